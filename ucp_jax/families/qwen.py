"""Qwen2 (q/k/v biases) and Qwen3 (q/k norms), sliding and full layers mixed, on
`models.llama.FlaxLlama`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ucp_jax.base._errors import shown
from ucp_jax.families._family import llama_shaped
from ucp_jax.models import _configs
from ucp_jax.models import _hf as hf
from ucp_jax.models._hf_reader import MAX_SIZE, Reader, is_int

QWEN = {"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}
QWEN |= {"tie_word_embeddings": False, "sliding_window": 4096, "use_sliding_window": False}
QWEN |= {"max_window_layers": 28, "layer_types": None}


def _qwen(r: Reader, kind: str) -> Callable[[], _configs.LlamaConfig]:
  sizes, common = hf.sizes(r), hf.common(r)
  extra: dict[str, Any]
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

  extra |= hf.windows(r, sizes["num_layers"], window, default)
  return hf.make(sizes, common, hf.rope(r, sizes["head_dim"]), extra)


FAMILIES = (
  llama_shaped(
    "qwen2",
    hf.defaults((151936, 4096, 22016, 32, 32, 32), **QWEN),
    _qwen,
  ),
  llama_shaped(
    "qwen3",
    hf.defaults((151936, 4096, 22016, 32, 32, 32), **QWEN)
    | {"head_dim": 128, "attention_bias": False},
    _qwen,
  ),
)
