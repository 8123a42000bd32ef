"""Atomic commit: a save is either wholly visible or not at all, and never loses the last one.

On a local file system a save writes into a hidden staging directory beside the
target, `.NAME.ucp-tmp-TOKEN`, and renames it into place: an atomic exchange
when overwriting (`renameat2(RENAME_EXCHANGE)`), or, where the file system
cannot exchange, two renames (target -> `STAGING.old`, staging -> target). An
exception inside the swap undoes it before it propagates; a process killed
between the two renames leaves both folders, which readers find and the next
save puts in place (`_swap`).

On object stores, where there is no rename, a save writes its arrays below a
fresh prefix (`gTOKEN/`) and commits by writing the manifest, one object that
names that prefix; only then are older generations deleted. A reader holding the
old manifest reads the old generation, or fails if it is deleted under it.

A lock beside the target (`.NAME.ucp-lock`, held with `flock`, or a `.ucp-lock`
object) turns a second concurrent writer away; a lock whose holder died is taken over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import socket
import time

from ucp_jax.base import _errors
from ucp_jax.store import _location, _manifest, _swap
from ucp_jax.store._swap import interrupted_swap as interrupted_swap  # read by `_reader`

_LOCK_KEY = ".ucp-lock"
_EXIT_GRACE_S = 5.0  # how long a dead holder's last threads may take to release its flock
_GENERATION = re.compile(r"^g[0-9a-f]{16}/")


def data_prefix(target: _location.Location, token: int) -> str:
  """Where a save's arrays go below the root: the root itself on local disks."""
  return "" if target.local_dir is not None else f"g{token:016x}/"


def staging_location(target: _location.Location, token: int) -> _location.Location:
  """Where a save writes its arrays before it commits."""
  if target.local_dir is None:
    return target.child(data_prefix(target, token))
  return _location.resolve(_location.staging_dir(target.local_dir, token))


def check_writable(target: _location.Location, overwrite: bool) -> None:
  """Raises before any write if saving to `target` would lose something."""
  if target.local_dir is not None:
    path = target.local_dir
    if os.path.islink(path):
      raise _errors.CheckpointExistsError(
        f"{path}: a symbolic link (to {os.readlink(path)}); save to the directory it names, or "
        "remove the link first"
      )
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
  store = _location.kvstore(target)
  if store.read(_manifest.MANIFEST_KEY).result().state == "value":
    if not overwrite:
      raise _errors.CheckpointExistsError(
        f"{target}: a checkpoint exists already; pass overwrite=True to replace it"
      )
    return
  foreign = [key for key in _keys(store) if not _ours(key)]
  if foreign:
    shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
    raise _errors.CheckpointExistsError(
      f"{target}: holds other data ({shown}) and no ucp_jax checkpoint; refusing to write there"
    )


def _keys(store) -> list[str]:
  return sorted(raw.decode(errors="replace") for raw in store.list().result())


def _ours(key: str) -> bool:
  """Keys a save writes at an object-store root besides the manifest: lock, root group, data."""
  return key in (_LOCK_KEY, "zarr.json") or bool(_GENERATION.match(key))


def file_above(path: str) -> str | None:
  """The nearest existing ancestor of `path` when it is not a directory (nothing fits below it)."""
  parent = os.path.dirname(path)
  while parent and not os.path.lexists(parent) and parent != os.path.dirname(parent):
    parent = os.path.dirname(parent)
  return parent if parent and os.path.lexists(parent) and not os.path.isdir(parent) else None


