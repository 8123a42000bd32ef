#!/usr/bin/env python
"""A large ZeRO-3 checkpoint converted by 1, 2 and 4 processes, and by `ds_to_universal`.

Generates once (cached under `--dir`) a synthetic DeepSpeed ZeRO-3 checkpoint of `--gib`
GiB at dp `--dp` (scripts/make_zero3_checkpoint.py: DeepSpeed's exact file layout, checked
against DeepSpeed's readers in tests/test_zero3_generator.py). Then, in interleaved
rounds, each contender converts it in its own process tree, timed as
scripts/bench_convert.py does (page cache warm, output durable for all, peak memory
sampled from /proc):

  ucp xN       `ucp convert SRC DST --processes N` (N processes, each a share)
  ds w E/M     DeepSpeed's `ds_to_universal --num_extract_workers E --num_merge_workers M`

With `--url`, the same checkpoint read as an object store holds it, by byte ranges through a
TensorStore kvstore (a `file://` URL takes the path `gs://` and `s3://` take), against the
status quo for a checkpoint in a bucket, downloading it whole first:

  ucp url xN   `ucp convert file://SRC DST --processes N`
  copy+ucp x1  `cp -r SRC LOCAL && ucp convert LOCAL DST` (the copy stands in for a download)

Reported: median and spread of wall time over the rounds, throughput, scaling efficiency
(time with 1 process / (N x time with N)), the peak RSS of the largest single process and
of the whole tree. The physical bound beside them: the source read from the page cache
and the output written and fsynced by `dd`-like numpy writes of the same bytes.

Usage:
  python scripts/bench_parallel_convert.py --gib 8 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as bu
import bench_convert as bc
import make_zero3_checkpoint as z3


def _ucp(src: str, out: str, processes: int) -> list[str]:
  return [sys.executable, "-m", "ucp_jax.cli", "convert", src, out, "--processes", str(processes)]


def _ds(tag_dir: str, out: str, extract: int, merge: int) -> list[str]:
  argv = ["ds_to_universal", "--input_folder", tag_dir, "--output_folder", out]
  argv += ["--num_extract_workers", str(extract), "--num_merge_workers", str(merge)]
  call = f"sys.argv = {argv!r}; m.main(m.parse_arguments()); _sync({out!r})"
  code = bc._TIMED.format(
    imports="from deepspeed.checkpoint import ds_to_universal as m", call=call
  )
  return [sys.executable, "-c", code]


def _bound(src_bytes: int, root: str) -> float:
  """Seconds to write and fsync `src_bytes` in 64 MiB files (the disk's share of any converter)."""
  import numpy as np

  folder = os.path.join(root, "bound")
  shutil.rmtree(folder, ignore_errors=True)
  os.makedirs(folder)
  block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
  t0 = time.perf_counter()
  for i in range(max(1, src_bytes // block.nbytes)):
    with open(os.path.join(folder, str(i)), "wb") as f:
      f.write(block)
      os.fsync(f.fileno())
  seconds = time.perf_counter() - t0
  shutil.rmtree(folder)
  return seconds


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default="/tmp/ucp_bench_parallel", help="cache and output folder")
  parser.add_argument("--gib", type=float, default=8.0, help="checkpoint size (default 8)")
  parser.add_argument("--dp", type=int, default=4, help="data-parallel ranks (default 4)")
  parser.add_argument("--processes", default="1,2,4", help="ucp process counts (default 1,2,4)")
  parser.add_argument(
    "--ds-workers", default="4/2,1/1", help="ds_to_universal extract/merge workers ('' skips)"
  )
  parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
  parser.add_argument("--url", action="store_true", help="also read SRC through file:// URLs")
  args = parser.parse_args()
  src = os.path.join(args.dir, f"z3_{args.gib:g}gib_dp{args.dp}")
  if not os.path.isfile(os.path.join(src, "latest")):
    print(f"generating {src} ...", flush=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    shapes = z3.model(4096, z3.layers_for(args.gib, 4096))
    z3.generate(src, shapes, args.dp)
  tag_dir = os.path.join(src, z3.TAG)
  src_bytes = sum(os.path.getsize(os.path.join(tag_dir, n)) for n in os.listdir(tag_dir))
  contenders = {f"ucp x{n}": _ucp(src, "{out}", int(n)) for n in args.processes.split(",")}
  if args.url:
    for n in args.processes.split(","):
      contenders[f"ucp url x{n}"] = _ucp(f"file://{src}", "{out}", int(n))
    local = os.path.join(args.dir, "copied")
    convert = " ".join(_ucp(local, "{out}", 1))
    contenders["copy+ucp x1"] = ["bash", "-c", f"cp -r {src} {local} && {convert}; rm -rf {local}"]
  for workers in filter(None, args.ds_workers.split(",")):
    e, m = workers.split("/")
    contenders[f"ds w {e}/{m}"] = _ds(tag_dir, "{out}", int(e), int(m))
  env = dict(os.environ, DS_ACCELERATOR="cpu", JAX_PLATFORMS="cpu")
  runs: dict[str, list[dict]] = {name: [] for name in contenders}
  bounds = []
  for round_ in range(args.rounds):
    for name, cmd in contenders.items():
      out = os.path.join(args.dir, "out")
      shutil.rmtree(out, ignore_errors=True)
      bc._warm(tag_dir)
      os.sync()
      time.sleep(2)
      result = bc.run([c.replace("{out}", out) for c in cmd], env)
      runs[name].append(result)
      print(f"round {round_ + 1} {name}: {result['seconds']:.1f} s", flush=True)
    shutil.rmtree(os.path.join(args.dir, "out"), ignore_errors=True)
    os.sync()
    bounds.append(_bound(src_bytes, args.dir))
  one = statistics.median(r["seconds"] for r in runs[next(iter(runs))])
  rows = []
  for name, results in runs.items():
    times = [r["seconds"] for r in results]
    median = statistics.median(times)
    n = int(name.split("x")[1]) if name.startswith("ucp x") else None
    rows.append(
      [
        name,
        f"{median:.1f}",
        f"{min(times):.1f}-{max(times):.1f}",
        f"{src_bytes / median / 2**30:.2f}",
        f"{one / (n * median):.0%}" if n else "-",
        bu.mib(max(r["process_rss"] for r in results)),
        bu.mib(max(r["tree_rss"] for r in results)),
      ]
    )
  print()
  print(
    f"source: {tag_dir}, {src_bytes / 2**30:.2f} GiB, dp {args.dp}; {args.rounds} interleaved "
    f"rounds on {os.cpu_count()} cores"
  )
  headers = ["converter", "median s", "range s", "GiB/s", "scaling", "peak RSS 1 proc MiB"]
  print(bu.table([*headers, "peak RSS tree MiB"], rows))
  bound = statistics.median(bounds)
  print(
    f"bound: writing and fsyncing {src_bytes / 2**30:.2f} GiB takes {bound:.1f} s "
    f"({src_bytes / bound / 2**30:.2f} GiB/s, median of {len(bounds)})"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
