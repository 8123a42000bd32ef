"""Chunks on an object store, read in batches: a request per run of a bundle, not per chunk.

Read one by one through TensorStore, each chunk of a bundle costs a request (and, without a
cache, one more for the bundle's index): 144 GETs for 16 arrays of 8 chunks. TensorStore
coalesces the reads of one `ts.Batch` that fall in the same object into one ranged GET, so
a process reads the chunks under its slices in batches of about `BATCH_BYTES`, each chunk
checked against the manifest's checksum for its place (as every read is), then copied into
the aligned host buffers that devices adopt. At most two batches are in flight: host memory
is the buffers plus two batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import crc32c
import numpy as np

from ucp_jax.base import _errors
from ucp_jax.store import _bundle, _chunks, _direct, _hostmem, _regions, _zarr
from ucp_jax.store._location import Location
from ucp_jax.store._regions import Region

BATCH_BYTES = 64 << 20
"""Chunk bytes one batch asks for (the unit of coalescing and of memory in flight)."""


def start_read(
  location: Location,
  where: str,
  key: str,
  info: Any,
  stored: Any,
  regions: Sequence[Region],
) -> tuple[list[np.ndarray], Callable[[], None]]:
  """Starts reading `regions` of `key` (`info`: its manifest entry; `stored`: the opened zarr
  array, its metadata checked) into new aligned host buffers; returns them and a function
  that waits for them (raising what went wrong, with `where` naming the array's files)."""
  dtype = np.dtype(info.dtype)
  outs = [_hostmem.aligned_empty(tuple(s.stop - s.start for s in r), dtype) for r in regions]
  needed = sorted({i for region in regions for i in _chunks.chunks_in(region, info.chunks)})
  chunk_bytes = max(1, math.prod(info.chunks) * dtype.itemsize)
  per_batch = max(1, BATCH_BYTES // chunk_bytes)
  batches = [needed[i : i + per_batch] for i in range(0, len(needed), per_batch)]
  started = [_start(stored, info, batch) for batch in batches[:2]]

  def wait() -> None:
    for n in range(len(batches)):
      if n + 2 < len(batches):
        started.append(_start(stored, info, batches[n + 2]))
      for index, future in started[n]:
        data = _zarr.wait_read(location, key, future)
        _check(info, where, key, index, data)
        _scatter(data, _chunks.chunk_region(index, info.chunks, info.shape), regions, outs)
      started[n] = []  # the batch's chunks go as soon as they are copied out

  return outs, wait


def _start(stored: Any, info: Any, indices: list[tuple[int, ...]]) -> list[tuple[tuple, Any]]:
  import tensorstore as ts

  batch = ts.Batch()
  reads = [
    (index, stored[_chunks.chunk_region(index, info.chunks, info.shape)].read(batch=batch))
    for index in indices
  ]
  batch.submit()
  return reads


def _check(info: Any, where: str, key: str, index: tuple[int, ...], data: np.ndarray) -> None:
  expected = info.expected_crc(index)
  if expected is None:
    return
  computed = crc32c.crc32c(_chunks.raw_bytes(_chunks.padded(data, info.chunks)))
  if computed != expected:
    shown = f"{where}/{_bundle.chunk_name(info, index)}"
    raise _errors.CorruptCheckpointError(_direct.misplaced(shown, key, computed, expected))


def _scatter(data: np.ndarray, chunk: Region, regions: Sequence[Region], outs: list) -> None:
  for region, out in zip(regions, outs):
    part = _regions.overlap(chunk, region)
    if part is not None:
      out[_regions.relative(part, region)] = data[_regions.relative(part, chunk)]
