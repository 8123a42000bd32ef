"""The process `hostile_run.run_batch` starts: runs each job in turn and reports it as JSON.

Usage: python hostile_worker.py JOBS.json ADDRESS_SPACE_BYTES

Before each call it prints `{"start": ...}`, after it `{"case", "entry", "outcome", ...}`; a
watchdog thread dumps every thread's stack and exits 3 when a call outlives
`hostile_run.CALL_SECONDS`. It runs under RLIMIT_AS, so a blowup of memory is an abort or a
MemoryError here, not a swapping machine.
"""

import contextlib
import faulthandler
import io
import json
import os
import resource
import sys
import threading
import time
import traceback

memory = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hostile_run  # noqa: E402  (beside this file: on the path of a script)
import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ucp_jax  # noqa: E402
from ucp_jax import cli  # noqa: E402
from ucp_jax.base import _errors  # noqa: E402
from ucp_jax.store import _keypath  # noqa: E402

faulthandler.enable()
MESH = jax.make_mesh((8,), ("data",))


def _cli_call(argv: list[str]) -> tuple[str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(argv)
  text = err.getvalue()
  if code == 0:
    return "ok", text
  if code == 2 and text.startswith("error: "):
    return "refused", text.removeprefix("error: ")
  if code == 1 and argv[0] == "verify":  # verify lists the arrays it found bad
    return "refused", (out.getvalue() + text).strip()
  return "bug", f"exit {code}\nstdout: {out.getvalue()}\nstderr: {text}"


def _api_call(entry: str, job: dict) -> tuple[str, str]:
  path, source = job["path"], job["source"]
  if entry == "read":
    ckpt = ucp_jax.open(path, source=source)
    for key in ckpt.keys():
      ckpt.read(key)
  elif entry == "restore":
    ucp_jax.restore(ucp_jax.open(path, source=source))
  else:
    ckpt = ucp_jax.open(path, source=source)
    target: dict = {}
    for key in ckpt.keys():
      shape = ckpt[key].shape
      spec = P("data") if shape and shape[0] % 8 == 0 else P()
      node = target
      *parents, leaf = _keypath.split(key)  # (a key's parts as the tree names them)
      for part in parents:
        node = node.setdefault(part, {})
      node[leaf] = NamedSharding(MESH, spec)
    jax.block_until_ready(ucp_jax.restore(ckpt, target))
  return "ok", ""


def _run(job: dict) -> tuple[str, str]:
  entry, path = job["entry"], job["path"]
  source = ["--from", job["source"]] if job["source"] else []
  try:
    if entry == "inspect":
      return _cli_call(["inspect", path, *source])
    if entry == "verify":
      return _cli_call(["verify", path])
    if entry == "convert":
      return _cli_call(["convert", path, job["dst"], *source])
    if entry == "diff":
      return _cli_call(["diff", path, path])
    return _api_call(entry, job)
  except (_errors.UcpError, OSError) as e:
    return "refused", str(e)
  except BaseException:
    return "bug", traceback.format_exc()


def _listing(root: str) -> set[str]:
  return {
    os.path.relpath(os.path.join(d, n), root)
    for d, dirs, files in os.walk(root)
    for n in dirs + files
  }


def _watchdog(label: str) -> threading.Timer:
  def fire():
    sys.stderr.write(f"watchdog: {label} still running after {hostile_run.CALL_SECONDS} s\n")
    faulthandler.dump_traceback(all_threads=True)
    os._exit(3)

  timer = threading.Timer(hostile_run.CALL_SECONDS, fire)
  timer.daemon = True
  timer.start()
  return timer


def main() -> None:
  with open(sys.argv[1]) as f:
    jobs = json.load(f)
  for job in jobs:
    label = f"{job['case']} / {job['entry']}"
    print(json.dumps({"start": label}), flush=True)
    folder = os.path.dirname(job["dst"])
    before = _listing(folder)
    timer = _watchdog(label)
    began = time.perf_counter()
    outcome, message = _run(job)
    seconds = time.perf_counter() - began
    timer.cancel()
    added = sorted(_listing(folder) - before) if outcome == "refused" else []
    result = {**job, "outcome": outcome, "message": message, "seconds": seconds}
    result["wrote_beside"] = added
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
