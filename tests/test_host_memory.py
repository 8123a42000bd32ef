"""The host buffer pool: restored and resharded arrays reuse warm memory, and never share it."""

import errno
import gc
import mmap
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax.store import _hostmem

MiB = 1 << 20


class _Clock:
  """A clock the test moves, and the trims the pool asked for, run only when the test says:
  the pool's idle release never races an assertion."""

  def __init__(self):
    self.now = 1000.0
    self.timers: list = []

  def __call__(self) -> float:
    return self.now

  def start_timer(self, seconds, fn):
    self.timers.append((self.now + seconds, fn))
    return self.timers[-1]

  def advance(self, seconds: float) -> None:
    """Moves the clock on and runs the trims that are due by then (and those they ask for)."""
    self.now += seconds
    while any(when <= self.now for when, _ in self.timers):
      due = [t for t in self.timers if t[0] <= self.now]
      self.timers = [t for t in self.timers if t[0] > self.now]
      for _, fn in due:
        fn()


@pytest.fixture
def clock():
  return _Clock()


@pytest.fixture
def pool(monkeypatch, clock):
  fresh = _hostmem._Pool(clock=clock, start_timer=clock.start_timer)
  monkeypatch.setattr(_hostmem, "POOL", fresh)
  yield fresh
  fresh.clear()


def _address(a: np.ndarray) -> int:
  return a.__array_interface__["data"][0]


def test_a_buffer_returns_when_its_last_view_goes_and_is_lent_again(pool):
  a = _hostmem.aligned_empty((MiB,), np.float32)
  view = a[10:20]
  where = _address(a)
  assert where % 64 == 0 and a.flags.c_contiguous and a.flags.writeable
  del a
  gc.collect()
  assert pool.free_bytes() == 0  # `view` still holds it
  b = _hostmem.aligned_empty((MiB,), np.float32)
  assert _address(b) != where  # never lent twice while alive
  del view
  gc.collect()
  assert pool.free_bytes() == 4 * MiB
  c = _hostmem.aligned_empty((1024, 1024), np.float32)
  assert _address(c) == where and pool.free_bytes() == 0
  assert _address(b) != where


def test_a_buffer_that_goes_while_the_pool_is_locked_comes_back_later(pool):
  """As when an allocation under the pool's lock sets off a garbage collection that frees
  an array: its buffer must not wait for the lock (a deadlock), nor be lost, nor wait for
  the pool's next use: the lock's holder files it on leaving."""
  a = _hostmem.aligned_empty((MiB,), np.uint8)
  with pool._held():
    del a
    assert pool._free_bytes == 0 and len(pool._returned) == 1
  assert not pool._returned and pool._free_bytes == MiB and pool._timer is not None
  assert _hostmem.aligned_empty((MiB,), np.uint8).size == MiB and pool.free_bytes() == 0


def test_buffers_of_arrays_alive_at_exit_are_not_lent_again(tmp_path):
  """At exit, a handler registered before the first pooled buffer runs after weakref's own
  exit hook: buffers of arrays still alive must not be in the pool for it to lend."""
  script = tmp_path / "exit.py"
  script.write_text(
    textwrap.dedent(
      """
      import atexit
      import numpy as np
      from ucp_jax.store import _hostmem

      @atexit.register
      def last_step():
        again = [_hostmem.aligned_empty((MiB,), np.uint8) for _ in range(2)]
        lent = {b.ctypes.data for b in again} & {kept.ctypes.data}
        for b in again:
          b[...] = 0
        print("free", _hostmem.POOL.free_bytes(), "lent", bool(lent), "intact", bool(kept.all()))

      MiB = 1 << 20
      kept = _hostmem.aligned_empty((MiB,), np.uint8)
      kept[...] = 1
      """
    )
  )
  out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["free", "0", "lent", "False", "intact", "True"], out
  assert "Traceback" not in out.stderr, out.stderr


def test_a_kernel_without_huge_pages_still_lends_buffers(pool, monkeypatch):
  class NoHugePages(mmap.mmap):
    def madvise(self, *args):
      raise OSError(errno.EINVAL, "Invalid argument")  # a kernel without THP

  monkeypatch.setattr(mmap, "mmap", NoHugePages)
  a = _hostmem.aligned_empty((8 * MiB,), np.uint8)
  a[...] = 7
  assert a.sum() == 7 * 8 * MiB


def test_a_forked_child_gets_a_working_pool(pool):
  """fork copies a lock that another thread may hold, and no timer thread: the child resets."""
  pool._lock.acquire()
  pool._timer = object()  # the parent's timer thread, absent in the child
  pool._after_fork()
  a = _hostmem.aligned_empty((MiB,), np.uint8)
  del a
  gc.collect()
  assert pool.free_bytes() == MiB and pool._timer is not None