class Lock:
  """Exclusive right to write one path, held by process 0 of a save (or by an export).

  On a local file system the lock file is held with `flock`, which the kernel
  drops when the holder exits however it dies, so a lock left by a killed or
  unreaped writer, or left empty, never blocks. On an object store the lock is
  an object created only if absent; one left by a dead process of this host is
  taken over, any other must be deleted by hand (the error says which).
  """

  def __init__(self, target: _location.Location, token: int, durable: bool = True):
    self._target = target
    self._token = token
    self._durable = durable
    self._holder = json.dumps(
      {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start": _start_time(os.getpid()),
        "token": f"{token:016x}",
        "time": time.time(),
        "flock": True,
      }
    )
    self._path = None
    self._fd: int | None = None
    if target.local_dir is not None:
      parent, name = os.path.split(target.local_dir)
      self._path = os.path.join(parent, f".{name}.ucp-lock")

  def acquire(self) -> None:
    if self._path is None:
      self._acquire_kvstore()
      return
    make_dirs(os.path.dirname(self._path), durable=self._durable)
    deadline = time.monotonic() + _EXIT_GRACE_S
    for _ in range(1000):
      fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        holder = _read_text(self._path)
        if _dead_holder(holder) and time.monotonic() < deadline:
          time.sleep(0.02)  # its threads are still exiting: the kernel drops the flock then
          continue
        raise _errors.ConcurrentWriteError(self._busy_message(holder)) from None
      if not _same_file(fd, self._path):  # the holder released (unlinked) it meanwhile: retry
        os.close(fd)
        continue
      previous = _read_fd(fd)
      if _live_unflocked_holder(previous):  # an older ucp_jax, which did not flock
        os.close(fd)
        raise _errors.ConcurrentWriteError(self._busy_message(previous))
      os.ftruncate(fd, 0)
      os.pwrite(fd, self._holder.encode(), 0)
      self._fd = fd
      return
    raise _errors.ConcurrentWriteError(self._busy_message(_read_text(self._path)))

  def _acquire_kvstore(self) -> None:
    store = _location.kvstore(self._target)
    current = store.read(_LOCK_KEY).result()
    if current.state == "value" and not _stale_object_lock(current.value.decode(errors="replace")):
      raise _errors.ConcurrentWriteError(self._busy_message(current.value.decode(errors="replace")))
    # conditional, so that of two writers only one wins; read back, since a write whose
    # answer was lost is retried and then fails its condition although it was applied
    store.write(_LOCK_KEY, self._holder.encode(), if_equal=current.stamp.generation).result()
    if store.read(_LOCK_KEY).result().value.decode(errors="replace") != self._holder:
      raise _errors.ConcurrentWriteError(self._busy_message("another writer"))
    _HELD.add(f"{self._token:016x}")

  def _busy_message(self, holder: str) -> str:
    where = self._path or f"{self._target}/{_LOCK_KEY}"
    return (
      f"{self._target}: another save to this path is in progress (lock {where} held by "
      f"{holder.strip() or 'a writer that has not said who it is'}). If no such save is "
      "running, delete the lock."
    )

  def release(self) -> None:
    if self._path is None:
      _HELD.discard(f"{self._token:016x}")  # from now on a lock object left is stale
      store = _location.kvstore(self._target)
      tidy(self._target, "releasing the lock", lambda: store.write(_LOCK_KEY, None).result())
      return
    if self._fd is not None:
      fd, self._fd = self._fd, None
      try:
        with contextlib.suppress(FileNotFoundError):
          os.remove(self._path)  # before the flock goes, so nobody locks an unlinked file
      finally:
        os.close(fd)  # even on an interrupt: a flock left held would turn this process away


def lock_token(target: _location.Location) -> str | None:
  """The token of the save that holds the lock object of the object-store checkpoint
  `target` (None when nobody does, or the lock does not say)."""
  result = _location.kvstore(target).read(_LOCK_KEY).result()
  if result.state != "value":
    return None
  try:
    holder = json.loads(result.value.decode(errors="replace"))
  except ValueError:
    return None
  token = holder.get("token") if isinstance(holder, dict) else None
  return token if isinstance(token, str) else None


def remove_stale_staging(target: _location.Location) -> None:
  """Cleans up after saves to `target` that died (the caller holds the lock).

  A swap cut short (killed between the two renames of the fallback, or while undoing
  them) is first put in place (`_swap.recover`); the staging folders left are deleted.
  """
  if target.local_dir is None:
    return
  _swap.recover(target.local_dir)  # raises, deleting nothing, if it cannot
  for stale in _location.staging_dirs(target.local_dir):
    _swap.discard(stale)


def live_manifest(target: _location.Location) -> _manifest.Manifest | bool | None:
  """The committed manifest at an object-store `target`: None if there is none, False if it
  cannot be read (then nothing of the checkpoint is known to be dead)."""
  result = _location.kvstore(target).read(_manifest.MANIFEST_KEY).result()
  if result.state != "value":
    return None
  try:
    return _manifest.Manifest.from_bytes(result.value, str(target))
  except _errors.ManifestError:
    return False


