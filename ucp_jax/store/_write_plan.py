"""Who writes what: each region of a sharded array once, replicas sharing the work.

A shard held by several devices (an array replicated over a data-parallel axis) is
written once. Giving it all to replica 0 would leave the hosts of the first
data-parallel slice writing every replicated byte while the others idle, so a shard
whose replicas live on several processes is split, along chunk boundaries, into one
slab per process. Which process takes which slab rotates with the array's key and the
shard, so single-chunk arrays spread over the processes too. The plan is a pure
function of the sharding, shape, chunks and key: every process computes the same one
without talking to the others. With one process it is exactly "replica 0 writes".
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from ucp_jax.store import _caches, _regions
from ucp_jax.store._regions import Region


@dataclasses.dataclass(frozen=True)
class _Shard:
  """One distinct region of the array, its slabs, and one holder device per process."""

  pieces: tuple[Region, ...]
  holders: tuple[tuple[int, Any], ...]  # (process, device), by process; the first replica each


@dataclasses.dataclass(frozen=True)
class _Layout:
  shards: tuple[_Shard, ...]
  by_process: Mapping[int, tuple[int, ...]]  # process -> the shards it holds a replica of


def assignments(
  key: str,
  index_map: Callable[[], Mapping[Any, tuple]],
  layout_key: Hashable,
  shape: Sequence[int],
  chunks: Sequence[int],
  process: int,
  process_of: Callable[[Any], int],
) -> dict[Any, list[Region]]:
  """The regions each of `process`'s devices writes of the array `key`.

  `index_map()` gives every device's index (`sharding.devices_indices_map(shape)`);
  it is called once per distinct `layout_key`, for which the split is cached.
  """
  layout = _layout(layout_key, index_map, tuple(shape), tuple(chunks), process_of)
  out: dict[Any, list[Region]] = {}
  for number in layout.by_process.get(process, ()):
    for holder, piece in _pieces(key, number, layout.shards[number]):
      if holder[0] == process:
        out.setdefault(holder[1], []).append(piece)
  return out


def every_assignment(
  key: str,
  index_map: Callable[[], Mapping[Any, tuple]],
  layout_key: Hashable,
  shape: Sequence[int],
  chunks: Sequence[int],
  process_of: Callable[[Any], int],
) -> list[tuple[int, Any, Region]]:
  """(process, device, region) for every region of `key` written, on every process."""
  layout = _layout(layout_key, index_map, tuple(shape), tuple(chunks), process_of)
  return [
    (*holder, piece)
    for number, shard in enumerate(layout.shards)
    for holder, piece in _pieces(key, number, shard)
  ]


def _pieces(key: str, number: int, shard: _Shard):
  """(holder, slab) for each slab of shard `number`, the holders taking turns by key."""
  k = len(shard.holders)
  rotation = (zlib.crc32(key.encode()) + number) % k
  for j, piece in enumerate(shard.pieces):
    yield shard.holders[(j + rotation) % k], piece


def of_sharding(key: str, sharding: Any, shape: Sequence[int], chunks: Sequence[int], process: int):
  """`assignments` for a jax sharding."""
  return assignments(key, *_sharding_args(sharding, shape), shape, chunks, process, _process_of)


def every_of_sharding(key: str, sharding: Any, shape: Sequence[int], chunks: Sequence[int]):
  """`every_assignment` for a jax sharding."""
  return every_assignment(key, *_sharding_args(sharding, shape), shape, chunks, _process_of)


def writers(sharding: Any, shape: Sequence[int]) -> int:
  """How many processes hold a replica of the most replicated shard (1 with one process)."""
  return _CACHE.get(("writers", sharding, tuple(shape)), lambda: _writers(sharding, shape))


def _writers(sharding: Any, shape: Sequence[int]) -> int:
  if len({_process_of(d) for d in sharding.device_set}) <= 1:
    return 1
  groups = _regions.group_regions(sharding.devices_indices_map(tuple(shape)), shape)
  return max(len({_process_of(d) for d in devices}) for _, devices in groups)


def _sharding_args(sharding: Any, shape: Sequence[int]):
  return lambda: sharding.devices_indices_map(tuple(shape)), (sharding, tuple(shape))


def _process_of(device: Any) -> int:
  return device.process_index


_CACHE = _caches.Memo(maxsize=512)
"""Layouts, and `writers` counts: a state's arrays share a few shardings and shapes."""


def _layout(layout_key, index_map, shape, chunks, process_of) -> _Layout:
  """The split of one layout, computed once: arrays of one shape and sharding share it."""
  return _CACHE.get(
    (layout_key, shape, chunks), lambda: _split_all(index_map(), shape, chunks, process_of)
  )


def _split_all(index_map: Mapping[Any, tuple], shape, chunks, process_of) -> _Layout:
  shards = []
  by_process: dict[int, list[int]] = {}
  for number, (region, devices) in enumerate(_regions.group_regions(index_map, shape)):
    holders: dict[int, Any] = {}  # process -> its first device
    for device in devices:
      holders.setdefault(process_of(device), device)
    ordered = tuple(sorted(holders.items(), key=lambda item: item[0]))
    shards.append(_Shard(split(region, chunks, shape, len(ordered)), ordered))
    for process, _ in ordered:
      by_process.setdefault(process, []).append(number)
  return _Layout(tuple(shards), {p: tuple(n) for p, n in by_process.items()})


def split(region: Region, chunks: Sequence[int], shape: Sequence[int], parts: int) -> tuple:
  """`region` cut into at most `parts` slabs along chunk boundaries of one dimension.

  The dimension is the first with at least `parts` chunks in the region (slabs of
  leading dimensions are contiguous in memory), else the one with the most. A
  dimension whose region does not start on a chunk boundary is never cut: two
  writers must never share a chunk.
  """
  if parts <= 1 or _regions.size(region) == 0:
    return (region,)
  counts = [
    -(-(s.stop - s.start) // c) if s.start % c == 0 and (s.stop % c == 0 or s.stop == d) else 1
    for s, c, d in zip(region, chunks, shape)
  ]
  if not counts or max(counts) <= 1:
    return (region,)
  dim = next((i for i, n in enumerate(counts) if n >= parts), counts.index(max(counts)))
  n, c, s = counts[dim], chunks[dim], region[dim]
  m = min(parts, n)
  cuts = [s.start + (j * n // m) * c for j in range(m)] + [s.stop]
  return tuple(
    (*region[:dim], slice(lo, min(hi, s.stop)), *region[dim + 1 :])
    for lo, hi in itertools.pairwise(cuts)
  )
