"""Ready rule sets for mixture-of-experts models: `transformers` names <-> `models.moe.FlaxMoe`.

The experts of a layer become one stacked array per weight (`layers/{i}/mlp/experts/gate`,
`up`: `[num_experts, d_model, expert_hidden]`, `down`: `[num_experts, expert_hidden,
d_model]`), whatever layout the names have (`experts`):

| layout | names (Mixtral; Qwen2/3-MoE alike) | read |
|---|---|---|
| `split` | `block_sparse_moe.experts.{e}.w1.weight` (w1 gate, w3 up, w2 down; Qwen: `mlp.experts.{e}.{gate,up,down}_proj.weight`): the Hub's files, what `save_pretrained` writes | stacked lazily, one view per expert |
| `fused` | `mlp.experts.gate_up_proj` `[E, 2 * hidden, d]`, `mlp.experts.down_proj` `[E, d, hidden]`: transformers 5's modules (`state_dict()`) | gate and up as sub-parameter views, transposed |
| `autoep` | `mlp.router.gate.weight`, `mlp.experts.w1`/`w3` `[E, hidden, d]`, `w2` `[E, d, hidden]`: DeepSpeed AutoEP's | transposed views |

Export writes the same layout back (split: one array per expert). With `stacked=True` a second
stage stacks the layers (`[layers, num_experts, ...]`), so per-expert names stack twice.
"""

from __future__ import annotations

import re
from typing import Any

from ucp_jax.base import _errors
from ucp_jax.mapping._hf_rulesets import hf_llama
from ucp_jax.mapping._mapping import RuleSet
from ucp_jax.mapping._rule import Rule
from ucp_jax.mapping._rulesets import layer_rules
from ucp_jax.mapping._transforms import Stack, SubParam, Transpose

EXPERT_LAYOUTS = ("split", "fused", "autoep")
_T = Transpose()
_T3 = Transpose((0, 2, 1))
_SPLIT_NAMES = {  # family -> (module of the block, router, expert weight names gate/up/down)
  "mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
  "qwen2_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
  "qwen3_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
}


