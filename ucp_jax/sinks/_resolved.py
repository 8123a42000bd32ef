"""The parameter schema of a checkpoint, resolved for an export.

`resolve(ckpt)` reads the manifest's schema (docs/schema.md), checks it against the
stored arrays and returns a `ResolvedState`: which array is which parameter, slot,
buffer; the param groups; the step. Every problem is collected and raised once,
before any array is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.store import _checkpoint, _reader, _schema

ADAM_SLOTS = ("exp_avg", "exp_avg_sq")
_ADAM_TYPES = ("adam", "adamw")

HOW_TO_GET_A_SCHEMA = (
  "A plain `ucp_jax.save(tree)` records none, and its keys are not a training state's "
  "(`model/` and `optimizer/opt_state/`, or `params/` and `opt_state/`). Save the train state "
  "with `ucp_jax.save_train_state(path, model, optimizer)` (in an Orbax manager: "
  "`UcpSave.train_state(model, optimizer)`), pass `schema=` to `ucp_jax.save` yourself "
  "(docs/schema.md), or convert a DeepSpeed checkpoint with `ucp convert`."
)


def inferred(ckpt: _checkpoint.Checkpoint) -> tuple[_checkpoint.Checkpoint, str | None]:
  """`ckpt` with a schema found from its keys, and a note saying so, when it was saved without
  one (`ucp_jax.save` or `UcpSave` of a training state's tree); else `(ckpt, None)`.

  The keys are read as an Orbax checkpoint's are (`sources.orbax._train_state`): the same
  trees, saved by either library, export alike. Hyperparameters are only found where
  `optax.inject_hyperparams` put them in the state.
  """
  if ckpt.manifest.schema is not None or not isinstance(ckpt, _reader.StoredCheckpoint):
    return ckpt, None
  from ucp_jax.sources._source_plan import Tensor
  from ucp_jax.sources.orbax import _train_state

  def tensor(key: str) -> Tensor:
    info = ckpt[key]
    kind = {} if info.kind == "array" else {"kind": info.kind}
    pieces = lambda: [np.asarray(ckpt.read(key)).reshape(-1)]  # noqa: E731  (a scalar's value)
    return Tensor(info.shape, np.dtype(info.dtype), pieces, f"{ckpt.location}/{key}", info=kind)

  found = _train_state.infer({key: tensor(key) for key in ckpt.keys()}, None).schema
  if found is None or found.optimizer is None or not found.trainable:
    return ckpt, None  # a model alone, or no optimizer state found: nothing to go on
  manifest = dataclasses.replace(ckpt.manifest, schema=_schema.written(found, str(ckpt.location)))
  note = (
    "the checkpoint recorded no parameter schema: it was found from the training state's "
    "keys (the parameters, their optimizer slots and step)"
  )
  if not any(g.values for g in found.optimizer.groups):
    note += (
      "; no hyperparameters are in the state (no optax.inject_hyperparams): save with "
      "UcpSave.train_state or save_train_state to record them"
    )
  return _reader.StoredCheckpoint(ckpt.location, manifest, origin=ckpt.origin), note


@dataclasses.dataclass(frozen=True)
class StoredParam:
  """One parameter as a checkpoint stores it: its value's key, shape and dtype, its slots'
  keys (trainable only), its group."""

  name: str
  value: str
  shape: tuple[int, ...]
  dtype: str
  slots: dict[str, str]
  group: int | None


@dataclasses.dataclass(frozen=True)
class ResolvedState:
  """What an export writes, resolved from the schema and checked against the arrays."""

  trainable: tuple[StoredParam, ...]
  frozen: tuple[StoredParam, ...]
  tied: dict[str, str]  # alias -> the parameter that holds the data
  buffers: tuple[StoredParam, ...]
  groups: tuple[dict[str, Any], ...]  # hyperparameters per param group (no `params`, `step`)
  optimizer_type: str
  step: int
  extra: dict[str, Any]
  nbytes: int  # bytes of the arrays the export reads
  not_carried: tuple[str, ...] = ()  # JAX state the export leaves out, one note each

  @property
  def slot_names(self) -> tuple[str, ...]:
    names: dict[str, None] = {}
    for p in self.trainable:
      names.update(dict.fromkeys(p.slots))
    return tuple(names)


def resolve(ckpt: _checkpoint.Checkpoint) -> ResolvedState:
  """Checks `ckpt`'s schema against its arrays and resolves it.

  Raises:
    MappingError: no schema, or a schema with problems (all of them listed).
  """
  schema = ckpt.manifest.typed_schema
  if schema is None:
    raise _errors.MappingError(
      f"{ckpt.location}: this checkpoint has no parameter schema, so it does not say which "
      "array is which parameter, optimizer slot (exp_avg, exp_avg_sq) or buffer, nor the "
      "optimizer step and hyperparameters that an export needs. " + HOW_TO_GET_A_SCHEMA
    )
  problems: list[str] = []
  checker = _Checker(ckpt, problems)
  if schema.version != _schema.VERSION:
    problems.append(
      f"schema version {schema.version!r}; this ucp_jax exports version {_schema.VERSION}"
    )
  _check_torch_names(ckpt, schema.naming)
  _check_has_optimizer_state(ckpt, schema)
  optimizer = schema.optimizer
  if optimizer is None:
    problems.append("no `optimizer` entry (type, step, groups)")
    optimizer = _schema.Optimizer(step=0, groups=(_schema.GroupEntry(),))
  groups = _groups(optimizer.groups, problems)
  opt_type = optimizer.type.lower()
  if opt_type in ("adam", "adamw"):  # torch's key for it: DeepSpeed sets it on the loading group
    groups = [{"decoupled_weight_decay": opt_type == "adamw", **g} for g in groups]
  step = optimizer.step
  if step is None or step < 0:
    problems.append(f"optimizer step {step!r}: expected an integer >= 0")
    step = 0
  if not schema.params:
    problems.append("no `params` entry, or an empty one")
  trainable, frozen, tied = checker.params(schema.params, len(groups))
  required = ADAM_SLOTS if opt_type in _ADAM_TYPES else ()
  _check_slots(trainable, required, problems)
  buffers = checker.buffers(schema.buffers)
  not_carried = _jax_only(optimizer.jax_only, problems)
  if problems:
    raise _errors.MappingError(
      f"{ckpt.location}: cannot export: {len(problems)} problem(s) in the parameter schema:\n"
      + _errors.bullet_list(problems)
    )
  read = [p.value for p in (*trainable, *frozen, *buffers)]
  read += [k for p in trainable for k in p.slots.values()]
  return ResolvedState(
    trainable=tuple(trainable),
    frozen=tuple(frozen),
    tied=tied,
    buffers=tuple(buffers),
    groups=tuple(groups),
    optimizer_type=opt_type,
    step=step,
    extra=dict(schema.extra),
    nbytes=sum(ckpt[k].nbytes for k in read),
    not_carried=tuple(not_carried),
  )


def _check_torch_names(ckpt: _checkpoint.Checkpoint, naming: str) -> None:
  """Raises unless the schema names parameters the torch way (then every name would be wrong
  for this one reason: it is said once, not once per parameter)."""
  if naming != "torch":
    raise _errors.MappingError(
      f"{ckpt.location}: cannot export: the parameters have {naming} names; the export needs "
      "torch names and layouts ([out, in] Linear weights): pass rules=... (--rules; e.g. "
      "ucp_jax.rules.gpt2(num_heads=...), or hf with the model's config.json) to map them back"
    )


@dataclasses.dataclass(frozen=True)
class ResolvedWeights:
  """The model's arrays only (for formats without optimizer state), checked like `plan`'s."""

  params: tuple[StoredParam, ...]  # trainable and frozen, in the schema's order
  frozen: tuple[str, ...]  # the names of the frozen ones
  tied: dict[str, str]  # alias -> the parameter that holds the data
  buffers: tuple[StoredParam, ...]
  nbytes: int


def _check_has_optimizer_state(ckpt: _checkpoint.Checkpoint, schema: _schema.Schema) -> None:
  """One error for a checkpoint of weights alone (a Hugging Face folder, a state dict), not
  a problem per parameter: no optimizer entry, and no parameter with a slot."""
  params = schema.params
  if schema.optimizer is not None or not params or any(p.slots for p in params.values()):
    return
  raise _errors.MappingError(
    f"{ckpt.location}: holds weights alone ({len(params)} parameters, no optimizer state: no "
    "step, hyperparameters or Adam moments), and a DeepSpeed checkpoint is a training state; "
    "export the weights with --format hf or dcp, or train in JAX and save with "
    "ucp_jax.save_train_state"
  )


def weights(ckpt: _checkpoint.Checkpoint) -> ResolvedWeights:
  """The parameters' values and the buffers of `ckpt`, resolved from its schema.

  Unlike `plan`, asks nothing of the optimizer: a checkpoint of weights alone (a Hugging
  Face folder, a `torch.save` state dict) exports too.

  Raises:
    MappingError: no schema, or one with problems (all of them listed).
  """
  schema = ckpt.manifest.typed_schema
  if schema is None:
    raise _errors.MappingError(
      f"{ckpt.location}: this checkpoint has no parameter schema, so it does not say which "
      "array is which parameter or buffer. " + HOW_TO_GET_A_SCHEMA
    )
  problems: list[str] = []
  checker = _Checker(ckpt, problems)
  _check_torch_names(ckpt, schema.naming)
  if not schema.params:
    problems.append("no `params` entry, or an empty one")
  trainable, frozen, tied = checker.params(schema.params, None)
  by_name = {p.name: p for p in (*trainable, *frozen)}
  ordered = [by_name[name] for name in schema.params if name in by_name]
  buffers = checker.buffers(schema.buffers)
  if problems:
    raise _errors.MappingError(
      f"{ckpt.location}: cannot export: {len(problems)} problem(s) in the parameter schema:\n"
      + _errors.bullet_list(problems)
    )
  return ResolvedWeights(
    params=tuple(dataclasses.replace(p, slots={}) for p in ordered),
    frozen=tuple(p.name for p in frozen),
    tied=tied,
    buffers=tuple(buffers),
    nbytes=sum(ckpt[p.value].nbytes for p in (*ordered, *buffers)),
  )


def _groups(groups: tuple[_schema.GroupEntry, ...], problems: list[str]) -> list[dict[str, Any]]:
  if not groups:
    problems.append("optimizer `groups`: expected a non-empty list of hyperparameter dicts")
    return []
  out = []
  for group in groups:
    hyper = group.hyperparameters
    if isinstance(hyper.get("betas"), list):
      hyper["betas"] = tuple(hyper["betas"])  # torch's own type; JSON turned it into a list
    out.append(hyper)
  return out


def check_jax_only(ckpt: _checkpoint.Checkpoint) -> None:
  """Raises what `plan` would about optimizer state DeepSpeed has no names for, before a
  Flax-named checkpoint is mapped to torch names (where it would show as missing slots)."""
  schema = ckpt.manifest.typed_schema
  problems: list[str] = []
  if schema is not None and schema.optimizer is not None:
    _jax_only(schema.optimizer.jax_only, problems)
  if problems:
    raise _errors.MappingError(
      f"{ckpt.location}: cannot export: {len(problems)} problem(s) in the parameter schema:\n"
      + _errors.bullet_list(problems)
    )


def _jax_only(entries: tuple[Mapping[str, Any], ...], problems: list[str]) -> list[str]:
  """State a JAX save holds that no DeepSpeed file can (`optimizer.jax_only`, docs/schema.md).

  Optimizer slots DeepSpeed has no names for are refused (its optimizer would restart
  without them); state beside the optimizer's (MultiSteps' accumulation, an EMA tree) is
  left out with a note.
  """
  notes = []
  for entry in entries:
    where, form = entry.get("state"), entry.get("form")
    if entry.get("export") == "drop" and form == "MultiStepsState":
      notes.append(
        f"`{where}` (optax.MultiSteps): its gradient accumulation is not carried "
        f"({entry.get('mini_step', 0)} pending mini-step(s)); DeepSpeed resumes from the last "
        "full optimizer step (set its gradient_accumulation_steps to accumulate alike)"
      )
    elif entry.get("export") == "drop":
      notes.append(
        f"`{where}`: neither model nor optimizer state (an EMA of the parameters, ...); "
        "DeepSpeed has no place for it, so it is not exported"
      )
    else:
      slots = ", ".join(entry.get("slots") or []) or "its state"
      problems.append(
        f"`{where}` (optax {form}: {slots} of {entry.get('params')} parameter(s)): DeepSpeed "
        "has no slot names for this state (it keeps exp_avg, exp_avg_sq for Adam and "
        "momentum_buffer for SGD), so its optimizer could not continue; this checkpoint moves "
        "between JAX meshes only"
      )
  return notes


def _check_slots(
  trainable: list[StoredParam], required: tuple[str, ...], problems: list[str]
) -> None:
  """Every trainable parameter needs the optimizer's slots, and all the same ones."""
  wanted: dict[str, None] = dict.fromkeys(required)
  for p in trainable:
    wanted.update(dict.fromkeys(p.slots))
  for p in trainable:
    missing = [f"`{slot}`" for slot in wanted if slot not in p.slots]
    if missing:
      problems.append(f"`{p.name}`: trainable, but no {', '.join(missing)} slot")


