"""Devices and shardings: which device holds which region, and host buffers put on devices.

The store reads and writes host buffers; this is where they meet `jax.Array`s. On CPU a
64-byte aligned host buffer (`store._hostmem.aligned_empty`) is adopted by the device as
it is, not copied.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from ucp_jax.store import _caches, _regions
from ucp_jax.store._regions import Region


def on_cpu(sharding: jax.sharding.Sharding) -> bool:
  """Whether every device of `sharding` is a CPU device: its buffers are host memory, which
  host buffers become without a copy (the one "on CPU" check of the package)."""
  return all(d.platform == "cpu" for d in sharding.device_set)


def array_on_cpu(x: Any) -> bool:
  """Whether `x` is a `jax.Array` on CPU devices."""
  return isinstance(x, jax.Array) and on_cpu(x.sharding)


def to_device(host: np.ndarray, device: jax.Device) -> jax.Array:
  """Puts `host` on `device`; on CPU an aligned buffer is adopted, not copied.

  The caller must not write to `host` afterwards.
  """
  return jax.device_put(host, device, may_alias=True)


def dense_copies(dtype: np.dtype) -> bool:
  """Whether `dense_copy` takes arrays of `dtype` as they are (JAX keeps the dtype: no
  64-bit values narrowed where x64 is off)."""
  try:
    return jax.dtypes.canonicalize_dtype(dtype) == np.dtype(dtype)
  except TypeError:
    return False


def dense_copy(view: np.ndarray, out: np.ndarray) -> None:
  """`out[...] = view` for a strided `view` (a transposed or head-split block of a read).

  numpy and TensorStore copy a transposed view element by element, and on a transposition
  of large rows every element misses the cache (2-4 s/GiB here); XLA copies a strided host
  buffer onto a CPU device through a tiled transposition (`TransposePlan`, several times
  faster), so the view goes through a CPU device and the dense result is copied out (a
  `memcpy`). `view.dtype` must pass `dense_copies`.
  """
  if view.size < _DENSE_MIN_ELEMENTS or view.strides[-1] == view.itemsize:
    out[...] = view  # runs of the last axis: numpy copies them whole
    return
  cpu = jax.local_devices(backend="cpu")[0]
  step = max(1, _DENSE_CHUNK_BYTES * view.shape[0] // max(1, view.nbytes))
  for start in range(0, view.shape[0], step):  # a few MiB at a time: small temporaries
    part = slice(start, start + step)
    out[part] = np.asarray(jax.device_put(view[part], cpu))


_DENSE_MIN_ELEMENTS = 1 << 16
"""Below this, numpy's strided copy costs less than a transfer's setup."""
_DENSE_CHUNK_BYTES = 4 << 20
"""What one transfer of `dense_copy` moves: its dense temporary, one per I/O thread at a
time, stays small and warm (reused by the allocator), not a fresh mapping per piece."""


def adopt(
  shape: tuple[int, ...], sharding: jax.sharding.Sharding, hosts: dict[tuple, np.ndarray]
) -> jax.Array:
  """The array over `sharding` whose every slice is the host buffer of its region (keyed by
  `_regions.bounds`), put on this process's devices in one call: on CPU an aligned buffer
  is adopted, not copied (8x faster than a `to_device` per slice).

  The caller must not write to the buffers afterwards.
  """
  return jax.make_array_from_callback(
    shape, sharding, lambda index: hosts[_regions.bounds(index, shape)]
  )


@_caches.cached_when_hashable(maxsize=4096)
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


@_caches.cached_when_hashable(maxsize=1024)
def group_by_slice(
  sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> tuple[tuple[Region, tuple[jax.Device, ...]], ...]:
  """This process's devices of `sharding`, grouped by the region of the array each holds
  (computed once per sharding and shape: a state's arrays share a few)."""
  return _regions.group_regions(sharding.addressable_devices_indices_map(shape), shape)
