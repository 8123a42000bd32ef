"""DeepSpeed mixture-of-experts checkpoints without ZeRO: `expp_rank_*` optimizer files.

Without ZeRO, DeepSpeed 0.19.8 (`_save_moe_checkpoint`) writes the module's non-expert values
in `mp_rank_00_model_states.pt` (`param_shapes` is None), each expert's values in its
`layer_L_expert_E_mp_rank_00_model_states.pt`, and for each expert-parallel rank e the plain
torch optimizer state of its writer in `expp_rank_{e}_mp_rank_00_optim_states.pt`: Adam's
state by parameter *index*, and the param groups listing indices, without names. Names are
found from the model: each group holds, in order, some of the module's parameters (dense
groups) or of rank e's local experts (expert groups), and the one way to place every group's
tensors on those parameters so that shapes match is taken; if there are several, the
checkpoint is refused rather than guessed. fp32 runs only (the values are the masters).
"""

from __future__ import annotations

import functools
import os
import re

import numpy as np

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources._source_plan import Plan, SourceParam
from ucp_jax.sources._torch_reader._torch_file import is_tensor
from ucp_jax.sources.deepspeed import _common as common
from ucp_jax.sources.deepspeed import _contract as contract
from ucp_jax.sources.deepspeed import _experts

PLAIN_MODEL_STATES = contract.Keys(
  {**contract.MODEL_STATES.required, "param_shapes": contract.Maybe(contract.ANY)},
  contract.MODEL_STATES.optional,
)
"""Model states of a run without ZeRO: `param_shapes` is None."""
_MAX_SEARCH = 1 << 16
"""Steps the search for the parameters' placement may take (then: refused as ambiguous)."""


def plan(folder: str, names: list[str], model_path: str) -> Plan:
  """Reads a no-ZeRO MoE tag folder; see the module docstring."""
  model = common.load_checked(model_path, PLAIN_MODEL_STATES, "DeepSpeed model-states file")
  module = model["module"] or {}
  expp = {
    int(m.group(1)): os.path.join(folder, n) for n in names if (m := _experts.EXPP_RE.match(n))
  }
  osds = {e: _osd(path) for e, path in sorted(expp.items())}
  groups = osds[0]["param_groups"]
  moe = [g for g, h in enumerate(groups) if h.get("moe") is True]
  ep = _ep(groups, moe, expp[0])
  missing = [e for e in range(ep) if e not in osds]
  common.fail(
    f"{folder}: expert-rank optimizer files missing",
    [f"expp_rank_{e}_mp_rank_00_optim_states.pt" for e in missing],
  )
  files = _expert_files(folder, names, ep)
  buffers = set(model.get("buffer_names") or [])
  dense_names = [n for n in module if n not in buffers and is_tensor(module[n])]
  problems: list[str] = []
  dense_groups = [g for g in range(len(groups)) if g not in moe]
  placed = _place(
    osds[0], dense_groups, dense_names, {n: module[n].shape for n in dense_names}, expp[0], problems
  )
  experts: dict[int, dict[int, str]] = {}  # ep rank -> {index: global expert name}
  for e in range(ep):
    local = [k for k, (er, _) in files.items() if er == e]
    shapes = {k: files[k][1].shape for k in local}
    experts[e] = _place(osds[e], moe, local, shapes, expp[e], problems)
  common.fail(f"{folder}: the optimizer files do not fit the model", problems)
  params, steps = [], [None] * len(groups)
  for index, name in placed.items():
    g = next(g for g in dense_groups if index in groups[g]["params"])
    params.append(_param(name, module[name], osds[0]["state"][index], g, model_path, problems))
    steps[g] = _step(osds[0]["state"][index])
  per_expert = {}
  for e, found in experts.items():
    for index, name in found.items():
      g = next(g for g in moe if index in osds[e]["param_groups"][g]["params"])
      per_expert[name] = _param(name, files[name][1], osds[e]["state"][index], g, expp[e], problems)
      steps[g] = _step(osds[e]["state"][index])
  common.fail(f"{folder}: unreadable optimizer state", problems)
  params += _experts.stack_universal(list(per_expert.values()), groups, problems)
  common.fail(f"{folder}: the experts do not stack", problems)
  optimized = set(placed.values())
  tied, buffer_tensors, leftovers = common.model_extras(model, model_path, optimized)
  params += [
    SourceParam(n, common.whole(module[n], f"{model_path}[{n!r}]"), frozen=True) for n in leftovers
  ] + tied
  source_layout = common.layout(model, stage=0, optimizer_class="torch")
  source_layout |= {
    "ep": ep,
    "moe": "native",
    "num_experts": common.jsonable(model.get("num_experts")),
  }
  hyper = [{k: v for k, v in h.items() if k != "params"} for h in groups]
  return Plan(
    params=params,
    buffers=buffer_tensors,
    optimizer=common.optimizer_entry(hyper, steps, model.get("ds_config")),
    extra=common.extra(model, source_layout),
    source=common.source(folder, "moe_no_zero", source_layout),
    step=common.number(model["global_steps"]),
    path=folder,
  )