def remove_dead_generations(target: _location.Location, live: _manifest.Manifest | bool | None):
  """On an object store: deletes the generations of saves that died (the caller holds the lock).

  Only `gTOKEN/` prefixes other than the live checkpoint's go; nothing at all when the live
  manifest cannot be read (`live` False), so a failed overwrite never costs the old data.
  """
  if target.local_dir is not None or live is False:
    return
  _delete_generations(target, keep=live.data if isinstance(live, _manifest.Manifest) else "")


def remove_replaced(target: _location.Location, new: str, old: _manifest.Manifest | bool | None):
  """After a commit on an object store: deletes what the replaced checkpoint held.

  Every generation but `new`, and the arrays (and their groups) of a replaced format
  version 1 checkpoint, which sit at the root. Nothing else below the root is touched.
  """
  if target.local_dir is not None:
    return
  _delete_generations(target, keep=new)
  if isinstance(old, _manifest.Manifest) and not old.data:
    store = _location.kvstore(target)
    groups = {"/".join(k.split("/")[:i]) for k in old.arrays for i in range(1, k.count("/") + 1)}
    futures = [store.delete_range(_location.prefix_range(key + "/")) for key in old.arrays]
    futures += [store.write(f"{group}/zarr.json", None) for group in groups]
    for f in futures:
      f.result()


def _delete_generations(target: _location.Location, keep: str) -> None:
  store = _location.kvstore(target)
  listed = store.list(_generation_range()).result()
  doomed = {m.group(0) for raw in listed for m in [_GENERATION.match(raw.decode())] if m}
  doomed.discard(keep)
  futures = [store.delete_range(_location.prefix_range(prefix)) for prefix in doomed]
  for f in futures:
    f.result()


def _generation_range():
  """The keys that may belong to generations (`g` followed by hex digits and a `/`)."""
  import tensorstore as ts

  return ts.KvStore.KeyRange("g", "h")


def commit(
  staging: _location.Location, target: _location.Location, manifest: bytes, *, durable: bool = True
) -> None:
  """Writes the manifest and makes the checkpoint visible at `target` in one step.

  Raises:
    CommitUncertainError: on an object store, the manifest's write failed and reading it
      back failed too, so whether it landed is not known (its answer may have been lost).
  """
  if staging.local_dir is None:
    _commit_object(target, manifest, durable)
    return
  path = os.path.join(staging.local_dir, _manifest.MANIFEST_KEY)
  with open(path, "wb") as f:
    f.write(manifest)
    if durable:
      f.flush()
      os.fsync(f.fileno())
  assert target.local_dir is not None  # a local staging folder is beside a local target
  if durable:
    _swap.fsync_dir(staging.local_dir)
  _swap.swap_into_place(staging.local_dir, target.local_dir, durable=durable)


def _commit_object(target: _location.Location, manifest: bytes, durable: bool) -> None:
  """The commit on an object store: one PUT of the manifest. A PUT that fails may have been
  applied all the same (its answer lost after the store took it), so the outcome is read back:
  the save failed only if the manifest there is not this one."""
  store = _location.kvstore(target, durable)
  try:
    store.write(_manifest.MANIFEST_KEY, manifest).result()
  except _errors.StorageError as failed:
    try:
      found = store.read(_manifest.MANIFEST_KEY).result()
    except _errors.StorageError as e:
      raise _errors.CommitUncertainError(
        f"{target}: the commit (writing {_manifest.MANIFEST_KEY}) failed ({_why(failed)}) and "
        f"reading it back failed too ({_why(e)}): the checkpoint there is whole, the one "
        "before or this save's; open it to see which step it holds. Nothing was deleted."
      ) from failed
    if found.state == "value" and found.value == manifest:
      return  # it landed: only its answer was lost
    raise


def _why(error: BaseException) -> str:
  """What went wrong, without the location `error`'s message starts with."""
  return str(error).split(": ", 1)[-1].rstrip(".")


def after_remote_commit(
  target: _location.Location, new: str, old: _manifest.Manifest | bool | None
) -> None:
  """Deletes, after a commit on an object store, what the checkpoint it replaced held. The
  commit is done: a deletion that fails leaves garbage for the next save, and a warning."""
  tidy(target, "deleting the replaced checkpoint's data", remove_replaced, target, new, old)


