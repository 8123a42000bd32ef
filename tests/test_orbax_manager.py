"""ucp_jax inside Orbax's CheckpointManager: retention, intervals, resume, async, resharding."""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax.orbax import UcpCheckpointHandler, UcpRestore, UcpSave
from ucp_jax.tree import _save

_WRITE = _save.Writer._write_entries


def _state(devices, step: int) -> dict:
  mesh = jax.make_mesh((8,), ("d",), devices=devices)
  w = jnp.arange(32.0).reshape(8, 4) + step
  return {
    "params": {"w": jax.device_put(w, NamedSharding(mesh, P("d")))},
    "step": step,
  }


def _target(mesh, spec) -> dict:
  sharding = NamedSharding(mesh, spec)
  return {"params": {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding)}, "step": 0}


def _manager(path, **options) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(**options))


def _steps_on_disk(path) -> list[int]:
  return sorted(int(name) for name in os.listdir(path) if name.isdigit())


def test_keeps_the_last_n_and_each_step_is_a_ucp_checkpoint(tmp_path, devices):
  with _manager(tmp_path, max_to_keep=2) as manager:
    for step in range(5):
      assert manager.save(step, args=UcpSave(_state(devices, step), step=step))
    manager.wait_until_finished()
    assert manager.all_steps() == [3, 4]
    assert manager.latest_step() == 4
  assert _steps_on_disk(tmp_path) == [3, 4]
  ckpt = ucp_jax.open(tmp_path / "4" / "default")  # a plain ucp_jax checkpoint
  assert ckpt.step == 4
  assert ckpt.keys() == ["params/w", "step"]
  np.testing.assert_array_equal(ckpt.read("params/w"), np.arange(32.0).reshape(8, 4) + 4)
  # Orbax adds its commit_success.txt to the item; the rest is ours.
  assert {"manifest.json", "params", "step", "zarr.json"} <= set(
    os.listdir(tmp_path / "4" / "default")
  )


def test_saves_every_k_steps(tmp_path, devices):
  with _manager(tmp_path, save_interval_steps=3, enable_async_checkpointing=False) as manager:
    saved = [
      step
      for step in range(8)
      if manager.save(step, args=UcpSave(_state(devices, step), step=step))
    ]
    assert saved == [0, 3, 6]
    assert manager.all_steps() == [0, 3, 6]
    assert [manager.should_save(step) for step in (8, 9)] == [False, True]


def test_resumes_from_the_latest_step_after_preemption(tmp_path, devices):
  """A new manager on the same directory finds the last committed step; a partial one is ignored."""
  with _manager(tmp_path) as manager:
    for step in (10, 20):
      state = _state(devices, step)
      manager.save(
        step,
        args=ocp.args.Composite(
          state=UcpSave(state, step=step), data=ocp.args.JsonSave({"position": step * 7})
        ),
      )
    manager.wait_until_finished()
  # The job is killed during the save of step 30: a partial temporary step directory remains.
  partial = tmp_path / "30.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp"
  partial.mkdir(parents=True)
  (partial / "zarr.json").write_text("{}")

  mesh = jax.make_mesh((8,), ("d",), devices=devices)
  with _manager(tmp_path) as resumed:  # the restarted job
    step = resumed.latest_step()
    assert step == 20
    restored = resumed.restore(
      step,
      args=ocp.args.Composite(state=UcpRestore(_target(mesh, P("d"))), data=ocp.args.JsonRestore()),
    )
  assert restored.data == {"position": 140}
  assert restored.state["step"] == 20
  np.testing.assert_array_equal(restored.state["params"]["w"], np.arange(32.0).reshape(8, 4) + 20)


def test_async_save_through_the_manager_overlaps_training(tmp_path, devices, monkeypatch):
  started, release = threading.Event(), threading.Event()

  def held(self, entries, max_host_bytes):
    started.set()
    assert release.wait(30)
    _WRITE(self, entries, max_host_bytes)

  monkeypatch.setattr(_save.Writer, "_write_entries", held)
  state = _state(devices, 5)
  with _manager(tmp_path, enable_async_checkpointing=True) as manager:
    try:
      assert manager.save(5, args=UcpSave(state, step=5))  # returns once state is on the host
      assert started.wait(10)
      w = jax.jit(lambda w: w * 0 - 1, donate_argnums=0)(state["params"]["w"])
      jax.block_until_ready(w)
      np.testing.assert_array_equal(np.asarray(w), -1)  # the step ran while the save is in flight
      assert not (tmp_path / "5").exists()  # not committed yet
    finally:
      release.set()
    manager.wait_until_finished()
    assert manager.latest_step() == 5
  np.testing.assert_array_equal(
    ucp_jax.open(tmp_path / "5" / "default").read("params/w"), np.arange(32.0).reshape(8, 4) + 5
  )


