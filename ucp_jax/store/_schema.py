"""The universal parameter schema (docs/schema.md) as typed records.

A manifest keeps the schema as JSON (`Manifest.schema`, public and documented); this module is
its one reader and its one writer. `Schema.from_json` checks the JSON's structure (every entry
of the right type, no unknown or misspelt field) and lists every problem at once; `to_json`
writes the canonical form back. What an entry means for a given use (a key the checkpoint
holds, a group index in range, the slots Adam needs) is checked by that use (the exports).

The two sides of a parameter have their own records: `ParamEntry` here names the *keys* a
checkpoint holds for it; a source's `SourceParam` (sources/_source_plan) holds the *tensors*
a conversion reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ucp_jax.base import _errors

VERSION = 1
NAMINGS = ("torch", "flax")


@dataclasses.dataclass(frozen=True)
class ParamEntry:
  """One parameter: the keys of its value and of its optimizer slots, and its place.

  Attributes:
    value: the key of its value (fp32 master where one exists); for a tied parameter the key
      of the parameter that holds the data; None where a schema names none.
    slots: optimizer slot name (`exp_avg`, `exp_avg_sq`, `momentum_buffer`) -> key.
    group: its index into `Optimizer.groups`; None for a frozen or tied parameter.
    frozen: not trained (`requires_grad=False`): a value and no slots.
    tied_to: the parameter holding its data, for a shared parameter.
    pattern: how a TP/PP/EP source split it (`parallel._patterns.Pattern.to_json()`).
  """

  value: str | None = None
  slots: Mapping[str, str] = dataclasses.field(default_factory=dict)
  group: int | None = None
  frozen: bool = False
  tied_to: str | None = None
  pattern: Mapping[str, Any] | None = None

  def to_json(self) -> dict[str, Any]:
    out: dict[str, Any] = {
      "value": self.value,
      "slots": dict(self.slots),
      "group": self.group,
      "frozen": self.frozen,
      "tied_to": self.tied_to,
    }
    if self.pattern is not None:
      out["pattern"] = dict(self.pattern)
    return out


@dataclasses.dataclass(frozen=True)
class GroupEntry:
  """One param group: its hyperparameters as the source recorded them (`lr`, `betas`, ...),
  with the group's own optimizer `step` where the source counts steps per group."""

  values: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def step(self) -> int | None:
    step = self.values.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None

  @property
  def hyperparameters(self) -> dict[str, Any]:
    """The values without `step` and `params` (the source's parameter indices)."""
    return {k: v for k, v in self.values.items() if k not in ("params", "step")}

  def to_json(self) -> dict[str, Any]:
    return dict(self.values)


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """The optimizer's state beside the slots: its kind, step, groups and JAX-only state.

  Attributes:
    type: `adam`, `adamw`, `sgd`, `optax:<states>`, or what the source called it.
    step: the optimizer step (Adam's bias-correction count), if known.
    groups: the param groups, in order (`ParamEntry.group` indexes them).
    states: a JAX save's Optax state class by key.
    jax_only: state no torch file holds (docs/schema.md), as recorded.
  """

  type: str = "adamw"
  step: int | None = None
  groups: tuple[GroupEntry, ...] = ()
  states: Mapping[str, str] = dataclasses.field(default_factory=dict)
  jax_only: tuple[Mapping[str, Any], ...] = ()

  def to_json(self) -> dict[str, Any]:
    out: dict[str, Any] = {
      "type": self.type,
      "step": self.step,
      "groups": [g.to_json() for g in self.groups],
    }
    if self.states:
      out["states"] = dict(self.states)
    if self.jax_only:
      out["jax_only"] = [dict(entry) for entry in self.jax_only]
    return out


