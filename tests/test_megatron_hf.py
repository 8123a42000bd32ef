"""A Megatron GPT under Hugging Face Llama's names: transformers and a Flax Llama give its logits.

The fixtures (tests/fixtures/megatron_core) hold Megatron's own logits for fixed tokens at the
saved step (`logits.npz`, gathered over TP by the fixture script). The Megatron run is read
with `names="hf"` (`ucp convert ROOT DST --option names=hf`), written as a Hugging Face folder,
and loaded by `from_pretrained`; and restored into `ucp_jax.models`' Flax Llama on a 2 x 4 mesh
through the ready Hugging Face rule set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import ucp_jax
from ucp_jax import models, rules
from ucp_jax.base._errors import InvalidArgumentError, SourceFormatError
from ucp_jax.sources import _registry

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_core"
FP32 = ["adam", "distopt_dp_reshardable"]  # bf16 runs compute their logits in bf16


def whole(tensor) -> np.ndarray:
  return np.concatenate([np.asarray(p).reshape(-1) for p in tensor.pieces()]).reshape(tensor.shape)


def megatron_logits(variant: str) -> tuple[np.ndarray, np.ndarray]:
  with np.load(FIXTURES / variant / "logits.npz") as data:
    return data["tokens"], data["logits"][..., :60]  # the padded vocabulary's real rows


@pytest.mark.parametrize("variant", ["distopt_dp_reshardable", "adam_bf16"])
def test_hf_names_are_views_of_megatrons_rows(variant):
  with np.load(FIXTURES / variant / "expected.npz") as data:
    want = dict(data)
  plan = _registry.describe(FIXTURES / variant, names="hf")
  params = {p.name: p for p in plan.params}
  assert len(params) == 3 + 2 * 9 and plan.source["config"]["num_key_value_heads"] == 2
  master = "optimizer.state.{}.{}".format
  value = "fp32_param" if variant == "adam_bf16" else "param"
  for slot in (value, "exp_avg_sq"):
    qkv = want[master(slot, "decoder.layers.self_attention.linear_qkv.weight")]
    groups = qkv[1].reshape(2, 4 * 4, 16)  # layer 1: 2 groups of [2 q heads; k; v] x head_dim 4

    def got(name: str, slot: str = slot) -> np.ndarray:
      return whole(params[name].value if slot == value else params[name].slots[slot])

    assert np.array_equal(
      got("model.layers.1.self_attn.q_proj.weight"), groups[:, :8].reshape(16, 16)
    )
    assert np.array_equal(
      got("model.layers.1.self_attn.k_proj.weight"), groups[:, 8:12].reshape(8, 16)
    )
    assert np.array_equal(
      got("model.layers.1.self_attn.v_proj.weight"), groups[:, 12:].reshape(8, 16)
    )
    fc1 = want[master(slot, "decoder.layers.mlp.linear_fc1.weight")][0]
    assert np.array_equal(got("model.layers.0.mlp.gate_proj.weight"), fc1[:24])
    assert np.array_equal(got("model.layers.0.mlp.up_proj.weight"), fc1[24:])
    embedding = want[master(slot, "embedding.word_embeddings.weight")]
    assert np.array_equal(got("model.embed_tokens.weight"), embedding[:60])  # 4 padded rows off
    norm = want[master(slot, "decoder.layers.mlp.linear_fc1.layer_norm_weight")][1]
    assert np.array_equal(got("model.layers.1.post_attention_layernorm.weight"), norm)
  assert params["model.norm.weight"].group == 1 and params["lm_head.weight"].group == 0


@pytest.mark.parametrize("variant", FP32)
def test_transformers_gives_megatrons_logits(tmp_path, variant):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  done = subprocess.run(
    [sys.executable, "-m", "ucp_jax.cli", "convert", str(FIXTURES / variant), str(tmp_path / "u"),
     "--option", "names=hf"],
    capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert done.returncode == 0, done.stderr
  ucp_jax.export(tmp_path / "u", tmp_path / "hf", format="hf")
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert config["model_type"] == "llama" and config["vocab_size"] == 60
  model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
  tokens, want = megatron_logits(variant)
  with torch.no_grad():
    got = model(torch.from_numpy(tokens)).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_a_flax_llama_on_a_2x4_mesh_gives_megatrons_logits(tmp_path, devices):
  variant = "distopt_dp_reshardable"
  ucp_jax.convert(FIXTURES / variant, tmp_path / "u", names="hf")
  rs, cfg = rules.from_hf(tmp_path / "u")  # the config.json the view recorded
  mesh = jax.make_mesh((2, 4), ("data", "model"), devices=devices)
  model = rules.load_into(models.build(cfg, mesh=mesh, abstract=True), tmp_path / "u", rs)
  kernel = model.layers[0].attn.q.kernel[...]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("data", "model")
  tokens, want = megatron_logits(variant)
  got = np.asarray(model(jax.numpy.asarray(tokens)))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_a_model_that_is_not_llama_style_is_refused_naming_what_differs(monkeypatch):
  from ucp_jax.sources.megatron import _folders

  real = _folders.record_fields
  monkeypatch.setattr(
    _folders, "record_fields", lambda v: {**real(v), "swiglu": False, "add_bias_linear": True}
  )
  with pytest.raises(
    SourceFormatError,
    match=r"not read under Hugging Face Llama names: "
    r"swiglu False \(Llama: True\); add_bias_linear True",
  ):
    _registry.describe(FIXTURES / "adam", names="hf")
  with pytest.raises(InvalidArgumentError, match="names='flax'"):
    _registry.describe(FIXTURES / "adam", names="flax")


# --- the way back: Hugging Face names laid out as Megatron's GPT ---


def test_hf_names_go_back_to_megatrons_layout_bit_for_bit(tmp_path):
  pytest.importorskip("torch")
  source = FIXTURES / "distopt_dp_reshardable"
  ucp_jax.convert(source, tmp_path / "u", names="hf")
  report = ucp_jax.export(tmp_path / "u", tmp_path / "back", format="megatron", vocab_multiple=32)
  assert "vocabulary padded to 64 rows (a multiple of 32)" in " ".join(report.notes)
  before = {p.name: p for p in _registry.describe(source).params}
  after = _registry.describe(tmp_path / "back")
  assert sorted(before) == sorted(p.name for p in after.params)
  for p in after.params:
    for kind in ("value", "exp_avg", "exp_avg_sq"):
      got = whole(p.value if kind == "value" else p.slots[kind])
      want = whole(before[p.name].value if kind == "value" else before[p.name].slots[kind])
      if p.name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        got, want = got[:60], want[:60]  # Megatron's padded rows: zeros after the trip
      assert np.array_equal(got, want), (p.name, kind)
    assert p.group == before[p.name].group
  assert [g.values["weight_decay"] for g in after.optimizer.groups] == [0.1, 0.0]
  assert after.extra["megatron"]["args"]["num_query_groups"] == 2


def _tiny_llama(tmp_path: Path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config = transformers.LlamaConfig(
    vocab_size=60, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
  )  # fmt: skip
  torch.manual_seed(3)
  model = transformers.LlamaForCausalLM(config).eval()
  model.save_pretrained(tmp_path / "hf")
  return torch, model


def test_a_transformers_llama_goes_to_megatron_and_back(tmp_path):
  _, model = _tiny_llama(tmp_path)
  ucp_jax.export(tmp_path / "hf", tmp_path / "run", format="megatron", vocab_multiple=32)
  back = _registry.describe(tmp_path / "run", names="hf")
  state = model.state_dict()
  for p in back.params:
    assert np.array_equal(whole(p.value), state[p.name].numpy()), p.name
  assert back.optimizer is None


@pytest.mark.slow
@pytest.mark.skipif(
  importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)
def test_megatron_runs_a_transformers_llama_with_its_logits(tmp_path):
  torch, model = _tiny_llama(tmp_path)
  ucp_jax.export(tmp_path / "hf", tmp_path / "run", format="megatron", vocab_multiple=32)
  support = Path(__file__).parent / "support"
  scripts = Path(__file__).parents[1] / "scripts"
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(scripts), str(support)])}
  (tmp_path / "out").mkdir()
  done = subprocess.run(
    [sys.executable, str(support / "megatron_load_worker.py"), str(tmp_path / "run"),
     str(tmp_path / "out"), "1", "1", "0", "--weights-only"],
    capture_output=True, text=True, timeout=900, env=env,
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-4000:]
  with np.load(tmp_path / "out" / "logits.npz") as data:
    tokens, megatron = data["tokens"], data["logits"][..., :60]
  with torch.no_grad():
    hf = model(torch.from_numpy(tokens)).logits.numpy()
  np.testing.assert_allclose(megatron, hf, atol=1e-5, rtol=0)


# --- a Megatron run trains on in JAX ---


def test_a_megatron_run_trains_on_in_jax_on_a_2x4_mesh_with_megatrons_losses(tmp_path, devices):
  """TP 2 x DP 2 Megatron (dp_reshardable) -> HF names, padded vocabulary kept -> a Flax Llama
  and masked optax.adamw on 2 x 4, Megatron's cosine schedule, restored with the moments and
  step -> the next two losses of the uninterrupted Megatron run (DP rank 0's), within 1e-5."""
  pytest.importorskip("torch")  # the fixture script draws its batches with torch
  import math

  import jax.numpy as jnp
  import make_megatron_core_fixtures as fx
  import optax
  from flax import nnx

  variant = "distopt_dp_reshardable"
  ucp_jax.convert(FIXTURES / variant, tmp_path / "u", names="hf", padded_vocab=True)
  rs, cfg = rules.from_hf(tmp_path / "u")
  assert cfg.vocab_size == 64  # Megatron's softmax spans the padded rows
  mesh = jax.make_mesh((2, 4), ("data", "model"), devices=devices)
  model = models.build(cfg, mesh=mesh, rngs=nnx.Rngs(0))
  top, bottom, warmup, decay = fx.LR, fx.LR / 10, 1, 10  # Megatron's OptimizerParamScheduler

  def cosine(count):
    return bottom + 0.5 * (jnp.cos(jnp.pi * (count - warmup) / (decay - warmup)) + 1) * (
      top - bottom
    )

  assert math.isclose(float(cosine(2)), 0.00972861679353659, rel_tol=1e-6)  # the saved lr
  decays = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)  # noqa: E731  (not norms)
  tx = optax.adamw(cosine, b1=fx.BETAS[0], b2=fx.BETAS[1], eps=fx.EPS,
                   weight_decay=fx.WEIGHT_DECAY, mask=decays)  # fmt: skip
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  ucp_jax.restore_train_state(tmp_path / "u", model, optimizer, rules=rs)

  @nnx.jit
  def step(model, optimizer, tokens):
    def loss(m):  # the fixtures' loss: each position labelled with its own token
      per_token = optax.softmax_cross_entropy_with_integer_labels(m(tokens), tokens)
      return per_token.mean(), per_token[:2].mean()  # the global mean; DP rank 0's rows

    (_, rank0), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    optimizer.update(model, grads)
    return rank0

  batches = [fx.batches(rank, fx.ITERATION + fx.CONTINUED) for rank in range(fx.DP)]
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  losses = []
  for i in range(fx.ITERATION, fx.ITERATION + fx.CONTINUED):
    tokens = np.concatenate([batches[rank][i].numpy() for rank in range(fx.DP)])
    losses.append(float(step(model, optimizer, jax.device_put(tokens.astype(np.int32), rows))))
  want = json.loads((FIXTURES / variant / "info.json").read_text())["continued_losses"]
  np.testing.assert_allclose(losses, want, rtol=1e-5)
