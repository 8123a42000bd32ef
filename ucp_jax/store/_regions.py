"""Regions of an array (tuples of `slice(start, stop)`): the one place they are computed."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  import jax

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


def cached_when_hashable(maxsize: int):
  """`functools.lru_cache`, except for calls with an unhashable argument (a custom
  sharding), which are computed each time."""

  def wrap(fn):
    cached = functools.lru_cache(maxsize=maxsize)(fn)

    @functools.wraps(fn)
    def call(*args):
      try:
        hash(args)
      except TypeError:
        return fn(*args)
      return cached(*args)

    return call

  return wrap


@cached_when_hashable(maxsize=4096)
def sharding_problem(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> str | None:
  """Why `sharding` cannot lay out an array of `shape`, or None when it can."""
  spec = getattr(sharding, "spec", None)
  if spec is not None:
    where = f"{spec} on mesh {dict(sharding.mesh.shape)}"
    if len(spec) > len(shape):
      return f"{where} has {len(spec)} dimensions, the array {len(shape)}"
    mesh_shape = dict(sharding.mesh.shape)
    for dim, axes in zip(shape, spec):
      names = axes if isinstance(axes, tuple) else (axes,)
      parts = math.prod(mesh_shape[a] for a in names if a is not None)
      if parts > 1 and dim % parts:
        return f"{where} splits a dimension of size {dim} into {parts} uneven parts"
  try:
    sharding.shard_shape(shape)
  except (ValueError, TypeError, IndexError) as e:
    return f"{sharding} cannot shard shape {shape}: {e}"
  return None


@cached_when_hashable(maxsize=1024)
def group_by_slice(
  sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> tuple[tuple[Region, tuple[jax.Device, ...]], ...]:
  """This process's devices of `sharding`, grouped by the region of the array each holds
  (computed once per sharding and shape: a state's arrays share a few)."""
  return group_regions(sharding.addressable_devices_indices_map(shape), shape)
