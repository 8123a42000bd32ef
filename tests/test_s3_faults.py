"""Object stores as trustworthy as disks: a real S3 server (moto's) behind a fault proxy.

Under any fault at any request (503 SlowDown until the retries are spent, a reset before
the request is applied, an answer lost after it was, a body cut half way), a save commits
whole or fails with one `UcpError` line naming the path and the request; the previous
checkpoint stays readable and bit-exact, and the next save works.
"""

import json
import os
import threading

import numpy as np
import pytest
import s3_faults
from test_commit import _value_of  # the one value of commit_fault_worker's state

import ucp_jax

pytest.importorskip("moto.server", reason="moto[server] is in the test extras")

# Fast retries, so that "every retry spent" takes milliseconds: a user's spec may say the same.
RETRIES = {"s3_request_retries": {"max_retries": 3, "initial_delay": "5ms", "max_delay": "20ms"}}


@pytest.fixture(scope="module")
def s3():
  with s3_faults.running(seed=7) as server:
    yield server


def _spec(s3, bucket):
  return {**s3.spec(bucket), "context": RETRIES}


def _tree(value: float) -> dict:
  return {
    "params": {"w": np.full((64, 32), value, np.float32), "b": np.full(32, value, np.float32)},
    "opt": {"mu": np.full((64, 32), value, np.float32)},
    "lr": np.float32(value),
  }


def _check_value(spec) -> float:
  ckpt = ucp_jax.open(spec)
  assert ckpt.verify() == {}
  out = ucp_jax.restore(spec)
  values = {
    float(v)
    for leaf in (out["params"]["w"], out["params"]["b"], out["opt"]["mu"])
    for v in np.unique(leaf)
  }
  assert len(values) == 1 and float(out["lr"]) in values, values
  return values.pop()


KINDS = [  # kind:method (the lock is deleted by a DELETE, which is of kind `delete`)
  "lock:GET",
  "lock:PUT",
  "manifest:GET",
  "manifest:PUT",
  "metadata:PUT",
  "chunk:PUT",
  "list:GET",
  "delete:DELETE",
]
FAULTS = {
  "slowdown": dict(action="status"),  # every attempt: the retries are spent
  "reset": dict(action="reset", count=1),
  "resets": dict(action="reset"),
  "lost": dict(action="lost", count=1),
  "lost-all": dict(action="lost"),
  "truncate": dict(action="truncate", count=1),
}


def overwrite_under_a_fault(server, spec: dict, kind: str, fault: str, scheme: str) -> None:
  """Saves 1, overwrites with 2 under the fault (`kind` "KIND:METHOD", a `FAULTS` name), then
  with 3: the overwrite commits whole or fails in one line naming the `scheme://` path, the
  old checkpoint stays bit-exact, and the next save works."""
  ucp_jax.save(spec, _tree(1.0), step=1)
  kind, method = kind.split(":")
  rule = s3_faults.Rule(kind=kind, method=method, **FAULTS[fault])
  with server.proxy.faults(rule):
    try:
      ucp_jax.save(spec, _tree(2.0), step=2, overwrite=True)
      outcome = None
    except ucp_jax.UcpError as e:
      outcome = str(e)
  assert rule.hits, "the fault never struck"
  value = _check_value(spec)
  if outcome is None:
    assert value == 2.0
  else:
    assert value == 1.0, outcome
    assert "\n" not in outcome and f"{scheme}://" in outcome, outcome
  ucp_jax.save(spec, _tree(3.0), step=3, overwrite=True)
  assert _check_value(spec) == 3.0
  assert ucp_jax.open(spec).step == 3


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("kind", KINDS)
def test_an_overwrite_under_a_fault_loses_nothing(s3, kind, fault):
  overwrite_under_a_fault(s3, _spec(s3, s3.bucket()), kind, fault, "s3")


