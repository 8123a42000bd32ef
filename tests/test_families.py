"""Every Hugging Face family, proven against `transformers` on a sharded mesh.

Each family's tiny random model is built from a `config.json` (written to disk and read by
`AutoConfig.from_pretrained`, as a user's folder is), its weights pushed off their init;
`rules.from_hf` reads the same file, and `rules.check_forward` compares the logits of the
Flax model, abstract and sharded over a 2 x 4 mesh of Explicit axes (`jax.make_mesh`'s
default) and, with stacked layers, over a 4 x 2 mesh of Auto axes. Two lengths: 12 steps
(longer than the sliding windows, longer than the short contexts of dynamic, yarn and
longrope RoPE) and 6.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hf_tiny
import jax
import numpy as np
import pytest
from _continuity import next_token_step
from jax.sharding import AxisType

import ucp_jax
from ucp_jax import models, rules

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SIZES = dict(hf_tiny.SIZES, num_hidden_layers=3, pad_token_id=0)
NEOX = dict(SIZES, num_hidden_layers=2)
del NEOX["num_key_value_heads"]
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0]}
CASES = {
  "gemma2": dict(
    SIZES,
    model_type="gemma2",
    num_key_value_heads=1,
    head_dim=16,
    sliding_window=4,
    query_pre_attn_scalar=12,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=3.0,
  ),
  "gemma3_text": dict(
    SIZES,
    model_type="gemma3_text",
    head_dim=16,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    final_logit_softcapping=3.0,
    rope_parameters={
      "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
  ),
  "phi3": dict(
    SIZES,
    model_type="phi3",
    max_position_embeddings=32,
    original_max_position_embeddings=8,
    rope_parameters={**LONGROPE, "rope_theta": 1e4, "partial_rotary_factor": 0.5},
  ),
  "olmo2": dict(SIZES, model_type="olmo2", attention_bias=True),
  "gpt_neox": dict(NEOX, model_type="gpt_neox", rotary_pct=0.5, rotary_emb_base=500.0),
  "gpt_neox_sequential_tied": dict(
    NEOX, model_type="gpt_neox", use_parallel_residual=False, tie_word_embeddings=True
  ),
  "qwen2_mixed_windows": dict(
    SIZES, model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1
  ),
  "qwen3_mixed_windows": dict(
    SIZES,
    model_type="qwen3",
    head_dim=16,
    use_sliding_window=True,
    sliding_window=4,
    layer_types=["full_attention", "sliding_attention", "full_attention"],
  ),
  "llama_yarn": dict(
    SIZES,
    model_type="llama",
    max_position_embeddings=32,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
  ),
  "llama_dynamic": dict(
    SIZES,
    model_type="llama",
    max_position_embeddings=8,
    rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
  ),
  "mistral_longrope": dict(
    SIZES,
    model_type="mistral",
    sliding_window=None,
    max_position_embeddings=32,
    rope_parameters={
      "rope_type": "longrope",
      "short_factor": [1.0, 1.2, 1.5, 2.0],
      "long_factor": [2.0, 3.0, 4.0, 6.0],
      "original_max_position_embeddings": 8,
      "rope_theta": 1e4,
    },
  ),
  "gemma_gelu": dict(SIZES, model_type="gemma", head_dim=16, hidden_act="gelu"),
}
"""Tiny configs as `config.json`s hold them: the issue's families, the RoPE types, the mixed
windows, and Google's Gemma releases' `hidden_act: "gelu"` (transformers' tanh GELU)."""

LEGACY = {
  "llama_rope_scaling_type": dict(
    SIZES,
    model_type="llama",
    rope_theta=5e4,
    rope_scaling={"type": "linear", "factor": 2.0},
  ),
  "llama_rope_scaling_wins_over_rope_parameters": dict(
    SIZES,
    model_type="llama",
    max_position_embeddings=32,
    rope_scaling={"rope_type": "yarn", "factor": 2.0, "beta_fast": 8, "truncate": False},
    rope_parameters={"rope_type": "linear", "factor": 8.0},
    original_max_position_embeddings=8,  # top level: wins over the dict's for yarn
  ),
  "gemma3_legacy_rope_and_pattern": dict(
    SIZES,
    model_type="gemma3_text",
    head_dim=16,
    sliding_window=3,
    sliding_window_pattern=2,
    rope_theta=5e5,
    rope_local_base_freq=100.0,
    rope_scaling={"rope_type": "linear", "factor": 4.0},
  ),
  "gemma2_hidden_activation_not_hidden_act": dict(
    SIZES,
    model_type="gemma2",
    head_dim=16,
    sliding_window=4,
    hidden_act="silu",  # unread by Gemma 2
    hidden_activation="gelu",  # exact GELU: Gemma 2 does not remap it
    layer_types=["attention", "sliding_attention", "attention"],  # the legacy name
  ),
  "phi3_su_is_longrope": dict(
    SIZES,
    model_type="phi3",
    max_position_embeddings=32,
    original_max_position_embeddings=8,
    partial_rotary_factor=0.5,
    rope_scaling={**LONGROPE, "type": "su"},
  ),
  "gpt_neox_rope_parameters": dict(
    NEOX,
    model_type="gpt_neox",
    rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0},
    rotary_pct=0.5,
  ),
  "mistral_null_window": dict(SIZES, model_type="mistral", sliding_window=None),
}
"""Older spellings, each read as transformers 5 reads it (the file's, not a resaved one's)."""

TOKENS = np.random.default_rng(1).integers(0, 96, (2, 12))


def hf_model(config: dict, folder):
  """The `transformers` model of `config`, as from_pretrained would configure it; its
  weights larger and its norms and biases off their init."""
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(config))
  hf_config = transformers.AutoConfig.from_pretrained(folder)
  torch.manual_seed(0)
  return hf_tiny.off_init(transformers.AutoModelForCausalLM.from_config(hf_config))


