"""The chunks of DCP tensors, read lazily from the rank files with `pread`.

Each chunk is a whole `torch.save` file inside a `.distcp` file (`_metadata`). When a chunk
is first read, the safe reader locates that span (`torch._torch_file.load_from` with a `span`,
`locate`: its zip directory and pickle are read, no tensor bytes) and checks it: a tensor of
the chunk's sizes and the declared dtype whose elements are one little-endian C-order run of
the file (DCP saves compact clones). From then on the chunk is that run's byte offset: a
region read takes from each chunk it meets only the bytes under it, one `pread` per contiguous
run (the part's rows where it spans the trailing dimensions whole, else each row's span of
columns), into the caller's buffer. Nothing stays mapped. On an object store (a `gs://`,
`s3://`, `memory://` or `file://` URL) the same reads are byte-range requests, the runs of one
read fetched as one range, each rank file pinned to the generation first read.

`tensor(...)` gives a `Tensor` of the source plan whose `store` is a lazy TensorStore: each
cell it reads (the chunks a converted checkpoint would have, split further to at most
`CELL_BYTES`) reads the bytes under it, so a restore onto a JAX mesh reads the bytes under
each device's slice (rounded to cells) and no others. `pieces` (for `convert`) is the whole
array, read the same way into one buffer.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
from typing import Any

import numpy as np

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _byte_span, _file_reads, _files, _remote
from ucp_jax.sources._source_plan import Tensor, lazy_store
from ucp_jax.sources._torch_reader import _torch_file
from ucp_jax.sources.dcp import _tiling
from ucp_jax.sources.dcp._metadata import Chunk, Stored, TensorEntry
from ucp_jax.store import _regions, _untrusted, _zarr

CELL_BYTES = 1 << 20
"""The most a lazy read of a view asks of the chunks at once (a TensorStore cell)."""

Region = _regions.Region


class RankFiles:
  """The rank files of one DCP folder; where each chunk's elements start, found once."""

  def __init__(self, folder: str, fs: _files.Files | None = None):
    self.folder = folder
    self._starts: dict[tuple[str, Chunk], int] = {}
    self._remote = _remote.Folder.at(folder) if (fs or _files.for_path(folder)).remote else None
    self._objects: dict[str, _remote.ObjectBlob] = {}
    self._lock = threading.Lock()

  def _object(self, name: str) -> _remote.ObjectBlob:
    """The rank file `name` on the object store: one blob, so one generation, for all reads."""
    with self._lock:
      if name not in self._objects:
        self._objects[name] = _remote.ObjectBlob(self._remote, name)
      return self._objects[name]

  def load(self, stored: Stored, what: str) -> Any:
    """The object of one `torch.save` blob, read safely (tensors map the file meanwhile)."""
    path = os.path.join(self.folder, stored.file)
    span = (stored.offset, stored.length)
    try:
      if self._remote is None:
        return _torch_file.load(path, span=span)
      if stored.length > _files.MAX_SMALL_FILE_BYTES:
        raise SourceFormatError(
          f"{path}: {what} is stored in {stored.length} bytes; an object of more than "
          f"{_files.MAX_SMALL_FILE_BYTES} bytes is not read whole from an object store"
        )
      data = self._object(stored.file).pread(stored.offset, stored.length)
      return _torch_file.load_from(_byte_span.BytesBlob(data), f"{path}[{span[0]}:]")
    except SourceFormatError as e:
      raise type(e)(f"{e} ({what})") from e
    except OSError as e:
      raise SourceFormatError(f"{path}: cannot read {what} ({e.strerror or e})") from e

  def _locate_span(self, stored: Stored, what: str) -> Any:
    """The object of one `torch.save` blob, its tensors located (`ByteSpan`s), not read."""
    path = os.path.join(self.folder, stored.file)
    span = (stored.offset, stored.length)
    try:
      if self._remote is not None:
        return _torch_file.load_from(self._object(stored.file), path, span=span, locate=True)
      with _untrusted.open_regular(path) as f:
        return _torch_file.load_from(_byte_span.FileBlob(f), path, span=span, locate=True)
    except SourceFormatError as e:
      raise type(e)(f"{e} ({what})") from e
    except OSError as e:
      raise SourceFormatError(f"{path}: cannot read {what} ({e.strerror or e})") from e

  def start(self, entry: TensorEntry, chunk: Chunk) -> int:
    """The byte of its rank file where the chunk's elements start, checked once."""
    found = self._starts.get((entry.key, chunk))
    if found is None:
      found = self._starts[(entry.key, chunk)] = self._locate(entry, chunk)
    return found

  def _locate(self, entry: TensorEntry, chunk: Chunk) -> int:
    what = f"`{entry.key}` chunk at {chunk.offsets}"
    data = self._locate_span(chunk.stored, what)
    shown = f"{os.path.join(self.folder, chunk.stored.file)}: {what}"
    if not isinstance(data, _byte_span.ByteSpan):
      raise SourceFormatError(f"{shown} holds a {type(data).__name__}, not a tensor")
    shape = (data.size,) if data.shape is None else data.shape
    if shape != chunk.sizes or data.dtype != entry.dtype:
      raise SourceFormatError(
        f"{shown} holds a {data.dtype} tensor of shape {shape}; the metadata says "
        f"{entry.dtype} of sizes {chunk.sizes}"
      )
    if not data.contiguous or data.swapped or sys.byteorder != "little":
      raise SourceFormatError(
        f"{shown} is not one little-endian C-order run of its file (a strided or big-endian "
        "tensor, which dcp.save does not write)"
      )
    return data.file_offset()

  def read(self, entry: TensorEntry, chunk: Chunk, part: Region, out: np.ndarray) -> None:
    """Reads `part` (in the chunk's own coordinates) of a chunk into `out`, run by run."""
    sizes = chunk.sizes
    itemsize = np.dtype(entry.dtype).itemsize
    strides = [math.prod(sizes[d + 1 :]) * itemsize for d in range(len(sizes))]
    k = max(0, len(sizes) - 1)  # each run spans dimensions k.. (those after k whole)
    while k > 0 and (part[k].start, part[k].stop) == (0, sizes[k]):
      k -= 1
    start = self.start(entry, chunk)
    runs = []  # (byte of the rank file, where its elements go)
    for lead in itertools.product(*(range(s.start, s.stop) for s in part[:k])):
      at = start + sum(i * s for i, s in zip(lead, strides))
      at += part[k].start * strides[k] if sizes else 0
      runs.append((at, out[(*(i - s.start for i, s in zip(lead, part[:k])), Ellipsis)]))
    if self._remote is not None:
      self._fetch_runs(chunk.stored.file, runs)
      return
    path = os.path.join(self.folder, chunk.stored.file)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO put there: refused
    try:
      _untrusted.check_regular(fd, path)
      for at, target in runs:
        if target.flags.c_contiguous:
          _pread(fd, path, at, target)
        else:  # a cell's part narrower than the cell: read the run, then place it
          run = np.empty(target.shape, target.dtype)
          _pread(fd, path, at, run)
          target[...] = run
    finally:
      os.close(fd)

  def _fetch_runs(self, name: str, runs: list[tuple[int, np.ndarray]]) -> None:
    """The runs of one region read from an object: one range request from the first run's
    start to the last run's end (a cell's runs lie close together), copied out."""
    first = runs[0][0]
    data = self._object(name).pread(first, runs[-1][0] + runs[-1][1].nbytes - first)
    for at, target in runs:
      run = np.frombuffer(data, target.dtype, target.size, at - first)
      target[...] = run.reshape(target.shape)


