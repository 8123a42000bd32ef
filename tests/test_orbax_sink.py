"""Orbax as a sink: `ucp export CKPT DST --format orbax`, read back by Orbax's own restore.

`ocp.StandardCheckpointer().restore(dst, target)` reads every export onto another mesh bit
for bit: a Flax NNX training state saved by `save_train_state`, an Orbax checkpoint converted
and exported back (its tree as Orbax wrote it: tuples, empty nodes, NNX values), any tree
through `target=`; in each storage layout; atomically, never over foreign files.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import orbax_states as S
import pytest
from flax import nnx

import ucp_jax
from ucp_jax import cli
from ucp_jax.sinks import _orbax


@pytest.fixture
def mesh(devices):
  return jax.make_mesh((2, 4), ("data", "model"), devices=devices)


@pytest.fixture
def other_mesh(devices):
  return jax.make_mesh((4, 2), ("x", "y"), devices=devices[::-1])


def _restore(path, target):
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path, target)


def _leftovers(folder) -> list[str]:
  return [n for n in os.listdir(folder) if ".ucp-export" in n or "orbax-checkpoint-tmp" in n]


def test_a_train_state_exports_and_orbax_restores_it_onto_another_mesh(
  tmp_path, other_mesh, capsys
):
  model, optimizer, state = S.trained()
  ucp_jax.save_train_state(tmp_path / "ckpt", model, optimizer)
  dst = str(tmp_path / "orbax")
  assert cli.main(["export", str(tmp_path / "ckpt"), dst, "--format", "orbax"]) == 0
  out = capsys.readouterr().out
  assert "Orbax checkpoint (OCDBT, zarr v2, zstd): 24 arrays as NNX Variable values" in out
  assert "note: leaves are NNX Variable values (KEY/value)" in out
  target = S.on_mesh(S.abstract(), other_mesh)
  restored = _restore(dst, target)
  S.assert_same(restored, state)
  assert S.shardings(restored) == {
    path: leaf.sharding for path, leaf in jax.tree_util.tree_leaves_with_path(target)
  }
  with open(os.path.join(dst, "ucp_export.json")) as f:
    assert json.load(f)["format"] == "orbax"
  assert _leftovers(tmp_path) == []
  assert cli.main(["inspect", dst]) == 0  # ucp_jax reads its own export in place
  assert "optimizer/opt_state/0/mu/l1/kernel" in capsys.readouterr().out


def _linen_like():
  params = {"dense": {"kernel": jnp.arange(32.0).reshape(8, 4), "bias": jnp.ones(4)}}
  tx = optax.adamw(1e-3)  # a chain: (ScaleByAdamState, EmptyState, EmptyState)
  return {
    "params": params,
    "opt_state": tx.init(params),
    "step": 3,
    "key": jax.random.key(7),
    "extras": [jnp.zeros(2, jnp.bfloat16), {}],
  }


def test_orbax_to_ucp_and_back_keeps_orbax_s_tree(tmp_path, mesh, other_mesh):
  tree = _linen_like()
  S.save(tmp_path / "src", tree)
  ucp_jax.convert(tmp_path / "src", tmp_path / "ckpt")
  report = ucp_jax.export(tmp_path / "ckpt", tmp_path / "orbax", format="orbax")
  assert report.summary.endswith("as plain nested dicts")
  abstract = jax.eval_shape(lambda: {k: v for k, v in tree.items() if k != "step"})
  S.assert_same(_restore(tmp_path / "orbax", S.on_mesh(abstract, other_mesh) | {"step": 0}), tree)
  # and straight from Orbax to Orbax, into another layout
  ucp_jax.export(tmp_path / "src", tmp_path / "flat", format="orbax", ocdbt=False, zarr3=True)
  S.assert_same(_restore(tmp_path / "flat", S.on_mesh(abstract, mesh) | {"step": 0}), tree)


def test_an_nnx_state_through_orbax_ucp_and_orbax_again(tmp_path, other_mesh):
  state = S.trained()[2]
  S.save(tmp_path / "src", state, ocdbt=False, compression=False)
  ucp_jax.convert(tmp_path / "src", tmp_path / "ckpt")
  ucp_jax.export(tmp_path / "ckpt", tmp_path / "orbax", format="orbax")
  S.assert_same(_restore(tmp_path / "orbax", S.on_mesh(S.abstract(), other_mesh)), state)
  ucp_jax.export(tmp_path / "ckpt", tmp_path / "pure", format="orbax", nnx=False)
  target = {k: nnx.to_pure_dict(v) for k, v in S.on_mesh(S.abstract(), other_mesh).items()}
  expected = {k: nnx.to_pure_dict(v) for k, v in state.items()}
  S.assert_same(_restore(tmp_path / "pure", target), expected)


def _orbax_dtypes(path) -> dict:
  """Each leaf's dtype as Orbax itself records it, and as it restores it into numpy."""
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
    recorded = checkpointer.metadata(os.path.abspath(path)).item_metadata.tree
    as_numpy = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in recorded}
    restored = checkpointer.restore(
      os.path.abspath(path), args=ocp.args.PyTreeRestore(restore_args=as_numpy)
    )
  assert {k: np.dtype(m.dtype) for k, m in recorded.items()} == {
    k: v.dtype for k, v in restored.items()
  }
  return {k: v.dtype for k, v in restored.items()}


