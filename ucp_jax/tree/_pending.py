"""The one `save_async` in flight per process: its handle, and waiting for it.

`save`, `save_async` and `wait_until_finished` all wait here for the save before them,
and raise its error if nobody has seen it yet.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable

_lock = threading.Lock()
_pending: SaveHandle | None = None  # the last save_async of this process


class SaveHandle:
  """A save started by `save_async`: poll it with `done`, wait with `result`."""

  def __init__(self, location: str):
    self._location = location
    self._finished = threading.Event()
    self._error: BaseException | None = None
    self._seen = False  # the error was raised to the caller once already

  def done(self) -> bool:
    """True once the checkpoint is committed or the save has failed."""
    return self._finished.is_set()

  def result(self, timeout: float | None = None) -> str:
    """Waits for the save; returns the checkpoint's location, or raises the save's error.

    Raises:
      TimeoutError: the save is still running after `timeout` seconds.
    """
    if not self._finished.wait(timeout):
      raise TimeoutError(f"{self._location}: the save is still running after {timeout} s")
    if self._error is not None:
      self._seen = True
      raise self._error
    return self._location

  def _run(self, write: Callable[[], object]) -> None:
    try:
      write()
    except BaseException as e:  # kept for result() and the next save
      if hasattr(e, "add_note"):  # Python >= 3.11
        e.add_note(f"raised by the background write of save_async({self._location!r})")
      self._error = e
    finally:
      self._finished.set()


def start(handle: SaveHandle, write: Callable[[], object], *, name: str) -> None:
  """Runs `write` in a background thread as the save `handle` stands for."""
  global _pending
  thread = threading.Thread(target=handle._run, args=(write,), name=name)
  with _lock:
    _pending = handle
  thread.start()


def wait_until_finished() -> None:
  """Waits for this process's last `save_async`; raises its error if not raised yet.

  Example:
    >>> import jax.numpy as jnp, ucp_jax
    >>> _ = ucp_jax.save_async("/tmp/ucp_doc_wait", {"w": jnp.ones(4)}, overwrite=True)
    >>> ucp_jax.wait_until_finished()
    >>> ucp_jax.open("/tmp/ucp_doc_wait").keys()
    ['w']
  """
  global _pending
  handle = _pending
  if handle is None:
    return
  handle._finished.wait()
  with _lock:
    if _pending is handle:
      _pending = None
  if handle._error is not None and not handle._seen:
    handle._seen = True
    raise handle._error


@atexit.register
def _report_unseen_error() -> None:
  """An async save that failed while the program exited without waiting is not silent.

  Runs after Python has joined the (non-daemon) writer thread.
  """
  handle = _pending
  if handle is not None and handle._error is not None and not handle._seen:
    print(
      f"ucp_jax: save_async({handle._location!r}) failed and nobody waited for it; "
      f"no checkpoint was committed: {handle._error!r}",
      file=sys.stderr,
    )