def test_failed_async_save_raises_and_keeps_the_earlier_steps(tmp_path, devices, monkeypatch):
  with _manager(tmp_path) as manager:
    manager.save(1, args=UcpSave(_state(devices, 1), step=1))
    manager.wait_until_finished()

    def broken(self, entries, max_host_bytes):
      raise OSError("injected: disk full")

    monkeypatch.setattr(_save.Writer, "_write_entries", broken)
    manager.save(2, args=UcpSave(_state(devices, 2), step=2))
    with pytest.raises(OSError, match="injected: disk full"):
      manager.wait_until_finished()
  monkeypatch.undo()
  with _manager(tmp_path) as resumed:
    assert resumed.all_steps() == [1]
  assert ucp_jax.open(tmp_path / "1" / "default").step == 1


def test_restores_onto_another_mesh_through_the_manager(tmp_path, devices):
  with _manager(tmp_path, enable_async_checkpointing=False) as manager:
    manager.save(3, args=UcpSave(_state(devices, 3), step=3))
  mesh = jax.make_mesh((2, 4), ("data", "model"), devices=devices)
  target = _target(mesh, P("model", "data"))
  with _manager(tmp_path) as manager:
    restored = manager.restore(manager.latest_step(), args=UcpRestore(target))
    metadata = manager.item_metadata(3)
  w = restored["params"]["w"]
  assert w.sharding == target["params"]["w"].sharding
  np.testing.assert_array_equal(w, np.arange(32.0).reshape(8, 4) + 3)
  for shard in w.addressable_shards:  # each device holds its (2, 2) block
    assert shard.data.shape == (2, 2)
  assert metadata.step == 3 and metadata.arrays["params/w"].shape == (8, 4)


def test_outside_a_manager_through_a_composite_checkpointer(tmp_path, devices):
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  args = ocp.args.Composite(state=UcpSave(_state(devices, 4), metadata={"run": "a"}))
  checkpointer.save(tmp_path / "ckpt", args=args)
  assert ucp_jax.open(tmp_path / "ckpt" / "state").metadata == {"run": "a"}
  want = np.arange(32.0).reshape(8, 4) + 4
  only_params = UcpRestore({"w": np.zeros((8, 4), np.float32)}, subtree="params")
  restored = checkpointer.restore(tmp_path / "ckpt", args=ocp.args.Composite(state=only_params))
  np.testing.assert_array_equal(restored.state["w"], want)
  untargeted = checkpointer.restore(tmp_path / "ckpt", args=ocp.args.Composite(state=UcpRestore()))
  assert untargeted.state["step"] == 4
  checkpointer.close()


@pytest.mark.parametrize("async_", [False, True])
def test_chunk_and_bundle_sizes_pass_through_the_manager(tmp_path, devices, async_):
  big = {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64)}  # 16 chunks of 1 KiB
  with _manager(tmp_path, enable_async_checkpointing=async_) as manager:
    manager.save(1, args=UcpSave(big, chunk_bytes=1024, bundle_bytes=4096))
    manager.save(2, args=UcpSave(big, chunk_bytes=1024, bundle_bytes=None))
    manager.wait_until_finished()
  for step, bundle in ((1, (16, 64)), (2, None)):
    info = ucp_jax.open(tmp_path / str(step) / "default")["w"]
    assert (info.chunks, info.bundle) == ((4, 64), bundle)


def test_refuses_a_directory_that_orbax_has_written_into(tmp_path):
  checkpointer = ocp.Checkpointer(UcpCheckpointHandler())  # puts _CHECKPOINT_METADATA first
  with pytest.raises(
    ucp_jax.CheckpointExistsError, match=r"holds \['_CHECKPOINT_METADATA'\]. Use it for an item"
  ):
    checkpointer.save(tmp_path / "ckpt", args=UcpSave({"x": np.ones(2)}))
  checkpointer.close()


def _gpt_train_state():
  import optax
  from flax import nnx

  from ucp_jax.models import gpt

  cfg = gpt.GPTConfig(num_layers=1, num_heads=4, d_model=32, vocab_size=64, max_len=16)
  model = gpt.FlaxGPT(cfg, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=0.1), wrt=nnx.Param)
  tokens = jnp.arange(16).reshape(2, 8) % 64

  def loss(model):
    return jnp.mean(model(tokens) ** 2)

  optimizer.update(model, nnx.grad(loss)(model))  # one step: moments that are not zeros
  return model, optimizer


def _export_files(root) -> dict:
  """Every file of a DeepSpeed export, `.pt` files loaded (less the source path they record)."""
  import torch

  out = {}
  for path in sorted(p for p in root.rglob("*") if p.is_file()):
    name = str(path.relative_to(root))
    if path.suffix != ".pt":
      out[name] = path.read_bytes()
      continue
    value = torch.load(path, weights_only=True)
    if isinstance(value, dict):
      value.pop("ucp_jax", None)  # where it was exported from
    out[name] = _plain(value)
  return out


