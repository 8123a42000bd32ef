"""Ready rule sets: PyTorch GPT-2 and Llama names <-> the Flax NNX models in `ucp_jax.models`.

Torch `Linear.weight` is `[out, in]`; the Flax kernels are `[in, out]` with the
attention heads as their own axes (`qkv/kernel [d, 3, heads, head_dim]`,
`o/kernel [heads, head_dim, d]`), so a tensor-parallel mesh can shard heads.
With `stacked=True` the per-layer arrays become one array with a leading layer
axis (`blocks/attn/qkv/kernel [layers, d, 3, heads, head_dim]`) for `nnx.scan`.
"""

from __future__ import annotations

from ucp_jax.mapping._mapping import RuleSet
from ucp_jax.mapping._rule import Rule
from ucp_jax.mapping._transforms import Split, Stack, SubParam, Transpose

_T = Transpose()


def layer_rules(prefix_regex: str, prefix_key: str, table, stacked: bool) -> list[Rule]:
  """Per-layer rules: `{prefix}.{i}.{name}` -> `{key}/{i}/{target}` or, stacked, `{key}/{target}`."""
  out = []
  for name, target, transforms in table:
    source = prefix_regex + r"\.(\d+)\." + name.replace(".", r"\.")
    if stacked:  # stack first: one view of the stack is split, not every layer's view
      subs = [t for t in transforms if isinstance(t, SubParam)]  # a sub-parameter: per layer
      rest = [_behind_layer_axis(t) for t in transforms if not isinstance(t, SubParam)]
      stacked_transforms = [*subs, Stack(0), *rest]
      out.append(Rule(source, f"{prefix_key}/{target}", stacked_transforms))
    else:
      out.append(Rule(source, f"{prefix_key}/{{0}}/{target}", transforms))
  return out


def _behind_layer_axis(t):
  """A per-layer (matrix or vector) transform, for the same arrays with a layer axis in front."""
  if isinstance(t, Transpose):
    return Transpose((0, 2, 1))
  return Split(t.axis + 1, t.sizes)


def gpt2(*, num_heads: int, stacked: bool = False) -> RuleSet:
  """Rules between a torch GPT-2 state dict and `ucp_jax.models.gpt.FlaxGPT`.

  Torch names: `wte.weight`, `wpe.weight`, `h.{i}.ln_1.weight/bias`,
  `h.{i}.attn.qkv.weight/bias` (one `Linear(d, 3d)`), `h.{i}.attn.proj.weight/bias`,
  `h.{i}.ln_2.weight/bias`, `h.{i}.mlp.fc.weight/bias`, `h.{i}.mlp.proj.weight/bias`,
  `ln_f.weight/bias`, and `lm_head.weight` tied to `wte.weight`.

  Example:
    >>> from ucp_jax import rules
    >>> rs = rules.gpt2(num_heads=12)
    >>> rs.map_names(["h.3.attn.qkv.weight"])
    {'blocks/3/attn/qkv/kernel': ('h.3.attn.qkv.weight',)}
    >>> rules.gpt2(num_heads=12, stacked=True).map_names(["h.0.mlp.fc.bias", "h.1.mlp.fc.bias"])
    {'blocks/mlp/fc/bias': ('h.0.mlp.fc.bias', 'h.1.mlp.fc.bias')}

  Args:
    num_heads: attention heads (the head axis of the qkv and proj kernels).
    stacked: one array per parameter with a leading layer axis (`nnx.scan`), or
      one per layer (`blocks/{i}/...`).

  Returns:
    A `RuleSet` between the torch twin's names (`h.{i}.attn.qkv.weight`, ...) and `FlaxGPT`'s keys.

  Raises:
    MappingError: raised later, where the rules are applied (`restore`, `load_into`,
      `import_arrays`), for arrays they do not fit (a head count that does not divide a
      width, say); every such name is listed at once.
  """
  heads = (num_heads, -1)
  table = [
    ("ln_1.weight", "ln_1/scale", []),
    ("ln_1.bias", "ln_1/bias", []),
    ("attn.qkv.weight", "attn/qkv/kernel", [_T, Split(1, (3, *heads))]),
    ("attn.qkv.bias", "attn/qkv/bias", [Split(0, (3, *heads))]),
    ("attn.proj.weight", "attn/proj/kernel", [_T, Split(0, heads)]),
    ("attn.proj.bias", "attn/proj/bias", []),
    ("ln_2.weight", "ln_2/scale", []),
    ("ln_2.bias", "ln_2/bias", []),
    ("mlp.fc.weight", "mlp/fc/kernel", [_T]),
    ("mlp.fc.bias", "mlp/fc/bias", []),
    ("mlp.proj.weight", "mlp/proj/kernel", [_T]),
    ("mlp.proj.bias", "mlp/proj/bias", []),
  ]
  return RuleSet(
    [
      Rule(r"wte\.weight", "wte/embedding"),
      Rule(r"wpe\.weight", "wpe/embedding"),
      *layer_rules("h", "blocks", table, stacked),
      Rule(r"ln_f\.weight", "ln_f/scale"),
      Rule(r"ln_f\.bias", "ln_f/bias"),
      Rule(r"lm_head\.weight", "wte/embedding", tied=True),
    ]
  )


