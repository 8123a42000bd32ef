"""Optax optimizer state <-> the universal slots, found by the state's structure.

The optimizer state is walked as optax builds it: every optax state is a NamedTuple
(`ScaleByAdamState`, `TraceState`, `MaskedState`, `PartitionState`, `MultiStepsState`, ...),
wherever it sits in a chain, under `inject_hyperparams`, `masked`, `multi_transform` or
`MultiSteps`. A field whose leaves are keyed like the parameters is a per-parameter slot;
an `optax.MaskedNode` (the place of a parameter that a mask or another label holds) and an
empty state hold nothing. Keys are the tree layer's, so Flax NNX (`optimizer.opt_state`)
and Linen (`TrainState.opt_state`) read alike. Two forms have torch names:

  ScaleByAdamState  mu -> exp_avg, nu -> exp_avg_sq   (adam, adamw, and their chains)
  TraceState        trace -> momentum_buffer          (sgd with momentum, nesterov or not)

Other per-parameter state (Lion, Adafactor, Muon, AdaBelief, `optax.ema`, ...) has no
DeepSpeed name: it moves between JAX meshes only. `optax.MultiSteps` accumulates gradients
between optimizer steps (`acc_grads`, `mini_step`), which a DeepSpeed checkpoint, taken
between steps, never holds. Every state's `count` (and MultiSteps' `gradient_step`) counts
optimizer steps. A parameter's group is the first optimizer state holding it; groups are
numbered in the optimizer's own order (a chain's position, `multi_transform`'s labels
sorted).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.store import _keypath
from ucp_jax.tree import _tree

TRANSLATED = {  # optax state -> (group kind, {field: universal slot})
  "ScaleByAdamState": ("adam", {"mu": "exp_avg", "nu": "exp_avg_sq"}),
  "TraceState": ("sgd", {"trace": "momentum_buffer"}),
}
_NOT_A_GROUP = ("EmaState",)  # per-parameter state beside an optimizer's, never its group
_MULTI_STEPS = "MultiStepsState"
_HYPER_NAMES = {  # inject_hyperparams name -> torch name
  "learning_rate": "lr",
  "eps": "eps",
  "weight_decay": "weight_decay",
  "momentum": "momentum",
}


@dataclasses.dataclass(frozen=True)
class Group:
  """One optimizer state that holds slots: a parameter group."""

  prefix: str  # key of the state, e.g. "optimizer/opt_state/inner_states/decay/inner_state/0"
  kind: str  # "adam", "sgd", or the optax state's class (no torch names for its slots)
  count_key: str | None
  hyperparams_prefix: str | None  # the nearest `inject_hyperparams` state's `hyperparams`


@dataclasses.dataclass(frozen=True)
class JaxOnly:
  """An optax state whose per-parameter fields have no torch name."""

  prefix: str
  form: str  # the state's class, e.g. "ScaleByLionState"
  fields: tuple[str, ...]
  params: int  # how many parameters it holds


@dataclasses.dataclass(frozen=True)
class Accumulator:
  """`optax.MultiSteps`: gradients summed between optimizer steps."""

  prefix: str
  mini_step_key: str | None
  acc: dict[str, str]  # param (relative) -> key of its accumulated gradient


@dataclasses.dataclass(frozen=True)
class SlotMap:
  """Where each parameter's slots live in a flattened optimizer state."""

  groups: list[Group]
  slots: dict[str, dict[str, str]]  # param key (relative) -> {universal slot: state key}
  group_of: dict[str, int]  # param key (relative) -> group index
  jax_slots: dict[str, dict[str, str]]  # param -> {"Form.field": state key}, no torch name
  jax_only: list[JaxOnly]
  accumulators: list[Accumulator]
  counters: list[str]  # keys counting optimizer steps (`count`, `gradient_step`)
  states: dict[str, str] = dataclasses.field(default_factory=dict)  # key -> optax state class

  def held(self) -> set[str]:
    """Parameters some state holds (the others are frozen)."""
    return set(self.group_of) | set(self.jax_slots)

  def slot_keys(self) -> dict[str, str]:
    """Every per-parameter state key -> its parameter (relative key)."""
    out = {key: p for p, by in self.slots.items() for key in by.values()}
    out.update((key, p) for p, by in self.jax_slots.items() for key in by.values())
    for acc in self.accumulators:
      out.update((key, p) for p, key in acc.acc.items())
    return out


def is_placeholder(leaf: Any) -> bool:
  """A leaf that holds nothing: `optax.MaskedNode` (NNX wraps it in a variable) or None."""
  optax = sys.modules.get("optax")
  return leaf is None or (optax is not None and isinstance(leaf, optax.MaskedNode))


