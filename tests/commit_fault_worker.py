"""Saves a checkpoint and SIGKILLs itself at one chosen step of the save (test_commit.py).

    python commit_fault_worker.py PATH VALUE STAGE

PATH is a directory or a JSON kvstore spec; every array of the saved state is
filled with VALUE. STAGE names where the process dies (see `_STAGES`).
"""

import os
import signal
import sys

import numpy as np

import ucp_jax
from ucp_jax.store import _commit, _direct, _writer


def die(*_args, **_kwargs):
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
  return False


_STAGES = {
  # every store
  "writing": lambda: setattr(_writer.Writer, "_write", after_calls(2, _writer.Writer._write)),
  "before-commit": lambda: setattr(_commit, "commit", die),
  # local directories
  "before-swap": lambda: setattr(_commit, "swap_into_place", die),
  "after-exchange": lambda: setattr(_commit.shutil, "rmtree", die),
  "fallback-between-renames": lambda: (
    setattr(_commit, "exchange", no_exchange),
    setattr(_commit.os, "rename", after_calls(2, os.rename)),
  ),
  "fallback-after-renames": lambda: (
    setattr(_commit, "exchange", no_exchange),
    setattr(_commit.shutil, "rmtree", die),
  ),
  # object stores: the old generation is removed after the manifest is written
  "after-manifest": lambda: setattr(_commit, "remove_replaced", die),
}


def state(value: float) -> dict:
  return {"a": np.full((64, 16), value, np.float32), "b": {"c": np.full((40,), value)}}


if __name__ == "__main__":
  path, value, stage = sys.argv[1], float(sys.argv[2]), sys.argv[3]
  if path.startswith("{"):
    import json

    path = json.loads(path)
  _direct.ENABLED = os.environ.get("UCP_DIRECT", "1") == "1"
  if stage != "none":
    _STAGES[stage]()
  ucp_jax.save(path, state(value), overwrite=True, chunk_bytes=1024)
  print("saved")
