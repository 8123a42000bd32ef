"""Flax model configs from Hugging Face `config.json`s: which reference model runs a checkpoint.

`config_from_hf(config)` reads every field that decides the computation, as `transformers`
5.24 reads it for that `model_type` (its config class's defaults for absent fields, `null`
where it means something, legacy spellings: `rope_scaling`, `rope_theta`, `rotary_pct`,
Gemma's `hidden_act: "gelu"`, which transformers runs as the tanh GELU), and refuses, listing
every reason at once, a config the reference models would compute differently.

`FAMILIES` maps each `model_type` to its reader; a new family adds one entry (its
`transformers` class's defaults in `DEFAULTS`, its rule set in
`ucp_jax.mapping._hf_rulesets.FAMILY_RULES`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ucp_jax.base import _errors
from ucp_jax.base._errors import shown
from ucp_jax.models import _configs, _hf_rope
from ucp_jax.models._hf_reader import MAX_SIZE as MAX_SIZE
from ucp_jax.models._hf_reader import Reader, is_int

MAX_LAYER_LIST = 1 << 16
"""The most layers a config may mix sliding and full attention over (a per-layer list)."""

_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
_SIZES += ("num_attention_heads", "num_key_value_heads")


def _defaults(sizes: tuple, **fields: Any) -> dict[str, Any]:
  return dict(zip(_SIZES, sizes)) | fields


_LLAMA = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
_QWEN = {"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}
_QWEN |= {"tie_word_embeddings": False, "sliding_window": 4096, "use_sliding_window": False}
_QWEN |= {"max_window_layers": 28, "layer_types": None}
_GEMMA2 = {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6}
_GEMMA2 |= {"tie_word_embeddings": True, "attention_bias": False, "sliding_window": 4096}
_GEMMA2 |= {"query_pre_attn_scalar": 256, "layer_types": None}
DEFAULTS: dict[str, dict[str, Any]] = {
  "llama": _defaults((32000, 4096, 11008, 32, 32, None), **_LLAMA)
  | {"head_dim": None, "max_position_embeddings": 2048, "attention_bias": False}
  | {"mlp_bias": False},
  "mistral": _defaults((32000, 4096, 14336, 32, 32, 8), **_LLAMA)
  | {"head_dim": None, "max_position_embeddings": 131072, "sliding_window": 4096},
  "qwen2": _defaults((151936, 4096, 22016, 32, 32, 32), **_QWEN),
  "qwen3": _defaults((151936, 4096, 22016, 32, 32, 32), **_QWEN)
  | {"head_dim": 128, "attention_bias": False},
  "gemma": _defaults((256000, 3072, 24576, 28, 16, 16), head_dim=256)
  | {"hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6}
  | {"tie_word_embeddings": True, "attention_bias": False, "use_bidirectional_attention": None},
  "gemma2": _defaults((256000, 2304, 9216, 26, 8, 4), **_GEMMA2)
  | {"max_position_embeddings": 8192, "final_logit_softcapping": 30.0}
  | {"attn_logit_softcapping": 50.0, "use_bidirectional_attention": None},
  "gemma3_text": _defaults((262208, 2304, 9216, 26, 8, 4), **_GEMMA2)
  | {"max_position_embeddings": 131072, "final_logit_softcapping": None}
  | {"attn_logit_softcapping": None, "use_bidirectional_attention": False},
  "phi3": _defaults((32064, 3072, 8192, 32, 32, None), hidden_act="silu")
  | {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096}
  | {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None},
  "olmo2": _defaults((50304, 4096, 11008, 32, 32, None), hidden_act="silu")
  | {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
  | {"attention_bias": False},
  "gpt_neox": _defaults((50432, 6144, 24576, 44, 64), hidden_act="gelu")
  | {"max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "tie_word_embeddings": False}
  | {"attention_bias": True, "use_parallel_residual": True},
  "gpt2": {"vocab_size": 50257, "tie_word_embeddings": True, "n_positions": 1024, "n_embd": 768}
  | {"n_layer": 12, "n_head": 12, "n_inner": None, "activation_function": "gelu_new"}
  | {"layer_norm_epsilon": 1e-5, "scale_attn_weights": True}
  | {"scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False},
}
"""Per `model_type`, the `transformers` 5.24 config class's default of every field read
(tests/test_families_config.py checks them against the classes). A field a class lacks
(Qwen2's, Phi-3's and OLMo 2's `head_dim`) is still read from the file when there, as
their attention reads it."""

REFUSED = {
  "gemma3": "multimodal Gemma 3 (a vision tower, the text model under `text_config`); "
  "gemma3_text runs",
  "mixtral": "mixture of experts (not yet)",
  "qwen2_moe": "mixture of experts (not yet)",
  "qwen3_moe": "mixture of experts (not yet)",
  "phi": "Phi-1/2 (a parallel block with a dense head): no reference model",
}
"""`model_type`s refused with their own reason (any other is refused naming the ready ones)."""


def config_from_hf(
  config: Mapping[str, Any], *, where: str = "config.json"
) -> _configs.GPTConfig | _configs.LlamaConfig | _configs.NeoXConfig:
  """The Flax model config that computes what the `config.json` `config` describes.

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
      feature the reference models do not compute (every one, on one line naming `where`).
  """
  if not isinstance(config, Mapping):
    raise _errors.MappingError(f"{where}: {shown(config)} is not a JSON object")
  kind = config.get("model_type")
  if isinstance(kind, str) and kind in FAMILIES:
    r = Reader(config, where, DEFAULTS[kind])
    return r.done(kind, FAMILIES[kind](r, kind))
  if isinstance(kind, str) and kind in REFUSED:
    raise _errors.MappingError(f"{where}: `model_type` {kind!r}: {REFUSED[kind]}")
  raise _errors.MappingError(
    f"{where}: `model_type` {shown(kind)} has no ready rule set; ready: {', '.join(FAMILIES)} "
    "(for another, write a RuleSet: docs/mapping.md)"
  )


def _gpt2(r: Reader, kind: str) -> Callable[[], _configs.GPTConfig]:
  sizes = {
    "vocab_size": r.size("vocab_size"),
    "max_len": r.size("n_positions"),
    "num_layers": r.size("n_layer"),
    "num_heads": r.size("n_head"),
    "d_model": r.size("n_embd"),
  }
  act = r.act("activation_function")
  r.refuse(not r.flag("scale_attn_weights"), "scale_attn_weights: false is not supported")
  r.refuse(
    r.flag("scale_attn_by_inverse_layer_idx"),
    "scale_attn_by_inverse_layer_idx: true is not supported",
  )
  r.refuse(r.flag("add_cross_attention"), "add_cross_attention: true is not supported")
  eps = r.number("layer_norm_epsilon")
  hidden = r.optional_size("n_inner")
  tie = r.flag("tie_word_embeddings")
  return lambda: _configs.GPTConfig(**sizes, eps=eps, hidden=hidden, act=act, tie_embeddings=tie)


def _sizes(r: Reader) -> dict[str, Any]:
  """Sizes every Llama-like family reads; `num_key_value_heads: null` is one per query head,
  `head_dim: null` (or absent without a class default) is `hidden_size // heads`."""
  heads = r.size("num_attention_heads")
  d = r.size("hidden_size")
  kv = r.size("num_key_value_heads", heads)
  r.refuse(heads % kv != 0, f"`num_key_value_heads` {kv} does not divide {heads} query heads")
  return {
    "vocab_size": r.size("vocab_size"),
    "num_layers": r.size("num_hidden_layers"),
    "num_heads": heads,
    "num_kv_heads": kv,
    "d_model": d,
    "hidden": r.size("intermediate_size"),
    "head_dim": r.size("head_dim", max(1, d // heads)),
  }


def _common(r: Reader, act: str = "hidden_act") -> dict[str, Any]:
  # Only Gemma's attention reads `use_bidirectional_attention` (refused there, `_causal`);
  # the others ignore it, as transformers does, once it is checked for its type
  r.flag("use_bidirectional_attention")
  return {
    "eps": r.number("rms_norm_eps"),
    "act": r.act(act),
    "tie_embeddings": r.flag("tie_word_embeddings"),
  }


def _rope(r: Reader, head_dim: int, *, partial: bool = False, **kwargs) -> dict[str, Any]:
  theta, scaling, factor = _hf_rope.read(
    r, _hf_rope.params(r, **kwargs), head_dim=head_dim, partial=partial
  )
  return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary": factor}


def _causal(r: Reader) -> None:
  r.refuse(r.flag("use_bidirectional_attention"), "bidirectional attention is not causal")


def _llama(r: Reader, kind: str) -> Callable[[], _configs.LlamaConfig]:
  sizes, common = _sizes(r), _common(r)
  bias = r.flag("attention_bias")
  extra = {"qkv_bias": bias, "o_bias": bias, "mlp_bias": r.flag("mlp_bias")}
  return _make(sizes, common, _rope(r, sizes["head_dim"]), extra)


def _mistral(r: Reader, kind: str) -> Callable[[], _configs.LlamaConfig]:
  sizes, common = _sizes(r), _common(r)
  extra = {"sliding_window": r.optional_size("sliding_window")}  # every layer; null: none
  return _make(sizes, common, _rope(r, sizes["head_dim"]), extra)


def _qwen(r: Reader, kind: str) -> Callable[[], _configs.LlamaConfig]:
  sizes, common = _sizes(r), _common(r)
  if kind == "qwen2":  # Qwen2: q/k/v biases always, `attention_bias` unread
    extra = {"qkv_bias": True}
  else:
    bias = r.flag("attention_bias")
    extra = {"qkv_bias": bias, "o_bias": bias, "qk_norm": "head"}
  window = r.optional_size("sliding_window") if r.flag("use_sliding_window") else None
  threshold = r("max_window_layers")
  if not is_int(threshold, -MAX_SIZE, MAX_SIZE):
    r.problem(f"`max_window_layers`: {shown(threshold)} is not an integer")
    threshold = 0

  def default(i: int) -> bool:  # layer i slides from max_window_layers on
    return window is not None and i >= threshold

  extra |= _windows(r, sizes["num_layers"], window, default)
  return _make(sizes, common, _rope(r, sizes["head_dim"]), extra)


def _gemma(r: Reader, kind: str) -> Callable[[], _configs.LlamaConfig]:
  sizes = _sizes(r)
  common = _common(r, "hidden_act" if kind == "gemma" else "hidden_activation")
  if kind == "gemma" and r("hidden_act") == "gelu":
    common["act"] = "gelu_tanh"  # transformers' GemmaConfig: the releases' "gelu" is the tanh one
  _causal(r)
  bias = r.flag("attention_bias")
  extra = {"qkv_bias": bias, "o_bias": bias, "norm_offset": 1.0, "embed_scale": True}
  if kind == "gemma":
    return _make(sizes, common, _rope(r, sizes["head_dim"]), extra)
  window = r.optional_size("sliding_window")
  pattern = 2
  if kind == "gemma3_text":
    pattern = r.size("sliding_window_pattern", 6)  # the legacy int, read as transformers does
  extra |= _windows(r, sizes["num_layers"], window, lambda i: bool((i + 1) % pattern))
  extra |= {"norms": "sandwich", "query_scale": r.number("query_pre_attn_scalar")}
  extra["final_softcap"] = r.optional_number("final_logit_softcapping")
  if kind == "gemma2":  # Gemma 3 keeps the field but never passes it to its attention
    extra["attn_softcap"] = r.optional_number("attn_logit_softcapping")
    return _make(sizes, common, _rope(r, sizes["head_dim"]), extra)
  extra["qk_norm"] = "head"
  return _make(sizes, common, _gemma3_rope(r, sizes["head_dim"]), extra)


def _gemma3_rope(r: Reader, head_dim: int) -> dict[str, Any]:
  """Gemma 3's RoPE per layer type: `rope_parameters` nested by `full_attention` and
  `sliding_attention`, or the legacy `rope_theta` (global, default 1e6), `rope_local_base_freq`
  (local, default 1e4) and `rope_scaling` (global only)."""
  given = r.mapping("rope_parameters") or {}
  nested = {}
  for name in ("full_attention", "sliding_attention"):
    value = given.get(name)
    if value is not None and not isinstance(value, Mapping):
      r.problem(f"`rope_parameters.{name}`: {shown(value)} is not an object")
      value = None
    nested[name] = dict(value or {"rope_type": "default"})
  scaling = r.mapping("rope_scaling")
  if scaling is not None:
    nested["full_attention"].update(scaling)
  full, local = nested["full_attention"], nested["sliding_attention"]
  full.setdefault("rope_theta", r.number("rope_theta") if r.present("rope_theta") else 1e6)
  key = "rope_local_base_freq"
  local.setdefault("rope_theta", r.number(key) if r.present(key) else 1e4)
  theta, scaling, _ = _hf_rope.read(r, full, head_dim=head_dim, partial=False)
  local_theta, local_scaling, _ = _hf_rope.read(
    r, local, head_dim=head_dim, partial=False, where="sliding_attention."
  )
  return {
    "rope_theta": theta,
    "rope_scaling": scaling,
    "local_rope_theta": local_theta,
    "local_rope_scaling": local_scaling,
  }


def _phi3(r: Reader, kind: str) -> Callable[[], _configs.LlamaConfig]:
  sizes, common = _sizes(r), _common(r)
  p = _hf_rope.params(r, partial_key=None)
  key = "partial_rotary_factor"
  p.setdefault(key, _hf_rope.fraction(r, key, r(key)) if r.present(key) else 1.0)
  kind_given = p.get("rope_type", p.get("type", "default"))
  if kind_given in ("su", "yarn"):  # transformers' Phi3Config: their old names of longrope
    p["rope_type"] = "longrope"
  elif kind_given not in ("default", "longrope"):
    r.problem(f"rope_type {shown(kind_given)}: Phi-3 runs default and longrope only")
  theta, scaling, factor = _hf_rope.read(r, p, head_dim=sizes["head_dim"], partial=True)
  rope = {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary": factor}
  extra = {"sliding_window": r.optional_size("sliding_window")}
  return _make(sizes, common, rope, extra)


def _olmo2(r: Reader, kind: str) -> Callable[[], _configs.LlamaConfig]:
  sizes, common = _sizes(r), _common(r)
  bias = r.flag("attention_bias")
  extra = {"qkv_bias": bias, "o_bias": bias, "qk_norm": "all", "norms": "post"}
  return _make(sizes, common, _rope(r, sizes["head_dim"]), extra)


def _gpt_neox(r: Reader, kind: str) -> Callable[[], _configs.NeoXConfig]:
  heads, d = r.size("num_attention_heads"), r.size("hidden_size")
  head_dim = max(1, d // heads)
  r.refuse(d % heads != 0, f"`hidden_size` {d} is not a multiple of {heads} heads")
  given = r("head_dim")
  r.refuse(
    r.present("head_dim") and given is not None and given != head_dim,
    f"`head_dim` {shown(given)} differs from hidden_size // heads (transformers' rotary and "
    "attention widths would disagree)",
  )
  p = _hf_rope.params(r, theta_key="rotary_emb_base", partial_key=None)
  if "partial_rotary_factor" not in p:
    pct = r("rotary_pct")
    p["partial_rotary_factor"] = (
      _hf_rope.fraction(r, "rotary_pct", pct) if r.present("rotary_pct") else 0.25
    )
  theta, scaling, factor = _hf_rope.read(r, p, head_dim=head_dim, partial=True)
  fields = {
    "vocab_size": r.size("vocab_size"),
    "num_layers": r.size("num_hidden_layers"),
    "num_heads": heads,
    "d_model": d,
    "hidden": r.size("intermediate_size"),
    "eps": r.number("layer_norm_eps"),
    "act": r.act("hidden_act"),
    "rope_theta": theta,
    "rope_scaling": scaling,
    "partial_rotary": factor,
    "parallel_residual": r.flag("use_parallel_residual"),
    "attention_bias": r.flag("attention_bias"),
    "tie_embeddings": r.flag("tie_word_embeddings"),
  }
  return lambda: _configs.NeoXConfig(**fields)


def _windows(r: Reader, layers: int, window: int | None, default) -> dict[str, Any]:
  """`sliding_window` and `layer_types` from the file's `layer_types` (names per layer) or,
  absent, `default(i)` (whether layer i slides); one kind of layer throughout needs no list."""
  types = r.names("layer_types")
  if types is not None:
    types = ["full_attention" if t == "attention" else t for t in types]  # the legacy name
    bad = sorted(set(types) - set(_configs.LAYER_TYPES))
    r.refuse(
      bool(bad),
      f"`layer_types`: {', '.join(map(repr, bad))} not one of {', '.join(_configs.LAYER_TYPES)}",
    )
    r.refuse(len(types) != layers, f"`layer_types`: {len(types)} entries for {layers} layers")
    sliding = [t == "sliding_attention" for t in types]
  else:
    first, last, alternate = default(0), default(layers - 1), default(1) if layers > 1 else None
    uniform = first == last and (alternate is None or alternate == first)
    if uniform and layers > MAX_LAYER_LIST:  # no list of layers built
      sliding = [first]
    elif layers > MAX_LAYER_LIST:
      r.problem(
        f"`num_hidden_layers`: {layers} layers with sliding and full layers mixed, more than "
        f"the {MAX_LAYER_LIST} listed"
      )
      return {}
    else:
      sliding = [default(i) for i in range(layers)]
  if any(sliding) and window is None:
    r.problem("sliding layers without a `sliding_window` (transformers cannot mask them)")
    return {}
  if not any(sliding):
    return {}
  if all(sliding):
    return {"sliding_window": window}
  return {
    "sliding_window": window,
    "layer_types": tuple(_configs.LAYER_TYPES[s] for s in sliding),
  }


def _make(*parts: dict) -> Callable[[], _configs.LlamaConfig]:
  fields: dict[str, Any] = {}
  for part in parts:
    fields |= part
  return lambda: _configs.LlamaConfig(**fields)


FAMILIES: dict[str, Callable[[Reader, str], Callable[[], Any]]] = {
  "gpt2": _gpt2,
  "llama": _llama,
  "mistral": _mistral,
  "qwen2": _qwen,
  "qwen3": _qwen,
  "gemma": _gemma,
  "gemma2": _gemma,
  "gemma3_text": _gemma,
  "phi3": _phi3,
  "olmo2": _olmo2,
  "gpt_neox": _gpt_neox,
}
"""`model_type` -> its reader: `reader(r, model_type)` reads every field (problems collected
in `r`) and returns a function making the Flax config."""
