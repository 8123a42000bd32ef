"""Optax optimizer state <-> the universal slots (`exp_avg`, `exp_avg_sq`, `momentum`, `step`).

Works on key paths, so it reads Flax NNX (`nnx.state(optimizer)`) and Linen
(`TrainState.opt_state`) alike: for a parameter at key `P`, Adam's first moment is the
key ending in `mu/P` and its second in `nu/P` (`ScaleByAdamState`, wherever it sits
in a chain, under `inject_hyperparams`, ...), SGD momentum the key ending in `trace/P`.
Each distinct optimizer state holding slots is one parameter group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ucp_jax import _errors

_SLOTS = {"mu": "exp_avg", "nu": "exp_avg_sq", "trace": "momentum"}
_HYPER_NAMES = {
  "learning_rate": "lr",
  "eps": "eps",
  "weight_decay": "weight_decay",
  "momentum": "momentum",
}


@dataclasses.dataclass(frozen=True)
class Group:
  """One optimizer state that holds slots: a parameter group."""

  prefix: str  # key of the state, e.g. "optimizer/opt_state/1/inner_state/0"
  kind: str  # "adam" or "sgd"
  count_key: str | None
  hyperparams_prefix: str | None


@dataclasses.dataclass(frozen=True)
class SlotMap:
  """Where each parameter's slots live in a flattened optimizer state."""

  groups: list[Group]
  slots: dict[str, dict[str, str]]  # param key (relative) -> {slot name: state key}
  group_of: dict[str, int]  # param key (relative) -> group index


def find_slots(param_keys: list[str], opt_keys: list[str]) -> SlotMap:
  """Locates every parameter's slots among the optimizer state's keys.

  `param_keys` are relative to the parameter tree (`fc1/kernel`), as they appear again
  below `mu/`, `nu/` or `trace/` in the optimizer state. Groups are numbered in the order
  their states appear in `opt_keys` (the optimizer's own order: a chain's position,
  `optax.multi_transform`'s labels sorted), not by which parameter comes first.
  """
  by_suffix: dict[str, list[tuple[str, str]]] = {}
  first_slot: dict[str, str] = {}  # state prefix -> its first slot name, in state order
  for key in opt_keys:
    parts = key.split("/")
    for i, part in enumerate(parts[:-1]):
      if part in _SLOTS:
        prefix = "/".join(parts[:i])
        by_suffix.setdefault("/".join(parts[i + 1 :]), []).append((prefix, part))
        first_slot.setdefault(prefix, part)
  slots: dict[str, dict[str, str]] = {}
  owner: dict[str, str] = {}
  for param in param_keys:
    for prefix, slot in by_suffix.get(param, []):
      slots.setdefault(param, {})[_SLOTS[slot]] = f"{prefix}/{slot}/{param}"
      owner[param] = prefix
  used = set(owner.values())
  prefixes = [p for p in first_slot if p in used]
  opt_set = set(opt_keys)
  groups = [_group(p, first_slot[p], opt_set) for p in prefixes]
  index = {p: i for i, p in enumerate(prefixes)}
  return SlotMap(groups, slots, {param: index[p] for param, p in owner.items()})


def _group(prefix: str, slot: str, opt_keys: set[str]) -> Group:
  count = f"{prefix}/count"
  hyper = None
  parts = prefix.split("/")
  for i in range(len(parts), 0, -1):  # the nearest inject_hyperparams state above this one
    candidate = "/".join(parts[:i]) + "/hyperparams"
    if any(k.startswith(candidate + "/") for k in opt_keys):
      hyper = candidate
      break
  kind = "sgd" if slot == "trace" else "adam"
  return Group(prefix, kind, count if count in opt_keys else None, hyper)


def group_hyperparams(group: Group, flat: dict[str, Any]) -> dict:
  """Hyperparameters a group's `inject_hyperparams` state records, in torch's names."""
  if group.hyperparams_prefix is None:
    return {}
  out: dict[str, Any] = {}
  values = {
    k[len(group.hyperparams_prefix) + 1 :]: _shortest_float(v)
    for k, v in flat.items()
    if k.startswith(group.hyperparams_prefix + "/")
  }
  for name, torch_name in _HYPER_NAMES.items():
    if name in values:
      out[torch_name] = values[name]
  if "b1" in values and "b2" in values:
    out["betas"] = [values["b1"], values["b2"]]
  return out


def _shortest_float(value: Any) -> float:
  """A float32 hyperparameter as the shortest decimal that rounds to it (0.01, not 0.0099...)."""
  x = np.asarray(value)
  return float(str(x[()])) if x.dtype == np.float32 else float(x)


def step_of(slots: SlotMap, flat: dict[str, Any]) -> int | None:
  """The optimizer step: Adam's bias-correction count (the same in every group)."""
  counts = {int(np.asarray(flat[g.count_key])) for g in slots.groups if g.count_key in flat}
  if len(counts) > 1:
    raise _errors.MappingError(f"parameter groups disagree on the step count: {sorted(counts)}")
  return counts.pop() if counts else None
