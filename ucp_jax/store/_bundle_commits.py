"""Bundles written through TensorStore (object stores, compressed arrays): one transaction
per bundle, committed once every chunk of it is in, so each bundle is one PUT.

A bundle holds the shards of several devices of one process (`_owners`), which arrive
as several writes. Written one by one, each would be a read-modify-write of the bundle
object: a GET and a PUT per device shard, and a bundle that grows object by object. In one
transaction TensorStore assembles the bundle and writes it whole, with no read.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.store import _bundle, _chunks, _regions
from ucp_jax.store._regions import Region


class BundleCommits:
  """The bundles of one save still being assembled, by array key and bundle index."""

  def __init__(self) -> None:
    self._open: dict[tuple[str, tuple[int, ...]], list] = {}  # -> [transaction, chunks left]
    self._lock = threading.Lock()

  def write(
    self, key: str, store: Any, info: Any, region: Region, data: np.ndarray, immutable: bool
  ) -> list:
    """Starts writing `data`, the chunk-aligned `region` of the bundled array `key` (its
    `store` and `ArrayInfo`), into the transactions of the bundles it covers; returns the
    writes' futures (done once TensorStore holds the data) and the commits of the bundles
    it completes. Called by one thread at a time for a given bundle."""
    import tensorstore as ts

    layout = _bundle.Layout(info.shape, info.chunks, info.bundle)
    counts: dict[tuple[int, ...], int] = {}
    for chunk in _chunks.chunks_in(region, info.chunks):
      where = layout.bundle_of(chunk)
      counts[where] = counts.get(where, 0) + 1
    futures = []
    for where, chunks in counts.items():
      extent = _regions.full(info.shape)
      bundle = tuple(
        slice(i * b, min((i + 1) * b, s.stop)) for i, b, s in zip(where, info.bundle, extent)
      )
      part = _regions.overlap(region, bundle)
      assert part is not None  # counts name only the bundles the region meets
      with self._lock:
        entry = self._open.get((key, where))
        if entry is None:
          entry = self._open[(key, where)] = [ts.Transaction(), math.prod(layout.present(where))]
        transaction = entry[0]
      view = store.with_transaction(transaction)[part]
      write = view.write(
        data[_regions.relative(part, region)], can_reference_source_data_indefinitely=immutable
      )
      futures.append(write.copy)
      with self._lock:
        entry[1] -= chunks
        done = entry[1] == 0
        if done:
          del self._open[(key, where)]
      if done:  # TensorStore starts the commit once the writes still copying are in
        futures.append(transaction.commit_async())
    return futures

  def check_complete(self, where: str) -> None:
    """Raises if a bundle did not get all its chunks (they would be missing, not written)."""
    with self._lock:
      left = sorted(self._open)
      self._open.clear()
    if left:
      raise _errors.UcpError(
        f"{where}: bundles written in part (an ownership with a gap; nothing committed): "
        + ", ".join(f"{key} bundle {list(index)}" for key, index in left[:5])
      )
