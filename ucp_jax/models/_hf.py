"""What the Llama-like families' `config.json` readers share (`ucp_jax.families`): sizes and
heads, norms and activations, RoPE, causal attention, sliding and full layers, and the Flax
config they make. Every field is read as `transformers` 5.24 reads it (its config class's
defaults for absent fields, `null` where it means something, legacy spellings), problems
collected in the `Reader`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ucp_jax.models import _configs, _hf_rope
from ucp_jax.models._hf_reader import MAX_SIZE as MAX_SIZE
from ucp_jax.models._hf_reader import Reader

MAX_LAYER_LIST = 1 << 16
"""The most layers a config may mix sliding and full attention over (a per-layer list)."""

_SIZES: tuple[str, ...] = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
_SIZES += ("num_attention_heads", "num_key_value_heads")


def defaults(sizes: tuple, **fields: Any) -> dict[str, Any]:
  return dict(zip(_SIZES, sizes)) | fields


def sizes(r: Reader) -> dict[str, Any]:
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


def common(r: Reader, act: str = "hidden_act") -> dict[str, Any]:
  # Only Gemma's attention reads `use_bidirectional_attention` (refused there, `causal`);
  # the others ignore it, as transformers does, once it is checked for its type
  r.flag("use_bidirectional_attention")
  return {
    "eps": r.number("rms_norm_eps"),
    "act": r.act(act),
    "tie_embeddings": r.flag("tie_word_embeddings"),
  }


def rope(r: Reader, head_dim: int, *, partial: bool = False, **kwargs) -> dict[str, Any]:
  theta, scaling, factor = _hf_rope.read(
    r, _hf_rope.params(r, **kwargs), head_dim=head_dim, partial=partial
  )
  return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary": factor}


def causal(r: Reader) -> None:
  r.refuse(r.flag("use_bidirectional_attention"), "bidirectional attention is not causal")


def windows(r: Reader, layers: int, window: int | None, default) -> dict[str, Any]:
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


def make(*parts: dict) -> Callable[[], _configs.LlamaConfig]:
  fields: dict[str, Any] = {}
  for part in parts:
    fields |= part
  return lambda: _configs.LlamaConfig(**fields)
