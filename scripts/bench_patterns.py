#!/usr/bin/env python
"""Tensor-parallel DeepSpeed checkpoint -> universal: `ucp_jax.convert` vs `ds_to_universal`.

Generates once (cached under `--dir`) a DeepSpeed AutoTP checkpoint at TP=2 x DP=2 (4 gloo
ranks on CPU, ZeRO-1, fp32, one training step) of the Llama-like model of
`scripts/make_tp_fixtures.py` scaled up (about 68M parameters by default: fused GQA QKV,
fused SwiGLU, row-parallel projections, a column-parallel vocabulary head). Then, in one run,
each contender converts it in its own subprocess (`scripts/bench_convert.py` measures: wall
time of the whole command, imports and conversion as the process timed them, peak RSS and
PSS of the process tree sampled every 10 ms, page cache warm for both):

  ucp        ucp_jax.convert(ckpt, out)          TP shards merged by pattern, ZeRO fragments cut
  deepspeed  python -m deepspeed.checkpoint.ds_to_universal (4 extract, 2 merge workers)

Targets: >= 10x faster, peak memory <= half. Afterwards every fp32/exp_avg/exp_avg_sq array
is compared bit for bit with DeepSpeed's output (`--no-check` skips).

Usage:
  python scripts/bench_patterns.py [--dir /tmp/ucp_bench_patterns] [--repeat 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_convert as bc
from _ds_launch import generate_checkpoint

DIMS = {"vocab": 16384, "dim": 1024, "heads": 16, "kv_heads": 4, "head_dim": 64, "ffn": 2816}


def _rank_worker(ckpt: str, layers: int) -> None:
  import make_tp_fixtures as mk

  torch, deepspeed = mk._setup()
  torch.manual_seed(0)
  model = mk.build_llama_like(**DIMS, layers=layers)
  config = mk.ds_config("autotp_tp2_dp2")
  specs = mk.autotp_layer_specs(DIMS["heads"], DIMS["kv_heads"], DIMS["head_dim"])
  config["tensor_parallel"]["partition_config"]["layer_specs"] = specs
  engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
  from deepspeed.utils import groups

  ids, targets = mk.batch(groups._get_data_parallel_rank(), DIMS["vocab"])
  logits = engine(ids)
  loss = torch.nn.functional.cross_entropy(logits.reshape(-1, DIMS["vocab"]), targets.ravel())
  engine.backward(loss)
  engine.step()
  engine.save_checkpoint(ckpt)


def generate(ckpt: str, layers: int) -> None:
  generate_checkpoint(
    ckpt, 4,
    lambda tmp: [sys.executable, __file__, "--rank-worker", "--dir", tmp, "--layers", str(layers)],
    what="AutoTP checkpoint",
  )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--dir", default="/tmp/ucp_bench_patterns", help="cache and output folder")
  parser.add_argument("--layers", type=int, default=3, help="layers (default 3: 68M params)")
  parser.add_argument("--repeat", type=int, default=1, help="tries per contender; best is shown")
  parser.add_argument("--json", help="also write the results here")
  parser.add_argument("--no-check", action="store_true", help="skip the bit-for-bit comparison")
  parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.rank_worker:
    _rank_worker(args.dir, args.layers)
    return 0

  ckpt = os.path.join(args.dir, f"autotp_tp2_dp2_l{args.layers}")
  if not os.path.isfile(os.path.join(ckpt, "latest")):
    print(f"generating {ckpt} with DeepSpeed AutoTP (4 ranks, CPU) ...", flush=True)
    t0 = time.perf_counter()
    generate(ckpt, args.layers)
    print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
  with open(os.path.join(ckpt, "latest")) as f:
    tag_dir = os.path.join(ckpt, f.read().strip())
  what = "AutoTP tp 2 x dp 2, ZeRO-1 fp32"
  return bc.compare(
    tag_dir, args.dir, what=what, repeat=args.repeat, json_path=args.json, verify=not args.no_check
  )


if __name__ == "__main__":
  sys.exit(main())
