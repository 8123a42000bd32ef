"""One JAX process of a multi-process incremental save (see tests/test_incremental_multiprocess.py).

Usage: python incremental_worker.py SCENARIO PROCESS_ID NUM_PROCESSES PORT WORKDIR

Joins the run on 127.0.0.1:PORT (gloo collectives on CPU), saves a series of steps to
WORKDIR, and writes WORKDIR/result-PROCESS_ID.json; an exception exits non-zero.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multiprocess_run import worker_main

import ucp_jax


def values(step: int) -> dict[str, np.ndarray]:
  """The global values of step `step` (frozen ones equal at every step)."""
  return {
    "sharded": np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
    "grid": np.arange(16 * 24, dtype=np.float32).reshape(16, 24) / 7,
    "replicated": np.arange(4096, dtype=np.float32).reshape(64, 64),  # written in shared slabs
    "adapter": np.full((8, 4), float(step), np.float32),
  }


def _shardings() -> dict[str, NamedSharding]:
  devices = np.array(jax.devices())
  flat, grid = Mesh(devices, ("x",)), Mesh(devices.reshape(2, 4), ("d", "m"))
  return {
    "sharded": NamedSharding(flat, P("x")),
    "grid": NamedSharding(grid, P("d", "m")),
    "replicated": NamedSharding(grid, P()),
    "adapter": NamedSharding(flat, P("x")),
  }


def _arrays(step: int, change_on: int | None = None) -> dict[str, jax.Array]:
  """Global arrays built from each process's own shards; with `change_on`, the part of
  `grid` held by that process differs (the others' parts are equal)."""
  out = {}
  for key, sharding in _shardings().items():
    value = values(step)[key]
    if key == "grid" and change_on == jax.process_index():
      value = value + 1
    out[key] = jax.make_array_from_callback(value.shape, sharding, lambda i, v=value: v[i])
  return out


def local(workdir: str) -> dict:
  frozen = _arrays(1)
  for step in (1, 2):
    state = {**frozen, "adapter": _arrays(step)["adapter"]}
    base = os.path.join(workdir, str(step - 1)) if step > 1 else None
    ucp_jax.save(os.path.join(workdir, str(step)), state, base=base, bundle_bytes=4096)
  state = {**frozen, "adapter": _arrays(3)["adapter"]}
  path = os.path.join(workdir, "3")
  ucp_jax.save_async(path, state, base=os.path.join(workdir, "2"), bundle_bytes=4096).result()
  return {}


def sha256(workdir: str) -> dict:
  """New objects at every step: only hashes can tell; process 1's part of `grid` changes."""
  ucp_jax.save(os.path.join(workdir, "1"), _arrays(1), unchanged="sha256")
  state = {**_arrays(2, change_on=1)}
  ucp_jax.save(
    os.path.join(workdir, "2"), state, base=os.path.join(workdir, "1"), unchanged="sha256"
  )
  return {}


def object_store(workdir: str) -> dict:
  frozen = _arrays(1)
  for step in (1, 2, 3):
    spec = {"driver": "file", "path": os.path.join(workdir, "bucket", "run", str(step))}
    base = os.path.join(workdir, "bucket", "run", str(step - 1)) if step > 1 else None
    base = {"driver": "file", "path": base} if base else None
    ucp_jax.save(spec, {**frozen, "adapter": _arrays(step)["adapter"]}, base=base)
  return {}


SCENARIOS = {"local": local, "sha256": sha256, "object_store": object_store}


def main() -> None:
  worker_main(SCENARIOS)


if __name__ == "__main__":
  main()
