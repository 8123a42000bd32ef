"""Rule sets: ordered rules that carry source names and layouts to target keys and back.

A `RuleSet` is one stage of rules (every source name must match exactly one) and,
optionally, a next stage that maps its output further (`a.then(b)`). It runs
- lazily over a checkpoint (`view`, or `restore(..., rules=rules)`), each target
  array a TensorStore view of the stored source arrays;
- eagerly on in-memory arrays, forward (`import_arrays`) and backward (`export_arrays`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.mapping import _matching
from ucp_jax.mapping._mapped import MappedCheckpoint, info_of
from ucp_jax.mapping._rule import Rule
from ucp_jax.mapping._transforms import SubParam, fuse
from ucp_jax.store import _checkpoint, _reader
from ucp_jax.tree import _tree


@dataclasses.dataclass(frozen=True)
class RuleSet:
  """An ordered list of `Rule`s, optionally followed by another rule set.

  Example:
    >>> import numpy as np
    >>> from ucp_jax import rules as R
    >>> rs = R.RuleSet([
    ...   R.Rule(r"fc(\\d+)\\.weight", "fc{0}/kernel", [R.transpose()]),
    ...   R.Rule(r"fc(\\d+)\\.bias", "fc{0}/bias"),
    ... ])
    >>> torch_sd = {"fc1.weight": np.zeros((4, 2)), "fc1.bias": np.zeros(4)}
    >>> {k: v.shape for k, v in rs.import_arrays(torch_sd).items()}
    {'fc1/kernel': (2, 4), 'fc1/bias': (4,)}
    >>> sorted(rs.export_arrays({"fc1": {"kernel": np.zeros((2, 4)), "bias": np.zeros(4)}}))
    ['fc1.bias', 'fc1.weight']

  Attributes:
    rules: the rules of this stage; each source name must match exactly one.
    next: the rule set applied to this stage's output (see `then`), or None.
  """

  rules: Sequence[Rule]
  next: RuleSet | None = None

  def __post_init__(self):
    object.__setattr__(self, "rules", tuple(self.rules))
    bad = [repr(r) for r in self.rules if not isinstance(r, Rule)]
    if bad:
      raise _errors.MappingError(
        "a RuleSet holds Rules; these are not:\n" + _errors.bullet_list(bad)
      )

  def __add__(self, other: RuleSet) -> RuleSet:
    """The union of two single-stage rule sets (every name must still match one rule)."""
    if self.next is not None or other.next is not None:
      raise _errors.MappingError("only single-stage rule sets add up; chain stages with `then`")
    return RuleSet(self.rules + other.rules)

  def then(self, other: RuleSet) -> RuleSet:
    """Chains two rule sets: `other` maps the keys that this one makes."""
    return RuleSet(self.rules, other if self.next is None else self.next.then(other))

  def under(self, source_prefix: str, target_prefix: str | None = None) -> RuleSet:
    """These rules for names below `source_prefix`, making keys below `target_prefix`.

    `rules.gpt2(...).under("exp_avg", "opt_state/mu")` maps the Adam moments the way
    the parameters are mapped. `target_prefix` defaults to `source_prefix`.
    """
    target_prefix = source_prefix if target_prefix is None else target_prefix
    stages = self.stages()
    out = RuleSet([r.under(source_prefix, target_prefix) for r in stages[0]])
    for stage in stages[1:]:
      out = out.then(RuleSet([r.under(target_prefix, target_prefix) for r in stage]))
    return out

  def stages(self) -> list[tuple[Rule, ...]]:
    return [self.rules] + (self.next.stages() if self.next is not None else [])

  def map_names(self, names: Iterable[str], *, partial: bool = False) -> dict[str, tuple[str, ...]]:
    """Target key -> the source names it is made of (one per layer when stacked).

    Raises:
      MappingError: unmatched names (unless `partial`), names matched by two rules,
        target keys made twice: every one, at once.
    """
    origin = {n: (n,) for n in names}
    for stage in self.stages():
      plan = _matching.match_import(stage, list(origin), partial=partial)
      origin = {k: sum((origin[s] for s in e.sources), ()) for k, e in plan.items()}
    return origin

  def view(
    self,
    ckpt: str | os.PathLike | _checkpoint.Checkpoint,
    *,
    subtree: str | None = None,
    partial: bool = False,
  ) -> MappedCheckpoint:
    """The checkpoint as this mapping presents it: target keys, lazily transformed arrays.

    Nothing is read but the manifest; `view.read(key, index)` and `ucp_jax.restore`
    read only the stored chunks under the region asked for.

    Args:
      ckpt: an opened checkpoint (or a path to open).
      subtree: map only the keys below this prefix (relative to it); others are left out.
      partial: leave out names no rule matches instead of raising.

    Raises:
      MappingError: every name, key and layout the rules cannot map, at once.
    """
    view = ckpt if isinstance(ckpt, _checkpoint.Checkpoint) else _reader.open(ckpt)
    prefix = (subtree or "").strip("/")
    for stage in self.stages():
      infos = {_relative(k, prefix): view[k] for k in view.keys() if _below(k, prefix)}
      plan = _matching.match_import(stage, infos, infos, partial=partial, where=str(view.location))
      view = MappedCheckpoint(view, plan, prefix)
    return view

  def import_arrays(self, arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Source-named arrays (a torch state dict as numpy) -> target-keyed numpy arrays.

    Raises:
      MappingError: as `view`, before any array is transformed.
    """
    current = {name: np.asarray(a) for name, a in arrays.items()}
    for stage in self.stages():
      infos = {name: info_of(a) for name, a in current.items()}
      plan = _matching.match_import(stage, infos, infos)
      current = {key: _forward(entry, current) for key, entry in plan.items()}
    return current

  def export_arrays(self, tree: Any) -> dict[str, np.ndarray]:
    """A target tree (e.g. `nnx.state(model)`) -> source-named numpy arrays, by the inverse rules.

    `tree` is a pytree (its leaves keyed as `ucp_jax.save` keys them) or a flat
    `{key: array}` dict whose keys hold `/`. Layers are unstacked, transposes and
    splits undone, casts reverted where the rule names the source dtype; tied names
    get the array of the key they are tied to. Unstacked layers and transposes are
    numpy views of one host copy per target array; nothing else is copied twice.

    Raises:
      MappingError: keys no rule makes, keys two rules make, source names given twice,
        rules that cannot run backwards, misfitting shapes: every one, at once.
    """
    current = {key: np.asarray(value) for key, value in _flat(tree).items()}
    for stage in reversed(self.stages()):
      shapes = {k: (v.shape, v.dtype) for k, v in current.items()}
      plan = _matching.match_export(stage, shapes)
      out: dict[str, np.ndarray] = {}
      parts: dict[str, tuple[SubParam, dict[int, np.ndarray]]] = {}
      for key, entries in plan.items():
        for entry in entries:
          sub = entry.rule.sub_param
          for name, array in _backward(entry, current[key]).items():
            if sub is None:
              out[name] = array
            else:  # one sub-parameter of a fused array: fused once all are in
              parts.setdefault(name, (sub, {}))[1][sub.index] = array
      out |= {name: fuse(pieces, sub) for name, (sub, pieces) in parts.items()}
      current = out
    return current


