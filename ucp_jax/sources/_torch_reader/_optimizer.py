"""A torch optimizer's `state_dict()` -> the schema's slots, param groups and step.

torch numbers the parameters by their position over `param_groups` (group 0's `params` are
ids 0..n0-1, group 1's follow) and keeps each id's state in `state[id]`: Adam and AdamW
`step`, `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq` with amsgrad), SGD `momentum_buffer`.
Every array of a state becomes a slot under its torch name; `step` becomes the group's step.

Which state-dict entry each id is, in this order:

1. `param_groups[g]['param_names']`, which torch >= 2.6 writes for an optimizer built from
   `model.named_parameters()`;
2. the `param_names=` option (the names of each group's parameters, in order);
3. by order: a training script builds its groups by filtering the model's parameters, so
   each group holds parameters in state-dict order (buffers, by name, and aliases left out).
   One group holding every parameter is the state-dict order itself; several groups (weights
   with weight decay, biases without) or parameters left out (frozen) are interleaved, and
   the interleaving is found from the state's shapes: it must be the only one that fits,
   or the ids are ambiguous and the error says how to name them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np

from ucp_jax.base._errors import SourceFormatError, bullet_list
from ucp_jax.sources._source_plan import Tensor, jsonable, number
from ucp_jax.sources._torch_reader._torch_file import is_tensor
from ucp_jax.store import _schema, _untrusted

MAX_STATES = 1 << 20
"""Partial interleavings tried at once; past it the ids count as ambiguous."""
_HOW = (
  "name them: build the optimizer from model.named_parameters() (torch >= 2.6 then saves "
  "param_groups[i]['param_names']), or pass param_names=[[names of group 0, in order], ...] "
  "to ucp_jax.convert"
)


@dataclasses.dataclass(frozen=True)
class Held:
  """What the optimizer holds for one parameter."""

  slots: dict[str, Tensor]
  group: int
  step: int | float | None


@dataclasses.dataclass(frozen=True)
class Found:
  """The optimizer, by parameter name.

  Attributes:
    held: parameter name -> its slots, group and step.
    entry: the schema's `optimizer` entry (`type`, `step`, `groups`).
    step: the optimizer step (the largest group step: the one most of a group's parameters
      share), None without one.
    extra: for the schema's `extra`: `optimizer_names` (how ids were named) and
      `param_steps` (parameters whose step differs from their group's).
  """

  held: dict[str, Held]
  entry: _schema.Optimizer
  step: int | None
  extra: dict


def read(
  osd: Any, file: str, where: str, shapes: dict[str, tuple], param_names: Any = None
) -> Found:
  """Reads an optimizer `state_dict()` against the model's parameters (name -> shape).

  Raises:
    SourceFormatError: not an optimizer state dict, ids that do not fit the parameters
      (all named, with file and key), or ids that cannot be told apart.
  """
  groups, state = _checked(osd, file, where)
  ids = [list(g["params"]) for g in groups]
  id_shapes = {i: _shape(state.get(i)) for g in ids for i in g}
  named = [g.get("param_names") for g in groups]
  if all(isinstance(n, list) for n in named):
    how, names = "param_names", _given(named, ids, shapes, id_shapes, file, f"{where} param_names")
  elif param_names is not None:
    how, names = "option", _given(param_names, ids, shapes, id_shapes, file, "param_names=")
  else:
    how, names = "order", _by_order(ids, shapes, id_shapes, file, where)
  held, problems = {}, []
  for g, group_ids in enumerate(ids):
    for i in group_ids:
      name, entry = names[i], state.get(i) or {}
      at = f"{where}['state'][{i}]"
      slots = {
        str(k): whole(v, f"{file}: {at}[{k!r}] ({name})")
        for k, v in entry.items()
        if k != "step" and is_tensor(v)
      }
      problems += [
        f"{at}[{k!r}] ({name}): shape {t.shape}, the parameter's is {shapes[name]}"
        for k, t in slots.items()
        if t.shape != shapes[name]
      ]
      step = number(entry["step"]) if _is_number(entry.get("step")) else None
      held[name] = Held(slots, g, step)
  if len(problems) == 1:
    raise SourceFormatError(f"{file}: the optimizer's state does not fit the model: {problems[0]}")
  if problems:
    raise SourceFormatError(
      f"{file}: the optimizer's state does not fit the model:\n{bullet_list(problems, 20)}"
    )
  group_steps = [_most(held[names[i]].step for i in g) for g in ids]
  differ = {
    names[i]: held[names[i]].step
    for g, s in zip(ids, group_steps)
    for i in g
    if held[names[i]].step != s
  }
  out_groups = [
    {
      **{str(k): jsonable(v) for k, v in group.items() if k not in ("params", "param_names")},
      "step": s,
    }
    for group, s in zip(groups, group_steps)
  ]
  known = [s for s in group_steps if s is not None]
  step = max(known) if known else None
  extra: dict[str, Any] = {"optimizer_names": how}
  if differ:
    extra["param_steps"] = differ
  step = _schema.integer_or_none(step)
  entry = _schema.Optimizer(kind(groups), step, tuple(map(_schema.GroupEntry, out_groups)))
  return Found(held, entry, step, extra)


def kind(groups: list[dict]) -> str:
  """`adam`, `adamw` or `sgd` from the hyperparameters (torch keeps no class name)."""
  first = groups[0] if groups else {}
  if "betas" in first:
    decoupled = first.get("decoupled_weight_decay")  # torch >= 2.6
    if decoupled is not None:
      return "adamw" if decoupled else "adam"
    return "adamw" if first.get("weight_decay") else "adam"
  if "momentum" in first:
    return "sgd"
  return "unknown"


def _checked(osd: Any, file: str, where: str) -> tuple[list[dict], dict]:
  """The optimizer's groups and state, checked to be torch's `state_dict()` layout."""
  at = f"{file}: {where}"
  if not isinstance(osd, dict) or not isinstance(osd.get("param_groups"), list):
    raise SourceFormatError(f"{at} is not an optimizer state_dict() (no 'param_groups' list)")
  state = osd.get("state", {})
  if not isinstance(state, dict):
    raise SourceFormatError(f"{at}['state'] is a {type(state).__name__}, not a dict")
  problems, seen = [], set()
  for g, group in enumerate(osd["param_groups"]):
    params = group.get("params") if isinstance(group, dict) else None
    if not isinstance(params, list) or not all(type(i) is int for i in params):
      problems.append(f"['param_groups'][{g}]['params'] is not a list of parameter ids")
      continue
    for i in params:
      if i in seen:
        problems.append(f"['param_groups'][{g}]['params']: id {i} is in two groups")
      seen.add(i)
  for i, entry in state.items():
    if i not in seen:
      problems.append(f"['state'][{i!r}]: no param group holds this id")
    elif not isinstance(entry, dict):
      problems.append(f"['state'][{i!r}] is a {type(entry).__name__}, not a dict")
  if problems:
    if len(problems) == 1:
      raise SourceFormatError(f"{at}{problems[0]}")
    raise SourceFormatError(f"{at}: not an optimizer state_dict():\n{bullet_list(problems, 20)}")
  return osd["param_groups"], state


def _shape(entry: Any) -> tuple | None:
  """The parameter shape an id's state implies (its arrays'), None when it has none."""
  if not isinstance(entry, dict):
    return None
  shapes = {v.shape for k, v in entry.items() if k != "step" and is_tensor(v)}
  return shapes.pop() if len(shapes) == 1 else None


def _given(
  names: Any, ids: list[list[int]], shapes: dict, id_shapes: dict, file: str, what: str
) -> dict[int, str]:
  """Ids -> the names given for each group, checked against the parameters."""
  if not isinstance(names, (list, tuple)) or len(names) != len(ids):
    raise SourceFormatError(f"{file}: {what} must list the names of each of the {len(ids)} groups")
  out: dict = {}
  problems: list[str] = []
  for g, (group_names, group_ids) in enumerate(zip(names, ids)):
    if not isinstance(group_names, (list, tuple)) or len(group_names) != len(group_ids):
      problems.append(f"group {g}: {len(group_ids)} parameter ids, names {group_names!r:.80}")
      continue
    for i, name in zip(group_ids, group_names):
      if name not in shapes:
        problems.append(f"group {g}: {name!r} is not a parameter of the state dict")
      elif name in out.values():
        problems.append(f"group {g}: {name!r} is named twice")
      elif id_shapes[i] not in (None, shapes[name]):
        problems.append(f"group {g}: {name!r} has shape {shapes[name]}, its state {id_shapes[i]}")
      out[i] = name
  if problems:
    raise SourceFormatError(
      f"{file}: {what} do not name the optimizer's parameters:\n" + bullet_list(problems, 20)
    )
  return out


def _by_order(
  ids: list[list[int]], shapes: dict, id_shapes: dict, file: str, where: str
) -> dict[int, str]:
  """Ids -> names: the one way to deal the parameters, in order, into the groups (or leave
  them out) such that every id's state has its parameter's shape."""
  params = list(shapes.items())
  sizes = tuple(len(g) for g in ids)
  spare = len(params) - sum(sizes)
  if spare < 0:
    raise SourceFormatError(
      f"{file}: {where} holds {sum(sizes)} parameters, the state dict {len(params)} (without "
      "buffers and tied aliases): from another model?"
    )
  layer: dict[tuple, tuple[int, Any]] = {(0,) * len(ids): (1, None)}
  history = []
  for n, (_, shape) in enumerate(params):
    nxt: dict[tuple, tuple[int, Any]] = {}
    for counts, (ways, _) in layer.items():
      moves = [
        g for g, c in enumerate(counts) if c < sizes[g] and id_shapes[ids[g][c]] in (None, shape)
      ]
      if n - sum(counts) < spare:
        moves.append(-1)  # left out of the optimizer: frozen
      for g in moves:
        new = counts if g < 0 else (*counts[:g], counts[g] + 1, *counts[g + 1 :])
        before = nxt.get(new)
        nxt[new] = (min(2, ways + (before[0] if before else 0)), (counts, g))
    if len(nxt) > MAX_STATES:
      raise SourceFormatError(f"{file}: too many ways to match {where}'s ids to parameters; {_HOW}")
    history.append(nxt)
    layer = nxt
  final = layer.get(sizes)
  if final is None:
    raise SourceFormatError(
      f"{file}: {where}'s ids do not match the state dict's parameters in order (by their "
      f"shapes): the groups were not built in model order; {_HOW}"
    )
  if final[0] > 1:
    raise SourceFormatError(
      f"{file}: {where}'s {sum(sizes)} ids fit the state dict's {len(params)} parameters in "
      f"more than one way (parameters of equal shapes in {len(ids)} groups"
      + (f", {spare} left out" if spare else "")
      + f"); {_HOW}"
    )
  out, counts = {}, sizes
  for n in range(len(params) - 1, -1, -1):
    prev, g = history[n][counts][1]
    if g >= 0:
      out[ids[g][prev[g]]] = params[n][0]
    counts = prev
  return out


def whole(array: np.ndarray, where: str) -> Tensor:
  """A `Tensor` of an array of a torch file: its memory map, or, for an array the file stores
  with strides (a saved transposed view), a contiguous copy made when it is read."""
  if array.flags.c_contiguous:
    piece = array.reshape(-1)
    return Tensor(tuple(array.shape), array.dtype, lambda: [piece], where)

  def copied() -> list[np.ndarray]:  # sizes come from the file: the copy must fit in memory
    _untrusted.check_allocation(array.nbytes, where)
    return [np.ascontiguousarray(array).reshape(-1)]

  return Tensor(tuple(array.shape), array.dtype, copied, where)


def _is_number(value: Any) -> bool:
  if is_tensor(value):
    return value.ndim == 0 and value.dtype.kind in "iuf"
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _most(steps) -> int | float | None:
  """The step most parameters of a group share (the largest among equals)."""
  counted = Counter(s for s in steps if s is not None)
  if not counted:
    return None
  top = max(counted.values())
  return max(s for s, c in counted.items() if c == top)