def _pread(fd: int, path: str, at: int, out: np.ndarray) -> None:
  """Fills the C-contiguous `out` from byte `at` of an open rank file: the one place chunk
  elements are read."""
  _file_reads.pread_into(fd, path, at, out, "a chunk")


class Reader:
  """Region reads of one tensor from its chunks (those a region meets found by `_tiling.Index`),
  straight from the rank files: callable from a lazy array's cell callback, which must not wait
  on another TensorStore read."""

  def __init__(self, files: RankFiles, entry: TensorEntry, where: str):
    self._files = files
    self._entry = entry
    self._where = where
    self._index = _tiling.Index(entry.chunks)

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(self._entry.dtype)

  def read(self, region: Region, out: np.ndarray | None = None) -> np.ndarray:
    """`region` of the tensor (into `out`, if given), from the chunks under it only."""
    entry = self._entry
    if out is None:
      shape = tuple(s.stop - s.start for s in region)
      _untrusted.check_allocation(math.prod(shape) * entry.dtype.itemsize, self._where)
      out = np.empty(shape, entry.dtype)
    if not out.size:
      return out
    for chunk in self._index.under(region):
      box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
      part = _regions.overlap(box, region) if region else ()
      if part is None:
        continue
      local = tuple(slice(p.start - b.start, p.stop - b.start) for p, b in zip(part, box))
      self._files.read(entry, chunk, local, out[_regions.relative(part, region)])
    return out

  def pieces(self) -> list[np.ndarray]:
    """The whole array, read into one buffer (for `convert`)."""
    return [self.read(_regions.full(self._entry.shape)).reshape(-1)]


