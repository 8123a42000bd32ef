"""Who writes what: each region of a sharded array once, replicas sharing the work.

A shard held by several devices (an array replicated over a data-parallel axis) is
written once. Giving it all to replica 0 would leave the hosts of the first
data-parallel slice writing every replicated byte while the others idle, so a shard
whose replicas live on several processes is split into units (the bundles or chunks a
writer owns whole), and the processes holding it take turns. Which process takes which
unit rotates with the array's key and the shard, so single-chunk arrays spread over the
processes too. Ownership is a pure function of the sharding, shape, units and key: every
process computes the same one without talking to the others. With one process it is
exactly "replica 0 writes".

A process's block (`blocks`) is the part of the array its devices hold together. When the
blocks tile the array in a regular grid (any mesh whose processes hold whole rows and
columns of shards, which is what `jax.make_mesh` lays out), a save bundles by block
(`store/_bundle`), so a checkpoint is a few objects per array and process, not one per
device shard. A unit then spans several devices' shards of one process: each device
writes its part of the unit, and the unit still has one writer process.
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
  """A part of the array that the same processes hold (one device region, or a process's
  block), the units it is cut into, and what each holder writes them from."""

  units: tuple[tuple[tuple[Region, Mapping[int, Any]], ...], ...]
  # each unit (the holders take turns, one writer each) as its parts in device regions,
  # with the device of each holder that writes the part (process -> device)
  holders: tuple[int, ...]  # the processes holding it, in order


@dataclasses.dataclass(frozen=True)
class _Layout:
  shards: tuple[_Shard, ...]
  by_process: Mapping[int, tuple[int, ...]]  # process -> the shards it holds a replica of


@dataclasses.dataclass(frozen=True)
class Blocks:
  """The processes' blocks of one layout, when they tile the array in a regular grid."""

  shape: tuple[int, ...]  # every block's (those at the array's far edge may be smaller)
  blocks: tuple[tuple[Region, tuple[int, ...], tuple[int, ...]], ...]
  # (block, its holder processes, the indexes in `group_regions` of the device regions in it)


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
    for writer, device, piece in _pieces(key, number, layout.shards[number]):
      if writer == process:
        out.setdefault(device, []).append(piece)
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
    piece for number, shard in enumerate(layout.shards) for piece in _pieces(key, number, shard)
  ]


def _pieces(key: str, number: int, shard: _Shard):
  """(process, device, region) for each device region's part of each unit of shard
  `number`, the holders taking turns by key."""
  k = len(shard.holders)
  rotation = (zlib.crc32(key.encode()) + number) % k
  for j, parts in enumerate(shard.units):
    writer = shard.holders[(j + rotation) % k]
    for piece, devices in parts:
      yield writer, devices[writer], piece


def of_sharding(key: str, sharding: Any, shape: Sequence[int], chunks: Sequence[int], process: int):
  """`assignments` for a jax sharding."""
  return assignments(key, *_sharding_args(sharding, shape), shape, chunks, process, _process_of)


def every_of_sharding(key: str, sharding: Any, shape: Sequence[int], chunks: Sequence[int]):
  """`every_assignment` for a jax sharding."""
  return every_assignment(key, *_sharding_args(sharding, shape), shape, chunks, _process_of)


def block_shape(sharding: Any, shape: Sequence[int]) -> tuple[int, ...] | None:
  """The shape of the block each process holds of an array of `shape` laid out by
  `sharding`, or None when the blocks do not tile it in a regular grid (`blocks`)."""
  found = _CACHE.get(
    ("blocks", sharding, tuple(shape)),
    lambda: blocks(sharding.devices_indices_map(tuple(shape)), shape, _process_of),
  )
  return None if found is None else found.shape


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


