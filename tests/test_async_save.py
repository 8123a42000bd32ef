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
from ucp_jax.base import _multihost
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


class _Watched(threading.Condition):
  """`_pending`'s condition, counting the threads that wait on it (so a test knows, without
  sleeping, that they are held back)."""

  def __init__(self):
    super().__init__()
    self.waiting = 0
    self._count = threading.Condition()

  def wait(self, timeout=None):
    with self._count:
      self.waiting += 1
      self._count.notify_all()
    try:
      return super().wait(timeout)
    finally:
      with self._count:
        self.waiting -= 1

  def until_waiting(self, n: int) -> None:
    with self._count:
      assert self._count.wait_for(lambda: self.waiting >= n, timeout=60), self.waiting


@pytest.fixture
def watched(monkeypatch):
  from ucp_jax.tree import _pending

  condition = _Watched()
  monkeypatch.setattr(_pending, "_changed", condition)
  return condition


@pytest.fixture
def thread_errors(monkeypatch):
  """Exceptions that escape a thread (none may)."""
  escaped = []
  monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
  return escaped


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
def test_a_second_save_waits_for_the_first(tmp_path, monkeypatch, watched, second):
  started, release = _hold_writes(monkeypatch, calls=1)
  first = ucp_jax.save_async(tmp_path / "first", {"x": np.ones(3)})
  assert started.wait(10)
  save = getattr(ucp_jax, second)
  thread = threading.Thread(target=save, args=(tmp_path / "second", {"y": np.zeros(2)}))
  thread.start()
  watched.until_waiting(1)  # held back by the first save (its own write would not wait)
  assert thread.is_alive() and not first.done()
  assert not (tmp_path / "second").exists()
  release.set()
  thread.join(10)
  ucp_jax.wait_until_finished()
  assert first.done()
  assert ucp_jax.open(tmp_path / "first").keys() == ["x"]
  assert ucp_jax.open(tmp_path / "second").keys() == ["y"]


def _threads(targets) -> list[threading.Thread]:
  threads = [threading.Thread(target=t) for t in targets]
  for t in threads:
    t.start()
  return threads


def _join(threads) -> None:
  for t in threads:
    t.join(60)
    assert not t.is_alive(), "a thread hung"


def test_save_async_from_several_threads_keeps_one_in_flight(
  tmp_path, monkeypatch, watched, thread_errors
):
  release, lock = threading.Event(), threading.Lock()
  _RELEASES.append(release)
  running, peak, started = [0], [0], threading.Semaphore(0)

  def held(self, entries, max_host_bytes):
    with lock:
      running[0] += 1
      peak[0] = max(peak[0], running[0])
    started.release()
    try:
      assert release.wait(60)
      _WRITE(self, entries, max_host_bytes)
    finally:
      with lock:
        running[0] -= 1

  monkeypatch.setattr(_save.Writer, "_write_entries", held)
  handles = {}

  def save(i):
    handles[i] = ucp_jax.save_async(tmp_path / f"c{i}", {"x": np.full(3, i)}, step=i)

  threads = _threads([lambda i=i: save(i) for i in range(4)])
  assert started.acquire(timeout=60)  # one write is under way ...
  watched.until_waiting(3)  # ... and the three other calls wait for it
  assert peak[0] == 1 and len(handles) == 1
  assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == []  # nothing started
  release.set()
  _join(threads)
  ucp_jax.wait_until_finished()
  assert peak[0] == 1 and sorted(handles) == [0, 1, 2, 3]
  for i, handle in handles.items():
    assert handle.result() == str(tmp_path / f"c{i}")
    assert ucp_jax.open(tmp_path / f"c{i}").step == i
  assert sorted(os.listdir(tmp_path)) == [f"c{i}" for i in range(4)] and not thread_errors


