"""Flax model configs from Hugging Face `config.json`s: which reference model runs a checkpoint.

`config_from_hf(config)` reads the fields that decide the computation (sizes, heads,
key/value heads, head width, epsilon, activation, RoPE theta and scaling, biases, tied
embeddings, sliding window) and refuses, listing every reason at once, a config whose
model the reference models would compute differently.
"""

from __future__ import annotations

import math
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


MAX_SIZE = 1 << 31
"""The largest size (vocabulary, width, layers, heads, positions) a config may give."""


def config_from_hf(
  config: Mapping[str, Any], *, where: str = "config.json"
) -> gpt.GPTConfig | llama.LlamaConfig:
  """The `GPTConfig` or `LlamaConfig` that computes what the `config.json` `config` describes.

  Example:
    >>> from ucp_jax.models._hf import config_from_hf
    >>> config_from_hf({"model_type": "qwen2", "vocab_size": 96, "hidden_size": 32,
    ...   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...   "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1e6}).qkv_bias
    True

  Args:
    config: the `config.json` as a dict.
    where: the file it came from, for messages.

  Raises:
    MappingError: a model type without a reference model, a field of the wrong type, a
      missing size, or a feature the reference models do not compute (every one, on one
      line naming `where`).
  """
  if not isinstance(config, Mapping):
    raise _errors.MappingError(f"{where}: {_shown(config)} is not a JSON object")
  kind = config.get("model_type")
  if kind == "gpt2":
    return _gpt2(config, where)
  if isinstance(kind, str) and kind in LLAMA_LIKE:
    return _llama(config, kind, where)
  raise _errors.MappingError(
    f"{where}: `model_type` {_shown(kind)} has no ready rule set; ready: {', '.join(FAMILIES)} "
    "(for another, write a RuleSet: docs/mapping.md)"
  )


