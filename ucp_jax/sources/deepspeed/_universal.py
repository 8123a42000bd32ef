"""DeepSpeed's own universal checkpoint (the output of `ds_to_universal`) -> a conversion plan.

The layout (docs/deepspeed_layouts.md §11): `zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`
(`{'param': tensor}` in the parameter's shape for ZeRO-1/2, a bare flat tensor for ZeRO-3),
`zero/<name>/step.pt` (ZeRO-1/2 only), `zero/optimizer_state.pt` (param groups, and ZeRO-3's
whole rank-0 optimizer state with the steps), and the model-states files copied byte for byte.
Frozen parameters and buffers are read from those model states, as in a direct conversion
(the `zero/<frozen>/fp32.pt` files hold upcast copies). Parameter files are opened one at a
time while writing.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _files
from ucp_jax.sources._source_plan import Pieces, Plan, SourceParam, Tensor
from ucp_jax.sources._torch_reader._torch_file import is_tensor
from ucp_jax.sources.deepspeed import _common as common
from ucp_jax.sources.deepspeed import _contract as contract
from ucp_jax.sources.deepspeed import _experts, _moe, _zero, _zero3
from ucp_jax.store import _schema, _untrusted

_ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_([0-9]+)_mp_rank_00_model_states\.pt\Z")


def is_universal(folder: str) -> bool:
  """Whether `folder` looks like a `ds_to_universal` output folder."""
  return _files.isfile(os.path.join(folder, "zero", "optimizer_state.pt"))


def plan(folder: str) -> Plan:
  """Reads the metadata of a DeepSpeed universal folder; see the module docstring."""
  _refuse_model_parallel(folder)
  opt_path = os.path.join(folder, "zero", "optimizer_state.pt")
  opt, stage, optimizer_class, models, model_paths = _read_states(folder, opt_path)
  model, model_path = models[0], model_paths[0]
  problems: list[str] = []
  shapes = common.shapes_of(model, model_path, problems)
  groups = opt["param_groups"]
  if stage == 3:
    owner = _zero3.group_of_subgroups(groups, len(shapes), opt_path, "['param_groups']")
  else:
    owner = list(range(len(shapes)))
    if not isinstance(groups, list) or len(groups) != len(shapes):
      problems.append(f"{opt_path}: ['param_groups'] does not have {len(shapes)} groups")
  common.fail(f"{folder}: optimizer state and model states disagree", problems)
  params, steps = _params_and_steps(folder, shapes, owner, stage, problems)
  if stage == 3:
    for s in range(len(shapes)):
      state = opt["optimizer_state_dict"]["state"].get(s)
      if isinstance(state, dict) and "step" in state:
        where = f"{opt_path} ['optimizer_state_dict']['state'][{s}]['step']"
        steps.setdefault(owner[s], []).append((where, np.asarray(state["step"]).item()))
  for g, found in steps.items():
    problems += common.same_everywhere(found, f"group {g}'s optimizer step")
  common.fail(f"{folder}: unreadable parameter files", problems)
  params = _experts.stack_universal(params, groups, problems)
  common.fail(f"{folder}: unreadable expert parameter files", problems)
  optimized = {p.name for p in params}
  tied, buffers, leftovers = common.model_extras(model, model_path, optimized)
  aliases, leftovers = _moe.module_aliases(model, leftovers, optimized)
  if stage == 3:
    params += _zero3.frozen_params(models, model_paths, model["dp_world_size"])
  else:
    params += _zero.frozen_params(model, model_path, leftovers)
  params += tied + aliases
  source_layout = common.layout(model, stage=stage, optimizer_class=optimizer_class)
  group_steps = [steps[g][0][1] if g in steps else None for g in range(len(groups))]
  return Plan(
    params=params,
    buffers=buffers,
    optimizer=common.optimizer_entry(groups, group_steps, model.get("ds_config")),
    extra=common.extra(model, source_layout),
    source=common.source(folder, "universal", source_layout),
    step=_schema.integer_or_none(common.number(model["global_steps"])),
    path=folder,
  )


def _refuse_model_parallel(folder: str) -> None:
  others = _other_model_ranks(folder)
  if others:  # its zero/ files are merged; param_shapes are per rank, and per stage
    shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    raise SourceFormatError(
      f"{folder}: a universal checkpoint of a model-parallel (TP/PP) run ({shown}); convert "
      "reads the universal form of single-rank runs only. Convert the DeepSpeed checkpoint "
      "that ds_to_universal read (its tag folder) instead: convert merges the ranks itself"
    )


def _read_states(folder: str, opt_path: str):
  """`zero/optimizer_state.pt` and the model states beside it, checked:
  (optimizer state, ZeRO stage, optimizer class, model states, their paths)."""
  opt = common.load(opt_path)
  problems = contract.check(opt, contract.UNIVERSAL_OPTIM, opt_path)
  stage, optimizer_class = common.optimizer_class(opt) if not problems else (0, "")
  if stage == 3:
    problems += common.missing_keys(opt, ("optimizer_state_dict",), opt_path)
  model_paths = _model_paths(folder, stage == 3)
  if not model_paths:
    want = "zero_pp_rank_0_mp_rank_00" if stage == 3 else "mp_rank_00"
    problems.append(f"{folder}: {want}_model_states.pt is missing")
  common.fail(
    f"{folder}: not a DeepSpeed universal checkpoint of a known layout (DeepSpeed 0.19.8: "
    "zero/optimizer_state.pt with 'param_groups', ZeRO-3's also with "
    "'optimizer_state_dict', next to the model-states files)",
    problems,
  )
  if stage == 3:
    models = _zero3.load_models(folder, model_paths)
  else:
    what = f"DeepSpeed model-states file (expected keys {common.MODEL_KEYS})"
    models = [common.load_checked(model_paths[0], contract.MODEL_STATES, what)]
  return opt, stage, optimizer_class, models, model_paths


def _params_and_steps(folder, shapes, owner, stage, problems):
  """Every parameter of `param_shapes` from its `zero/<name>/` files, and the steps found
  there by group (`{group: [(file, step)]}`); problems noted."""
  params, steps = [], {}
  for s, sub in enumerate(shapes):
    for name, shape in sub.items():
      param, step = _param(folder, name, shape, owner[s], stage, problems)
      if param is not None:
        params.append(param)
        if step is not None:
          steps.setdefault(owner[s], []).append(step)
  slot_names = {slot for p in params for slot in p.slots}
  problems += [
    f"{os.path.join(folder, 'zero', p.name, slot)}.pt is missing (other parameters have it)"
    for p in params
    for slot in sorted(slot_names - set(p.slots))
  ]
  return params, steps


def _other_model_ranks(folder: str) -> list[str]:
  """Model-states files of model-parallel ranks other than 0."""
  found = []
  for name in sorted(_files.listdir(folder)):
    m = common.MODEL_RE.match(name) or common.ZERO3_MODEL_RE.match(name)
    if m and int(m.groups()[-1]) > 0:
      found.append(name)
  return found


def _model_paths(folder: str, zero3: bool) -> list[str]:
  if not zero3:
    path = os.path.join(folder, "mp_rank_00_model_states.pt")
    return [path] if _files.isfile(path) else []
  ranks = {
    int(m.group(1)): name for name in _files.listdir(folder) if (m := _ZERO3_MODEL_RE.match(name))
  }
  return [os.path.join(folder, ranks[k]) for k in sorted(ranks)] if 0 in ranks else []


def _param(folder, name, shape, group, stage, problems):
  """The parameter `name` from `zero/<name>/*.pt`; (None, None) with problems noted."""
  if name in (".", "..") or any(c in name for c in ("/", "\\", "\0", os.sep)):
    problems.append(f"{folder}: parameter name {name!r:.80} is not a folder name in zero/")
    return None, None
  where = os.path.join(folder, "zero", name)
  files = sorted(_files.listdir(where)) if _files.isdir(where) else []
  if "fp32.pt" not in files:
    problems.append(f"{os.path.join(where, 'fp32.pt')} is missing")
    return None, None
  known = len(problems)
  shape, pattern = _expert_shape(os.path.join(where, "fp32.pt"), shape, problems)
  if len(problems) > known:
    return None, None
  step = None
  if stage != 3:
    if "step.pt" not in files:
      problems.append(f"{os.path.join(where, 'step.pt')} is missing")
      return None, None
    try:
      value = common.load(os.path.join(where, "step.pt"))
    except SourceFormatError as e:
      problems.append(str(e))
      return None, None
    if not is_tensor(value) or value.size != 1:
      problems.append(f"{os.path.join(where, 'step.pt')}: not a 0-d tensor")
      return None, None
    step = (os.path.join(where, "step.pt"), value.reshape(()).item())
  tensors = {}
  for file in files:
    if file.endswith(".pt") and file != "step.pt":
      path = os.path.join(where, file)
      dtype = _check(path, shape, stage, problems)
      if dtype is not None:
        tensors[file.removesuffix(".pt")] = Tensor(shape, dtype, _loader(path, shape, stage), path)
  if len(tensors) != len([f for f in files if f.endswith(".pt") and f != "step.pt"]):
    return None, None
  value = tensors.pop("fp32")
  shard = None if pattern is None else (1, *shape[1:])
  slots = dict(sorted(tensors.items()))
  return SourceParam(name, value, slots, group=group, pattern=pattern, shard_shape=shard), step


def _expert_shape(path: str, shape: tuple[int, ...], problems: list[str]):
  """An AutoEP expert weight (`is_expert_param`, `ep_num_experts` beside `param`): all its
  experts are in the file, `param_shapes` gives one rank's; (shape, pattern) else (shape, None)."""
  try:
    data = common.load(path)
  except SourceFormatError as e:
    problems.append(str(e))
    return shape, None
  if not isinstance(data, dict) or data.get("is_expert_param") is not True or not shape:
    return shape, None
  n = data.get("ep_num_experts")
  if type(n) is not int or not 0 < n <= contract.MAX_RANKS * max(1, shape[0]) or n % shape[0]:
    problems.append(f"{path}: ep_num_experts {n!r:.40} for {shape[0]} local experts")
    return shape, None
  pattern = {
    "kind": "expert",
    "cat_dim": 0,
    "num_experts": n,
    "experts": {"layout": "autoep", "names": os.path.basename(os.path.dirname(path)) + ".{e}"},
  }
  return (n, *shape[1:]), pattern