def _split_all(index_map: Mapping[Any, tuple], shape, unit, process_of) -> _Layout:
  """The shards of a layout and their units: each device region cut into slabs of whole
  units, one per holder process; or, where a unit spans several device regions (bundles
  by block), each process block cut into its units."""
  groups = _regions.group_regions(index_map, shape)
  regions = []
  for region, devices in groups:
    holders: dict[int, Any] = {}  # process -> its first device
    for device in devices:
      holders.setdefault(process_of(device), device)
    regions.append((region, holders))
  if all(_within(region, unit, shape) for region, _ in groups):
    shards = [
      _Shard(
        tuple(((slab, holders),) for slab in split(region, unit, shape, len(holders))),
        tuple(sorted(holders)),
      )
      for region, holders in regions
    ]
  else:
    grid = blocks(index_map, shape, process_of, groups)
    if grid is None or not all(_within(u, unit, shape) for u, *_ in grid.blocks):
      raise ValueError(f"units {unit} span the shards of several processes")  # save chose them
    shards = []
    for block, holders, inside in grid.blocks:
      units = _units(block, unit, shape) if len(holders) > 1 else [block]
      parts = [
        tuple(
          (piece, regions[n][1])
          for n in inside
          for piece in [_regions.overlap(u, regions[n][0])]
          if piece is not None
        )
        for u in units
      ]
      shards.append(_Shard(tuple(parts), holders))
  by_process: dict[int, list[int]] = {}
  for number, shard in enumerate(shards):
    for process in shard.holders:
      by_process.setdefault(process, []).append(number)
  return _Layout(tuple(shards), {p: tuple(n) for p, n in by_process.items()})


def blocks(index_map: Mapping[Any, tuple], shape, process_of, groups=None) -> Blocks | None:
  """The block of the array each process holds (the union of its devices' regions), when
  every block is a box, processes hold either the same block or disjoint ones, and the
  blocks tile the array in a regular grid; None otherwise."""
  shape = tuple(shape)
  groups = groups if groups is not None else _regions.group_regions(index_map, shape)
  held: dict[int, set[int]] = {}
  for number, (_, devices) in enumerate(groups):
    for device in devices:
      held.setdefault(process_of(device), set()).add(number)
  by_set: dict[frozenset, list[int]] = {}
  for process, numbers in held.items():
    by_set.setdefault(frozenset(numbers), []).append(process)
  found, taken = [], 0
  for numbers, processes in by_set.items():
    inside = sorted(numbers)
    box = _box([groups[n][0] for n in inside])
    taken += len(inside)
    if sum(_regions.size(groups[n][0]) for n in inside) != _regions.size(box):
      return None  # the regions leave holes in their box (or overlap)
    found.append((box, tuple(sorted(processes)), tuple(inside)))
  if taken != len(groups):
    return None  # a device region is held with different companions by different processes
  block = tuple(max(b[d].stop - b[d].start for b, *_ in found) for d in range(len(shape)))
  for box, *_ in found:
    for s, n, d in zip(box, block, shape):
      if s.start % max(n, 1) or (s.stop - s.start != n and s.stop != d):
        return None
  return Blocks(block, tuple(sorted(found, key=lambda b: _regions.bounds(b[0], shape))))


def _box(regions: Sequence[Region]) -> Region:
  return tuple(
    slice(min(r[d].start for r in regions), max(r[d].stop for r in regions))
    for d in range(len(regions[0]))
  )


def _within(region: Region, unit: Sequence[int], shape: Sequence[int]) -> bool:
  """Whether `region` is made of whole units (or reaches the array's edge)."""
  return all(
    s.start % u == 0 and (s.stop % u == 0 or s.stop == d) for s, u, d in zip(region, unit, shape)
  )


def _units(block: Region, unit: Sequence[int], shape: Sequence[int]):
  """The units (whole, clipped to the array) that tile `block`, in C order."""
  ranges = [
    [slice(lo, min(lo + u, s.stop)) for lo in range(s.start, s.stop, u)]
    for s, u in zip(block, unit)
  ]
  return itertools.product(*ranges)


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
