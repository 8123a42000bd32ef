"""A converted TP=2 checkpoint restores onto any model-axis size, each slice read from its chunks."""

import os

import jax
import numpy as np
import pytest
from chunk_reads import ChunkReads
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax.store import _bundle, _chunks
from ucp_jax.tree import _tree

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "tp", "autotp_tp2_dp2", "ckpt")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  dst = tmp_path_factory.mktemp("tp") / "converted"
  ucp_jax.convert(FIXTURE, dst)
  return str(dst)


def _leaves(tree):
  return dict(
    zip(
      [_tree.from_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)],
      jax.tree_util.tree_leaves(tree),
    )
  )


@pytest.mark.parametrize("model", [1, 2, 4, 8])
def test_restore_on_any_model_axis(converted, monkeypatch, model):
  ckpt = ucp_jax.open(converted)
  mesh = jax.make_mesh((8 // model, model), ("data", "model"))
  target = ucp_jax.tp_shardings(ckpt, mesh)
  shardings = _leaves(target)
  assert shardings["params/layers.0.mlp.down_proj.weight"].spec == P(None, "model")  # row
  assert shardings["exp_avg/layers.1.self_attn.qkv_proj.weight"].spec == P("model", None)
  assert shardings["params/norm.weight"].spec == P()  # replicated
  lm_head = shardings["params/lm_head.weight"].spec  # 51 rows: split only where it divides
  assert lm_head == (P("model", None) if model == 1 else P())

  expected = {key: ckpt.read(key) for key in ckpt.keys()}  # (read before reads are recorded)
  reads = ChunkReads(monkeypatch)
  restored = _leaves(ucp_jax.restore(converted, target))
  files_read = list(reads.files)
  assert set(restored) == set(ckpt.keys())
  for key, array in restored.items():
    assert array.sharding == shardings[key], key
    np.testing.assert_array_equal(np.asarray(array), expected[key], err_msg=key)

  # each distinct device slice is asked for once, and only the chunks under it are read, once
  chunk_files = []
  for key in restored:
    info = ckpt[key]
    wanted = {
      tuple((s.start or 0, s.stop if s.stop is not None else d) for s, d in zip(idx, info.shape))
      for idx in shardings[key].devices_indices_map(info.shape).values()
    }
    asked = {tuple((s.start, s.stop) for s in r) for r in reads.regions[key]}
    assert asked == wanted, key
    chunks = set()
    for region in reads.regions[key]:
      chunks |= set(_chunks.chunks_in(region, info.chunks))
    chunk_files += [os.path.join(converted, key, _bundle.chunk_name(info, i)) for i in chunks]
  assert sorted(files_read) == sorted(chunk_files)


def test_a_device_slice_reads_only_its_chunks(converted, monkeypatch):
  # Chunks follow the source's TP=2 pieces: a restore onto 2 devices on the model axis reads,
  # for each device, exactly the chunk of its half.
  ckpt = ucp_jax.open(converted)
  key = "params/layers.0.self_attn.o_proj.weight"  # row-parallel [16, 16], chunks [16, 8]
  assert ckpt[key].chunks == (16, 8)
  mesh = jax.make_mesh((1, 2), ("data", "model"), devices=jax.devices()[:2])
  sharding = _leaves(ucp_jax.tp_shardings(ckpt, mesh))[key]
  reads = ChunkReads(monkeypatch)
  array = ucp_jax.restore(
    converted, {key.split("/")[0]: {key.split("/")[1]: sharding}}, partial=True
  )
  by_region = {}
  for region in reads.regions[key]:
    by_region[(region[1].start, region[1].stop)] = list(_chunks.chunks_in(region, (16, 8)))
  assert by_region == {(0, 8): [(0, 0)], (8, 16): [(0, 1)]}
  names = sorted(os.path.relpath(f, os.path.join(converted, key)) for f in reads.files)
  assert names == [_bundle.chunk_name(ckpt[key], (0, 0)), _bundle.chunk_name(ckpt[key], (0, 1))]
  np.testing.assert_array_equal(np.asarray(array["params"][key.split("/")[1]]), ckpt.read(key))


def test_patterns_map_to_specs():
  from ucp_jax.parallel._tp_shardings import spec_for

  mesh = jax.make_mesh((2, 4), ("data", "model"))
  assert spec_for({"kind": "row", "cat_dim": 1}, (8, 12), mesh, "model", "expert") == P(
    None, "model"
  )
  assert spec_for({"kind": "column", "cat_dim": 0}, (6, 4), mesh, "model", "expert") == P()
  assert spec_for({"kind": "expert", "cat_dim": 0}, (8, 2), mesh, "model", "expert") == P()
  assert spec_for({"kind": "expert", "cat_dim": 0}, (8, 2), mesh, "model", "data") == P(
    "data", None
  )
  assert spec_for(None, (8,), mesh, "model", "expert") == P()