def _tensor(path: str, stage: int) -> np.ndarray:
  data = common.load(path)
  if stage != 3 or isinstance(data, dict):
    if not isinstance(data, dict) or "param" not in data:
      raise SourceFormatError(f"{path}: expected a dict with key 'param' (ds_to_universal's form)")
    data = data["param"]
  if not is_tensor(data):
    raise SourceFormatError(f"{path}: holds a {type(data).__name__}, not a tensor")
  return data


def _check(path: str, shape: tuple[int, ...], stage: int, problems: list[str]) -> np.dtype | None:
  try:
    data = _tensor(path, stage)
  except SourceFormatError as e:
    problems.append(str(e))
    return None
  flat_ok = data.ndim == 1 and data.size == math.prod(shape)
  if data.shape != shape and not (stage == 3 and flat_ok):
    problems.append(f"{path}: tensor of shape {data.shape}, param_shapes says {shape}")
    return None
  return data.dtype


def _loader(path: str, shape: tuple[int, ...], stage: int) -> Pieces:
  def pieces() -> list[np.ndarray]:
    data = _tensor(path, stage)
    if data.size != math.prod(shape):
      raise SourceFormatError(f"{path}: tensor of shape {data.shape}, param_shapes says {shape}")
    if not data.flags.c_contiguous:  # copied: sizes come from the file
      _untrusted.check_allocation(data.nbytes, path)
    return [np.ascontiguousarray(data).reshape(-1)]

  return pieces
