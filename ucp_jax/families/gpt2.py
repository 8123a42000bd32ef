"""GPT-2 (`transformer.h.{i}...`, Conv1D weights) on `models.gpt.FlaxGPT`."""

from __future__ import annotations

from collections.abc import Callable

from ucp_jax.families._family import Family
from ucp_jax.mapping import _hf_rulesets as rulesets
from ucp_jax.models import _configs
from ucp_jax.models._hf_reader import Reader


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


FAMILIES = (
  Family(
    model_type="gpt2",
    defaults={"vocab_size": 50257, "tie_word_embeddings": True, "n_positions": 1024, "n_embd": 768}
    | {"n_layer": 12, "n_head": 12, "n_inner": None, "activation_function": "gelu_new"}
    | {"layer_norm_epsilon": 1e-5, "scale_attn_weights": True}
    | {"scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False},
    read=_gpt2,
    names=("transformer.", ("wte.", "h.")),
    rules=rulesets.gpt2_for,
    model="gpt.FlaxGPT",
  ),
)