@dataclasses.dataclass(frozen=True)
class Schema:
  """Which key holds which parameter, optimizer slot and buffer, with the optimizer's groups
  and step (docs/schema.md).

  Attributes:
    params: every parameter by name, in the source's order.
    buffers: buffer name -> key.
    optimizer: None for weights alone (no optimizer state).
    naming: `torch` ([out, in] Linear weights) or `flax` names and layouts.
    extra: what else the source recorded (steps, scheduler, config, source layout), as JSON.
    version: the schema's version (`VERSION` for the ones this ucp_jax writes).
  """

  params: Mapping[str, ParamEntry]
  buffers: Mapping[str, str] = dataclasses.field(default_factory=dict)
  optimizer: Optimizer | None = None
  naming: str = "torch"
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  version: int = VERSION

  @property
  def trainable(self) -> dict[str, ParamEntry]:
    """The parameters the optimizer trains (neither frozen nor tied)."""
    return {n: p for n, p in self.params.items() if not p.frozen and p.tied_to is None}

  def to_json(self) -> dict[str, Any]:
    """The JSON form a manifest holds (`Manifest.schema`): the one writer of it."""
    return {
      "version": self.version,
      "naming": self.naming,
      "params": {name: entry.to_json() for name, entry in self.params.items()},
      "buffers": dict(self.buffers),
      "optimizer": {} if self.optimizer is None else self.optimizer.to_json(),
      "extra": dict(self.extra),
    }

  @classmethod
  def from_json(
    cls, data: Any, where: str, error: type[_errors.UcpError] = _errors.ManifestError
  ) -> Schema:
    """The schema of a manifest's JSON, checked for structure.

    Raises:
      ManifestError (or `error`): every problem found, each naming its entry.
    """
    problems: list[str] = []
    schema = _Parse(problems).schema(data)
    _errors.raise_problems(error, f"{where}: malformed parameter schema", problems)
    assert schema is not None
    return schema


def integer_or_none(value: Any) -> int | None:
  """`value` where it is an integer (a step), else None: a source's counter that is not one
  (a float, a string) is no step the schema can record."""
  return value if isinstance(value, int) and not isinstance(value, bool) else None


def of(schema: Schema | Mapping[str, Any] | None, where: str) -> Schema | None:
  """`schema` as a `Schema`: a record as it is, JSON checked (`Schema.from_json`)."""
  if schema is None or isinstance(schema, Schema):
    return schema
  return Schema.from_json(schema, where)


def written(
  schema: Schema | Mapping[str, Any] | None,
  where: str,
  error: type[_errors.UcpError] = _errors.ManifestError,
) -> dict[str, Any] | None:
  """The JSON a manifest stores for `schema` (a record or JSON): the canonical form, checked
  as a reader will check it, so that no save writes a schema its own `open` refuses.

  Raises:
    `error`: every problem of the schema's structure.
  """
  if schema is None:
    return None
  data = schema.to_json() if isinstance(schema, Schema) else schema
  return Schema.from_json(data, where, error).to_json()


_FIELDS = ("version", "naming", "params", "buffers", "optimizer", "extra")
_PARAM_FIELDS = ("value", "slots", "group", "frozen", "tied_to", "pattern")
_OPTIMIZER_FIELDS = ("type", "step", "groups", "states", "jax_only")