def test_numpy_scalars_keep_their_dtypes(tmp_path):
  """A `PyTreeCheckpointHandler` save of numpy scalars exports them at their own width."""
  tree = {
    "f32": np.float32(2.5),
    "f16": np.float16(1.5),
    "f64": np.float64(0.25),
    "i32": np.int32(-3),
    "i8": np.int8(-2),
    "u16": np.uint16(7),
    "int": 3,
    "float": 0.5,
    "flag": True,
    "w": np.ones(3, np.float32),
  }
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
    checkpointer.save(tmp_path / "src", args=ocp.args.PyTreeSave(tree))
  expected = _orbax_dtypes(tmp_path / "src")
  assert expected["f32"] == np.float32 and expected["int"] == np.int64
  ucp_jax.export(tmp_path / "src", tmp_path / "direct", format="orbax")
  ucp_jax.convert(tmp_path / "src", tmp_path / "ckpt")
  ucp_jax.export(tmp_path / "ckpt", tmp_path / "via_ucp", format="orbax", ocdbt=False, zarr3=True)
  for dst in ("direct", "via_ucp"):
    assert _orbax_dtypes(tmp_path / dst) == expected, dst
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
      restored = checkpointer.restore(os.path.abspath(tmp_path / dst))
    scalars = {k: np.asarray(v).item() for k, v in tree.items() if k != "w"}
    assert {k: (type(v), v) for k, v in restored.items() if k != "w"} == {
      k: (type(v), v) for k, v in scalars.items()
    }  # Orbax's own restore: Python numbers, as from the source


def test_target_writes_exactly_the_tree_orbax_is_given(tmp_path, mesh):
  tree = _linen_like()
  ucp_jax.save(tmp_path / "ckpt", tree)  # ucp_jax keeps keys, not tuples or empty nodes
  abstract = S.on_mesh(jax.eval_shape(lambda: {k: v for k, v in tree.items() if k != "step"}), mesh)
  target = abstract | {"step": 0}
  report = ucp_jax.export(tmp_path / "ckpt", tmp_path / "orbax", format="orbax", target=target)
  assert report.summary.endswith("as the target's tree")
  S.assert_same(_restore(tmp_path / "orbax", target), tree)
  wrong = {"params": target["params"], "other": 1}
  with pytest.raises(ucp_jax.TreeMismatchError) as caught:
    ucp_jax.export(tmp_path / "ckpt", tmp_path / "x", format="orbax", target=wrong)
  assert "other: in target, not in checkpoint" in str(caught.value)
  assert "step: in checkpoint, not in target" in str(caught.value)
  assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize(
  "options",
  [
    dict(ocdbt=False, compression=None),
    dict(zarr3=True, chunk_bytes=64),
    dict(ocdbt=False, zarr3=True, compression="zstd"),
  ],
  ids=["folders-raw", "zarr3-small-chunks", "folders-zarr3-zstd"],
)
def test_storage_options(tmp_path, mesh, options):
  tree = {"w": np.arange(64.0, dtype=np.float32).reshape(16, 4), "n": 5}
  ucp_jax.save(tmp_path / "ckpt", tree)
  ucp_jax.export(tmp_path / "ckpt", tmp_path / "orbax", format="orbax", **options)
  with open(tmp_path / "orbax" / "_METADATA") as f:
    metadata = json.load(f)
  assert metadata["use_ocdbt"] == options.get("ocdbt", True)
  assert metadata["use_zarr3"] == options.get("zarr3", False)
  if not options.get("ocdbt", True) and not options.get("zarr3"):
    with open(tmp_path / "orbax" / "w" / ".zarray") as f:
      assert json.load(f)["compressor"] is None
  view = ucp_jax.open(tmp_path / "orbax")
  chunks = view.tensorstore("w").chunk_layout.read_chunk.shape
  if "chunk_bytes" in options:
    assert np.prod(chunks) * 4 <= 64
  target = {"w": S.on_mesh(jax.eval_shape(lambda: jnp.asarray(tree["w"])), mesh), "n": 0}
  restored = _restore(tmp_path / "orbax", target)
  np.testing.assert_array_equal(np.asarray(restored["w"]), tree["w"])
  assert restored["n"] == 5


