"""How a DeepSpeed export writes stacked experts `[num_experts, ...]` (docs/moe.md).

Native `deepspeed.moe.layer.MoE` engines name one parameter per expert
(`...deepspeed_experts.{e}.fc1.weight`) and load each from its own `zero/<name>/` folder, so a
stacked native weight is split again, expert by expert, under the names a one-expert-rank
engine (ep 1) has. AutoEP engines hold `...experts.w1` stacked per rank and cut their own
experts from the whole array (`is_expert_param`, `ep_num_experts`), so AutoEP weights stay
stacked. A checkpoint that came from JAX without a recorded pattern is recognized by name.
"""

from __future__ import annotations

import re
from typing import Any

_NATIVE_STACKED = re.compile(r"^(.*\.deepspeed_experts)\.(\D.*)\Z")
_AUTOEP = re.compile(r"\.experts\.w[0-9]+\Z")


def native_names(name: str, pattern: Any, shape: tuple[int, ...]) -> list[str] | None:
  """The per-expert names of a stacked native MoE weight, or None for any other parameter."""
  experts = pattern.get("experts") if isinstance(pattern, dict) else None
  template = experts.get("names") if isinstance(experts, dict) else None
  if isinstance(experts, dict) and experts.get("layout") == "native" and isinstance(template, str):
    return [template.format(e=e) for e in range(shape[0])]
  m = _NATIVE_STACKED.match(name)
  if m and pattern is None and shape:
    return [f"{m.group(1)}.{e}.{m.group(2)}" for e in range(shape[0])]
  return None


def expert_pattern(name: str, pattern: Any, shape: tuple[int, ...]) -> Any:
  """`pattern`, or an expert pattern for an AutoEP weight that recorded none (from JAX)."""
  if pattern is None and shape and _AUTOEP.search(name):
    return {"kind": "expert", "cat_dim": 0, "num_experts": shape[0]}
  return pattern


def is_expert(name: str, pattern: Any, shape: tuple[int, ...]) -> bool:
  """Whether a parameter is a stacked expert weight (recorded, or by its DeepSpeed name)."""
  if isinstance(pattern, dict) and pattern.get("kind") == "expert":
    return True
  return native_names(name, pattern, shape) is not None or (
    expert_pattern(name, pattern, shape) is not None and pattern is None
  )


def deepspeed_groups(state: Any, patterns: dict[str, Any]) -> tuple[list[dict], dict[str, int]]:
  """The param groups a DeepSpeed MoE engine has, and each trainable parameter's.

  DeepSpeed moves the experts of each param group into a group of its own, appended after
  all the others (`split_params_into_different_moe_groups_for_optimizer`), and its universal
  loader reads `param_groups` by position, only as many as the file lists: a checkpoint whose
  experts share a group with other parameters (one Optax group in JAX) gets that group's
  hyperparameters again for its experts, with `moe: true`, so that none is left unloaded.
  """
  expert = {p.name: is_expert(p.name, patterns.get(p.name), p.shape) for p in state.trainable}
  dense_groups = {p.group for p in state.trainable if not expert[p.name]}
  mixed = sorted({p.group for p in state.trainable if expert[p.name]} & dense_groups)
  groups = [dict(g) for g in state.groups]
  extra = {}
  for g in mixed:
    extra[g] = len(groups)
    groups.append({**state.groups[g], "moe": True})
  group_of = {
    p.name: extra[p.group] if expert[p.name] and p.group in extra else p.group
    for p in state.trainable
  }
  return groups, group_of
