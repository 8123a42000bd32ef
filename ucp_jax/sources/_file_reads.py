"""Slices of an array stored as one C-order run of bytes in a file, read with `pread`.

A device's slice of a row-sharded array is one contiguous range of the file: it is read
straight into the aligned buffer the device adopts (one copy, from the page cache, as
numpy's own file reads do). Slices that cut the trailing dimensions are grouped by the rows
they span: when together they need whole rows (this process holds every column), the rows
are read once, into a buffer they share, and each slice is copied out; otherwise only the
span of columns they need is read, row by row. Either way each byte is read at most once
per process. Nothing is memory-mapped, so the process's resident memory holds the restored
arrays only. `_byte_runs.start_read` (store) runs the tasks planned here.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.store import _byte_runs, _hostmem

Region = tuple[slice, ...]


def tensor_reads(
  path: str, offset: int, shape: tuple[int, ...], dtype, regions: list[Region], identity=()
) -> list[_byte_runs.Task]:
  """The tasks that read `regions` of the array at byte `offset` of `path`
  (`_byte_runs.start_read` runs them).

  `identity` (device, inode, size, mtime), when given, is the file's when its header was
  checked: a file put at `path` since is refused rather than read.
  """
  dtype = np.dtype(dtype)
  if sys.byteorder != "little" and dtype.itemsize > 1:
    raise SourceFormatError(f"{path}: little-endian data on a big-endian host")
  row = math.prod(shape[1:]) * dtype.itemsize
  by_rows: dict[tuple[int, int], list[int]] = {}
  tasks = []
  for i, region in enumerate(regions):
    if _contiguous(region, shape):
      at = offset + (region[0].start * row if shape else 0)
      tasks.append(_byte_runs.Task(_read_run, (i,), (path, at, identity)))
    else:
      by_rows.setdefault((region[0].start, region[0].stop), []).append(i)
  for (start, stop), users in by_rows.items():
    group = [regions[i] for i in users]
    block = (slice(start, stop), *_columns(group, shape))
    args = (path, offset, shape, dtype, block, group, identity)
    tasks.append(_byte_runs.Task(_read_shared, tuple(users), args))
  return tasks


def _contiguous(region: Region, shape: tuple[int, ...]) -> bool:
  """Whether `region` is one run of the C-order array: full in every dimension after the first."""
  return all(s.start == 0 and s.stop == n for s, n in zip(region[1:], shape[1:]))


def _columns(regions: list[Region], shape: tuple[int, ...]) -> tuple[slice, ...]:
  """The second dimension's span the regions need together (whole trailing dims past it)."""
  if len(shape) < 2:
    return ()
  lo = min(r[1].start for r in regions)
  hi = max(r[1].stop for r in regions)
  return (slice(lo, hi), *(slice(0, n) for n in shape[2:]))


def _read_run(outs: list[np.ndarray], path: str, at: int, identity) -> None:
  """Reads a region that is one run of the file straight into its buffer."""
  (out,) = outs
  _pread(path, at, out, identity)


def _read_shared(outs, path, offset, shape, dtype, block: Region, regions, identity) -> None:
  """Reads `block` (rows, and a column span with whole trailing dims) once into `regions`
  (a region that is not one run: the array has at least two dimensions)."""
  row = math.prod(shape[1:]) * dtype.itemsize
  order = _tiling(block, regions, shape)
  if order is not None:  # each row lands in the regions' buffers, side by side
    _scatter_rows(path, offset + block[0].start * row, [outs[i] for i in order], identity)
    return
  rows = _hostmem.aligned_empty(tuple(s.stop - s.start for s in block), dtype)  # pooled: warm
  if _contiguous(block, shape):
    _pread(path, offset + block[0].start * row, rows, identity)
  else:  # each row's span of columns is one run
    first = block[1].start * math.prod(shape[2:]) * dtype.itemsize
    for i in range(rows.shape[0]):
      _pread(path, offset + (block[0].start + i) * row + first, rows[i], identity)
  origin = tuple(s.start for s in block)
  for region, out in zip(regions, outs):
    out[...] = rows[tuple(slice(s.start - o, s.stop - o) for s, o in zip(region, origin))]


def _tiling(block: Region, regions: list[Region], shape: tuple[int, ...]) -> list[int] | None:
  """The regions in column order when, side by side, they are exactly the whole rows of
  `block` (a model axis over the columns, whole trailing dims); else None."""
  if not _contiguous(block, shape) or any(not _contiguous(r[1:], shape[1:]) for r in regions):
    return None
  order = sorted(range(len(regions)), key=lambda i: regions[i][1].start)
  edge = 0
  for i in order:
    if regions[i][1].start != edge:
      return None
    edge = regions[i][1].stop
  return order if edge == shape[1] else None


_IOV_MAX = 1024
"""The most buffers one `preadv` takes (Linux's IOV_MAX)."""


def _scatter_rows(path: str, at: int, outs: list[np.ndarray], identity) -> None:
  """Reads whole rows from byte `at`, each row's bytes split over `outs` (the same rows, their
  columns side by side) with `preadv`: no staging buffer, no copy."""
  rows = [out.reshape(out.shape[0], -1).view(np.uint8) for out in outs]
  per_call = max(1, _IOV_MAX // len(rows))
  fd = open_unchanged(path, identity)
  try:
    for first in range(0, rows[0].shape[0], per_call):
      last = min(first + per_call, rows[0].shape[0])
      buffers = [r[i] for i in range(first, last) for r in rows]
      want = sum(r.shape[1] for r in rows) * (last - first)
      if os.preadv(fd, buffers, at) != want:  # short: page by page, as the run loop reads
        for buffer in buffers:
          pread_into(fd, path, at, buffer, "a tensor")
          at += buffer.nbytes
        continue
      at += want
  finally:
    os.close(fd)


def _pread(path: str, start: int, out: np.ndarray, identity=()) -> None:
  fd = open_unchanged(path, identity)
  try:
    pread_into(fd, path, start, out, "a tensor")
  finally:
    os.close(fd)


def open_unchanged(path: str, identity=()) -> int:
  """A descriptor of the file at `path`, opened for reading.

  Raises:
    SourceFormatError: it is not the file whose `identity` (device, inode, size, mtime) was
      taken when its header was checked (a file put at `path` since, or rewritten).
  """
  fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
  try:
    st = os.fstat(fd)
    if identity and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != tuple(identity):
      raise SourceFormatError(
        f"{path}: changed since it was opened (replaced or rewritten); open it again"
      )
  except BaseException:
    os.close(fd)
    raise
  return fd


def pread_into(fd: int, path: str, at: int, out: np.ndarray, inside: str) -> None:
  """Fills the C-contiguous `out` from byte `at` of the open file `path` (`_byte_runs.read_full`);
  a file that ends first is an error naming what it ends `inside`."""
  view = _byte_runs.byte_view(out)
  done = _byte_runs.read_full(fd, at, view)
  if done < view.nbytes:
    raise SourceFormatError(f"{path}: ends at byte {at + done}, inside {inside}")
