"""Plain `torch.save` files as a source: a state dict, or a training script's checkpoint dict.

What a file may hold (read with the safe reader, `_torch_file.load`: no pickled code runs,
tensors are memory maps of the file):

* a state dict: `{name: tensor}` (`pytorch_model.bin`, `torch.save(model.state_dict(), ...)`);
* a dict as training scripts write it, with the state dict under `model`, `state_dict`,
  `model_state_dict`, `module` or `model_state`, the optimizer's `state_dict()` under
  `optimizer`, `optim`, `optimizer_state_dict`, `opt` or `optimizer_state` (or Lightning's
  `optimizer_states`, a list of one), and anything else (`epoch`, `step`, `scheduler`, ...)
  kept as JSON in the schema's `extra`.

Every state-dict entry becomes a parameter (`params/NAME`) except buffers, recognized by
name (`BUFFER_NAMES`: `running_mean`, `num_batches_tracked`, ...), and aliases (an entry on
the same bytes as an earlier one: a tied weight, `tied_to` the first). With an optimizer,
a parameter it does not hold is frozen. Optimizer slots, groups and how its ids are matched
to names: `_optimizer`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _files
from ucp_jax.sources._source_plan import Plan, SourceParam, jsonable, number
from ucp_jax.sources._torch_reader import _optimizer, _torch_file
from ucp_jax.sources._torch_reader._optimizer import whole
from ucp_jax.sources._torch_reader._state_dict import SUFFIXES, aliases, is_buffer, tensors
from ucp_jax.sources._torch_reader._torch_file import is_tensor
from ucp_jax.store import _schema, _untrusted

NAME = "torch"
DESCRIPTION = (
  "a torch.save file (.pt, .pth, .bin, .ckpt), or a folder holding exactly one: a state dict, "
  "or a {model, optimizer, ...} dict with a torch Adam/AdamW/SGD state_dict()"
)
MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module", "model_state")
OPTIMIZER_KEYS = ("optimizer", "optim", "optimizer_state_dict", "opt", "optimizer_state")
STEP_KEYS = ("step", "global_step")


def sniff(path: str) -> bool:
  """A torch file by its suffix, or a folder holding exactly one (file names only)."""
  if _files.isdir(path):
    return len(_torch_files(path)) == 1
  return path.endswith(SUFFIXES)


def sniff_remote(url: str) -> bool:
  """`sniff` for a URL: a torch file by its suffix, or a prefix holding exactly one."""
  return sniff(url.rstrip("/"))


def sniff_weak(path: str) -> bool:
  """False: a path no source recognizes is never torch's to explain."""
  return False


def describe(path: str, *, param_names: list[list[str]] | None = None) -> Plan:
  """The file's parameters, buffers, optimizer slots and groups; the tensors stay mapped.

  Args:
    path: a torch file, or a folder holding exactly one.
    param_names: for an optimizer whose `param_groups` do not name their parameters (torch
      < 2.6, or built from `model.parameters()`) and whose ids cannot be told apart by
      shape: the state-dict names of each group's parameters, in the order given to it.

  Raises:
    SourceFormatError: not a state dict or a checkpoint dict, a non-tensor where a tensor
      must be, an optimizer state that does not fit the model (all named, file and key).
  """
  file = _the_file(path)
  data = load(file)
  model, model_key, osd, osd_where, rest = split(data, file)
  prefix = f"[{model_key!r}]" if model_key else ""
  arrays = tensors(model, file, prefix)
  buffers = {n: whole(a, f"{file}: {prefix}[{n!r}]") for n, a in arrays.items() if is_buffer(n)}
  ties = aliases({n: a for n, a in arrays.items() if n not in buffers})
  kept = [n for n in arrays if n not in ties and n not in buffers]
  optimizer: _schema.Optimizer | None = None
  extra, step = {}, None
  held: dict[str, _optimizer.Held] = {}
  if osd is not None:
    shapes = {n: tuple(arrays[n].shape) for n in kept}
    found = _optimizer.read(osd, file, osd_where, shapes, param_names)
    held, optimizer, step = found.held, found.entry, found.step
    extra = found.extra
  params = []
  for name in [n for n in kept if n in held] + [n for n in kept if n not in held]:
    where = f"{file}: {prefix}[{name!r}]"
    h = held.get(name)
    params.append(
      SourceParam(
        name=name,
        value=whole(arrays[name], where),
        slots={} if h is None else h.slots,
        group=None if h is None else h.group,
        frozen=osd is not None and h is None,
      )
    )
  params += [SourceParam(name=alias, value=None, tied_to=holder) for alias, holder in ties.items()]
  step = _wrapper_step(rest, step)
  return Plan(
    params=params,
    buffers=buffers,
    optimizer=optimizer,
    extra={**extra, "client_state": jsonable(rest)} if rest or extra else {},
    source={
      "framework": "torch",
      "format": NAME,
      "path": _files.absolute(file),
      "model_key": model_key,
      "optimizer_key": osd_where or None,
    },
    step=step,
    path=file,
    format=NAME,
  )