def _meshes():
  explicit = jax.make_mesh((2, 4), ("data", "model"))
  auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  return ((explicit, False), (auto, True))


@pytest.mark.parametrize("name", CASES)
def test_each_family_gives_the_transformers_logits_on_a_sharded_mesh(devices, tmp_path, name):
  hf = hf_model(CASES[name], tmp_path / "hf")
  for mesh, stacked in _meshes():
    rs, cfg = rules.from_hf(tmp_path / "hf" / "config.json", stacked=stacked)
    model = models.build(cfg, mesh=mesh, abstract=True, scan=stacked)
    for tokens in (TOKENS, TOKENS[:, :6]):
      assert rules.check_forward(hf, model, rs, tokens) < 1e-5


@pytest.mark.parametrize("name", LEGACY)
def test_legacy_spellings_compute_what_transformers_computes(devices, tmp_path, name):
  hf = hf_model(LEGACY[name], tmp_path / "hf")
  rs, cfg = rules.from_hf(tmp_path / "hf" / "config.json")
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  assert rules.check_forward(hf, models.build(cfg, mesh=mesh, abstract=True), rs, TOKENS) < 1e-5


def test_what_the_legacy_spellings_read():
  def read(config: dict):
    return rules.from_hf(config)[1]

  assert read(LEGACY["llama_rope_scaling_type"]).rope_theta == 5e4
  yarn = dict(read(LEGACY["llama_rope_scaling_wins_over_rope_parameters"]).rope_scaling)
  assert (yarn["rope_type"], yarn["original_max_position_embeddings"]) == ("yarn", 8)
  assert (yarn["beta_fast"], yarn["beta_slow"], yarn["truncate"]) == (8.0, 1.0, False)
  gemma3 = read(LEGACY["gemma3_legacy_rope_and_pattern"])
  assert (gemma3.rope_theta, gemma3.local_rope_theta) == (5e5, 100.0)
  assert gemma3.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
  assert read(LEGACY["gemma2_hidden_activation_not_hidden_act"]).act == "gelu"
  assert read(CASES["gemma_gelu"]).act == "gelu_tanh"
  assert dict(read(LEGACY["phi3_su_is_longrope"]).rope_scaling)["rope_type"] == "longrope"
  neox = read(LEGACY["gpt_neox_rope_parameters"])
  assert (neox.rope_theta, neox.partial_rotary) == (100.0, 0.5)
  assert read(dict(NEOX, model_type="gpt_neox")).partial_rotary == 0.25  # rotary_pct's default
  assert read(LEGACY["mistral_null_window"]).sliding_window is None  # null: no window
  assert read(dict(SIZES, model_type="mistral")).sliding_window == 4096  # absent: the default
  absent = {k: v for k, v in SIZES.items() if k != "num_key_value_heads"}
  absent |= {"num_attention_heads": 32, "hidden_size": 256}
  assert read(dict(absent, model_type="mistral")).num_kv_heads == 8  # MistralConfig's default
  assert read(dict(absent, model_type="qwen2")).num_kv_heads == 32  # Qwen2Config's
  assert read(dict(absent, model_type="llama")).num_kv_heads == 32  # None: one per query head
  assert read(dict(absent, model_type="qwen2", num_key_value_heads=None)).num_kv_heads == 32
  with pytest.raises(ucp_jax.MappingError, match="`num_key_value_heads` 32 does not divide 4"):
    read({k: v for k, v in SIZES.items() if k != "num_key_value_heads"} | {"model_type": "qwen2"})


def test_gemma_with_hidden_act_gelu_runs_the_tanh_gelu(devices, tmp_path):
  import dataclasses

  hf = hf_model(CASES["gemma_gelu"], tmp_path / "hf")
  rs, cfg = rules.from_hf(tmp_path / "hf")
  assert rules.check_forward(hf, models.build(cfg, abstract=True), rs, TOKENS) < 1e-5
  exact = models.build(dataclasses.replace(cfg, act="gelu"), abstract=True)
  with pytest.raises(ucp_jax.MappingError, match="outputs differ"):
    rules.check_forward(hf, exact, rs, TOKENS)  # what from_hf read before: silently wrong


TRAINED = ["gemma2", "gemma3_text", "phi3", "olmo2", "gpt_neox", "qwen2_mixed_windows"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_a_sharded_optax_step_exports_to_a_folder_from_pretrained_loads(devices, tmp_path, name):
  """From a saved folder onto a sharded Explicit mesh (each device reading its slice), one
  optax step, `ucp export --format hf`, and `from_pretrained` with transformers' defaults
  computes the trained Flax model's logits."""
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from ucp_jax import cli

  hf_model(CASES[name], tmp_path / "hf").save_pretrained(tmp_path / "hf")
  rs, cfg = rules.from_hf(tmp_path / "hf")
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  model = rules.load_into(models.build(cfg, mesh=mesh, abstract=True), tmp_path / "hf", rs)
  before = np.asarray(model.embed.embedding[...]).copy()
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  tokens = jax.device_put(jnp.asarray(TOKENS), NamedSharding(mesh, P("data")))
  next_token_step()(model, opt, tokens)
  assert not np.array_equal(np.asarray(model.embed.embedding[...]), before)
  want = np.asarray(model(TOKENS))
  ucp_jax.save_train_state(tmp_path / "jax", model, opt)
  argv = ["export", str(tmp_path / "jax"), str(tmp_path / "out"), "--format", "hf"]
  assert cli.main([*argv, "--rules", "hf", "--config", str(tmp_path / "hf")]) == 0
  assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  with torch.no_grad():
    got = back(torch.from_numpy(TOKENS)).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
