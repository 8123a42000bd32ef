"""The parameter schema of an Orbax training state, found from its keys alone.

An export to DeepSpeed or Hugging Face needs to know which array is which parameter,
optimizer slot or buffer (docs/schema.md). `save_train_state` reads that from the live
optimizer; an Orbax checkpoint holds only the tree, so it is read from the tree's shape, in
the forms Flax trainers save:

- `{"model": nnx.state(model), "optimizer": nnx.state(optimizer)}` (what `save_train_state`
  saves for NNX): parameters below `model/`, Optax state below `optimizer/opt_state/`;
- a Linen `TrainState`: `params/`, `opt_state/`, `step`;
- a model alone (`nnx.state(model)`, a params dict): every floating-point array a (frozen)
  parameter.

A parameter is a model array that the optimizer state holds a slot for: a node of the Optax
state whose leaves are keyed like the model's (`optimizer/opt_state/0/mu/l1/kernel`).
`mu`/`nu` of one state are Adam's `exp_avg`/`exp_avg_sq`, `trace` SGD's `momentum_buffer`;
other slots (Lion, Adafactor, an EMA) have no torch names (`jax_only`, refused by the export),
MultiSteps' `acc_grads` are left out with a note. Model arrays without slots are buffers
(BatchNorm statistics; a parameter outside `nnx.Optimizer(wrt=...)` reads as one too). The
names and keys are those `save_train_state` writes, so the same rule sets export both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

from ucp_jax.base import _errors
from ucp_jax.sources._source_plan import Tensor
from ucp_jax.store import _schema

_TORCH_SLOTS = {"mu": "exp_avg", "nu": "exp_avg_sq", "trace": "momentum_buffer"}
_FORMS = {frozenset({"mu", "nu"}): "adam", frozenset({"trace"}): "sgd"}
_HYPER = {"learning_rate": "lr", "eps": "eps", "weight_decay": "weight_decay"}
_HYPER |= {"momentum": "momentum", "b1": "b1", "b2": "b2"}
_LAYOUTS = (("model", "optimizer/opt_state", "optimizer/step"), ("params", "opt_state", "step"))


@dataclasses.dataclass(frozen=True)
class TrainState:
  """The schema found (None for a tree that is no training state) and the optimizer step."""

  schema: _schema.Schema | None
  step: int | None


def infer(tensors: dict[str, Tensor], hyperparams: dict | list[dict] | None) -> TrainState:
  """The schema of the tree `tensors` holds, if it is a training state (see the module)."""
  keys = list(tensors)
  for params_prefix, opt_prefix, step_key in _LAYOUTS:
    if _has(keys, params_prefix) and _has(keys, opt_prefix):
      return _Inference(tensors, params_prefix, opt_prefix, step_key).run(hyperparams)
  if any("opt_state" in k.split("/") for k in keys):
    return TrainState(None, None)  # Optax state in a tree of another shape: no guess
  return _Inference(tensors, "", None, None).run(hyperparams)


def _has(keys: list[str], prefix: str) -> bool:
  return any(k.startswith(prefix + "/") for k in keys)


class _Inference:
  def __init__(self, tensors: dict[str, Tensor], params: str, opt: str | None, step: str | None):
    self.tensors, self.opt, self.step_key = tensors, opt, step
    self.params_prefix = params
    self.model = {
      (k[len(params) + 1 :] if params else k): k
      for k in tensors
      if not params or k.startswith(params + "/")
    }
    self.opt_keys = [k for k in tensors if opt and k.startswith(opt + "/")]

  def run(self, hyperparams: dict | list[dict] | None) -> TrainState:
    states = self._states()
    groups = [s for s, fields in states.items() if _form(fields) in ("adam", "sgd")]
    shapes_ok = {s: self._shapes_match(states[s]) for s in groups}
    groups = [s for s in groups if shapes_ok[s]]
    group_of: dict[str, int] = {}
    slots: dict[str, dict[str, str]] = {}
    for index, state in enumerate(groups):
      for field, held in states[state].items():
        for rel, key in held.items():
          if group_of.setdefault(rel, index) == index:
            slots.setdefault(rel, {})[_TORCH_SLOTS[field]] = key
    floating = [r for r, k in self.model.items() if _floating(self.tensors[k])]
    params: dict[str, _schema.ParamEntry]
    if self.opt is None or not states:  # a model alone, or an optimizer with no slots
      frozen = self.opt is None
      group = None if frozen else 0
      params = {r: _schema.ParamEntry(self.model[r], {}, group, frozen) for r in floating}
    else:
      params = {r: _schema.ParamEntry(self.model[r], slots[r], g) for r, g in group_of.items()}
    buffers = {r: self.model[r] for r in floating if r not in params}
    step = self._step(groups)
    group_hyper = self._hyperparams(groups, hyperparams)
    kinds = {_form(states[s]) for s in groups}
    optimizer = _schema.Optimizer(
      type=_kind(kinds, group_hyper, self.opt),
      step=step,
      groups=tuple(map(_schema.GroupEntry, group_hyper)),
      jax_only=tuple(self._jax_only(states, set(groups))),
    )
    order = {rel: i for i, rel in enumerate(self.model)}  # the tree's order, as saved
    ordered = dict(sorted(params.items(), key=lambda kv: order[kv[0]]))
    return TrainState(_schema.Schema(ordered, buffers, optimizer, naming="flax"), step)

  def _states(self) -> dict[str, dict[str, dict[str, str]]]:
    """Optax state node -> field -> {parameter: key}, for every field keyed like the model.

    Linear in the keys (times their depth): each key's prefixes are looked up, never
    compared with every other key.
    """
    splits = {key: _splits(key) for key in self.opt_keys}
    candidates = {
      holder for pairs in splits.values() for holder, rel in pairs[1:] if rel in self.model
    }
    below: dict[str, dict[str, str]] = {}  # candidate -> {rel: key} of every key below it
    for key, pairs in splits.items():
      for holder, rel in pairs:
        if holder in candidates:
          below.setdefault(holder, {})[rel] = key
    holders: dict[str, dict[str, str]] = {}
    for holder in sorted(candidates, key=len):  # a holder before any node below it
      if any(above in holders for above, _ in _splits(holder)):
        continue
      under = below.get(holder, {})
      if under and all(rel in self.model for rel in under):
        holders[holder] = under
    states: dict[str, dict[str, dict[str, str]]] = {}
    for holder in sorted(holders, key=_natural):
      state, _, field = holder.rpartition("/")
      states.setdefault(state, {})[field] = holders[holder]
    return states

  def _shapes_match(self, fields: dict[str, dict[str, str]]) -> bool:
    return all(
      self.tensors[key].shape == self.tensors[self.model[rel]].shape
      for held in fields.values()
      for rel, key in held.items()
    )

  def _step(self, groups: list[str]) -> int | None:
    for key in [f"{s}/count" for s in groups] + [self.step_key or ""]:
      count = _count(self.tensors.get(key))
      if count is not None:
        return count
    return None

  def _hyperparams(self, groups: list[str], given: dict | list[dict] | None) -> list[dict]:
    count = max(1, len(groups))
    if given is not None:
      listed = given if isinstance(given, list) else [given] * count
      if len(listed) != count or not all(isinstance(g, dict) for g in listed):
        raise _errors.InvalidArgumentError(
          f"hyperparams: {len(listed)} dict(s) given; the optimizer state has {count} "
          "parameter group(s) (one dict for all, or one per group)"
        )
      return [dict(g) for g in listed]
    injected: dict[str, dict[str, str]] = {}  # node -> {name: key} below its `hyperparams/`
    marker = "/hyperparams/"
    for key in self.tensors:
      at = key.find(marker)
      while at != -1:
        name = key[at + len(marker) :]
        named = injected.setdefault(key[:at], {})
        if name in _HYPER:
          named[name] = key
        at = key.find(marker, at + 1)
    values: dict[str, float | None] = {}  # key -> value, each read once
    out = []
    for state in groups or [self.opt or ""]:
      found: dict[str, Any] = {}
      parts = state.split("/")
      for i in range(len(parts), 0, -1):  # the nearest optax.inject_hyperparams above it
        above = injected.get("/".join(parts[:i]))
        if above is not None:
          for n, k in above.items():
            if k not in values:
              values[k] = _scalar(self.tensors[k])
            if values[k] is not None:
              found[_HYPER[n]] = values[k]
          break
      if "b1" in found or "b2" in found:
        found["betas"] = [found.pop("b1", 0.9), found.pop("b2", 0.999)]
      out.append(found)
    return out[:count]

  def _jax_only(self, states: dict, groups: set[str]) -> list[dict]:
    out = []
    for state, fields in states.items():
      if state in groups:
        continue
      held = len({rel for h in fields.values() for rel in h})
      entry = {"state": state, "slots": sorted(fields), "params": held}
      if set(fields) == {"acc_grads"}:
        mini_step = _count(self.tensors.get(f"{state}/mini_step")) or 0
        out.append({**entry, "form": "MultiStepsState", "mini_step": mini_step, "export": "drop"})
      else:
        form = f"state with {', '.join(sorted(fields))}"
        out.append({**entry, "form": form, "export": "refuse"})
    if self.opt is not None:
      inside = (self.params_prefix + "/", self.opt + "/", self.step_key)
      top = len(self.opt.split("/")) - 1
      found = [k for k in self.tensors if not (k == self.step_key or k.startswith(inside[:2]))]
      for where in dict.fromkeys("/".join(k.split("/")[: top + 1]) for k in found):
        out.append({"state": where, "form": "not optimizer state", "slots": [], "export": "drop"})
    return out


def _natural(key: str) -> tuple:
  """Sequence indices in number order, names in name order (a chain's states, then labels)."""
  return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split("/"))


