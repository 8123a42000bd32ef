"""OLMo 2 (post-norms, q/k norms over all heads) on `models.llama.FlaxLlama`."""

from __future__ import annotations

from collections.abc import Callable

from ucp_jax.families._family import llama_shaped
from ucp_jax.models import _configs
from ucp_jax.models import _hf as hf
from ucp_jax.models._hf_reader import Reader


def _olmo2(r: Reader, kind: str) -> Callable[[], _configs.LlamaConfig]:
  sizes, common = hf.sizes(r), hf.common(r)
  bias = r.flag("attention_bias")
  extra = {"qkv_bias": bias, "o_bias": bias, "qk_norm": "all", "norms": "post"}
  return hf.make(sizes, common, hf.rope(r, sizes["head_dim"]), extra)


FAMILIES = (
  llama_shaped(
    "olmo2",
    hf.defaults((50304, 4096, 11008, 32, 32, None), hidden_act="silu")
    | {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    | {"attention_bias": False},
    _olmo2,
  ),
)
