"""One JAX process of a multi-process test run (see tests/test_multiprocess.py).

Usage: python multiprocess_worker.py SCENARIO PROCESS_ID NUM_PROCESSES PORT WORKDIR

The parent sets XLA_FLAGS (fake CPU device count) and JAX_PLATFORMS=cpu. The
worker joins the run on 127.0.0.1:PORT, runs SCENARIO, and writes
WORKDIR/result-PROCESS_ID.json; any exception exits non-zero with a traceback.
The module also defines the global test data, which the parent imports.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multiprocess_run import worker_main

import ucp_jax
from ucp_jax.store import _writer
from ucp_jax.tree import _save

STEP = 7
OLD_STEP = 1


def expected() -> dict:
  """The global (unsharded) values of every leaf, the same in every process."""
  rng = np.random.default_rng(0)
  keys = jax.random.split(jax.random.key(42), 8)
  return {
    "x8": np.arange(64 * 3, dtype=np.float32).reshape(64, 3),
    "dm": rng.standard_normal((16, 12)).astype(np.float32),
    "rep": np.arange(10, dtype=np.int32) * 3,
    "bf16": (np.arange(8 * 16).reshape(8, 16) / 4).astype(jax.numpy.bfloat16),
    "host": np.arange(6, dtype=np.int64).reshape(2, 3),
    "count": STEP,
    "lr": 0.25,
    "keys": np.asarray(jax.random.key_data(keys)),
  }


def global_array(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array built from each process's own shards (nothing is gathered)."""
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def meshes() -> tuple[Mesh, Mesh]:
  """A flat mesh ('x',) of all devices and a (2, 4) mesh ('d', 'm'), process-major."""
  devices = np.array(jax.devices())
  return Mesh(devices, ("x",)), Mesh(devices.reshape(2, 4), ("d", "m"))


def state() -> dict:
  """The state to save, laid out over every device of the run."""
  flat, grid = meshes()
  data = expected()
  key_data = global_array(data["keys"], NamedSharding(flat, P("x", None)))
  return {
    "x8": global_array(data["x8"], NamedSharding(flat, P("x"))),
    "dm": global_array(data["dm"], NamedSharding(grid, P("d", "m"))),
    "rep": global_array(data["rep"], NamedSharding(grid, P())),
    "bf16": global_array(data["bf16"], NamedSharding(flat, P(None, "x"))),
    "host": data["host"],
    "count": data["count"],
    "lr": data["lr"],
    "keys": jax.random.wrap_key_data(key_data),
  }


def restore_target() -> dict:
  """A target on the (2, 4) mesh, laid out differently from `state()`."""
  _, grid = meshes()
  data = expected()

  def spec(key: str, *axes) -> jax.ShapeDtypeStruct:
    value = data[key]
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(grid, P(*axes)))

  return {
    "x8": spec("x8", ("m", "d")),
    "dm": spec("dm", "m", "d"),
    "rep": spec("rep", "d"),
    "bf16": spec("bf16", "m", "d"),
    "host": np.zeros((2, 3), np.int64),
    "count": 0,
    "lr": 0.0,
    "keys": jax.ShapeDtypeStruct(
      (8,), jax.random.key(0).dtype, sharding=NamedSharding(grid, P("m"))
    ),
  }


def check_restored(restored: dict) -> int:
  """Compares every addressable shard with its slice of `expected()`; returns the count."""
  data = expected()
  checked = 0
  for key, want in data.items():
    got = restored[key]
    if key == "keys":
      got = jax.random.key_data(got)
    if isinstance(got, jax.Array):
      assert got.shape == want.shape and got.dtype == want.dtype, (key, got.shape, got.dtype)
      for shard in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=key)
        checked += 1
    else:
      assert type(got) is type(want), (key, type(got))
      np.testing.assert_array_equal(got, want, err_msg=key)
      checked += 1
  return checked


_ORIGINAL_WRITE = _save.Writer._write_entries


def _patch_write(fn) -> None:
  """Runs `fn(writer, entries)` on this process before it writes its shards."""

  def patched(self, entries, max_host_bytes):
    fn(self, entries)
    _ORIGINAL_WRITE(self, entries, max_host_bytes)

  _save.Writer._write_entries = patched


def _unpatch_write() -> None:
  _save.Writer._write_entries = _ORIGINAL_WRITE


def _expect_failure(fn) -> str:
  try:
    fn()
  except Exception as e:
    return f"{type(e).__name__}: {e}"
  raise AssertionError("expected the save to fail on this process")


def save_slow_writer(workdir: str) -> dict:
  """Saves `state()`; process 1 waits, then checks that nothing was committed yet."""
  path = os.path.join(workdir, "ckpt")
  seen = {}
  if jax.process_index() == 1:

    def slow(writer, entries):
      time.sleep(1.5)
      try:
        ucp_jax.open(path)
        seen["committed_before_write"] = True
      except ucp_jax.CheckpointNotFoundError:
        seen["committed_before_write"] = False

    _patch_write(slow)
  ucp_jax.save(path, state(), step=STEP)
  return seen


