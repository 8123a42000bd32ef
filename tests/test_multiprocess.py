"""Real multi-process JAX: save and restore across processes (gloo on 127.0.0.1).

Each run starts fresh Python processes running tests/support/multiprocess_worker.py; the
single-process side (1 process x 8 devices) runs here, on conftest's 8 devices.
"""

import json
import os
import socket

import jax
import multiprocess_run
import multiprocess_worker as worker
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax

pytestmark = pytest.mark.slow

WORKER = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "support", "multiprocess_worker.py"
)
WORKER_TIMEOUT_S = 60  # a worker dumps its stacks and exits after this long
TIMEOUT_S = WORKER_TIMEOUT_S + 30  # then the parent kills what is left


def run_workers(scenario: str, workdir, *, processes: int = 2, devices: int = 4) -> list[dict]:
  """Runs `scenario` on `processes` processes; returns each one's result, or fails the test."""
  return multiprocess_run.run_workers(
    WORKER,
    scenario,
    workdir,
    processes=processes,
    devices=devices,
    worker_timeout_s=WORKER_TIMEOUT_S,
    timeout_s=TIMEOUT_S,
  )


def _leftovers(directory) -> list[str]:
  return sorted(n for n in os.listdir(directory) if ".ucp-tmp-" in n or ".ucp-lock" in n)


@pytest.fixture(scope="module")
def saved_2x4(tmp_path_factory):
  """A checkpoint saved by 2 processes x 4 devices; process 1 writes 1.5 s late."""
  workdir = tmp_path_factory.mktemp("saved_2x4")
  results = run_workers("save_slow_writer", workdir)
  return workdir, results


def test_save_2x4_restore_1x8(saved_2x4, devices):
  workdir, _ = saved_2x4
  mesh = Mesh(np.array(devices).reshape(4, 2), ("a", "b"))
  data = worker.expected()

  def spec(key, *axes):
    value = data[key]
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, P(*axes)))

  target = {
    "x8": spec("x8", "b"),
    "dm": spec("dm", "a", "b"),
    "rep": spec("rep", "b"),
    "bf16": spec("bf16", None, ("a", "b")),
    "host": np.zeros((2, 3), np.int64),
    "count": 0,
    "lr": 0.0,
    "keys": jax.ShapeDtypeStruct(
      (8,), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P("a"))
    ),
  }
  restored = ucp_jax.restore(workdir / "ckpt", target)
  assert restored["x8"].sharding == target["x8"].sharding
  assert worker.check_restored(restored) == 5 * 8 + 3  # 5 arrays x 8 shards, 3 host leaves
  ckpt = ucp_jax.open(workdir / "ckpt")
  assert ckpt.step == worker.STEP
  assert ckpt.manifest.source["process_count"] == 2
  assert ckpt.manifest.source["device_count"] == 8


def test_commit_waits_for_every_process(saved_2x4):
  workdir, results = saved_2x4
  assert [r["local_devices"] for r in results] == [4, 4]
  # Process 1 looked for the checkpoint after its delay, just before writing.
  assert results[1]["committed_before_write"] is False
  # Everything it wrote afterwards is in the committed checkpoint.
  ckpt = ucp_jax.open(workdir / "ckpt")
  for key, want in worker.expected().items():
    got = ckpt.read(key)
    np.testing.assert_array_equal(got, want, err_msg=key)
  assert _leftovers(workdir) == []


