"""`ucp_jax.diff` / `ucp diff`: two checkpoints of any formats, array by array."""

import json
import os

import numpy as np
import pytest

import ucp_jax
from ucp_jax import _diff, cli

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
DS = os.path.join(FIXTURES, "deepspeed", "z2_fp32_dp2", "ckpt")


def _save(path, **arrays):
  ucp_jax.save(path, arrays)
  return str(path)


def test_a_deepspeed_folder_and_its_conversion_are_identical(tmp_path):
  ucp_jax.convert(DS, tmp_path / "c")
  report = ucp_jax.diff(DS, tmp_path / "c")
  assert report.identical and report.verdict() == f"identical: {len(report.arrays)} arrays"
  assert len(report.arrays) == len(ucp_jax.open(DS).keys())


def test_values_shapes_dtypes_and_names_that_differ(tmp_path, monkeypatch):
  monkeypatch.setattr(_diff, "_BLOCK_BYTES", 64)  # many blocks per array
  w = np.arange(200, dtype=np.float32).reshape(20, 10)
  a = _save(
    tmp_path / "a", w=w, n=np.array([1.0, np.nan]), s=np.ones(3), d=np.ones(2), x=np.ones(1)
  )
  moved = w.copy()
  moved[17, 3] += 0.5
  b = _save(
    tmp_path / "b",
    w=moved,
    n=np.array([1.0, np.nan]),  # NaN where both have NaN: equal
    s=np.ones(4),
    d=np.ones(2, np.float32),
    y=np.ones(1),
  )
  report = ucp_jax.diff(a, b)
  by_key = {d.key: d for d in report.arrays}
  assert (by_key["w"].max_abs, by_key["w"].mismatched) == (0.5, 1)
  assert by_key["w"].max_rel == pytest.approx(0.5 / 173.5)
  assert by_key["n"].max_abs == 0 and by_key["n"].mismatched == 0
  assert by_key["s"].problem == "shape (3,) vs (4,)"
  assert by_key["d"].problem == "dtype float64 vs float32" and by_key["d"].max_abs == 0
  assert (report.only_a, report.only_b) == (("x",), ("y",))
  assert report.verdict() == f"differ: 1 only in {a}, 1 only in {b}, 3 of 4 common arrays differ"
  assert not ucp_jax.diff(
    a, b, atol=1.0
  ).same_within_tolerance  # names, shapes, dtypes still differ


def test_a_tolerance(tmp_path):
  a = _save(tmp_path / "a", w=np.ones(5))
  b = _save(tmp_path / "b", w=np.ones(5) * (1 + 1e-7))
  assert not ucp_jax.diff(a, b).same_within_tolerance
  report = ucp_jax.diff(a, b, rtol=1e-6)
  assert report.same_within_tolerance and not report.identical
  assert report.verdict().startswith("equal within atol=0, rtol=1e-06: 1 arrays")


def test_a_flax_checkpoint_against_the_torch_folder_it_came_from(tmp_path):
  from flax import nnx

  from ucp_jax.models import gpt

  with open(os.path.join(FIXTURES, "cross_framework", "info.json")) as f:
    info = json.load(f)
  src = os.path.join(FIXTURES, "cross_framework", "ckpt")
  config = gpt.GPTConfig(**info["model"])
  rules = ucp_jax.rules.gpt2(num_heads=config.num_heads)
  model = gpt.FlaxGPT(config, rngs=nnx.Rngs(0))
  params = ucp_jax.restore(src, nnx.state(model, nnx.Param), subtree="params", rules=rules)
  ucp_jax.save(tmp_path / "flax", {"params": params})
  report = ucp_jax.diff(tmp_path / "flax", src, rules=rules)
  assert report.identical, report.verdict()
  assert report.arrays and not report.only_a
  # the DeepSpeed side's Adam moments and step lie outside the parameters: said, not hidden
  assert any(k.startswith("exp_avg/") for k in report.not_compared)
  assert report.verdict().endswith(
    "outside the parameters not compared (optimizer slots, "
    "step, buffers: compare those without rules)"
  )
  unmapped = ucp_jax.diff(tmp_path / "flax", src)
  assert not unmapped.arrays and "compare through a rule set (--rules hf" in unmapped.verdict()


def test_the_command_line(tmp_path, capsys):
  a = _save(tmp_path / "a", w=np.ones(3))
  b = _save(tmp_path / "b", w=np.array([1.0, 2.0, 1.0]))
  assert cli.main(["diff", a, a]) == 0
  assert capsys.readouterr().out.strip().endswith("identical: 1 arrays")
  assert cli.main(["diff", a, b]) == 1
  out = capsys.readouterr().out
  assert "w" in out and out.strip().endswith("differ: 1 of 1 common arrays differ")
  assert cli.main(["diff", a, b, "--atol", "1"]) == 0
  capsys.readouterr()
  assert cli.main(["diff", a, b, "--json"]) == 1
  data = json.loads(capsys.readouterr().out)
  assert data["arrays"][0]["max_abs"] == 1.0 and data["verdict"].startswith("differ")
  assert cli.main(["diff", a, str(tmp_path / "nope")]) == 2
  assert "nope" in capsys.readouterr().err


@pytest.mark.parametrize(
  ("x", "y", "verdict"),
  [
    (np.array([2**53], np.int64), np.array([2**53 + 1], np.int64), "differ"),
    (np.array([2**64 - 1], np.uint64), np.array([2**64 - 2], np.uint64), "differ"),
    (np.array([np.inf]), np.array([np.inf]), "identical"),
    (np.array([1.0]), np.array([np.inf]), "differ"),
    (np.array([1.0]), np.array([np.nan]), "differ"),
    (np.array([np.nan]), np.array([1.0]), "differ"),
    (np.array([complex(np.nan, 1)]), np.array([complex(1, np.nan)]), "differ"),
    (np.array([-0.0]), np.array([0.0]), "equal within"),
  ],
)
def test_verdicts_on_edge_values(tmp_path, x, y, verdict):
  a, b = _save(tmp_path / "a", x=x), _save(tmp_path / "b", x=y)
  for tolerance in ({}, {"atol": 0.5}):
    got = ucp_jax.diff(a, b, **tolerance).verdict()
    assert got.startswith(verdict), (tolerance, got)


def test_a_hugging_face_folder_against_the_training_state_it_became(tmp_path, capsys):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import optax
  from flax import nnx

  from ucp_jax import models, rules

  torch.manual_seed(0)
  config = transformers.LlamaConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
  )
  hf = transformers.LlamaForCausalLM(config)
  hf.save_pretrained(tmp_path / "hf")
  rs, cfg = rules.from_hf(tmp_path / "hf")
  state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
  model = rules.load_into(models.build(cfg, rngs=nnx.Rngs(1)), state, rs)
  ucp_jax.save_train_state(
    tmp_path / "jax", model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  )
  report = ucp_jax.diff(tmp_path / "jax", tmp_path / "hf", rules="hf")  # model/... vs HF names
  assert report.same_within_tolerance and len(report.arrays) == len(rs.map_names(list(state)))
  assert cli.main(["diff", str(tmp_path / "jax"), str(tmp_path / "hf"), "--rules", "hf"]) == 0
  config_file = str(tmp_path / "hf" / "config.json")
  argv = ["diff", str(tmp_path / "jax"), str(tmp_path / "hf"), "--rules", "hf", "--config"]
  assert cli.main([*argv, config_file]) == 0
  assert "identical" in capsys.readouterr().out
