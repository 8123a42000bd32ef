"""Ready rule sets for Hugging Face `transformers` names <-> the Flax NNX models in `ucp_jax.models`.

`hf_llama` covers the decoders that share Llama's names (Llama, Mistral, Qwen2 with its
q/k/v biases, Qwen3 with its q/k norms, Gemma); `hf_gpt2` covers GPT-2, whose `Conv1D`
weights are stored `[in, out]`, the Flax layout, where a `Linear`'s are `[out, in]`:
they are split into heads but never transposed. `ucp_jax.rules.from_hf` picks the set
and the model config from a `config.json`.
"""

from __future__ import annotations

import re
from typing import Any

from ucp_jax import _errors
from ucp_jax.mapping._mapping import RuleSet
from ucp_jax.mapping._rule import Rule
from ucp_jax.mapping._rulesets import layer_rules
from ucp_jax.mapping._transforms import Split, Transpose

_T = Transpose()


def hf_llama(
  *,
  num_heads: int,
  num_kv_heads: int,
  tied: bool = False,
  stacked: bool = False,
  prefix: str = "model.",
) -> RuleSet:
  """Rules between a `transformers` Llama-style state dict and `ucp_jax.models.llama.FlaxLlama`.

  Names: `model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`
  (and `.bias` where the model has them: Qwen2's q/k/v, Llama's `attention_bias`),
  `model.layers.{i}.self_attn.{q,k}_norm.weight` (Qwen3),
  `model.layers.{i}.mlp.{gate,up,down}_proj.weight` (and `.bias`: `mlp_bias`),
  `model.layers.{i}.{input,post_attention}_layernorm.weight`, `model.norm.weight`,
  `lm_head.weight`. Llama, Mistral, Qwen2, Qwen3 and Gemma all use these names; the model
  config (`ucp_jax.rules.from_hf`) says what differs. Old checkpoints' per-layer
  `rotary_emb.inv_freq` buffers are dropped.

  Example:
    >>> from ucp_jax import rules
    >>> rs = rules.hf_llama(num_heads=8, num_kv_heads=2)
    >>> rs.map_names(["model.layers.0.self_attn.k_proj.bias", "lm_head.weight"])
    {'layers/0/attn/k/bias': ('model.layers.0.self_attn.k_proj.bias',), 'lm_head/kernel': ('lm_head.weight',)}
    >>> rules.hf_llama(num_heads=8, num_kv_heads=2, tied=True).map_names(["lm_head.weight"])
    {}

  Args:
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention).
    tied: `lm_head.weight` is a copy of the embeddings (`tie_word_embeddings`): not read,
      and written back from `embed/embedding` on export; otherwise it is `lm_head/kernel`.
    stacked: one array per parameter with a leading layer axis (`nnx.scan`).
    prefix: what precedes `embed_tokens`, `layers` and `norm` in the names: `model.` for
      the `...ForCausalLM` classes, `""` for a bare `LlamaModel`.
  """
  _check_options(
    "hf_llama",
    num_heads=num_heads,
    num_kv_heads=num_kv_heads,
    tied=tied,
    stacked=stacked,
    prefix=prefix,
  )
  q, kv = (num_heads, -1), (num_kv_heads, -1)
  table = [
    ("self_attn.q_proj.weight", "attn/q/kernel", [_T, Split(1, q)]),
    ("self_attn.k_proj.weight", "attn/k/kernel", [_T, Split(1, kv)]),
    ("self_attn.v_proj.weight", "attn/v/kernel", [_T, Split(1, kv)]),
    ("self_attn.o_proj.weight", "attn/o/kernel", [_T, Split(0, q)]),
    ("self_attn.q_proj.bias", "attn/q/bias", [Split(0, q)]),
    ("self_attn.k_proj.bias", "attn/k/bias", [Split(0, kv)]),
    ("self_attn.v_proj.bias", "attn/v/bias", [Split(0, kv)]),
    ("self_attn.o_proj.bias", "attn/o/bias", []),
    ("self_attn.q_norm.weight", "attn/q_norm/scale", []),
    ("self_attn.k_norm.weight", "attn/k_norm/scale", []),
    ("mlp.gate_proj.weight", "mlp/gate/kernel", [_T]),
    ("mlp.up_proj.weight", "mlp/up/kernel", [_T]),
    ("mlp.down_proj.weight", "mlp/down/kernel", [_T]),
    ("mlp.gate_proj.bias", "mlp/gate/bias", []),
    ("mlp.up_proj.bias", "mlp/up/bias", []),
    ("mlp.down_proj.bias", "mlp/down/bias", []),
    ("input_layernorm.weight", "attn_norm/scale", []),
    ("post_attention_layernorm.weight", "mlp_norm/scale", []),
  ]
  p = re.escape(prefix)
  return RuleSet(
    [
      Rule(p + r"embed_tokens\.weight", "embed/embedding"),
      *layer_rules(p + "layers", "layers", table, stacked),
      Rule(p + r"layers\.(\d+)\.self_attn\.rotary_emb\.inv_freq", None),
      Rule(p + r"norm\.weight", "norm/scale"),
      _head("embed/embedding", tied),
    ]
  )


