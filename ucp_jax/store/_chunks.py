"""Chunks: the grid of an array, and checksums bound to each chunk's place in it.

zarr's `crc32c` codec protects each chunk object on its own, but says nothing of
where the object belongs: two chunks swapped, or a chunk of another array or
another save copied over one, pass it. So every save also records, per array, the
crc32c of each chunk's raw bytes (C order, little-endian, an edge chunk padded to
the full chunk shape with zeros, exactly what zarr's `bytes` codec produces) in
chunk-grid order, and the manifest, itself checksummed, carries the table. A read
compares each chunk it takes with its entry. For an uncompressed chunk file the
entry equals the file's own crc32c trailer, so checking it costs nothing more.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence

import crc32c
import numpy as np

from ucp_jax.store._regions import Region


def grid(shape: Sequence[int], chunks: Sequence[int]) -> tuple[int, ...]:
  """The chunk grid's shape (no chunks along an empty dimension)."""
  return tuple(-(-d // c) for d, c in zip(shape, chunks))


def count(shape: Sequence[int], chunks: Sequence[int]) -> int:
  """How many chunks an array of `shape` has (1 for a 0-d array, 0 for an empty one)."""
  return math.prod(grid(shape, chunks))


def chunk_region(index: Sequence[int], chunks: Sequence[int], shape: Sequence[int]) -> Region:
  """The region of the array that chunk `index` holds (clipped at the array's edge)."""
  return tuple(slice(i * c, min((i + 1) * c, d)) for i, c, d in zip(index, chunks, shape))


def chunks_in(region: Region, chunks: Sequence[int]) -> Iterator[tuple[int, ...]]:
  """Grid indices of the chunks that overlap `region`."""
  ranges = [range(s.start // c, -(-s.stop // c)) for s, c in zip(region, chunks)]
  return itertools.product(*ranges)


def padded(block: np.ndarray, chunks: Sequence[int]) -> np.ndarray:
  """`block` as zarr stores it: C-contiguous, an edge chunk padded with zeros to `chunks`."""
  if block.shape != tuple(chunks):
    full = np.zeros(chunks, dtype=block.dtype)
    full[tuple(slice(0, n) for n in block.shape)] = block
    return full
  return np.ascontiguousarray(block)


def raw_bytes(block: np.ndarray) -> memoryview:
  """The bytes of a C-contiguous array, as zarr's little-endian `bytes` codec lays them out."""
  if not block.size:
    return memoryview(b"")
  if block.dtype.byteorder == ">":
    block = block.astype(block.dtype.newbyteorder("<"))
  return memoryview(block.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy<3.12 stubs


def of_block(block: np.ndarray, chunks: Sequence[int]) -> int:
  """The checksum entry of one chunk whose in-bounds data is `block`."""
  return crc32c.crc32c(raw_bytes(padded(block, chunks)))


HASH_BYTES = 32
"""A chunk's strong hash: sha256 of the same raw bytes as its crc32c."""


def hash_of(raw) -> bytes:
  """The sha256 of a chunk's raw bytes (`raw_bytes` of the padded chunk)."""
  return hashlib.sha256(raw).digest()


class Table:
  """The checksums (and, with `hashed`, sha256 hashes) of one array's chunks while a save
  fills them in.

  Thread-safe enough for the writer threads: each chunk is set once, by index.
  """

  def __init__(self, shape: Sequence[int], chunks: Sequence[int], hashed: bool = False):
    self.grid = grid(shape, chunks)
    self.crcs = np.zeros(self.grid, dtype=np.uint32)
    self.written = np.zeros(self.grid, dtype=bool)
    self.hashes = np.zeros((*self.grid, HASH_BYTES), dtype=np.uint8) if hashed else None

  def set(self, index: tuple[int, ...], crc: int, raw=None) -> None:
    """Records chunk `index`: its crc32c, and the hash of its raw bytes `raw` if hashed."""
    if self.hashes is not None and raw is not None:
      self.hashes[index] = np.frombuffer(hash_of(raw), np.uint8)
    self.crcs[index] = crc
    self.written[index] = True

  def fill(self, crcs: np.ndarray, hashes: np.ndarray | None) -> None:
    """Records every chunk at once, as another checkpoint holds them (a reused array)."""
    self.crcs[...] = crcs
    self.written[...] = True
    if self.hashes is not None:
      if hashes is None:
        self.hashes = None  # unknown: the manifest records none for this array
      else:
        self.hashes[...] = hashes

  def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(flat indices, crcs, hashes or None) of the chunks written here."""
    flat = np.flatnonzero(self.written.reshape(-1))
    hashes = None if self.hashes is None else self.hashes.reshape(-1, HASH_BYTES)[flat]
    return flat.astype(np.uint64), self.crcs.reshape(-1)[flat], hashes

  def merge(self, flat: np.ndarray, crcs: np.ndarray, hashes: np.ndarray | None = None) -> None:
    """Adds the entries another process wrote."""
    self.crcs.reshape(-1)[flat.astype(np.intp)] = crcs
    self.written.reshape(-1)[flat.astype(np.intp)] = True
    if self.hashes is not None and hashes is not None:
      self.hashes.reshape(-1, HASH_BYTES)[flat.astype(np.intp)] = hashes

  def missing(self) -> int:
    return int(self.written.size - np.count_nonzero(self.written))


def pack_entries(tables: dict[str, Table], hashed: bool = False) -> bytes:
  """The chunk checksums (and hashes) this process recorded, as bytes to send to process 0."""
  kind = _entry_type(hashed)
  parts = []
  for number, key in enumerate(sorted(tables)):
    flat, crcs, hashes = tables[key].entries()
    part = np.zeros(len(flat), dtype=kind)
    part["array"], part["chunk"], part["crc"] = number, flat, crcs
    if hashed and hashes is not None:
      part["sha"] = hashes
    parts.append(part)
  return np.concatenate(parts).tobytes() if parts else b""


def merge_entries(
  tables: dict[str, Table], keys: list[str], raw: bytes, hashed: bool = False
) -> None:
  entries = np.frombuffer(raw, dtype=_entry_type(hashed))
  for number in np.unique(entries["array"]):
    mine = entries[entries["array"] == number]
    tables[keys[int(number)]].merge(mine["chunk"], mine["crc"], mine["sha"] if hashed else None)


def _entry_type(hashed: bool) -> np.dtype:
  fields = [("array", "<u4"), ("chunk", "<u8"), ("crc", "<u4")]
  return np.dtype(fields + ([("sha", "u1", (HASH_BYTES,))] if hashed else []))


def encode(crcs: np.ndarray) -> str:
  """A table as the manifest stores it: base64 of little-endian uint32s in grid order."""
  return base64.b64encode(np.ascontiguousarray(crcs, dtype="<u4").tobytes()).decode("ascii")


def decode(text: str, shape: Sequence[int], chunks: Sequence[int]) -> np.ndarray:
  """The table `encode` made, shaped as the chunk grid.

  Raises:
    ValueError: not base64, or not one entry per chunk.
  """
  raw = base64.b64decode(text.encode("ascii"), validate=True)
  expected = count(shape, chunks)
  if len(raw) != 4 * expected:
    raise ValueError(f"{len(raw) // 4} chunk checksums for {expected} chunks")
  return np.frombuffer(raw, dtype="<u4").astype(np.uint32).reshape(grid(shape, chunks))


def encode_hashes(hashes: np.ndarray) -> str:
  """A hash table as the manifest stores it: base64 of the hashes in grid order."""
  return base64.b64encode(np.ascontiguousarray(hashes, dtype=np.uint8).tobytes()).decode("ascii")


def decode_hashes(text: str, shape: Sequence[int], chunks: Sequence[int]) -> np.ndarray:
  """The table `encode_hashes` made, shaped as the chunk grid + (32,).

  Raises:
    ValueError: not base64, or not one hash per chunk.
  """
  raw = base64.b64decode(text.encode("ascii"), validate=True)
  expected = count(shape, chunks)
  if len(raw) != HASH_BYTES * expected:
    raise ValueError(f"{len(raw)} bytes of chunk hashes for {expected} chunks")
  return np.frombuffer(raw, np.uint8).reshape(*grid(shape, chunks), HASH_BYTES).copy()