COMPARE_BYTES = 16 << 20
"""The most `same_bytes` holds of each tensor at once."""


def same_bytes(files: RankFiles, a: TensorEntry, b: TensorEntry) -> bool:
  """Whether tensors `a` and `b` (of one shape and dtype) hold the same bytes, compared a
  block at a time: memory stays bounded however large they declare themselves."""
  readers = [Reader(files, e, f"{files.folder}: `{e.key}`") for e in (a, b)]
  for region in _blocks(a.shape, np.dtype(a.dtype).itemsize, COMPARE_BYTES):
    x, y = (reader.read(region) for reader in readers)
    if x.tobytes() != y.tobytes():
      return False
  return True


def _blocks(shape: tuple[int, ...], itemsize: int, limit: int):
  """Regions that cover `shape` in C order, each of at most `limit` bytes (or one element)."""
  k = 0  # the dimension cut into steps: the dimensions after it fit in `limit` whole
  while k < len(shape) - 1 and math.prod(shape[k + 1 :]) * itemsize > limit:
    k += 1
  if not shape:
    yield ()
    return
  inner = math.prod(shape[k + 1 :]) * itemsize
  step = max(1, limit // max(inner, 1))
  rest = tuple(slice(0, n) for n in shape[k + 1 :])
  for lead in itertools.product(*(range(n) for n in shape[:k])):
    for start in range(0, shape[k], step):
      cut = slice(start, min(start + step, shape[k]))
      yield (*(slice(i, i + 1) for i in lead), cut, *rest)


def tensor(files: RankFiles, entry: TensorEntry, where: str) -> Tensor:
  """`entry` as a plan `Tensor`: lazy `pieces` and a lazy TensorStore (`store`)."""
  reader = Reader(files, entry, where)
  itemsize = np.dtype(entry.dtype).itemsize
  cells = _zarr.choose_chunks(entry.shape, shard_shape(entry), itemsize, CELL_BYTES)

  store = lazy_store(entry.shape, entry.dtype, cells, reader.read)
  return Tensor(entry.shape, np.dtype(entry.dtype), reader.pieces, where, store=store)


def shard_shape(entry: TensorEntry) -> tuple[int, ...]:
  """The chunk grid's block shape, where the chunks form one (DTensor shards); else the shape."""
  shape = entry.shape
  if not shape or not entry.chunks:
    return shape
  block = tuple(max(c.sizes[d] for c in entry.chunks) for d in range(len(shape)))
  if not all(b and o % b == 0 for c in entry.chunks for o, b in zip(c.offsets, block)):
    return shape
  return block
