#!/usr/bin/env python
"""Save and restore by 1, 2 and 4 JAX processes over the same 8 CPU devices.

Each run starts N processes (`jax.distributed` on 127.0.0.1, 8/N devices each). Every
process builds its own shards of the same state (`--arrays` float32 arrays, `--mib` MiB in
all, sharded over the 8 devices), then, timed between barriers: a durable `ucp_jax.save`
(each process writes its shards, process 0 commits), and a `restore` onto another mesh.
Runs are interleaved over `--rounds` rounds. Reported: median and range of the save and
restore wall times (the slowest process), aggregate and per-process throughput, the
efficiency against one process (aggregate throughput with N / with 1), and the CPU time the
restore took in all processes together (a chunk that feeds devices of several processes is
read and checksummed by each). Beside them the bound:
numpy writing and fsyncing the same bytes in 64 MiB files, and reading them back from the
page cache.

Usage:
  python scripts/bench_multiprocess.py --mib 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as bu


def worker(args) -> None:
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // args.processes}"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import ucp_jax

  if args.processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", args.processes, args.process_id)
  devices = np.array(jax.devices())
  flat, grid = Mesh(devices, ("x",)), Mesh(devices.reshape(2, 4), ("a", "b"))
  rows = args.mib * 2**20 // 4 // args.arrays // 1024
  source = NamedSharding(flat, P("x"))
  target = NamedSharding(grid, P("b", "a"))

  def make(i: int):
    return jax.make_array_from_callback(
      (rows, 1024), source, lambda index: np.full((rows, 1024), i, np.float32)[index]
    )

  state = {f"w{i}": make(i) for i in range(args.arrays)}
  jax.block_until_ready(state)
  wanted = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=target) for k, v in state.items()}
  path = os.path.join(args.dir, "ckpt")

  def barrier(name: str) -> None:
    if args.processes > 1:
      multihost_utils.sync_global_devices(name)

  barrier("start")
  t0 = time.perf_counter()
  ucp_jax.save(path, state, overwrite=True)
  t1 = time.perf_counter()
  barrier("saved")
  t2, cpu0 = time.perf_counter(), _cpu_seconds()
  restored = ucp_jax.restore(path, wanted)
  jax.block_until_ready(restored)
  t3, cpu1 = time.perf_counter(), _cpu_seconds()
  shard = restored["w3"].addressable_shards[0]
  assert np.all(np.asarray(shard.data) == 3), "restored the wrong values"
  barrier("done")
  result = {"save": t1 - t0, "restore": t3 - t2, "restore_cpu": cpu1 - cpu0}
  print("RESULT", json.dumps(result), flush=True)


def _cpu_seconds() -> float:
  """User + system CPU time of this process, all its threads."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def run(processes: int, args) -> dict:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [
    subprocess.Popen(
      [
        *[sys.executable, __file__, "--worker", "--processes", str(processes)],
        *["--process-id", str(i), "--port", str(port), "--dir", args.dir],
        *["--mib", str(args.mib), "--arrays", str(args.arrays)],
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(processes)
  ]
  results = []
  for proc in procs:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode:
      raise SystemExit(f"a worker failed:\n{out[-3000:]}")
    results.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
  slowest = {phase: max(r[phase] for r in results) for phase in ("save", "restore")}
  return {**slowest, "restore_cpu": sum(r["restore_cpu"] for r in results)}


def bound(nbytes: int, folder: str) -> tuple[float, float]:
  """(write + fsync, read back) seconds for `nbytes` in 64 MiB numpy files."""
  import numpy as np

  os.makedirs(folder, exist_ok=True)
  block = np.ones(64 << 20, np.uint8)
  n = max(1, nbytes // block.nbytes)
  t0 = time.perf_counter()
  for i in range(n):
    with open(os.path.join(folder, str(i)), "wb") as f:
      f.write(block)
      os.fsync(f.fileno())
  t1 = time.perf_counter()
  out = np.empty_like(block)
  for i in range(n):
    with open(os.path.join(folder, str(i)), "rb") as f:
      f.readinto(out)
  t2 = time.perf_counter()
  shutil.rmtree(folder)
  return t1 - t0, t2 - t1


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mib", type=int, default=1024, help="state size (default 1024)")
  parser.add_argument("--arrays", type=int, default=16, help="arrays in the state (default 16)")
  parser.add_argument("--counts", default="1,2,4", help="process counts (default 1,2,4)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
  parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args)
    return 0
  args.dir = args.dir or tempfile.mkdtemp(prefix="ucp_bench_mp_")
  counts = [int(c) for c in args.counts.split(",")]
  times: dict[int, list[dict]] = {n: [] for n in counts}
  bounds = []
  for round_ in range(args.rounds):
    for n in counts:
      times[n].append(run(n, args))
      print(f"round {round_ + 1}, {n} processes: {times[n][-1]}", flush=True)
    bounds.append(bound(args.mib << 20, os.path.join(args.dir, "bound")))
  nbytes = args.mib << 20
  rows = []
  base = {p: statistics.median(r[p] for r in times[counts[0]]) for p in ("save", "restore")}
  for n in counts:
    row = [str(n)]
    for phase in ("save", "restore"):
      values = [r[phase] for r in times[n]]
      median = statistics.median(values)
      row += [
        f"{median:.2f} ({min(values):.2f}-{max(values):.2f})",
        f"{nbytes / median / 2**30:.2f}",
        f"{nbytes / n / median / 2**30:.2f}",
        f"{base[phase] / median:.0%}",
      ]
    row.append(f"{statistics.median(r['restore_cpu'] for r in times[n]):.2f}")
    rows.append(row)
  print()
  print(
    f"{args.mib} MiB in {args.arrays} arrays over 8 CPU devices, durable saves, restore onto "
    f"another mesh; median (range) of {args.rounds} interleaved rounds on {os.cpu_count()} cores"
  )
  headers = ["processes", "save s", "GiB/s", "GiB/s/proc", "vs 1", "restore s", "GiB/s"]
  print(bu.table([*headers, "GiB/s/proc", "vs 1", "restore CPU s"], rows))
  write = statistics.median(b[0] for b in bounds)
  read = statistics.median(b[1] for b in bounds)
  print(
    f"bound: numpy write+fsync {nbytes / write / 2**30:.2f} GiB/s, read from the page cache "
    f"{nbytes / read / 2**30:.2f} GiB/s (one process, median of {len(bounds)})"
  )
  shutil.rmtree(args.dir, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
