"""Overwrites a checkpoint incrementally (its own base) and dies or fails at one chosen step.

    python incremental_fault_worker.py PATH VALUE STAGE

PATH is a directory or a JSON kvstore spec (an object store without rename). The state is
a frozen array, taken from the checkpoint at PATH when there is one (restored: then this
process knows it unchanged), and two arrays filled with VALUE; it is saved to PATH with
`base=PATH, overwrite=True`. STAGE is one of commit_fault_worker's stages, or one of the
incremental steps below; `none` saves normally.
"""

import json
import os
import sys

import commit_fault_worker as cfw
import numpy as np

import ucp_jax
from ucp_jax.store import _location, _pool, _reuse

FROZEN = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)


def _die_in_pool_deletion():
  """Killed while the collector deletes a generation of the pool (after condemning it)."""
  real = _location.KvStore.delete_range

  def delete_range(self, key_range):
    if self._location.url.endswith("/.ucp-pool/"):
      cfw.die()
    return real(self, key_range)

  _location.KvStore.delete_range = delete_range


def _die_after_registering():
  real = _pool.register

  def register(*args, **kwargs):
    real(*args, **kwargs)
    cfw.die()

  _pool.register = register


STAGES = {
  **cfw._STAGES,
  "linking": lambda: setattr(_reuse.Linker, "_link", cfw.after_calls(3, _reuse.Linker._link)),
  "registering": _die_after_registering,
  "collecting": _die_in_pool_deletion,
}


def state(path, value: float) -> dict:
  import jax

  mesh = jax.make_mesh((8,), ("d",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  try:
    target = {"frozen": jax.ShapeDtypeStruct(FROZEN.shape, FROZEN.dtype, sharding=sharding)}
    frozen = ucp_jax.restore(path, target, partial=True)["frozen"]
  except ucp_jax.CheckpointNotFoundError:
    frozen = jax.device_put(FROZEN, sharding)
  return {
    "frozen": frozen,
    "a": np.full((40,), value, np.float32),
    "b": np.full((3, 5), value, np.float32),
  }


if __name__ == "__main__":
  path, value, stage = sys.argv[1], float(sys.argv[2]), sys.argv[3]
  if path.startswith("{"):
    path = json.loads(path)
  tree = state(path, value)
  try:
    base = ucp_jax.open(path)
  except ucp_jax.CheckpointNotFoundError:
    base = None
  if stage != "none":
    STAGES[stage]()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # 8 files for the frozen array (a chunk per shard, not bundled): a kill while linking
  # leaves some linked and others not
  ucp_jax.save(path, tree, base=base, overwrite=True, chunk_bytes=8192, bundle_bytes=8192)
  print("saved")
