"""Chunk files on a local disk, read without TensorStore in the way (`_chunk_writes` writes them).

For uncompressed arrays in a local directory a zarr v3 chunk is just the raw
little-endian C-order bytes followed by their crc32c. Writing a chunk that is a
contiguous block of a shard is then one checksum and one `writev`, and reading a
chunk that lands contiguously in a device's slice is one `pread` straight into
the buffer the device adopts (`_byte_runs` starts the reads): one copy from the
page cache, like raw numpy file I/O. A chunk that feeds several slices is mapped
(`mmap`), checked, and copied from the page cache into each. Everything else
(object stores, compression, mapped views) goes through TensorStore, which reads
the same files.

Each chunk read is checked twice: against its own crc32c trailer (the bytes are
intact) and against the manifest's entry for its place (`expected`: the bytes are
the ones this save wrote there, not another chunk's or another save's).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import mmap
import os
import struct
import sys
import threading

import crc32c
import numpy as np

from ucp_jax.base import _errors
from ucp_jax.store import _bundle, _byte_runs, _chunks, _regions, _untrusted
from ucp_jax.store._manifest import ArrayInfo

ENABLED = sys.byteorder == "little"
"""Off where the host is big-endian (the files are little-endian); tests may switch it off."""

Region = _regions.Region


def chunk_path(array_dir: str, index: tuple[int, ...]) -> str:
  """The file of chunk `index` under zarr v3's default chunk key encoding."""
  return os.path.join(array_dir, "c", *map(str, index))


@dataclasses.dataclass(frozen=True)
class ArrayFiles:
  """Where one stored array's chunk files are, and what they must hold.

  Attributes:
    io_dir: the directory reads go through (possibly `/proc/self/fd/N/KEY`).
    shown_dir: the same directory as the user named it, for messages.
    key: the array's key.
    info: its manifest entry (dtype, chunks, shape, checksums).
    pin: whatever keeps `io_dir` valid (the open directory descriptor) while these files
      are read.
  """

  io_dir: str
  shown_dir: str
  key: str
  info: ArrayInfo
  pin: object = dataclasses.field(default=None, compare=False, repr=False)

  @functools.cached_property
  def _bundles(self) -> tuple[_bundle.Layout, int, dict, threading.Lock] | None:
    """(layout, encoded chunk size, indexes read so far, their lock) of a bundled array."""
    info = self.info
    if info.bundle is None:
      return None
    encoded = math.prod(info.chunks) * np.dtype(info.dtype).itemsize + 4
    return _bundle.Layout(info.shape, info.chunks, info.bundle), encoded, {}, threading.Lock()

  def chunk(self, index: tuple[int, ...]) -> tuple[str, str, int | None]:
    """(path to open, path to show, byte offset) of chunk `index`, without reading anything.

    The offset is None for a chunk that is a file of its own; in a bundle it is where a
    save puts the chunk (`_bundle`). A read there that fails its checks looks the chunk up
    in the bundle's index (`indexed`), which a writer of another layout would have followed.
    """
    if self._bundles is None:
      return chunk_path(self.io_dir, index), chunk_path(self.shown_dir, index), None
    layout, encoded, _, _ = self._bundles
    where, _, offset = layout.slot(index, encoded)
    return chunk_path(self.io_dir, where), f"{self.shown_dir}/{layout.name(index)}", offset

  def check_file(self, index: tuple[int, ...]) -> None:
    """Raises `CorruptCheckpointError` if the file that holds chunk `index` is there but is
    not a regular file inside the checkpoint (for reads that TensorStore makes: it would
    block on a FIFO); a missing file is left to the read to report."""
    path, shown, _ = self.chunk(index)
    try:
      _open_chunks(self, path, shown).close()
    except (FileNotFoundError, NotADirectoryError):
      pass
    except OSError as e:
      raise _store_error(e, shown, self.key) from e

  def indexed(self, index: tuple[int, ...]) -> tuple[str, str, int] | None:
    """Where the bundle's index puts chunk `index`, when that is not where `chunk` looked
    (None: the same place, or not bundled).

    Raises:
      CorruptCheckpointError: the bundle file is missing, or its index is damaged, points
        past its chunks, marks the chunk missing or gives it the wrong size.
    """
    if self._bundles is None:
      return None
    layout, encoded, tables, lock = self._bundles
    where, entry, canonical = layout.slot(index, encoded)
    path, shown = chunk_path(self.io_dir, where), f"{self.shown_dir}/{layout.name(index)}"
    with lock:  # the chunks of a bundle are read by several threads at once
      table = tables.get(where)
      if table is None:
        table = tables[where] = _read_index(self, path, chunk_path(self.shown_dir, where))
    offset, nbytes = (int(n) for n in table[entry])
    if offset == _bundle.MISSING and nbytes == _bundle.MISSING:
      raise _errors.CorruptCheckpointError(f"{shown}: `{self.key}`: chunk missing from its bundle")
    if nbytes != encoded:
      raise _errors.CorruptCheckpointError(
        f"{shown}: `{self.key}`: the bundle's index gives the chunk {nbytes} bytes, "
        f"expected {encoded}"
      )
    return None if offset == canonical else (path, shown, offset)

  def index_problems(self) -> list[str]:
    """What is wrong with the bundle files' indexes, which reads here skip but zarr readers
    follow (for `verify`): a damaged index, a chunk it marks missing or sizes wrongly, or a
    place that holds other bytes than the chunk a save put where reads here look."""
    if self._bundles is None:
      return []
    problems: dict[str, None] = {}  # in order, once each (a bad index fails every chunk)
    for index in itertools.product(*(range(n) for n in self._bundles[0].chunk_grid)):
      try:
        moved = self.indexed(index)
        if moved is not None:  # another layout than a save writes: check what it points at
          _read_into(self, index, np.empty(self.info.chunks, self.info.dtype), *moved)
      except _errors.CorruptCheckpointError as e:
        problems[str(e).replace(f": `{self.key}`", "")] = None
    return list(problems)


