"""`config.json` readers of the mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE.

Each reads what `transformers` 5.24 reads for its `model_type` (the class defaults for absent
fields, `DEFAULTS`) into a `ucp_jax.models._configs.MoeConfig`; `register()` adds them to
`ucp_jax.models._hf.FAMILIES` (done when `ucp_jax.models` is imported).
"""

from __future__ import annotations

from collections.abc import Callable

from ucp_jax.base._errors import shown
from ucp_jax.models import _configs, _hf, _hf_rope
from ucp_jax.models._hf_reader import MAX_SIZE, Reader, is_int

_MOE = {"hidden_act": "silu", "tie_word_embeddings": False, "num_experts_per_tok": 2}
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
_SIZES += ("num_attention_heads", "num_key_value_heads")
DEFAULTS = {
  "mixtral": dict(zip(_SIZES, (32000, 4096, 14336, 32, 32, 8)))
  | _MOE
  | {"head_dim": None, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072}
  | {"sliding_window": None, "num_local_experts": 8, "router_jitter_noise": 0.0},
  "qwen2_moe": dict(zip(_SIZES, (151936, 2048, 5632, 24, 16, 16)))
  | _MOE
  | {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "moe_intermediate_size": 1408}
  | {"shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4}
  | {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
  | {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
  | {"layer_types": None, "qkv_bias": True},
  "qwen3_moe": dict(zip(_SIZES, (151936, 2048, 6144, 24, 32, 4)))
  | _MOE
  | {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "moe_intermediate_size": 768}
  | {"num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": False}
  | {"decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False}
  | {"sliding_window": 4096, "attention_bias": False, "head_dim": None},
}
"""Per `model_type`, the `transformers` 5.24 config class's default of every field read."""


def _sizes(r: Reader) -> dict:
  """The sizes every Llama-like family reads (as `ucp_jax.models._hf` reads them)."""
  heads, d = r.size("num_attention_heads"), r.size("hidden_size")
  return {
    "vocab_size": r.size("vocab_size"),
    "num_layers": r.size("num_hidden_layers"),
    "num_heads": heads,
    "num_kv_heads": r.size("num_key_value_heads", heads),
    "d_model": d,
    "hidden": r.size("intermediate_size"),
    "head_dim": r.size("head_dim", max(1, d // heads)),
  }


def _common(r: Reader) -> dict:
  return {
    "eps": r.number("rms_norm_eps"),
    "act": r.act("hidden_act"),
    "tie_embeddings": r.flag("tie_word_embeddings"),
  }


def _rope(r: Reader, head_dim: int) -> dict:
  theta, scaling, factor = _hf_rope.read(r, _hf_rope.params(r), head_dim=head_dim, partial=False)
  return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary": factor}


def _windows(r: Reader, layers: int, window: int | None, default) -> dict:
  """`sliding_window` and `layer_types` from the file's `layer_types`, else `default(i)`."""
  types = r.names("layer_types")
  if types is not None and len(types) != layers:
    r.problem(f"`layer_types`: {len(types)} entries for {layers} layers")
    return {}
  if types is None and layers > _hf.MAX_LAYER_LIST:
    r.problem(f"`num_hidden_layers`: {layers} layers, more than the {_hf.MAX_LAYER_LIST} listed")
    return {}
  sliding = (
    [t == "sliding_attention" for t in types] if types else [default(i) for i in range(layers)]
  )
  if not any(sliding):
    return {}
  if window is None:
    r.problem("sliding layers without a `sliding_window` (transformers cannot mask them)")
    return {}
  if all(sliding):
    return {"sliding_window": window}
  return {"sliding_window": window, "layer_types": tuple(_configs.LAYER_TYPES[s] for s in sliding)}


def _experts(r: Reader, *keys: str) -> dict:
  """The experts' count (the first of `keys` the file has, else the first's default) and top k."""
  count = r.size(next((k for k in keys if r.present(k)), keys[0]))
  top_k = r.size("num_experts_per_tok")
  r.refuse(top_k > count, f"`num_experts_per_tok` {top_k} exceeds the {count} experts")
  return {"num_experts": count, "top_k": top_k}


def _sparse_layers(r: Reader, layers: int) -> tuple[int, ...]:
  """The dense layers of a Qwen MoE: `mlp_only_layers`, and those off `decoder_sparse_step`."""
  step = r("decoder_sparse_step")
  if not is_int(step, 1, MAX_SIZE):
    r.problem(f"`decoder_sparse_step`: {shown(step)} is not a positive integer")
    step = 1
  only = r("mlp_only_layers")
  if not (isinstance(only, list) and all(is_int(i, 0, MAX_SIZE) for i in only)):
    r.problem(f"`mlp_only_layers`: {shown(only)} is not a list of layer numbers")
    only = []
  r.refuse(layers > _hf.MAX_LAYER_LIST and (step != 1 or only), "too many layers to list")
  if step == 1 and not only:
    return ()
  return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def mixtral(r: Reader, kind: str) -> Callable[[], _configs.MoeConfig]:
  sizes, common = _sizes(r), _common(r)
  extra = {"sliding_window": r.optional_size("sliding_window"), "norm_topk_prob": True}
  extra |= _experts(r, "num_local_experts", "num_experts") | {"expert_hidden": sizes["hidden"]}
  return _make(sizes, common, _rope(r, sizes["head_dim"]), extra)


def qwen_moe(r: Reader, kind: str) -> Callable[[], _configs.MoeConfig]:
  sizes, common = _sizes(r), _common(r)
  if kind == "qwen2_moe":
    extra = {"qkv_bias": r.flag("qkv_bias")}
    shared = r.size("shared_expert_intermediate_size")
    extra |= {"shared_hidden": shared, "shared_gate": True}
  else:
    bias = r.flag("attention_bias")
    extra = {"qkv_bias": bias, "o_bias": bias, "qk_norm": "head"}
  extra |= _experts(r, "num_experts", "num_local_experts")
  extra |= {"expert_hidden": r.size("moe_intermediate_size")}
  extra["norm_topk_prob"] = r.flag("norm_topk_prob")
  extra["dense_layers"] = _sparse_layers(r, sizes["num_layers"])
  use = r.flag("use_sliding_window")
  window = r.optional_size("sliding_window") if use else None
  if kind == "qwen3_moe":  # every layer slides when the window is on
    extra |= {"sliding_window": window}
  else:
    threshold = r("max_window_layers")
    if not is_int(threshold, -MAX_SIZE, MAX_SIZE):
      r.problem(f"`max_window_layers`: {shown(threshold)} is not an integer")
      threshold = 0
    extra |= _windows(
      r, sizes["num_layers"], window, lambda i: use and bool((i + 1) % 2) and i < threshold
    )
  return _make(sizes, common, _rope(r, sizes["head_dim"]), extra)


def _make(*parts: dict) -> Callable[[], _configs.MoeConfig]:
  fields: dict = {}
  for part in parts:
    fields |= part
  return lambda: _configs.MoeConfig(**fields)


FAMILIES = {"mixtral": mixtral, "qwen2_moe": qwen_moe, "qwen3_moe": qwen_moe}


def register() -> None:
  """Adds the MoE families to `_hf.FAMILIES` and `_hf.DEFAULTS` (and takes them off
  `_hf.REFUSED`)."""
  for kind, reader in FAMILIES.items():
    _hf.FAMILIES[kind] = reader
    _hf.DEFAULTS[kind] = DEFAULTS[kind]
    _hf.REFUSED.pop(kind, None)


register()
