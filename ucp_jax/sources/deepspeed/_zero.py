"""DeepSpeed ZeRO-1/2 and BF16-optimizer checkpoints -> a conversion plan.

The layout (docs/deepspeed_layouts.md §5, §6): each optimizer param group is one flat buffer,
partitioned evenly over the dp ranks; `param_slice_mappings[g]` says which elements of the rank's
partition belong to which parameter, and the fragments of one parameter over ranks 0..dp-1
concatenate to it. The fp32 master partition (`single_partition_of_fp32_groups`) and every
optimizer slot (`exp_avg`, `exp_avg_sq`, ...) share that layout, so each parameter is a list of
views into the rank files, cut by offset: no copy until the writer assembles it.
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

import numpy as np

from ucp_jax.sources._source_plan import Plan, SourceParam, Tensor, fixed
from ucp_jax.sources._torch_reader._torch_file import InertObject, is_tensor
from ucp_jax.sources.deepspeed import _common as common
from ucp_jax.sources.deepspeed import _contract as contract

OSD_KEYS = (
  "base_optimizer_state",
  "single_partition_of_fp32_groups",
  "group_paddings",
  "partition_count",
  "param_slice_mappings",
  "ds_version",
)
"""`optimizer_state_dict` keys of ZeRO-1/2 and the BF16 optimizer (§5)."""
_OSD = common.OSD
_PER_GROUP = ("single_partition_of_fp32_groups", "group_paddings", "param_slice_mappings")


def plan(files: common.TagFiles) -> Plan:
  """Reads the metadata of a ZeRO-1/2 or BF16-optimizer tag folder; see the module docstring."""
  model_path = files.models[0]
  model = common.load_checked(
    model_path,
    contract.MODEL_STATES,
    f"DeepSpeed ZeRO model-states file (expected keys {common.MODEL_KEYS})",
  )
  paths = common.check_ranks(files, model["dp_world_size"], model_path)
  osds, versions = load_optim_states(files.folder, paths)
  stage, optimizer_class = check_consistent(model, model_path, paths, osds, versions)
  problems: list[str] = []
  shapes = common.shapes_of(model, model_path, problems)
  common.fail(f"{model_path}: unreadable param_shapes", problems)
  params, steps = [], []
  for g, group in enumerate(shapes):
    params += group_params(g, group, paths, osds, problems)
    steps.append(group_step(g, paths, osds, problems))
  common.fail(f"{files.folder}: the rank files do not make up the parameters", problems)
  optimized = {p.name for p in params}
  tied, buffers, leftovers = common.model_extras(model, model_path, optimized)
  params += frozen_params(model, model_path, leftovers)
  params += tied
  groups = [osds[0]["base_optimizer_state"]["param_groups"][g] for g in range(len(shapes))]
  source_layout = common.layout(model, stage=stage, optimizer_class=optimizer_class)
  return Plan(
    params=params,
    buffers=buffers,
    optimizer=common.optimizer_entry(groups, steps, model.get("ds_config")),
    extra=common.extra(model, source_layout),
    source=common.source(files.folder, "zero", source_layout),
    step=common.number(model["global_steps"]),
    path=files.folder,
  )


def _elastic(osd: dict, path: str) -> list[str]:
  if not isinstance(osd.get("base_optimizer_state"), list):
    return []
  return [
    f"{path}: {_OSD}['base_optimizer_state'] is a list: the elastic checkpoint layout "
    "(zero_optimization.elastic_checkpoint: true), which keeps no per-group "
    "hyperparameters, is not supported"
  ]


def load_optim_states(folder: str, paths: list[str]) -> tuple[list[dict], list]:
  """Each rank's `optimizer_state_dict` (keys checked) and its file's `(path, ds_version)`."""
  osds, versions, problems = common.load_optim_files(paths, contract.ZERO12_OSD, _elastic)
  common.fail(
    f"{folder}: not a DeepSpeed ZeRO-1/2 or BF16-optimizer checkpoint of a known layout "
    f"(DeepSpeed 0.19.8: {_OSD} with keys {OSD_KEYS}, and base_optimizer_state with "
    "'state' and 'param_groups')",
    problems,
  )
  return osds, versions


def check_consistent(model: dict, model_path: str, paths: list[str], osds: list, versions: list):
  """Every rank file from the same run and step as the model states; (stage, class)."""
  dp = model["dp_world_size"]
  n = len(model["param_shapes"]) if isinstance(model["param_shapes"], list) else -1
  problems = common.same_everywhere(
    [(model_path, model["ds_version"]), *versions], "['ds_version']"
  )
  problems += common.same_everywhere(
    [(model_path, model["ds_version"])] + [(p, o["ds_version"]) for p, o in zip(paths, osds)],
    f"{_OSD}['ds_version']",
  )
  kinds = [(p, common.optimizer_class(o)) for p, o in zip(paths, osds)]
  problems += common.same_everywhere(kinds, "(zero stage, optimizer class)")
  stage, optimizer_class = kinds[0][1]
  if stage not in (1, 2):
    problems.append(
      f"{paths[0]}: {_OSD}['zero_stage'] is {stage}, but a ZeRO-1/2 checkpoint "
      f"({os.path.basename(model_path)}) needs 1 or 2"
    )
  for path, osd in zip(paths, osds):
    if osd["partition_count"] != [dp] * n:
      problems.append(
        f"{path}: {_OSD}['partition_count'] is {osd['partition_count']!r:.60}, but "
        f"{os.path.basename(model_path)} has dp_world_size {dp} and {n} param groups"
      )
    for key in _PER_GROUP:
      if not isinstance(osd[key], list) or len(osd[key]) != n:
        problems.append(f"{path}: {_OSD}[{key!r}] does not have one entry per group ({n})")
    groups = osd["base_optimizer_state"]["param_groups"]
    if not isinstance(groups, list) or len(groups) != n:
      problems.append(
        f"{path}: {_OSD}['base_optimizer_state']['param_groups'] does not have {n} groups"
      )
  problems += common.same_everywhere(
    [(p, o["base_optimizer_state"]["param_groups"]) for p, o in zip(paths, osds)],
    f"{_OSD}['base_optimizer_state']['param_groups']",
  )
  common.fail(f"{os.path.dirname(model_path)}: rank files from different runs or steps", problems)
  return stage, optimizer_class


def group_params(
  g: int, shapes: dict[str, tuple[int, ...]], paths: list[str], osds: list[dict], problems: list
) -> list[SourceParam]:
  """The parameters of flat group `g`: fragments cut from every rank's partitions (§6)."""
  pieces: dict[str, dict[str, list[np.ndarray]]] = {name: {} for name in shapes}
  slot_names: list[str] | None = None
  for path, osd in zip(paths, osds):
    where = f"{_OSD}['single_partition_of_fp32_groups'][{g}]"
    fp32 = common.flat(osd["single_partition_of_fp32_groups"][g], path, where, problems)
    state = osd["base_optimizer_state"]["state"].get(g)
    if fp32 is None or not isinstance(state, dict):
      problems.append(f"{path}: {_OSD}['base_optimizer_state']['state'] has no group {g}")
      continue
    slots = {
      k: common.flat(v, path, f"state[{g}][{k!r}]", problems)
      for k, v in state.items()
      if k != "step" and is_tensor(v) and v.ndim >= 1
    }
    if any(v is None for v in slots.values()):
      continue
    if slot_names is None:
      slot_names = sorted(slots)
    elif sorted(slots) != slot_names:
      problems.append(f"{path}: group {g} has slots {sorted(slots)}, rank 0 has {slot_names}")
      continue
    padding = osd["group_paddings"][g]
    sizes = {v.size for v in slots.values()}
    bf16 = "zero_stage" not in osd  # the BF16 optimizer keeps the fp32 tail padding (§5)
    expected = {fp32.size} if bf16 else {fp32.size + padding}
    if sizes and sizes != expected:
      problems.append(
        f"{path}: group {g}: slots of {sorted(sizes)} elements next to an fp32 partition of "
        f"{fp32.size} and group_paddings {padding} (expected {sorted(expected)}): unknown layout"
      )
      continue
    for name, address in osd["param_slice_mappings"][g].items():
      span = _span(address)
      if name not in shapes or span is None or span[0] + span[1] > fp32.size:
        problems.append(
          f"{path}: {_OSD}['param_slice_mappings'][{g}][{name!r}] = {_show(address)} "
          + ("names no parameter of this group" if name not in shapes else "is out of range")
          + f" (fp32 partition of {fp32.size} elements)"
        )
        continue
      start, numel = span
      pieces[name].setdefault("value", []).append(fp32[start : start + numel])
      for slot, data in slots.items():
        pieces[name].setdefault(slot, []).append(data[start : start + numel])
    problems += _overlaps(
      osd["param_slice_mappings"][g], f"{path}: {_OSD}['param_slice_mappings'][{g}]"
    )
  files = ", ".join(sorted({os.path.basename(p) for p in paths}))
  params = []
  for name, shape in shapes.items():
    held = sum(p.size for p in pieces[name].get("value", []))
    if held != math.prod(shape):
      problems.append(
        f"{name}: its fragments in param_slice_mappings[{g}] of the rank files hold {held} "
        f"elements, its shape {shape} has {math.prod(shape)}"
      )
      continue
    where = f"{name} (group {g} of {files})"
    tensors = {}
    for k in ["value", *(slot_names or [])]:
      v = pieces[name].get(k, [])  # none for an empty parameter
      tensors[k] = Tensor(
        shape, v[0].dtype if v else np.dtype(np.float32), fixed(v), f"{where}[{k}]"
      )
    value = tensors.pop("value")
    params.append(SourceParam(name=name, value=value, slots=tensors, group=g))
  return params