def test_replicated_arrays_are_written_once_by_processes_in_turn(tmp_path):
  results = run_workers("save_replicated", tmp_path)
  data = worker.replicated_values()
  for name in ("sync", "async"):
    wrote = [r["wrote"][name] for r in results]
    for key, value in data.items():
      ckpt = ucp_jax.open(tmp_path / name)
      np.testing.assert_array_equal(ckpt.read(key), value, err_msg=f"{name}/{key}")
      mine, theirs = (set(w[key]) for w in wrote)
      assert not mine & theirs, (name, key)
      assert mine | theirs == set(range(ckpt[key].checksums.size))
    # Replicated over both processes: each writes half of every replicated shard, in whole
    # bundles of 4 chunks (one writer per file).
    assert [len(w["rep_big"]) for w in wrote] == [4, 4]
    assert sorted(w["rep_big"][0] for w in wrote) == [0, 4]
    assert [len(w["half_rep"]) for w in wrote] == [4, 4]
    assert sorted(len(w["tiny"]) for w in wrote) == [0, 1]


def test_a_conversion_failing_on_one_process_fails_on_all_and_commits_nothing(tmp_path):
  results = run_workers("convert_fails_on_one", tmp_path)
  errors = [r["error"] for r in results]
  assert errors[0].endswith("writing arrays failed on another process (see its log)"), errors
  assert (
    errors[1].startswith("StorageError: ")
    and "I/O error: check the disk (rank_file.pt)" in errors[1]
  )
  assert all(r["seconds"] < 30 for r in results), results  # agreed, not waited out
  assert not (tmp_path / "out").exists()
  assert _leftovers(tmp_path) == []


def test_save_1x8_restore_2x4(tmp_path, devices):
  ucp_jax.save(tmp_path / "ckpt", worker.state(), step=worker.STEP)
  results = run_workers("restore_grid", tmp_path)
  # On each process: 5 arrays x 4 local shards, and the 3 host leaves.
  assert [r["checked"] for r in results] == [5 * 4 + 3] * 2


def test_reshard_live_state_across_processes(tmp_path):
  results = run_workers("reshard_live", tmp_path)
  # On each process: 5 arrays x 4 local shards, and the 3 host leaves, for both methods.
  assert [r["checked"] for r in results] == [{"auto": 5 * 4 + 3, "device_put": 5 * 4 + 3}] * 2
  for r in results:
    assert "other processes" in r["host_refused"], r["host_refused"]


def test_failed_save_commits_nothing(tmp_path):
  old = {"w": np.arange(5.0), "step": worker.OLD_STEP}
  ucp_jax.save(tmp_path / "old", old, step=worker.OLD_STEP)
  lock = tmp_path / ".locked.ucp-lock"  # held by this (live) process
  holder = {"host": socket.gethostname(), "pid": os.getpid(), "token": "0", "time": 0}
  lock.write_text(json.dumps(holder))
  results = run_workers("failed_saves", tmp_path)
  errors = [r["errors"] for r in results]
  elsewhere = "failed on another process (see its log)"
  for name in ("write_fresh", "write_old"):
    assert errors[0][name].endswith(f"writing shards {elsewhere}")
    assert errors[1][name].startswith("StorageError: ") and errors[1][name].endswith(
      ": writing shards: injected write failure on process 1. Nothing was committed; the "
      "checkpoint there before, if any, is intact."
    )
  assert errors[0]["plan_old"].endswith(f"checking the tree {elsewhere}")
  assert errors[1]["plan_old"].startswith("UnsupportedLeafError: cannot save these leaves")
  assert errors[0]["locked"].startswith("ConcurrentWriteError: ")
  assert errors[1]["locked"].endswith("process 0 could not start the save (see its log)")
  assert json.loads(lock.read_text()) == holder
  lock.unlink()
  with pytest.raises(ucp_jax.CheckpointNotFoundError):
    ucp_jax.open(tmp_path / "fresh")
  ckpt = ucp_jax.open(tmp_path / "old")
  assert ckpt.step == worker.OLD_STEP
  restored = ucp_jax.restore(tmp_path / "old", {"w": np.zeros(5), "step": 0})
  np.testing.assert_array_equal(restored["w"], old["w"])
  assert restored["step"] == worker.OLD_STEP
  assert not (tmp_path / "locked").exists()
  assert ucp_jax.open(tmp_path / "again").step == worker.STEP
  assert _leftovers(tmp_path) == []
