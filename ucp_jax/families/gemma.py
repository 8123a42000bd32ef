"""Gemma 1, 2 and 3 (text): offset norms, scaled embeddings, sandwich norms, soft-capping,
per-layer-type RoPE, on `models.llama.FlaxLlama`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ucp_jax.base._errors import shown
from ucp_jax.families._family import llama_shaped
from ucp_jax.models import _configs, _hf_rope
from ucp_jax.models import _hf as hf
from ucp_jax.models._hf_reader import Reader

GEMMA2 = {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6}
GEMMA2 |= {"tie_word_embeddings": True, "attention_bias": False, "sliding_window": 4096}
GEMMA2 |= {"query_pre_attn_scalar": 256, "layer_types": None}


def _gemma(r: Reader, kind: str) -> Callable[[], _configs.LlamaConfig]:
  sizes = hf.sizes(r)
  common = hf.common(r, "hidden_act" if kind == "gemma" else "hidden_activation")
  if kind == "gemma" and r("hidden_act") == "gelu":
    common["act"] = "gelu_tanh"  # transformers' GemmaConfig: the releases' "gelu" is the tanh one
  hf.causal(r)
  bias = r.flag("attention_bias")
  extra: dict[str, Any] = {"qkv_bias": bias, "o_bias": bias, "norm_offset": 1.0}
  extra["embed_scale"] = True
  if kind == "gemma":
    return hf.make(sizes, common, hf.rope(r, sizes["head_dim"]), extra)
  window = r.optional_size("sliding_window")
  pattern = 2
  if kind == "gemma3_text":
    pattern = r.size("sliding_window_pattern", 6)  # the legacy int, read as transformers does
  extra |= hf.windows(r, sizes["num_layers"], window, lambda i: bool((i + 1) % pattern))
  extra |= {"norms": "sandwich", "query_scale": r.number("query_pre_attn_scalar")}
  extra["final_softcap"] = r.optional_number("final_logit_softcapping")
  if kind == "gemma2":  # Gemma 3 keeps the field but never passes it to its attention
    extra["attn_softcap"] = r.optional_number("attn_logit_softcapping")
    return hf.make(sizes, common, hf.rope(r, sizes["head_dim"]), extra)
  extra["qk_norm"] = "head"
  return hf.make(sizes, common, _gemma3_rope(r, sizes["head_dim"]), extra)


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


FAMILIES = (
  llama_shaped(
    "gemma",
    hf.defaults((256000, 3072, 24576, 28, 16, 16), head_dim=256)
    | {"hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6}
    | {"tie_word_embeddings": True, "attention_bias": False, "use_bidirectional_attention": None},
    _gemma,
  ),
  llama_shaped(
    "gemma2",
    hf.defaults((256000, 2304, 9216, 26, 8, 4), **GEMMA2)
    | {"max_position_embeddings": 8192, "final_logit_softcapping": 30.0}
    | {"attn_logit_softcapping": 50.0, "use_bidirectional_attention": None},
    _gemma,
  ),
  llama_shaped(
    "gemma3_text",
    hf.defaults((262208, 2304, 9216, 26, 8, 4), **GEMMA2)
    | {"max_position_embeddings": 131072, "final_logit_softcapping": None}
    | {"attn_logit_softcapping": None, "use_bidirectional_attention": False},
    _gemma,
  ),
)