def hf_moe(
  *,
  family: str,
  num_heads: int,
  num_kv_heads: int,
  tied: bool = False,
  stacked: bool = False,
  prefix: str = "model.",
  experts: str = "split",
  qk_norm: bool = False,
) -> RuleSet:
  """Rules between a `transformers` Mixtral, Qwen2-MoE or Qwen3-MoE and `FlaxMoe`.

  Example:
    >>> from ucp_jax import rules
    >>> rs = rules.hf_moe(family="mixtral", num_heads=4, num_kv_heads=2)
    >>> rs.map_names([f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in range(2)])
    {'layers/0/mlp/experts/gate': ('model.layers.0.block_sparse_moe.experts.0.w1.weight', 'model.layers.0.block_sparse_moe.experts.1.w1.weight')}

  Args:
    family: `mixtral`, `qwen2_moe` or `qwen3_moe`.
    num_heads: query heads.
    num_kv_heads: key/value heads.
    tied: `lm_head.weight` is a copy of the embeddings.
    stacked: for a model built with `scan=True` (`[layers, ...]`, experts `[layers, E, ...]`).
    prefix: what precedes `embed_tokens`, `layers` and `norm` (`model.`, or `""`).
    experts: the experts' layout, one of `EXPERT_LAYOUTS` (see the module docstring).
    qk_norm: the attention has Qwen3's per-head query and key norms (their rules are
      there either way; this only documents the family).

  Returns:
    A `RuleSet` between the family's `transformers` names and `FlaxMoe`'s keys.

  Raises:
    InvalidArgumentError: `family` or `experts` is none of the values above.
    MappingError: raised later, where the rules are applied (`restore`, `load_into`,
      `import_arrays`), for arrays they do not fit (a head count that does not divide a
      width, say); every such name is listed at once.
  """
  if family not in _SPLIT_NAMES or experts not in EXPERT_LAYOUTS:
    raise _errors.InvalidArgumentError(
      f"hf_moe: family={family!r} (one of {', '.join(_SPLIT_NAMES)}), experts={experts!r} "
      f"(one of {', '.join(EXPERT_LAYOUTS)})"
    )
  del qk_norm
  base = hf_llama(
    num_heads=num_heads, num_kv_heads=num_kv_heads, tied=tied, stacked=False, prefix=prefix
  )
  p = re.escape(prefix) + "layers"
  block, router, (w_gate, w_up, w_down) = _SPLIT_NAMES[family]
  table: list[tuple[str, str, list[Any]]]
  if experts == "autoep":
    table = [
      ("mlp.router.gate.weight", "mlp/router/kernel", [_T]),
      ("mlp.experts.w1", "mlp/experts/gate", [_T3]),
      ("mlp.experts.w3", "mlp/experts/up", [_T3]),
      ("mlp.experts.w2", "mlp/experts/down", [_T3]),
    ]
  elif experts == "fused":
    halves = (1, 1)
    table = [
      ("mlp.gate.weight", "mlp/router/kernel", [_T]),
      ("mlp.experts.gate_up_proj", "mlp/experts/gate", [SubParam(1, halves, 0), _T3]),
      ("mlp.experts.gate_up_proj", "mlp/experts/up", [SubParam(1, halves, 1), _T3]),
      ("mlp.experts.down_proj", "mlp/experts/down", [_T3]),
    ]
  else:
    table = [(f"{block}.{router}.weight", "mlp/router/kernel", [_T])]
  table += [
    ("mlp.shared_expert.gate_proj.weight", "mlp/shared/gate/kernel", [_T]),
    ("mlp.shared_expert.up_proj.weight", "mlp/shared/up/kernel", [_T]),
    ("mlp.shared_expert.down_proj.weight", "mlp/shared/down/kernel", [_T]),
    ("mlp.shared_expert_gate.weight", "mlp/shared_gate/kernel", [_T]),
  ]
  rules = list(base.rules) + layer_rules(p, "layers", table, False)
  if experts == "split":
    for name, key in ((w_gate, "gate"), (w_up, "up"), (w_down, "down")):
      source = rf"{p}\.(\d+)\.{re.escape(block)}\.experts\.(\d+)\.{re.escape(name)}\.weight"
      rules.append(Rule(source, f"layers/{{0}}/mlp/experts/{key}", [_T, Stack(1)]))
  rs = RuleSet(rules)
  return rs.then(stack_layers(rs)) if stacked else rs


def stack_layers(rs: RuleSet) -> RuleSet:
  """A stage that stacks every `layers/{i}/...` key that `rs` makes into `layers/...` (a new
  leading axis) and passes the other keys through."""
  out, seen = [], set()
  for rule in rs.rules:
    if rule.target is None or rule.tied or rule.target in seen:
      continue
    seen.add(rule.target)
    head = "layers/{0}/"
    if rule.target.startswith(head):
      suffix = rule.target[len(head) :]
      out.append(Rule(r"layers/(\d+)/" + re.escape(suffix), "layers/" + suffix, [Stack(0)]))
    else:
      out.append(Rule(re.escape(rule.target), rule.target))
  return RuleSet(out)


def expert_layout(names: list[str] | None) -> str:
  """The experts' layout that weight `names` show (`split` when there are none)."""
  for name in names or ():
    if name.endswith(".experts.gate_up_proj"):
      return "fused"
    if re.search(r"\.experts\.w[123]\Z", name):
      return "autoep"
  return "split"


def make(family: str):
  """The rule-set maker of `family`'s record (`ucp_jax.families`): `make(cfg, stacked=,
  prefix=, experts=)`."""

  def rules(cfg: Any, **options: Any) -> RuleSet:
    return hf_moe(
      family=family,
      num_heads=cfg.num_heads,
      num_kv_heads=cfg.num_kv_heads,
      tied=cfg.tie_embeddings,
      **options,
    )

  return rules


def named_options(names: list[str] | None) -> dict[str, Any]:
  """The rule-set options a MoE checkpoint's weight names decide: its experts' layout."""
  return {"experts": expert_layout(names)}
