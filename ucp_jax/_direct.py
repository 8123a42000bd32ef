"""Chunk files on a local disk, read and written without TensorStore in the way.

For uncompressed arrays in a local directory a zarr v3 chunk is just the raw
little-endian C-order bytes followed by their crc32c. Writing a chunk that is a
contiguous block of a shard is then one checksum and one `writev`, and reading a
chunk that lands contiguously in a device's slice is one `readinto` straight into
the buffer the device adopts: one copy from the page cache, like raw numpy file
I/O. A chunk that feeds several slices is mapped (`mmap`), checked, and copied
from the page cache into each. Everything else (object stores, compression, mapped views) goes through
TensorStore, which reads the same files.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import mmap
import os
import struct
import sys
import threading
from collections.abc import Iterator

import crc32c
import numpy as np

from ucp_jax import _errors, _hostmem, _regions

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


def chunks_in(region: Region, chunks: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
  """Grid indices of the chunks that overlap `region`."""
  ranges = [range(s.start // c, -(-s.stop // c)) for s, c in zip(region, chunks)]
  return itertools.product(*ranges)


def _chunk_region(index: tuple[int, ...], chunks, shape) -> Region:
  return tuple(slice(i * c, min((i + 1) * c, d)) for i, c, d in zip(index, chunks, shape))


def write_region(
  array_dir: str, data: np.ndarray, region: Region, chunks: tuple[int, ...], shape
) -> list[concurrent.futures.Future]:
  """Starts writing `data` (the array's `region`, chunk-aligned) as chunk files."""
  data = np.asarray(data)
  futures = []
  for index in chunks_in(region, chunks):
    chunk = _chunk_region(index, chunks, shape)
    block = data[_regions.relative(chunk, region)]
    futures.append(_POOL.submit(_write_chunk, chunk_path(array_dir, index), block, chunks))
  return futures


def _write_chunk(path: str, block: np.ndarray, chunks: tuple[int, ...]) -> None:
  if block.shape != tuple(chunks):  # an edge chunk: zarr stores it padded to full size
    padded = np.zeros(chunks, dtype=block.dtype)
    padded[tuple(slice(0, n) for n in block.shape)] = block
    block = padded
  block = np.ascontiguousarray(block)
  raw = memoryview(block.reshape(-1).view(np.uint8)) if block.size else memoryview(b"")
  checksum = struct.pack("<I", crc32c.crc32c(raw))
  _makedirs(os.path.dirname(path))
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  try:
    os.writev(fd, [raw, checksum])
  finally:
    os.close(fd)


def _makedirs(path: str) -> None:
  if path in _made_dirs:
    return
  os.makedirs(path, exist_ok=True)
  with _made_dirs_lock:
    if len(_made_dirs) > 100_000:
      _made_dirs.clear()
    _made_dirs.add(path)


def start_read(
  array_dir: str, key: str, regions: list[Region], dtype, chunks: tuple[int, ...], shape
):
  """Starts reading several regions of one array, each chunk once, into aligned host buffers.

  Returns the buffers and a function that waits for them to be filled.

  A chunk needed by one region only, and contiguous there, is read straight into
  that region's buffer; any other is read once and copied into each region.

  Raises:
    CorruptCheckpointError: a chunk file is missing, short, or fails its checksum.
  """
  dtype = np.dtype(dtype)
  outs = [_hostmem.aligned_empty(tuple(s.stop - s.start for s in r), dtype) for r in regions]
  users: dict[tuple[int, ...], list[int]] = {}
  for i, region in enumerate(regions):
    for index in chunks_in(region, chunks):
      users.setdefault(index, []).append(i)
  tasks = [
    _POOL.submit(
      _read_chunk, array_dir, key, index, regions, outs, users[index], dtype, chunks, shape
    )
    for index in users
  ]

  def wait() -> None:
    for task in tasks:
      task.result()

  return outs, wait


def _read_chunk(array_dir, key, index, regions, outs, users, dtype, chunks, shape) -> None:
  path = chunk_path(array_dir, index)
  chunk = _chunk_region(index, chunks, shape)
  full = tuple(chunk) == tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunks))
  if len(users) == 1 and full and _regions.overlap(chunk, regions[users[0]]) == chunk:
    target = outs[users[0]][_regions.relative(chunk, regions[users[0]])]
    if target.flags.c_contiguous:
      _read_into(path, key, target)
      return
  buffer = _mapped(path, key, int(np.prod(chunks)) * dtype.itemsize).view(dtype).reshape(chunks)
  for i in users:
    part = _regions.overlap(chunk, regions[i])
    if part is not None:
      outs[i][_regions.relative(part, regions[i])] = buffer[_regions.relative(part, chunk)]


def _mapped(path: str, key: str, nbytes: int) -> np.ndarray:
  """The checked bytes of a chunk file, mapped from the page cache rather than copied out.

  For a chunk that is copied into several slices anyway, this saves one copy. The mapping
  goes when the array does.
  """
  try:
    with open(path, "rb", buffering=0) as f:
      size = os.fstat(f.fileno()).st_size
      if size == nbytes + 4 and nbytes:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
  except FileNotFoundError:
    raise _errors.CorruptCheckpointError(f"{path}: `{key}`: chunk file missing") from None
  if size != nbytes + 4 or not nbytes:  # an empty chunk, or a short one (_read_into says so)
    buffer = np.empty(nbytes, np.uint8)
    _read_into(path, key, buffer)
    return buffer
  raw = np.frombuffer(mapped, np.uint8)
  stored = struct.unpack("<I", raw[nbytes:].tobytes())[0]
  computed = crc32c.crc32c(raw[:nbytes])
  if stored != computed:
    raise _errors.CorruptCheckpointError(
      f"{path}: `{key}`: checksum mismatch (stored crc32c {stored:#010x}, computed {computed:#010x})"
    )
  return raw[:nbytes]


def _read_into(path: str, key: str, out: np.ndarray) -> None:
  raw = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(bytearray())
  try:
    with open(path, "rb", buffering=0) as f:
      got = f.readinto(raw) if out.size else 0
      tail = f.read(5)
  except FileNotFoundError:
    raise _errors.CorruptCheckpointError(f"{path}: `{key}`: chunk file missing") from None
  if got != raw.nbytes or len(tail) != 4:
    raise _errors.CorruptCheckpointError(
      f"{path}: `{key}`: chunk file holds {got + len(tail)} bytes, expected {raw.nbytes + 4}"
    )
  stored = struct.unpack("<I", tail)[0]
  computed = crc32c.crc32c(raw)
  if stored != computed:
    raise _errors.CorruptCheckpointError(
      f"{path}: `{key}`: checksum mismatch (stored crc32c {stored:#010x}, computed {computed:#010x})"
    )
