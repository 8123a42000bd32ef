"""torch DCP folders as a source: what `torch.distributed.checkpoint.save` writes.

The state is read as `torch.distributed.checkpoint.state_dict.get_state_dict` lays it out and
training scripts save it, `dcp.save({"model": model_sd, "optim": optim_sd}, ...)` (docs/dcp.md):

* `model.<fqn>`: a parameter or buffer of the model (FSDP2 / DTensor shards as chunks);
* `optim.state.<fqn>.<slot>`: the optimizer's state of parameter `<fqn>` (`exp_avg`,
  `exp_avg_sq`, `momentum_buffer`, ...; `step`);
* `optim.param_groups.<g>.<hyper>`: group `g`'s hyperparameters, with `params`, the names
  of its parameters;
* or, flattened (`flatten_optimizer_state_dict=True`; torchtitan saves the model's keys and
  these at the top level): `state.<fqn>.<slot>` and `param_groups.<fqn>.<hyper>`.

A model entry the optimizer holds is a trainable parameter with its slots and group; one it
does not hold is a buffer (by name: `_torch_reader._state_dict.BUFFER_NAMES`), an alias of a trainable
parameter of the same bytes (a tied weight: `tied_to`), or a frozen parameter. Without an optimizer every
entry but the buffers is a parameter. Any other top-level entry (a scheduler, a data loader
state) is kept in the schema's `extra` as JSON. `.metadata` and the rank files are checked by
`_metadata`; tensors are read lazily by `_chunks`.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from ucp_jax.base._errors import SourceFormatError, UnsafePickleError, bullet_list
from ucp_jax.sources import _files
from ucp_jax.sources._source_plan import Plan, SourceParam, Tensor, jsonable, number
from ucp_jax.sources._torch_reader._state_dict import is_buffer
from ucp_jax.sources.dcp import _chunks, _metadata
from ucp_jax.sources.dcp._metadata import BytesEntry, Layout, TensorEntry
from ucp_jax.store import _schema

NAME = "dcp"
DESCRIPTION = (
  "a torch.distributed.checkpoint folder (.metadata with __R_N.distcp rank files), e.g. "
  "FSDP2 model and optimizer state saved through get_state_dict"
)
MODEL_KEYS = ("model",)
OPTIMIZER_KEYS = ("optim", "optimizer")


def sniff(path: str, fs: _files.Files | None = None) -> bool:
  """A folder with a `.metadata` file, or rank 0's `__0.metadata` (file names only; a
  `.metadata` that is no regular file counts, so that reading it says what it is)."""
  fs = fs or _files.for_path(path)
  names = (_metadata.METADATA, "__0" + _metadata.METADATA)
  found = fs.isfile if fs.remote else os.path.lexists
  return fs.isdir(path) and any(found(os.path.join(path, n)) for n in names)


def sniff_remote(url: str) -> bool:
  """`sniff` for a URL: one listing of the prefix."""
  return sniff(url.rstrip("/"))


def sniff_weak(path: str) -> bool:
  """False: a path no source recognizes is never DCP's to explain."""
  return False


def describe(path: str) -> Plan:
  """The folder's parameters, slots, buffers and groups; tensors stay in the rank files.

  Raises:
    SourceFormatError: a `.metadata` that is unreadable, of another DCP version, or does not
      describe its rank files (chunks that overlap, leave holes or exceed their tensor, spans
      past the end of a file, a missing rank file), or a state that is not a model with an
      optimizer as `get_state_dict` lays them out (every problem listed, file and key).
    UnsafePickleError: the metadata pickle asks for something that can run code.
  """
  fs = _files.for_path(path)
  path = fs.absolute(path) if fs.remote else path
  if not fs.isdir(path):
    raise SourceFormatError(f"{path}: a DCP checkpoint is a folder")
  layout = _metadata.read(path, fs)
  files = _chunks.RankFiles(path, fs)
  meta = os.path.join(path, _metadata.METADATA)
  model, state, groups, other, problems = _split(layout, meta)
  tensors = {
    key: _chunks.tensor(files, entry, f"{meta}: `{key}`")
    for key, entry in layout.entries.items()
    if isinstance(entry, TensorEntry)
  }
  hypers, members = _groups(groups, layout, files, meta, problems)
  group_of = {name: g for g, names in enumerate(members) for name in names}
  for name in group_of:
    if name not in model:
      problems.append(f"{meta}: `optim.param_groups` name `{name}`, which the model lacks")
  held, steps = _held(state, model, tensors, layout, files, meta, problems)
  if len(problems) == 1:
    raise SourceFormatError(f"{path}: not a model and optimizer state it can read: {problems[0]}")
  if problems:
    raise SourceFormatError(
      f"{path}: not a model and optimizer state it can read:\n" + bullet_list(problems)
    )
  params = [
    SourceParam(
      name,
      tensors[model[name]],
      slots=held.get(name, {}),
      group=group_of[name],
      shard_shape=_chunks.shard_shape(layout.entries[model[name]]),
    )
    for names in members
    for name in names
  ]
  buffers, rest = {}, [n for n in model if n not in group_of]
  for name in rest:
    key = model[name]
    tied = _tied_to(key, params, model, layout, files) if members else None
    if tied is not None:
      params.append(SourceParam(name, None, tied_to=tied))
    elif is_buffer(name):
      buffers[name] = tensors[key]
    else:
      params.append(
        SourceParam(
          name,
          tensors[key],
          frozen=bool(members),
          shard_shape=_chunks.shard_shape(layout.entries[key]),
        )
      )
  step = max(steps.values(), default=None)
  return Plan(
    params=params,
    buffers=buffers,
    optimizer=_optimizer(hypers, members, steps) if members else None,
    extra=_extra(other, files, layout, steps, step),
    source=_source(path, layout),
    step=None if step is None else number(step),
    path=path,
    format=NAME,
  )


