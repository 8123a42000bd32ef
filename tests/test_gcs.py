"""gs:// kept to the same promises as s3://: TensorStore's gcs driver against a GCS server
(gcp-storage-emulator, `gcs_server`) behind the same fault proxy.

Save, a restore onto another mesh, reads, verify, overwrite and save_async; an overwrite
under a fault at any kind of request loses nothing; a stalled request is one error; the
incremental pool; a source format read in place and converted gs:// to gs://.
"""

import numpy as np
import pytest
import s3_faults
from test_s3_faults import overwrite_under_a_fault, stalled_is_one_error
from test_s3_sources import _hf, _same_arrays

import ucp_jax

pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator is in the test extras")

RETRIES = {"gcs_request_retries": {"max_retries": 3, "initial_delay": "5ms", "max_delay": "20ms"}}


@pytest.fixture(scope="module")
def gcs():
  import gcs_server

  with gcs_server.running(seed=11) as server:
    yield server


def _spec(gcs, bucket: str, path: str = "ckpt") -> dict:
  return {**gcs.spec(bucket, path), "context": RETRIES}


def test_save_restore_read_verify_overwrite_and_save_async_on_gcs(gcs):
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  bucket = gcs.bucket()
  url = gcs.url(bucket)
  mesh8 = jax.make_mesh((8,), ("d",))
  w = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
  state = {"w": jax.device_put(w, NamedSharding(mesh8, P("d"))), "step": 3}
  ucp_jax.save(url, state, step=3)
  data = [k for k in gcs.keys(bucket, "ckpt/g") if "/w/c/" in k]
  assert len(data) == 1  # the 8 device shards of one process: one bundle, one object
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  target = {
    "w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P("b", "a"))),
    "step": 0,
  }
  out = ucp_jax.restore(url, target)
  np.testing.assert_array_equal(np.asarray(out["w"]), w)
  assert out["step"] == 3
  np.testing.assert_array_equal(ucp_jax.open(url).read("w", np.s_[8:40, 3:]), w[8:40, 3:])
  assert ucp_jax.open(url).verify() == {}
  with pytest.raises(ucp_jax.CheckpointExistsError):
    ucp_jax.save(url, state)
  ucp_jax.save_async(url, {**state, "step": 4}, step=4, overwrite=True).result()
  assert ucp_jax.open(url).step == 4
  live = ucp_jax.open(url).manifest.data
  assert {k.split("/")[1] + "/" for k in gcs.keys(bucket) if "/g" in k} == {live}


KINDS = ["lock:POST", "manifest:POST", "metadata:POST", "chunk:POST", "list:GET", "delete:DELETE"]


@pytest.mark.parametrize("fault", ["slowdown", "lost", "resets"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_overwrite_on_gcs_under_a_fault_loses_nothing(gcs, kind, fault):
  overwrite_under_a_fault(gcs, _spec(gcs, gcs.bucket()), kind, fault, "gs")


@pytest.mark.parametrize(
  ("op", "kind", "method"), [("restore", "chunk", "GET"), ("save", "manifest", "POST")]
)
def test_a_stalled_gcs_request_is_one_error_not_a_hang(gcs, op, kind, method):
  """With UCP_STORE_TIMEOUT_S=3 a request that never gets its answer ends the operation in
  one StorageError line (the subprocess timeout only tells a hang from an answer)."""
  spec = _spec(gcs, gcs.bucket())
  ucp_jax.save(spec, {"w": np.ones((64, 32), np.float32), "b": np.ones(3)})
  stalled_is_one_error(gcs, spec, op, s3_faults.Rule("stall", kind=kind, method=method), "gs")


def test_incremental_steps_into_the_pool_on_gcs(gcs):
  import jax.numpy as jnp

  frozen = {f"w{i}": jnp.full((64, 64), float(i)) for i in range(3)}
  root = _spec(gcs, gcs.bucket(), "run")

  def step_spec(step):
    return {**root, "path": f"run/{step}"}

  def state(step):
    return {"frozen": frozen, "adapter": jnp.full((8,), float(step))}

  ucp_jax.save(step_spec(1), state(1))
  ucp_jax.save(step_spec(2), state(2), base=step_spec(1))  # into the pool beside the steps
  before = gcs.proxy.seen("chunk", method="POST")
  ucp_jax.save(step_spec(3), state(3), base=step_spec(2))
  written = gcs.proxy.seen("chunk", method="POST") - before
  # the adapter's one object and the pool's reference (written as the save starts, then
  # naming the base's generation too); no frozen array
  assert written == 3
  rule = s3_faults.Rule("status", kind="manifest", method="POST")
  with gcs.proxy.faults(rule), pytest.raises(ucp_jax.StorageError, match=r"^gs://"):
    ucp_jax.save(step_spec(4), state(4), base=step_spec(3))
  ucp_jax.save(step_spec(5), state(5), base=step_spec(3))  # collects what step 4 left
  for step in (1, 2, 3, 5):
    out = ucp_jax.restore(step_spec(step))
    assert float(out["adapter"][0]) == step
    assert all(np.all(out["frozen"][k] == np.asarray(v)) for k, v in frozen.items())
  assert ucp_jax.open(step_spec(5)).verify() == {}


def test_a_source_reads_in_place_and_converts_from_gcs_to_gcs(gcs, tmp_path):
  import tensorstore as ts

  local = _hf(tmp_path)
  bucket = gcs.bucket()
  store = ts.KvStore.open(gcs.spec(bucket, "src/")).result()
  for path in sorted(p for p in local.rglob("*") if p.is_file()):
    store.write(path.relative_to(local).as_posix(), path.read_bytes()).result()
  url = gcs.url(bucket, "src")
  _same_arrays(ucp_jax.open(local), ucp_jax.open(url))
  dst = gcs.url(bucket, "universal")
  ucp_jax.convert(url, dst)
  _same_arrays(ucp_jax.open(local), ucp_jax.open(dst))
  assert ucp_jax.open(dst).verify() == {}


def test_orbax_checkpoint_manager_with_ucp_items_on_gcs(gcs):
  """Orbax's manager keeps its steps on gs:// (through gcsfs), each a ucp_jax checkpoint
  written and restored onto another mesh through TensorStore."""
  pytest.importorskip("gcsfs", reason="gcsfs (Orbax's gs:// paths) is in the test extras")
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from ucp_jax.orbax import UcpRestore, UcpSave

  mesh = jax.make_mesh((8,), ("d",))

  def state(step):
    w = jnp.arange(32.0).reshape(8, 4) + step
    return {"params": {"w": jax.device_put(w, NamedSharding(mesh, P("d")))}, "step": step}

  bucket = gcs.bucket()
  path = gcs.url(bucket, "run")
  options = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(path, options=options) as manager:
    for step in range(4):
      manager.save(step, args=UcpSave(state(step), step=step))
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 3]
  other = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("b", "a"))
  target = {"params": {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=other)}, "step": 0}
  with ocp.CheckpointManager(path, options=options) as manager:  # a new job resumes
    assert manager.latest_step() == 3
    out = manager.restore(3, args=UcpRestore(target))
  np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.arange(32.0).reshape(8, 4) + 3)
  assert out["params"]["w"].sharding == other and out["step"] == 3
  assert ucp_jax.open(gcs.url(bucket, "run/3/default")).verify() == {}
  steps = {k.split("/")[1] for k in gcs.keys(bucket, "run/")}
  assert steps - {".ucp-pool"} == {"2", "3"}  # the older steps deleted by the manager
