"""What several JAX processes must agree on during a save: a token, and that all went well."""

from __future__ import annotations

import jax
import numpy as np


def is_primary() -> bool:
  return jax.process_index() == 0


def broadcast_from_primary(values: np.ndarray) -> np.ndarray:
  """Process 0's `values` on every process (a no-op with one process)."""
  if jax.process_count() == 1:
    return values
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.broadcast_one_to_all(values))


def all_ok(ok: bool) -> bool:
  """True on every process iff `ok` was true on every process; also a barrier."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils

  flags = multihost_utils.process_allgather(np.array([ok], dtype=np.int32))
  return bool(np.all(flags))
