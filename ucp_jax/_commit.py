"""Atomic commit: a save is either wholly visible or not at all.

On a local file system a save writes into a hidden staging directory beside the
target, `.NAME.ucp-tmp-TOKEN`, and renames it into place (an atomic exchange when
overwriting). On object stores, where there is no rename, the manifest is the
commit marker: it is written last, and removed first when overwriting. A lock
beside the target (`.NAME.ucp-lock`, or a `.ucp-lock` key) turns a second
concurrent writer away.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import socket
import time

from ucp_jax import _errors, _manifest, _store

_LOCK_KEY = ".ucp-lock"


def staging_location(target: _store.Location, token: int) -> _store.Location:
  """Where a save writes before it commits."""
  if target.local_dir is None:
    return target
  return _store.resolve(_store.staging_dir(target.local_dir, token))


def check_writable(target: _store.Location, overwrite: bool) -> None:
  """Raises before any write if saving to `target` would lose something."""
  if target.local_dir is not None:
    path = target.local_dir
    if os.path.isfile(path):
      raise _errors.CheckpointExistsError(f"{path}: a file is in the way of the checkpoint")
    blocker = file_above(path)
    if blocker is not None:
      raise _errors.CheckpointExistsError(f"{path}: {blocker} is a file, not a directory")
    if not os.path.isdir(path) or not os.listdir(path):
      return
    is_checkpoint = os.path.exists(os.path.join(path, _manifest.MANIFEST_KEY))
    if not is_checkpoint:
      raise _errors.CheckpointExistsError(
        f"{path}: directory exists and is not a ucp_jax checkpoint; refusing to replace it"
      )
    if not overwrite:
      raise _errors.CheckpointExistsError(
        f"{path}: a checkpoint exists already; pass overwrite=True to replace it"
      )
    return
  store = _store.kvstore(target)
  if not overwrite and store.read(_manifest.MANIFEST_KEY).result().state == "value":
    raise _errors.CheckpointExistsError(
      f"{target}: a checkpoint exists already; pass overwrite=True to replace it"
    )


def file_above(path: str) -> str | None:
  """The nearest existing ancestor of `path` when it is not a directory (nothing fits below it)."""
  parent = os.path.dirname(path)
  while parent and not os.path.lexists(parent) and parent != os.path.dirname(parent):
    parent = os.path.dirname(parent)
  return parent if parent and os.path.lexists(parent) and not os.path.isdir(parent) else None


class Lock:
  """Exclusive right to write one checkpoint path, held by process 0 of a save."""

  def __init__(self, target: _store.Location, token: int):
    self._target = target
    self._token = token
    self._holder = json.dumps(
      {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "token": f"{token:016x}",
        "time": time.time(),
      }
    )
    self._path = None
    if target.local_dir is not None:
      parent, name = os.path.split(target.local_dir)
      self._path = os.path.join(parent, f".{name}.ucp-lock")

  def acquire(self) -> None:
    if self._path is None:
      self._acquire_kvstore()
      return
    os.makedirs(os.path.dirname(self._path), exist_ok=True)
    for _ in range(2):
      try:
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        if self._steal_if_stale():
          continue
        raise _errors.ConcurrentWriteError(self._busy_message(_read_text(self._path))) from None
      with os.fdopen(fd, "w") as f:
        f.write(self._holder)
      return
    raise _errors.ConcurrentWriteError(self._busy_message(_read_text(self._path)))

  def _steal_if_stale(self) -> bool:
    """A lock left by a dead process on this host does not block a new save."""
    try:
      holder = json.loads(_read_text(self._path))
    except (OSError, ValueError):
      return False
    if holder.get("host") != socket.gethostname() or _pid_alive(int(holder.get("pid", -1))):
      return False
    with contextlib.suppress(FileNotFoundError):
      os.remove(self._path)
    return True

  def _acquire_kvstore(self) -> None:
    store = _store.kvstore(self._target)
    current = store.read(_LOCK_KEY).result()
    if current.state == "value":
      raise _errors.ConcurrentWriteError(self._busy_message(current.value.decode()))
    store.write(_LOCK_KEY, self._holder.encode(), if_equal=current.stamp.generation).result()
    if store.read(_LOCK_KEY).result().value.decode() != self._holder:
      raise _errors.ConcurrentWriteError(self._busy_message("another writer"))

  def _busy_message(self, holder: str) -> str:
    where = self._path or f"{self._target}/{_LOCK_KEY}"
    return (
      f"{self._target}: another save to this path is in progress (lock {where} held by "
      f"{holder.strip()}). If no such save is running, delete the lock file."
    )

  def release(self) -> None:
    if self._path is None:
      _store.kvstore(self._target).write(_LOCK_KEY, None).result()
    else:
      with contextlib.suppress(FileNotFoundError):
        os.remove(self._path)


def remove_stale_staging(target: _store.Location) -> None:
  """Deletes staging directories of saves to `target` that died (the caller holds the lock)."""
  if target.local_dir is None:
    return
  for stale in _store.staging_dirs(target.local_dir):
    shutil.rmtree(stale, ignore_errors=True)


def prepare_kvstore_target(target: _store.Location) -> None:
  """On an object store: uncommit the old checkpoint (manifest first), then clear it."""
  if target.local_dir is not None:
    return
  store = _store.kvstore(target)
  store.write(_manifest.MANIFEST_KEY, None).result()
  for key in store.list().result():
    if key.decode() != _LOCK_KEY:
      store.write(key, None).result()


def commit(staging: _store.Location, target: _store.Location, manifest: bytes) -> None:
  """Writes the manifest and makes the checkpoint visible at `target` in one step."""
  _store.kvstore(staging).write(_manifest.MANIFEST_KEY, manifest).result()
  if staging.local_dir is None:
    return
  _fsync_tree_metadata(staging.local_dir)
  swap_into_place(staging.local_dir, target.local_dir)


def swap_into_place(staging_dir: str, target_dir: str) -> None:
  """Makes the directory `staging_dir` visible as `target_dir` in one step.

  An existing, non-empty `target_dir` is exchanged atomically where the kernel can
  (renameat2), then deleted; the parent directory is fsynced.
  """
  if os.path.isdir(target_dir) and os.listdir(target_dir):
    old = staging_dir
    if not _exchange(staging_dir, target_dir):
      old = staging_dir + ".old"
      os.rename(target_dir, old)
      os.rename(staging_dir, target_dir)
    shutil.rmtree(old, ignore_errors=True)
  else:
    if os.path.isdir(target_dir):
      os.rmdir(target_dir)
    os.rename(staging_dir, target_dir)
  _fsync_dir(os.path.dirname(target_dir))


def abort(staging: _store.Location, target: _store.Location) -> None:
  if staging.local_dir is not None and staging != target:
    shutil.rmtree(staging.local_dir, ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
  """Atomically swaps two directories (Linux renameat2); False where unsupported."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = libc.renameat2
  except (OSError, AttributeError):
    return False
  at_fdcwd, rename_exchange = -100, 2
  rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
  return rc == 0


def _fsync_tree_metadata(root: str) -> None:
  with contextlib.suppress(OSError):
    fd = os.open(os.path.join(root, _manifest.MANIFEST_KEY), os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def _fsync_dir(path: str) -> None:
  with contextlib.suppress(OSError):
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def _pid_alive(pid: int) -> bool:
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _read_text(path: str) -> str:
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return "an unknown writer"
