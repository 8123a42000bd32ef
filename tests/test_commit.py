"""Commits lose nothing: a save killed at any step leaves the last checkpoint or the new one,
whole; locks left by dead writers never block; readers never mix two saves; data is synced.
"""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ucp_jax
from ucp_jax.store import _commit, _direct, _location, _swap

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "support", "commit_fault_worker.py")


def _run_worker(path, value, stage, direct=True):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "UCP_DIRECT": "1" if direct else "0"}
  arg = json.dumps(path) if isinstance(path, dict) else str(path)
  proc = subprocess.run(
    [sys.executable, WORKER, arg, str(value), stage],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  return proc


def _value_of(path) -> float:
  """The one value every array of the checkpoint holds (it must be whole and uniform)."""
  ckpt = ucp_jax.open(path)
  assert ckpt.verify() == {}
  out = ucp_jax.restore(path)
  values = {float(v) for leaf in (out["a"], out["b"]["c"]) for v in np.unique(leaf)}
  assert len(values) == 1, values
  return values.pop()


LOCAL_STAGES = [
  ("writing", 1.0, True),
  ("writing", 1.0, False),  # through TensorStore
  ("before-commit", 1.0, True),
  ("before-swap", 1.0, True),
  ("after-exchange", 2.0, True),
  ("fallback-between-renames", 2.0, True),
  ("fallback-after-renames", 2.0, True),
  ("fallback-undo-cut", 2.0, True),  # the second rename failed, killed putting back the first
  ("fallback-abort-cut", 1.0, True),  # the undo failed too, killed removing the staging folder
]


@pytest.mark.parametrize(("stage", "expected", "direct"), LOCAL_STAGES)
def test_a_save_killed_at_any_step_leaves_one_whole_checkpoint(tmp_path, stage, expected, direct):
  path = tmp_path / "ckpt"
  assert _run_worker(path, 1, "none").returncode == 0
  proc = _run_worker(path, 2, stage, direct)
  assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
  assert _value_of(path) == expected  # readable before anyone cleans up
  assert _run_worker(path, 3, "none").returncode == 0  # the next save cleans up after it
  assert _value_of(path) == 3
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]


OBJECT_STORE_STAGES = [("writing", 1.0), ("before-commit", 1.0), ("after-manifest", 2.0)]


@pytest.mark.parametrize(("stage", "expected"), OBJECT_STORE_STAGES)
def test_object_store_commit_killed_at_any_step(tmp_path, stage, expected):
  # An object store without rename: a file kvstore spec keeps its data across processes.
  path = {"driver": "file", "path": str(tmp_path / "bucket" / "ckpt")}
  assert _run_worker(path, 1, "none").returncode == 0
  proc = _run_worker(path, 2, stage)
  assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
  assert _value_of(path) == expected
  assert _run_worker(path, 3, "none").returncode == 0
  assert _value_of(path) == 3
  generations = [n for n in os.listdir(tmp_path / "bucket" / "ckpt") if n.startswith("g")]
  live = ucp_jax.open(path).manifest.data.rstrip("/")
  assert [g for g in generations if os.listdir(tmp_path / "bucket" / "ckpt" / g)] == [live]


def test_a_failed_overwrite_on_an_object_store_keeps_the_old_checkpoint():
  url = "memory://ucp_test_failed_overwrite"
  ucp_jax.save(url, {"a": np.ones(4)})

  class Boom:  # not storable: the save fails after taking the lock, before any data
    pass

  with pytest.raises(ucp_jax.UnsupportedLeafError):
    ucp_jax.save(url, {"a": np.zeros(4), "b": Boom()}, overwrite=True)
  np.testing.assert_array_equal(ucp_jax.restore(url)["a"], np.ones(4))
  real = _location.KvStore.write

  def failing(self, key, value, **options):
    if key == "manifest.json" and value is not None:
      raise OSError("the bucket went away")
    return real(self, key, value, **options)

  try:
    _location.KvStore.write = failing
    with pytest.raises(ucp_jax.StorageError, match="the bucket went away"):
      ucp_jax.save(url, {"a": np.zeros(4)}, overwrite=True)
  finally:
    _location.KvStore.write = real
  np.testing.assert_array_equal(ucp_jax.restore(url)["a"], np.ones(4))
  assert ucp_jax.open(url).verify() == {}


# --- locks ---