def find_slots(opt_state: Any, prefix: str, param_keys: list[str]) -> SlotMap:
  """Locates every parameter's slots in the optax state `opt_state` (keys under `prefix`).

  `param_keys` are relative to the parameter tree (`fc1/kernel`), as they appear again
  below a slot field (`mu/fc1/kernel`).
  """
  walk = _Walk(set(param_keys))
  if opt_state is not None:
    walk.visit(opt_state, prefix, None)
  first: dict[str, tuple[str, str, str | None, str | None]] = {}  # param -> its group's state
  for state in walk.holders:
    for param in state.params:
      first.setdefault(param, (state.prefix, state.form, state.count, state.hyper))
  order = list(dict.fromkeys(first.values()))  # group states in the optimizer's order
  order.sort(key=lambda g: walk.order[g[0]])
  groups = [
    Group(p, TRANSLATED.get(form, (form, {}))[0], count, hyper) for p, form, count, hyper in order
  ]
  index = {g: i for i, g in enumerate(order)}
  return SlotMap(
    groups=groups,
    slots=walk.slots,
    group_of={param: index[g] for param, g in first.items()},
    jax_slots=walk.jax_slots,
    jax_only=walk.jax_only,
    accumulators=walk.accumulators,
    counters=walk.counters,
    states=walk.forms,
  )


@dataclasses.dataclass
class _Holder:
  prefix: str
  form: str
  count: str | None
  hyper: str | None
  params: list[str]


class _Walk:
  """Visits every optax state in order, noting its slots, counters and groups."""

  def __init__(self, params: set[str]):
    self.params = params
    self.order: dict[str, int] = {}
    self.forms: dict[str, str] = {}
    self.holders: list[_Holder] = []
    self.slots: dict[str, dict[str, str]] = {}
    self.jax_slots: dict[str, dict[str, str]] = {}
    self.jax_only: list[JaxOnly] = []
    self.accumulators: list[Accumulator] = []
    self.counters: list[str] = []

  def visit(self, tree: Any, prefix: str, hyper: str | None) -> None:
    for key, node in _nodes(tree, prefix):
      if _is_state(node):
        self._state(node, key, hyper)

  def _state(self, state: Any, key: str, hyper: str | None) -> None:
    form = type(state).__name__
    self.order.setdefault(key, len(self.order))
    self.forms[key] = form
    if "hyperparams" in state._fields:
      hyper = f"{key}/hyperparams"
    kind, names = TRANSLATED.get(form, (None, {}))
    held: dict[str, dict[str, str]] = {}  # field -> {param: key}
    count = None
    for field in state._fields:
      value, at = getattr(state, field), f"{key}/{field}"
      entries = self._per_param(value, at)
      if entries is not None:
        if entries:
          held[field] = entries
      elif field == "count" or (form == _MULTI_STEPS and field == "gradient_step"):
        self.counters.append(at)
        count = at if field == "count" else count
      elif not (form == _MULTI_STEPS and field == "mini_step"):
        self.visit(value, at, hyper)
    if form == _MULTI_STEPS:
      mini = f"{key}/mini_step" if "mini_step" in state._fields else None
      acc = {p: k for entries in held.values() for p, k in entries.items()}
      self.accumulators.append(Accumulator(key, mini, acc))
      return
    if not held:
      return
    params = list(dict.fromkeys(p for entries in held.values() for p in entries))
    if form not in _NOT_A_GROUP:
      self.holders.append(_Holder(key, form, count, hyper, params))
    untranslated = [f for f in held if f not in names]
    for field, entries in held.items():
      if field in names:
        for param, at in entries.items():
          self.slots.setdefault(param, {})[names[field]] = at
      else:
        for param, at in entries.items():
          self.jax_slots.setdefault(param, {})[f"{form}.{field}"] = at
    if untranslated or kind is None:
      self.jax_only.append(JaxOnly(key, form, tuple(untranslated), len(params)))

  def _per_param(self, value: Any, at: str) -> dict[str, str] | None:
    """{param: key} if `value`'s leaves are keyed like the parameters, else None."""
    leaves = _nodes(value, "")
    if not leaves or any(_is_state(x) or k not in self.params for k, x in leaves):
      return None
    return {k: f"{at}/{k}" for k, x in leaves if not is_placeholder(_value(x))}


def _nodes(tree: Any, prefix: str) -> list[tuple[str, Any]]:
  """(key, node) of `tree`'s optax states, variables, placeholders and leaves, in order."""
  import jax

  pairs, _ = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: _is_state(x) or _is_variable(x) or is_placeholder(x)
  )
  return [(_keypath.under(prefix, _tree.from_path(path)), x) for path, x in pairs]


