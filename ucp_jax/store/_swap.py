"""The swap of a complete staging folder into place: atomic where the file system can, and
never losing the folder it replaces where it cannot.

Saves (`_commit.commit`, with the manifest as the marker of a whole folder) and exports
(`sinks._folder.staged`, with `ucp_export.json`) both commit a local folder through
`swap_into_place`; `interrupted_swap` tells readers where a checkpoint waits when a swap
was cut short, and `recover` (run by the next save or export, under the lock) puts it
in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil

from ucp_jax.base import _errors
from ucp_jax.store import _location, _manifest

# The fallback swap of a staging folder S into the target T (O is `S.old`) goes through
# these states; in each one a reader finds a whole checkpoint and `recover` knows what to do:
#   1. T old, S new             (before)  read T; the next save removes S
#   2. T missing, O old, S new  (between) read S; `recover` renames S to T
#   3. T new, O old             (after)   read T; the next save removes O
#   4. T missing, O old         (an undo cut short) read O; `recover` renames O to T
# S "new" means that it holds its marker (the manifest, or an export's `ucp_export.json`),
# which a staging folder gets only once complete; every folder is deleted marker first
# (`discard`), so what a deletion cut short leaves is never taken for a checkpoint.

_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
"""What renameat2 fails with where the kernel or the file system cannot exchange."""
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def swap_into_place(
  staging_dir: str,
  target_dir: str,
  *,
  durable: bool = True,
  marker: str = _manifest.MANIFEST_KEY,
) -> None:
  """Makes the directory `staging_dir` visible as `target_dir`, or raises and leaves
  `target_dir` as it was.

  An existing, non-empty `target_dir` is exchanged atomically where the kernel and the
  file system can (renameat2); where they cannot, it is renamed to `STAGING.old` and
  `staging_dir` into place. The parent directory is fsynced (with `durable`): that is
  the commit. Any exception before it (KeyboardInterrupt, an OSError) first undoes the
  swap; a process killed on the way leaves one of the states above, which
  `interrupted_swap` finds and `recover` completes. The replaced directory is deleted
  after the commit (errors ignored: the next save removes what is left).

  Args:
    staging_dir: the complete new folder, holding `marker`.
    target_dir: where it goes.
    durable: fsync the parent directory after the renames.
    marker: the file that makes a folder whole (the manifest, or an export's marker).

  Raises:
    OSError: the swap failed, and was undone.
    StorageError: the swap failed and undoing it failed too; the message says where
      each checkpoint is.
  """
  new = _identity(staging_dir)
  try:
    replaced = _swap(staging_dir, target_dir)
    if durable:
      fsync_dir(os.path.dirname(target_dir))
  except BaseException as e:
    try:
      _undo(staging_dir, target_dir, new)
    except Exception as undo_error:  # a second interrupt propagates as it is
      raise _errors.StorageError(
        f"{target_dir}: the commit failed ({_describe(e)}) and undoing it failed too "
        f"({_describe(undo_error)}); {_whereabouts(staging_dir, target_dir)}"
      ) from e
    raise
  if replaced is not None:
    discard(replaced, marker)


def _swap(staging_dir: str, target_dir: str) -> str | None:
  """Renames `staging_dir` to `target_dir`; returns the folder that now holds what
  `target_dir` held (None: it held nothing)."""
  if not os.path.isdir(target_dir) or not os.listdir(target_dir):
    if os.path.isdir(target_dir):
      os.rmdir(target_dir)
    os.rename(staging_dir, target_dir)
    return None
  if exchange(staging_dir, target_dir):
    return staging_dir
  old = staging_dir + ".old"
  os.rename(target_dir, old)
  os.rename(staging_dir, target_dir)
  return old


def _undo(staging_dir: str, target_dir: str, new: tuple[int, int] | None) -> None:
  """Puts back what `target_dir` held before `_swap`, wherever the swap stopped.

  The fallback's steps are told apart by which names exist (a folder only ever moves
  from S to T and from T to O); an exchange, which leaves both names, by `new`, the
  identity of the staging folder.
  """
  old = staging_dir + ".old"
  if os.path.lexists(staging_dir) and os.path.lexists(target_dir):  # before, or exchanged
    if new is not None and _identity(target_dir) == new and not exchange(staging_dir, target_dir):
      raise OSError(errno.EINVAL, "the exchange worked once and now fails", target_dir)
    return
  if os.path.lexists(target_dir):  # renamed into place: back to the staging name
    os.rename(target_dir, staging_dir)
  if os.path.isdir(old) and not os.path.lexists(target_dir):
    os.rename(old, target_dir)


def _identity(path: str) -> tuple[int, int] | None:
  try:
    st = os.lstat(path)
  except OSError:
    return None
  return st.st_dev, st.st_ino


def _describe(error: BaseException) -> str:
  return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _whereabouts(staging_dir: str, target_dir: str) -> str:
  """Where the checkpoints are after a swap that could not be undone, once the caller has
  dropped the staging folder (`drop_staging`, which also tries to put the old one back)."""
  if os.path.lexists(target_dir):
    return f"{target_dir} holds the new checkpoint (committed, not known to be durable)"
  return (
    f"the previous checkpoint is in {staging_dir}.old until the next save or export to "
    f"{target_dir} puts it back (reading {target_dir} reads it there)"
  )


def _whole(folder: str, marker: str) -> bool:
  return os.path.isfile(os.path.join(folder, marker))


def interrupted_swap(
  target_dir: str, candidates: list[str] | None = None, marker: str = _manifest.MANIFEST_KEY
) -> str | None:
  """Where the checkpoint of a missing `target_dir` waits when a swap into it was cut short.

  The new one (state 2 above: a staging folder holding `marker`, with its `.old`
  beside it) if there is one, else the old one (state 4: a `.old` holding `marker`);
  None when `target_dir` exists or nothing waits.

  Args:
    target_dir: the checkpoint's path.
    candidates: the staging folders of `target_dir` (default: those of a save).
    marker: the file that makes a folder whole.
  """
  if os.path.lexists(target_dir):
    return None
  candidates = _location.staging_dirs(target_dir) if candidates is None else candidates
  olds = sorted(c for c in candidates if c.endswith(".old") and os.path.isdir(c))
  for old in olds:
    if _whole(old[: -len(".old")], marker):
      return old[: -len(".old")]
  olds = [old for old in olds if _whole(old, marker)]
  return olds[0] if olds else None


def recover(
  target_dir: str, candidates: list[str] | None = None, marker: str = _manifest.MANIFEST_KEY
) -> None:
  """Puts in place the checkpoint that a swap cut short left aside (the caller holds the
  lock): the new one if it waits, else the old one; see `interrupted_swap`.

  Raises:
    OSError: the rename failed (nothing was deleted).
  """
  found = interrupted_swap(target_dir, candidates, marker)
  if found is None:
    return
  os.rename(found, target_dir)
  fsync_dir(os.path.dirname(target_dir))
  if not found.endswith(".old"):
    discard(found + ".old", marker)


def discard(folder: str, marker: str = _manifest.MANIFEST_KEY) -> None:
  """Deletes `folder`, its `marker` first, so that a deletion cut short never leaves what
  looks like a checkpoint. Errors are ignored: the next save removes what is left."""
  with contextlib.suppress(OSError):
    os.unlink(os.path.join(folder, marker))
  shutil.rmtree(folder, ignore_errors=True)


def drop_staging(staging_dir: str, target_dir: str, marker: str = _manifest.MANIFEST_KEY) -> None:
  """Removes a staging folder that will not be committed and, if a swap that could not be
  undone left the old checkpoint aside (state 4), tries to put it back."""
  discard(staging_dir, marker)
  with contextlib.suppress(OSError):
    recover(target_dir, [staging_dir + ".old"], marker)


def exchange(a: str, b: str) -> bool:
  """Swaps the directories `a` and `b` in one step (Linux renameat2, RENAME_EXCHANGE).

  Returns False where the kernel or the file system cannot exchange (EINVAL, ENOSYS,
  EOPNOTSUPP: NFS, many FUSE mounts, a libc or an OS without renameat2); the caller then
  falls back to two renames. Any other failure raises: an EIO is no reason to try
  moving the checkpoint another way.

  Raises:
    OSError: the exchange failed (nothing moved).
  """
  code = _renameat2(a, b, _RENAME_EXCHANGE)
  if code == 0:
    return True
  if code in _UNSUPPORTED:
    return False
  raise OSError(code, os.strerror(code), a, None, b)


def _renameat2(a: str, b: str, flags: int) -> int:
  """renameat2(a, b, flags): 0, or the errno it failed with (ENOSYS where libc lacks it)."""
  try:
    call = _libc().renameat2
  except (OSError, AttributeError):
    return errno.ENOSYS
  if call(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
    return 0
  return ctypes.get_errno() or errno.EIO


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
  return ctypes.CDLL(None, use_errno=True)


def fsync_dir(path: str) -> None:
  """Makes the entries of directory `path` durable."""
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  except OSError as e:  # some file systems cannot fsync a directory; their renames are durable
    if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
      raise
  finally:
    os.close(fd)