def _lock_holder(tmp_path, script):
  return subprocess.Popen(
    [sys.executable, "-c", script],
    stdout=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )


_HOLD = """
import sys, time
from ucp_jax.store import _commit, _location
_commit.Lock(_location.resolve({path!r}), 1).acquire()
print("locked", flush=True)
{after}
"""


def test_a_lock_file_left_empty_does_not_block(tmp_path):
  (tmp_path / ".ckpt.ucp-lock").write_text("")  # killed between create and write, disk full
  ucp_jax.save(tmp_path / "ckpt", {"a": np.ones(2)})
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_live_lock_blocks_and_a_killed_holder_does_not(tmp_path):
  path = str(tmp_path / "ckpt")
  holder = _lock_holder(tmp_path, _HOLD.format(path=path, after="time.sleep(600)"))
  assert holder.stdout.readline().strip() == "locked"
  try:
    with pytest.raises(ucp_jax.ConcurrentWriteError, match=f'"pid": {holder.pid}'):
      ucp_jax.save(path, {"a": np.ones(2)})
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    holder.stdout.close()
  ucp_jax.save(path, {"a": np.ones(2)})
  np.testing.assert_array_equal(ucp_jax.restore(path)["a"], np.ones(2))


def test_a_dead_but_unreaped_holder_does_not_block(tmp_path):
  path = str(tmp_path / "ckpt")
  holder = _lock_holder(tmp_path, _HOLD.format(path=path, after="import os; os._exit(0)"))
  assert holder.stdout.readline().strip() == "locked"
  deadline = 1200  # a watchdog: 60 s for the holder to exit
  while deadline and _commit._proc_stat(holder.pid)[0:1] != ["Z"]:  # exited, not reaped
    threading.Event().wait(0.05)
    deadline -= 1
  assert _commit._proc_stat(holder.pid)[0:1] == ["Z"]
  ucp_jax.save(path, {"a": np.ones(2)})
  holder.wait()
  holder.stdout.close()


def test_a_lock_of_an_older_ucp_jax_blocks_while_its_holder_lives(tmp_path):
  lock = tmp_path / ".ckpt.ucp-lock"
  import socket

  lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": "x"}))
  with pytest.raises(ucp_jax.ConcurrentWriteError):
    ucp_jax.save(tmp_path / "ckpt", {"a": np.ones(2)})
  dead = subprocess.run(
    [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
  )
  pid = int(dead.stdout)
  lock.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "token": "x"}))
  ucp_jax.save(tmp_path / "ckpt", {"a": np.ones(2)})