def _is_state(x: Any) -> bool:
  return isinstance(x, tuple) and hasattr(x, "_fields") and bool(x._fields)


def _is_variable(x: Any) -> bool:
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def _value(x: Any) -> Any:
  return x.get_value() if _is_variable(x) else x


SHARED_STATES = {  # optax state classes that several optimizers' states are made of
  "ScaleByAdamState": "adam, adamw, nadam, radam, adamax, yogi, lamb",
  "TraceState": "sgd with momentum, nesterov or not",
}


def state_problems(saved: dict[str, str], target: SlotMap) -> list[str]:
  """How the Optax states a checkpoint recorded (`saved`: key -> state class) differ from
  the target optimizer's at the same keys: another optimizer's moments are never restored
  as if they were its own (adabelief's `nu` is not adam's)."""
  problems = []
  for key, form in sorted(target.states.items()):
    was = saved.get(key)
    if isinstance(was, str) and was != form:
      problems.append(f"{key}: {_named(was)} in the checkpoint, {_named(form)} in the target")
  return problems


def _named(form: str) -> str:
  shared = SHARED_STATES.get(form)
  return f"optax {form} ({shared})" if shared else f"optax {form}"


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


_CLOSURE_HYPERPARAMS = {  # optax function (qualname) -> {its closure variable: torch name}
  "scale_by_adam.<locals>.update_fn": {"b1": "b1", "b2": "b2", "eps": "eps"},
  "add_decayed_weights.<locals>.update_fn": {"weight_decay": "weight_decay"},
  "scale.<locals>.update_fn": {"step_size": "step_size"},
  "trace.<locals>.update_fn": {"decay": "momentum"},
}


def transformation_hyperparams(tx: Any) -> dict:
  """The hyperparameters a plain Optax optimizer was built with (`optax.adamw(1e-3,
  weight_decay=0.1)`: lr, betas, eps, weight_decay), in torch's names, read from the closures
  of optax's own functions (nothing else holds them); {} where they are not plain numbers
  (schedules) or the optimizer holds several groups."""
  found: dict[str, list] = {}
  seen: set[int] = set()
  stack = [(getattr(tx, "update", None), 0)]
  while stack:
    fn, depth = stack.pop()
    code = getattr(fn, "__code__", None)
    if fn is None or code is None or id(fn) in seen or depth > 8:
      continue
    seen.add(id(fn))
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    for var, name in _CLOSURE_HYPERPARAMS.get(fn.__qualname__, {}).items():
      value = cells.get(var)
      if isinstance(value, (int, float)) and not isinstance(value, bool):
        found.setdefault(name, []).append(float(value))
    for value in cells.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        if callable(item):
          stack.append((item, depth + 1))
  if any(len(values) > 1 for values in found.values()):
    return {}  # several states of a kind: groups, not one optimizer
  one = {k: v[0] for k, v in found.items()}
  out: dict[str, Any] = {}
  if "step_size" in one and one["step_size"] < 0:
    out["lr"] = -one["step_size"]
  if "b1" in one and "b2" in one:
    out["betas"] = [one["b1"], one["b2"]]
  out.update((k, one[k]) for k in ("eps", "weight_decay", "momentum") if k in one)
  return out


def hyperparam_keys(group: Group, torch_hyper: dict[str, Any], keys: set[str]) -> dict[str, Any]:
  """{state key: value}: torch hyperparameters for a group's `inject_hyperparams` state."""
  prefix = group.hyperparams_prefix
  if prefix is None:
    return {}
  wanted = {name: torch_hyper.get(torch_name) for name, torch_name in _HYPER_NAMES.items()}
  betas = torch_hyper.get("betas")
  if isinstance(betas, (list, tuple)) and len(betas) == 2:
    wanted.update(b1=betas[0], b2=betas[1])
  return {
    f"{prefix}/{name}": value
    for name, value in wanted.items()
    if isinstance(value, (int, float)) and not isinstance(value, bool)
    if f"{prefix}/{name}" in keys
  }


def _shortest_float(value: Any) -> float:
  """A float32 hyperparameter as the shortest decimal that rounds to it (0.01, not 0.0099...)."""
  x = np.asarray(value)
  return float(str(x[()])) if x.dtype == np.float32 else float(x)


def step_of(slots: SlotMap, flat: dict[str, Any]) -> int | None:
  """The optimizer step: the groups' step count (Adam's bias correction), else any counter."""
  keys = [g.count_key for g in slots.groups if g.count_key in flat] or [
    k for k in slots.counters if k in flat
  ]
  counts = {int(np.asarray(flat[k])) for k in keys}
  if len(counts) > 1:
    raise _errors.MappingError(f"parameter groups disagree on the step count: {sorted(counts)}")
  return counts.pop() if counts else None
