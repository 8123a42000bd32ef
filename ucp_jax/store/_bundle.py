"""Bundles: several chunks of one array in one file, as zarr v3's `sharding_indexed` codec lays
them out, so a checkpoint holds a few objects per array and writer, not one per chunk.

A bundle (a zarr "shard", a name this package keeps for jax's shards) is a block of the
chunk grid: the chunks of one process's part of the array (`_owners.block_shape`: the
shards of all its devices), split further only when larger than `BUNDLE_BYTES`, so every
bundle has exactly one writer process. Its file holds the encoded
chunks that lie in the array, in C order of the bundle's chunk grid, then the index:
one little-endian (offset, nbytes) uint64 pair per chunk place, `2**64 - 1` twice for a
place outside the array, and the crc32c of the index. This is byte for byte what
TensorStore writes (and zarr-python reads). For raw chunks every encoded chunk has the
same size, so a writer knows every chunk's offset before writing any: the chunks of a
bundle are written in parallel groups with `pwritev`, and the index last.

A restore reads only the byte ranges of the chunks under its slices, where a save puts
them, without reading the index; a chunk that is not there (a bundle another zarr writer
laid out) is looked up in the index. Each chunk is checked against its own crc32c and the
manifest's entry for its place, so the index only says where to look, never what to
trust; `verify` checks that the index agrees, for the readers that follow it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import crc32c
import numpy as np

from ucp_jax.base import _errors
from ucp_jax.store import _chunks, _zarr

BUNDLE_BYTES = 256 << 20
"""Largest bundle written to a local disk by default: one file per process's part of an
array below it, several above."""

REMOTE_BUNDLE_BYTES = 16 << 20
"""Largest bundle written to an object store by default: each bundle is one PUT, in one
stream, so smaller ones keep more streams in flight (1 GiB in 16 arrays through moto's S3
server: 3.6 s in bundles of 16 MiB, 5.0 s in one 64 MiB bundle per array, 3.7 s in 128
objects of 8 MiB; docs/benchmarks.md)."""

AUTO = "auto"
"""`bundle_bytes="auto"`: `BUNDLE_BYTES` on a local disk, `REMOTE_BUNDLE_BYTES` elsewhere."""

SPREAD_BYTES = 16 << 20
"""Largest bundle of a shard that several processes hold (replicated over a data-parallel
axis): they share its writing in whole bundles, so it is cut finer (docs/scale.md)."""

MISSING = 2**64 - 1
"""An index entry's offset and size for a chunk place with no chunk (outside the array)."""


