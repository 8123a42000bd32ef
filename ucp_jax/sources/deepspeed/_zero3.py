"""DeepSpeed ZeRO-3 checkpoints -> a conversion plan.

The layout (docs/deepspeed_layouts.md §5, §7): every parameter is partitioned on its own into
`pn = ceil(numel / dp)` elements per rank (the last rank's tail is padding), and each optimizer
sub-group is the plain concatenation of its parameters' partitions, listed in order by the
model states' `param_shapes` (one dict per sub-group). `fp32_flat_groups[s]` and the slots of
`optimizer_state_dict['state'][s]` share that layout; frozen parameters are padded partitions
in every rank's `frozen_param_fragments`.
"""

from __future__ import annotations

import math
import os

import numpy as np

from ucp_jax.sources._source_plan import Plan, SourceParam, Tensor, fixed
from ucp_jax.sources.deepspeed import _common as common
from ucp_jax.sources.deepspeed import _contract as contract

OSD_KEYS = ("zero_stage", "partition_count", "optimizer_state_dict", "fp32_flat_groups")
"""`optimizer_state_dict` keys of ZeRO-3 (§5)."""
_OSD = common.OSD
_SAME_IN_MODELS = (
  "global_steps",
  "dp_world_size",
  "ds_version",
  "param_shapes",
  "frozen_param_shapes",
  "buffer_names",
)


def plan(files: common.TagFiles) -> Plan:
  """Reads the metadata of a ZeRO-3 tag folder; see the module docstring."""
  models = load_models(files.folder, files.models)
  dp = models[0]["dp_world_size"]
  paths = common.check_ranks(files, dp, files.models[0])
  osds, versions = _load_optim_states(files.folder, paths)
  _check_consistent(files, models, paths, osds, versions, dp)
  problems: list[str] = []
  shapes = common.shapes_of(models[0], files.models[0], problems)
  common.fail(f"{files.models[0]}: unreadable param_shapes", problems)
  states = [o["optimizer_state_dict"]["state"] for o in osds]
  groups = osds[0]["optimizer_state_dict"]["param_groups"]
  owner = group_of_subgroups(groups, len(shapes), paths[0], f"{_OSD}{_OSD}['param_groups']")
  params = []
  for s, sub in enumerate(shapes):
    flats = [o["fp32_flat_groups"][s] if s < len(o["fp32_flat_groups"]) else None for o in osds]
    slots = [{k: v for k, v in st.get(s, {}).items() if k != "step"} for st in states]
    params += _subgroup_params(s, sub, owner[s], paths, flats, slots, dp, problems)
  steps = []
  for g in range(len(groups)):
    found = [
      (f"{path} {_OSD}{_OSD}['state'][{s}]['step']", np.asarray(st[s]["step"]).item())
      for path, st in zip(paths, states)
      for s in range(len(shapes))
      if owner[s] == g and isinstance(st.get(s), dict) and "step" in st[s]
    ]
    problems += common.same_everywhere(found, f"group {g}'s optimizer step") if found else []
    steps.append(found[0][1] if found else None)
  common.fail(f"{files.folder}: the rank files do not make up the parameters", problems)
  optimized = {p.name for p in params}
  tied, buffers, leftovers = common.model_extras(models[0], files.models[0], optimized)
  frozen = models[0]["frozen_param_shapes"] or {}
  common.fail(
    f"{files.models[0]}: ['module'] has parameters that are neither optimized, frozen, tied "
    "nor buffers",
    [name for name in leftovers if name not in frozen],
  )
  params += frozen_params(models, files.models, dp) + tied
  source_layout = common.layout(models[0], stage=3, optimizer_class="DeepSpeedZeroOptimizer_Stage3")
  return Plan(
    params=params,
    buffers=buffers,
    optimizer=common.optimizer_entry(groups, steps, models[0].get("ds_config")),
    extra=common.extra(models[0], source_layout),
    source=common.source(files.folder, "zero", source_layout),
    step=common.number(models[0]["global_steps"]),
    path=files.folder,
  )


def load_models(folder: str, paths: list[str]) -> list[dict]:
  """Every rank's ZeRO-3 model states, keys checked and run-level values compared."""
  models = [common.load(p) for p in paths]
  keys = (*common.MODEL_KEYS, "frozen_param_shapes", "frozen_param_fragments")
  problems = [
    m for p, d in zip(paths, models) for m in contract.check(d, contract.ZERO3_MODEL_STATES, p)
  ]
  common.fail(
    f"{folder}: not a DeepSpeed ZeRO-3 model-states file of a known layout (DeepSpeed 0.19.8; "
    f"expected keys {keys})",
    problems,
  )
  for key in _SAME_IN_MODELS:
    problems += common.same_everywhere([(p, m[key]) for p, m in zip(paths, models)], f"[{key!r}]")
  common.fail(f"{folder}: model-states files from different runs or steps", problems)
  return models


def _load_optim_states(folder: str, paths: list[str]) -> tuple[list[dict], list]:
  osds, versions, problems = common.load_optim_files(paths, contract.ZERO3_OSD)
  common.fail(
    f"{folder}: not a DeepSpeed ZeRO-3 checkpoint of a known layout (DeepSpeed 0.19.8: {_OSD} "
    f"with keys {OSD_KEYS}, and its optimizer_state_dict with 'state' and 'param_groups')",
    problems,
  )
  return osds, versions