def _plain(value):
  """`value` with its tensors as (dtype, shape, bytes): comparable with ==."""
  import torch

  if isinstance(value, torch.Tensor):
    return (
      str(value.dtype),
      tuple(value.shape),
      value.view(-1).view(torch.uint8).numpy().tobytes(),
    )
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return type(value)(_plain(v) for v in value)
  return value


def test_a_train_state_saved_through_the_manager_exports_as_save_train_state(tmp_path):
  """`UcpSave.train_state` records the schema `save_train_state` records: the DeepSpeed
  exports of the two are the same files, hyperparameters and all; restore_train_state
  reads the manager's item back."""
  pytest.importorskip("torch")
  from flax import nnx

  model, optimizer = _gpt_train_state()
  manager = _manager(tmp_path / "run")
  manager.save(1, args=UcpSave.train_state(model, optimizer))
  manager.wait_until_finished()
  item = tmp_path / "run" / "1" / "default"
  ucp_jax.save_train_state(tmp_path / "direct", model, optimizer)
  assert ucp_jax.open(item).manifest.schema == ucp_jax.open(tmp_path / "direct").manifest.schema
  rules = "gpt2:num_heads=4"
  for src, dst in ((item, "from_manager"), (tmp_path / "direct", "from_direct")):
    ucp_jax.export(src, tmp_path / dst, format="deepspeed", rules=rules, tag="t")
  assert _export_files(tmp_path / "from_manager") == _export_files(tmp_path / "from_direct")

  fresh_model, _ = _gpt_train_state()
  fresh = nnx.Optimizer(fresh_model, optimizer.tx, wrt=nnx.Param)
  ucp_jax.restore_train_state(item, fresh_model, fresh)
  assert int(fresh.step[...]) == 1
  np.testing.assert_array_equal(fresh_model.wte.embedding[...], model.wte.embedding[...])


def test_a_plain_save_of_a_train_state_tree_exports_with_its_schema_found(tmp_path):
  """`UcpSave(item)` of `{"model": ..., "optimizer": ...}` records no schema; the export finds
  it from the keys (as for an Orbax checkpoint of the same tree) and says so: the moments
  are those of the direct save's export, the hyperparameters missing (not in the state)."""
  torch = pytest.importorskip("torch")
  from flax import nnx

  model, optimizer = _gpt_train_state()
  manager = _manager(tmp_path / "run")
  manager.save(1, args=UcpSave({"model": nnx.state(model), "optimizer": nnx.state(optimizer)}))
  manager.wait_until_finished()
  item = tmp_path / "run" / "1" / "default"
  assert ucp_jax.open(item).manifest.schema is None
  report = ucp_jax.export(item, tmp_path / "ds", format="deepspeed", rules="gpt2:num_heads=4")
  assert any("it was found from the training state's keys" in n for n in report.notes)
  assert any("no hyperparameters are in the state" in n for n in report.notes)
  ucp_jax.save_train_state(tmp_path / "direct", model, optimizer)
  ucp_jax.export(
    tmp_path / "direct", tmp_path / "ds2", format="deepspeed", rules="gpt2:num_heads=4"
  )
  theirs, ours = tmp_path / "ds2" / report.tag / "zero", tmp_path / "ds" / report.tag / "zero"
  files = sorted(str(p.relative_to(ours)) for p in ours.glob("*/*.pt"))  # per parameter
  assert files == sorted(str(p.relative_to(theirs)) for p in theirs.glob("*/*.pt"))
  assert any(f.endswith("/exp_avg_sq.pt") for f in files)
  for name in files:
    a, b = (_plain(torch.load(root / name, weights_only=True)) for root in (ours, theirs))
    assert a == b, name


def test_a_plain_save_of_another_tree_says_how_to_make_it_exportable(tmp_path):
  manager = _manager(tmp_path / "run")
  manager.save(1, args=UcpSave({"w": jnp.ones(3)}))
  manager.wait_until_finished()
  with pytest.raises(ucp_jax.MappingError, match=r"UcpSave\.train_state\(model, optimizer\)"):
    ucp_jax.export(tmp_path / "run" / "1" / "default", tmp_path / "hf", format="hf")


def test_a_manager_folder_points_at_the_item_to_open_in_one_hop(tmp_path):
  manager = _manager(tmp_path / "run")
  for step in (1, 2):
    manager.save(step, args=UcpSave({"w": jnp.ones(3) * step}, step=step))
  manager.wait_until_finished()
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(tmp_path / "run")
  named = str(e.value).rpartition("e.g. ")[2]
  assert named == str(tmp_path / "run" / "2" / "default")
  assert ucp_jax.open(named).step == 2  # the path the message names opens
