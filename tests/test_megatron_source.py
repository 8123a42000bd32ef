"""Megatron-core checkpoints as a source: Megatron-LM roots and iteration folders, exactly.

The fixtures are written by megatron-core 0.19.2 itself (`scripts/make_megatron_core_fixtures.py`):
a Llama-style GPTModel (GQA, SwiGLU, RMSNorm, RoPE) trained two steps on TP 2 x DP 2 gloo
ranks with Megatron's DDP and optimizer, saved as Megatron-LM saves: the distributed optimizer
in both of its formats and the plain optimizer, fp32 and bf16. The oracle, `expected.npz`, was
assembled from Megatron's own sharded state dicts at save time (the distributed optimizer's by
its own `fully_reshardable` gather), not from the files read here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _registry
from ucp_jax.sources.megatron import _buckets

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_core"
VARIANTS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
DP_RESHARDABLE = FIXTURES / "distopt_dp_reshardable"


def expected(variant: str) -> dict[str, np.ndarray]:
  with np.load(FIXTURES / variant / "expected.npz") as data:
    return dict(data)


def info(variant: str) -> dict:
  return json.loads((FIXTURES / variant / "info.json").read_text())


def whole(tensor) -> np.ndarray:
  return np.concatenate([np.asarray(p).reshape(-1) for p in tensor.pieces()]).reshape(tensor.shape)


def test_every_variant_is_there():
  assert VARIANTS == [
    "adam",
    "adam_bf16",
    "distopt_dp_reshardable",
    "distopt_fully_reshardable_bf16",
  ]


@pytest.mark.parametrize("variant", VARIANTS)
def test_values_and_moments_are_megatrons_own_bit_for_bit(variant):
  plan = _registry.describe(FIXTURES / variant)
  want = expected(variant)
  assert plan.format == "megatron" and plan.path.endswith("iter_0000002")
  assert len(plan.params) == 9
  for p in plan.params:
    master = want.get(f"optimizer.state.param.{p.name}")
    if master is None:
      master = want.get(f"optimizer.state.fp32_param.{p.name}", want[p.name])
    assert p.value.dtype == np.float32, p.name  # the fp32 master in bf16 runs
    assert np.array_equal(whole(p.value), master), p.name
    assert sorted(p.slots) == ["exp_avg", "exp_avg_sq"], p.name
    for slot, tensor in p.slots.items():
      assert np.array_equal(whole(tensor), want[f"optimizer.state.{slot}.{p.name}"]), (p.name, slot)
  if info(variant)["bf16"]:  # the value is the master, of which the bf16 weight is a rounding
    fc2 = "decoder.layers.mlp.linear_fc2.weight"
    master = whole(next(p.value for p in plan.params if p.name == fc2))
    assert not np.array_equal(master, want[fc2])
    assert np.array_equal(master.astype(ml_dtypes.bfloat16).astype(np.float32), want[fc2])


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_optimizer_step_groups_and_common_state_are_carried(variant):
  plan = _registry.describe(FIXTURES / variant)
  facts = info(variant)
  assert plan.step == facts["iteration"] == 2
  assert plan.optimizer.type == "adamw" and plan.optimizer.step == facts["step"]
  groups = [g.to_json() if hasattr(g, "to_json") else dict(g) for g in plan.optimizer.groups]
  assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
  assert all(g["lr"] == pytest.approx(facts["lr"][0]) and g["step"] == 2 for g in groups)
  by_group = {p.name: p.group for p in plan.params}
  assert by_group["decoder.final_layernorm.weight"] == 1  # norms: no weight decay
  assert by_group["decoder.layers.self_attention.linear_qkv.layer_norm_weight"] == 1
  assert by_group["decoder.layers.self_attention.linear_qkv.weight"] == 0
  assert by_group["embedding.word_embeddings.weight"] == 0
  megatron = plan.extra["megatron"]
  assert megatron["args"]["hidden_size"] == 16 and megatron["args"]["num_query_groups"] == 2
  assert megatron["iteration"] == 2 and megatron["opt_param_scheduler"]["num_steps"] == 2
  assert megatron["optimizer_format"] == (facts["sharding_type"] or "plain")
  assert megatron["not_carried"] == ["rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2"]


def test_layers_are_stacked_and_patterns_say_how_tp_split_them():
  plan = _registry.describe(DP_RESHARDABLE)
  params = {p.name: p for p in plan.params}
  qkv = params["decoder.layers.self_attention.linear_qkv.weight"]
  assert qkv.value.shape == (2, 32, 16)  # (layers, (4 + 2 + 2) heads x 4, hidden)
  assert qkv.pattern == {"kind": "column", "cat_dim": 1}
  assert params["decoder.layers.self_attention.linear_proj.weight"].pattern == {
    "kind": "row",
    "cat_dim": 2,
  }
  assert params["decoder.layers.mlp.linear_fc1.weight"].pattern == {
    "kind": "sub_params",
    "cat_dim": 1,
    "sub_params": 2,
  }
  assert params["decoder.final_layernorm.weight"].pattern == {"kind": "replicated"}
  assert params["embedding.word_embeddings.weight"].value.shape == (64, 16)  # padded vocab


def test_a_root_an_iteration_folder_and_an_explicit_iteration_read_the_same(tmp_path):
  root = tmp_path / "run"
  shutil.copytree(DP_RESHARDABLE, root)
  shutil.copytree(root / "iter_0000002", root / "iter_0000001")
  by_root = _registry.describe(root)
  assert by_root.path == str(root / "iter_0000002")
  folder = _registry.describe(root / "iter_0000002")
  older = _registry.describe(root, iteration=1)
  assert older.path == str(root / "iter_0000001")
  for a, b in zip(by_root.params, folder.params):
    assert a.name == b.name and np.array_equal(whole(a.slots["exp_avg"]), whole(b.slots["exp_avg"]))
  with pytest.raises(
    SourceFormatError,
    match=r"iter_0000007: no torch_dist checkpoint.*"
    r"holds iter_0000001, iter_0000002",
  ):
    _registry.describe(root, iteration=7)


def test_a_restore_onto_a_mesh_reads_the_rebuilt_moments_slice_by_slice(devices):
  want = expected(DP_RESHARDABLE.name)
  mesh = jax.make_mesh((2, 4), ("data", "model"), devices=devices)
  name = "decoder.layers.mlp.linear_fc1.weight"  # (2, 48, 16): [gate; up] over 2 TP domains
  target = {
    "params": {name: NamedSharding(mesh, P(None, "model", "data"))},
    "exp_avg_sq": {name: NamedSharding(mesh, P("data", "model"))},
  }
  restored = ucp_jax.restore(DP_RESHARDABLE, target, partial=True)
  assert np.array_equal(np.asarray(restored["params"][name]), want[name])
  got = restored["exp_avg_sq"][name]
  assert np.array_equal(np.asarray(got), want[f"optimizer.state.exp_avg_sq.{name}"])
  assert got.sharding == target["exp_avg_sq"][name]


def _ucp(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "ucp_jax.cli", *argv], capture_output=True, text=True, timeout=600
  )


def test_ucp_convert_and_inspect_a_megatron_lm_root(tmp_path):
  root = tmp_path / "run"
  shutil.copytree(FIXTURES / "adam_bf16", root)
  shutil.copytree(root / "iter_0000002", root / "iter_0000001")
  shown = _ucp("inspect", str(root))
  assert shown.returncode == 0, shown.stderr
  assert "megatron" in shown.stdout and "decoder.layers.mlp.linear_fc1.weight" in shown.stdout
  done = _ucp("convert", str(root), str(tmp_path / "ucp"), "--iteration", "1")
  assert done.returncode == 0, done.stderr
  converted = ucp_jax.open(tmp_path / "ucp")
  assert converted.step == 2 and converted.manifest.source["iteration_folder"] == "iter_0000001"
  want = expected("adam_bf16")
  key = "decoder.layers.self_attention.linear_qkv.weight"
  assert np.array_equal(converted.read(f"params/{key}"), want[f"optimizer.state.fp32_param.{key}"])
  refused = _ucp("convert", str(root), str(tmp_path / "other"), "--iteration", "latest")
  assert refused.returncode == 2 and "--iteration 'latest'" in refused.stderr


# --- what it refuses, and how ---


def test_a_tracker_that_names_no_iteration_is_refused_naming_the_file(tmp_path):
  root = tmp_path / "run"
  shutil.copytree(DP_RESHARDABLE, root)
  (root / "latest_checkpointed_iteration.txt").write_text("iter two\n")
  with pytest.raises(
    SourceFormatError,
    match=r"latest_checkpointed_iteration.txt: 'iter two' is "
    "not an iteration number",
  ):
    ucp_jax.open(root)


def test_an_iteration_folder_given_an_iteration_says_where_iterations_are_picked():
  with pytest.raises(SourceFormatError, match="--iteration 2 picks one under a Megatron-LM root"):
    _registry.describe(DP_RESHARDABLE / "iter_0000002", iteration=2)


def test_buckets_that_do_not_match_the_parameters_are_refused_not_misread(monkeypatch):
  """One element more recorded in a bucket: the walk cannot land on its end."""
  real = _buckets._bucket_sizes

  def one_more(layout, files, domain, meta):
    return [(padded, unpadded + 1) for padded, unpadded in real(layout, files, domain, meta)]

  monkeypatch.setattr(_buckets, "_bucket_sizes", one_more)
  with pytest.raises(
    SourceFormatError,
    match=r"fill 0 of its 1 buckets.*"
    r"resave with Megatron-LM's --dist-ckpt-optim-fully-reshardable",
  ):
    _registry.describe(DP_RESHARDABLE)


def test_buckets_smaller_than_the_parameters_are_refused(monkeypatch):
  real = _buckets._bucket_sizes

  def fewer(layout, files, domain, meta):
    return [(padded, unpadded - 64) for padded, unpadded in real(layout, files, domain, meta)]

  monkeypatch.setattr(_buckets, "_bucket_sizes", fewer)
  with pytest.raises(
    SourceFormatError,
    match=r"bucket 0 holds 3200 elements, but its "
    r"parameters in Megatron's order need",
  ):
    _registry.describe(DP_RESHARDABLE)


def test_a_dp_reshardable_checkpoint_of_other_parallel_sizes_is_refused(monkeypatch):
  from ucp_jax.sources.megatron import _folders

  real = _folders.record_fields

  def tp4(value):
    return {**real(value), "tensor_model_parallel_size": 4}

  monkeypatch.setattr(_folders, "record_fields", tp4)
  with pytest.raises(SourceFormatError, match=r"buckets for domains \[0, 1\], but TP 4 makes"):
    _registry.describe(DP_RESHARDABLE)


def test_a_folder_whose_metadata_json_is_not_json_says_so(tmp_path):
  folder = tmp_path / "iter_0000002"
  shutil.copytree(DP_RESHARDABLE / "iter_0000002", folder)
  (folder / "metadata.json").write_text("{torch_dist")
  with pytest.raises(SourceFormatError, match=r"metadata.json: not JSON"):
    _registry.describe(folder, "megatron")
  (folder / "metadata.json").write_text('{"sharded_backend": "zarr"}')
  with pytest.raises(SourceFormatError, match=r"sharded_backend 'zarr'; ucp_jax reads"):
    _registry.describe(folder, "megatron")


def test_without_common_state_it_says_what_it_looked_for(tmp_path, monkeypatch):
  from ucp_jax.sources.megatron import _folders

  monkeypatch.setattr(_folders, "COMMON_KEY", "not/there")
  with pytest.raises(
    SourceFormatError,
    match=r"no common state: neither a `not/there` entry "
    r"\(megatron-core 0.19\) nor common.pt",
  ):
    _registry.describe(DP_RESHARDABLE)


def test_the_fixtures_are_what_the_script_makes():
  """The fixture script's variants and sizes are the ones committed (regenerate both)."""
  import make_megatron_core_fixtures as script

  assert sorted(script.VARIANTS) == VARIANTS
  for variant in VARIANTS:
    facts = info(variant)
    assert (facts["tp"], facts["dp"], facts["padded_vocab"]) == (
      script.TP,
      script.DP,
      script.padded_vocab(),
    )
  assert os.path.getsize(DP_RESHARDABLE / "expected.npz") < 200_000


