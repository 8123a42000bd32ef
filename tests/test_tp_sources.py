"""TP/PP/EP DeepSpeed checkpoints -> universal: equal to ds_to_universal and to the known state."""

import json
import os

import numpy as np
import pytest

import ucp_jax
from ucp_jax.base._errors import MappingError
from ucp_jax.parallel import _pattern_flat as pf
from ucp_jax.parallel import _pattern_rules as pr
from ucp_jax.parallel import _patterns as pt
from ucp_jax.sources._torch_reader import _torch_file
from ucp_jax.sources.deepspeed import _tp

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "tp")
REAL = ["autotp_tp2_dp1", "autotp_tp2_dp2", "pp2", "pp2_tp2"]


def _convert(name, tmp_path, **kw):
  dst = tmp_path / name
  ucp_jax.convert(os.path.join(FIXTURES, name, "ckpt"), dst, **kw)
  return ucp_jax.open(dst)


def _universal(name):
  """ds_to_universal's output: {param: {state: (array, metadata)}}."""
  zero = os.path.join(FIXTURES, name, "universal", "zero")
  out = {}
  for param in sorted(os.listdir(zero)):
    if param.endswith(".pt"):
      continue
    out[param] = {}
    for f in os.listdir(os.path.join(zero, param)):
      data = _torch_file.load(os.path.join(zero, param, f))
      out[param][f[:-3]] = (data["param"], data) if isinstance(data, dict) else (data, {})
  return out


@pytest.mark.parametrize("name", [*REAL, "megatron_tp2"])
def test_equal_to_ds_to_universal(tmp_path, name):
  ckpt = _convert(name, tmp_path)
  theirs = _universal(name)
  schema = ckpt.manifest.schema
  ours = {n for n, e in schema["params"].items() if e["tied_to"] is None}
  assert ours >= set(theirs)
  for param, states in theirs.items():
    for state, (array, _) in states.items():
      if state == "step":
        assert (
          schema["optimizer"]["groups"][schema["params"][param]["group"]]["step"] == array.item()
        )
        continue
      key = f"{'params' if state == 'fp32' else state}/{param}"
      np.testing.assert_array_equal(ckpt.read(key), array, err_msg=key)


def test_autotp_patterns_recorded(tmp_path):
  schema = _convert("autotp_tp2_dp2", tmp_path).manifest.schema
  got = {n: e["pattern"] for n, e in schema["params"].items()}
  assert got["layers.0.self_attn.qkv_proj.weight"] == {
    "kind": "sub_params",
    "cat_dim": 0,
    "sub_params": [16, 8, 8],
    "shard_widths": [[8, 8], [4, 4], [4, 4]],
  }
  assert got["layers.0.mlp.gate_up_proj.weight"]["sub_params"] == [24, 24]
  assert got["layers.1.self_attn.o_proj.weight"] == {"kind": "row", "cat_dim": 1}
  assert got["lm_head.weight"] == {"kind": "column", "cat_dim": 0, "vocab_size": 51}
  assert got["norm.weight"] == {"kind": "replicated"}
  assert schema["extra"]["source_layout"]["tp"] == 2
  assert schema["extra"]["source_layout"]["dp"] == 2


def test_pipeline_names_and_tied_embedding(tmp_path):
  for name in ("pp2", "pp2_tp2"):
    ckpt = _convert(name, tmp_path)
    params = ckpt.manifest.schema["params"]
    assert "tied_modules.embed.embed.weight" in params
    assert ckpt["params/3.down.weight"].shape == (8, 12)  # stage 1, row-parallel under TP
    assert ckpt["params/4.weight"].shape == (8,)  # stage 1, replicated
    assert ckpt.manifest.schema["extra"]["source_layout"]["pp"] == 2