def _split(layout: Layout, meta: str):
  """(model fqn -> key, (fqn, slot) -> key, groups, other keys, problems).

  `groups` maps a group index (`get_state_dict`'s nested layout) or, for the flattened one
  (`flatten_optimizer_state_dict=True`), a parameter name to `{hyper: key}`.
  """
  model: dict[str, str] = {}
  state: dict[tuple[str, str], str] = {}
  groups: dict[Any, dict[str, str]] = {}
  other: list[str] = []
  problems: list[str] = []
  for key, entry in layout.entries.items():
    kind, *parts = _classify(layout.paths.get(key) or _guess(key))
    if kind == "model" and isinstance(entry, BytesEntry):
      problems.append(f"{meta}: `{key}`: a model entry that is not a tensor")
    elif kind == "model":
      model[parts[0]] = key
    elif kind == "state":
      state[(parts[0], parts[1])] = key
    elif kind == "group":
      groups.setdefault(parts[0], {})[parts[1]] = key
    else:
      other.append(key)
  if not model:  # a bare model state dict saved by itself: every tensor at the top
    top = [k for k in other if len(layout.paths.get(k) or _guess(k)) == 1]
    model = {k: k for k in top if isinstance(layout.entries[k], TensorEntry)}
    other = [k for k in other if k not in model]
  kinds = {type(g) for g in groups}
  if len(kinds) > 1:
    problems.append(f"{meta}: optimizer param groups both nested and flattened")
  return model, state, groups, other, problems


def _classify(path: tuple) -> tuple:
  """("model", fqn), ("state", fqn, slot), ("group", index or fqn, hyper) or ("other",)."""
  if len(path) == 2 and path[0] in MODEL_KEYS and isinstance(path[1], str):
    return ("model", path[1])
  opt = path[1:] if len(path) >= 2 and path[0] in OPTIMIZER_KEYS else path
  if len(opt) == 3 and opt[0] in ("state", "param_groups"):
    if opt[0] == "state":
      return ("state", str(opt[1]), str(opt[2]))
    return ("group", opt[1], str(opt[2])) if type(opt[1]) is int and opt[1] >= 0 else ("other",)
  if len(opt) == 1 and isinstance(opt[0], str):  # flattened: state.<fqn>.<slot>, ...
    head, _, rest = opt[0].partition(".")
    if head in ("state", "param_groups") and "." in rest:
      fqn, last = rest.rsplit(".", 1)
      return ("state" if head == "state" else "group", fqn, last)
  return ("other",)


def _guess(key: str) -> tuple:
  """A key's path when the metadata has no planner_data (it is always written since torch 2.0)."""
  head, _, rest = key.partition(".")
  if head in OPTIMIZER_KEYS and rest.startswith("param_groups."):
    _, g, hyper = rest.split(".", 2) if rest.count(".") >= 2 else (rest, "", "")
    return (head, "param_groups", int(g) if g.isdigit() else g, hyper)
  if head in OPTIMIZER_KEYS and rest.startswith("state.") and "." in rest[6:]:
    fqn, slot = rest[6:].rsplit(".", 1)
    return (head, "state", fqn, slot)
  return (head, rest) if head in MODEL_KEYS and rest else (key,)


def _groups(
  groups: dict, layout: Layout, files, meta: str, problems: list
) -> tuple[list[dict], list[list[str]]]:
  """Each group's hyperparameters (JSON) and the names of its parameters, in order.

  The flattened layout keeps each parameter's hyperparameters: parameters with the same ones
  form a group, numbered in order of first appearance (two torch groups with equal
  hyperparameters read as one).
  """
  values = {
    g: {h: _value(layout, files, k, meta, problems) for h, k in hyper.items()}
    for g, hyper in groups.items()
  }
  if any(type(g) is str for g in values):
    hypers: list[dict] = []
    members: list[list[str]] = []
    for name, hyper in values.items():
      shown = {k: jsonable(v) for k, v in hyper.items() if k != "params"}
      if shown not in hypers:
        hypers.append(shown)
        members.append([])
      members[hypers.index(shown)].append(name)
    return hypers, members
  if sorted(values) != list(range(len(values))):
    problems.append(
      f"{meta}: optim.param_groups numbers {sorted(values)}, not 0..{len(values) - 1}"
    )
    return [], []
  hypers, members = [], []
  for g in range(len(values)):
    names = values[g].pop("params", None)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
      problems.append(
        f"{meta}: `optim.param_groups.{g}.params` is {names!r:.60}, not a list of names"
      )
      names = []
    hypers.append({k: jsonable(v) for k, v in values[g].items()})
    members.append(names)
  return hypers, members