def _read_index(files: ArrayFiles, path: str, shown: str) -> np.ndarray:
  """The checked index table of the bundle file at `path`."""
  bundles = files._bundles
  assert bundles is not None  # only a bundled array's files have indexes
  layout = bundles[0]
  try:
    with _open_chunks(files, path, shown) as f:
      size = os.fstat(f.fileno()).st_size
      data_end = size - layout.index_nbytes
      if data_end < 0:
        raise _errors.CorruptCheckpointError(
          f"{shown}: `{files.key}`: bad bundle file: {size} bytes, less than its index "
          f"({layout.index_nbytes})"
        )
      f.seek(data_end)
      raw = f.read(layout.index_nbytes + 1)
  except FileNotFoundError:
    raise _errors.CorruptCheckpointError(f"{shown}: `{files.key}`: bundle file missing") from None
  except OSError as e:
    raise _store_error(e, shown, files.key) from e
  table = _bundle.decode_index(raw, layout.places)
  if isinstance(table, np.ndarray):
    present = ~((table[:, 0] == _bundle.MISSING) & (table[:, 1] == _bundle.MISSING))
    ends = table[present, 0] + table[present, 1]  # uint64: a wrapped sum is caught below
    if not (ends.size and (ends.max() > data_end or (ends < table[present, 0]).any())):
      return table
    table = "its index points past the chunks it holds"
  raise _errors.CorruptCheckpointError(f"{shown}: `{files.key}`: bad bundle file: {table}")


def chunk_reads(files: ArrayFiles, regions: list[Region]) -> list[_byte_runs.Task]:
  """The tasks that read several regions of one array (`_byte_runs.start_read`), each chunk
  under them once.

  A chunk needed by one region only, and contiguous there, is read straight into
  that region's buffer; any other is read once and copied into each region. A task
  raises `CorruptCheckpointError` where a chunk file is missing, short, fails its
  checksum, or is not the chunk the manifest recorded at its place.
  """
  users: dict[tuple[int, ...], list[int]] = {}
  for i, region in enumerate(regions):
    for index in _chunks.chunks_in(region, files.info.chunks):
      users.setdefault(index, []).append(i)
  return [
    _byte_runs.Task(_read_chunk, tuple(used), (files, index, [regions[i] for i in used]))
    for index, used in users.items()
  ]


def _read_chunk(outs: list[np.ndarray], files: ArrayFiles, index, regions: list[Region]) -> None:
  """Fills the parts of `outs` (the buffers of `regions`) that chunk `index` holds."""
  info = files.info
  chunk = _chunks.chunk_region(index, info.chunks, info.shape)
  full = tuple(chunk) == tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, info.chunks))
  if len(regions) == 1 and full and _regions.overlap(chunk, regions[0]) == chunk:
    target = outs[0][_regions.relative(chunk, regions[0])]
    if target.flags.c_contiguous:
      read_chunk_into(files, index, target)
      return
  buffer = mapped_chunk(files, index)
  for out, region in zip(outs, regions):
    part = _regions.overlap(chunk, region)
    if part is not None:
      out[_regions.relative(part, region)] = buffer[_regions.relative(part, chunk)]


def mapped_chunk(files: ArrayFiles, index: tuple[int, ...]) -> np.ndarray:
  """The checked content of a whole (padded) chunk, mapped from the page cache, not copied out.

  For a chunk that is copied into several slices anyway, this saves one copy. The mapping
  goes when the array does.
  """
  try:
    return _mapped(files, index, *files.chunk(index))
  except _errors.CorruptCheckpointError:
    moved = files.indexed(index)
    if moved is None:
      raise
    return _mapped(files, index, *moved)