def hf_gpt2(
  *, num_heads: int, tied: bool = True, stacked: bool = False, prefix: str = "transformer."
) -> RuleSet:
  """Rules between a `transformers` GPT-2 state dict and `ucp_jax.models.gpt.FlaxGPT`.

  Names: `transformer.wte.weight`, `transformer.wpe.weight`,
  `transformer.h.{i}.ln_1.{weight,bias}`, `transformer.h.{i}.attn.c_attn.{weight,bias}`
  (q, k and v in one `Conv1D`, `[d, 3 * d]`), `transformer.h.{i}.attn.c_proj.{weight,bias}`,
  `transformer.h.{i}.ln_2.{weight,bias}`, `transformer.h.{i}.mlp.c_fc.{weight,bias}`,
  `transformer.h.{i}.mlp.c_proj.{weight,bias}`, `transformer.ln_f.{weight,bias}` and
  `lm_head.weight`, tied to `wte`. `Conv1D` weights are `[in, out]` already: they are not
  transposed (a `Linear`'s rule would transpose them, and on the square `attn.c_proj`
  the shapes could not tell; `ucp_jax.rules.check_forward` can). The attention-mask
  buffers of old checkpoints (`attn.bias`, `attn.masked_bias`) are dropped.

  Example:
    >>> from ucp_jax import rules
    >>> rs = rules.hf_gpt2(num_heads=12)
    >>> rs.map_names(["transformer.h.3.attn.c_attn.weight", "transformer.h.3.attn.bias"])
    {'blocks/3/attn/qkv/kernel': ('transformer.h.3.attn.c_attn.weight',)}

  Args:
    num_heads: attention heads (the head axis of the qkv and proj kernels).
    tied: `lm_head.weight` is a copy of `wte` (GPT-2's `tie_word_embeddings`); otherwise
      it is `lm_head/kernel`.
    stacked: one array per parameter with a leading layer axis (`nnx.scan`).
    prefix: what precedes `wte`, `h` and `ln_f` in the names: `transformer.` for
      `GPT2LMHeadModel`, `""` for a bare `GPT2Model` (the original `gpt2` checkpoints).
  """
  _check_options("hf_gpt2", num_heads=num_heads, tied=tied, stacked=stacked, prefix=prefix)
  heads = (num_heads, -1)
  table = [
    ("ln_1.weight", "ln_1/scale", []),
    ("ln_1.bias", "ln_1/bias", []),
    ("attn.c_attn.weight", "attn/qkv/kernel", [Split(1, (3, *heads))]),
    ("attn.c_attn.bias", "attn/qkv/bias", [Split(0, (3, *heads))]),
    ("attn.c_proj.weight", "attn/proj/kernel", [Split(0, heads)]),
    ("attn.c_proj.bias", "attn/proj/bias", []),
    ("ln_2.weight", "ln_2/scale", []),
    ("ln_2.bias", "ln_2/bias", []),
    ("mlp.c_fc.weight", "mlp/fc/kernel", []),
    ("mlp.c_fc.bias", "mlp/fc/bias", []),
    ("mlp.c_proj.weight", "mlp/proj/kernel", []),
    ("mlp.c_proj.bias", "mlp/proj/bias", []),
  ]
  p = re.escape(prefix)
  return RuleSet(
    [
      Rule(p + r"wte\.weight", "wte/embedding"),
      Rule(p + r"wpe\.weight", "wpe/embedding"),
      *layer_rules(p + "h", "blocks", table, stacked),
      Rule(p + r"h\.(\d+)\.attn\.(?:bias|masked_bias)", None),
      Rule(p + r"ln_f\.weight", "ln_f/scale"),
      Rule(p + r"ln_f\.bias", "ln_f/bias"),
      _head("wte/embedding", tied),
    ]
  )


def _check_options(function: str, **options: Any) -> None:
  """Raises `InvalidArgumentError` naming every option of the wrong type (from a config.json
  or a command line, they may be anything)."""
  wants = {"num_heads": "a positive integer", "num_kv_heads": "a positive integer"}
  wants |= {"tied": "true or false", "stacked": "true or false", "prefix": "a string"}
  bad = [
    f"{name}={value!r} is not {wants[name]}"
    for name, value in options.items()
    if not _fits(wants[name], value)
  ]
  if bad:
    raise _errors.InvalidArgumentError(f"{function}: {'; '.join(bad)}")


def _fits(want: str, value: Any) -> bool:
  if want == "true or false":
    return isinstance(value, bool)
  if want == "a string":
    return isinstance(value, str)
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _head(embedding: str, tied: bool) -> Rule:
  if tied:
    return Rule(r"lm_head\.weight", embedding, tied=True)
  return Rule(r"lm_head\.weight", "lm_head/kernel", [_T])