def _form(fields: dict) -> str:
  return _FORMS.get(frozenset(fields), "other")


def _kind(kinds: set[str], groups: list[dict], opt: str | None) -> str:
  if kinds == {"sgd"} or (not kinds and opt is not None):
    return "sgd"
  return "adamw" if any(g.get("weight_decay") for g in groups) else "adam"


def _floating(tensor: Tensor) -> bool:
  """A floating-point (or complex) array, bfloat16 and the float8 types included."""
  if tensor.info.get("kind") is not None:  # a scalar or a PRNG key
    return False
  try:
    ml_dtypes.finfo(np.dtype(tensor.dtype))
  except ValueError:
    return np.dtype(tensor.dtype).kind == "c"
  return True


def _scalar(tensor: Tensor) -> float | None:
  """A hyperparameter's value; None unless it holds one finite number."""
  if tensor.numel != 1 or np.dtype(tensor.dtype).kind not in "biuf":
    return None
  value = np.asarray(tensor.pieces()[0]).reshape(-1)[0]
  if value.dtype.kind == "f":
    return float(str(value)) if np.isfinite(value) else None
  return value.item()


def _count(tensor: Tensor | None) -> int | None:
  """A step counter's value; None unless it holds one integer."""
  if tensor is None or tensor.numel != 1 or np.dtype(tensor.dtype).kind not in "iu":
    return None
  return int(np.asarray(tensor.pieces()[0]).reshape(-1)[0])


def _splits(key: str) -> list[tuple[str, str]]:
  """(prefix, rest) at each `/` of `key`, the shortest prefix first."""
  out = []
  at = key.find("/")
  while at != -1:
    out.append((key[:at], key[at + 1 :]))
    at = key.find("/", at + 1)
  return out
