"""Incremental saves by 2 processes x 4 devices (gloo on 127.0.0.1): each process takes the
base's files of the parts it owns, an array is reused only if every process finds its part
unchanged, and every step restores alone (here, on 1 process x 8 devices)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import incremental_worker as worker
import multiprocess_run
import numpy as np
import pytest

import ucp_jax

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "support" / "incremental_worker.py"
TIMEOUT_S = 120


def _run(scenario: str, workdir: Path, processes: int = 2) -> None:
  results = multiprocess_run.run_workers(
    WORKER, scenario, workdir, processes=processes, worker_timeout_s=90, timeout_s=TIMEOUT_S
  )
  assert all(r["ok"] for r in results)


def _shared(a: Path, b: Path) -> set[str]:
  fa = {str(p.relative_to(a)): p.stat().st_ino for p in a.rglob("*") if p.is_file()}
  fb = {str(p.relative_to(b)): p.stat().st_ino for p in b.rglob("*") if p.is_file()}
  return {k.split("/c/")[0] for k in fa if "/c/" in k and fb.get(k) == fa[k]}


def _holds(path, step: int, changed: dict | None = None) -> None:
  assert ucp_jax.open(path).verify() == {}
  out = ucp_jax.restore(path)
  for key, value in {**worker.values(step), **(changed or {})}.items():
    np.testing.assert_array_equal(out[key], value, err_msg=key)


def test_two_processes_take_the_unchanged_arrays(tmp_path):
  _run("local", tmp_path)
  frozen = {"sharded", "grid", "replicated"}
  assert _shared(tmp_path / "1", tmp_path / "2") == frozen
  assert _shared(tmp_path / "2", tmp_path / "3") == frozen  # save_async too
  shutil.rmtree(tmp_path / "1")
  shutil.rmtree(tmp_path / "2")
  _holds(tmp_path / "3", 3)


def test_an_array_changed_on_one_process_only_is_written(tmp_path):
  _run("sha256", tmp_path)
  assert _shared(tmp_path / "1", tmp_path / "2") == {"sharded", "replicated"}
  ckpt = ucp_jax.open(tmp_path / "2")  # every chunk's hash, gathered from both processes
  for key in ckpt.keys():
    info = ckpt[key]
    data = ckpt.read(key)
    for index in np.ndindex(*info.hashes.shape[:-1]):
      region = tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, info.chunks))
      block = np.zeros(info.chunks, data.dtype)
      part = data[region]
      block[tuple(slice(0, n) for n in part.shape)] = part
      assert hashlib.sha256(block.tobytes()).digest() == info.hashes[index].tobytes(), key
  shutil.rmtree(tmp_path / "1")
  grid = worker.values(2)["grid"].copy()
  grid[8:] += 1  # process 1 holds the second half of the (2, 4) grid's rows
  _holds(tmp_path / "2", 2, {"grid": grid})


def test_two_processes_reference_the_pool_of_an_object_store(tmp_path):
  _run("object_store", tmp_path)
  run = tmp_path / "bucket" / "run"

  def spec(step):
    return {"driver": "file", "path": str(run / str(step))}

  m2, m3 = (ucp_jax.open(spec(s)).manifest for s in (2, 3))
  assert m3.pool == "../.ucp-pool/"
  assert {m3.arrays[k].at for k in ("sharded", "grid", "replicated")} == {f"g{m2.token}/"}
  assert m3.arrays["adapter"].at == f"g{m3.token}/"
  shutil.rmtree(run / "1")
  shutil.rmtree(run / "2")
  _holds(spec(3), 3)