def restore_grid(workdir: str) -> dict:
  """Restores WORKDIR/ckpt onto the (2, 4) mesh; checks this process's shards."""
  restored = ucp_jax.restore(os.path.join(workdir, "ckpt"), restore_target())
  return {"checked": check_restored(restored)}


def failed_saves(workdir: str) -> dict:
  """Saves that fail on process 1 only; every process must raise, nothing is committed."""
  fresh = os.path.join(workdir, "fresh")
  old = os.path.join(workdir, "old")  # holds a checkpoint at step OLD_STEP
  errors = {}

  def broken(writer, entries):
    raise OSError("injected write failure on process 1")

  if jax.process_index() == 1:
    _patch_write(broken)
  for name, path in (("fresh", fresh), ("old", old)):
    errors[f"write_{name}"] = _expect_failure(
      lambda path=path: ucp_jax.save(path, state(), step=STEP, overwrite=True)
    )
  _unpatch_write()

  # A tree that process 1 cannot even plan (an unsupported leaf): fails before any I/O.
  bad = state()
  if jax.process_index() == 1:
    bad["lr"] = "not a number"
  errors["plan_old"] = _expect_failure(lambda: ucp_jax.save(old, bad, step=STEP, overwrite=True))

  # Another writer holds the lock (the parent made it): process 0 cannot start the save.
  locked = os.path.join(workdir, "locked")
  errors["locked"] = _expect_failure(lambda: ucp_jax.save(locked, state(), step=STEP))

  # The failures left no lock behind and the processes in step: the next save works.
  ucp_jax.save(os.path.join(workdir, "again"), state(), step=STEP)
  return {"errors": errors}


def reshard_live(workdir: str) -> dict:
  """Moves state() spread over both processes onto restore_target()'s shardings, in memory."""
  shardings = {
    k: v.sharding if isinstance(v, jax.ShapeDtypeStruct) else None
    for k, v in restore_target().items()
    if k != "host"
  }
  live = {k: v for k, v in state().items() if k != "host"}
  checked = {}
  for method in ("auto", "device_put"):
    moved = ucp_jax.reshard(live, shardings, method=method)
    for key, sharding in shardings.items():
      if sharding is not None:
        assert moved[key].sharding == sharding, (method, key, moved[key].sharding)
    moved["host"] = expected()["host"]
    checked[method] = check_restored(moved)
  try:
    ucp_jax.reshard(live, shardings, method="host")
  except ValueError as e:
    refused = str(e)
  else:
    refused = ""
  return {"checked": checked, "host_refused": refused}


def replicated_values() -> dict:
  """Arrays that both processes hold whole (or whole along one mesh axis)."""
  return {
    "rep_big": np.arange(64 * 256, dtype=np.float32).reshape(64, 256),  # 8 chunks of 8 KiB
    "half_rep": np.arange(256 * 64, dtype=np.float32).reshape(256, 64) / 7,  # 4 shards x 2 chunks
    "tiny": np.arange(10, dtype=np.int32),  # one chunk: one process writes it
  }


def save_replicated(workdir: str) -> dict:
  """Saves replicated arrays with save and save_async; reports the chunks each process wrote."""
  _, grid = meshes()
  data = replicated_values()
  specs = {"rep_big": P(), "half_rep": P(None, "m"), "tiny": P()}
  state = {k: global_array(v, NamedSharding(grid, specs[k])) for k, v in data.items()}
  wrote: dict[str, dict] = {}
  original = _writer.Writer.commit

  def recording(self, manifest):
    wrote[str(self.target).rstrip("/").rsplit("/", 1)[-1]] = {
      key: table.entries()[0].tolist() for key, table in self._tables.items()
    }
    original(self, manifest)

  _writer.Writer.commit = recording
  try:
    # 8 KiB chunks in bundles of at most 4: a bundle file has one writer, so rep_big is 2
    options = {"chunk_bytes": 8 << 10, "bundle_bytes": 32 << 10}
    ucp_jax.save(os.path.join(workdir, "sync"), state, step=STEP, **options)
    handle = ucp_jax.save_async(os.path.join(workdir, "async"), state, **options)
    handle.result()
  finally:
    _writer.Writer.commit = original
  return {"wrote": wrote}


def convert_fails_on_one(workdir: str) -> dict:
  """Converts a DeepSpeed fixture on both processes; process 1 fails on its first array."""
  from ucp_jax.sources import _source_plan

  tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  src = os.path.join(tests, "fixtures/deepspeed/z2_bf16_dp3")
  if jax.process_index() == 1:

    def broken(tensor):
      raise OSError(5, "Input/output error (injected)", "rank_file.pt")

    _source_plan.assemble = broken
  start = time.monotonic()
  error = _expect_failure(lambda: ucp_jax.convert(os.path.join(src, "ckpt"), workdir + "/out"))
  return {"error": error, "seconds": time.monotonic() - start}


SCENARIOS = {
  "convert_fails_on_one": convert_fails_on_one,
  "save_replicated": save_replicated,
  "reshard_live": reshard_live,
  "save_slow_writer": save_slow_writer,
  "restore_grid": restore_grid,
  "failed_saves": failed_saves,
}


def main() -> None:
  worker_main(SCENARIOS)


if __name__ == "__main__":
  main()
