"""Regions of an array (tuples of `slice(start, stop)`): the one place they are computed."""

from __future__ import annotations

Region = tuple[slice, ...]


def normalize(index: tuple, shape: tuple[int, ...]) -> Region:
  """A numpy-style index (slices, possibly short or open) as explicit `slice(start, stop)`s."""
  return tuple(slice(*b) for b in bounds(index, shape))


def full(shape: tuple[int, ...]) -> Region:
  return tuple(slice(0, d) for d in shape)


def size(region: Region) -> int:
  n = 1
  for s in region:
    n *= s.stop - s.start
  return n


def overlap(a: Region, b: Region) -> Region | None:
  """The intersection of two regions, or None when they do not meet."""
  out = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b))
  return None if any(s.start >= s.stop for s in out) else out


def relative(region: Region, origin: Region) -> tuple:
  """`region` relative to `origin`, as an index that gives a view even of a 0-d array."""
  return (*(slice(r.start - o.start, r.stop - o.start) for r, o in zip(region, origin)), Ellipsis)


def bounds(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  """A numpy-style index (slices, possibly short or open) as hashable `(start, stop)` pairs
  (slices hash only from Python 3.12)."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  return tuple(s.indices(d)[:2] for s, d in zip(index, shape))


def group_regions(index_map, shape: tuple[int, ...]) -> tuple[tuple[Region, tuple], ...]:
  """Devices grouped by the region of the array each holds (`index_map`: device -> index)."""
  groups: dict[tuple, list] = {}
  for device, index in index_map.items():
    groups.setdefault(bounds(index, shape), []).append(device)
  return tuple((tuple(slice(*b) for b in where), tuple(devs)) for where, devs in groups.items())
