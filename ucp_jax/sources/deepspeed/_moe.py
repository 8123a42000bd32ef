"""DeepSpeed mixture-of-experts checkpoints (native `deepspeed.moe.layer.MoE`, AutoEP) -> a plan.

The layout (docs/moe.md, DeepSpeed 0.19.8, ZeRO-1/2): experts sit in optimizer param groups of
their own (`'moe': True`, `'name': 'ep_size_N'`), each partitioned over its *expert-data*
group: the `dp / N` ranks that hold the same experts. The ordinary
`zero_pp_rank_K_mp_rank_00_optim_states.pt` files hold those partitions beside the dense
groups', and `param_slice_mappings` name a rank's *local* experts (native:
`...deepspeed_experts.{j}...`, j < num_local; AutoEP: `...experts.w1` of shape
`[num_local, ...]`). The expert-parallel rank of dp rank K is `K % N`, its expert-data rank
`K // N` (with `use_data_before_expert_parallelism`: `K // (dp / N)` and `K % (dp / N)`), and
local expert j of expert-parallel rank e is global expert `e * num_local + j`.

Every expert weight of a layer becomes one stacked parameter `[num_experts, ...]` (the name
without the expert number for native MoE; AutoEP's own name), its value and every optimizer
slot stacked alike, with its group, so each expert appears once. The per-expert
`layer_L_expert_E_mp_rank_00_model_states.pt` files (the module's copies) are read only to
check, element by element on a sample, that each global expert got its own fp32 master: a
wrong guess of the layout is an error, never silently swapped experts.

Not supported (one line each): tensor or pipeline parallelism with experts, ZeRO-3 with
experts, frozen experts, runs without ZeRO (`expp_rank_*` optimizer files: `_moe_plain`).
"""

from __future__ import annotations

import os
import re

import numpy as np

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _files
from ucp_jax.sources._source_plan import Plan, SourceParam, read_pieces
from ucp_jax.sources.deepspeed import _common as common
from ucp_jax.sources.deepspeed import _contract as contract
from ucp_jax.sources.deepspeed import _experts, _zero

_AUTOEP_RE = re.compile(r"^(.*\.experts\.w[0-9]+)\.([0-9]+)\Z")
SAMPLE = 64
"""Elements of each expert compared with its per-expert file."""


def is_moe(folder: str) -> bool:
  """Whether a tag folder holds per-expert files or per-expert-rank optimizer files, and no
  files of tensor-parallel ranks (those go to `_tp`, which reads expert values only)."""
  names = _files.listdir(folder)
  for name in names:
    m = (
      common.MODEL_RE.match(name)
      or common.OPTIM_RE.match(name)
      or common.EXPERT_FILE_RE.match(name)
    )
    if m and int(m.groups()[-1]) > 0:
      return False
  return any(common.EXPERT_FILE_RE.match(n) or _experts.EXPP_RE.match(n) for n in names)


def plan(folder: str) -> Plan:
  """Reads the metadata of a MoE tag folder into a plan; see the module docstring."""
  names = sorted(_files.listdir(folder))
  _refuse_unsupported(folder, names)
  model_path = os.path.join(folder, "mp_rank_00_model_states.pt")
  if not _files.isfile(model_path):
    raise SourceFormatError(f"{folder}: mp_rank_00_model_states.pt is missing")
  if any(_experts.EXPP_RE.match(n) for n in names):
    from ucp_jax.sources.deepspeed import _moe_plain

    return _moe_plain.plan(folder, names, model_path)
  model = common.load_checked(model_path, contract.MODEL_STATES, "DeepSpeed ZeRO model-states file")
  dp = model["dp_world_size"]
  paths = _optim_paths(folder, names, dp)
  osds, versions = _zero.load_optim_states(folder, paths)
  problems: list[str] = []
  shapes = common.shapes_of(model, model_path, problems)
  common.fail(f"{model_path}: unreadable param_shapes", problems)
  groups = _groups(osds[0], len(shapes), dp, paths[0])
  stage, optimizer_class = _check_consistent(model, model_path, paths, osds, versions, groups)
  topology = _ep_ranks(model, dp)
  params, steps, experts = [], [], []
  for g in groups:
    if not g.moe:
      params += _zero.group_params(g.index, shapes[g.index], paths, osds, problems)
      steps.append(_zero.group_step(g.index, paths, osds, problems))
      continue
    ranks = topology(g.ep)
    per_rank = []
    for _e, members in enumerate(ranks):
      sub_paths, sub_osds = [paths[r] for r in members], [osds[r] for r in members]
      per_rank.append(_zero.group_params(g.index, shapes[g.index], sub_paths, sub_osds, problems))
    step = _zero.group_step(g.index, paths, osds, problems)
    steps.append(step)
    if not problems:
      experts += _experts.stack_experts(per_rank, g, folder, problems)
  common.fail(f"{folder}: the rank files do not make up the parameters", problems)
  check_expert_files(folder, names, experts)
  optimized = {p.name for p in params}
  tied, buffers, leftovers = common.model_extras(model, model_path, optimized)
  aliases, leftovers = module_aliases(model, leftovers, optimized)
  params += _zero.frozen_params(model, model_path, leftovers) + aliases
  params += [p for p, _ in experts] + tied
  hyper = [osds[0]["base_optimizer_state"]["param_groups"][g.index] for g in groups]
  source_layout = common.layout(model, stage=stage, optimizer_class=optimizer_class)
  source_layout |= moe_layout(model, groups, [p for p, _ in experts])
  return Plan(
    params=params,
    buffers=buffers,
    optimizer=common.optimizer_entry(hyper, steps, model.get("ds_config")),
    extra=common.extra(model, source_layout),
    source=common.source(folder, "zero_moe", source_layout),
    step=common.number(model["global_steps"]),
    path=folder,
  )