def choose(
  shape: Sequence[int],
  block: Sequence[int],
  chunks: Sequence[int],
  itemsize: int,
  limit: int | None = BUNDLE_BYTES,
  writers: int = 1,
) -> tuple[int, ...] | None:
  """The bundle shape for an array chunked as `chunks` whose writers each hold a `block`.

  `block` is the part of the array one process holds (`_owners.block_shape`; a device
  shard where the processes' parts tile no grid). None (one file per chunk) when bundling
  is off (`limit` None), for 0-d and empty arrays, and when a bundle would hold a single
  chunk. A bundle is the block along the dimensions the block cuts (the chunks divide it)
  and the whole padded extent along the others, then halved like a chunk is
  (`_zarr.choose_chunks`), in whole chunks, while larger than `limit`, or than
  `SPREAD_BYTES` when `writers` (the processes that hold each block) share the writing.
  """
  if limit is None or not shape or not math.prod(shape):
    return None
  if writers > 1:
    limit = min(limit, SPREAD_BYTES)
  sharded = [s < full for s, full in zip(block, shape)]
  counts = [
    max(1, s // c) if cut else -(-d // c) for s, c, d, cut in zip(block, chunks, shape, sharded)
  ]
  chunk_bytes = math.prod(chunks) * itemsize
  while math.prod(counts) * chunk_bytes > limit and _zarr.split_once(counts, sharded):  # as chunks
    pass
  if math.prod(counts) <= 1:
    return None
  return tuple(n * c for n, c in zip(counts, chunks))


def limit_for(local: bool, bundle_bytes: int | str | None = AUTO) -> int | None:
  """`bundle_bytes` as a save to a local disk (`local`) or an object store takes it."""
  if bundle_bytes != AUTO:
    return bundle_bytes  # type: ignore[return-value]
  return BUNDLE_BYTES if local else REMOTE_BUNDLE_BYTES


def check_limit(bundle_bytes: int | None) -> None:
  if bundle_bytes is not None and (
    isinstance(bundle_bytes, bool) or not isinstance(bundle_bytes, int) or bundle_bytes <= 0
  ):
    raise _errors.InvalidArgumentError(
      f"bundle_bytes={bundle_bytes!r}: the largest bundle must be a positive number of bytes, "
      f"None for a file per chunk, or 'auto' (the default: {BUNDLE_BYTES} on a local disk, "
      f"{REMOTE_BUNDLE_BYTES} on an object store)"
    )


def check(shape: Sequence[int], chunks: Sequence[int], bundle: Sequence[int]) -> str | None:
  """Why `bundle` cannot be a bundle shape of this array (None: it can)."""
  if len(bundle) != len(shape) or not all(
    isinstance(b, int) and not isinstance(b, bool) and b > 0 and b % c == 0
    for b, c in zip(bundle, chunks)
  ):
    return f"bundle {list(bundle)} is not a whole number of chunks {list(chunks)} per dimension"
  if any(b > -(-d // c) * c for b, c, d in zip(bundle, chunks, shape)):
    return f"bundle {list(bundle)} is larger than the array {list(shape)} in chunks {list(chunks)}"
  return None


class Layout:
  """Where each chunk of an array lives: which bundle file, and at what place in it."""

  def __init__(self, shape: Sequence[int], chunks: Sequence[int], bundle: Sequence[int]):
    self.shape, self.chunks, self.bundle = tuple(shape), tuple(chunks), tuple(bundle)
    self.counts = tuple(b // c for b, c in zip(bundle, chunks))
    self.chunk_grid = _chunks.grid(shape, chunks)
    self.places = math.prod(self.counts)

  def bundle_of(self, index: Sequence[int]) -> tuple[int, ...]:
    return tuple(i // n for i, n in zip(index, self.counts))

  def name(self, index: Sequence[int]) -> str:
    """Chunk `index` as messages name it: its bundle file, relative to the array, and itself."""
    where = self.bundle_of(index)
    return "/".join(["c", *map(str, where)]) + f" (chunk {'/'.join(map(str, index))})"

  def present(self, bundle: Sequence[int]) -> tuple[int, ...]:
    """How many chunks the bundle holds along each dimension (fewer at the array's edge)."""
    return tuple(min(n, g - b * n) for b, n, g in zip(bundle, self.counts, self.chunk_grid))

  def slot(self, index: Sequence[int], encoded: int) -> tuple[tuple[int, ...], int, int]:
    """(bundle, index entry, byte offset) of chunk `index` when each chunk is `encoded` bytes."""
    bundle = self.bundle_of(index)
    entry = rank = 0
    for i, b, n, g in zip(index, bundle, self.counts, self.chunk_grid):  # C order, by hand: hot
      local = i - b * n
      entry = entry * n + local
      rank = rank * min(n, g - b * n) + local
    return bundle, entry, rank * encoded

  def index_bytes(self, bundle: Sequence[int], encoded: int) -> tuple[int, bytes]:
    """(offset, bytes) of the index of a bundle of raw chunks of `encoded` bytes each."""
    present = self.present(bundle)
    table = np.full((self.places, 2), MISSING, dtype="<u8")
    if math.prod(present):
      local = np.indices(present).reshape(len(present), -1)
      entries = np.ravel_multi_index(tuple(local), self.counts)
      table[entries, 0] = np.arange(local.shape[1], dtype=np.uint64) * np.uint64(encoded)
      table[entries, 1] = encoded
    raw = table.tobytes()
    return math.prod(present) * encoded, raw + crc32c.crc32c(raw).to_bytes(4, "little")

  @property
  def index_nbytes(self) -> int:
    return 16 * self.places + 4


def chunk_name(info, index: Sequence[int]) -> str:
  """Where chunk `index` of the array `info` (an ArrayInfo) lives, relative to the array."""
  if info.bundle is None:
    return "/".join(["c", *map(str, index)])
  return Layout(info.shape, info.chunks, info.bundle).name(index)


def decode_index(raw: bytes, places: int) -> np.ndarray | str:
  """The (places, 2) table of a bundle's index, or what is wrong with it."""
  if len(raw) != 16 * places + 4:
    return f"an index of {len(raw)} bytes, expected {16 * places + 4}"
  stored = int.from_bytes(raw[-4:], "little")
  if crc32c.crc32c(raw[:-4]) != stored:
    return "its index fails its crc32c"
  return np.frombuffer(raw[:-4], dtype="<u8").reshape(places, 2)