# --- other layouts: megatron-core <= 0.18 (common.pt), NeMo 2 (module.) ---


def _rewrite_metadata(folder: Path, rename=lambda key: key, drop: tuple[str, ...] = ()) -> None:
  """`folder`'s DCP metadata with keys renamed and entries dropped (torch's own classes)."""
  import dataclasses
  import pickle

  pytest.importorskip("torch")
  with open(folder / ".metadata", "rb") as f:
    meta = pickle.load(f)  # the fixture's own, written by megatron-core
  meta.state_dict_metadata = {
    rename(k): v for k, v in meta.state_dict_metadata.items() if k not in drop
  }
  meta.storage_data = {
    dataclasses.replace(index, fqn=rename(index.fqn)): info
    for index, info in meta.storage_data.items()
    if index.fqn not in drop
  }
  with open(folder / ".metadata", "wb") as f:
    pickle.dump(meta, f)


def test_a_megatron_core_0_18_folder_reads_its_common_state_from_common_pt(tmp_path):
  torch = pytest.importorskip("torch")
  import io

  import torch.distributed.checkpoint as dcp

  root = tmp_path / "run"
  shutil.copytree(DP_RESHARDABLE, root)
  folder = root / "iter_0000002"
  blob = {"common_state/shard_0_1": io.BytesIO()}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
    dcp.load(blob, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
  (common,) = blob["common_state/shard_0_1"]  # megatron's ShardedObject list
  torch.save(common, folder / "common.pt")
  _rewrite_metadata(folder, drop=("common_state/shard_0_1",))
  plan = _registry.describe(root)
  assert plan.step == 2 and plan.optimizer.step == 2
  assert plan.extra["megatron"]["args"]["hidden_size"] == 16
  want = expected(DP_RESHARDABLE.name)
  for p in plan.params:
    assert np.array_equal(whole(p.slots["exp_avg"]), want[f"optimizer.state.exp_avg.{p.name}"])


def test_nemo_2_module_prefixed_keys_read_under_megatrons_names(tmp_path):
  root = tmp_path / "run"
  shutil.copytree(FIXTURES / "adam_bf16", root)

  def nemo(key: str) -> str:
    for slot in ("exp_avg", "exp_avg_sq", "fp32_param"):
      head = f"optimizer.state.{slot}."
      if key.startswith(head):
        return head + "module." + key[len(head) :]
    return key if key.startswith(("optimizer.", "rng_state", "common_state")) else "module." + key

  _rewrite_metadata(root / "iter_0000002", rename=nemo)
  plan = _registry.describe(root)
  want = expected("adam_bf16")
  names = [p.name for p in plan.params]
  assert "decoder.layers.self_attention.linear_qkv.weight" in names and len(names) == 9
  for p in plan.params:
    assert np.array_equal(whole(p.value), want[f"optimizer.state.fp32_param.{p.name}"]), p.name
    assert np.array_equal(
      whole(p.slots["exp_avg_sq"]), want[f"optimizer.state.exp_avg_sq.{p.name}"]
    )


# --- on an object store ---


def test_a_megatron_lm_root_on_an_object_store_reads_as_on_disk(tmp_path):
  from ucp_jax.store import _location

  url = "memory://ucp_megatron_remote/run"
  store = _location.kvstore(_location.resolve(url + "/"))
  for path in DP_RESHARDABLE.rglob("*"):
    if path.is_file() and path.name not in ("expected.npz", "logits.npz", "info.json"):
      store.write(str(path.relative_to(DP_RESHARDABLE)), path.read_bytes()).result()
  remote = _registry.describe(url)
  assert remote.format == "megatron" and remote.step == 2
  want = expected(DP_RESHARDABLE.name)
  for p in remote.params:  # the rebuilt buckets, read by byte ranges
    assert np.array_equal(whole(p.slots["exp_avg"]), want[f"optimizer.state.exp_avg.{p.name}"])
  ucp_jax.convert(url, tmp_path / "u")
  assert ucp_jax.open(tmp_path / "u").step == 2