def _refuse_unsupported(folder: str, names: list[str]) -> None:
  for name in names:
    if common.ZERO3_MODEL_RE.match(name):
      raise SourceFormatError(
        f"{folder}: experts with ZeRO-3 ({name}) are not supported by this reader"
      )
    if name.startswith("layer_") and "-model_" in name:
      raise SourceFormatError(
        f"{folder}: experts with pipeline parallelism ({name}) are not supported by this reader"
      )


def _optim_paths(folder: str, names: list[str], dp: int) -> list[str]:
  found = {int(m.group(2)): n for n in names if (m := common.OPTIM_RE.match(n))}
  problems = [
    f"zero_pp_rank_{k}_mp_rank_00_optim_states.pt is missing" for k in range(dp) if k not in found
  ]
  problems += [f"{found[k]}: rank {k} >= dp_world_size {dp}" for k in found if k >= dp]
  common.fail(f"{folder}: the rank files do not match dp_world_size {dp}", problems)
  return [os.path.join(folder, found[k]) for k in range(dp)]


def _groups(osd0: dict, count: int, dp: int, path: str) -> list[_experts.Group]:
  """Each flat group's kind: dense, or experts with their expert-parallel degree."""
  hyper = osd0["base_optimizer_state"]["param_groups"]
  if not isinstance(hyper, list) or len(hyper) != count:
    raise SourceFormatError(
      f"{path}: {common.OSD}['base_optimizer_state']['param_groups'] does not have {count} groups"
    )
  out = []
  for g, group in enumerate(hyper):
    if group.get("moe") is not True:
      out.append(_experts.Group(g, 1, False))
      continue
    m = _experts.GROUP_NAME_RE.match(str(group.get("name")))
    ep = int(m.group(1)) if m else 0
    if not 0 < ep <= dp or dp % ep:
      raise SourceFormatError(
        f"{path}: param group {g} is an expert group named {str(group.get('name'))!r:.40}, not "
        f"'ep_size_N' with N dividing dp_world_size {dp}"
      )
    out.append(_experts.Group(g, ep, True))
  return out