@pytest.mark.parametrize("seed", range(4))
def test_saves_under_a_mix_of_faults_lose_nothing(s3, seed):
  """SlowDown, resets, lost answers and cut bodies at random on every kind of request."""
  bucket = s3.bucket()
  spec = _spec(s3, bucket)
  ucp_jax.save(spec, _tree(0.0), step=0)
  committed = 0.0
  rules = [
    s3_faults.Rule("status", rate=0.2),
    s3_faults.Rule("reset", rate=0.05),
    s3_faults.Rule("lost", rate=0.05),
    s3_faults.Rule("truncate", rate=0.05),
  ]
  s3.proxy.reseed(seed)
  for step in range(1, 5):
    with s3.proxy.faults(*rules):
      try:
        ucp_jax.save(spec, _tree(float(step)), step=step, overwrite=True)
        committed = float(step)
      except ucp_jax.CommitUncertainError:
        committed = None
      except ucp_jax.UcpError as e:
        assert "\n" not in str(e) and str(e).startswith("s3://"), str(e)
    value = _check_value(spec)
    assert value == committed or (committed is None and value in (step - 1, step)), value
    committed = value
  ucp_jax.save(spec, _tree(9.0), step=9, overwrite=True)
  assert _check_value(spec) == 9.0


READ_FAULTS = {
  "slowdown": dict(action="status"),
  "reset": dict(action="reset", count=1),
  "resets": dict(action="reset"),
  "lost": dict(action="lost", count=2),
  "truncate": dict(action="truncate", count=1),
  "truncates": dict(action="truncate"),
}