def valid_name(name: str) -> bool:
  """A parameter name DeepSpeed can use as a directory name (`zero/<name>/`)."""
  return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


class _Checker:
  """Resolves schema entries to keys, noting every problem."""

  def __init__(self, ckpt: _checkpoint.Checkpoint, problems: list[str]):
    self._ckpt = ckpt
    self._problems = problems

  def _array(self, what: str, key: Any) -> tuple[tuple[int, ...], str] | None:
    if not isinstance(key, str):
      self._problems.append(f"{what}: expected a key string, got {key!r}")
      return None
    if key not in self._ckpt:
      self._problems.append(f"{what} -> `{key}`: no such array in the checkpoint")
      return None
    info = self._ckpt[key]
    return tuple(info.shape), info.dtype

  def params(
    self, params: Mapping[str, _schema.ParamEntry], n_groups: int | None
  ) -> tuple[list[StoredParam], list[StoredParam], dict[str, str]]:
    """(trainable, frozen, tied) parameters; groups are checked against `n_groups` unless None."""
    trainable, frozen, tied = [], [], {}
    for name, entry in params.items():
      if not valid_name(name):
        self._problems.append(
          f"`{name}`: not usable as a parameter name (empty, `.`, `..` or a `/`)"
        )
        continue
      target = entry.tied_to
      if target is not None:
        real = params.get(target)
        if real is None or real.tied_to is not None:
          self._problems.append(f"`{name}`: tied to `{target}`, which is not an untied parameter")
        else:
          tied[name] = target
        continue
      found = self._array(f"`{name}` value", entry.value)
      if found is None or entry.value is None:
        continue
      shape, dtype = found
      if entry.frozen:
        frozen.append(StoredParam(name, entry.value, shape, dtype, {}, None))
        continue
      slots = self._slots(name, entry.slots, shape)
      group = 0 if entry.group is None else entry.group
      if n_groups is not None and not 0 <= group < n_groups:
        self._problems.append(
          f"`{name}`: group {group!r}, but the optimizer has {n_groups} group(s)"
        )
      in_group = None if n_groups is None else group
      trainable.append(StoredParam(name, entry.value, shape, dtype, slots, in_group))
    return trainable, frozen, tied

  def _slots(self, name: str, slots: Mapping[str, str], shape: tuple[int, ...]) -> dict[str, str]:
    out = {}
    for slot, key in slots.items():
      found = self._array(f"`{name}` slot `{slot}`", key)
      if found is None:
        out[slot] = key  # noted already; keeps the slot from also being reported missing
        continue
      if found[0] != shape:
        self._problems.append(f"`{name}` slot `{slot}`: shape {found[0]}, the value's is {shape}")
      out[slot] = key
    return out

  def buffers(self, buffers: Mapping[str, str]) -> list[StoredParam]:
    out = []
    for name, key in buffers.items():
      if not valid_name(name):
        self._problems.append(f"buffer `{name}`: not usable as a name (empty, `.`, `..` or a `/`)")
        continue
      found = self._array(f"buffer `{name}`", key)
      if found is not None:
        out.append(StoredParam(name, key, found[0], found[1], {}, None))
    return out
