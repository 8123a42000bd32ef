"""Incremental saves: an array unchanged since a base checkpoint is not written again.

The tree layer decides which arrays are unchanged (`tree/_unchanged`); this module says
whether the base can give an array (`compatible`: the same shape, dtype, chunk grid,
bundles and codec, its checksums recorded) and puts the base's files into the new
checkpoint. On a local disk each file is hard-linked into the staging folder, so the new
checkpoint holds a directory entry of its own for every file: deleting or overwriting
the base (or `rm -rf` of it) unlinks only the base's entries, and the data stays for as
long as any checkpoint names it. Where a link cannot be made (another file system, a
file system without hard links, a file at its link limit) the file is copied. On an
object store the new manifest references the base's generation in their shared pool
instead (`_pool`).

Nothing ever writes into an existing file: a save writes new files in a fresh staging
folder, so a file shared by several checkpoints never changes. The new manifest carries
the base's checksums for a reused array, so each of its chunks is checked by place like
a chunk the save wrote: a base file that changed after the base was saved fails every
read and `verify` of the new checkpoint too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import stat
import threading
from typing import Any

from ucp_jax.base import _errors
from ucp_jax.store import (
  _chunk_writes,
  _chunks,
  _direct,
  _location,
  _manifest,
  _shards,
  _threads,
  _untrusted,
)
from ucp_jax.store._regions import Region

_CANNOT_LINK = frozenset(
  {errno.EXDEV, errno.EMLINK, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
)
"""Why a hard link may be impossible where a copy is not: another file system, the file's
link limit (65,000 on ext4), a file system or mount that does not link."""


class Unavailable(Exception):
  """A base file that cannot be reused (missing, or not a regular file): write the region."""


def compatible(
  base: _manifest.ArrayInfo | None, info: _manifest.ArrayInfo, compression: str | None
) -> bool:
  """Whether the base's stored array can stand for `info` saved with `compression`: the
  same logical array stored the same way (an array with another shape, dtype, chunk grid,
  bundles or codec is written anew), with a checksum per chunk to check it by."""
  return (
    base is not None
    and base.checksums is not None
    and (base.shape, base.dtype, base.chunks, base.bundle)
    == (info.shape, info.dtype, info.chunks, info.bundle)
    and (base.kind, base.python_type, base.prng_impl)
    == (info.kind, info.python_type, info.prng_impl)
    and base.compression == compression
  )


def reachable(base: Any, target: _location.Location, pool: _location.Location | None) -> bool:
  """Whether a save to `target` can take arrays from the checkpoint `base` (a Checkpoint):
  on a local disk from a local one (by link, or copy); on an object store from one whose
  arrays are in `pool`, the pool the save writes to."""
  if target.local_dir is not None:
    return base.location.local_dir is not None
  return (
    pool is not None
    and base.pool is not None
    and (base.pool.url, base.pool.spec) == (pool.url, pool.spec)
  )


def file_indices(info: _manifest.ArrayInfo, regions: list[Region]) -> list[tuple[int, ...]]:
  """The grid indices of the files (chunk or bundle files) that make up `regions`, each
  once (a bundle may hold several regions: the device shards of one process)."""
  if not info.shape:
    return [()] if regions else []
  unit = info.bundle or info.chunks
  return list(dict.fromkeys(i for region in regions for i in _chunks.chunks_in(region, unit)))


def sharing_files(info: _manifest.ArrayInfo, regions: list[Region]) -> list[list[Region]]:
  """`regions` in groups that share no file with another group (a bundle may hold several
  regions: the device shards of one process), so each group is linked, or written
  instead, whole."""
  groups: list[tuple[list[Region], set]] = []
  for region in regions:
    files = set(file_indices(info, [region]))
    joined = [g for g in groups if g[1] & files]
    merged = ([region], files)
    for g in joined:
      merged[0][:0] = g[0]
      merged[1].update(g[1])
      groups.remove(g)
    groups.append(merged)
  return [g[0] for g in groups]


class Linker:
  """Puts the files of reused arrays from a local base into a local staging folder.

  Args:
    base_data: where the base's arrays are (pinned: reads go through an open descriptor,
      so a base replaced during the save is still the one that was opened).
    staging_dir: the new checkpoint's staging folder.
    base_durable: whether the base was saved durably (its files are on stable storage);
      otherwise each linked file is fsynced when `durable`.
    durable: whether this save is.
  """

  def __init__(
    self, base_data: _location.Location, staging_dir: str, *, base_durable: bool, durable: bool
  ):
    self._base = base_data
    self._staging = staging_dir
    self._fsync_links = durable and not base_durable
    self._durable = durable
    self.copied = 0  # files that could not be linked (counted for tests and reports)
    self._lock = threading.Lock()

  def start(self, key: str, info: _manifest.ArrayInfo, regions: list[Region]):
    """Starts linking the files of `regions` of `key`; returns a future that raises
    `Unavailable` if the base does not have them all (the caller writes the regions then)."""
    return _threads.submit(self._link_all, key, file_indices(info, regions))

  def _link_all(self, key: str, names: list) -> None:
    assert self._base.local_dir is not None  # links are made on a local disk only
    for index in names:
      src = _direct.chunk_path(self._base.io_path(key), index)
      dst = _direct.chunk_path(os.path.join(self._staging, key), index)
      self._link(src, dst, _direct.chunk_path(os.path.join(self._base.local_dir, key), index))

  def discard(self, key: str, info: _manifest.ArrayInfo, regions: list[Region]) -> None:
    """Removes what `start` linked of `regions`, before they are written instead (a write
    never goes into a linked file: that would change the base's file too)."""
    for index in file_indices(info, regions):
      with contextlib.suppress(FileNotFoundError):
        os.unlink(_direct.chunk_path(os.path.join(self._staging, key), index))

  def _link(self, src: str, dst: str, shown: str) -> None:
    try:
      mode = os.lstat(src).st_mode
    except (FileNotFoundError, NotADirectoryError):
      raise Unavailable(f"{shown}: missing from the base") from None
    if not stat.S_ISREG(mode):
      raise Unavailable(f"{shown}: {_untrusted.not_regular(mode)}")
    _chunk_writes.makedirs(os.path.dirname(dst))
    try:
      os.link(src, dst, follow_symlinks=False)
    except FileNotFoundError:
      raise Unavailable(f"{shown}: missing from the base") from None
    except OSError as e:
      if e.errno not in _CANNOT_LINK:
        raise
      self._copy(src, dst, shown)
      return
    if self._fsync_links:
      _fsync(dst)

  def _copy(self, src: str, dst: str, shown: str) -> None:
    try:
      source = _untrusted.open_regular(src, Unavailable, buffered=False)
    except FileNotFoundError:
      raise Unavailable(f"{shown}: missing from the base") from None
    with source, open(dst, "xb", buffering=0) as out:
      _copy_bytes(source, out)
      if self._durable:
        os.fsync(out.fileno())
    with self._lock:
      self.copied += 1


def _copy_bytes(source, out) -> None:
  """All of `source` into `out`, in the kernel where it can (a reflink on XFS and btrfs)."""
  size = os.fstat(source.fileno()).st_size
  done = 0
  try:
    while done < size:
      n = os.copy_file_range(source.fileno(), out.fileno(), size - done)
      if not n:
        break
      done += n
  except (OSError, AttributeError):  # not between these file systems, or no such call
    source.seek(done)
    out.seek(done)
    shutil.copyfileobj(source, out, 8 << 20)


def _fsync(path: str) -> None:
  fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def link_owned(
  base: Any,
  staging_dir: str,
  entries: list,
  *,
  primary: bool,
  durable: bool,
  started: list,
  target: _location.Location,
) -> list:
  """Links the files of every region of the reused `entries` (`_shards.Entry`) that this
  process would have written, from the local checkpoint `base` into `staging_dir`; adds
  each link's future to `started` (an abort waits for them). Returns entries that write
  instead the regions the base could not give, from memory.

  Raises:
    CorruptCheckpointError: a region the base could not give, which `save_async` holds no
      copy of.
  """
  linker = Linker(
    base.array_location(entries[0].key),
    staging_dir,
    base_durable=bool(base.manifest.durable),
    durable=durable,
  )
  jobs = []
  for entry in entries:
    for regions in sharing_files(entry.info, _shards.owned_regions(entry, primary)):
      jobs.append((entry, regions, linker.start(entry.key, entry.info, regions)))
  started += [job[-1] for job in jobs]
  rewrite: dict[str, list] = {}
  for entry, regions, future in jobs:
    try:
      future.result()
    except Unavailable as e:  # written instead: every region of the files they share
      linker.discard(entry.key, entry.info, regions)
      for region in regions:
        data = _shards.region_data(entry, region)
        if data is None:
          raise _errors.CorruptCheckpointError(
            f"{target}: `{entry.key}` is unchanged since the base, but {e}, and this "
            "save_async holds no copy of it to write instead; save again (without the base)"
          ) from None
        rewrite.setdefault(entry.key, []).append((region, data))
  return [
    dataclasses.replace(e, reuse=False, value=None, owned=tuple(rewrite[e.key]))
    for e in entries
    if e.key in rewrite
  ]
