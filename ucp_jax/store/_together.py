"""Steps of a save that every process takes together: one fails, all raise."""

from __future__ import annotations

from typing import Any

from ucp_jax.base import _errors, _multihost
from ucp_jax.store import _location

NOTHING_LOST = "Nothing was committed; the checkpoint there before, if any, is intact."
"""What every failed step of a save adds to its message: what the failure did not touch."""


def together(sync: _multihost.Sync, target: _location.Location, what: str, fn, *args) -> Any:
  """`fn(*args)` on every process; if it fails on any process, every process raises."""
  error, result = None, None
  try:
    result = fn(*args)
  except Exception as e:
    error = _location.storage_error(e, target, what, NOTHING_LOST)
    if error is not e:
      error.__cause__ = e
  if not sync.all_ok(error is None, what):
    if error is not None:
      raise error
    raise _errors.UcpError(f"{target}: {what} failed on another process (see its log)")
  return result
