"""What `rules.from_hf` reads of a `config.json`, and what it refuses, one line each.

The defaults of every field read are `transformers` 5.24's (checked against its config
classes when transformers is installed); every field the new families read is checked for
its type, one line naming the file and the field (the hostile-input rule of
tests/test_hostile_hf.py); a config the reference models would compute differently is
refused naming the `model_type` or option.
"""

import dataclasses
import json

import pytest

import ucp_jax
from ucp_jax import families, rules

MINE = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
MINE += ("olmo2", "gpt_neox")
SIZES = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
SIZES |= {"num_attention_heads": 4, "num_key_value_heads": 2}
GEMMA2 = {**SIZES, "model_type": "gemma2", "head_dim": 16, "sliding_window": 4}
GEMMA3 = {**GEMMA2, "model_type": "gemma3_text"}
PHI3 = {**SIZES, "model_type": "phi3", "max_position_embeddings": 32}
NEOX = {k: v for k, v in SIZES.items() if k != "num_key_value_heads"} | {"model_type": "gpt_neox"}
LLAMA = {**SIZES, "model_type": "llama", "max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 2.0}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}


@pytest.mark.parametrize("kind", MINE)
def test_the_defaults_are_the_transformers_config_classes(kind):
  transformers = pytest.importorskip("transformers")
  config_class = transformers.CONFIG_MAPPING[kind]
  fields = {f.name: f.default for f in dataclasses.fields(config_class)}
  for key, value in families.get(kind).defaults.items():
    assert key in fields, f"{kind}: {key} is not a field of {config_class.__name__}"
    assert fields[key] == value, f"{kind}: {key}"


WRONG = [  # (config, field, value): the fields the new families read, of a wrong type
  (GEMMA2, "query_pre_attn_scalar", "256"),
  (GEMMA2, "final_logit_softcapping", "30"),
  (GEMMA2, "attn_logit_softcapping", -1.0),
  (GEMMA2, "hidden_activation", 7),
  (GEMMA2, "layer_types", [1, 2]),
  (GEMMA2, "sliding_window", "4"),
  (GEMMA3, "sliding_window_pattern", 0),
  (GEMMA3, "rope_local_base_freq", "1e4"),
  (GEMMA3, "rope_parameters", {"full_attention": 5}),
  ({**PHI3, "rope_scaling": LONGROPE}, "original_max_position_embeddings", "8"),
  (PHI3, "partial_rotary_factor", 1.5),
  (PHI3, "rope_scaling", {**LONGROPE, "short_factor": "x"}),
  (NEOX, "rotary_pct", 2),
  (NEOX, "rotary_emb_base", "1e4"),
  (NEOX, "use_parallel_residual", "yes"),
  (NEOX, "layer_norm_eps", None),
  (LLAMA, "rope_parameters", {**YARN, "beta_fast": "32"}),
  (LLAMA, "rope_parameters", {**YARN, "truncate": "no"}),
  (LLAMA, "rope_parameters", {"rope_type": "dynamic", "factor": [2]}),
  (LLAMA, "max_position_embeddings", 0),
]


@pytest.mark.parametrize(
  ("base", "field", "value"), WRONG, ids=[f"{c['model_type']}-{f}-{v!r}" for c, f, v in WRONG]
)
def test_a_wrong_field_is_one_line_naming_file_and_field(tmp_path, base, field, value):
  path = tmp_path / "config.json"
  config = {**base, field: value}
  if field == "max_position_embeddings":
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0}
  path.write_text(json.dumps(config))
  with pytest.raises(ucp_jax.MappingError) as e:
    rules.from_hf(path)
  message = str(e.value)
  named = {"rope_parameters": ("short_factor", "beta_fast", "truncate", "factor", "full_attention")}
  names = named.get(field, (field,))
  names = ("short_factor",) if field == "rope_scaling" else names
  assert message.startswith(str(path)) and "\n" not in message, message
  assert any(f"`{n}" in message or f"{n}`" in message for n in names), message


