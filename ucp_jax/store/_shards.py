"""Which regions of a save's arrays this process writes, and the host copies of their data.

A save writes each region once (`_owners`: replicas share the work); the shards of a
`DeviceArray` are copied to host memory as the writes need them, every copy started at once.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from ucp_jax.store import _manifest, _regions
from ucp_jax.store._regions import Region


@dataclasses.dataclass(frozen=True)
class Entry:
  """One array of a save: its key, what the manifest says of it, and its data."""

  key: str
  info: _manifest.ArrayInfo
  value: Any  # a `DeviceArray` or a numpy array
  # Host copies of the (index, data) this process writes, taken by `save_async`; None: use `value`.
  # The data is None for a reused array whose copy `save_async` did not take.
  owned: tuple[tuple[tuple[slice, ...], np.ndarray | None], ...] | None = None
  reuse: bool = False  # unchanged since the base: its files are the base's (`_reuse`)


class DeviceArray(abc.ABC):
  """An array in device memory that a save writes from: the store knows devices only through
  this (the tree layer wraps each `jax.Array` in one, `tree._device_arrays`)."""

  @property
  @abc.abstractmethod
  def in_host_memory(self) -> bool:
    """Whether its shards already are host memory (CPU devices): written from there, with no
    host copy to bound."""

  @abc.abstractmethod
  def regions(self, key: str, unit: tuple[int, ...]) -> list[Region]:
    """The regions this process writes (`unit`: the chunks or bundles a writer owns whole)."""

  @abc.abstractmethod
  def pieces(self, key: str, unit: tuple[int, ...]) -> list[tuple[Region, Any, Region]]:
    """(region, shard, the shard's region) for each region this process writes."""

  @abc.abstractmethod
  def start_host_copy(self, shard: Any) -> Any:
    """Starts copying a shard to host memory; `np.asarray` of the result waits for it."""


def owned_shards(entries: list[Entry], primary: bool) -> Iterator[tuple[Entry, tuple, Any, tuple]]:
  """(entry, region, data, data's region) for every region this process must write.

  `data` holds `region` (a whole shard) or more (a replicated shard that several
  processes share: `slab` cuts out the region). Device-to-host copies start early.
  """
  device_shards = []
  for entry in entries:
    if entry.reuse:
      continue
    if entry.owned is not None:
      for index, data in entry.owned:
        yield entry, index, data, index
    elif isinstance(entry.value, DeviceArray):
      device_shards += [(entry, *p) for p in entry.value.pieces(entry.key, _unit(entry))]
    elif primary:
      full = tuple(slice(0, d) for d in entry.info.shape)
      yield entry, full, entry.value, full
  copies: dict[int, Any] = {}  # a shard holding several regions is copied once
  for entry, region, data, origin in device_shards:
    copy = copies.get(id(data))
    if copy is None:
      copy = copies[id(data)] = entry.value.start_host_copy(data)
    yield entry, region, copy, origin


def _unit(entry: Entry) -> tuple[int, ...]:
  return entry.info.bundle or entry.info.chunks  # a bundle file has one writer


def no_data(entry: Entry) -> bool:
  """Whether an entry lacks the data to be written (`save_async` took no copy of a reused one)."""
  return entry.value is None and (entry.owned is None or any(d is None for _, d in entry.owned))


def owned_regions(entry: Entry, primary: bool) -> list[tuple]:
  """The regions of `entry` this process writes, without touching its data (a reused array's
  files are linked by the process that would write them: its owner is the one)."""
  if entry.owned is not None:
    return [index for index, _ in entry.owned]
  if isinstance(entry.value, DeviceArray):
    return entry.value.regions(entry.key, _unit(entry))
  return [tuple(slice(0, d) for d in entry.info.shape)] if primary else []


def region_data(entry: Entry, region: tuple) -> np.ndarray | None:
  """The host values of `region` (one `owned_regions` gave), copied now; None where
  `save_async` took no copy."""
  if entry.owned is not None:
    return next((data for index, data in entry.owned if index == region), None)
  if isinstance(entry.value, DeviceArray):
    for piece, data, origin in entry.value.pieces(entry.key, _unit(entry)):
      if piece == region:
        return slab(np.asarray(entry.value.start_host_copy(data)), region, origin)
    return None
  return None if entry.value is None else np.asarray(entry.value)[region]


def slab(host: np.ndarray, region: tuple, origin: tuple) -> np.ndarray:
  """The part of `host` (which holds `origin`) that `region` names; a view."""
  return host if region == origin else host[_regions.relative(region, origin)]
