"""Host buffers that CPU devices can adopt without a copy."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  import jax

_ALIGN = 64  # XLA's CPU client aliases host buffers aligned to this many bytes


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """An uninitialized C-contiguous array whose data is 64-byte aligned."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
  offset = (-raw.ctypes.data) % _ALIGN
  return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def to_device(host: np.ndarray, device: jax.Device) -> jax.Array:
  """Puts `host` on `device`; on CPU an aligned buffer is adopted, not copied.

  The caller must not write to `host` afterwards.
  """
  import jax

  return jax.device_put(host, device, may_alias=True)