def test_small_buffers_are_not_pooled(pool):
  a = _hostmem.aligned_empty((1000,), np.float64)
  assert _address(a) % 64 == 0
  del a
  gc.collect()
  assert pool.free_bytes() == 0


def test_the_pool_keeps_no_more_than_its_limit(pool, monkeypatch):
  monkeypatch.setattr(_hostmem, "pool_limit", lambda: 3 * MiB)
  held = [_hostmem.aligned_empty((MiB,), np.uint8) for _ in range(5)]
  del held
  gc.collect()
  assert pool.free_bytes() == 3 * MiB


def test_a_request_of_another_size_releases_the_unused_buffers(pool):
  held = [_hostmem.aligned_empty((MiB,), np.uint8), _hostmem.aligned_empty((2 * MiB,), np.uint8)]
  del held
  gc.collect()
  assert pool.free_bytes() == 3 * MiB
  kept = _hostmem.aligned_empty((2 * MiB,), np.uint8)  # a hit leaves the others
  assert pool.free_bytes() == MiB
  other = _hostmem.aligned_empty((3 * MiB,), np.uint8)  # a miss releases them
  assert pool.free_bytes() == 0
  del kept, other


def test_the_limit_follows_a_cgroup_below_physical_memory(monkeypatch, tmp_path):
  _hostmem._memory_bytes.cache_clear()
  limit = tmp_path / "memory.max"
  limit.write_text("1073741824\n")
  real_open = open
  monkeypatch.setattr(
    "builtins.open",
    lambda path, *a, **k: real_open(
      limit if path == "/sys/fs/cgroup/memory.max" else path, *a, **k
    ),
  )
  try:
    assert _hostmem.pool_limit() == 256 * MiB
  finally:
    monkeypatch.undo()
    _hostmem._memory_bytes.cache_clear()


def test_unused_buffers_go_back_to_the_system(pool, clock):
  a = _hostmem.aligned_empty((2 * MiB,), np.uint8)
  del a
  gc.collect()
  assert pool.free_bytes() == 2 * MiB and len(clock.timers) == 1  # a trim is due
  clock.advance(_hostmem.IDLE_SECONDS / 2)
  b = _hostmem.aligned_empty((MiB,), np.uint8)  # another size: the 2 MiB go at once
  assert pool.free_bytes() == 0
  del b
  gc.collect()
  assert pool.free_bytes() == MiB
  clock.advance(_hostmem.IDLE_SECONDS / 2)  # the first trim: b's buffer is not idle long enough
  assert pool.free_bytes() == MiB and len(clock.timers) == 1  # the next trim is due
  clock.advance(_hostmem.IDLE_SECONDS / 2)  # idle long enough now; gone at the next trim
  assert pool.free_bytes() == MiB
  clock.advance(_hostmem.IDLE_SECONDS / 2)
  assert pool.free_bytes() == 0 and not clock.timers  # nothing left: no trim is due


def test_the_pool_trims_itself_on_the_real_clock():
  """The default pool runs its trims in a daemon timer thread on the monotonic clock."""
  fresh = _hostmem._Pool()
  assert fresh._clock is time.monotonic
  timer = fresh._start_timer(3600, lambda: None)
  try:
    assert isinstance(timer, threading.Timer) and timer.daemon and timer.is_alive()
  finally:
    timer.cancel()


def _state(seed: int, sharding) -> dict:
  rng = np.random.default_rng(seed)
  return {
    f"w{i}": jax.device_put(rng.standard_normal((512, 1024), np.float32), sharding)
    for i in range(3)
  }


