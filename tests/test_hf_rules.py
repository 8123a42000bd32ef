"""Rule sets for `transformers` models: HF state dict -> Flax model -> the torch model's logits.

Real `transformers` models from tiny random configs (no download): GPT-2, Llama (biases,
Llama 3 RoPE), Mistral (a sliding window shorter than the batch), Qwen2 (q/k/v biases,
tied), Qwen3 (q/k norms, head_dim != d / heads) and Gemma (`1 + weight` norms, scaled
embeddings, GELU, one key/value head). `rules.check_forward` proves each set by outputs,
and catches the wrong layouts (and configs) that shapes cannot.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_tiny import SIZES, off_init
from jax.sharding import AxisType, NamedSharding

import ucp_jax
from ucp_jax import _rule_specs, cli, models, rules
from ucp_jax.models import llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {
  "rope_type": "llama3",
  "rope_theta": 500000.0,
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 8,
}
CASES = {
  "gpt2": (
    "GPT2LMHeadModel",
    "GPT2Config",
    dict(
      vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    ),
  ),
  "llama": (
    "LlamaForCausalLM",
    "LlamaConfig",
    dict(SIZES, rms_norm_eps=1e-5, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE),
  ),
  "mistral": ("MistralForCausalLM", "MistralConfig", dict(SIZES, sliding_window=4)),
  "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(SIZES, tie_word_embeddings=True)),
  "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(SIZES, head_dim=16)),
  "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(SIZES, num_key_value_heads=1, head_dim=16)),
}
TOKENS = np.random.default_rng(1).integers(0, 96, (2, 12))


def _hf_model(name: str):
  """A tiny random model, its weights larger and its norms and biases off their init."""
  model_class, config_class, kwargs = CASES[name]
  torch.manual_seed(0)
  return off_init(getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs)))


def _state_dict(model) -> dict[str, np.ndarray]:
  return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _abstract(cfg, stacked: bool = False):
  return nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0), scan=stacked))


def _replace(rule_set: rules.RuleSet, suffix: str, **changes) -> rules.RuleSet:
  out = [
    dataclasses.replace(r, **changes) if r.source.endswith(suffix) else r for r in rule_set.rules
  ]
  return rules.RuleSet(out)


@pytest.mark.parametrize("stacked", [False, True], ids=["layers", "scan"])
@pytest.mark.parametrize("name", CASES)
def test_hf_state_dict_gives_the_torch_logits_in_flax(name, stacked):
  hf = _hf_model(name)
  rs, cfg = rules.from_hf(hf, stacked=stacked)
  diff = rules.check_forward(hf, _abstract(cfg, stacked), rs, TOKENS)
  print(f"{name} ({'scan' if stacked else 'layers'}): max |flax - torch| = {diff:.2e}")
  assert diff < 1e-5


@pytest.mark.parametrize("name", ["gpt2", "qwen2", "gemma"])
def test_flax_parameters_export_back_to_a_state_dict_transformers_loads(name):
  hf = _hf_model(name)
  sd = _state_dict(hf)
  rs, cfg = rules.from_hf(hf)
  model = rules.load_into(models.build(cfg, rngs=nnx.Rngs(1)), hf.state_dict(), rs)
  back = rs.export_arrays(nnx.state(model, nnx.Param))
  assert sorted(back) == sorted(sd)  # the tied lm_head.weight written back from the embedding
  for key, value in sd.items():
    assert back[key].tobytes() == value.tobytes(), key  # bit for bit
  again = _hf_model(name)
  with torch.no_grad():
    again.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in back.items()}, strict=True)
    np.testing.assert_array_equal(
      again(torch.from_numpy(TOKENS)).logits.numpy(), hf(torch.from_numpy(TOKENS)).logits.numpy()
    )


def test_from_hf_reads_a_saved_folder_and_its_names(tmp_path):
  hf = _hf_model("qwen2")
  hf.save_pretrained(tmp_path / "qwen2")
  rs, cfg = rules.from_hf(tmp_path / "qwen2")
  assert (rs, cfg) == rules.from_hf(hf) == rules.from_hf(hf.config.to_dict())
  assert rules.from_hf(tmp_path / "qwen2" / "config.json") == (rs, cfg)
  assert (cfg.qkv_bias, cfg.o_bias, cfg.tie_embeddings, cfg.eps) == (True, False, True, 1e-6)

  from safetensors.numpy import load_file  # what save_pretrained wrote: no lm_head.weight

  arrays = load_file(tmp_path / "qwen2" / "model.safetensors")
  assert "lm_head.weight" not in arrays
  model = rules.load_into(models.build(cfg, rngs=nnx.Rngs(1)), arrays, rs)
  with torch.no_grad():
    expected = hf(torch.from_numpy(TOKENS)).logits.numpy()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), expected, atol=1e-5)


def test_the_base_models_names_and_old_buffers_map_too():
  gpt2 = _hf_model("gpt2")
  bare = [*gpt2.transformer.state_dict(), "h.0.attn.bias", "h.1.attn.masked_bias"]
  rs, cfg = rules.from_hf(gpt2.transformer)  # a GPT2Model: names without `transformer.`
  flax_keys = ["/".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(_abstract(cfg)))]
  assert sorted(rs.map_names(bare)) == sorted(flax_keys)
  config = dict(gpt2.config.to_dict(), architectures=["GPT2Model"])
  assert rules.from_hf(config)[0] == rs
  assert rules.from_hf(dict(config, architectures=["GPT2LMHeadModel"]))[0] != rs

  names = ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.norm.weight"]
  assert rules.hf_llama(num_heads=4, num_kv_heads=2).map_names(names) == {
    "norm/scale": ("model.norm.weight",)
  }


def test_check_forward_catches_a_conv1d_read_as_a_linear():
  hf = _hf_model("gpt2")
  rs, cfg = rules.from_hf(hf)
  # attn.c_proj.weight is square: a Linear's transpose fits every shape check
  wrong = _replace(
    rs, r"attn\.c_proj\.weight", transforms=(rules.transpose(), rules.split(0, (4, -1)))
  )
  rules.load_into(models.build(cfg, rngs=nnx.Rngs(1)), hf.state_dict(), wrong)  # loads fine
  with pytest.raises(ucp_jax.MappingError) as e:
    rules.check_forward(hf, _abstract(cfg), wrong, TOKENS)
  assert re.fullmatch(
    r"outputs differ beyond atol=1e-05 \+ rtol=1e-05 \* \|torch\| in \d+ of 2304 values: the "
    r"largest \|flax - torch\| is \S+ at \[\d, \d+, \d+\] \(flax \S+, torch \S+\); the first "
    r"position that differs is 0\. The rules or the model config do not match the torch model: "
    r"a layout the shapes allow \(a Conv1D weight, \[in, out\], read as a Linear one, \[out, in\], "
    r"or the reverse; .*",
    str(e.value),
  ), str(e.value)


def test_check_forward_catches_swapped_norms_and_configs_that_differ():
  hf = _hf_model("llama")
  rs, cfg = rules.from_hf(hf)
  swapped = _replace(rs, r"input_layernorm\.weight", target="layers/{0}/mlp_norm/scale")
  swapped = _replace(
    swapped, r"post_attention_layernorm\.weight", target="layers/{0}/attn_norm/scale"
  )
  with pytest.raises(ucp_jax.MappingError, match="the first position that differs is 0"):
    rules.check_forward(hf, _abstract(cfg), swapped, TOKENS)
  plain_rope = dataclasses.replace(cfg, rope_scaling=None)  # Llama 3's RoPE scaling left out
  with pytest.raises(ucp_jax.MappingError, match="the first position that differs is 1"):
    rules.check_forward(hf, _abstract(plain_rope), rs, TOKENS)

  mistral = _hf_model("mistral")
  rs, cfg = rules.from_hf(mistral)
  assert cfg.sliding_window == 4  # the first 4 positions see no difference without it
  with pytest.raises(ucp_jax.MappingError, match="the first position that differs is 4"):
    rules.check_forward(
      mistral, _abstract(dataclasses.replace(cfg, sliding_window=None)), rs, TOKENS
    )

  gemma = _hf_model("gemma")
  rs, cfg = rules.from_hf(gemma)
  with pytest.raises(ucp_jax.MappingError, match="outputs differ"):
    rules.check_forward(gemma, _abstract(dataclasses.replace(cfg, norm_offset=0.0)), rs, TOKENS)


def test_from_hf_refuses_what_the_reference_models_do_not_compute(tmp_path):
  bad = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "hidden_act": "xielu",
    "rms_norm_eps": None,
    "rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4},
  }
  with pytest.raises(ucp_jax.MappingError) as e:
    rules.from_hf(bad)
  assert str(e.value) == (
    "config.json (llama): the reference Flax model cannot run it: "
    "`rms_norm_eps`: null is not a positive number; "
    "`hidden_act`: 'xielu' is not one of silu, swish, gelu_new, gelu_pytorch_tanh, "
    "gelu_python_tanh, gelu_fast, gelu_accurate, gelu, gelu_python, quick_gelu, relu, relu2, "
    "relu6, tanh, sigmoid; "
    "rope_type 'mrope': supported are default, linear, llama3, dynamic, yarn, longrope"
  )
  with pytest.raises(
    ucp_jax.MappingError,
    match="`model_type` 'bert' has no ready rule set; ready: gpt2, llama, mistral, qwen2, qwen3, "
    "gemma, gemma2, gemma3_text, phi3, olmo2, gpt_neox",
  ):
    rules.from_hf({"model_type": "bert"})
  mixed = dict(
    CASES["qwen2"][2],
    model_type="qwen2",
    use_sliding_window=True,
    sliding_window=4,
    max_window_layers=1,
  )
  assert rules.from_hf(mixed)[1].layer_types == ("full_attention", "sliding_attention")
  gpt2 = dict(CASES["gpt2"][2], model_type="gpt2", scale_attn_by_inverse_layer_idx=True)
  with pytest.raises(ucp_jax.MappingError, match="scale_attn_by_inverse_layer_idx: true"):
    rules.from_hf(gpt2)
  ucp_jax.save(tmp_path / "plain", {"params": {"w": np.zeros(2)}})
  with pytest.raises(ucp_jax.MappingError, match=r"recorded no Hugging Face config\.json"):
    rules.from_hf(tmp_path / "plain")


def test_load_into_keeps_a_tensor_parallel_models_shardings(devices):
  hf = _hf_model("qwen2")
  rs, cfg = rules.from_hf(hf, stacked=True)
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
  abstract = _abstract(cfg, stacked=True)
  graphdef, _ = nnx.split(abstract)
  model = nnx.merge(graphdef, llama.tp_state(nnx.state(abstract), mesh))  # abstract, sharded
  assert rules.load_into(model, hf.state_dict(), rs) is model
  q_bias = model.layers.attn.q.bias[...]
  assert isinstance(q_bias.sharding, NamedSharding) and q_bias.sharding.spec[1] == "model"
  with torch.no_grad():
    expected = hf(torch.from_numpy(TOKENS)).logits.numpy()
  got = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(TOKENS))
  np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5)


def test_load_into_checks_everything_first_and_reads_checkpoints(tmp_path):
  hf = _hf_model("gemma")
  rs, cfg = rules.from_hf(hf)
  model = models.build(cfg, rngs=nnx.Rngs(1))
  before = np.asarray(model.embed.embedding[...]).copy()
  sd = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp" not in k}
  sd = {k: v.to(torch.bfloat16) if k.endswith("norm.weight") else v for k, v in sd.items()}
  with pytest.raises(ucp_jax.TreeMismatchError, match="layers/1/mlp/down/kernel"):
    rules.load_into(model, sd, rs)
  with pytest.raises(ucp_jax.DtypeMismatchError, match="norm/scale"):
    rules.load_into(model, hf.state_dict() | {"model.norm.weight": sd["model.norm.weight"]}, rs)
  np.testing.assert_array_equal(model.embed.embedding[...], before)  # nothing changed
  rules.load_into(
    model, hf.state_dict() | {"model.norm.weight": sd["model.norm.weight"]}, rs, cast=True
  )
  assert model.norm.scale[...].dtype == jnp.float32

  ucp_jax.save(tmp_path / "ckpt", {"params": _state_dict(hf)})  # torch names, converted
  rules.load_into(model, tmp_path / "ckpt", rs, subtree="params")
  with torch.no_grad():
    expected = hf(torch.from_numpy(TOKENS)).logits.numpy()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), expected, atol=1e-5)


def test_cli_rules_take_any_rule_set(tmp_path, monkeypatch):
  hf = _hf_model("llama")
  hf.save_pretrained(tmp_path / "hf")
  for stacked in (False, True):
    expected = rules.from_hf(hf, stacked=stacked)[0]
    assert (
      _rule_specs.parse(f"hf:config={tmp_path / 'hf'},stacked={str(stacked).lower()}") == expected
    )
  # a Flax-named checkpoint tells whether its layers are stacked; --config names the config.json
  model = models.build(rules.from_hf(hf)[1], rngs=nnx.Rngs(0), scan=True)
  ucp_jax.save(tmp_path / "flax", {"params": nnx.state(model, nnx.Param)})
  made = _rule_specs.parse("hf", str(tmp_path / "flax"), str(tmp_path / "hf" / "config.json"))
  assert made == rules.from_hf(hf, stacked=True)[0]
  assert _rule_specs.parse("hf_llama:num_heads=4,num_kv_heads=2,prefix=") == rules.hf_llama(
    num_heads=4, num_kv_heads=2, prefix=""
  )

  (tmp_path / "my_rules.py").write_text(
    "from ucp_jax import rules\n"
    "def make(heads, prefix='model.', scale=1.0):\n"
    "  assert scale == 0.5\n"
    "  return rules.hf_llama(num_heads=heads, num_kv_heads=2, prefix=prefix)\n"
    "def not_rules():\n"
    "  return {}\n"
  )
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  made = _rule_specs.parse("my_rules:make:heads=4,prefix=,scale=0.5")
  assert made == rules.hf_llama(num_heads=4, num_kv_heads=2, prefix="")
  problems = {
    "no_such_module:make": "no module 'no_such_module' to import",
    "my_rules:missing": "module my_rules has no 'missing'",
    "my_rules:not_rules": "made a dict, not a RuleSet",
    "my_rules:make:size=4": "got an unexpected keyword argument 'size'",
    "gpt2:num_heads=four": "num_heads='four' is not an integer",
    "bert": "not a ready rule set (gpt2, llama, hf_gpt2, hf_llama, hf) nor module:function",
    "hf": "no config.json to read: pass hf:config=PATH",
    "hf:heads=4,config=x": "heads is not an option of hf (stacked, prefix, config)",
  }
  for spec, problem in problems.items():
    with pytest.raises(ucp_jax.MappingError, match=re.escape(problem)):
      _rule_specs.parse(spec)
  with pytest.raises(ucp_jax.MappingError, match=r"hf:config=PATH or --config"):
    _rule_specs.parse("hf", str(tmp_path / "flax"))


def test_a_hugging_face_model_trained_in_flax_exports_back_through_the_cli(tmp_path, capsys):
  optax = pytest.importorskip("optax")
  hf = _hf_model("gemma")
  hf.save_pretrained(tmp_path / "hf")
  rs, cfg = rules.from_hf(tmp_path / "hf")
  model = rules.load_into(models.build(cfg, rngs=nnx.Rngs(0)), hf.state_dict(), rs)
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  ucp_jax.save_train_state(tmp_path / "jax", model, opt)
  argv = ["export", str(tmp_path / "jax"), str(tmp_path / "out"), "--format", "hf"]
  argv += ["--config", str(tmp_path / "hf" / "config.json"), "--rules", "hf"]
  assert cli.main(argv) == 0, capsys.readouterr().err
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  with torch.no_grad():
    np.testing.assert_array_equal(
      back(torch.from_numpy(TOKENS)).logits.numpy(), hf(torch.from_numpy(TOKENS)).logits.numpy()
    )
  assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "gemma"
  # --config means the same on every format: --rules hf reads it (deepspeed and dcp write no
  # config.json); without --rules hf, where nothing would read it, it is refused
  config = ["--config", str(tmp_path / "hf" / "config.json")]
  for format in ("deepspeed", "dcp"):
    base = ["export", str(tmp_path / "jax"), str(tmp_path / format), "--format", format, *config]
    assert cli.main([*base, "--rules", "hf"]) == 0, capsys.readouterr().err
    assert cli.main(base) == 2
    assert (
      f"error: --config: the model's Hugging Face config.json, which --rules hf reads and "
      f"--format hf writes; format '{format}' without --rules hf has no use for it"
    ) in capsys.readouterr().err
  zero = tmp_path / "deepspeed" / "global_step0" / "zero"
  written = {p.name for p in zero.iterdir()}
  assert "model.layers.0.self_attn.q_proj.weight" in written
  for name, value in hf.state_dict().items():  # the torch names and layouts, through the rules
    if name in written:
      assert torch.equal(torch.load(zero / name / "fp32.pt", weights_only=True)["param"], value)


def test_a_hugging_face_folder_restores_lazily_through_its_rules(tmp_path):
  hf = _hf_model("llama")
  hf.save_pretrained(tmp_path / "hf")
  try:
    ckpt = ucp_jax.open(tmp_path / "hf")  # keys params/<name>, config.json recorded
  except ucp_jax.CheckpointNotFoundError:
    pytest.skip("no Hugging Face source registered")
  rs, cfg = rules.from_hf(ckpt, stacked=True)
  assert (rs, cfg) == rules.from_hf(hf, stacked=True)
  model = models.build(cfg, rngs=nnx.Rngs(0), scan=True)
  rules.load_into(model, tmp_path / "hf", rs, subtree="params")
  with torch.no_grad():
    expected = hf(torch.from_numpy(TOKENS)).logits.numpy()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), expected, atol=1e-5)


def test_docs_mapping_hugging_face_example():
  text = (Path(__file__).resolve().parent.parent / "docs" / "mapping.md").read_text()
  section = text[text.index("## Hugging Face models") :]
  code = re.search(r"^```python\n(.*?)^```", section, flags=re.S | re.M)[1]
  ns = {"hf_model": _hf_model("gemma"), "tokens": TOKENS}
  exec(compile(code, "docs/mapping.md: Hugging Face models", "exec"), ns)
  assert ns["worst"] < 1e-5
  assert type(ns["model"]).__name__ == "FlaxLlama"
