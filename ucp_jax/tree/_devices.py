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