def _shown(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


class _Reader:
  """Reads fields, each checked for its type, collecting every problem."""

  def __init__(self, config: Mapping[str, Any], where: str, defaults: Mapping | None = None):
    self.config, self.where, self.defaults, self.problems = config, where, defaults or {}, []
    self.names("architectures")  # read by `ucp_jax.rules.from_hf` for the names' prefix

  def __call__(self, key: str, default: Any = None) -> Any:
    value = self.config.get(key)
    if value is None:
      value = self.defaults.get(key, default)
    return value

  def _checked(self, key: str, value: Any, ok: bool, what: str, fallback: Any) -> Any:
    if value is None or ok:
      return value
    self.problems.append(f"`{key}`: {_shown(value)} is not {what}")
    return fallback

  def size(self, key: str, default: Any = None, *, required: bool = False) -> Any:
    """A positive integer (at most `MAX_SIZE`), or None where absent and not required."""
    value = self(key, default)
    if value is None and required:
      self.problems.append(f"`{key}`: missing")
    return self._checked(key, value, _is_int(value, 1, MAX_SIZE), "a positive integer", 1)

  def integer(self, key: str, default: Any = None) -> Any:
    value = self(key, default)
    return self._checked(key, value, _is_int(value, -MAX_SIZE, MAX_SIZE), "an integer", 0)

  def number(self, key: str, default: float, *, value: Any = None) -> Any:
    """A positive finite number (`value` when given, else the field `key`)."""
    value = self(key, default) if value is None else value
    ok = _is_number(value) and value > 0
    return self._checked(key, value, ok, "a positive number", default)

  def flag(self, key: str, default: bool) -> bool:
    value = self(key, default)
    return self._checked(key, value, isinstance(value, bool), "true or false", default)

  def text(self, key: str, default: str | None = None) -> Any:
    value = self(key, default)
    return self._checked(key, value, isinstance(value, str), "a name", default)

  def mapping(self, key: str) -> dict:
    value = self(key)
    return dict(self._checked(key, value, isinstance(value, Mapping), "an object", None) or {})

  def names(self, key: str) -> list[str] | None:
    value = self(key)
    ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    return self._checked(key, value, ok, "a list of names", None)

  def act(self, key: str, default: str) -> str:
    name = self.text(key, default)
    if name not in ACTIVATIONS:
      if isinstance(name, str):
        self.problems.append(f"`{key}`: {_shown(name)} is not one of {', '.join(ACTIVATIONS)}")
      return "silu"
    return ACTIVATIONS[name]

  def refuse(self, condition: bool, problem: str) -> None:
    if condition:
      self.problems.append(problem)

  def done(self, kind: str, make):
    if self.problems:
      raise _errors.MappingError(
        f"{self.where} ({kind}): the reference Flax model cannot run it: "
        + "; ".join(self.problems)
      )
    return make()


def _is_int(value: Any, low: int, high: int) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _gpt2(config: Mapping[str, Any], where: str) -> gpt.GPTConfig:
  r = _Reader(config, where)
  sizes = {
    "vocab_size": r.size("vocab_size", required=True),
    "max_len": r.size("n_positions", required=True),
    "num_layers": r.size("n_layer", required=True),
    "num_heads": r.size("n_head", required=True),
    "d_model": r.size("n_embd", required=True),
  }
  act = r.act("activation_function", "gelu_new")
  r.refuse(not r.flag("scale_attn_weights", True), "scale_attn_weights: false is not supported")
  r.refuse(
    r.flag("scale_attn_by_inverse_layer_idx", False),
    "scale_attn_by_inverse_layer_idx: true is not supported",
  )
  r.refuse(r.flag("add_cross_attention", False), "add_cross_attention: true is not supported")
  eps = float(r.number("layer_norm_epsilon", 1e-5))
  hidden = r.size("n_inner")
  tie = r.flag("tie_word_embeddings", True)
  return r.done(
    "gpt2",
    lambda: gpt.GPTConfig(**sizes, eps=eps, hidden=hidden, act=act, tie_embeddings=tie),
  )


def _llama(config: Mapping[str, Any], kind: str, where: str) -> llama.LlamaConfig:
  defaults, implied = LLAMA_LIKE[kind]
  r = _Reader(config, where, defaults)
  heads = r.size("num_attention_heads", required=True)
  sizes = {
    "vocab_size": r.size("vocab_size", required=True),
    "num_layers": r.size("num_hidden_layers", required=True),
    "num_heads": heads,
    "num_kv_heads": r.size("num_key_value_heads", heads),
    "d_model": r.size("hidden_size", required=True),
    "hidden": r.size("intermediate_size", required=True),
    "head_dim": r.size("head_dim"),
  }
  act = r.act("hidden_act", "silu")
  theta, scaling = _rope(r)
  bias = r.flag("attention_bias", False)
  window = _window(r, kind)
  r.refuse(r.flag("use_bidirectional_attention", False), "bidirectional attention is not causal")
  eps = float(r.number("rms_norm_eps", 1e-6))
  mlp_bias = r.flag("mlp_bias", False)
  tie = r.flag("tie_word_embeddings", False)
  return r.done(
    kind,
    lambda: llama.LlamaConfig(
      **sizes,
      rope_theta=theta,
      rope_scaling=scaling,
      eps=eps,
      qkv_bias=bias or implied.get("qkv_bias", False),
      o_bias=bias,
      mlp_bias=mlp_bias,
      qk_norm=implied.get("qk_norm", False),
      tie_embeddings=tie,
      act=act,
      norm_offset=implied.get("norm_offset", 0.0),
      embed_scale=implied.get("embed_scale", False),
      sliding_window=window,
    ),
  )


def _rope(r: _Reader) -> tuple[float, dict | None]:
  """`rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4): theta, scaling."""
  params = {**r.mapping("rope_scaling"), **r.mapping("rope_parameters")}
  theta = float(r.number("rope_theta", 10000.0, value=params.get("rope_theta")))
  kind = params.get("rope_type", params.get("type", "default"))
  if not isinstance(kind, str):
    r.problems.append(f"`rope_type`: {_shown(kind)} is not a name")
    return theta, None
  factor = params.get("partial_rotary_factor", 1.0)
  r.refuse(factor != 1.0, "partial_rotary_factor: only 1.0 (RoPE on the whole head) is supported")
  if kind == "default":
    return theta, None
  if kind not in ROPE_SCALING:
    r.problems.append(f"rope_type {kind!r}: supported are default, {', '.join(ROPE_SCALING)}")
    return theta, None
  scaling: dict[str, Any] = {"rope_type": kind}
  if kind == "llama3" and "original_max_position_embeddings" not in params:
    params["original_max_position_embeddings"] = r.size("max_position_embeddings")
  for key in ROPE_SCALING[kind]:
    if params.get(key) is None:
      r.problems.append(f"rope {kind}: {key} missing")
    else:
      scaling[key] = r.number(key, 1.0, value=params[key])
  return theta, scaling


def _window(r: _Reader, kind: str) -> int | None:
  """The sliding window of every layer (None: full attention), as `transformers` decides it."""
  window = r.size("sliding_window")
  if kind == "mistral":
    return window
  if kind == "gemma" or not r.flag("use_sliding_window", False) or window is None:
    return None
  types = r.names("layer_types")
  if types:
    mixed, first_sliding = len(set(types)) > 1, bool(types) and types[0] == "sliding_attention"
  else:  # layer i slides when i >= max_window_layers (no list of layers built)
    layers, full = r.size("num_hidden_layers") or 0, r.integer("max_window_layers", 28)
    mixed, first_sliding = 0 < full < layers, layers > 0 and full <= 0
  if mixed:
    r.problems.append("use_sliding_window with sliding and full layers mixed is not supported")
  return window if first_sliding else None
