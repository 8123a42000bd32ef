"""Ready rule sets for Hugging Face `transformers` names <-> the Flax NNX models in `ucp_jax.models`.

`hf_llama` covers the decoders that share Llama's names (Llama, Mistral, Qwen2 with its
q/k/v biases, Qwen3 with its q/k norms, Gemma 1/2/3 with their sandwich norms, OLMo 2 with
its post-norms, Phi-3 with its fused `qkv_proj` and `gate_up_proj`, read as sub-parameters);
`hf_gpt_neox` covers GPT-NeoX; `hf_gpt2` covers GPT-2, whose `Conv1D` weights are stored
`[in, out]`, the Flax layout, where a `Linear`'s are `[out, in]`: they are split into heads
but never transposed. `ucp_jax.families` gives each `model_type`'s set from its Flax config;
`ucp_jax.rules.from_hf` picks the set and the model config from a `config.json`.
"""

from __future__ import annotations

import re
from typing import Any

from ucp_jax.base import _errors
from ucp_jax.mapping._mapping import RuleSet
from ucp_jax.mapping._rule import Rule
from ucp_jax.mapping._rulesets import layer_rules
from ucp_jax.mapping._transforms import Split, SubParam, Transpose

_T = Transpose()

NORM_NAMES = {
  "pre": (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")),
  "sandwich": (
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "attn_post_norm"),
    ("pre_feedforward_layernorm", "mlp_norm"),
    ("post_feedforward_layernorm", "mlp_post_norm"),
  ),
  "post": (
    ("post_attention_layernorm", "attn_post_norm"),
    ("post_feedforward_layernorm", "mlp_post_norm"),
  ),
}
"""Each `norms` layout's `transformers` layer-norm names and the Flax layer's norm keys (one
name, two meanings: Llama's `post_attention_layernorm` comes before the MLP, Gemma 2's and
OLMo 2's after attention)."""