def tidy(target: _location.Location, what: str, fn, *args) -> None:
  """`fn(*args)`, a clean-up that may fail without harm: its failure is logged, not raised
  (what it would have deleted is collected by the next save to `target`)."""
  try:
    fn(*args)
  except Exception as e:  # an interrupt still propagates
    error = _location.storage_error(e, target, what)
    _LOG.warning("%s (left for the next save to collect)", error)


_LOG = logging.getLogger("ucp_jax")


def abort(staging: _location.Location, target: _location.Location) -> None:
  """Removes what a save wrote before it failed (and puts back, on a local file system, an
  old checkpoint that a swap which could not be undone left aside). On an object store a
  deletion that fails leaves garbage for the next save's collector, and a warning."""
  if staging.local_dir is not None:
    if staging != target and target.local_dir is not None:
      _swap.drop_staging(staging.local_dir, target.local_dir)
    return
  if staging.url != target.url:
    prefix = staging.url[len(target.url) :]
    store = _location.kvstore(target)
    tidy(
      target,
      "removing this save's data",
      lambda: store.delete_range(_location.prefix_range(prefix)).result(),
    )


def make_dirs(path: str, durable: bool = True) -> None:
  """`os.makedirs(path)`, each folder it creates fsynced into its parent (if `durable`).

  A checkpoint committed into a folder that the save created must not lose that folder,
  and the checkpoint with it, to a power loss: the commit fsyncs only the checkpoint's
  own parent.
  """
  missing = []
  folder = os.path.abspath(path)
  while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
    missing.append(folder)
    folder = os.path.dirname(folder)
  os.makedirs(path, exist_ok=True)
  for created in reversed(missing if durable else ()):
    _swap.fsync_dir(os.path.dirname(created))


def _same_file(fd: int, path: str) -> bool:
  try:
    return os.stat(path).st_ino == os.fstat(fd).st_ino
  except FileNotFoundError:
    return False


def _live_unflocked_holder(text: str) -> bool:
  """A lock written by a ucp_jax that did not flock, whose holder still runs here."""
  try:
    holder = json.loads(text)
  except ValueError:
    return False
  return isinstance(holder, dict) and not holder.get("flock") and not _dead_holder(text)


_HELD: set[str] = set()  # the tokens of the object-store locks this process holds


def _stale_object_lock(text: str) -> bool:
  """A lock object whose holder is gone: a dead process of this host, or this very process
  when it holds no lock of that token (its release failed, and the object stayed)."""
  if _dead_holder(text):
    return True
  try:
    holder = json.loads(text)
    mine = holder.get("host") == socket.gethostname() and int(holder.get("pid", -1)) == os.getpid()
  except (ValueError, TypeError, AttributeError):
    return False
  return (
    mine and holder.get("start") == _start_time(os.getpid()) and holder.get("token") not in _HELD
  )


def _dead_holder(text: str) -> bool:
  """The lock's holder ran on this host and has exited (or is a zombie, or its pid was reused)."""
  try:
    holder = json.loads(text)
    pid = int(holder.get("pid", -1))
  except (ValueError, TypeError, AttributeError):
    return False
  if holder.get("host") != socket.gethostname():
    return False
  if not _pid_alive(pid):
    return True
  start = holder.get("start")
  return start is not None and start != _start_time(pid)


def _pid_alive(pid: int) -> bool:
  """The process exists and is not a zombie (exited, waiting to be reaped)."""
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return _proc_stat(pid)[0:1] != ["Z"]


def _start_time(pid: int) -> int | None:
  """When the process started (clock ticks since boot): tells a reused pid apart."""
  fields = _proc_stat(pid)
  return int(fields[19]) if len(fields) > 19 else None


def _proc_stat(pid: int) -> list[str]:
  """The fields of /proc/PID/stat after the command name (empty where there is no /proc)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      text = f.read()
  except OSError:
    return []
  return text[text.rfind(")") + 2 :].split()


def _read_fd(fd: int) -> str:
  return os.pread(fd, 1 << 16, 0).decode(errors="replace")


def _read_text(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()
  except OSError:
    return "an unknown writer"