def _check_consistent(files, models, paths, osds, versions, dp) -> None:
  problems = common.same_everywhere(
    [(files.models[0], models[0]["ds_version"]), *versions], "['ds_version']"
  )
  n = len(models[0]["param_shapes"]) if isinstance(models[0]["param_shapes"], list) else -1
  for path, osd in zip(paths, osds):
    stage = common.int_of(osd["zero_stage"])
    if stage != 3:
      problems.append(f"{path}: {_OSD}['zero_stage'] is {stage}, not 3")
    if osd["partition_count"] != dp:
      problems.append(
        f"{path}: {_OSD}['partition_count'] is {osd['partition_count']!r:.40}, but "
        f"{os.path.basename(files.models[0])} has dp_world_size {dp}"
      )
    if not isinstance(osd["fp32_flat_groups"], list) or len(osd["fp32_flat_groups"]) != n:
      problems.append(
        f"{path}: {_OSD}['fp32_flat_groups'] does not have one entry per sub-group of "
        f"param_shapes ({n})"
      )
  problems += common.same_everywhere(
    [(p, o["optimizer_state_dict"]["param_groups"]) for p, o in zip(paths, osds)],
    f"{_OSD}{_OSD}['param_groups']",
  )
  common.fail(f"{files.folder}: rank files from different runs or steps", problems)


def group_of_subgroups(groups, count: int, path: str, where: str) -> list[int]:
  """The param group of each sub-group, from `param_groups[g]['params']` (§5)."""
  owner: dict[int, int] = {}
  problems = []
  for g, group in enumerate(groups if isinstance(groups, list) else []):
    for s in group.get("params", []) if isinstance(group, dict) else []:
      if type(s) is not int or s in owner or not 0 <= s < count:
        problems.append(
          f"{path}: {where}[{g}]['params'] has sub-group {s!r:.20} twice or >= {count}"
        )
        continue
      owner[s] = g
  missing = [s for s in range(count) if s not in owner]
  problems += [f"{path}: {where}: no param group lists sub-group {s}" for s in missing]
  common.fail(f"{path}: param groups do not match the {count} sub-groups of param_shapes", problems)
  return [owner[s] for s in range(count)]


def cut(flats: list[np.ndarray], offset: int, numel: int) -> list[np.ndarray]:
  """A parameter's pieces: `pn` elements at `offset` in each rank's flat, padding dropped."""
  pn = -(-numel // len(flats))
  pieces = []
  for r, flat in enumerate(flats):
    n = min(pn, numel - r * pn)
    if n <= 0:
      break
    pieces.append(flat[offset : offset + n])
  return pieces


def _subgroup_params(s, shapes, group, paths, flats, slots, dp, problems) -> list[SourceParam]:
  size = sum(-(-math.prod(shape) // dp) for shape in shapes.values())
  arrays: dict[str, list[np.ndarray]] = {}
  for path, fp32, rank_slots in zip(paths, flats, slots):
    named = {"value": (fp32, f"{_OSD}['fp32_flat_groups'][{s}]")}
    named |= {k: (v, f"{_OSD}{_OSD}['state'][{s}][{k!r}]") for k, v in rank_slots.items()}
    for key, (array, where) in named.items():
      data = common.flat(array, path, where, problems)
      if data is not None and data.size != size:
        problems.append(
          f"{path}: {where} has {data.size} elements; the sub-group's parameters "
          f"({', '.join(shapes)}) need {size} at dp {dp}: unknown layout"
        )
      arrays.setdefault(key, []).append(data)
  keys = sorted(arrays)
  bad = [p for p, st in zip(paths, slots) if sorted(["value", *st]) != keys]
  problems += [f"{p}: sub-group {s} has other optimizer slots than rank 0" for p in bad]
  if bad or any(a is None or a.size != size for v in arrays.values() for a in v):
    return []
  params, offset = [], 0
  files = ", ".join(sorted({os.path.basename(p) for p in paths}))
  for name, shape in shapes.items():
    numel = math.prod(shape)
    where = f"{name} (sub-group {s} of {files})"
    tensors = {
      k: Tensor(shape, v[0].dtype, fixed(cut(v, offset, numel)), f"{where}[{k}]")
      for k, v in arrays.items()
    }
    value = tensors.pop("value")
    params.append(SourceParam(name=name, value=value, slots=tensors, group=group))
    offset += -(-numel // dp)
  return params


def frozen_params(models: list[dict], paths: list[str], dp: int) -> list[SourceParam]:
  """Frozen parameters (§9): a padded `ceil(n/dp)` fragment in each rank's model states."""
  params, problems = [], []
  for name, shape in (models[0]["frozen_param_shapes"] or {}).items():
    pieces = []
    for path, model in zip(paths, models):
      piece = (model["frozen_param_fragments"] or {}).get(name)
      where = f"['frozen_param_fragments'][{name!r}]"
      data = common.flat(piece, path, where, problems)
      if data is not None and data.size != -(-math.prod(shape) // dp):
        problems.append(f"{path}: {where} has {data.size} elements, not ceil({shape} / {dp})")
      pieces.append(data)
    if any(p is None or p.size != -(-math.prod(shape) // dp) for p in pieces):
      continue
    where = f"{name} (frozen_param_fragments of {len(paths)} model-states files)"
    value = Tensor(tuple(shape), pieces[0].dtype, fixed(cut(pieces, 0, math.prod(shape))), where)
    params.append(SourceParam(name=name, value=value, frozen=True))
  common.fail(f"{os.path.dirname(paths[0])}: unreadable frozen parameters", problems)
  return params
