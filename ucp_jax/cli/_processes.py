"""One `ucp` command on several processes that agree through `jax.distributed`.

A conversion needs no accelerator and no collectives: its processes only agree on the
save (a token, the checksums, the commit) through the coordination service, so they
run on CPU. `--processes N` starts N-1 helpers on this host, each the same command
joining the run that this process coordinates on 127.0.0.1; across hosts every host
runs the command with `--coordinator`, `--num-processes` and `--process-id`, as
training jobs start `jax.distributed`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile

INIT_TIMEOUT_S = 300


def join(coordinator: str, num_processes: int, process_id: int) -> None:
  """Joins (process 0: starts) the run of `num_processes` processes at `coordinator`."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  jax.distributed.initialize(
    coordinator_address=coordinator,
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=INIT_TIMEOUT_S,
  )


def leave() -> None:
  """Leaves the run: waits until every process has left (process 0 last, as it serves)."""
  import jax

  jax.distributed.shutdown()


def exit_now(console, code: int) -> None:
  """Ends this process at once, skipping `jax.distributed`'s exit, which would wait (minutes)
  for processes that are gone. Only after every write was stopped and the save aborted."""
  console.print("[red]interrupted[/red]", highlight=False)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Helpers:
  """Processes 1..n-1 of a local run, each `python -m ucp_jax.cli ARGV... --process-id I`.

  Their output goes to files; `failures()` tells what the ones that failed printed.
  """

  def __init__(self, argv: list[str], num_processes: int):
    self._logs = []
    self._procs = []
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for i in range(1, num_processes):
      log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (kept until the helpers are done)
      self._logs.append(log)
      self._procs.append(
        subprocess.Popen(
          [sys.executable, "-m", "ucp_jax.cli", *argv, "--process-id", str(i)],
          stdout=log,
          stderr=subprocess.STDOUT,
          env=env,
        )
      )

  def wait(self) -> list[str]:
    """Waits for every helper; what each failed one printed (last lines)."""
    failures = []
    for i, (proc, log) in enumerate(zip(self._procs, self._logs), start=1):
      if proc.wait() != 0:
        log.seek(0)
        tail = log.read().strip().splitlines()[-5:]
        failures.append(f"process {i} (exit {proc.returncode}): " + " / ".join(tail))
      log.close()
    return failures

  def kill(self) -> None:
    for proc in self._procs:
      with contextlib.suppress(ProcessLookupError):
        proc.kill()
