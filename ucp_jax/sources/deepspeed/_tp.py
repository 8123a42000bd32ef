"""DeepSpeed tensor-, pipeline- and expert-parallel checkpoints -> a conversion plan.

A tag folder of a model-parallel run holds, per model-parallel rank `i` (pipeline-major:
stage `i // tp`, TP rank `i % tp`, as `checkpoint_parallel_dimensions` says), one
`mp_rank_{i:02d}_model_states.pt` and one ZeRO-1/2 optimizer file per dp rank
(`[bf16_]zero_pp_rank_{dp}_mp_rank_{i:02d}_optim_states.pt`). Pipeline runs keep weights in
`layer_XX-model_YY-model_states.pt` (the optimizer files hold the fp32 masters under the
pipeline module's names); native MoE runs keep experts in
`layer_{L}_expert_{E}_mp_rank_{TP:02d}_model_states.pt`.

Each TP rank's shard of a parameter (value and every optimizer slot) is cut from its dp
partitions by the ZeRO-1/2 converter's per-rank logic (`_zero`); the shards are then
merged by the parameter's pattern (`_tp_merge`: column, row, replicated, average,
sub-params, vocabulary padding), and a parameter held by several pipeline stages (a tied
embedding) is checked equal across them. Patterns come from `universal_checkpoint_info` (the union over all
model-states files: AutoTP writes each pipeline stage's own) and from user rules. Experts from
per-expert files are stacked into one `[num_experts, ...]` array (values only: DeepSpeed keeps
native MoE optimizer state in files this reader does not parse). Every merged parameter records
its pattern in the schema (`"pattern": {"kind": ..., ...}`).

Not supported (each refused with a message): ZeRO-3 with TP (`zero_pp_rank_*_mp_rank_*_model_states.pt`
with mp_rank > 0), frozen parameters and buffers of pipeline runs (their `module` is empty).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.parallel import _pattern_rules, _patterns
from ucp_jax.parallel._patterns import Pattern
from ucp_jax.sources import _files
from ucp_jax.sources._source_plan import Plan, SourceParam, Tensor, read_pieces
from ucp_jax.sources.deepspeed import _common as common
from ucp_jax.sources.deepspeed import _contract as contract
from ucp_jax.sources.deepspeed import _tp_merge, _zero
from ucp_jax.store import _untrusted

_LAYER_RE = re.compile(r"^layer_([0-9]+)-model_([0-9]+)-model_states\.pt\Z")
_EXPERT_KEY_RE = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)\.(.*)$")
_MODEL_STATES = "DeepSpeed ZeRO model-states file"


def is_model_parallel(folder: str) -> bool:
  """Whether a tag folder holds files of model-parallel ranks other than 0, or layer files."""
  for name in _files.listdir(folder):
    m = (
      common.MODEL_RE.match(name)
      or common.OPTIM_RE.match(name)
      or common.ZERO3_MODEL_RE.match(name)
    )
    if m and int(m.groups()[-1]) > 0:
      return True
    if _LAYER_RE.match(name) or common.EXPERT_FILE_RE.match(name):
      return True
  return False


@dataclasses.dataclass
class _Rank:
  """One model-parallel rank: (stage, tp rank), its model states, and its parameters."""

  stage: int
  tp: int
  path: str
  model: dict
  params: dict[str, SourceParam]
  steps: list[Any]
  osd0: dict  # dp rank 0's optimizer_state_dict (param groups, stage)


def plan(folder: str, *, rules: Sequence = ()) -> Plan:
  """Reads the metadata of a TP/PP/EP tag folder into a plan; see the module docstring.

  Args:
    folder: the tag folder.
    rules: `(regex, pattern)` pairs (see `_pattern_rules.classify`) for parameters the checkpoint's
      `universal_checkpoint_info` does not describe (or describes wrongly).
  """
  names = sorted(_files.listdir(folder))
  ranks, tp, pp = _read_ranks(folder, names)
  info, problems = contract.universal_info(
    union_info([r.model.get("universal_checkpoint_info") for r in ranks]), folder
  )
  common.fail(f"{folder}: unusable universal_checkpoint_info", problems)
  experts = _expert_files(folder, names, tp)
  params = _params(folder, ranks, tp, info, rules, experts)
  model = ranks[0].model
  if model.get("module") is not None and pp == 1:
    params += _frozen_and_buffers_check(ranks, {p.name for p in params})
  groups = ranks[0].osd0["base_optimizer_state"]["param_groups"]
  stage, optimizer_class = common.optimizer_class(ranks[0].osd0)
  source_layout = common.layout(model, stage=stage, optimizer_class=optimizer_class)
  source_layout |= {"tp": tp, "pp": pp, "num_experts": {n: len(f) for n, f in experts.items()}}
  extra = common.extra(model, source_layout)
  extra["universal_checkpoint_info"] = _patterns_json(info)
  return Plan(
    params=params,
    buffers={},
    optimizer=common.optimizer_entry(groups, ranks[0].steps, model.get("ds_config")),
    extra=extra,
    source=common.source(folder, "zero_tp", source_layout),
    step=common.number(model["global_steps"]),
    path=folder,
  )


def _read_ranks(folder: str, names: list[str]) -> tuple[list[_Rank], int, int]:
  """Every model-parallel rank of the folder (checked to match its layout), and tp, pp."""
  zero3 = [n for n in names if common.ZERO3_MODEL_RE.match(n)]
  common.fail(
    f"{folder}: ZeRO-3 with tensor parallelism is not supported by this reader yet (use "
    "DeepSpeed's ds_to_universal, then convert its output)",
    zero3,
  )
  models = {
    int(m.group(1)): os.path.join(folder, n) for n in names if (m := common.MODEL_RE.match(n))
  }
  optims: dict[int, dict[int, str]] = {}
  for n in names:
    if m := common.OPTIM_RE.match(n):
      optims.setdefault(int(m.group(3)), {})[int(m.group(2))] = os.path.join(folder, n)
  if 0 not in models:
    raise SourceFormatError(f"{folder}: mp_rank_00_model_states.pt is missing")
  first = common.load_checked(models[0], contract.MODEL_STATES, _MODEL_STATES)
  tp, pp = _degrees(first, models[0], len(models))
  problems = [
    f"mp_rank_{i:02d}_model_states.pt is missing (tp {tp} x pp {pp})"
    for i in range(tp * pp)
    if i not in models
  ]
  problems += [
    f"{os.path.basename(models[i])}: beyond tp {tp} x pp {pp}" for i in models if i >= tp * pp
  ]
  common.fail(f"{folder}: the model-parallel rank files do not match the layout", problems)
  ranks = [
    _read_rank(folder, i, tp, models[i], optims.get(i, {}), first if i == 0 else None)
    for i in range(tp * pp)
  ]
  return ranks, tp, pp


def _params(folder: str, ranks: list[_Rank], tp: int, info: dict, rules: Sequence, experts):
  """The optimized parameters: every rank's shards merged by pattern, experts stacked."""
  by_name: dict[str, dict[int, dict[int, SourceParam]]] = {}
  for r in ranks:
    for name, p in r.params.items():
      by_name.setdefault(name, {}).setdefault(r.stage, {})[r.tp] = p
  patterns = _pattern_rules.classify(  # experts are stacked by expert, whatever the info says
    list(by_name),
    info=info,
    rules=rules,
    default=_patterns.column() if (info or tp == 1) else None,
    where=folder,
  )
  params, problems = [], []
  for name, stages in by_name.items():
    p = _tp_merge.merged_param(name, stages, tp, patterns[name], problems)
    if p is not None:
      params.append(p)
  for name, files in experts.items():
    params.append(_experts(name, files, problems))
  common.fail(f"{folder}: the tensor-parallel fragments do not make up the parameters", problems)
  return params


