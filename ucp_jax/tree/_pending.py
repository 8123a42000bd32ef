"""The one `save_async` in flight per process: its handle, and waiting for it.

`save`, `save_async` and `wait_until_finished` all wait here for the save before them, from
whichever thread they are called, and raise its error if nobody has seen it yet. A
`save_async` reserves its turn (`claim`) before it copies the state, so two threads never
have two in flight, and each error reaches exactly one caller of these functions.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable

_changed = threading.Condition()  # guards the three below; notified when any changes
_last: SaveHandle | None = None  # the last save_async: running, or failed and not yet reported
_claimed: object | None = None  # the turn of a save_async copying its state (see `claim`)


class SaveHandle:
  """A save that `save_async` started and a background thread finishes.

  `done()` says whether it has finished (committed, or failed) without waiting;
  `result(timeout)` waits, then returns the checkpoint's location or raises the save's
  error. An error is raised once: to `result`, or else to the first `save`, `save_async`
  or `wait_until_finished` of this process after it; a failed save leaves the checkpoint
  that was at its path (if any) intact. A program that exits without waiting for a
  failed save prints its error to stderr.

  Example:
    >>> import jax.numpy as jnp, ucp_jax
    >>> handle = ucp_jax.save_async("/tmp/ucp_doc_handle", {"w": jnp.ones(2)}, overwrite=True)
    >>> handle.result(timeout=60), handle.done()
    ('/tmp/ucp_doc_handle', True)
  """

  def __init__(self, location: str):
    self._location = location
    self._finished = threading.Event()
    self._error: BaseException | None = None
    self._seen = False  # the error was raised to a caller once already (guarded by _changed)

  def done(self) -> bool:
    """True once the checkpoint is committed or the save has failed."""
    return self._finished.is_set()

  def result(self, timeout: float | None = None) -> str:
    """Waits for the save; returns the checkpoint's location, or raises the save's error.

    Args:
      timeout: seconds to wait at most; None waits as long as the save runs.

    Returns:
      The checkpoint's location, as `save` returns it.

    Raises:
      TimeoutError: the save is still running after `timeout` seconds.
      Exception: the background write's error (a `UcpError` such as `StorageError`, or
        whatever else stopped it), with a note naming the save.
    """
    if not self._finished.wait(timeout):
      raise TimeoutError(f"{self._location}: the save is still running after {timeout} s")
    if self._error is not None:
      with _changed:
        self._seen = True  # the caller holding the handle has it: not raised again elsewhere
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
      with _changed:
        self._finished.set()
        _changed.notify_all()


def claim() -> object:
  """Reserves the next `save_async` of this process for the caller; returns the turn.

  Waits until no other `save_async` is starting or running, in any thread; if the last
  one failed and nobody has seen its error, raises it instead (nothing is reserved then).
  The caller then passes the turn to `start`, or to `release` in any case (a turn already
  started or released is left alone).
  """
  global _claimed
  turn = object()
  with _changed:
    error = _wait_and_take_error()
    if error is None:
      _claimed = turn
  if error is not None:
    raise error
  return turn


def release(turn: object) -> None:
  """Gives back `turn` if its save did not start."""
  global _claimed
  with _changed:
    if _claimed is turn:
      _claimed = None
      _changed.notify_all()


def start(turn: object, handle: SaveHandle, write: Callable[[], object], *, name: str) -> None:
  """Runs `write` in a background thread as the save `handle` stands for, in `turn`."""
  global _last
  thread = threading.Thread(target=handle._run, args=(write,), name=name)
  with _changed:
    _last = handle  # waited for from now on ...
  try:
    thread.start()
  except BaseException as e:
    if thread.ident is None:  # ... unless it never ran: then its error is the caller's
      with _changed:
        handle._error, handle._seen = e, True
        handle._finished.set()
    raise
  finally:
    release(turn)


def wait_until_finished() -> None:
  """Waits for this process's last `save_async`; raises its error if not raised yet.

  Any thread may call it; a `save_async` that another thread is starting is waited for
  too. The error of a failed save is raised once, to the first caller of this function,
  `save` or `save_async` (or of the handle's `result`).

  Returns:
    None, once no `save_async` of this process is running.

  Raises:
    Exception: the last `save_async`'s error, if it failed and nobody has seen it yet.

  Example:
    >>> import jax.numpy as jnp, ucp_jax
    >>> _ = ucp_jax.save_async("/tmp/ucp_doc_wait", {"w": jnp.ones(4)}, overwrite=True)
    >>> ucp_jax.wait_until_finished()
    >>> ucp_jax.open("/tmp/ucp_doc_wait").keys()
    ['w']
  """
  with _changed:
    error = _wait_and_take_error()
  if error is not None:
    raise error


def _wait_and_take_error() -> BaseException | None:
  """(`_changed` held.) Waits until no save_async is starting or running; returns the last
  one's error if nobody has seen it (now they have), and forgets that save."""
  global _last
  while _claimed is not None or (_last is not None and not _last.done()):
    _changed.wait()
  handle, _last = _last, None
  if handle is None or handle._error is None or handle._seen:
    return None
  handle._seen = True
  return handle._error


@atexit.register
def _report_unseen_error() -> None:
  """An async save that failed while the program exited without waiting is not silent.

  Runs after Python has joined the (non-daemon) writer thread.
  """
  handle = _last
  if handle is not None and handle._error is not None and not handle._seen:
    print(
      f"ucp_jax: save_async({handle._location!r}) failed and nobody waited for it; "
      f"no checkpoint was committed: {handle._error!r}",
      file=sys.stderr,
    )