def test_restores_reuse_freed_buffers_and_never_touch_live_results(pool, tmp_path):
  devices = np.array(jax.devices())
  fsdp = NamedSharding(Mesh(devices, ("x",)), P("x", None))
  tp = NamedSharding(Mesh(devices.reshape(2, 4), ("data", "model")), P("data", "model"))
  one, two = _state(1, fsdp), _state(2, fsdp)
  ucp_jax.save(tmp_path / "one", one)
  ucp_jax.save(tmp_path / "two", two)
  expected_one = {k: np.asarray(v) for k, v in one.items()}
  expected_two = {k: np.asarray(v) for k, v in two.items()}
  target = {k: tp for k in one}  # 128x256 float32 slices: 128 KiB, under the pooled size
  big = {k: NamedSharding(Mesh(devices[:2], ("x",)), P("x", None)) for k in one}  # 1 MiB

  kept = ucp_jax.restore(tmp_path / "one", big)
  gc.collect()
  assert pool.free_bytes() == 0
  dropped = ucp_jax.restore(tmp_path / "two", big)
  del dropped
  gc.collect()
  assert pool.free_bytes() == 6 * MiB  # 3 arrays x 2 slices of 1 MiB, back once dropped

  @jax.jit
  def step(x):
    return jax.tree.map(lambda a: a * 2 + 1, x)

  stepped = jax.jit(step.__wrapped__, donate_argnums=0)(ucp_jax.restore(tmp_path / "one", big))
  again = ucp_jax.restore(tmp_path / "two", big)
  resharded = ucp_jax.reshard(again, {k: fsdp for k in one})
  del again
  gc.collect()
  small = ucp_jax.restore(tmp_path / "two", target)
  for _ in range(2):  # every reuse of the freed buffers leaves live results as they were
    later = ucp_jax.restore(tmp_path / "one", big)
    for k in one:  # `+ 0` reads the device buffers (np.asarray caches a host copy)
      np.testing.assert_array_equal(np.asarray(kept[k] + 0), expected_one[k])
      np.testing.assert_array_equal(np.asarray(stepped[k] + 0), expected_one[k] * 2 + 1)
      np.testing.assert_array_equal(np.asarray(resharded[k] + 0), expected_two[k])
      np.testing.assert_array_equal(np.asarray(small[k] + 0), expected_two[k])
      np.testing.assert_array_equal(np.asarray(later[k] + 0), expected_one[k])
    del later
    gc.collect()


def test_reshards_reuse_freed_buffers(pool):
  devices = np.array(jax.devices())
  fsdp = NamedSharding(Mesh(devices, ("x",)), P("x", None))
  tp = NamedSharding(Mesh(devices.reshape(2, 4), ("data", "model")), P("data", "model"))
  state = {
    "w": jax.device_put(jnp.arange(2048 * 1024, dtype=jnp.float32).reshape(2048, 1024), fsdp)
  }
  first = ucp_jax.reshard(state, {"w": tp}, method="host")
  addresses = {s.data.unsafe_buffer_pointer() for s in first["w"].addressable_shards}
  del first
  gc.collect()
  assert pool.free_bytes() == 8 * MiB
  second = ucp_jax.reshard(state, {"w": tp}, method="host")
  assert {s.data.unsafe_buffer_pointer() for s in second["w"].addressable_shards} == addresses
  np.testing.assert_array_equal(np.asarray(second["w"]), np.asarray(state["w"]))


@pytest.mark.parametrize("threshold, path", [(0, "host"), (1 << 30, "device_put")])
def test_reshard_auto_from_several_threads_at_once(monkeypatch, threshold, path):
  """Threads that make the same layout change at once all take the one path the rule gives."""
  from ucp_jax.tree import _reshard

  monkeypatch.setattr(_reshard, "HOST_COPY_MIN_BYTES", threshold)
  devices = np.array(jax.devices())
  fsdp = NamedSharding(Mesh(devices, ("x",)), P("x", None))
  tp = NamedSharding(Mesh(devices.reshape(2, 4), ("a", "b")), P("b", "a"))
  x = {"w": jax.device_put(jnp.arange(512 * 768, dtype=jnp.float32).reshape(512, 768), fsdp)}
  barrier, errors = threading.Barrier(6), []

  def run():
    barrier.wait()
    try:
      for _ in range(3):
        np.testing.assert_array_equal(np.asarray(ucp_jax.reshard(x, {"w": tp})["w"] + 0), x["w"])
    except Exception as e:
      errors.append(repr(e))

  threads = [threading.Thread(target=run) for _ in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  assert _reshard.reshard_method(x, {"w": tp})[0] == path


def test_reshard_of_replicated_keys():
  devices = np.array(jax.devices())
  replicated = NamedSharding(Mesh(devices, ("x",)), P())
  keys = jax.device_put(jax.random.split(jax.random.key(1), 16), replicated)
  for method in ("host", "auto"):
    out = ucp_jax.reshard({"k": keys}, {"k": replicated}, method=method)["k"]
    np.testing.assert_array_equal(jax.random.key_data(out), jax.random.key_data(keys))


def test_plans_are_cached_for_hashable_arguments_and_computed_for_others():
  from ucp_jax.store import _caches

  calls = []

  @_caches.cached_when_hashable(maxsize=4)
  def plan(sharding, shape):
    calls.append(shape)
    return len(sharding)

  assert plan((1, 2), (3,)) == plan((1, 2), (3,)) == 2 and len(calls) == 1
  assert plan([1, 2, 3], (3,)) == plan([1, 2, 3], (3,)) == 3 and len(calls) == 3  # unhashable
