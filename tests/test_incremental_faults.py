"""Nothing lost when an incremental save is interrupted at any step, or killed.

An incremental save overwrites its own base (the hardest case: the files it takes belong
to the checkpoint it replaces): the in-process matrix of test_commit_faults.py interrupts
it at every step of its commit, and real SIGKILLs stop it while it links the base's files,
around its commit, and, on object stores, while it registers its use of the pool and
while the collector deletes what no checkpoint uses. After each: the path holds the old or
the new checkpoint whole, and the next save works and leaves nothing beside it (on an
object store, the pool holds exactly what the live checkpoint uses).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import test_commit_faults as faults
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax

WORKER = Path(__file__).parent / "support" / "incremental_fault_worker.py"
FROZEN = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)


def _frozen():
  """One jax.Array for every save of the matrix: unchanged since each base."""
  if not hasattr(_frozen, "array"):
    sharding = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))
    _frozen.array = jax.device_put(FROZEN, sharding)
  return _frozen.array


def _version(path) -> int:
  """The version the checkpoint at `path` holds, whole: its frozen array intact."""
  assert ucp_jax.open(path).verify() == {}
  out = ucp_jax.restore(path)
  np.testing.assert_array_equal(out["frozen"], FROZEN)
  values = {float(x) for key in ("a", "b") for x in np.unique(out[key])}
  assert len(values) == 1, values
  return int(values.pop())


def _base(dst):
  try:
    return ucp_jax.open(dst)
  except ucp_jax.CheckpointNotFoundError:
    return None


def _save_incremental(dst: Path, v: int) -> None:
  state = {"frozen": _frozen(), "a": np.full((40,), v, np.float32), "b": np.full((3, 5), v)}
  ucp_jax.save(dst, state, base=_base(dst), overwrite=True, chunk_bytes=8192)


def _save_async_incremental(dst: Path, v: int) -> None:
  state = {"frozen": _frozen(), "a": np.full((40,), v, np.float32), "b": np.full((3, 5), v)}
  ucp_jax.save_async(dst, state, base=_base(dst), overwrite=True, chunk_bytes=8192)
  ucp_jax.wait_until_finished()


COMMITTERS = {
  "save": faults.Committer("incremental-save", _save_incremental, _version),
  "save_async": faults.Committer("incremental-save_async", _save_async_incremental, _version),
}


@pytest.mark.parametrize(
  ("name", "exchange"), [("save", False), ("save", True), ("save_async", False)]
)
def test_an_incremental_overwrite_interrupted_at_any_step_loses_nothing(
  name, exchange, tmp_path, monkeypatch
):
  done = faults._run_matrix(COMMITTERS[name], tmp_path, monkeypatch, exchange=exchange)
  assert len(done) >= 15  # every step, each way, and every kill image
  print("\n".join(done))


def _worker(path, value: int, stage: str) -> subprocess.CompletedProcess:
  arg = json.dumps(path) if isinstance(path, dict) else str(path)
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    [sys.executable, str(WORKER), arg, str(value), stage],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    start_new_session=True,
  )


LOCAL_KILLS = [
  ("linking", 1),  # half the base's files linked into the staging folder
  ("before-commit", 1),
  ("before-swap", 1),
  ("after-exchange", 2),  # the replaced folder, whose files the new one shares, half deleted
  ("fallback-between-renames", 2),
  ("fallback-after-renames", 2),
]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "expected"), LOCAL_KILLS)
def test_an_incremental_save_killed_on_a_local_disk(tmp_path, stage, expected):
  path = tmp_path / "ckpt"
  assert _worker(path, 1, "none").returncode == 0
  proc = _worker(path, 2, stage)
  assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
  assert _version(path) == expected  # readable before anyone cleans up
  assert _worker(path, 3, "none").returncode == 0  # the next save cleans up after it
  assert _version(path) == 3
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]


OBJECT_KILLS = [
  ("registering", 1),  # its reference written, nothing else
  ("writing", 1),
  ("before-commit", 1),
  ("after-manifest", 2),  # committed; the replaced data not removed yet
  ("collecting", 2),  # committed; killed while the collector deletes a generation
]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "expected"), OBJECT_KILLS)
def test_an_incremental_save_killed_on_an_object_store(tmp_path, stage, expected):
  path = {"driver": "file", "path": str(tmp_path / "bucket" / "ckpt")}
  pool = tmp_path / "bucket" / ".ucp-pool"
  for _ in range(3):  # the second save moves the arrays into the pool, the third takes them
    assert _worker(path, 1, "none").returncode == 0
  assert ucp_jax.open(path).manifest.pool
  proc = _worker(path, 2, stage)
  assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
  assert _version(path) == expected
  assert _worker(path, 3, "none").returncode == 0
  assert _version(path) == 3
  manifest = ucp_jax.open(path).manifest
  used = {info.at.rstrip("/") for info in manifest.arrays.values()}
  assert {n for n in _objects(pool) if n.startswith("g")} == used
  assert _objects(pool / "refs") == {manifest.token}
  assert not _objects(pool / "condemned")
  assert _objects(tmp_path / "bucket" / "ckpt") == {"manifest.json", "zarr.json"}


def _objects(folder: Path) -> set[str]:
  """The names below `folder` that hold objects (a file kvstore leaves empty folders)."""
  if not folder.exists():
    return set()
  return {p.name for p in folder.iterdir() if p.is_file() or any(q.is_file() for q in p.rglob("*"))}
