"""Mistral (a sliding window on every layer) on `models.llama.FlaxLlama`."""

from __future__ import annotations

from collections.abc import Callable

from ucp_jax.families._family import llama_shaped
from ucp_jax.families.llama import LLAMA
from ucp_jax.models import _configs
from ucp_jax.models import _hf as hf
from ucp_jax.models._hf_reader import Reader


def _mistral(r: Reader, kind: str) -> Callable[[], _configs.LlamaConfig]:
  sizes, common = hf.sizes(r), hf.common(r)
  extra = {"sliding_window": r.optional_size("sliding_window")}  # every layer; null: none
  return hf.make(sizes, common, hf.rope(r, sizes["head_dim"]), extra)


FAMILIES = (
  llama_shaped(
    "mistral",
    hf.defaults((32000, 4096, 14336, 32, 32, 8), **LLAMA)
    | {"head_dim": None, "max_position_embeddings": 131072, "sliding_window": 4096},
    _mistral,
  ),
)