def test_large_arrays_reach_orbax_through_scratch_files(tmp_path, mesh, monkeypatch):
  monkeypatch.setattr(_orbax, "SCRATCH_MIN_BYTES", 256)
  monkeypatch.setattr(_orbax, "BLOCK_BYTES", 100)  # three rows of 8 floats per block
  mapped = []
  load = np.load
  monkeypatch.setattr(
    np, "load", lambda *a, **k: mapped.append(k.get("mmap_mode")) or load(*a, **k)
  )
  tree = {"big": np.arange(512.0, dtype=np.float32).reshape(64, 8), "small": np.ones(4)}
  ucp_jax.save(tmp_path / "ckpt", tree)
  ucp_jax.export(tmp_path / "ckpt", tmp_path / "orbax", format="orbax")
  assert mapped == ["r"]  # the big one, memory-mapped; the small one stayed in memory
  target = S.on_mesh(jax.eval_shape(lambda: jax.tree.map(jnp.asarray, tree)), mesh)
  restored = _restore(tmp_path / "orbax", target)
  np.testing.assert_array_equal(np.asarray(restored["big"]), tree["big"])
  assert _leftovers(tmp_path) == []


def test_destinations_and_options_are_checked_first(tmp_path, monkeypatch):
  ucp_jax.save(tmp_path / "ckpt", {"w": np.ones(3)})
  ckpt = str(tmp_path / "ckpt")
  foreign = tmp_path / "foreign"
  foreign.mkdir()
  (foreign / "notes.txt").write_text("mine")
  with pytest.raises(ucp_jax.CheckpointExistsError, match="not an earlier ucp_jax export"):
    ucp_jax.export(ckpt, foreign, format="orbax", overwrite=True)
  assert os.listdir(foreign) == ["notes.txt"]
  with pytest.raises(ucp_jax.InvalidArgumentError) as caught:
    ucp_jax.export(
      ckpt, tmp_path / "x", format="orbax", nnx="yes", compression="gzip", chunk_bytes=0
    )
  message = str(caught.value)
  assert "nnx='yes'" in message and "compression='gzip'" in message and "chunk_bytes=0" in message
  with pytest.raises(ucp_jax.InvalidArgumentError, match="takes no zero_stage"):
    ucp_jax.export(ckpt, tmp_path / "x", format="orbax", zero_stage=1)
  assert not os.path.exists(tmp_path / "x")

  ucp_jax.export(ckpt, tmp_path / "orbax", format="orbax")
  with pytest.raises(ucp_jax.CheckpointExistsError, match="pass overwrite=True"):
    ucp_jax.export(ckpt, tmp_path / "orbax", format="orbax")
  ucp_jax.save(tmp_path / "ckpt2", {"w": np.full(3, 2.0)})
  ucp_jax.export(tmp_path / "ckpt2", tmp_path / "orbax", format="orbax", overwrite=True)
  assert ucp_jax.open(tmp_path / "orbax").read("w").tolist() == [2.0, 2.0, 2.0]

  def fail(*args):
    raise OSError("disk full")

  monkeypatch.setattr(_orbax, "_save", fail)
  with pytest.raises(OSError, match="disk full"):
    ucp_jax.export(ckpt, tmp_path / "orbax", format="orbax", overwrite=True)
  assert ucp_jax.open(tmp_path / "orbax").read("w").tolist() == [2.0, 2.0, 2.0]  # the old one
  assert _leftovers(tmp_path) == []


@pytest.mark.slow
def test_a_jax_trained_gpt_moves_to_pytorch(tmp_path):
  """Orbax save of a Flax GPT train state -> convert -> Hugging Face folder with the GPT-2
  rule set -> the PyTorch twin loads it and computes the same logits."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("safetensors")
  from safetensors.torch import load_file
  from torch_twins import TorchGPT

  from ucp_jax import rules
  from ucp_jax.models import gpt

  cfg = gpt.GPTConfig(vocab_size=64, max_len=16, num_layers=2, num_heads=4, d_model=32)
  model = gpt.FlaxGPT(cfg, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  tokens = jnp.arange(24).reshape(2, 12) % cfg.vocab_size

  @nnx.jit
  def step(model, optimizer):
    def loss(m):
      logits = m(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    optimizer.update(model, nnx.grad(loss)(model))

  for _ in range(2):
    step(model, optimizer)
  state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "orbax", state)
  ucp_jax.convert(tmp_path / "orbax", tmp_path / "ckpt", hyperparams={"lr": 1e-2})
  report = ucp_jax.export(
    tmp_path / "ckpt", tmp_path / "hf", format="hf", rules=rules.gpt2(num_heads=cfg.num_heads)
  )
  assert report.tied == {"lm_head.weight": "wte.weight"}
  twin = TorchGPT(cfg).eval()
  missing, unexpected = twin.load_state_dict(
    load_file(tmp_path / "hf" / "model.safetensors"), strict=False
  )
  assert missing == ["lm_head.weight"] and unexpected == []  # tied to wte.weight
  with torch.no_grad():
    logits = twin(torch.tensor(np.asarray(tokens))).numpy()
  np.testing.assert_allclose(logits, np.asarray(model(tokens)), rtol=1e-5, atol=1e-5)
  # and to DeepSpeed, Adam's moments included
  gpt2 = rules.gpt2(num_heads=cfg.num_heads)
  report = ucp_jax.export(tmp_path / "ckpt", tmp_path / "ds", rules=gpt2, format="deepspeed")
  assert report.step == 2 and report.params == 4 + 12 * cfg.num_layers
