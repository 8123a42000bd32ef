"""Flax model configs from Hugging Face `config.json`s: which reference model runs a checkpoint.

`config_from_hf(config)` reads the fields that decide the computation (sizes, heads,
key/value heads, head width, epsilon, activation, RoPE theta and scaling, biases, tied
embeddings, sliding window) and refuses, listing every reason at once, a config whose
model the reference models would compute differently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ucp_jax import _errors
from ucp_jax.models import gpt, llama
from ucp_jax.models.llama import ROPE_SCALING

LLAMA_LIKE = {
  # model_type: (defaults of the transformers config class, options it implies)
  "llama": ({"tie_word_embeddings": False}, {}),
  "mistral": ({"tie_word_embeddings": False, "sliding_window": 4096}, {}),
  "qwen2": ({"tie_word_embeddings": False}, {"qkv_bias": True}),
  "qwen3": ({"tie_word_embeddings": False, "head_dim": 128}, {"qk_norm": True}),
  "gemma": (
    {"tie_word_embeddings": True, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh"},
    {"norm_offset": 1.0, "embed_scale": True},
  ),
}
"""The `model_type`s that run on `FlaxLlama`, with what their `transformers` class implies."""

FAMILIES = ("gpt2", *LLAMA_LIKE)

ACTIVATIONS = {
  "silu": "silu",
  "swish": "silu",
  "gelu_new": "gelu_tanh",
  "gelu_pytorch_tanh": "gelu_tanh",
  "gelu_fast": "gelu_tanh",
  "gelu": "gelu",
  "relu": "relu",
}
"""`transformers` activation names -> `ucp_jax.models._common.ACTIVATIONS` keys."""


def config_from_hf(config: Mapping[str, Any]) -> gpt.GPTConfig | llama.LlamaConfig:
  """The `GPTConfig` or `LlamaConfig` that computes what the `config.json` `config` describes.

  Example:
    >>> from ucp_jax.models._hf import config_from_hf
    >>> config_from_hf({"model_type": "qwen2", "vocab_size": 96, "hidden_size": 32,
    ...   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...   "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1e6}).qkv_bias
    True

  Raises:
    MappingError: a model type without a reference model, a missing size, or a feature
      the reference models do not compute (every one, at once).
  """
  kind = config.get("model_type")
  if kind == "gpt2":
    return _gpt2(config)
  if kind in LLAMA_LIKE:
    return _llama(config, kind)
  raise _errors.MappingError(
    f"config.json: model_type {kind!r} has no ready rule set; ready: {', '.join(FAMILIES)} "
    "(for another, write a RuleSet: docs/mapping.md)"
  )


class _Reader:
  """Reads fields, collecting every problem."""

  def __init__(self, config: Mapping[str, Any], defaults: Mapping[str, Any] | None = None):
    self.config, self.defaults, self.problems = config, defaults or {}, []

  def __call__(self, key: str, default: Any = None) -> Any:
    value = self.config.get(key)
    if value is None:
      value = self.defaults.get(key, default)
    return value

  def required(self, key: str) -> Any:
    value = self(key)
    if value is None:
      self.problems.append(f"{key}: missing")
    return value

  def act(self, key: str, default: str) -> str:
    name = self(key, default)
    if name not in ACTIVATIONS:
      self.problems.append(f"{key}: {name!r} is not one of {', '.join(ACTIVATIONS)}")
      return "silu"
    return ACTIVATIONS[name]

  def refuse(self, condition: bool, problem: str) -> None:
    if condition:
      self.problems.append(problem)

  def done(self, kind: str, make):
    if self.problems:
      raise _errors.MappingError(
        f"config.json ({kind}): the reference Flax model cannot run it:\n"
        + _errors.bullet_list(self.problems)
      )
    return make()


def _gpt2(config: Mapping[str, Any]) -> gpt.GPTConfig:
  r = _Reader(config)
  sizes = {
    "vocab_size": r.required("vocab_size"),
    "max_len": r.required("n_positions"),
    "num_layers": r.required("n_layer"),
    "num_heads": r.required("n_head"),
    "d_model": r.required("n_embd"),
  }
  act = r.act("activation_function", "gelu_new")
  r.refuse(not r("scale_attn_weights", True), "scale_attn_weights: false is not supported")
  r.refuse(
    bool(r("scale_attn_by_inverse_layer_idx", False)),
    "scale_attn_by_inverse_layer_idx: true is not supported",
  )
  r.refuse(bool(r("add_cross_attention", False)), "add_cross_attention: true is not supported")
  return r.done(
    "gpt2",
    lambda: gpt.GPTConfig(
      **sizes,
      eps=float(r("layer_norm_epsilon", 1e-5)),
      hidden=r("n_inner"),
      act=act,
      tie_embeddings=bool(r("tie_word_embeddings", True)),
    ),
  )


def _llama(config: Mapping[str, Any], kind: str) -> llama.LlamaConfig:
  defaults, implied = LLAMA_LIKE[kind]
  r = _Reader(config, defaults)
  heads = r.required("num_attention_heads")
  sizes = {
    "vocab_size": r.required("vocab_size"),
    "num_layers": r.required("num_hidden_layers"),
    "num_heads": heads,
    "num_kv_heads": r("num_key_value_heads", heads),
    "d_model": r.required("hidden_size"),
    "hidden": r.required("intermediate_size"),
    "head_dim": r("head_dim"),
  }
  act = r.act("hidden_act", "silu")
  theta, scaling = _rope(r)
  bias = bool(r("attention_bias", False))
  window = _window(r, kind)
  r.refuse(bool(r("use_bidirectional_attention", False)), "bidirectional attention is not causal")
  return r.done(
    kind,
    lambda: llama.LlamaConfig(
      **sizes,
      rope_theta=theta,
      rope_scaling=scaling,
      eps=float(r("rms_norm_eps", 1e-6)),
      qkv_bias=bias or implied.get("qkv_bias", False),
      o_bias=bias,
      mlp_bias=bool(r("mlp_bias", False)),
      qk_norm=implied.get("qk_norm", False),
      tie_embeddings=bool(r("tie_word_embeddings")),
      act=act,
      norm_offset=implied.get("norm_offset", 0.0),
      embed_scale=implied.get("embed_scale", False),
      sliding_window=window,
    ),
  )


def _rope(r: _Reader) -> tuple[float, dict | None]:
  """`rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4): theta, scaling."""
  params = {**(r("rope_scaling") or {}), **(r("rope_parameters") or {})}
  theta = float(params.get("rope_theta", r("rope_theta", 10000.0)))
  kind = params.get("rope_type", params.get("type", "default"))
  r.refuse(
    params.get("partial_rotary_factor", 1.0) != 1.0,
    "partial_rotary_factor: only 1.0 (RoPE on the whole head) is supported",
  )
  if kind == "default":
    return theta, None
  if kind not in ROPE_SCALING:
    r.problems.append(f"rope_type {kind!r}: supported are default, {', '.join(ROPE_SCALING)}")
    return theta, None
  scaling = {"rope_type": kind}
  if kind == "llama3" and "original_max_position_embeddings" not in params:
    params["original_max_position_embeddings"] = r("max_position_embeddings")
  for key in ROPE_SCALING[kind]:
    if params.get(key) is None:
      r.problems.append(f"rope {kind}: {key} missing")
    scaling[key] = params.get(key)
  return theta, scaling


def _window(r: _Reader, kind: str) -> int | None:
  """The sliding window of every layer (None: full attention), as `transformers` decides it."""
  window = r("sliding_window")
  if kind == "mistral":
    return window
  if kind == "gemma" or not r("use_sliding_window", False) or window is None:
    return None
  layers = r("layer_types") or [
    "sliding_attention" if i >= r("max_window_layers", 28) else "full_attention"
    for i in range(r("num_hidden_layers", 0))
  ]
  if len(set(layers)) > 1:
    r.problems.append("use_sliding_window with sliding and full layers mixed is not supported")
  return window if layers and layers[0] == "sliding_attention" else None
