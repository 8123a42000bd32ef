"""What the mixture-of-experts families' `config.json` readers share (`ucp_jax.families`:
Mixtral, Qwen2-MoE, Qwen3-MoE): sizes, experts and their top k, dense layers, sliding and
full layers, and the `MoeConfig` they make, each field read as `transformers` 5.24 reads it.
"""

from __future__ import annotations

from collections.abc import Callable

from ucp_jax.base._errors import shown
from ucp_jax.models import _configs, _hf, _hf_rope
from ucp_jax.models._hf_reader import MAX_SIZE, Reader, is_int


def sizes(r: Reader) -> dict:
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


def common(r: Reader) -> dict:
  return {
    "eps": r.number("rms_norm_eps"),
    "act": r.act("hidden_act"),
    "tie_embeddings": r.flag("tie_word_embeddings"),
  }


def rope(r: Reader, head_dim: int) -> dict:
  theta, scaling, factor = _hf_rope.read(r, _hf_rope.params(r), head_dim=head_dim, partial=False)
  return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary": factor}


def windows(r: Reader, layers: int, window: int | None, default) -> dict:
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


def experts(r: Reader, *keys: str) -> dict:
  """The experts' count (the first of `keys` the file has, else the first's default) and top k."""
  count = r.size(next((k for k in keys if r.present(k)), keys[0]))
  top_k = r.size("num_experts_per_tok")
  r.refuse(top_k > count, f"`num_experts_per_tok` {top_k} exceeds the {count} experts")
  return {"num_experts": count, "top_k": top_k}


def sparse_layers(r: Reader, layers: int) -> tuple[int, ...]:
  """The dense layers of a Qwen MoE: `mlp_only_layers`, and those off `decoder_sparse_step`."""
  step = r("decoder_sparse_step")
  if not is_int(step, 1, MAX_SIZE):
    r.problem(f"`decoder_sparse_step`: {shown(step)} is not a positive integer")
    step = 1
  only = r("mlp_only_layers")
  if not (isinstance(only, list) and all(is_int(i, 0, MAX_SIZE) for i in only)):
    r.problem(f"`mlp_only_layers`: {shown(only)} is not a list of layer numbers")
    only = []
  r.refuse(layers > _hf.MAX_LAYER_LIST and (step != 1 or bool(only)), "too many layers to list")
  if step == 1 and not only:
    return ()
  return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def make(*parts: dict) -> Callable[[], _configs.MoeConfig]:
  fields: dict = {}
  for part in parts:
    fields |= part
  return lambda: _configs.MoeConfig(**fields)
