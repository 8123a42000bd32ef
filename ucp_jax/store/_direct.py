"""Chunk files on a local disk, read and written without TensorStore in the way.

For uncompressed arrays in a local directory a zarr v3 chunk is just the raw
little-endian C-order bytes followed by their crc32c. Writing a chunk that is a
contiguous block of a shard is then one checksum and one `writev`, and reading a
chunk that lands contiguously in a device's slice is one `readinto` straight into
the buffer the device adopts: one copy from the page cache, like raw numpy file
I/O. A chunk that feeds several slices is mapped (`mmap`), checked, and copied
from the page cache into each. Everything else (object stores, compression, mapped
views) goes through TensorStore, which reads the same files.

Each chunk read is checked twice: against its own crc32c trailer (the bytes are
intact) and against the manifest's entry for its place (`expected`: the bytes are
the ones this save wrote there, not another chunk's or another save's).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import mmap
import os
import struct
import sys
import threading
from collections.abc import Callable

import crc32c
import numpy as np

from ucp_jax import _errors
from ucp_jax.store import _chunks, _hostmem, _regions
from ucp_jax.store._manifest import ArrayInfo

ENABLED = sys.byteorder == "little"
"""Off where the host is big-endian (the files are little-endian); tests may switch it off."""

_POOL = concurrent.futures.ThreadPoolExecutor(
  max_workers=max(4, 2 * (os.cpu_count() or 1)), thread_name_prefix="ucp_io"
)
_made_dirs: set[str] = set()
_made_dirs_lock = threading.Lock()

Region = _regions.Region


def submit(fn, *args) -> concurrent.futures.Future:
  """Runs `fn(*args)` on the I/O thread pool (for copies that release the GIL)."""
  return _POOL.submit(fn, *args)


def chunk_path(array_dir: str, index: tuple[int, ...]) -> str:
  """The file of chunk `index` under zarr v3's default chunk key encoding."""
  return os.path.join(array_dir, "c", *map(str, index))


def write_region(
  array_dir: str,
  data: np.ndarray,
  region: Region,
  chunks: tuple[int, ...],
  shape,
  *,
  record: Callable[[tuple[int, ...], int], None],
  durable: bool = True,
) -> list[concurrent.futures.Future]:
  """Starts writing `data` (the array's `region`, chunk-aligned) as chunk files.

  `record(index, crc)` is called with each chunk's checksum once it is written;
  with `durable`, each file is fsynced by the thread that wrote it.
  """
  data = np.asarray(data)
  futures = []
  for index in _chunks.chunks_in(region, chunks):
    chunk = _chunks.chunk_region(index, chunks, shape)
    block = data[_regions.relative(chunk, region)]
    path = chunk_path(array_dir, index)
    futures.append(_POOL.submit(_write_chunk, path, index, block, chunks, record, durable))
  return futures


def _write_chunk(path: str, index, block: np.ndarray, chunks, record, durable: bool) -> None:
  raw = _chunks.raw_bytes(_chunks.padded(block, chunks))  # an edge chunk is stored padded
  crc = crc32c.crc32c(raw)
  try:
    _makedirs(os.path.dirname(path))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
      _write_all(fd, [raw, struct.pack("<I", crc)])
      if durable:
        os.fsync(fd)
    finally:
      os.close(fd)
  except OSError as e:
    raise OSError(e.errno, e.strerror, e.filename or path) from e
  record(index, crc)


def _write_all(fd: int, parts: list) -> None:
  """`os.writev` until every byte is written (one call writes at most ~2 GiB on Linux)."""
  views = [memoryview(p).cast("B") for p in parts]
  while views:
    written = os.writev(fd, views)
    while written and views:
      if written >= views[0].nbytes:
        written -= views[0].nbytes
        views.pop(0)
      else:
        views[0], written = views[0][written:], 0
    views = [v for v in views if v.nbytes]


def _read_all(f, buffer: memoryview) -> int:
  """`readinto` until `buffer` is full or the file ends (one call reads at most ~2 GiB)."""
  got = 0
  while got < buffer.nbytes:
    n = f.readinto(buffer[got:])
    if not n:
      break
    got += n
  return got