def test_megatron_against_the_known_state(tmp_path):
  import make_megatron_fixtures as meg

  ckpt = _convert("megatron_tp2", tmp_path)
  state, grads = meg.logical_state(), meg.logical_grads()
  averaged = meg.average_copies()
  b1, b2 = meg.BETAS
  for name, x in state.items():
    got = ckpt.read(f"params/{name}")
    if name in averaged:
      np.testing.assert_allclose(got, x, atol=1e-6)
      np.testing.assert_array_equal(got, (averaged[name][0] + averaged[name][1]) / 2)
    else:
      np.testing.assert_array_equal(got, x, err_msg=name)
    if meg.MOE in name:
      continue  # experts: values only
    np.testing.assert_array_equal(ckpt.read(f"exp_avg/{name}"), np.float32(1 - b1) * grads[name])
    np.testing.assert_allclose(
      ckpt.read(f"exp_avg_sq/{name}"), np.float32(1 - b2) * grads[name] ** 2, rtol=1e-6
    )
  params = ckpt.manifest.schema["params"]
  emb = "language_model.embedding.word_embeddings.weight"
  assert params[emb]["pattern"] == {"kind": "column", "cat_dim": 0, "vocab_size": 50}
  assert ckpt[f"params/{emb}"].shape == (50, 16)
  qkv = params[f"{meg.PREFIX}.0.self_attention.query_key_value.weight"]["pattern"]
  assert qkv == {"kind": "sub_params", "cat_dim": 0, "sub_params": [16, 8, 8]}
  assert params[f"{meg.PREFIX}.0.mlp.dense_h_to_4h.weight"]["pattern"]["sub_params"] == [24, 24]
  assert params[f"{meg.PREFIX}.1.self_attention.dense.bias"]["pattern"] == {"kind": "average"}
  experts = params[f"{meg.PREFIX}.1.{meg.MOE}.dense_h_to_4h.weight"]["pattern"]
  assert experts == {"kind": "expert", "cat_dim": 0, "num_experts": 4}


def test_user_rules_override_and_unused_rules_are_errors(tmp_path):
  ckpt = _convert("autotp_tp2_dp1", tmp_path, patterns=[(r"norm\.weight$", "average")])
  assert ckpt.manifest.schema["params"]["norm.weight"]["pattern"] == {"kind": "average"}
  with pytest.raises(MappingError, match=r"'nothing\\\\\.here' \(user rule\) matches no parameter"):
    _convert("autotp_tp2_dp1", tmp_path / "x", patterns=[(r"nothing\.here", "row")])


def test_without_universal_info_every_parameter_needs_a_rule(tmp_path, monkeypatch):
  monkeypatch.setattr(_tp, "union_info", lambda infos: {})
  with pytest.raises(MappingError) as e:
    _convert("autotp_tp2_dp1", tmp_path)
  text = str(e.value)
  assert "parameters no rule claims:" in text
  assert "  layers.1.mlp.down_proj.weight" in text and "  norm.bias" in text


def test_ds_to_universal_misreads_autotp_pipelines_without_merged_info():
  # Recorded by scripts/make_tp_fixtures.py: each stage lists only its own parameters, and
  # ds_to_universal reads the first file's; our reader takes the union over all files.
  with open(os.path.join(FIXTURES, "pp2_tp2", "info.json")) as f:
    info = json.load(f)
  stages = info["per_stage_universal_checkpoint_info"]
  first = set(stages[0]["tp_replicated_parameter_patterns"])
  assert r"^4\.weight$" not in first
  union = _tp.union_info(stages)
  assert r"^4\.weight$" in union["tp_replicated_parameter_patterns"]
  assert pr.classify(["4.weight"], info=union) == {"4.weight": pt.replicated()}


def test_tied_copies_that_diverge_are_reported(tmp_path, monkeypatch):
  real = pf.merge_flat

  def skewed(shards, shapes, pattern, **kw):
    out = real(shards, shapes, pattern, **kw)
    if kw.get("name") == "tied_modules.embed.embed.weight":
      skewed.calls += 1
      if skewed.calls == 2:  # stage 1's value
        out = (pf.whole(out, shapes[0]) if isinstance(out, list) else out) + np.float32(1e-3)
    return out

  skewed.calls = 0
  monkeypatch.setattr(pf, "merge_flat", skewed)
  with pytest.raises(
    Exception,
    match=r"(?s)tied_modules\.embed\.embed\.weight.*max \|difference\| 0\.001.*stages \[0, 1\]",
  ):
    _convert("pp2", tmp_path)
