#!/usr/bin/env python
"""A synthetic DeepSpeed ZeRO-3 checkpoint of any size, in DeepSpeed's exact layout.

Training a multi-GiB model with real DeepSpeed on two CPU cores takes hours, so this
writes the files DeepSpeed would: every file is a copy of a real ZeRO-3 checkpoint's
(tests/fixtures/deepspeed/z3_fp32_dp2, written by DeepSpeed 0.19.8), the same keys and
the same pickled DeepSpeed objects, with the model replaced. The model is `--layers`
blocks of a (dim, dim) weight and a (dim + 1,) bias (whose partitions end in padding),
one AdamW group, one sub-group; each rank holds `ceil(numel / dp)` elements of every
parameter, concatenated (docs/deepspeed_layouts.md §5). Values are a cheap hash of
(parameter, slot, element), so any slice is computed without the rest: `expected` gives
the truth for checks. tests/test_zero3_generator.py checks a small instance against
DeepSpeed's own readers (`zero_to_fp32` and `ds_to_universal`).

Usage:
  python scripts/make_zero3_checkpoint.py OUT --gib 8 --dp 4
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time
from collections import OrderedDict

import numpy as np

TEMPLATE = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  "tests/fixtures/deepspeed/z3_fp32_dp2/ckpt/global_step3",
)
TAG = "global_step3"
SLOTS = ("fp32", "exp_avg", "exp_avg_sq")


def model(dim: int, layers: int) -> OrderedDict:
  """Parameter names and shapes, in the order DeepSpeed lists them."""
  shapes = OrderedDict()
  for i in range(layers):
    shapes[f"blocks.{i}.weight"] = (dim, dim)
    shapes[f"blocks.{i}.bias"] = (dim + 1,)
  return shapes


def values(param: int, slot: int, start: int, stop: int) -> np.ndarray:
  """Elements [start, stop) of parameter number `param`'s `SLOTS[slot]`, flattened."""
  i = np.arange(start, stop, dtype=np.uint64)
  h = (i * np.uint64(2654435761) + np.uint64(param * 7919 + slot * 104729)) & np.uint64(0xFFFFFF)
  x = h.astype(np.float32) / np.float32(1 << 24) - np.float32(0.5)
  return x * x if SLOTS[slot] == "exp_avg_sq" else x


def expected(shapes: OrderedDict, name: str, slot: str) -> np.ndarray:
  """The full value of `name`'s `slot` ("fp32", "exp_avg" or "exp_avg_sq")."""
  number = list(shapes).index(name)
  shape = shapes[name]
  return values(number, SLOTS.index(slot), 0, math.prod(shape)).reshape(shape)


def _rank_flat(shapes: OrderedDict, slot: int, rank: int, dp: int):
  """One rank's flat partition of every parameter, concatenated (padded with zeros)."""
  import torch

  sizes = [math.ceil(math.prod(s) / dp) for s in shapes.values()]
  flat = np.zeros(sum(sizes), dtype=np.float32)
  at = 0
  for number, (shape, pn) in enumerate(zip(shapes.values(), sizes)):
    numel = math.prod(shape)
    start, stop = min(rank * pn, numel), min((rank + 1) * pn, numel)
    flat[at : at + stop - start] = values(number, slot, start, stop)
    at += pn
  return torch.from_numpy(flat)


def generate(out: str, shapes: OrderedDict, dp: int, *, log=print) -> int:
  """Writes the checkpoint folder `out` (with `latest`); returns the bytes written."""
  import torch

  models = torch.load(
    os.path.join(TEMPLATE, "zero_pp_rank_0_mp_rank_00_model_states.pt"), weights_only=False
  )
  optim = torch.load(
    os.path.join(TEMPLATE, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), weights_only=False
  )
  tag_dir = os.path.join(out, TAG)
  os.makedirs(tag_dir, exist_ok=True)
  ds_config = copy.deepcopy(models["ds_config"])
  ds_config["zero_optimization"]["sub_group_size"] = 10**9  # DeepSpeed's default: one sub-group
  total = 0
  for rank in range(dp):
    m = copy.copy(models)
    m.update(
      module=OrderedDict((name, torch.empty(0)) for name in shapes),  # ZeRO-3: partitioned away
      buffer_names=[],
      param_shapes=[OrderedDict((name, torch.Size(s)) for name, s in shapes.items())],
      frozen_param_shapes=OrderedDict(),
      shared_params={},
      frozen_param_fragments=OrderedDict(),
      dp_world_size=dp,
      ds_config=ds_config,
    )
    path = os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    torch.save(m, path)
    total += os.path.getsize(path)
    t0 = time.perf_counter()
    o = copy.copy(optim)
    osd = copy.copy(optim["optimizer_state_dict"])
    inner = osd["optimizer_state_dict"]
    group = dict(inner["param_groups"][0], params=[0])
    step = inner["state"][0]["step"]
    osd.update(
      partition_count=dp,
      fp32_flat_groups=[_rank_flat(shapes, 0, rank, dp)],
      optimizer_state_dict={
        "state": {
          0: {
            "step": step,
            "exp_avg": _rank_flat(shapes, 1, rank, dp),
            "exp_avg_sq": _rank_flat(shapes, 2, rank, dp),
          }
        },
        "param_groups": [group],
      },
    )
    o.update(optimizer_state_dict=osd, ds_config=ds_config)
    path = os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    torch.save(o, path)
    del o, osd
    total += os.path.getsize(path)
    log(
      f"  rank {rank}: {os.path.getsize(path) / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s"
    )
  with open(os.path.join(out, "latest"), "w") as f:
    f.write(TAG)
  return total


def layers_for(gib: float, dim: int) -> int:
  """Blocks of width `dim` for about `gib` GiB of fp32 values and two moments."""
  return max(1, round(gib * 2**30 / (12 * (dim * dim + dim + 1))))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out", help="the checkpoint folder to write")
  parser.add_argument("--gib", type=float, default=8.0, help="checkpoint size (default 8)")
  parser.add_argument("--dim", type=int, default=4096, help="block width (default 4096)")
  parser.add_argument("--dp", type=int, default=4, help="data-parallel ranks (default 4)")
  args = parser.parse_args()
  os.environ.setdefault("DS_ACCELERATOR", "cpu")
  shapes = model(args.dim, layers_for(args.gib, args.dim))
  t0 = time.perf_counter()
  total = generate(args.out, shapes, args.dp)
  params = sum(math.prod(s) for s in shapes.values())
  print(
    f"{args.out}: {params / 1e6:.0f}M params, {len(shapes)} tensors, dp {args.dp}, "
    f"{total / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s"
  )


if __name__ == "__main__":
  main()
