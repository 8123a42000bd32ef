#!/usr/bin/env python
"""Training-loop stall of an asynchronous save: ucp_jax.save_async against Orbax's async save.

One state for both: `--arrays` float32 arrays, `--size-mb` MiB in all (default 8 x 4096x4096
= 512 MiB) on 8 CPU devices, sharded P('x', None). A round, as a training loop does it:
start the asynchronous save (timed: the stall, what the loop waits for), run one jitted step
that donates the state (timed), then wait for the save to commit (timed: the flush). Both
contenders are durable (ucp_jax `durable=True`; Orbax syncs its files), and each saved
checkpoint is read back and must hold the values from before the step.

Contenders, each in its own subprocess, `--rounds` rounds of `--repeat` saves:
  ucp    ucp_jax.save_async(path, state) ... handle.result()
  orbax  ocp.StandardCheckpointer() (an AsyncCheckpointer): .save(path, state) ...
         .wait_until_finished()

Reported: median and range of the stall, the step, the flush and their total, and the
stall as a share of a blocking durable save (`ucp_jax.save`, timed in the ucp worker).

Usage:
  python scripts/bench_async.py                        # 512 MiB, 5 saves per contender
  python scripts/bench_async.py --size-mb 128 --repeat 3 --rounds 2 --json out.json
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import time

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as bu  # noqa: E402

CONTENDERS = ("ucp", "orbax")
PHASES = ("stall", "step", "flush", "total", "blocking_save")


def worker(args) -> int:
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((8,), ("x",))
  side = max(8, int(math.sqrt(args.size_mb * bu.MiB / 4 / args.arrays)) // 8 * 8)
  sharding = NamedSharding(mesh, P("x", None))
  rng = np.random.default_rng(0)
  state = {
    f"w{i}": jax.device_put(rng.random((side, side), dtype=np.float32), sharding)
    for i in range(args.arrays)
  }
  step = jax.jit(lambda s: jax.tree.map(lambda a: a * 0.5 + 1.0, s), donate_argnums=0)
  state = jax.block_until_ready(step(state))  # compiled before timing
  root = os.path.join(args.dir, args.worker)
  os.makedirs(root, exist_ok=True)
  out = {"name": args.worker, "phases": {p: [] for p in PHASES}, "errors": []}

  if args.worker == "ucp":
    import ucp_jax

    def start(path, tree):
      return ucp_jax.save_async(path, tree)

    def finish(handle):
      handle.result()

    def read(path):
      return ucp_jax.restore(path)

  else:
    import orbax.checkpoint as ocp
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
    ckptr = ocp.StandardCheckpointer()

    def start(path, tree):
      ckptr.save(path, tree)
      return None

    def finish(_):
      ckptr.wait_until_finished()

    def read(path):
      abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in state.items()
      }
      return ckptr.restore(path, abstract)

  for i in range(args.repeat):
    os.sync()
    before = {k: np.asarray(v).copy() for k, v in state.items()}
    path = os.path.join(root, f"ckpt_{i}")
    t0 = time.perf_counter()
    handle = start(path, state)
    t1 = time.perf_counter()
    state = jax.block_until_ready(step(state))
    t2 = time.perf_counter()
    finish(handle)
    t3 = time.perf_counter()
    for name, seconds in (
      ("stall", t1 - t0),
      ("step", t2 - t1),
      ("flush", t3 - t2),
      ("total", t3 - t0),
    ):
      out["phases"][name].append(seconds)
    saved = read(path)
    if any(not np.array_equal(np.asarray(saved[k]), before[k]) for k in before):
      out["errors"].append(f"save {i}: the checkpoint does not hold the values before the step")
    del saved
    shutil.rmtree(path, ignore_errors=True)
  if args.worker == "ucp":
    import ucp_jax

    for i in range(args.repeat):
      os.sync()
      path = os.path.join(root, f"blocking_{i}")
      t0 = time.perf_counter()
      ucp_jax.save(path, state)
      out["phases"]["blocking_save"].append(time.perf_counter() - t0)
      shutil.rmtree(path, ignore_errors=True)
  else:
    ckptr.close()
  bu.write_result(args.result_file, out)
  return 0


def _run_rounds(args) -> dict:
  """Every contender's phases (seconds of each try) and errors, over `args.rounds` workers each."""
  common = [
    "--size-mb",
    str(args.size_mb),
    "--arrays",
    str(args.arrays),
    "--repeat",
    str(args.repeat),
    "--dir",
    args.dir,
  ]
  results = {name: {p: [] for p in PHASES} | {"errors": []} for name in CONTENDERS}
  for name, run in bu.worker_rounds(os.path.abspath(__file__), CONTENDERS, common, args.rounds):
    if "error" in run:
      results[name]["errors"].append(run["error"])
      continue
    for phase in PHASES:
      results[name][phase] += run["phases"][phase]
    results[name]["errors"] += run["errors"]
  return results


def main(argv=None) -> int:
  ap = bu.worker_parser(__doc__)
  ap.add_argument("--size-mb", type=float, default=512)
  ap.add_argument("--arrays", type=int, default=8)
  bu.add_round_args(ap, repeat=5, rounds=1)
  args = ap.parse_args(argv)
  if args.worker:
    return worker(args)
  with bu.work_dir(args, "ucp_bench_async_"):
    results = _run_rounds(args)
  rows = []
  for name in CONTENDERS:
    for phase in PHASES:
      tries = results[name][phase]
      if tries:
        rows.append(
          [
            name,
            phase,
            f"{statistics.median(tries):.3f}",
            f"{min(tries):.3f}-{max(tries):.3f} ({len(tries)})",
          ]
        )
  print()
  print(
    f"{args.arrays} arrays, {args.size_mb:.0f} MiB on 8 CPU devices; durable saves; a donating step after each"
  )
  print(bu.table(["contender", "phase", "median s", "range s (tries)"], rows, align="llrr"))
  summary = {"results": results}
  ucp, orbax = results["ucp"], results["orbax"]
  if ucp["stall"] and orbax["stall"] and ucp["blocking_save"]:
    summary["stall_vs_orbax"] = statistics.median(ucp["stall"]) / statistics.median(orbax["stall"])
    summary["stall_share_of_blocking_save"] = statistics.median(ucp["stall"]) / statistics.median(
      ucp["blocking_save"]
    )
    summary["total_vs_orbax"] = statistics.median(ucp["total"]) / statistics.median(orbax["total"])
    print(
      f"ucp stall / orbax stall: {summary['stall_vs_orbax']:.2f}; ucp stall / blocking durable "
      f"save: {summary['stall_share_of_blocking_save']:.1%}; ucp total / orbax total: "
      f"{summary['total_vs_orbax']:.2f}"
    )
  for name in CONTENDERS:
    for e in results[name]["errors"]:
      print(f"ERROR {name}: {e}")
  if args.json:
    bu.write_result(args.json, summary)
  return 1 if any(results[n]["errors"] for n in CONTENDERS) else 0


if __name__ == "__main__":
  sys.exit(main())
