"""Real multi-process JAX for the tests: the parent starts worker processes on 127.0.0.1
(`run_workers`), and each worker joins the run and runs one scenario (`worker_main`).

A worker script (tests/multiprocess_worker.py, tests/incremental_worker.py) is run as
`python WORKER SCENARIO PROCESS_ID NUM_PROCESSES PORT WORKDIR` and writes
WORKDIR/result-PROCESS_ID.json; any exception exits non-zero with a traceback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
  """A free TCP port on 127.0.0.1, for the coordinator."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def env(devices_per_process: int, worker_timeout_s: float = 60) -> dict:
  """The environment of a worker with `devices_per_process` fake CPU devices."""
  flags = [
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  ]
  flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
  return dict(
    os.environ,
    XLA_FLAGS=" ".join(flags),
    JAX_PLATFORMS="cpu",
    PYTHONPATH=path,
    UCP_WORKER_TIMEOUT_S=str(worker_timeout_s),
  )


def run_workers(
  worker: str | os.PathLike,
  scenario: str,
  workdir: Path,
  *,
  processes: int = 2,
  devices: int = 4,
  worker_timeout_s: float = 60,
  timeout_s: float | None = None,
) -> list[dict]:
  """Runs `scenario` of the script `worker` on `processes` processes of `devices` CPU
  devices each; returns each one's result, or fails the test with every process's output.

  A worker dumps its stacks and exits after `worker_timeout_s`; the parent kills what is
  left after `timeout_s` (default: 30 s more).
  """
  import pytest

  timeout_s = worker_timeout_s + 30 if timeout_s is None else timeout_s
  port = free_port()
  environ = env(devices, worker_timeout_s)
  logs = [open(workdir / f"log-{scenario}-{i}.txt", "w+") for i in range(processes)]  # noqa: SIM115
  procs = [
    subprocess.Popen(
      [sys.executable, str(worker), scenario, str(i), str(processes), str(port), str(workdir)],
      env=environ,
      cwd=ROOT,
      stdout=log,
      stderr=subprocess.STDOUT,
    )
    for i, log in enumerate(logs)
  ]
  deadline = time.monotonic() + timeout_s
  hung = False
  for proc in procs:
    try:
      proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      hung = True
      break
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  outputs = []
  for log in logs:
    log.seek(0)
    outputs.append(log.read())
    log.close()
  if hung or any(p.returncode for p in procs):
    report = "\n".join(
      f"--- process {i} (exit code {p.returncode}) ---\n{out}"
      for i, (p, out) in enumerate(zip(procs, outputs))
    )
    why = f"hung for {timeout_s} s and was killed" if hung else "failed"
    pytest.fail(f"multi-process scenario {scenario!r} {why}:\n{report}", pytrace=False)
  results = []
  for i in range(processes):
    with open(workdir / f"result-{i}.json") as f:
      results.append(json.load(f))
    os.remove(workdir / f"result-{i}.json")
  return results


def worker_main(scenarios: dict[str, Callable[[str], dict]]) -> None:
  """A worker's `main`: joins the run its command line names (gloo collectives on CPU),
  runs the scenario, writes its result (`process`, `local_devices`, `ok`, and what the
  scenario returns, or the `traceback`)."""
  import faulthandler

  import jax

  scenario, process_id, num_processes, port, workdir = sys.argv[1:]
  # A hung worker prints every thread's stack and exits, before the parent kills it.
  faulthandler.dump_traceback_later(float(os.environ.get("UCP_WORKER_TIMEOUT_S", 60)), exit=True)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=int(num_processes),
    process_id=int(process_id),
    initialization_timeout=60,
  )
  result = {"process": jax.process_index(), "local_devices": jax.local_device_count()}
  try:
    result.update(scenarios[scenario](workdir))
    result["ok"] = True
  except BaseException:
    result["ok"] = False
    result["traceback"] = traceback.format_exc()
  with open(os.path.join(workdir, f"result-{process_id}.json"), "w") as f:
    json.dump(result, f)
  if not result["ok"]:
    print(result["traceback"], file=sys.stderr)
    sys.exit(1)