def hf_llama(
  *,
  num_heads: int,
  num_kv_heads: int,
  tied: bool = False,
  stacked: bool = False,
  prefix: str = "model.",
  norms: str = "pre",
  qk_norm: str = "head",
  fused: bool = False,
) -> RuleSet:
  """Rules between a `transformers` Llama-style state dict and `ucp_jax.models.llama.FlaxLlama`.

  Names: `model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`
  (and `.bias` where the model has them: Qwen2's q/k/v, Llama's `attention_bias`),
  `model.layers.{i}.self_attn.{q,k}_norm.weight` (Qwen3),
  `model.layers.{i}.mlp.{gate,up,down}_proj.weight` (and `.bias`: `mlp_bias`),
  `model.layers.{i}.{input,post_attention}_layernorm.weight` (Gemma 2/3 also
  `{pre,post}_feedforward_layernorm`; OLMo 2 `post_attention` and `post_feedforward` only),
  `model.norm.weight`, `lm_head.weight`; Phi-3's `self_attn.qkv_proj.weight` and
  `mlp.gate_up_proj.weight` (`fused=True`). Llama, Mistral, Qwen2, Qwen3, Gemma 1/2/3,
  Phi-3 and OLMo 2 use these names; the model config (`ucp_jax.rules.from_hf`) says what
  differs. Old checkpoints' per-layer `rotary_emb.inv_freq` buffers are dropped.

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
    norms: which layer norms there are, as the Flax model's `LlamaConfig.norms`: `"pre"`
      (`input_layernorm`, then `post_attention_layernorm` before the MLP), `"sandwich"`
      (Gemma 2/3: also `post_attention_layernorm` after attention, `pre_feedforward_layernorm`
      and `post_feedforward_layernorm`), `"post"` (OLMo 2: `post_attention_layernorm` and
      `post_feedforward_layernorm` after each).
    qk_norm: `"head"` (a `q_norm`/`k_norm` weight per head width) or `"all"` (OLMo 2's, over
      the whole projection, split into heads here).
    fused: Phi-3's names: `self_attn.qkv_proj.weight` (queries, keys and values stacked) and
      `mlp.gate_up_proj.weight` (gate, then up), each read as sub-parameters (lazily: a view
      of each slice) and fused again on export.

  Returns:
    A `RuleSet` between `transformers` Llama-family names and `FlaxLlama`'s keys.

  Raises:
    InvalidArgumentError: `norms` or `qk_norm` is none of the values above, or `prefix` is not a string.
    MappingError: raised later, where the rules are applied (`restore`, `load_into`,
      `import_arrays`), for arrays they do not fit (a head count that does not divide a
      width, say); every such name is listed at once.
  """
  _check_options(
    "hf_llama",
    num_heads=num_heads,
    num_kv_heads=num_kv_heads,
    tied=tied,
    stacked=stacked,
    prefix=prefix,
    fused=fused,
  )
  if norms not in NORM_NAMES or qk_norm not in ("head", "all"):
    raise _errors.InvalidArgumentError(
      f"hf_llama: norms={norms!r} (one of {', '.join(NORM_NAMES)}), qk_norm={qk_norm!r} "
      "(head or all)"
    )
  q, kv = (num_heads, -1), (num_kv_heads, -1)
  if fused:
    qkv, halves = (num_heads, num_kv_heads, num_kv_heads), (1, 1)
    proj = [
      ("self_attn.qkv_proj.weight", f"attn/{n}/kernel", [SubParam(0, qkv, i), _T, Split(1, h)])
      for i, (n, h) in enumerate((("q", q), ("k", kv), ("v", kv)))
    ]
    proj += [
      ("mlp.gate_up_proj.weight", f"mlp/{n}/kernel", [SubParam(0, halves, i), _T])
      for i, n in enumerate(("gate", "up"))
    ]
  else:
    proj = [
      ("self_attn.q_proj.weight", "attn/q/kernel", [_T, Split(1, q)]),
      ("self_attn.k_proj.weight", "attn/k/kernel", [_T, Split(1, kv)]),
      ("self_attn.v_proj.weight", "attn/v/kernel", [_T, Split(1, kv)]),
      ("mlp.gate_proj.weight", "mlp/gate/kernel", [_T]),
      ("mlp.up_proj.weight", "mlp/up/kernel", [_T]),
    ]
  per_head = qk_norm == "head"
  table = [
    *proj,
    ("self_attn.o_proj.weight", "attn/o/kernel", [_T, Split(0, q)]),
    ("self_attn.q_proj.bias", "attn/q/bias", [Split(0, q)]),
    ("self_attn.k_proj.bias", "attn/k/bias", [Split(0, kv)]),
    ("self_attn.v_proj.bias", "attn/v/bias", [Split(0, kv)]),
    ("self_attn.o_proj.bias", "attn/o/bias", []),
    ("self_attn.q_norm.weight", "attn/q_norm/scale", [] if per_head else [Split(0, q)]),
    ("self_attn.k_norm.weight", "attn/k_norm/scale", [] if per_head else [Split(0, kv)]),
    ("mlp.down_proj.weight", "mlp/down/kernel", [_T]),
    ("mlp.gate_proj.bias", "mlp/gate/bias", []),
    ("mlp.up_proj.bias", "mlp/up/bias", []),
    ("mlp.down_proj.bias", "mlp/down/bias", []),
    *((f"{name}.weight", f"{key}/scale", []) for name, key in NORM_NAMES[norms]),
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

  Returns:
    A `RuleSet` between `transformers` GPT-2 names and `FlaxGPT`'s keys.

  Raises:
    InvalidArgumentError: `prefix` is not a string.
    MappingError: raised later, where the rules are applied (`restore`, `load_into`,
      `import_arrays`), for arrays they do not fit (a head count that does not divide a
      width, say); every such name is listed at once.
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


def hf_gpt_neox(
  *,
  num_heads: int,
  tied: bool = False,
  stacked: bool = False,
  prefix: str = "gpt_neox.",
  head: str = "lm_head",
) -> RuleSet:
  """Rules between a `transformers` GPT-NeoX state dict and `ucp_jax.models.neox.FlaxNeoX`.

  Names: `gpt_neox.embed_in.weight`, `gpt_neox.layers.{i}.{input,post_attention}_layernorm.
  {weight,bias}`, `gpt_neox.layers.{i}.attention.query_key_value.{weight,bias}` (per head:
  its query, key and value side by side, `[heads * 3 * head_dim, d]`),
  `gpt_neox.layers.{i}.attention.dense.{weight,bias}`, `gpt_neox.layers.{i}.mlp.
  dense_h_to_4h.{weight,bias}`, `...mlp.dense_4h_to_h.{weight,bias}`,
  `gpt_neox.final_layer_norm.{weight,bias}` and the head, `lm_head.weight` (transformers 5)
  or `embed_out.weight` (the Pythia checkpoints). Old checkpoints' attention buffers
  (`attention.bias`, `attention.masked_bias`, `attention.rotary_emb.inv_freq`) are dropped.

  Example:
    >>> from ucp_jax import rules
    >>> rs = rules.hf_gpt_neox(num_heads=8, head="embed_out")
    >>> rs.map_names(["gpt_neox.layers.0.attention.query_key_value.weight", "embed_out.weight"])
    {'layers/0/attn/qkv/kernel': ('gpt_neox.layers.0.attention.query_key_value.weight',), 'lm_head/kernel': ('embed_out.weight',)}

  Args:
    num_heads: attention heads.
    tied: the head is a copy of `embed_in` (`tie_word_embeddings`).
    stacked: one array per parameter with a leading layer axis (`nnx.scan`).
    prefix: what precedes `embed_in`, `layers` and `final_layer_norm`.
    head: the head's name, `lm_head` or `embed_out`.

  Returns:
    A `RuleSet` between `transformers` GPT-NeoX names and `FlaxNeoX`'s keys.

  Raises:
    InvalidArgumentError: `head` is neither `lm_head` nor `embed_out`, or `prefix` is not a string.
    MappingError: raised later, where the rules are applied (`restore`, `load_into`,
      `import_arrays`), for arrays they do not fit (a head count that does not divide a
      width, say); every such name is listed at once.
  """
  _check_options("hf_gpt_neox", num_heads=num_heads, tied=tied, stacked=stacked, prefix=prefix)
  if head not in ("lm_head", "embed_out"):
    raise _errors.InvalidArgumentError(f"hf_gpt_neox: head={head!r} (lm_head or embed_out)")
  heads = (num_heads, -1)
  table = [
    ("attention.query_key_value.weight", "attn/qkv/kernel", [_T, Split(1, (num_heads, 3, -1))]),
    ("attention.query_key_value.bias", "attn/qkv/bias", [Split(0, (num_heads, 3, -1))]),
    ("attention.dense.weight", "attn/o/kernel", [_T, Split(0, heads)]),
    ("attention.dense.bias", "attn/o/bias", []),
    ("mlp.dense_h_to_4h.weight", "mlp/up/kernel", [_T]),
    ("mlp.dense_h_to_4h.bias", "mlp/up/bias", []),
    ("mlp.dense_4h_to_h.weight", "mlp/down/kernel", [_T]),
    ("mlp.dense_4h_to_h.bias", "mlp/down/bias", []),
  ]
  for name, key in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")):
    table += [(f"{name}.weight", f"{key}/scale", []), (f"{name}.bias", f"{key}/bias", [])]
  p = re.escape(prefix)
  if tied:
    head_rule = Rule(re.escape(head) + r"\.weight", "embed/embedding", tied=True)
  else:
    head_rule = Rule(re.escape(head) + r"\.weight", "lm_head/kernel", [_T])
  return RuleSet(
    [
      Rule(p + r"embed_in\.weight", "embed/embedding"),
      *layer_rules(p + "layers", "layers", table, stacked),
      Rule(p + r"layers\.(\d+)\.attention\.(?:bias|masked_bias|rotary_emb\.inv_freq)", None),
      Rule(p + r"final_layer_norm\.weight", "norm/scale"),
      Rule(p + r"final_layer_norm\.bias", "norm/bias"),
      head_rule,
    ]
  )


def llama_like(cfg, **options: Any) -> RuleSet:
  """`hf_llama` for a Llama-like Flax config (`models.llama.LlamaConfig`)."""
  fused = options.pop("fused", False)
  qk = "all" if cfg.qk_norm == "all" else "head"
  return hf_llama(
    num_heads=cfg.num_heads,
    num_kv_heads=cfg.num_kv_heads,
    tied=cfg.tie_embeddings,
    norms=cfg.norms,
    qk_norm=qk,
    fused=fused,
    **options,
  )


def fused_llama_like(cfg, **options: Any) -> RuleSet:
  """`llama_like` with fused qkv and gate_up weights (Phi-3's)."""
  return llama_like(cfg, fused=True, **options)


def gpt2_for(cfg, **options: Any) -> RuleSet:
  """`hf_gpt2` for a `models.gpt.GPTConfig`."""
  return hf_gpt2(num_heads=cfg.num_heads, tied=cfg.tie_embeddings, **options)


def gpt_neox_for(cfg, **options: Any) -> RuleSet:
  """`hf_gpt_neox` for a `models.neox.NeoXConfig`."""
  return hf_gpt_neox(num_heads=cfg.num_heads, tied=cfg.tie_embeddings, **options)


def gpt_neox_head(names: list[str] | None) -> dict[str, Any]:
  """The head's name in the weight names: `embed_out` in the Pythia checkpoints."""
  return {"head": "embed_out"} if names and "embed_out.weight" in names else {}


def _check_options(function: str, **options: Any) -> None:
  """Raises `InvalidArgumentError` naming every option of the wrong type (from a config.json
  or a command line, they may be anything)."""
  wants = {"num_heads": "a positive integer", "num_kv_heads": "a positive integer"}
  wants |= {"tied": "true or false", "stacked": "true or false", "prefix": "a string"}
  wants |= {"fused": "true or false"}
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