def _value(layout: Layout, files, key: str, meta: str, problems: list) -> Any:
  """A small entry read whole: an object, or a 0-d tensor as a Python number."""
  entry = layout.entries[key]
  try:
    if isinstance(entry, BytesEntry):
      return files.load(entry.stored, f"`{key}`")
    if entry.shape == ():
      out = np.empty((), entry.dtype)
      files.read(entry, entry.chunks[0], (), out)
      return number(out)
  except UnsafePickleError:
    raise
  except SourceFormatError as e:
    problems.append(str(e))
    return None
  problems.append(f"{meta}: `{key}`: a tensor of shape {entry.shape}, not a number")
  return None


def _held(state: dict, model: dict, tensors: dict, layout: Layout, files, meta, problems):
  """Each parameter's slots (tensors of its shape), and its optimizer step."""
  held: dict[str, dict[str, Tensor]] = {}
  steps: dict[str, Any] = {}
  for (fqn, slot), key in state.items():
    if fqn not in model:
      problems.append(f"{meta}: `{key}`: optimizer state of `{fqn}`, which the model lacks")
      continue
    if slot == "step":
      step = _value(layout, files, key, meta, problems)
      if step is not None and not (isinstance(step, (int, float)) and math.isfinite(step)):
        problems.append(f"{meta}: `{key}`: step {step!r:.40} is not a finite number")
      elif step is not None:
        steps[fqn] = step
      continue
    value = tensors.get(key)
    shape = tensors[model[fqn]].shape
    if value is None or value.shape != shape:
      got = "an object" if value is None else f"shape {value.shape}"
      problems.append(f"{meta}: `{key}`: {got}, but `{model[fqn]}` has shape {shape}")
      continue
    held.setdefault(fqn, {})[slot] = value
  return held, steps


def _tied_to(key: str, params: list[SourceParam], model: dict, layout: Layout, files) -> str | None:
  """The trainable parameter that model entry `key` aliases: the same shape, dtype and bytes."""
  mine = layout.entries[key]
  for p in params:
    if p.frozen or p.tied_to or p.value is None:
      continue
    other = layout.entries[model[p.name]]
    same = other.shape == mine.shape and other.dtype == mine.dtype
    if same and _chunks.same_bytes(files, other, mine):
      return p.name
  return None


def _optimizer(hypers: list[dict], members: list[list[str]], steps: dict) -> _schema.Optimizer:
  """The schema's `optimizer` entry: type, step, per-group hyperparameters and step."""
  groups = []
  for hyper, names in zip(hypers, members):
    known = [steps[n] for n in names if n in steps]
    groups.append({**hyper, "step": number(max(known)) if known else None})
  first = hypers[0] if hypers else {}
  if "betas" in first:
    kind = "adamw" if first.get("decoupled_weight_decay", True) else "adam"
  else:
    kind = "sgd" if "momentum" in first else "unknown"
  top = max(steps.values(), default=None)
  step = _schema.integer_or_none(None if top is None else number(top))
  return _schema.Optimizer(type=kind, step=step, groups=tuple(map(_schema.GroupEntry, groups)))


def _extra(other: list[str], files, layout: Layout, steps: dict, step: Any) -> dict:
  """The schema's `extra`: other top-level entries as JSON, steps that differ, the layout."""
  client = {}
  for key in other:
    entry = layout.entries[key]
    if isinstance(entry, BytesEntry):
      client[key] = jsonable(files.load(entry.stored, f"`{key}`"))
    else:
      client[key] = {"__tensor__": {"shape": list(entry.shape), "dtype": str(entry.dtype)}}
  out: dict[str, Any] = {"source_layout": _layout_facts(layout)}
  if client:
    out["client_state"] = client
  differing = {n: number(s) for n, s in steps.items() if s != step}
  if differing:
    out["param_steps"] = differing
  return out


def _layout_facts(layout: Layout) -> dict:
  ranks = sorted({f.split("_")[2] if f.count("_") >= 3 else f for f in layout.files})
  return {"dcp_version": layout.version, "files": list(layout.files), "ranks": len(ranks)}


def _source(path: str, layout: Layout) -> dict:
  return {
    "framework": "torch",
    "format": NAME,
    "path": path if "://" in path else os.path.abspath(path),
    "dcp_version": layout.version,
    "files": len(layout.files),
  }