@pytest.mark.parametrize("waiters", ["wait_until_finished", "save", "save_async", "mixed"])
def test_a_background_error_reaches_exactly_one_caller_of_any_thread(
  tmp_path, monkeypatch, watched, thread_errors, waiters
):
  started, release = _hold_writes(monkeypatch, fail=RuntimeError("injected"))
  failing = ucp_jax.save_async(tmp_path / "failing", {"x": np.ones(3)})
  assert started.wait(60)
  calls = {
    "wait_until_finished": ucp_jax.wait_until_finished,
    "save": lambda i: ucp_jax.save(tmp_path / f"s{i}", {"x": np.full(2, i)}),
    "save_async": lambda i: ucp_jax.save_async(tmp_path / f"s{i}", {"x": np.full(2, i)}),
  }
  kinds = list(calls)[:3] * 2 if waiters == "mixed" else [waiters] * 4
  outcomes = {}

  def call(i, kind):
    try:
      calls[kind]() if kind == "wait_until_finished" else calls[kind](i)
      outcomes[i] = None
    except BaseException as e:  # counted below
      outcomes[i] = e

  threads = _threads([lambda i=i, k=k: call(i, k) for i, k in enumerate(kinds)])
  watched.until_waiting(len(kinds))  # every caller is held back by the failing save
  release.set()
  _join(threads)
  ucp_jax.wait_until_finished()  # the error was raised already, and the others' saves done
  raised = [e for e in outcomes.values() if e is not None]
  assert len(outcomes) == len(kinds) and len(raised) == 1, outcomes
  assert isinstance(raised[0], RuntimeError) and str(raised[0]) == "injected"
  with pytest.raises(RuntimeError, match="injected"):  # its handle still tells it too
    failing.result()
  ucp_jax.wait_until_finished()  # and nobody else hears of it again
  for i, kind in enumerate(kinds):
    if kind != "wait_until_finished" and outcomes[i] is None:  # each save that was not
      assert ucp_jax.open(tmp_path / f"s{i}").keys() == ["x"]  # turned away was written
  assert not (tmp_path / "failing").exists() and not thread_errors


def test_every_background_error_is_raised_once_under_concurrent_saves(
  tmp_path, monkeypatch, thread_errors
):
  """Threads save in a loop, some saves failing: each failure of a save that started is
  raised exactly once, to whichever thread calls next, and nothing escapes."""

  def write(self, entries, max_host_bytes):
    if "fail" in str(self.target):
      raise RuntimeError(f"injected {self.target}")
    _WRITE(self, entries, max_host_bytes)

  monkeypatch.setattr(_save.Writer, "_write_entries", write)
  started, raised, lock = [], [], threading.Lock()

  def loop(t):
    for j in range(6):
      name = f"t{t}-{j}" + ("-fail" if (t + j) % 3 == 0 else "")
      try:
        ucp_jax.save_async(tmp_path / name, {"x": np.full(2, j)})
      except RuntimeError as e:
        with lock:
          raised.append(str(e))
        continue
      with lock:
        started.append(name)

  _join(_threads([lambda t=t: loop(t) for t in range(4)]))
  try:
    ucp_jax.wait_until_finished()
  except RuntimeError as e:
    raised.append(str(e))
  failed = sorted(f"injected {tmp_path / n}" for n in started if n.endswith("-fail"))
  assert sorted(raised) == failed  # each once, none lost
  for name in started:
    assert (tmp_path / name).exists() != name.endswith("-fail")
  assert not thread_errors


def test_bad_tree_raises_at_the_call(tmp_path):
  with pytest.raises(ucp_jax.UnsupportedLeafError, match=r"x: builtins\.str"):
    ucp_jax.save_async(tmp_path / "ckpt", {"x": "text"})
  ucp_jax.wait_until_finished()  # nothing was started
  assert not (tmp_path / "ckpt").exists()


# Multi-process: 2 processes x 4 CPU devices over gloo; the background writes agree
# through the coordination service while the main threads run cross-process steps.


def test_multiprocess_save_async_overlaps_cross_process_steps(tmp_path, devices):
  from multiprocess_run import env, free_port

  port = free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, __file__, str(i), str(port), str(tmp_path)],
      env=env(4),
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
  from ucp_jax.tree import _device_arrays as _shards

  monkeypatch.setattr(_shards, "PINNED_PLATFORMS", ("cpu",))
  copies = []
  start = _shards.start_host_copy
  monkeypatch.setattr(_shards, "start_host_copy", lambda d: copies.append(start(d)) or copies[-1])
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
  assert copies and all(isinstance(c, _shards.PinnedCopy) for c in copies)
  assert {c.array.sharding.memory_kind for c in copies} == {"pinned_host"}
  _assert_tree_equal(ucp_jax.restore(tmp_path / "ckpt"), before)
  assert not ucp_jax.open(tmp_path / "ckpt").verify()