def _degrees(model: dict, path: str, files: int) -> tuple[int, int]:
  dims = model.get("checkpoint_parallel_dimensions")
  if isinstance(dims, dict) and "tp_degree" in dims and "pp_degree" in dims:
    tp, pp = dims["tp_degree"], dims["pp_degree"]
  else:
    tp = model.get("mp_world_size")
    if tp is None:
      raise SourceFormatError(
        f"{path}: neither ['checkpoint_parallel_dimensions'] nor an int ['mp_world_size']: "
        "cannot tell the tensor- and pipeline-parallel degrees"
      )
    pp = max(1, files // tp)
  if tp * pp > contract.MAX_RANKS:  # each is at most MAX_RANKS (contract.MODEL_STATES)
    raise SourceFormatError(
      f"{path}: tp {tp} x pp {pp} model-parallel ranks, more than {contract.MAX_RANKS}"
    )
  return tp, pp


def _read_rank(folder, i, tp, model_path, optims, model) -> _Rank:
  if model is None:  # rank 0's, read and checked by `_read_ranks`
    model = common.load_checked(model_path, contract.MODEL_STATES, _MODEL_STATES)
  dp = model["dp_world_size"]
  missing = [k for k in range(dp) if k not in optims]
  common.fail(
    f"{folder}: optimizer files of model-parallel rank {i} are missing (dp_world_size {dp})",
    [f"zero_pp_rank_{k}_mp_rank_{i:02d}_optim_states.pt" for k in missing],
  )
  paths = [optims[k] for k in range(dp)]
  osds, versions = _zero.load_optim_states(folder, paths)
  _zero.check_consistent(model, model_path, paths, osds, versions)
  problems: list[str] = []
  shapes = common.shapes_of(model, model_path, problems)
  params, steps = {}, []
  for g, group in enumerate(shapes):
    for p in _zero.group_params(g, group, paths, osds, problems):
      params[p.name] = p
    steps.append(_zero.group_step(g, paths, osds, problems))
  common.fail(
    f"{folder}: the rank files of model-parallel rank {i} do not make up its shards", problems
  )
  return _Rank(i // tp, i % tp, model_path, model, params, steps, osds[0])


def union_info(infos: Sequence[Any]) -> dict:
  """The union of several `universal_checkpoint_info` dicts (pattern lists and maps merged).

  DeepSpeed's `ds_to_universal` reads only the first model-states file's; with AutoTP and a
  pipeline each stage lists only its own parameters. A list or dict replaces a value of
  another kind under the same key (`_contract.universal_info` checks the union).
  """
  out: dict[str, Any] = {}
  seen: dict[str, set] = {}  # per list: what it holds (its repr, when unhashable)
  for info in infos:
    if not isinstance(info, dict):
      continue
    for key, value in info.items():
      if isinstance(value, list | tuple) and key != "shape":
        if not isinstance(out.get(key), list):
          out[key], seen[key] = [], set()
        merged = out[key]
        for v in value:
          marker = v if isinstance(v, str | int | float) else repr(v)
          if marker not in seen.setdefault(key, set()):
            seen[key].add(marker)
            merged.append(v)
      elif isinstance(value, dict):
        if not isinstance(out.get(key), dict):
          out[key] = {}
        merged = out[key]
        for k, v in value.items():
          merged[k] = (
            {**merged[k], **v} if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
          )
      else:
        out.setdefault(key, value)
  return out


def _patterns_json(info: dict) -> dict:
  from ucp_jax.sources._source_plan import jsonable

  return jsonable({k: v for k, v in info.items() if k != "affine_map"})


def _expert_files(folder: str, names: list[str], tp: int) -> dict[str, dict[int, tuple[str, str]]]:
  """`{stacked name: {expert: (file, key)}}` from native MoE per-expert files (TP rank 0)."""
  out: dict[str, dict[int, tuple[str, str]]] = {}
  for n in names:
    m = common.EXPERT_FILE_RE.match(n)
    if not m or int(m.group(3)) != 0:
      continue
    path = os.path.join(folder, n)
    data = common.load_checked(path, contract.EXPERTS, "DeepSpeed expert-parameters file")
    for key in data:
      k = _EXPERT_KEY_RE.match(key)
      if k is None or int(k.group(2)) != int(m.group(2)):
        raise SourceFormatError(f"{path}: key {key!r} is not an expert {m.group(2)} parameter")
      out.setdefault(k.group(1) + k.group(3), {})[int(k.group(2))] = (path, key)
  return out


def _experts(name: str, files: dict[int, tuple[str, str]], problems) -> SourceParam:
  n = len(files)
  if sorted(files) != list(range(n)):
    problems.append(f"`{name}`: expert files for experts {sorted(files)}, expected 0..{n - 1}")
  path0, key0 = files[min(files)]
  sample = common.load(path0)[key0]
  for path, key in files.values():
    array = common.load(path)[key]
    if array.shape != sample.shape or array.dtype != sample.dtype:
      problems.append(
        f"{path}: [{key!r}] has shape {array.shape} and {array.dtype}, but the expert in "
        f"{os.path.basename(path0)} {sample.shape} and {sample.dtype}"
      )
  shape = (n, *sample.shape)
  pattern = _patterns.expert(n)

  def pieces() -> list[np.ndarray]:
    _untrusted.check_allocation(math.prod(shape) * sample.dtype.itemsize, path0)
    arrays = read_pieces([common.load(files[e][0])[files[e][1]] for e in range(n)])
    return [
      np.ascontiguousarray(_patterns.merge(arrays, pattern, name=name, per_expert=True)).reshape(-1)
    ]

  value = Tensor(shape, sample.dtype, pieces, f"{name} (experts in {os.path.basename(path0)} ...)")
  return SourceParam(
    name, value, {}, group=None, pattern=pattern.to_json(), shard_shape=(1, *shape[1:])
  )


def _frozen_and_buffers_check(ranks: list[_Rank], optimized: set[str]) -> list[SourceParam]:
  """Frozen parameters and buffers of TP runs: not merged yet; refuse rather than drop them."""
  module = ranks[0].model.get("module") or {}
  extra = [k for k in module if k not in optimized and not _EXPERT_KEY_RE.match(k)]
  shared = ranks[0].model.get("shared_params") or {}
  extra = [k for k in extra if k not in shared]
  common.fail(
    f"{ranks[0].path}: buffers and frozen parameters of tensor-parallel checkpoints are not "
    "converted yet",
    extra,
  )
  return [SourceParam(alias, None, tied_to=holder) for alias, holder in shared.items()]


def universal_meta(pattern: dict | None, name: str) -> dict[str, Any]:
  """The keys DeepSpeed's universal files carry beside `param` for a parameter's pattern.

  They are what `ds_to_universal` writes and what `load_hp_checkpoint_state`
  (deepspeed/checkpoint/universal_checkpoint.py) reads to cut a target TP rank's slice:
  `cat_dim`, `param_n_sub_params` (two equal sub-parameters), `sub_param_shape` (a
  `SubparamShape`, only when deepspeed is importable), `vocab_tensor` (padded again to the
  target's size), `is_expert_param`/`ep_num_experts`. Without a pattern: `{"cat_dim": 0}`.
  """
  if not pattern:
    return {"cat_dim": 0}
  p = Pattern.from_json(pattern)
  meta: dict[str, Any] = {}
  if p.kind in ("column", "row", "expert"):
    meta["cat_dim"] = p.cat_dim
  elif p.kind == "sub_params":
    sizes = p.sub_params if isinstance(p.sub_params, tuple) else None
    if p.cat_dim == 0 and (sizes is None or (len(sizes) == 2 and sizes[0] == sizes[1])):
      meta |= {"cat_dim": 0, "param_n_sub_params": 2 if sizes else p.sub_params}
    else:
      try:
        from deepspeed.checkpoint.universal_checkpoint import SubparamShape
      except ImportError:
        SubparamShape = None
      if SubparamShape is not None:
        shape: list[Any] = [-1, -1]
        shape[p.cat_dim] = tuple(sizes)
        meta["sub_param_shape"] = SubparamShape(
          patterns=[f"^{re.escape(name)}$"], shape=tuple(shape), partition_dim=p.cat_dim
        )
  if p.vocab_size is not None:
    meta["vocab_tensor"] = True
  if p.kind == "expert":
    meta |= {"is_expert_param": True, "ep_num_experts": p.num_experts}
  return meta
