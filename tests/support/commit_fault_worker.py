"""Overwrites a checkpoint and dies (SIGKILL) or fails at one chosen step of the commit.

    python commit_fault_worker.py PATH VALUE STAGE [HOW [INPUT]]

PATH is a directory or a JSON kvstore spec. HOW is how it is written (default `save`):
`save` and `save_async` fill every array of the state with VALUE; `convert` converts the
source folder INPUT, `convert-2proc` does so with `ucp convert --processes 2` (this
process is process 0, which commits); `export-FORMAT` exports the checkpoint INPUT.
STAGE names where the process dies, or what it raises (see `_STAGES`). A worker that
leads its own session (the test starts it so) kills its whole process group, helpers
included, as when a job is killed.
"""

import errno
import os
import signal
import sys

import numpy as np

import ucp_jax
from ucp_jax.store import _commit, _direct, _swap, _writer


def die(*_args, **_kwargs):
  if os.getsid(0) == os.getpid():
    os.killpg(os.getpid(), signal.SIGKILL)
  os.kill(os.getpid(), signal.SIGKILL)


def after_calls(n, real):
  """`real`, except that the n-th call kills the process (before it runs)."""
  calls = [0]

  def wrapped(*args, **kwargs):
    calls[0] += 1
    if calls[0] == n:
      die()
    return real(*args, **kwargs)

  return wrapped


def no_exchange(*_args):
  """renameat2 as NFS, macOS and many FUSE mounts answer: not supported."""
  return errno.EINVAL


def eio():
  raise OSError(errno.EIO, "Input/output error (injected)")


def interrupt():
  raise KeyboardInterrupt


def _target_renames():
  """Hides the exchange, and makes each rename that moves the checkpoint folder (to or from
  PATH) call a hook first with its number (from 1); returns the list that holds the hook."""
  target = os.path.abspath(sys.argv[1])
  real = os.rename
  hook = [lambda n: None]
  calls = [0]

  def rename(a, b, *args, **kwargs):
    if target in (os.path.abspath(a), os.path.abspath(b)):
      calls[0] += 1
      hook[0](calls[0])
    return real(a, b, *args, **kwargs)

  os.rename = rename
  _swap._renameat2 = no_exchange
  return hook


def at_swap_rename(n, action):
  """Without the exchange, the n-th rename that moves the checkpoint folder runs `action`."""
  _target_renames()[0] = lambda i: action() if i == n else None


def _cut_undo():
  """The second rename fails (EIO), and the process dies as it undoes the first."""
  _target_renames()[0] = lambda i: eio() if i == 2 else die() if i == 3 else None


def _cut_abort():
  """Both renames back fail (EIO), and the process dies while the abort removes the
  staging folder, half of it gone: the old checkpoint is left alone in STAGING.old."""
  _target_renames()[0] = lambda i: eio() if i >= 2 else None

  def rmtree(path, *args, **kwargs):
    files = sorted(os.path.join(r, n) for r, _, names in os.walk(path) for n in names)
    for name in files[::2]:
      os.unlink(name)
    die()

  _swap.shutil.rmtree = rmtree


_STAGES = {
  # every store
  "writing": lambda: setattr(_writer.Writer, "_write", after_calls(2, _writer.Writer._write)),
  "before-commit": lambda: setattr(_commit, "commit", die),
  # local directories
  "before-swap": lambda: setattr(_swap, "swap_into_place", die),
  "after-exchange": lambda: setattr(_swap.shutil, "rmtree", die),
  "fallback-between-renames": lambda: at_swap_rename(2, die),
  "fallback-after-renames": lambda: (
    setattr(_swap, "_renameat2", no_exchange),
    setattr(_swap.shutil, "rmtree", die),
  ),
  "fallback-undo-cut": _cut_undo,
  "fallback-abort-cut": _cut_abort,
  # in process (multi-process convert): the second rename raises
  "fallback-eio": lambda: at_swap_rename(2, eio),
  "fallback-interrupt": lambda: at_swap_rename(2, interrupt),
  # object stores: the old generation is removed after the manifest is written
  "after-manifest": lambda: setattr(_commit, "remove_replaced", die),
}


def state(value: float) -> dict:
  return {"a": np.full((64, 16), value, np.float32), "b": {"c": np.full((40,), value)}}


def write(path, value: float, how: str, source: str | None) -> None:
  if how == "save":
    ucp_jax.save(path, state(value), overwrite=True, chunk_bytes=1024)
  elif how == "save_async":
    ucp_jax.save_async(path, state(value), overwrite=True, chunk_bytes=1024)
    ucp_jax.wait_until_finished()
  elif how == "convert":
    ucp_jax.convert(source, path, overwrite=True)
  elif how == "convert-2proc":
    from ucp_jax import cli

    code = cli.main(["convert", source, path, "--processes", "2", "--overwrite"])
    sys.stdout.flush()
    os._exit(code)  # as the `ucp` command exits
  else:
    ucp_jax.export(source, path, format=how.removeprefix("export-"), overwrite=True)


if __name__ == "__main__":
  path, value, stage = sys.argv[1], float(sys.argv[2]), sys.argv[3]
  how = sys.argv[4] if len(sys.argv) > 4 else "save"
  source = sys.argv[5] if len(sys.argv) > 5 else None
  if path.startswith("{"):
    import json

    path = json.loads(path)
  _direct.ENABLED = os.environ.get("UCP_DIRECT", "1") == "1"
  if stage != "none":
    _STAGES[stage]()
  write(path, value, how, source)
  print("saved")