@pytest.fixture(scope="module")
def saved(s3):
  """A checkpoint of 8-way sharded arrays in 4 chunks each, its spec."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  spec = _spec(s3, s3.bucket())
  mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
  w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  ucp_jax.save(spec, {"w": jax.device_put(w, NamedSharding(mesh, P("d"))), "b": np.ones(3)}, step=5)
  return spec, w


def _restored_onto_another_mesh(spec):
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((2, 4), ("a", "b"))
  target = {"w": NamedSharding(mesh, P("b", "a")), "b": np.zeros(3)}
  return np.asarray(ucp_jax.restore(spec, target)["w"])


READS = {
  "restore": _restored_onto_another_mesh,
  "numpy": lambda spec: ucp_jax.restore(spec)["w"],
  "read": lambda spec: ucp_jax.open(spec).read("w", np.s_[8:40, 3:]),
  "verify": lambda spec: ucp_jax.open(spec).verify(),
}


@pytest.mark.parametrize("fault", sorted(READ_FAULTS))
@pytest.mark.parametrize("kind", ["chunk", "metadata", "manifest", "list"])
@pytest.mark.parametrize("read", sorted(READS))
def test_a_read_under_a_fault_is_exact_or_one_error(s3, saved, read, kind, fault):
  """Data read after a retry is checked like any other: exact, or an error; never wrong."""
  spec, w = saved
  rule = s3_faults.Rule(kind=kind, method="GET", **READ_FAULTS[fault])
  with s3.proxy.faults(rule):
    try:
      out = READS[read](spec)
    except ucp_jax.UcpError as e:
      assert isinstance(e, ucp_jax.StorageError), repr(e)
      assert "\n" not in str(e) and str(e).startswith("s3://"), str(e)
      return
  expected = {"restore": w, "numpy": w, "read": w[8:40, 3:], "verify": {}}[read]
  np.testing.assert_array_equal(out, expected) if read != "verify" else None
  assert read != "verify" or out == {}, out


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support", "s3_worker.py")
STALLS = [  # op, kind, method
  ("restore", "chunk", "GET"),
  ("read", "chunk", "GET"),
  ("verify", "chunk", "GET"),
  ("restore", "manifest", "GET"),
  ("save", "chunk", "PUT"),
  ("save", "manifest", "PUT"),
  ("save", "lock", "PUT"),
  ("save", "list", "GET"),
]


def stalled_is_one_error(server, spec: dict, op: str, rule, scheme: str) -> None:
  """Runs `op` (s3_worker.py) on `spec` in a process of its own with UCP_STORE_TIMEOUT_S=3
  while `rule` stalls requests: it ends in one StorageError line naming the `scheme://` path."""
  import subprocess
  import sys

  env = {**os.environ, **s3_faults.ENV, "UCP_STORE_TIMEOUT_S": "3"}
  env.pop("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", None)
  with server.proxy.faults(rule):
    proc = subprocess.run(
      [sys.executable, WORKER, op, json.dumps(spec)],
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
    )
  assert rule.hits, "the fault never struck"
  lines = [line for line in proc.stdout.splitlines() if line != "started"]
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert len(lines) == 1 and lines[0].startswith(f"StorageError: {scheme}://"), lines
  assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("action", ["stall", "stall-body"])
@pytest.mark.parametrize(("op", "kind", "method"), STALLS)
def test_a_stalled_store_is_one_error_not_a_hang(s3, saved, op, kind, method, action):
  """With UCP_STORE_TIMEOUT_S=3, a request that never finishes (no answer, or a body that
  stops half way) ends the operation with one StorageError line. The subprocess timeout
  only tells a hang from an answer: nothing here measures how long it took."""
  if action == "stall-body" and method != "GET":
    pytest.skip("a PUT's answer has no body to cut")
  spec, _ = saved
  if op == "save":
    spec = _spec(s3, s3.bucket())
    ucp_jax.save(spec, _tree(1.0), step=1)
  stalled_is_one_error(s3, spec, op, s3_faults.Rule(action, kind=kind, method=method), "s3")
  if op == "save":
    assert _check_value(spec) == 1.0


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_ctrl_c_stops_a_command_waiting_on_a_stalled_store(s3, saved, command):
  import signal
  import subprocess
  import sys

  spec, _ = saved
  kind = "chunk" if command == "verify" else "manifest"
  rule = s3_faults.Rule("stall", kind=kind, method="GET")
  env = {**os.environ, **s3_faults.ENV, "UCP_STORE_TIMEOUT_S": "600"}
  env.pop("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", None)
  with s3.proxy.faults(rule):
    proc = subprocess.Popen(
      [sys.executable, "-m", "ucp_jax.cli", command, json.dumps(spec)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for _ in range(1200):  # until the stalled request is held (a hang detector, not a timer)
      if rule.hits or proc.poll() is not None:
        break
      threading.Event().wait(0.1)
    assert rule.hits, proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
  assert proc.returncode == 130, err
  assert "Traceback" not in err


KILLS = [  # kind, method, after (matching requests let through first), action
  ("lock", "PUT", 0, "kill-after"),
  ("metadata", "PUT", 2, "kill"),
  ("chunk", "PUT", 0, "kill"),
  ("chunk", "PUT", 1, "kill-after"),
  ("manifest", "PUT", 0, "kill"),
  ("manifest", "PUT", 0, "kill-after"),
  ("delete", "DELETE", 0, "kill"),  # after the commit, deleting the replaced generation
  ("delete", "DELETE", 2, "kill-after"),
]


@pytest.mark.parametrize(("kind", "method", "after", "action"), KILLS)
def test_a_save_killed_at_any_request_loses_nothing(s3, kind, method, after, action):
  """SIGKILL as the store sees a request (before it is applied, or after): the checkpoint
  there is the old one or the new one, whole, and the next save collects what was left."""
  import subprocess
  import sys

  worker = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "support", "commit_fault_worker.py"
  )
  spec = _spec(s3, s3.bucket())
  env = {**os.environ, **s3_faults.ENV, "JAX_PLATFORMS": "cpu"}

  args = [sys.executable, worker, json.dumps(spec)]

  def save(value):
    proc = subprocess.run([*args, str(value), "none"], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr

  save(1)
  with subprocess.Popen(
    [*args, "2", "none"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
  ) as proc:
    rule = s3_faults.Rule(action, kind=kind, method=method, after=after, count=1, pid=proc.pid)
    with s3.proxy.faults(rule):
      proc.communicate(timeout=120)
  assert rule.hits, "the kill never struck"
  assert proc.returncode == -9
  value = _value_of(spec)
  assert value in (1.0, 2.0)
  if kind == "delete":
    assert value == 2.0  # killed after its commit
  save(3)
  assert _value_of(spec) == 3.0
  live = ucp_jax.open(spec).manifest.data
  assert {k.split("/")[1] + "/" for k in s3.keys(spec["bucket"]) if "/g" in k} == {live}


def _chained(root: dict, step: int) -> dict:
  return {**root, "path": f"{root['path']}/{step}"}


@pytest.mark.parametrize("fault", ["slowdown", "lost", "resets"])
@pytest.mark.parametrize(
  "kind", ["chunk:PUT", "manifest:PUT", "delete:DELETE", "list:GET", "chunk:GET"]
)
def test_incremental_steps_on_s3_under_a_fault_lose_nothing(s3, kind, fault):
  """save(base=...) into the pool beside the steps (its references, its collector): under a
  fault each step commits whole or fails in one line; every committed step restores alone."""
  import jax.numpy as jnp

  frozen = {f"w{i}": jnp.full((64, 64), float(i)) for i in range(3)}
  root = {**_spec(s3, s3.bucket()), "path": "run"}

  def state(step):
    return {"frozen": frozen, "adapter": jnp.full((8,), float(step))}

  def holds(step):
    spec = _chained(root, step)
    assert ucp_jax.open(spec).verify() == {}
    out = ucp_jax.restore(spec)
    assert all(np.all(out["frozen"][k] == np.asarray(v)) for k, v in frozen.items())
    return float(out["adapter"][0])

  ucp_jax.save(_chained(root, 1), state(1))
  ucp_jax.save(_chained(root, 2), state(2), base=_chained(root, 1))
  method_kind, method = kind.split(":")
  rule = s3_faults.Rule(kind=method_kind, method=method, **FAULTS[fault])
  committed = [1, 2]
  with s3.proxy.faults(rule):
    try:
      ucp_jax.save(_chained(root, 3), state(3), base=_chained(root, 2))
      committed.append(3)
    except ucp_jax.UcpError as e:
      assert "\n" not in str(e) and str(e).startswith("s3://"), str(e)
  assert rule.hits, "the fault never struck"
  for step in committed:
    assert holds(step) == step
  base = committed[-1]
  ucp_jax.save(_chained(root, 4), state(4), base=_chained(root, base))  # collects after it
  for step in (*committed, 4):
    assert holds(step) == step


def test_save_async_and_a_resharded_restore_on_s3(s3):
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  spec = _spec(s3, s3.bucket())
  mesh8 = jax.make_mesh((8,), ("d",))
  w = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
  state = {"w": jax.device_put(w, NamedSharding(mesh8, P("d"))), "step": 3}
  pending = ucp_jax.save_async(spec, state, step=3)
  pending.result()
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  target = {
    "w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P("b", "a"))),
    "step": 0,
  }
  out = ucp_jax.restore(spec, target)
  np.testing.assert_array_equal(np.asarray(out["w"]), w)
  assert out["w"].sharding == target["w"].sharding and out["step"] == 3
  with s3.proxy.faults(s3_faults.Rule("status", kind="manifest", method="PUT")):
    pending = ucp_jax.save_async(spec, {**state, "step": 4}, step=4, overwrite=True)
    with pytest.raises(ucp_jax.StorageError, match=r"^s3://.*manifest\.json"):
      pending.result()
  assert ucp_jax.open(spec).step == 3
  np.testing.assert_array_equal(ucp_jax.restore(spec)["w"], w)


def test_a_restore_reads_each_zarr_json_once(s3):
  """The metadata ucp_jax reads to check it before TensorStore's parser sees it is the
  metadata the array opens on: one request per array, not two."""
  spec = _spec(s3, s3.bucket())
  ucp_jax.save(spec, _tree(2.0))
  arrays = len(ucp_jax.open(spec).keys())
  before = s3.proxy.seen("metadata")
  assert _check_value(spec) == 2.0  # verify, then restore: each opens every array
  assert s3.proxy.seen("metadata") - before == 2 * arrays


def test_a_restore_reads_each_bundle_in_one_request(s3):
  """A process's chunks of a bundle are read in one batch: TensorStore coalesces them (and
  the bundle's index) into one ranged GET, not a GET per chunk and index; `read` and
  `verify` read that way too."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  spec = _spec(s3, s3.bucket())
  mesh8 = jax.make_mesh((8,), ("d",))
  w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  state = {f"w{i}": jax.device_put(w + i, NamedSharding(mesh8, P("d"))) for i in range(4)}
  ucp_jax.save(spec, state, chunk_bytes=1024)  # 8 chunks, one bundle, per array
  assert all(ucp_jax.open(spec)[k].bundle == (64, 32) for k in state)
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  target = {k: NamedSharding(mesh, P("b", "a")) for k in state}  # 8 slices, each in 2 chunks
  before = s3.proxy.seen("chunk", method="GET")
  out = ucp_jax.restore(spec, target)
  assert s3.proxy.seen("chunk", method="GET") - before == len(state)
  for i, k in enumerate(sorted(state)):
    np.testing.assert_array_equal(np.asarray(out[k]), w + i)
  before = s3.proxy.seen("chunk", method="GET")
  np.testing.assert_array_equal(ucp_jax.open(spec).read("w2"), w + 2)  # a whole array: one too
  assert s3.proxy.seen("chunk", method="GET") - before == 1
  before = s3.proxy.seen("chunk", method="GET")
  assert ucp_jax.open(spec).verify() == {}  # and verify, array by array
  assert s3.proxy.seen("chunk", method="GET") - before == len(state)
