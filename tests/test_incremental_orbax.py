"""Incremental saves through Orbax's CheckpointManager: the latest step is the base, and
retention (`max_to_keep`) never breaks a step that is kept."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax.integrations import _orbax
from ucp_jax.orbax import UcpRestore, UcpSave


def _frozen(devices) -> dict:
  mesh = jax.make_mesh((8,), ("d",), devices=devices)
  return {
    f"w{i}": jax.device_put(jnp.full((64, 128), float(i)), NamedSharding(mesh, P("d")))
    for i in range(2)
  }


def _state(frozen: dict, step: int) -> dict:
  return {"frozen": frozen, "adapter": jnp.full((8, 4), float(step))}


def _inodes(item: Path) -> dict[str, int]:
  return {str(p.relative_to(item)): p.stat().st_ino for p in item.rglob("c/*/*") if p.is_file()}


def _steps(root: Path, prefix: str = "") -> list[int]:
  return sorted(
    int(n.removeprefix(prefix)) for n in os.listdir(root) if n.removeprefix(prefix).isdigit()
  )


@pytest.mark.parametrize("asynchronous", [True, False])
def test_the_latest_step_is_the_base_and_retention_breaks_nothing(tmp_path, devices, asynchronous):
  frozen = _frozen(devices)
  options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=asynchronous)
  with ocp.CheckpointManager(tmp_path, options=options) as manager:
    for step in range(6):
      manager.save(step, args=UcpSave(_state(frozen, step), step=step))
    manager.wait_until_finished()
  assert _steps(tmp_path) == [4, 5]
  four, five = (_inodes(tmp_path / str(s) / "default") for s in (4, 5))
  shared = {k.split("/c/")[0] for k in five if four.get(k) == five[k]}
  assert shared == {"frozen/w0", "frozen/w1"}
  shutil.rmtree(tmp_path / "4")  # an older step deleted by hand too
  target = jax.tree.map(lambda x: jnp.zeros_like(x), _state(frozen, 0))
  with ocp.CheckpointManager(tmp_path) as manager:
    out = manager.restore(5, args=UcpRestore(target))
  np.testing.assert_array_equal(out["frozen"]["w1"], np.full((64, 128), 1.0))
  np.testing.assert_array_equal(out["adapter"], np.full((8, 4), 5.0))
  assert ucp_jax.open(tmp_path / "5" / "default").verify() == {}


def test_incremental_false_writes_every_array(tmp_path, devices):
  frozen = _frozen(devices)
  with ocp.CheckpointManager(tmp_path) as manager:
    for step in range(2):
      manager.save(step, args=UcpSave(_state(frozen, step), incremental=False))
    manager.wait_until_finished()
  zero, one = (_inodes(tmp_path / str(s) / "default") for s in (0, 1))
  assert not [k for k in one if zero.get(k) == one[k]]


def test_steps_with_a_prefix_and_sha256(tmp_path):
  weights = {"w": np.arange(1024.0).reshape(32, 32)}
  options = ocp.CheckpointManagerOptions(step_prefix="step", enable_async_checkpointing=False)
  with ocp.CheckpointManager(tmp_path, options=options) as manager:
    for step in range(3):
      state = {"w": weights["w"].copy(), "b": np.full(3, step)}  # new numpy objects each time
      manager.save(step, args=UcpSave(state, unchanged="sha256"))
  assert _steps(tmp_path, "step_") == [0, 1, 2]
  one, two = (_inodes(tmp_path / f"step_{s}" / "default") for s in (1, 2))
  assert {k.split("/c")[0] for k in two if one.get(k) == two[k]} == {"w"}


def test_the_base_is_the_highest_finalized_step(tmp_path):
  for name in ("3", "10", "12.orbax-checkpoint-tmp-1", "7", "notes"):
    (tmp_path / name / "default").mkdir(parents=True)
  for name in ("3", "7"):
    ucp_jax.save(tmp_path / name / "default" / "x", {"a": np.ones(2)})
    os.rename(tmp_path / name / "default" / "x", tmp_path / f"{name}.ckpt")
    os.rmdir(tmp_path / name / "default")
    os.rename(tmp_path / f"{name}.ckpt", tmp_path / name / "default")
  current = tmp_path / "12.orbax-checkpoint-tmp-1" / "default.orbax-checkpoint-tmp-2"
  assert _orbax.latest_item(current) == str(tmp_path / "7" / "default")  # 10 holds none
  assert _orbax.latest_item(tmp_path / "7" / "default") == str(tmp_path / "3" / "default")
  assert _orbax.latest_item(tmp_path / "x" / "y") is None


def test_steps_that_orbax_moves_by_copying_are_saved_whole():
  args = UcpSave({"w": np.ones(2)})
  assert _orbax._incremental("/ckpts/3.orbax-checkpoint-tmp-1/default.orbax-checkpoint-tmp", args)
  assert _orbax._incremental("gs://bucket/ckpts/3/default", args)  # written in place
  assert not _orbax._incremental("s3://bucket/ckpts/3.orbax-checkpoint-tmp-1/default", args)
  assert not _orbax._incremental("/ckpts/3/default", UcpSave({}, incremental=False))