_TORCH_OSD = contract.Keys(
  {
    "state": contract.DictOf(
      contract.Int(0), contract.Keys({}, {"step": contract.NUMBER}, key=contract.STR)
    ),
    "param_groups": contract.ListOf(
      contract.Keys({"params": contract.ListOf(contract.Int(0))}, {"moe": contract.FLAG})
    ),
  }
)
"""An `expp_rank_*` file's `['optimizer']`: a torch optimizer `state_dict`."""


def _osd(path: str) -> dict:
  data = common.load(path)
  common.fail(
    f"{path}: not a DeepSpeed expert-rank optimizer file",
    contract.check(data, contract.Keys({"optimizer": _TORCH_OSD}), path),
  )
  return data["optimizer"]


def _ep(groups: list, moe: list[int], path: str) -> int:
  sizes = {str(groups[g].get("name")) for g in moe}
  m = re.match(r"ep_size_([0-9]+)\Z", next(iter(sizes))) if len(sizes) == 1 else None
  if m is None:
    raise SourceFormatError(f"{path}: expert groups named {sorted(sizes)}, not one 'ep_size_N'")
  return int(m.group(1))


def _expert_files(folder: str, names: list[str], ep: int) -> dict[str, tuple[int, np.ndarray]]:
  """Every expert weight by global name: (its expert-parallel rank, value), in module order
  (layer by layer, experts in order: local expert j of rank e is global `e * local + j`)."""
  found = []
  for n in names:
    if m := common.EXPERT_FILE_RE.match(n):
      path = os.path.join(folder, n)
      data = common.load_checked(path, contract.EXPERTS, "DeepSpeed expert-parameters file")
      found.append((int(m.group(1)), int(m.group(2)), data))
  per_layer: dict[int, int] = {}
  for layer, _, _ in found:
    per_layer[layer] = per_layer.get(layer, 0) + 1
  bad = [n for layer, n in per_layer.items() if n % ep]
  if bad:
    raise SourceFormatError(f"{folder}: {bad[0]} expert files in a layer for ep_size {ep}")
  out = {}
  for layer, expert, data in sorted(found, key=lambda x: (x[0], x[1])):
    for key, value in data.items():
      out[key] = (expert // (per_layer[layer] // ep), value)
  return out


def _place(osd, groups, candidates, shapes, path, problems) -> dict[int, str]:
  """{optimizer index: name}: the one placement of `groups`' tensors (in index order) on
  `candidates` (in module order) whose shapes match; a problem when none or several fit."""
  seqs = []
  for g in groups:
    indices = osd["param_groups"][g]["params"]
    shaped = []
    for i in indices:
      state = osd["state"].get(i) or {}
      avg = state.get("exp_avg")
      shaped.append((i, tuple(avg.shape) if is_tensor(avg) else None))
    seqs.append(shaped)
  steps = [0]

  @functools.cache
  def count(pos: int, at: tuple[int, ...]) -> int:
    steps[0] += 1
    if steps[0] > _MAX_SEARCH:
      return 2
    if all(a == len(s) for a, s in zip(at, seqs)):
      return 1
    if pos == len(candidates):
      return 0
    total = count(pos + 1, at)  # this parameter is in no group (frozen)
    for k, s in enumerate(seqs):
      if at[k] < len(s) and s[at[k]][1] == tuple(shapes[candidates[pos]]):
        total += count(pos + 1, (*at[:k], at[k] + 1, *at[k + 1 :]))
        if total > 1:
          return 2
    return total

  start = tuple(0 for _ in seqs)
  found = count(0, start)
  if found != 1:
    problems.append(
      f"{path}: cannot tell which parameters param groups {groups} hold (a torch optimizer "
      f"state has no names, and {'no' if found == 0 else 'more than one'} placement of its "
      "tensors on the model's parameters fits their shapes)"
    )
    return {}
  out, pos, at = {}, 0, start
  while not all(a == len(s) for a, s in zip(at, seqs)):
    if count(pos + 1, at) == 1:
      pos += 1
      continue
    for k, s in enumerate(seqs):
      if at[k] < len(s) and s[at[k]][1] == tuple(shapes[candidates[pos]]):
        nxt = (*at[:k], at[k] + 1, *at[k + 1 :])
        if count(pos + 1, nxt) == 1:
          out[s[at[k]][0]] = candidates[pos]
          at, pos = nxt, pos + 1
          break
  return out


def _param(name, value, state, group, path, problems) -> SourceParam | None:
  if not is_tensor(value) or value.dtype != np.float32:
    problems.append(f"{path}: {name!r} is not a float32 tensor (fp32 runs only without ZeRO)")
    return None
  slots = {}
  for k, v in sorted(state.items()):
    if k != "step" and is_tensor(v) and v.shape == value.shape:
      slots[k] = common.whole(v, f"{path} state {k} of {name}")
  return SourceParam(name, common.whole(value, f"{name} ({path})"), slots, group=group)


def _step(state: dict):
  step = state.get("step")
  return np.asarray(step).item() if step is not None else None