def _span(address: Any) -> tuple[int, int] | None:
  if isinstance(address, (InertObject, dict)):
    start, numel = address.get("start"), address.get("numel")
  else:
    return None
  if type(start) is not int or type(numel) is not int or start < 0 or numel < 0:
    return None
  return start, numel


def _overlaps(mappings: dict, where: str) -> list[str]:
  """Parameters whose fragments share elements of a partition (each element has one owner)."""
  spans = sorted((span, name) for name, a in mappings.items() if (span := _span(a)) and span[1])
  return [
    f"{where}: {a!r} and {b!r} share elements (at {s2[0]}, before {s1[0] + s1[1]})"
    for (s1, a), (s2, b) in itertools.pairwise(spans)
    if s2[0] < s1[0] + s1[1]
  ]


def _show(address: Any) -> str:
  if isinstance(address, InertObject):
    return f"{address.qualname.rsplit('.', 1)[-1]}({address.state!r:.60})"
  return f"{address!r:.60}"


def group_step(g: int, paths: list[str], osds: list[dict], problems: list) -> Any:
  steps = []
  for path, osd in zip(paths, osds):
    state = osd["base_optimizer_state"]["state"].get(g)
    if isinstance(state, dict) and "step" in state:
      steps.append((path, np.asarray(state["step"]).item()))
  problems += common.same_everywhere(steps, f"group {g}'s optimizer step") if steps else []
  return steps[0][1] if steps else None


def frozen_params(model: dict, path: str, leftovers: list[str]) -> list[SourceParam]:
  """Frozen parameters (§9): `frozen_param_fragments` (stage 2) or `module` (stage 1, BF16)."""
  module = model["module"]
  shapes = model.get("frozen_param_shapes") or {}
  fragments = model.get("frozen_param_fragments") or {}
  names = list(dict.fromkeys([*leftovers, *shapes]))
  params, problems = [], []
  for name in names:
    key = "frozen_param_fragments" if name in fragments else "module"
    array = fragments[name] if name in fragments else module.get(name)
    if not is_tensor(array):
      problems.append(f"{path}: frozen parameter {name!r} is in neither module nor fragments")
      continue
    if name in shapes and tuple(shapes[name]) != array.shape:
      problems.append(
        f"{path}: [{key!r}][{name!r}] has shape {array.shape}, frozen_param_shapes says "
        f"{tuple(shapes[name])}"
      )
      continue
    value = common.whole(array, f"{path}[{key!r}][{name!r}]")
    params.append(SourceParam(name=name, value=value, frozen=True))
  common.fail(f"{path}: unreadable frozen parameters", problems)
  return params
