"""Chunk files on a local disk, written without TensorStore in the way.

For uncompressed arrays in a local directory a zarr v3 chunk is just the raw little-endian
C-order bytes followed by their crc32c (`_direct` reads them). Writing a chunk that is a
contiguous block of a shard is then one checksum and one `writev`; the chunks of a bundle
(`_bundle`) go out in groups, each run of adjacent ones with one `pwritev`.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import struct
import threading
from collections.abc import Callable

import crc32c
import numpy as np

from ucp_jax.store import _bundle, _chunks, _regions, _threads
from ucp_jax.store._direct import chunk_path
from ucp_jax.store._regions import Region

MADE_DIRS_KEPT = 100_000
"""Directories remembered as made (no `makedirs` call for them again); past this many the
memory is cleared, a bound on what a long-running process keeps."""
_made_dirs: set[str] = set()
_made_dirs_lock = threading.Lock()


_GROUP_BYTES = 8 << 20
"""A bundle's chunks are written by one task per this many bytes: small chunks go out in one
`pwritev` each group, large ones in parallel."""


def write_region(
  array_dir: str,
  data: np.ndarray,
  region: Region,
  chunks: tuple[int, ...],
  shape,
  *,
  record: Callable[[tuple[int, ...], int], None],
  durable: bool = True,
  bundle: tuple[int, ...] | None = None,
  files: BundleFiles | None = None,
) -> list[concurrent.futures.Future]:
  """Starts writing `data` (the array's `region`, chunk-aligned) as chunk or bundle files.

  `record(index, crc, raw)` is called with each chunk's checksum (and its raw bytes, for
  a hash) once it is written;
  with `durable`, each file is fsynced once its last chunk is written. The chunks of
  a bundle (`_bundle`) are written in groups of about `_GROUP_BYTES`, in parallel, each
  at its own offset, and the index last. A bundle may take several calls (one per device
  shard it holds): `files`, shared by the calls of one save, keeps it open until all its
  chunks are written.
  """
  data = np.asarray(data)
  layout = None if bundle is None else _bundle.Layout(shape, chunks, bundle)
  encoded = math.prod(chunks) * data.dtype.itemsize + 4
  bundles: dict[tuple[int, ...], list] = {}
  jobs = []
  for index in _chunks.chunks_in(region, chunks):
    chunk = _chunks.chunk_region(index, chunks, shape)
    block = data[_regions.relative(chunk, region)]
    if layout is None:
      jobs.append(
        (_write_chunk, chunk_path(array_dir, index), index, block, chunks, record, durable)
      )
    else:
      where, _, offset = layout.slot(index, encoded)
      bundles.setdefault(where, []).append((offset, index, block))
  per_group = max(1, _GROUP_BYTES // encoded)
  files = files if files is not None else BundleFiles(durable)
  for where, items in bundles.items():
    target = files.get(chunk_path(array_dir, where), layout, where, encoded)
    items.sort(key=lambda item: item[0])
    groups = [items[i : i + per_group] for i in range(0, len(items), per_group)]
    jobs += [(_write_bundled, target, group, chunks, record) for group in groups]
  return [_threads.submit(*job) for job in jobs]


_IOV_MAX = 1024  # buffers one `pwritev` takes (os.sysconf("SC_IOV_MAX") on Linux)


def _encode(block: np.ndarray, chunks) -> tuple[memoryview, int]:
  raw = _chunks.raw_bytes(_chunks.padded(block, chunks))  # an edge chunk is stored padded
  return raw, crc32c.crc32c(raw)


def _write_chunk(path: str, index, block: np.ndarray, chunks, record, durable: bool) -> None:
  raw, crc = _encode(block, chunks)
  try:
    makedirs(os.path.dirname(path))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
      _write_all(fd, [raw, struct.pack("<I", crc)])
      if durable:
        os.fsync(fd)
    finally:
      os.close(fd)
  except OSError as e:
    raise OSError(e.errno, e.strerror, e.filename or path) from e
  record(index, crc, raw)


def _write_bundled(target: _BundleFile, group: list, chunks, record) -> None:
  """Writes a group of chunks of one bundle (sorted by offset), each run of adjacent ones
  with one `pwritev`."""
  try:
    try:  # whatever fails, `done` runs: the bundle's last writer closes the file
      encoded = [(offset, index, *_encode(block, chunks)) for offset, index, block in group]
      fd = target.fd()
      start, end = encoded[0][0], encoded[0][0]
      parts: list[bytes] = []
      for offset, _, raw, crc in encoded:
        if offset != end or len(parts) >= _IOV_MAX:
          _write_all(fd, parts, start)
          start, end, parts = offset, offset, []
        parts += [raw, struct.pack("<I", crc)]
        end += raw.nbytes + 4
      _write_all(fd, parts, start)
    finally:
      target.done(len(group))
  except OSError as e:
    raise OSError(e.errno, e.strerror, e.filename or target.path) from e
  for _, index, raw, crc in encoded:
    record(index, crc, raw)


class BundleFiles:
  """The bundle files one save has open: each is opened by its first write and closed, its
  index written and the file fsynced, by the write of its last chunk (one writer process
  writes every chunk of a bundle, `_owners`, in one or several `write_region` calls)."""

  def __init__(self, durable: bool):
    self._durable = durable
    self._open: dict[str, _BundleFile] = {}
    self._lock = threading.Lock()

  def get(self, path: str, layout: _bundle.Layout, where, encoded: int) -> _BundleFile:
    with self._lock:
      target = self._open.get(path)
      if target is None:
        index_at, index = layout.index_bytes(where, encoded)
        chunks = math.prod(layout.present(where))
        target = _BundleFile(path, index_at, index, chunks, self._durable, self._closed)
        self._open[path] = target
      return target

  def _closed(self, path: str) -> None:
    with self._lock:
      self._open.pop(path, None)

  def close(self) -> None:
    """Closes the files of bundles whose writes did not all happen (a save that failed)."""
    with self._lock:
      left, self._open = list(self._open.values()), {}
    for target in left:
      target.abandon()


class _BundleFile:
  """One bundle file being written by several tasks: opened by the first; its index written,
  the file fsynced and closed once all its chunks are. Not truncated: the staging folder is
  new, so nothing else is there."""

  def __init__(self, path: str, index_at: int, index: bytes, chunks: int, durable: bool, closed):
    self.path, self._index_at, self._index, self._durable = path, index_at, index, durable
    self._remaining = chunks  # chunks still to be written; each task reports its own
    self._closed = closed
    self._fd: int | None = None
    self._lock = threading.Lock()

  def fd(self) -> int:
    with self._lock:
      if self._fd is None:
        makedirs(os.path.dirname(self.path))
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
      return self._fd

  def done(self, chunks: int) -> None:
    with self._lock:
      self._remaining -= chunks
      if self._remaining > 0 or self._fd is None:
        return
      fd, self._fd = self._fd, None
    self._closed(self.path)
    try:
      _write_all(fd, [self._index], self._index_at)  # last: the file grows once, in order
      if self._durable:
        os.fsync(fd)
    finally:
      os.close(fd)

  def abandon(self) -> None:
    with self._lock:
      fd, self._fd = self._fd, None
    if fd is not None:
      os.close(fd)


def _write_all(fd: int, parts: list, offset: int | None = None) -> None:
  """`os.writev` (`os.pwritev` at `offset`) until every byte is written (one call writes at
  most ~2 GiB on Linux)."""
  views = [memoryview(p).cast("B") for p in parts]
  while views:
    if offset is None:
      written = os.writev(fd, views)
    else:
      written = os.pwritev(fd, views, offset)
      offset += written
    while written and views:
      if written >= views[0].nbytes:
        written -= views[0].nbytes
        views.pop(0)
      else:
        views[0], written = views[0][written:], 0
    views = [v for v in views if v.nbytes]


def makedirs(path: str) -> None:
  if path in _made_dirs:
    return
  os.makedirs(path, exist_ok=True)
  with _made_dirs_lock:
    if len(_made_dirs) > MADE_DIRS_KEPT:
      _made_dirs.clear()
    _made_dirs.add(path)
