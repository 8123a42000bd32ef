"""save_async: the write overlaps training, saves the state of the call, and fails loudly.

The multi-process test runs this file as a script, one JAX process each (see `_worker`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax.store import _multihost
from ucp_jax.tree import _save

_WRITE = _save.Writer._write_entries


_RELEASES: list[threading.Event] = []


@pytest.fixture(autouse=True)
def _no_save_left_running():
  yield
  for release in _RELEASES:  # a failed test must not leave a write held
    release.set()
  _RELEASES.clear()
  with contextlib.suppress(Exception):
    ucp_jax.wait_until_finished()


def _hold_writes(monkeypatch, *, fail: Exception | None = None, calls: int = 1):
  """Makes the next `calls` writes wait for `release` (then fail with `fail`, if given)."""
  started, release = threading.Event(), threading.Event()
  _RELEASES.append(release)
  count = iter(range(calls))

  def held(self, entries, max_host_bytes):
    if next(count, None) is not None:
      started.set()
      assert release.wait(30), "the test never released the write"
      if fail is not None:
        raise fail
    _WRITE(self, entries, max_host_bytes)

  monkeypatch.setattr(_save.Writer, "_write_entries", held)
  return started, release


def _state(devices) -> dict:
  mesh = jax.make_mesh((8,), ("d",), devices=devices)
  rows = NamedSharding(mesh, P("d"))
  return {
    "params": {"w": jax.device_put(jnp.arange(64.0).reshape(16, 4), rows)},
    "opt": {"mu": jax.device_put(jnp.ones((8, 3), jnp.bfloat16), NamedSharding(mesh, P()))},
    "host": np.arange(5, dtype=np.int32),
    "step": 3,
  }


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _assert_tree_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)


def test_write_overlaps_a_training_step_and_saves_the_state_of_the_call(
  tmp_path, devices, monkeypatch
):
  state = _state(devices)
  before = _host(_state(devices))  # (np.asarray would pin a replicated array's buffer)
  started, release = _hold_writes(monkeypatch)

  handle = ucp_jax.save_async(tmp_path / "ckpt", state, step=3)
  assert started.wait(10)  # the background write is under way

  @jax.jit
  def train_step(arrays):
    return jax.tree.map(lambda a: (a * 2 + jnp.sum(a)).astype(a.dtype), arrays)

  arrays = {"params": state["params"], "opt": state["opt"]}
  new = jax.jit(train_step, donate_argnums=0)(arrays)
  jax.block_until_ready(new)
  state["host"][:] = -1  # the caller's numpy leaf changes too
  # The step ran to completion while the save was still in flight. On CPU the save holds
  # views of the device buffers (nothing was copied before save_async returned), so XLA
  # does not reuse the buffers the step was asked to donate: it writes to fresh memory.
  assert not handle.done()
  np.testing.assert_array_equal(
    np.asarray(new["params"]["w"]), 2 * before["params"]["w"] + before["params"]["w"].sum()
  )

  release.set()
  assert handle.result() == str(tmp_path / "ckpt")
  assert handle.done()
  _assert_tree_equal(ucp_jax.restore(tmp_path / "ckpt"), before)
  assert ucp_jax.open(tmp_path / "ckpt").step == 3


def test_restore_onto_another_mesh_after_save_async(tmp_path, devices):
  state = _state(devices)
  ucp_jax.save_async(tmp_path / "ckpt", state).result()
  mesh = jax.make_mesh((2, 4), ("a", "b"), devices=devices)
  target = {
    "params": {"w": NamedSharding(mesh, P("b", "a"))},
    "opt": {"mu": NamedSharding(mesh, P("a"))},
    "host": np.zeros(5, np.int32),
    "step": 0,
  }
  restored = ucp_jax.restore(tmp_path / "ckpt", target)
  assert restored["params"]["w"].sharding == target["params"]["w"]
  _assert_tree_equal(_host(restored), _host(state))


@pytest.mark.parametrize("next_call", ["save", "save_async", "wait_until_finished"])
def test_failed_save_async_raises_on_the_next_call_and_keeps_the_old_checkpoint(
  tmp_path, devices, monkeypatch, next_call
):
  path = tmp_path / "ckpt"
  old = {"w": np.arange(4.0), "step": 1}
  ucp_jax.save(path, old, step=1)
  _, release = _hold_writes(monkeypatch, fail=OSError("injected: disk full"))
  release.set()
  handle = ucp_jax.save_async(path, _state(devices), step=2, overwrite=True)
  handle._finished.wait(10)  # finished, and nobody has seen the error yet

  other = tmp_path / "other"
  calls = {
    "save": lambda: ucp_jax.save(other, {"x": 1}),
    "save_async": lambda: ucp_jax.save_async(other, {"x": 1}),
    "wait_until_finished": ucp_jax.wait_until_finished,
  }
  with pytest.raises(OSError, match="injected: disk full") as caught:
    calls[next_call]()
  if sys.version_info >= (3, 11):
    assert caught.value.__notes__ == [
      f"raised by the background write of save_async({str(path)!r})"
    ]
  assert not other.exists()  # the failed save is reported; the new one did not start
  ckpt = ucp_jax.open(path)
  assert ckpt.step == 1
  _assert_tree_equal(ucp_jax.restore(path), old)
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging directory, no lock

  calls[next_call]()  # reported once: the next call goes ahead
  ucp_jax.wait_until_finished()


def test_result_raises_the_error_and_then_it_is_not_raised_again(tmp_path, monkeypatch):
  _, release = _hold_writes(monkeypatch, fail=ValueError("injected"))
  release.set()
  handle = ucp_jax.save_async(tmp_path / "ckpt", {"x": np.ones(3)})
  for _ in range(2):
    with pytest.raises(ValueError, match="injected"):
      handle.result()
  ucp_jax.wait_until_finished()  # the caller has seen it already
  with pytest.raises(ucp_jax.CheckpointNotFoundError):
    ucp_jax.open(tmp_path / "ckpt")


def test_result_times_out_while_the_write_is_held(tmp_path, monkeypatch):
  _, release = _hold_writes(monkeypatch)
  handle = ucp_jax.save_async(tmp_path / "ckpt", {"x": np.ones(3)})
  with pytest.raises(TimeoutError, match=r"still running after 0\.01 s"):
    handle.result(timeout=0.01)
  release.set()
  assert handle.result() == str(tmp_path / "ckpt")


@pytest.mark.parametrize("second", ["save", "save_async"])
def test_a_second_save_waits_for_the_first(tmp_path, monkeypatch, second):
  started, release = _hold_writes(monkeypatch, calls=1)
  first = ucp_jax.save_async(tmp_path / "first", {"x": np.ones(3)})
  assert started.wait(10)
  save = getattr(ucp_jax, second)
  thread = threading.Thread(target=save, args=(tmp_path / "second", {"y": np.zeros(2)}))
  thread.start()
  thread.join(0.2)
  # Held back by the first save (the second's own write would not wait for `release`).
  assert thread.is_alive() and not first.done()
  assert not (tmp_path / "second").exists()
  release.set()
  thread.join(10)
  ucp_jax.wait_until_finished()
  assert first.done()
  assert ucp_jax.open(tmp_path / "first").keys() == ["x"]
  assert ucp_jax.open(tmp_path / "second").keys() == ["y"]


def test_bad_tree_raises_at_the_call(tmp_path):
  with pytest.raises(ucp_jax.UnsupportedLeafError, match=r"x: builtins\.str"):
    ucp_jax.save_async(tmp_path / "ckpt", {"x": "text"})
  ucp_jax.wait_until_finished()  # nothing was started
  assert not (tmp_path / "ckpt").exists()


# Multi-process: 2 processes x 4 CPU devices over gloo; the background writes agree
# through the coordination service while the main threads run cross-process steps.


def test_multiprocess_save_async_overlaps_cross_process_steps(tmp_path, devices):
  from test_multiprocess import _env, _free_port

  port = _free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, __file__, str(i), str(port), str(tmp_path)],
      env=_env(4),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outputs = []
  for proc in procs:
    try:
      outputs.append(proc.communicate(timeout=120)[0])
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      pytest.fail("a worker hung", pytrace=False)
  if any(p.returncode for p in procs):
    pytest.fail("\n".join(f"--- process {i}\n{o}" for i, o in enumerate(outputs)), pytrace=False)
  results = [json.loads((tmp_path / f"result-{i}.json").read_text()) for i in range(2)]
  assert [r["done_after_steps"] for r in results] == [False, False]
  assert results[0]["error"] == (
    f"UcpError: {tmp_path / 'ckpt'}: writing shards failed on another process (see its log)"
  )
  assert results[1]["error"] == (
    f"StorageError: {tmp_path / 'ckpt'}: writing shards: injected on process 1. Nothing was "
    "committed; the checkpoint there before, if any, is intact."
  )
  mesh = jax.make_mesh((2, 4), ("a", "b"), devices=devices)
  restored = ucp_jax.restore(tmp_path / "ckpt", {"w": NamedSharding(mesh, P("b", "a"))})
  np.testing.assert_array_equal(np.asarray(restored["w"]), _worker_initial())
  assert ucp_jax.open(tmp_path / "ckpt").step == 1  # the failed save left it as it was
  assert ucp_jax.open(tmp_path / "sync").step == 2
  assert ucp_jax.open(tmp_path / "orbax" / "5" / "default").step == 5
  assert sorted(os.listdir(tmp_path / "orbax")) == ["5"]
  names = ["ckpt", "orbax", "result-0.json", "result-1.json", "sync"]
  assert sorted(os.listdir(tmp_path)) == names


def _worker_initial() -> np.ndarray:
  return np.arange(32 * 6, dtype=np.float32).reshape(32, 6)


def _worker(process_id: int, port: int, workdir: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id, initialization_timeout=60)
  mesh = jax.make_mesh((8,), ("d",))
  value = _worker_initial()
  sharding = NamedSharding(mesh, P("d"))
  w = jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
  ckpt = os.path.join(workdir, "ckpt")

  release = threading.Event()
  failing = threading.Event()

  def held(self, entries, max_host_bytes):
    assert release.wait(60)
    if failing.is_set() and jax.process_index() == 1:
      raise OSError("injected on process 1")
    _WRITE(self, entries, max_host_bytes)

  _save.Writer._write_entries = held

  def no_collectives(*args):
    raise AssertionError("a save ran device collectives")

  # Saves agree through the coordination service, never through device collectives.
  _multihost.all_ok = _multihost.broadcast_from_primary = no_collectives
  step = jax.jit(lambda w: w - 0.01 * jnp.mean(w), donate_argnums=0)  # a cross-process all-reduce

  handle = ucp_jax.save_async(ckpt, {"w": w}, step=1)
  for _ in range(3):
    w = step(w)
  jax.block_until_ready(w)
  done_after_steps = handle.done()
  release.set()
  handle.result()

  ucp_jax.save(os.path.join(workdir, "sync"), {"w": w}, step=2)  # a synchronous save in between
  failing.set()
  w = step(w)
  ucp_jax.save_async(ckpt, {"w": w}, step=3, overwrite=True)  # fails on process 1 only
  try:
    ucp_jax.wait_until_finished()
    error = None
  except Exception as e:
    error = f"{type(e).__name__}: {e}"
  failing.clear()

  # Orbax's CheckpointManager: our writes run in its background thread, after its barriers.
  import orbax.checkpoint as ocp

  from ucp_jax.orbax import UcpSave

  options = ocp.CheckpointManagerOptions(max_to_keep=1)
  with ocp.CheckpointManager(os.path.join(workdir, "orbax"), options=options) as manager:
    for i in (4, 5):
      manager.save(i, args=UcpSave({"w": w}, step=i))
      w = step(w)
    manager.wait_until_finished()
  result = {"done_after_steps": done_after_steps, "error": error}
  with open(os.path.join(workdir, f"result-{process_id}.json"), "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


def test_failed_async_save_at_exit_is_reported(tmp_path):
  import subprocess
  import sys
  import textwrap

  script = textwrap.dedent(
    f"""
    import numpy as np, ucp_jax
    from ucp_jax.store import _writer
    def boom(self, entries, budget):
      raise OSError("disk full")
    _writer.Writer._write_entries = boom
    ucp_jax.save_async({str(tmp_path / "c")!r}, {{"w": np.ones(3)}})
    """
  )
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert "failed and nobody waited for it" in proc.stderr and "disk full" in proc.stderr
  assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_shards_copied_through_pinned_host_memory_save_the_state_of_the_call(
  tmp_path, devices, monkeypatch, asynchronous
):
  # GPUs copy shards to pinned host memory (as Orbax does); CPU devices have that memory kind
  # too, so the same path runs here when the platform is let in.
  from ucp_jax.store import _writer

  monkeypatch.setattr(_writer, "PINNED_PLATFORMS", ("cpu",))
  copies = []
  start = _writer.start_host_copy
  monkeypatch.setattr(_writer, "start_host_copy", lambda d: copies.append(start(d)) or copies[-1])
  state = _state(devices)
  before = _host(_state(devices))
  if asynchronous:
    handle = ucp_jax.save_async(tmp_path / "ckpt", state)
    arrays = {"params": state["params"], "opt": state["opt"]}
    step = jax.jit(lambda a: jax.tree.map(lambda x: x * 3, a), donate_argnums=0)
    jax.block_until_ready(step(arrays))  # the state's buffers are donated and overwritten
    handle.result()
  else:
    ucp_jax.save(tmp_path / "ckpt", state, bundle_bytes=None)
  assert copies and all(isinstance(c, _writer.PinnedCopy) for c in copies)
  assert {c.array.sharding.memory_kind for c in copies} == {"pinned_host"}
  _assert_tree_equal(ucp_jax.restore(tmp_path / "ckpt"), before)
  assert not ucp_jax.open(tmp_path / "ckpt").verify()