def llama(*, num_heads: int, num_kv_heads: int, stacked: bool = False) -> RuleSet:
  """Rules between a torch Llama state dict and `ucp_jax.models.llama.FlaxLlama`.

  Torch names: `embed_tokens.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj.weight`
  (grouped-query: k and v have `num_kv_heads` heads), `layers.{i}.mlp.{gate,up,down}_proj.weight`,
  `layers.{i}.input_layernorm.weight`, `layers.{i}.post_attention_layernorm.weight`,
  `norm.weight`, `lm_head.weight` (untied).

  Example:
    >>> from ucp_jax import rules
    >>> rules.llama(num_heads=8, num_kv_heads=2).map_names(["layers.0.self_attn.k_proj.weight"])
    {'layers/0/attn/k/kernel': ('layers.0.self_attn.k_proj.weight',)}

  Args:
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention).
    stacked: one array per parameter with a leading layer axis (`nnx.scan`).

  Returns:
    A `RuleSet` between the torch twin's names (`layers.{i}.self_attn.q_proj.weight`, ...) and `FlaxLlama`'s keys.

  Raises:
    MappingError: raised later, where the rules are applied (`restore`, `load_into`,
      `import_arrays`), for arrays they do not fit (a head count that does not divide a
      width, say); every such name is listed at once.
  """
  table = [
    ("self_attn.q_proj.weight", "attn/q/kernel", [_T, Split(1, (num_heads, -1))]),
    ("self_attn.k_proj.weight", "attn/k/kernel", [_T, Split(1, (num_kv_heads, -1))]),
    ("self_attn.v_proj.weight", "attn/v/kernel", [_T, Split(1, (num_kv_heads, -1))]),
    ("self_attn.o_proj.weight", "attn/o/kernel", [_T, Split(0, (num_heads, -1))]),
    ("mlp.gate_proj.weight", "mlp/gate/kernel", [_T]),
    ("mlp.up_proj.weight", "mlp/up/kernel", [_T]),
    ("mlp.down_proj.weight", "mlp/down/kernel", [_T]),
    ("input_layernorm.weight", "attn_norm/scale", []),
    ("post_attention_layernorm.weight", "mlp_norm/scale", []),
  ]
  return RuleSet(
    [
      Rule(r"embed_tokens\.weight", "embed/embedding"),
      *layer_rules("layers", "layers", table, stacked),
      Rule(r"norm\.weight", "norm/scale"),
      Rule(r"lm_head\.weight", "lm_head/kernel", [_T]),
    ]
  )