load = _torch_file.load_named
"""The object tree of a torch file, read safely; every error names the file."""


def split(data: Any, file: str) -> tuple[dict, str | None, Any, str, dict]:
  """(state dict, its key or None, optimizer state dict or None, its key, the other entries)."""
  if not isinstance(data, dict):
    raise SourceFormatError(
      f"{file}: holds a {type(data).__name__}, not a state dict or a checkpoint dict"
    )
  models = [k for k in MODEL_KEYS if isinstance(data.get(k), dict)]
  if not models:
    if data and not any(is_tensor(v) for v in data.values()):
      keys = ", ".join(repr(k) for k in list(data)[:8]) + (" ..." if len(data) > 8 else "")
      raise SourceFormatError(
        f"{file}: neither a state dict nor a checkpoint dict: no tensors, and no state dict "
        f"under {', '.join(MODEL_KEYS)} (its keys: {keys})"
      )
    return data, None, None, "", {}
  if len(models) > 1:
    raise SourceFormatError(
      f"{file}: both {models[0]!r} and {models[1]!r} hold a dict: which is the model's state "
      "dict? Save one of them"
    )
  optims = [k for k in OPTIMIZER_KEYS if isinstance(data.get(k), dict)]
  osd, where = None, ""
  if len(optims) > 1:
    raise SourceFormatError(f"{file}: both {optims[0]!r} and {optims[1]!r} hold an optimizer")
  if optims:
    osd, where = data[optims[0]], f"[{optims[0]!r}]"
  elif isinstance(data.get("optimizer_states"), list):  # PyTorch Lightning
    states = data["optimizer_states"]
    if len(states) != 1:
      raise SourceFormatError(
        f"{file}: ['optimizer_states'] holds {len(states)} optimizers; ucp_jax reads one"
      )
    osd, where = states[0], "['optimizer_states'][0]"
  taken = {models[0], *optims, *(["optimizer_states"] if where.startswith("['optimizer_s") else [])}
  rest = {str(k): v for k, v in data.items() if k not in taken}
  return data[models[0]], models[0], osd, where, rest


def _wrapper_step(rest: dict, step: int | None) -> int | None:
  for key in STEP_KEYS:
    value = rest.get(key)
    if value is not None and (isinstance(value, (int, np.integer)) or is_tensor(value)):
      if np.ndim(value) != 0:
        continue
      value = number(value)
      if isinstance(value, int):
        return value
  return step


def _torch_files(folder: str) -> list[str]:
  return sorted(
    n
    for n in _files.listdir(folder)
    if n.endswith(SUFFIXES) and _files.isfile(os.path.join(folder, n))
  )


def _the_file(path: str) -> str:
  if not _files.exists(path):
    raise SourceFormatError(f"{path}: no such file or directory")
  if not _files.isdir(path):
    return path
  files = _torch_files(path)
  if len(files) != 1:
    found = ", ".join(f if f.isprintable() else repr(f) for f in files[:12]) or "none"
    raise SourceFormatError(
      f"{path}: a folder read as a torch source must hold exactly one torch file "
      f"({', '.join(SUFFIXES)}); found {found}: pass the file"
    )
  file = os.path.join(path, files[0])
  if not _files.for_path(path).remote:
    _untrusted.check_inside(file, path)  # a link in the folder may not lead out of it
  return file