def _below(key: str, prefix: str) -> bool:
  return not prefix or key.startswith(prefix + "/")


def _relative(key: str, prefix: str) -> str:
  return key[len(prefix) + 1 :] if prefix else key


def _flat(tree: Any) -> dict[str, Any]:
  if isinstance(tree, Mapping) and any(isinstance(k, str) and "/" in k for k in tree):
    return {k: _tree.variable_value(v) if _tree.is_variable(v) else v for k, v in tree.items()}
  return _tree.flatten(tree)[0]


def _forward(entry: _matching.Entry, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
  rule = entry.rule
  layers = []
  for name in entry.sources:
    x = arrays[name]
    for t in rule.before_stack:
      x = t.forward(x)
    layers.append(x)
  if rule.stack is None:
    return layers[0]
  x = np.stack(layers, axis=rule.stack.axis)
  for t in rule.after_stack:
    x = t.forward(x)
  return x


def _backward(entry: _matching.ExportEntry, x: np.ndarray) -> dict[str, np.ndarray]:
  rule = entry.rule
  for t in reversed(rule.after_stack):
    x = t.inverse(x)
  layers = [x] if rule.stack is None else list(np.moveaxis(x, rule.stack.axis, 0))
  out = {}
  for name, layer in zip(entry.names, layers):
    for t in reversed(rule.before_stack):
      layer = t.inverse(layer)
    out[name] = layer
  return out