REFUSED = [
  ({"model_type": "mixtral_like_unknown"}, "`model_type` 'mixtral_like_unknown' has no ready"),
  ({"model_type": "gemma3"}, "`model_type` 'gemma3': multimodal Gemma 3"),
  ({**LLAMA, "rope_parameters": {"rope_type": "mrope"}}, "rope_type 'mrope': supported are"),
  (
    {**LLAMA, "rope_parameters": {**YARN, "partial_rotary_factor": 0.5}},
    "partial_rotary_factor 0.5 with rope_type 'yarn'",
  ),
  ({**PHI3, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "Phi-3 runs default and"),
  ({**NEOX, "head_dim": 4}, "`head_dim` 4 differs from hidden_size // heads"),
  ({**GEMMA3, "use_bidirectional_attention": True}, "bidirectional attention is not causal"),
  ({**GEMMA2, "sliding_window": None}, "sliding layers without a `sliding_window`"),
  (
    {**SIZES, "model_type": "qwen2", "layer_types": ["sliding_attention", "full_attention"]},
    "sliding layers without a `sliding_window`",
  ),
  ({**GEMMA2, "layer_types": ["full_attention"]}, "`layer_types`: 1 entries for 2 layers"),
  ({**GEMMA2, "layer_types": ["linear_attention"] * 2}, "'linear_attention' not one of"),
  ({**LLAMA, "hidden_act": "xielu"}, "`hidden_act`: 'xielu' is not one of"),
  ({**PHI3, "rope_scaling": {**LONGROPE, "long_factor": [1.0]}}, "is not 4 positive numbers"),
]


@pytest.mark.parametrize(("config", "says"), REFUSED, ids=[s[:30] for _, s in REFUSED])
def test_what_the_reference_models_do_not_compute_is_refused_in_one_line(config, says):
  with pytest.raises(ucp_jax.MappingError) as e:
    rules.from_hf(config)
  assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_mixed_windows_over_huge_layer_counts_build_no_list():
  huge = {**GEMMA2, "num_hidden_layers": 2**31 - 1}
  with pytest.raises(ucp_jax.MappingError, match="sliding and full layers mixed"):
    rules.from_hf(huge)
  uniform = {**SIZES, "model_type": "qwen2", "num_hidden_layers": 2**31 - 1}
  uniform |= {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}
  assert rules.from_hf(uniform)[1].sliding_window == 4  # every layer slides: no list


def test_the_rule_sets_of_each_family():
  def names(config):
    return rules.from_hf(config)[0]

  phi3 = names(PHI3).map_names(["model.layers.0.self_attn.qkv_proj.weight"])
  assert sorted(phi3) == [
    "layers/0/attn/k/kernel",
    "layers/0/attn/q/kernel",
    "layers/0/attn/v/kernel",
  ]
  gemma2 = names(GEMMA2).map_names(
    [
      f"model.layers.0.{n}.weight"
      for n in ("post_attention_layernorm", "pre_feedforward_layernorm")
    ]
  )
  assert sorted(gemma2) == ["layers/0/attn_post_norm/scale", "layers/0/mlp_norm/scale"]
  olmo2 = names({**SIZES, "model_type": "olmo2"}).map_names(
    ["model.layers.0.self_attn.q_norm.weight"]
  )
  assert list(olmo2) == ["layers/0/attn/q_norm/scale"]
  pythia = rules.from_hf(NEOX)[0].map_names(["gpt_neox.final_layer_norm.bias", "lm_head.weight"])
  assert sorted(pythia) == ["lm_head/kernel", "norm/bias"]


def test_the_configs_name_the_activations_the_models_run():
  from ucp_jax.models import _common, _configs

  assert tuple(_common.ACTIVATIONS) == _configs.ACTIVATION_NAMES


@pytest.mark.parametrize("kind", families.ready())
def test_each_family_is_one_record_whose_model_runs_its_defaults(kind):
  """The registry's record of `kind` reads a `config.json` of nothing but the `model_type`
  (its class's defaults) into a config that `models.build` runs on the record's model."""
  from ucp_jax.models import _build

  family = families.get(kind)
  assert family.model_type == kind
  model = _build.MODELS[type(families.config_from_hf({"model_type": kind}))]
  assert f"{model.__module__.rpartition('.')[2]}.{model.__name__}" == family.model


def test_a_family_is_found_without_importing_the_others():
  import subprocess
  import sys

  code = (
    "import sys\nfrom ucp_jax import families\nfamilies.get('mistral')\n"
    "print(sorted(m for m in sys.modules if m.startswith('ucp_jax.families.')))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  loaded = out.stdout.strip()
  assert (
    loaded == "['ucp_jax.families._family', 'ucp_jax.families.llama', 'ucp_jax.families.mistral']"
  )
