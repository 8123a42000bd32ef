"""Shared helpers for the benchmark scripts in `scripts/`: memory, timing, workers, tables.

Nothing here imports jax, so a parent process can drive workers without touching devices.

Peak RSS per phase uses Linux's `/proc/self/clear_refs` ("5" resets the peak, `VmHWM` in
`/proc/self/status` then tracks the phase alone). Where that is not allowed the process-wide
`ru_maxrss` is used instead, and results say so (`peak_source`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

MiB = 1 << 20
GB = 1e9  # bandwidths are reported in GB/s (10^9 bytes per second)


# ---------------------------------------------------------------------------------------------
# Memory


def _status_kib(field: str) -> int | None:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    return None
  return None


def rss_bytes() -> int:
  """Current resident set size of this process."""
  kib = _status_kib("VmRSS")
  if kib is not None:
    return kib * 1024
  return ru_maxrss_bytes()


def ru_maxrss_bytes() -> int:
  """Peak RSS of this process over its whole life (getrusage)."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
  """Resets the peak-RSS watermark (VmHWM) to the current RSS; False where not possible."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def peak_rss_bytes(reset_ok: bool) -> int:
  """Peak RSS since the last successful `reset_peak_rss` (or since start, without one)."""
  if reset_ok:
    kib = _status_kib("VmHWM")
    if kib is not None:
      return kib * 1024
  return ru_maxrss_bytes()


def drop_caches() -> str | None:
  """Flushes dirty pages and drops the page cache (root only). Returns an error or None."""
  os.sync()
  try:
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")
  except OSError as e:
    return f"drop_caches failed: {e}"
  return None


# ---------------------------------------------------------------------------------------------
# Timing


def measure(
  fn: Callable[[], Any],
  *,
  repeat: int = 1,
  before: Callable[[], None] | None = None,
  after: Callable[[Any, int], None] | None = None,
  sync: bool = True,
) -> tuple[dict, Any]:
  """Runs `fn` `repeat` times; returns the best time, its peak RSS, and the last result.

  Each try starts after an untimed `os.sync()` (unless `sync=False`), so that writeback of
  earlier writes does not land in it. `before()` runs untimed before each try (cleanup,
  dropping caches); `after(result, i)` runs
  untimed after each try, after the peak RSS was read (verification, deleting outputs). The
  result of a try is released before the next one starts.
  """
  tries = []
  result = None
  for i in range(max(1, repeat)):
    result = None
    gc.collect()
    if sync:
      os.sync()  # no dirty pages left over from earlier phases or contenders
    if before is not None:
      before()
    reset_ok = reset_peak_rss()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes(reset_ok)
    tries.append(
      {
        "seconds": seconds,
        "rss_before": rss0,
        "peak_rss": peak,
        "peak_delta": max(0, peak - rss0),
        "peak_source": "VmHWM" if reset_ok else "ru_maxrss",
      }
    )
    if after is not None:
      after(result, i)
  best = min(tries, key=lambda t: t["seconds"])
  out = dict(best)
  out["tries"] = [t["seconds"] for t in tries]
  return out, result


# ---------------------------------------------------------------------------------------------
# Workers: the script re-invokes itself with `--worker NAME --result-file FILE`


def run_worker(
  script: str,
  name: str,
  argv: Sequence[str],
  *,
  env: dict | None = None,
  timeout: float | None = None,
) -> dict:
  """Runs `python script --worker name --result-file F *argv` and returns the JSON it wrote."""
  fd, result_file = tempfile.mkstemp(prefix=f"bench_{name}_", suffix=".json")
  os.close(fd)
  cmd = [sys.executable, script, "--worker", name, "--result-file", result_file, *argv]
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, env=env, timeout=timeout, check=False)
    with open(result_file) as f:
      text = f.read()
    if proc.returncode != 0 or not text:
      return {"name": name, "error": f"worker exited with status {proc.returncode}"}
    result = json.loads(text)
  except subprocess.TimeoutExpired:
    return {"name": name, "error": f"worker timed out after {timeout} s"}
  finally:
    with contextlib.suppress(OSError):
      os.remove(result_file)
  result["worker_seconds"] = time.perf_counter() - t0
  return result


def worker_parser(doc: str | None) -> argparse.ArgumentParser:
  """A benchmark's parser: `doc` as its description, and the hidden `--worker NAME
  --result-file FILE` with which the script runs itself as one contender (`run_worker`)."""
  ap = argparse.ArgumentParser(
    description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
  return ap


def add_round_args(ap: argparse.ArgumentParser, *, repeat: int, rounds: int) -> None:
  """Adds what every benchmark of interleaved worker rounds takes: `--repeat` (timed tries
  per worker), `--rounds` (`worker_rounds`), `--dir` (`work_dir`) and `--json` (the summary)."""
  ap.add_argument("--repeat", type=int, default=repeat)
  ap.add_argument("--rounds", type=int, default=rounds)
  ap.add_argument("--dir", default=None, help="working folder (a temp dir under /tmp)")
  ap.add_argument("--json", default=None)


@contextlib.contextmanager
def work_dir(args: argparse.Namespace, prefix: str) -> Iterator[str]:
  """`args.dir`; where none is given, a new folder under /tmp named with `prefix`, set as
  `args.dir` and removed afterwards."""
  made = args.dir is None
  args.dir = args.dir or tempfile.mkdtemp(prefix=prefix, dir="/tmp")
  try:
    yield args.dir
  finally:
    if made:
      shutil.rmtree(args.dir, ignore_errors=True)


def worker_rounds(
  script: str,
  names: Sequence[str],
  argv: Sequence[str],
  rounds: int,
  *,
  env: dict | None = None,
  rotate: bool = False,
) -> Iterator[tuple[str, dict]]:
  """Runs every contender `rounds` times as a worker of `script` (`run_worker`), the rounds
  interleaved so that the page cache's drift over the run favours nobody; with `rotate`,
  each round starts one contender later. Yields (name, what its worker returned)."""
  names = list(names)
  for rnd in range(rounds):
    order = names[rnd % len(names) :] + names[: rnd % len(names)] if rotate else names
    for name in order:
      print(f"running {name} (round {rnd + 1} of {rounds}) ...", flush=True)
      yield name, run_worker(script, name, argv, env=env)


def write_result(path: str, result: dict) -> None:
  with open(path, "w") as f:
    json.dump(result, f, indent=1, default=str)


# ---------------------------------------------------------------------------------------------
# Reporting


def gbps(nbytes: int, seconds: float | None) -> float | None:
  if not seconds:
    return None
  return nbytes / seconds / GB


def fmt(value: Any, spec: str = ".2f", missing: str = "-") -> str:
  if value is None:
    return missing
  if isinstance(value, str):
    return value
  return format(value, spec)


def mib(nbytes: int | None) -> str:
  return "-" if nbytes is None else f"{nbytes / MiB:.0f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
  """A plain-text table; `align` has one 'l' or 'r' per column (default: first left)."""
  cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
  align = align or "l" + "r" * (len(headers) - 1)

  def line(row):
    parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)]
    return "  ".join(parts).rstrip()

  sep = "  ".join("-" * w for w in widths)
  return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def verdict(value: float | None, target: float, higher_is_better: bool = True) -> str:
  if value is None:
    return "n/a"
  ok = value >= target if higher_is_better else value <= target
  return "PASS" if ok else "FAIL"


# ---------------------------------------------------------------------------------------------
# Contenders' rounds, gathered and compared


def gather_rounds(rounds: Iterator[tuple[str, dict]], phase: str) -> dict[str, dict]:
  """Each contender's timed tries of `phase`, its largest peak RSS, its errors and the rest
  of its last run (`worker_rounds`' output)."""
  results: dict[str, dict] = {}
  for name, run in rounds:
    kept = results.setdefault(name, {"tries": [], "peak_delta": 0, "errors": []})
    if "error" in run:
      kept["errors"].append(run["error"])
      continue
    stats = run["phases"][phase]
    kept["tries"] += stats["tries"]
    kept["peak_delta"] = max(kept["peak_delta"], stats["peak_delta"])
    kept["errors"] += run.get("errors", [])
    kept["last"] = run
  return results


def timing_rows(results: dict[str, dict], nbytes: int) -> list[list[str]]:
  """Table rows: contender, median, range (tries), GB/s, peak RSS, ok or FAILED."""
  rows = []
  for name, r in results.items():
    tries = r["tries"]
    med = statistics.median(tries) if tries else None
    spread = f"{min(tries):.3f}-{max(tries):.3f} ({len(tries)})" if tries else "-"
    rows.append([name, fmt(med, ".3f"), spread, fmt(gbps(nbytes, med)), mib(r["peak_delta"]),
                 "FAILED" if r["errors"] else "ok"])  # fmt: skip
  return rows


def ratios(results: dict[str, dict], pairs: Sequence[tuple[str, str]]) -> dict[str, dict]:
  """For each (ours, peer) both ran: the median speedup and the peak-RSS ratio, printed."""
  out = {}
  for mine, peer in pairs:
    ours, other = results.get(mine, {}).get("tries"), results.get(peer, {}).get("tries")
    if ours and other:
      ratio = statistics.median(other) / statistics.median(ours)
      memory = results[mine]["peak_delta"] / max(1, results[peer]["peak_delta"])
      out[f"{mine}/{peer}"] = {"speedup": ratio, "peak_ratio": memory}
      print(f"{mine} vs {peer}: {ratio:.2f}x faster (median), peak RSS {memory:.2f}x of theirs")
  for name, r in results.items():
    for e in r["errors"]:
      print(f"ERROR {name}: {e}")
  return out