def test_object_store_lock_of_a_dead_process_is_taken_over():
  import socket

  url = "memory://ucp_test_dead_lock"
  store = _location.kvstore(_location.resolve(url))
  dead = subprocess.run(
    [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
  )
  holder = {"host": socket.gethostname(), "pid": int(dead.stdout), "token": "x", "flock": True}
  store.write(".ucp-lock", json.dumps(holder).encode()).result()
  ucp_jax.save(url, {"a": np.ones(2)})
  with subprocess.Popen(["sleep", "60"]) as live:  # another process of this host, running
    alive = {**holder, "pid": live.pid, "start": _commit._start_time(live.pid)}
    store.write(".ucp-lock", json.dumps(alive).encode()).result()
    with pytest.raises(ucp_jax.ConcurrentWriteError, match="another save to this path"):
      ucp_jax.save(url, {"a": np.zeros(2)}, overwrite=True)
    live.kill()
  # this very process, under a token it does not hold: a lock whose release failed
  mine = {**holder, "pid": os.getpid(), "start": _commit._start_time(os.getpid())}
  store.write(".ucp-lock", json.dumps(mine).encode()).result()
  ucp_jax.save(url, {"a": np.full(2, 3.0)}, overwrite=True)
  assert ucp_jax.restore(url)["a"].tolist() == [3.0, 3.0]


# --- readers and writers at once ---


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_reader_never_mixes_two_saves(tmp_path, where):
  path = str(tmp_path / "ckpt") if where == "local" else "memory://ucp_test_isolation"
  state = lambda v: {"a": np.full((256, 64), v, np.float32), "b": np.full((512,), v)}  # noqa: E731
  ucp_jax.save(path, state(0), chunk_bytes=4096, overwrite=True)
  stop = threading.Event()
  errors, saves = [], [0]

  def overwrite():
    while not stop.is_set():
      try:
        ucp_jax.save(path, state(saves[0] + 1), chunk_bytes=4096, overwrite=True)
      except BaseException as e:  # reported below
        errors.append(e)
        return
      saves[0] += 1
      stop.wait(0.002 * (saves[0] % 5))  # some gaps, so that some reads land between saves

  writer = threading.Thread(target=overwrite)
  writer.start()
  whole, replaced = 0, 0
  try:
    watchdog = time.monotonic() + 300  # against a hang only: the loop ends on counts
    while (saves[0] < 8 or whole < 3) and not errors and time.monotonic() < watchdog:
      try:
        out = ucp_jax.restore(path)
      except ucp_jax.ConcurrentWriteError:
        replaced += 1
        continue
      values = set(np.unique(out["a"]).tolist()) | set(np.unique(out["b"]).tolist())
      assert len(values) == 1, f"a restore mixed saves {sorted(values)}"
      whole += 1
  finally:
    stop.set()
    writer.join()
  assert not errors, errors
  assert whole > 0 and saves[0] >= 8, (whole, replaced, saves)  # they did overlap


# --- durability ---


@pytest.mark.parametrize("durable", [True, False])
def test_a_durable_save_fsyncs_every_file_and_directory(tmp_path, monkeypatch, durable):
  synced = set()
  real = os.fsync

  def fsync(fd):
    staged = os.readlink(f"/proc/self/fd/{fd}")
    synced.add(re.sub(r"/\.([^/]+)\.ucp-tmp-[0-9a-f]{16}", r"/\1", staged))  # as committed
    return real(fd)

  monkeypatch.setattr(os, "fsync", fsync)
  path = tmp_path / "ckpt"
  tree = {"a": np.ones((64, 16), np.float32), "b": {"c": 1}}
  ucp_jax.save(path, tree, chunk_bytes=1024, durable=durable)
  ucp_jax.save(tmp_path / "unbundled", tree, chunk_bytes=1024, durable=durable, bundle_bytes=None)
  if not durable:
    assert synced == set()
    return
  # chunk files and the manifest (zarr.json files are written by TensorStore, which syncs them)
  for where, count in ((path, 3), (tmp_path / "unbundled", 6)):  # a's 4 chunks in one bundle
    files = {str(p) for p in where.rglob("*") if p.is_file() and p.name != "zarr.json"}
    dirs = {str(p) for p in where.rglob("*") if p.is_dir()} | {str(where)}
    assert len(files) == count and files <= synced, files - synced
    assert dirs <= synced, dirs - synced
  assert str(tmp_path) in synced  # the rename into place


def test_folders_a_durable_save_creates_are_fsynced_into_their_parents(tmp_path, monkeypatch):
  synced = []
  real = _swap.fsync_dir

  def fsync_dir(path):
    synced.append(os.path.abspath(path))
    real(path)

  monkeypatch.setattr(_swap, "fsync_dir", fsync_dir)
  ucp_jax.save(tmp_path / "runs" / "a" / "ckpt", {"w": np.ones(3)}, durable=False)
  assert synced == []
  ucp_jax.save(tmp_path / "new" / "b" / "ckpt", {"w": np.ones(3)})
  for created in (tmp_path / "new", tmp_path / "new" / "b"):  # each in its parent, top down
    assert str(created.parent) in synced
  assert synced.index(str(tmp_path)) < synced.index(str(tmp_path / "new"))


def test_a_failed_compressed_save_leaves_no_staging_behind(tmp_path, monkeypatch):
  from ucp_jax.store import _writer

  real = _writer.Writer._write
  calls = []

  def failing(self, key, host, index, immutable):
    calls.append(key)
    if len(calls) == 40:  # after 39 TensorStore writes were started, none awaited
      raise OSError(28, "No space left on device (injected)")
    return real(self, key, host, index, immutable)

  monkeypatch.setattr(_writer.Writer, "_write", failing)
  tree = {f"a{i}": np.full((256, 256), i, np.float32) for i in range(64)}
  with pytest.raises(ucp_jax.StorageError, match="no space left on the device"):
    ucp_jax.save(tmp_path / "ckpt", tree, compression="zstd")
  time.sleep(0.2)  # a write still in flight would land now, recreating the staging folder
  assert os.listdir(tmp_path) == []


def test_direct_reads_and_writes_are_on():
  assert _direct.ENABLED


# --- remote stores ---


def _silent_endpoint():
  """An S3 endpoint that accepts connections and never answers."""
  import socket

  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(64)
  spec = {
    "driver": "s3",
    "bucket": "ucp-bucket",
    "path": "ckpt",
    "endpoint": f"http://127.0.0.1:{server.getsockname()[1]}",
    "aws_region": "us-east-1",
  }
  return server, json.dumps(spec)


def _ucp(args, **env):
  environ = {**os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", **env}
  return subprocess.Popen(
    [sys.executable, "-m", "ucp_jax.cli", *args],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=environ,
  )


def test_an_unanswering_store_is_an_error_within_the_timeout():
  server, spec = _silent_endpoint()
  with server:
    proc = _ucp(["inspect", spec], UCP_STORE_TIMEOUT_S="2")
    _, err = proc.communicate(timeout=60)
  ours = [line for line in err.splitlines() if not line.startswith("E")]  # not the AWS log
  assert proc.returncode == 2, err
  assert ours == [
    "error: s3://ucp-bucket/ckpt: reading manifest.json: no answer within 2 s (no network, a "
    "wrong endpoint, or missing credentials?); set UCP_STORE_TIMEOUT_S to wait longer"
  ]


def test_ctrl_c_stops_a_wait_on_a_store():
  """Ctrl-C once the command waits on its first request (the store has its first bytes)."""
  server, spec = _silent_endpoint()
  with server:
    proc = _ucp(["inspect", spec], UCP_STORE_TIMEOUT_S="600")
    try:
      server.settimeout(300)  # a hang detector, not a timer
      connection, _ = server.accept()
      with connection:
        connection.settimeout(300)
        connection.recv(1)  # its request has begun: the command waits on the answer
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:  # a hung child must not outlive the test (its leftovers would fail the next one)
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
  assert proc.returncode == 130, err
  assert "Traceback" not in err


# --- what a save may replace ---


def test_a_save_checks_again_once_it_holds_the_lock(tmp_path, monkeypatch):
  """Another save that commits between the first check and the lock is not overwritten."""
  path = tmp_path / "ckpt"
  real = _commit.Lock.acquire

  def acquire(self):  # this save is preempted after its first check, before the lock
    monkeypatch.setattr(_commit.Lock, "acquire", real)
    ucp_jax.save(path, {"w": np.ones(2)}, step=1)
    return real(self)

  monkeypatch.setattr(_commit.Lock, "acquire", acquire)
  with pytest.raises(ucp_jax.CheckpointExistsError, match="overwrite=True"):
    ucp_jax.save(path, {"w": np.zeros(2)}, step=2)
  assert ucp_jax.open(path).step == 1


def test_a_checkpoint_left_by_a_cut_swap_needs_overwrite_too(tmp_path):
  path = tmp_path / "ckpt"
  ucp_jax.save(path, {"w": np.zeros(3)}, step=1)
  ucp_jax.save(tmp_path / "new", {"w": np.ones(3)}, step=2)
  staged = tmp_path / ".ckpt.ucp-tmp-00000000000000aa"
  os.rename(path, f"{staged}.old")  # the fallback swap's first rename ...
  os.rename(tmp_path / "new", staged)  # ... and not its second
  assert ucp_jax.open(path).step == 2  # committed: read where it waits
  with pytest.raises(ucp_jax.CheckpointExistsError, match="overwrite=True"):
    ucp_jax.save(path, {"w": np.full(3, 7.0)}, step=3)
  assert ucp_jax.open(path).step == 2 and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_symlinked_path_is_refused(tmp_path):
  ucp_jax.save(tmp_path / "step100", {"w": np.ones(2)}, step=100)
  os.symlink(tmp_path / "step100", tmp_path / "latest")
  with pytest.raises(ucp_jax.CheckpointExistsError, match="a symbolic link"):
    ucp_jax.save(tmp_path / "latest", {"w": np.zeros(2)}, step=101, overwrite=True)
  assert ucp_jax.open(tmp_path / "latest").step == 100  # reading through it is fine
  assert sorted(os.listdir(tmp_path)) == ["latest", "step100"]


def test_an_object_store_prefix_with_other_data_is_refused(tmp_path):
  root = tmp_path / "bucket"
  (root / "logs").mkdir(parents=True)
  (root / "config.yaml").write_text("lr: 1")
  (root / "logs" / "run.log").write_text("step 1")
  spec = {"driver": "file", "path": str(root)}
  for overwrite in (False, True):
    with pytest.raises(ucp_jax.CheckpointExistsError, match=r"holds other data \(config\.yaml"):
      ucp_jax.save(spec, {"w": np.ones(2)}, overwrite=overwrite)
  assert sorted(os.listdir(root)) == ["config.yaml", "logs"]


def test_an_object_store_overwrite_deletes_only_what_the_old_checkpoint_held():
  outer, inner = "memory://ucp_test_nested", "memory://ucp_test_nested/best"
  ucp_jax.save(outer, {"w": np.ones(2)}, step=1)
  ucp_jax.save(inner, {"w": np.full(2, 5.0)}, step=9)  # a checkpoint below another's prefix
  store = _location.kvstore(_location.resolve(outer))
  store.write("notes.txt", b"mine").result()
  ucp_jax.save(outer, {"w": np.zeros(2)}, step=2, overwrite=True)
  assert ucp_jax.open(outer).step == 2 and ucp_jax.open(inner).step == 9
  assert store.read("notes.txt").result().value == b"mine"
  generations = {k.decode().split("/")[0] for k in store.list().result() if k.startswith(b"g")}
  assert generations == {ucp_jax.open(outer).manifest.data.rstrip("/")}
  ucp_jax.save("memory://ucp_test_parent/child", {"w": np.ones(1)})
  with pytest.raises(ucp_jax.CheckpointExistsError, match=r"holds other data \(child/"):
    ucp_jax.save("memory://ucp_test_parent", {"w": np.ones(1)})  # no checkpoint there: refused
  assert ucp_jax.open("memory://ucp_test_parent/child").keys() == ["w"]


# --- the swap without an exchange: every way out leaves a whole checkpoint ---


def _hide_exchange(monkeypatch, code=errno.EINVAL):
  monkeypatch.setattr(_swap, "_renameat2", lambda a, b, flags: code)


def _fail_renames(monkeypatch, failing: set[int]):
  """The renames numbered in `failing` (from 1) raise EIO instead of running."""
  real, calls = os.rename, [0]

  def rename(a, b, *args, **kwargs):
    calls[0] += 1
    if calls[0] in failing:
      raise OSError(errno.EIO, "Input/output error (injected)", a)
    return real(a, b, *args, **kwargs)

  monkeypatch.setattr(os, "rename", rename)
  return calls


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP])
def test_without_an_exchange_an_overwrite_renames_twice(tmp_path, monkeypatch, code):
  path = tmp_path / "ckpt"
  ucp_jax.save(path, {"w": np.zeros(3)}, step=1)
  _hide_exchange(monkeypatch, code)
  calls = _fail_renames(monkeypatch, set())
  ucp_jax.save(path, {"w": np.ones(3)}, step=2, overwrite=True)
  assert calls[0] == 2 and ucp_jax.open(path).step == 2
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_exchange_that_fails_otherwise_is_an_error_that_moves_nothing(tmp_path, monkeypatch):
  path = tmp_path / "ckpt"
  ucp_jax.save(path, {"w": np.zeros(3)}, step=1)
  _hide_exchange(monkeypatch, errno.EIO)
  calls = _fail_renames(monkeypatch, set())
  with pytest.raises(
    ucp_jax.StorageError,
    match=r"the commit: the device reported an I/O error: check the disk \(.*\)\. Nothing was",
  ):
    ucp_jax.save(path, {"w": np.ones(3)}, step=2, overwrite=True)
  assert calls[0] == 0  # no fallback on a failing disk
  assert ucp_jax.open(path).step == 1 and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_swap_that_cannot_be_undone_says_where_the_old_checkpoint_is(tmp_path, monkeypatch):
  path = tmp_path / "ckpt"
  ucp_jax.save(path, {"w": np.zeros(3)}, step=1)
  _hide_exchange(monkeypatch)
  _fail_renames(monkeypatch, {2, 3})  # into place, and back: both fail
  with pytest.raises(ucp_jax.StorageError) as caught:
    ucp_jax.save(path, {"w": np.ones(3)}, step=2, overwrite=True)
  assert re.fullmatch(
    rf"{path}: the commit failed \(OSError: .*\) and undoing it failed too \(OSError: .*\); the "
    rf"previous checkpoint is in {tmp_path}/\.ckpt\.ucp-tmp-[0-9a-f]{{16}}\.old until the next "
    rf"save or export to {path} puts it back \(reading {path} reads it there\)",
    str(caught.value),
  )
  # The abort removed the new one and, the disk working again, put the old one back.
  assert ucp_jax.open(path).step == 1 and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_lone_old_checkpoint_is_read_and_put_back(tmp_path):
  """What a swap whose undo was cut short leaves: the old checkpoint aside, nothing in place,
  and maybe part of the staging folder, its manifest deleted first."""
  path = tmp_path / "ckpt"
  ucp_jax.save(path, {"w": np.zeros(3)}, step=1)
  staged = tmp_path / ".ckpt.ucp-tmp-00000000000000aa"
  os.rename(path, f"{staged}.old")
  ucp_jax.save(tmp_path / "other", {"w": np.ones(3)}, step=2)
  os.rename(tmp_path / "other", staged)
  os.unlink(staged / "manifest.json")  # half deleted: not a checkpoint any more
  assert ucp_jax.open(path).step == 1
  np.testing.assert_array_equal(ucp_jax.restore(path)["w"], np.zeros(3))
  _swap.recover(str(path))
  assert ucp_jax.open(path).step == 1
  with pytest.raises(ucp_jax.CheckpointExistsError, match="overwrite=True"):
    ucp_jax.save(path, {"w": np.full(3, 7.0)}, step=3)
  ucp_jax.save(path, {"w": np.full(3, 7.0)}, step=3, overwrite=True)
  assert ucp_jax.open(path).step == 3 and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_interrupt_while_a_save_starts_leaves_no_lock_held(tmp_path, monkeypatch):
  path = tmp_path / "ckpt"
  ucp_jax.save(path, {"w": np.zeros(3)}, step=1)
  real = _commit.remove_stale_staging

  def interrupted(target):
    raise KeyboardInterrupt

  monkeypatch.setattr(_commit, "remove_stale_staging", interrupted)
  with pytest.raises(KeyboardInterrupt):
    ucp_jax.save(path, {"w": np.ones(3)}, step=2, overwrite=True)
  monkeypatch.setattr(_commit, "remove_stale_staging", real)
  ucp_jax.save(path, {"w": np.ones(3)}, step=2, overwrite=True)  # not turned away by its own lock
  assert ucp_jax.open(path).step == 2 and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_export_cut_between_its_renames_is_put_back_before_it_is_replaced(tmp_path):
  from ucp_jax.sinks import _folder, _registry

  dst = tmp_path / "out"
  with _folder.staged(str(dst)) as staging:
    (Path(staging) / "weights.bin").write_bytes(b"old")
    _folder.write_marker(staging, "test", files=["weights.bin"])
  staged = tmp_path / ".out.ucp-export-00000000000000bb"
  os.rename(dst, f"{staged}.old")  # a kill between the renames of the next export
  staged.mkdir()
  (staged / "weights.bin").write_bytes(b"new")
  _folder.write_marker(str(staged), "test", files=["weights.bin"])
  with pytest.raises(ucp_jax.CheckpointExistsError, match="overwrite=True"):
    _folder.check_destination(
      _registry.Destination(str(dst)), not_an_export=lambda p: [], what="a test"
    )
  assert (dst / "weights.bin").read_bytes() == b"new"  # the new one, put in place
  assert sorted(os.listdir(tmp_path)) == ["out"]


def test_an_interrupt_as_the_exchange_returns_is_undone(tmp_path, monkeypatch):
  """Ctrl-C lands after renameat2 swapped the folders, before Python saw it return: the swap
  is told by the folders' identity, and exchanged back."""
  path = tmp_path / "ckpt"
  ucp_jax.save(path, {"w": np.zeros(3)}, step=1)
  real, calls = _swap._renameat2, []

  def exchanged_then_interrupted(a, b, flags):
    calls.append(real(a, b, flags))
    if len(calls) == 1:
      raise KeyboardInterrupt
    return calls[-1]

  monkeypatch.setattr(_swap, "_renameat2", exchanged_then_interrupted)
  with pytest.raises(KeyboardInterrupt):
    ucp_jax.save(path, {"w": np.ones(3)}, step=2, overwrite=True)
  assert calls == [0, 0]  # exchanged, and back
  assert ucp_jax.open(path).step == 1 and sorted(os.listdir(tmp_path)) == ["ckpt"]
