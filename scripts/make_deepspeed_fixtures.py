#!/usr/bin/env python
"""Generate small, real DeepSpeed checkpoints (and their universal conversions) as test fixtures.

Each fixture trains a tiny model for a few steps with real DeepSpeed on CPU (gloo backend,
``DS_ACCELERATOR=cpu``), saves a checkpoint, and converts it with DeepSpeed's own
``deepspeed.checkpoint.ds_to_universal``. Output, per fixture::

  <out>/<name>/ckpt/          DeepSpeed's checkpoint directory (``latest`` + ``global_step<N>/``)
  <out>/<name>/universal/     ds_to_universal output for ``ckpt/global_step<N>``
  <out>/<name>/latest_universal   written by ds_to_universal; holds the tag ``universal``
  <out>/<name>/info.json      config, stage, dtype, dp, parameter table, losses, step count

The recovery scripts DeepSpeed copies into every checkpoint (``zero_to_fp32.py``,
``zero_to_torch.py``) are deleted to keep the fixtures small; ``info.json`` lists them.

Usage::

  python scripts/make_deepspeed_fixtures.py                 # all fixtures
  python scripts/make_deepspeed_fixtures.py --only z2_bf16_dp3 --only z3_fp32_dp2
  python scripts/make_deepspeed_fixtures.py --list

Ranks are spawned as plain processes (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
``MASTER_PORT``), one fixture at a time. Needs torch==2.13.0 and deepspeed==0.19.8 (see
docs/deepspeed_on_cpu.md). Regenerating gives byte-identical .pt files (fixed seeds,
deterministic data, one thread per rank, uninitialized memory filled with NaN); about 3 minutes
on 2 cores. docs/deepspeed_layouts.md describes what the files contain.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ds_launch import (
  dir_size,
  ds_to_universal,
  init_rank,
  install_fixture,
  launch_ranks,
  token_batch,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

SEED = 1234
VOCAB = 37
DIM = 12
HIDDEN = 19
SEQ = 5
MICRO_BATCH = 2
STEPS = 3
LR = (1e-2, 5e-3)
WEIGHT_DECAY = (0.1, 0.0)
BETAS = (0.9, 0.99)
EPS = 1e-8
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")

# name -> (zero stage, bf16, dp degree, extra config merged into the DeepSpeed config)
FIXTURES: dict[str, tuple[int, bool, int, dict[str, Any]]] = {
  "z1_fp32_dp2": (1, False, 2, {}),
  "z1_bf16_dp2": (1, True, 2, {}),
  "z2_fp32_dp2": (2, False, 2, {}),
  "z2_fp32_dp3": (2, False, 3, {}),
  "z2_bf16_dp3": (2, True, 3, {}),
  # Tiny params are all below the default stage3_param_persistence_threshold (1e5): persistent.
  "z3_fp32_dp2": (3, False, 2, {"zero_optimization": {"sub_group_size": 100}}),
  # Threshold 0: every param is released after use, as large params are in real models.
  "z3_bf16_dp3": (
    3,
    True,
    3,
    {"zero_optimization": {"sub_group_size": 100, "stage3_param_persistence_threshold": 0}},
  ),
  # zero_optimization.parameter_alignment pads every param but the group's last to 16 bytes.
  "z2_bf16_palign_dp2": (2, True, 2, {"zero_optimization": {"parameter_alignment": True}}),
  # bf16 + fp32 gradient accumulation + stage 1 selects deepspeed's BF16_Optimizer.
  "bf16opt_dp2": (1, True, 2, {"data_types": {"grad_accum_dtype": "fp32"}}),
}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
  """Recursively merges ``extra`` into a copy of ``base``."""
  out = dict(base)
  for key, value in extra.items():
    if isinstance(value, dict) and isinstance(out.get(key), dict):
      out[key] = _merge(out[key], value)
    else:
      out[key] = value
  return out


def ds_config(name: str) -> dict[str, Any]:
  """Returns the DeepSpeed config of fixture ``name``."""
  stage, bf16, _, extra = FIXTURES[name]
  base: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1_000_000,
    "optimizer": {
      "type": "AdamW",
      "params": {
        "torch_adam": True,
        "lr": LR[0],
        "betas": list(BETAS),
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY[0],
      },
    },
    "zero_optimization": {"stage": stage},
    "bf16": {"enabled": bf16},
  }
  return _merge(base, extra)


# --------------------------------------------------------------------------------------------
# Worker (one per rank)
# --------------------------------------------------------------------------------------------


def _build_model():
  """Builds the tiny model (torch is imported lazily so ``--list`` needs no torch)."""
  import torch
  from torch import nn

  class Tiny(nn.Module):
    """Embedding tied to the output head, two odd-sized Linears, LayerNorm, frozen param, buffer."""

    def __init__(self) -> None:
      super().__init__()
      self.embed = nn.Embedding(VOCAB, DIM)
      self.fc1 = nn.Linear(DIM, HIDDEN)
      self.ln = nn.LayerNorm(HIDDEN)
      self.fc2 = nn.Linear(HIDDEN, DIM)
      self.head = nn.Linear(DIM, VOCAB, bias=False)
      self.head.weight = self.embed.weight  # tied: state_dict has both names, one parameter
      self.gate = nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN), requires_grad=False)  # frozen
      self.register_buffer("scale", torch.linspace(0.9, 1.1, DIM))  # persistent buffer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
      h = self.embed(ids)
      h = h * self.scale.to(h.dtype)  # bf16 engines cast params only; the buffer stays fp32
      h = self.fc1(h) * self.gate
      h = self.ln(torch.nn.functional.gelu(h))
      h = self.fc2(h)
      return self.head(h)

  return Tiny()


def _batch(rank: int, step: int):
  """Deterministic token batch for ``rank`` at ``step``: (inputs, next-token targets)."""
  return token_batch(SEED + 1000 * step + rank, VOCAB, MICRO_BATCH, SEQ)


def worker(name: str, ckpt_dir: str, info_path: str) -> None:
  """Trains ``STEPS`` steps on this rank, saves the checkpoint; rank 0 writes partial info."""
  # DeepSpeed leaves some padding (ZeRO-3's last-rank partition tails) as torch.empty memory;
  # filling such memory with NaN makes files regenerate byte-identical (and stale padding shows).
  torch, deepspeed = init_rank(deterministic=True, fill_uninitialized=True)
  import deepspeed.comm as dist

  torch.manual_seed(SEED)
  model = _build_model()
  param_names = {id(p): n for n, p in model.named_parameters()}
  all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
  trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
  decay = [p for n, p in trainable if n.endswith("weight") and p.dim() >= 2]
  no_decay = [p for n, p in trainable if not (n.endswith("weight") and p.dim() >= 2)]
  groups = [
    {"params": decay, "lr": LR[0], "weight_decay": WEIGHT_DECAY[0]},
    {"params": no_decay, "lr": LR[1], "weight_decay": WEIGHT_DECAY[1]},
  ]
  group_names = [[param_names[id(p)] for p in g["params"]] for g in groups]
  params_table = {
    n: {"shape": list(p.shape), "numel": p.numel(), "requires_grad": p.requires_grad}
    for n, p in model.named_parameters()
  }
  state_dict_keys = list(model.state_dict())

  config = ds_config(name)
  engine, optimizer, _, _ = deepspeed.initialize(
    model=model, model_parameters=groups, config=config
  )
  rank = dist.get_rank()
  world = dist.get_world_size()

  losses: list[float] = []
  rank_losses: list[list[float]] = []
  for step in range(STEPS):
    ids, targets = _batch(rank, step)
    logits = engine(ids)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
    engine.backward(loss)
    engine.step()
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, loss.detach().float().reshape(1))
    per_rank = [float(t.item()) for t in gathered]
    rank_losses.append(per_rank)
    losses.append(sum(per_rank) / world)

  engine.save_checkpoint(ckpt_dir, client_state={"universal_checkpoint_info": {}})

  if rank == 0:
    info = {
      "name": name,
      "deepspeed_version": deepspeed.__version__,
      "torch_version": torch.__version__.split("+")[0],
      "config": config,
      "zero_stage": FIXTURES[name][0],
      "dtype": "bfloat16" if FIXTURES[name][1] else "float32",
      "dp": world,
      "optimizer_class": type(optimizer).__name__,
      "base_optimizer_class": type(engine.basic_optimizer).__name__,
      "tag": f"global_step{engine.global_steps}",
      "steps": engine.global_steps,
      "seed": SEED,
      "micro_batch": MICRO_BATCH,
      "seq_len": SEQ,
      "params": params_table,
      "state_dict_keys": state_dict_keys,
      "param_groups": [
        {"names": names, "lr": g["lr"], "weight_decay": g["weight_decay"]}
        for names, g in zip(group_names, groups)
      ],
      "adam": {"betas": list(BETAS), "eps": EPS},
      "frozen": [n for n, p in model.named_parameters() if not p.requires_grad],
      "tied": {"head.weight": "embed.weight"},
      "buffers": {n: str(b.dtype).removeprefix("torch.") for n, b in engine.module.named_buffers()},
      "all_param_names": sorted(all_names),
      "losses": losses,
      "rank_losses": rank_losses,
    }
    with open(info_path, "w") as f:
      json.dump(info, f, indent=2)
  dist.barrier()


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def make_fixture(name: str, out: Path, timeout: float = 600.0) -> dict[str, Any]:
  """Generates fixture ``name`` under ``out/name`` (replacing it). Returns a summary dict."""
  _, _, dp, _ = FIXTURES[name]
  dest = out / name
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix=f"dsfix_{name}_") as tmp:
    tmp_path = Path(tmp)
    ckpt = tmp_path / "ckpt"
    info_path = tmp_path / "info.json"
    cmd = [
      sys.executable,
      __file__,
      "--worker",
      name,
      "--ckpt",
      str(ckpt),
      "--info",
      str(info_path),
    ]
    launch_ranks(dp, cmd, tmp_path, what=name, timeout=timeout)
    t_train = time.perf_counter() - t0

    info = json.loads(info_path.read_text())
    tag = info["tag"]
    for script in RECOVERY_SCRIPTS:
      (ckpt / script).unlink(missing_ok=True)
    universal = tmp_path / "universal"
    t1 = time.perf_counter()
    ds_to_universal(ckpt / tag, universal)
    t_convert = time.perf_counter() - t1

    info["ds_to_universal"] = {
      "command": "python -m deepspeed.checkpoint.ds_to_universal --input_folder ckpt/"
      f"{tag} --output_folder universal --num_extract_workers 1 --num_merge_workers 1",
    }
    info["universal_tag"] = "universal"
    info["removed_from_ckpt"] = list(RECOVERY_SCRIPTS)
    info["files"] = {
      "ckpt": sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()),
      "universal": sorted(
        str(p.relative_to(universal)) for p in universal.rglob("*") if p.is_file()
      ),
    }
    (tmp_path / "info.json").write_text(json.dumps(info, indent=2) + "\n")

    install_fixture(dest, ckpt, universal)
    shutil.copy(tmp_path / "info.json", dest / "info.json")
  return {
    "name": name,
    "optimizer": info["optimizer_class"],
    "bytes": dir_size(dest),
    "train_s": round(t_train, 1),
    "convert_s": round(t_convert, 1),
    "losses": info["losses"],
  }


def main(argv: list[str] | None = None) -> int:
  """Command-line entry point."""
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--out",
    type=Path,
    help="output folder (the committed fixtures: tests/fixtures/deepspeed)",
  )
  parser.add_argument(
    "--only", action="append", choices=sorted(FIXTURES), help="fixture to make (repeatable)"
  )
  parser.add_argument("--list", action="store_true", help="list fixture names and exit")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--ckpt", help=argparse.SUPPRESS)
  parser.add_argument("--info", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)

  if args.worker:
    worker(args.worker, args.ckpt, args.info)
    return 0
  if args.list:
    for name, (stage, bf16, dp, _) in FIXTURES.items():
      print(f"{name}: stage={stage} dtype={'bf16' if bf16 else 'fp32'} dp={dp}")
    return 0

  names = args.only or list(FIXTURES)
  if args.out is None:
    parser.error(
      "--out is required to make the fixtures (tests/fixtures/deepspeed: the committed ones)"
    )
  failed = []
  t0 = time.perf_counter()
  for name in names:
    try:
      s = make_fixture(name, args.out)
    except Exception as e:  # report it and go on with the next fixture
      failed.append(name)
      print(f"FAILED {name}: {e}", flush=True)
      continue
    print(
      f"{s['name']:<14} {s['optimizer']:<24} {s['bytes'] / 1024:7.1f} KiB  "
      f"train+save {s['train_s']:5.1f}s  convert {s['convert_s']:4.1f}s  "
      f"losses {', '.join(f'{x:.4f}' for x in s['losses'])}",
      flush=True,
    )
  total = dir_size(args.out) if args.out.exists() else 0
  print(f"total {total / 1024:.1f} KiB in {args.out} ({time.perf_counter() - t0:.0f}s)")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
