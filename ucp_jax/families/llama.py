"""Llama 1-3 (RoPE scaling: linear, dynamic, yarn, llama3) on `models.llama.FlaxLlama`."""

from __future__ import annotations

from collections.abc import Callable

from ucp_jax.families._family import llama_shaped
from ucp_jax.models import _configs
from ucp_jax.models import _hf as hf
from ucp_jax.models._hf_reader import Reader

LLAMA = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
"""Defaults that Llama's config class shares with Mistral's."""


def _llama(r: Reader, kind: str) -> Callable[[], _configs.LlamaConfig]:
  sizes, common = hf.sizes(r), hf.common(r)
  bias = r.flag("attention_bias")
  extra = {"qkv_bias": bias, "o_bias": bias, "mlp_bias": r.flag("mlp_bias")}
  return hf.make(sizes, common, hf.rope(r, sizes["head_dim"]), extra)


FAMILIES = (
  llama_shaped(
    "llama",
    hf.defaults((32000, 4096, 11008, 32, 32, None), **LLAMA)
    | {"head_dim": None, "max_position_embeddings": 2048, "attention_bias": False}
    | {"mlp_bias": False},
    _llama,
  ),
)