class _Parse:
  """Reads JSON into the records, noting every problem (a bad entry reads as a default)."""

  def __init__(self, problems: list[str]):
    self.problems = problems

  def note(self, where: str, value: Any, expected: str) -> None:
    self.problems.append(f"{where} is {_errors.shown(value)}, not {expected}")

  def unknown(self, where: str, data: Mapping, known: tuple[str, ...]) -> None:
    for key in data:
      if key not in known:
        self.problems.append(
          f"{where}unknown field {_errors.shown(key)} (known: {', '.join(known)})"
        )

  def schema(self, data: Any) -> Schema | None:
    if not isinstance(data, dict):
      self.note("the schema", data, "an object")
      return None
    self.unknown("", data, _FIELDS)
    version = self.integer("`version`", data.get("version", VERSION), optional=False)
    naming = data.get("naming", "torch")
    if naming not in NAMINGS:
      self.note("`naming`", naming, " or ".join(f'"{n}"' for n in NAMINGS))
      naming = "torch"
    params_data = self.mapping("`params`", data.get("params", {}))
    params = {
      str(name): self.param(f"`params.{_errors.named(str(name))}`", entry)
      for name, entry in params_data.items()
    }
    buffers = self.names("`buffers`", data.get("buffers", {}))
    optimizer = self.optimizer(data.get("optimizer"))
    extra = self.mapping("`extra`", data.get("extra", {}))
    return Schema(
      params=params,
      buffers=buffers,
      optimizer=optimizer,
      naming=naming,
      extra=extra,
      version=version if version is not None else VERSION,
    )

  def param(self, where: str, data: Any) -> ParamEntry:
    if not isinstance(data, dict):
      self.note(where, data, "an object")
      return ParamEntry()
    self.unknown(f"{where}: ", data, _PARAM_FIELDS)
    pattern = data.get("pattern")
    if pattern is not None and not isinstance(pattern, dict):
      self.note(f"{where} `pattern`", pattern, "an object")
      pattern = None
    frozen = data.get("frozen", False)
    if not isinstance(frozen, bool):
      self.note(f"{where} `frozen`", frozen, "true or false")
      frozen = False
    return ParamEntry(
      value=self.text(f"{where} `value`", data.get("value")),
      slots=self.names(f"{where} `slots`", data.get("slots") or {}),
      group=self.integer(f"{where} `group`", data.get("group")),
      frozen=frozen,
      tied_to=self.text(f"{where} `tied_to`", data.get("tied_to")),
      pattern=pattern,
    )

  def optimizer(self, data: Any) -> Optimizer | None:
    if data is None or data == {}:
      return None
    if not isinstance(data, dict):
      self.note("`optimizer`", data, "an object")
      return None
    self.unknown("`optimizer`: ", data, _OPTIMIZER_FIELDS)
    kind = data.get("type", "adamw")
    if not isinstance(kind, str):
      self.note("`optimizer.type`", kind, "a string")
      kind = "adamw"
    groups = data.get("groups", [])
    if not isinstance(groups, list):
      self.note("`optimizer.groups`", groups, "a list")
      groups = []
    for i, group in enumerate(groups):
      if not isinstance(group, dict):
        self.note(f"`optimizer.groups[{i}]`", group, "an object")
    jax_only = data.get("jax_only", [])
    if not isinstance(jax_only, list) or not all(isinstance(e, dict) for e in jax_only):
      self.note("`optimizer.jax_only`", jax_only, "a list of objects")
      jax_only = []
    return Optimizer(
      type=kind,
      step=self.integer("`optimizer.step`", data.get("step")),
      groups=tuple(GroupEntry(g) for g in groups if isinstance(g, dict)),
      states=self.names("`optimizer.states`", data.get("states", {})),
      jax_only=tuple(jax_only),
    )

  def mapping(self, where: str, data: Any) -> dict[str, Any]:
    if isinstance(data, dict):
      return data
    self.note(where, data, "an object")
    return {}

  def names(self, where: str, data: Any) -> dict[str, str]:
    """An object of strings (name -> key)."""
    data = self.mapping(where, data)
    bad = [k for k, v in data.items() if not isinstance(v, str)]
    for key in bad:
      self.note(f"{where} `{_errors.named(str(key))}`", data[key], "a key (a string)")
    return {str(k): v for k, v in data.items() if k not in bad}

  def text(self, where: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
      return value
    self.note(where, value, "a string or null")
    return None

  def integer(self, where: str, value: Any, optional: bool = True) -> int | None:
    if (value is None and optional) or (isinstance(value, int) and not isinstance(value, bool)):
      return value
    self.note(where, value, "an integer" + (" or null" if optional else ""))
    return None