def _mapped(files: ArrayFiles, index, path: str, shown: str, offset: int | None) -> np.ndarray:
  info = files.info
  dtype = np.dtype(info.dtype)
  nbytes = int(np.prod(info.chunks)) * dtype.itemsize
  start = offset or 0
  base = start - start % mmap.ALLOCATIONGRANULARITY
  try:
    with _open_chunks(files, path, shown) as f:
      size = os.fstat(f.fileno()).st_size
      whole = (size == nbytes + 4) if offset is None else (start + nbytes + 4 <= size)
      if whole and nbytes:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(
          f.fileno(), start + nbytes + 4 - base, flags=flags, prot=mmap.PROT_READ, offset=base
        )
  except FileNotFoundError:
    raise _errors.CorruptCheckpointError(f"{shown}: `{files.key}`: chunk file missing") from None
  except OSError as e:
    raise _store_error(e, shown, files.key) from e
  if not whole or not nbytes:  # an empty chunk, or a short one (_read_into says so)
    buffer = np.empty(info.chunks, dtype)
    _read_into(files, index, buffer, path, shown, offset)
    return buffer
  raw = np.frombuffer(mapped, np.uint8)[start - base :]
  stored = struct.unpack("<I", raw[nbytes:].tobytes())[0]
  _check(files, index, shown, stored, crc32c.crc32c(raw[:nbytes]))  # type: ignore[arg-type]
  return raw[:nbytes].view(dtype).reshape(info.chunks)


def read_chunk_into(files: ArrayFiles, index: tuple[int, ...], out: np.ndarray) -> None:
  """Reads the whole (padded) chunk `index` into the C-contiguous `out`, checked."""
  try:
    _read_into(files, index, out, *files.chunk(index))
  except _errors.CorruptCheckpointError:
    moved = files.indexed(index)
    if moved is None:
      raise
    _read_into(files, index, out, *moved)


def _read_into(files: ArrayFiles, index, out, path: str, shown: str, offset: int | None) -> None:
  raw = _byte_runs.byte_view(out)
  start = offset or 0
  try:
    with _open_chunks(files, path, shown) as f:
      got = _byte_runs.read_full(f.fileno(), start, raw)
      # a chunk file ends with its checksum (a fifth byte: the file is longer than a chunk)
      tail = os.pread(f.fileno(), 5 if offset is None else 4, start + got)
  except FileNotFoundError:
    raise _errors.CorruptCheckpointError(f"{shown}: `{files.key}`: chunk file missing") from None
  except OSError as e:
    raise _store_error(e, shown, files.key) from e
  if got != raw.nbytes or len(tail) != 4:
    raise _errors.CorruptCheckpointError(
      f"{shown}: `{files.key}`: chunk file holds {got + len(tail)} bytes, expected {raw.nbytes + 4}"
    )
  _check(files, index, shown, struct.unpack("<I", tail)[0], crc32c.crc32c(raw))


def _open_chunks(files: ArrayFiles, path: str, shown: str):
  """The chunk or bundle file at `path` (`shown` in messages), opened only if it is a regular
  file (a FIFO would block the read forever) and no link out of the checkpoint."""
  root = files.io_dir.removesuffix(files.key)  # links may point anywhere in the checkpoint
  try:
    return _untrusted.open_regular(
      path, _errors.CorruptCheckpointError, buffered=False, inside=root
    )
  except _errors.CorruptCheckpointError as e:
    why = str(e).removeprefix(f"{path}: ").replace(root, files.shown_dir.removesuffix(files.key))
    raise _errors.CorruptCheckpointError(f"{shown}: `{files.key}`: {why}") from None


def _store_error(error: OSError, shown: str, key: str) -> _errors.StorageError:
  return _errors.StorageError(f"{shown}: `{key}`: cannot read the chunk file: {error.strerror}")


def _check(files: ArrayFiles, index, shown: str, stored: int, computed: int) -> None:
  if stored != computed:
    raise _errors.CorruptCheckpointError(
      f"{shown}: `{files.key}`: checksum mismatch (stored crc32c {stored:#010x}, "
      f"computed {computed:#010x})"
    )
  expected = files.info.expected_crc(index)
  if expected is not None and computed != expected:
    raise _errors.CorruptCheckpointError(misplaced(shown, files.key, computed, expected))


def misplaced(shown: str, key: str, computed: int, expected: int) -> str:
  """The message for a sound chunk that is not the one the manifest recorded at its place."""
  return (
    f"{shown}: `{key}`: chunk does not belong here: its crc32c {computed:#010x} is not the "
    f"{expected:#010x} the manifest recorded for this place (a chunk moved or copied from "
    "elsewhere, or a file of another save)"
  )