def _check_consistent(model, model_path, paths, osds, versions, groups):
  """`_zero.check_consistent` with each group's own partition count (dp / N for experts)."""
  want = [len(paths) // g.ep for g in groups]
  problems = common.same_everywhere(
    [(model_path, model["ds_version"]), *versions], "['ds_version']"
  )
  kinds = [(p, common.optimizer_class(o)) for p, o in zip(paths, osds)]
  problems += common.same_everywhere(kinds, "(zero stage, optimizer class)")
  stage, optimizer_class = kinds[0][1]
  if stage not in (1, 2) or optimizer_class != "DeepSpeedZeroOptimizer":
    problems.append(f"{paths[0]}: {optimizer_class} (stage {stage}) with experts is not supported")
  for path, osd in zip(paths, osds):
    if osd["partition_count"] != want:
      problems.append(
        f"{path}: {common.OSD}['partition_count'] is {osd['partition_count']!r:.60}, but the "
        f"groups' data-parallel degrees are {want} (dp_world_size {len(paths)}, expert "
        f"groups over dp / ep ranks)"
      )
    for key in ("single_partition_of_fp32_groups", "group_paddings", "param_slice_mappings"):
      if not isinstance(osd[key], list) or len(osd[key]) != len(groups):
        problems.append(f"{path}: {common.OSD}[{key!r}] does not have one entry per group")
  problems += common.same_everywhere(
    [(p, o["base_optimizer_state"]["param_groups"]) for p, o in zip(paths, osds)],
    f"{common.OSD}['base_optimizer_state']['param_groups']",
  )
  common.fail(f"{os.path.dirname(model_path)}: rank files from different runs or steps", problems)
  return stage, optimizer_class


def _ep_ranks(model: dict, dp: int):
  """`topology(ep)`: per expert-parallel rank, its dp ranks in expert-data order."""
  config = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else {}
  data_first = bool(config.get("use_data_before_expert_parallelism", False))

  def topology(ep: int) -> list[list[int]]:
    if data_first:
      stride = dp // ep
      return [list(range(e * stride, (e + 1) * stride)) for e in range(ep)]
    return [list(range(e, dp, ep)) for e in range(ep)]

  return topology


def module_aliases(model: dict, leftovers: list[str], optimized: set[str]):
  """`module` entries of an AutoEP layer that are another name of one of its optimized
  parameters (its router is saved as `mlp.router.gate.weight` and again as
  `mlp.gate.gate.weight`, equal bit for bit): tied parameters, not frozen ones.
  Returns (tied Params, the other leftovers)."""
  module = model.get("module") if isinstance(model.get("module"), dict) else {}
  layers = model.get("ds_autoep_layers") or []
  paths = [x.get("module_path") for x in layers if isinstance(x, dict)]
  paths = [p + "." for p in paths if isinstance(p, str) and p]
  aliases, rest = [], []
  for name in leftovers:
    t = module.get(name)
    holder = None
    for path in (p for p in paths if name.startswith(p)):
      for other in sorted(o for o in optimized if o.startswith(path)):
        u = module.get(other)
        if _bit_equal(t, u):
          holder = other
          break
    if holder is None:
      rest.append(name)
    else:
      aliases.append(SourceParam(name, None, tied_to=holder))
  return aliases, rest


def _bit_equal(a, b) -> bool:
  if not (common.is_tensor(a) and common.is_tensor(b)) or a.shape != b.shape or a.dtype != b.dtype:
    return False
  x, y = read_pieces([a, b])
  return bool(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)))


def check_expert_files(folder: str, names: list[str], experts: list) -> None:
  """Each global expert's fp32 master, cast to the module dtype, equals its own file's copy
  on a sample: the expert-parallel layout was read right (else an error naming the experts)."""
  keys: dict[str, tuple[str, dict]] = {}
  for n in names:
    if common.EXPERT_FILE_RE.match(n):
      path = os.path.join(folder, n)
      data = common.load_checked(path, contract.EXPERTS, "DeepSpeed expert-parameters file")
      for key in data:
        keys[key] = (path, data)
  problems, covered = [], set()
  for param, owners in experts:
    for e, (key, local, index) in sorted(owners.items()):
      covered.add(key)
      if key not in keys:
        problems.append(f"`{param.name}` expert {e}: no expert file holds {key!r}")
        continue
      path, data = keys[key]
      copy = data[key]
      count = min(SAMPLE, copy.size)
      start = 0 if index is None else index * copy.size
      sample = _elements(local.value.pieces(), start, count)
      mine = sample.astype(copy.dtype)
      theirs = np.asarray(read_pieces([copy.reshape(-1)[:count]])[0])
      if not np.array_equal(mine.view(np.uint8), theirs.view(np.uint8)):
        problems.append(
          f"`{param.name}` expert {e}: its fp32 master differs from {os.path.basename(path)}"
          f"[{key!r}] (the expert-parallel layout is not the one assumed)"
        )
  frozen = sorted(set(keys) - covered)
  if frozen:
    problems.append(
      f"experts in no optimizer group (frozen experts are not supported): {frozen[0]}"
      + (f" and {len(frozen) - 1} more" if len(frozen) > 1 else "")
    )
  common.fail(f"{folder}: the experts do not match their per-expert files", problems)


def _elements(pieces, start: int, count: int) -> np.ndarray:
  """Elements `[start, start + count)` of the concatenation of `pieces` (reading only those)."""
  out, offset = [], 0
  for piece in pieces:
    n = piece.size
    lo, hi = max(start, offset), min(start + count, offset + n)
    if lo < hi:
      out.append(np.asarray(read_pieces([piece.reshape(-1)[lo - offset : hi - offset]])[0]))
    offset += n
    if offset >= start + count:
      break
  return np.concatenate(out) if out else np.zeros(0, np.float32)


def moe_layout(model: dict, groups: list[_experts.Group], experts: list[SourceParam]) -> dict:
  """The schema's `source_layout` entries of a MoE run."""
  kinds = sorted({p.pattern["experts"]["layout"] for p in experts})
  return {
    "ep": max((g.ep for g in groups if g.moe), default=1),
    "moe": kinds[0] if len(kinds) == 1 else kinds,
    "num_experts": common.jsonable(model.get("num_experts")),
    "autoep_layers": common.jsonable(model.get("ds_autoep_layers")),
  }