def _makedirs(path: str) -> None:
  if path in _made_dirs:
    return
  os.makedirs(path, exist_ok=True)
  with _made_dirs_lock:
    if len(_made_dirs) > 100_000:
      _made_dirs.clear()
    _made_dirs.add(path)


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

  def chunk(self, index: tuple[int, ...]) -> tuple[str, str]:
    """(path to open, path to show) of chunk `index`."""
    return chunk_path(self.io_dir, index), chunk_path(self.shown_dir, index)


def start_read(files: ArrayFiles, regions: list[Region]):
  """Starts reading several regions of one array, each chunk once, into aligned host buffers.

  Returns the buffers and a function that waits for them to be filled.

  A chunk needed by one region only, and contiguous there, is read straight into
  that region's buffer; any other is read once and copied into each region.

  Raises:
    CorruptCheckpointError: a chunk file is missing, short, fails its checksum, or
      is not the chunk the manifest recorded at its place.
  """
  dtype = np.dtype(files.info.dtype)
  outs = [_hostmem.aligned_empty(tuple(s.stop - s.start for s in r), dtype) for r in regions]
  users: dict[tuple[int, ...], list[int]] = {}
  for i, region in enumerate(regions):
    for index in _chunks.chunks_in(region, files.info.chunks):
      users.setdefault(index, []).append(i)
  tasks = [_POOL.submit(_read_chunk, files, index, regions, outs, users[index]) for index in users]

  def wait() -> None:
    for task in tasks:
      task.result()

  return outs, wait


def _read_chunk(files: ArrayFiles, index, regions, outs, users) -> None:
  info = files.info
  chunk = _chunks.chunk_region(index, info.chunks, info.shape)
  full = tuple(chunk) == tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, info.chunks))
  if len(users) == 1 and full and _regions.overlap(chunk, regions[users[0]]) == chunk:
    target = outs[users[0]][_regions.relative(chunk, regions[users[0]])]
    if target.flags.c_contiguous:
      read_chunk_into(files, index, target)
      return
  buffer = mapped_chunk(files, index)
  for i in users:
    part = _regions.overlap(chunk, regions[i])
    if part is not None:
      outs[i][_regions.relative(part, regions[i])] = buffer[_regions.relative(part, chunk)]


def mapped_chunk(files: ArrayFiles, index: tuple[int, ...]) -> np.ndarray:
  """The checked content of a whole (padded) chunk, mapped from the page cache, not copied out.

  For a chunk that is copied into several slices anyway, this saves one copy. The mapping
  goes when the array does.
  """
  info = files.info
  dtype = np.dtype(info.dtype)
  nbytes = int(np.prod(info.chunks)) * dtype.itemsize
  path, shown = files.chunk(index)
  try:
    with open(path, "rb", buffering=0) as f:
      size = os.fstat(f.fileno()).st_size
      if size == nbytes + 4 and nbytes:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
  except FileNotFoundError:
    raise _errors.CorruptCheckpointError(f"{shown}: `{files.key}`: chunk file missing") from None
  except OSError as e:
    raise _store_error(e, shown, files.key) from e
  if size != nbytes + 4 or not nbytes:  # an empty chunk, or a short one (read_chunk_into says so)
    buffer = np.empty(info.chunks, dtype)
    read_chunk_into(files, index, buffer)
    return buffer
  raw = np.frombuffer(mapped, np.uint8)
  stored = struct.unpack("<I", raw[nbytes:].tobytes())[0]
  _check(files, index, shown, stored, crc32c.crc32c(raw[:nbytes]))
  return raw[:nbytes].view(dtype).reshape(info.chunks)


def read_chunk_into(files: ArrayFiles, index: tuple[int, ...], out: np.ndarray) -> None:
  """Reads the whole (padded) chunk `index` into the C-contiguous `out`, checked."""
  path, shown = files.chunk(index)
  raw = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(bytearray())
  try:
    with open(path, "rb", buffering=0) as f:
      got = _read_all(f, raw) if out.size else 0
      tail = f.read(5)
  except FileNotFoundError:
    raise _errors.CorruptCheckpointError(f"{shown}: `{files.key}`: chunk file missing") from None
  except OSError as e:
    raise _store_error(e, shown, files.key) from e
  if got != raw.nbytes or len(tail) != 4:
    raise _errors.CorruptCheckpointError(
      f"{shown}: `{files.key}`: chunk file holds {got + len(tail)} bytes, expected {raw.nbytes + 4}"
    )
  _check(files, index, shown, struct.unpack("<I", tail)[0], crc32c.crc32c(raw))


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
