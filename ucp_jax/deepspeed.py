"""Inside a DeepSpeed job: finishing what `engine.load_checkpoint` leaves undone.

DeepSpeed 0.19.8's `load_checkpoint` with `"checkpoint": {"load_universal": true}` restores
the trainable parameters (fp32 masters, then the low-precision copies) and the optimizer
state from `zero/`. Measured against its source (docs/export.md), it also:

- never loads the model-states `module` (engine.py `_load_checkpoint` skips
  `load_module_state_dict` for universal loads): buffers and frozen parameters keep the values
  the model was built with;
- ZeRO-1/2 (base_optimizer.py): gives the engine's param group i the hyperparameters of the
  file's group i, by position, whatever parameters each holds: an export whose groups are
  numbered otherwise (a JAX optimizer's order) would swap them silently;
- ZeRO-3 (stage3.py `load_hp_checkpoint_state_from_checkpoint_dir_stage3`): applies
  `param_groups[0]`'s hyperparameters to every group, and gives every sub-group the *same*
  step tensor, which torch's Adam increments in place once per sub-group: with S sub-groups
  the step count advances S times per optimizer step (wrong bias correction).

No file can change that code. `finish_load`, called right after `load_checkpoint`, fixes all
of it from the files `ucp_jax.export` writes (and, except frozen parameters, from
`ds_to_universal`'s). Needs torch and deepspeed (imported when called).
"""

from __future__ import annotations

import os

from ucp_jax.integrations import _moe_load
from ucp_jax.sinks import _deepspeed


def finish_load(engine, load_dir: str | os.PathLike, tag: str | None = None) -> list[str]:
  """Restores what DeepSpeed's universal `load_checkpoint` leaves out; call it on every rank.

  - buffers and frozen parameters from the model-states `module` (ZeRO-3: each frozen
    parameter is gathered, set and re-partitioned, a collective);
  - each param group's own hyperparameters from `zero/optimizer_state.pt`'s `param_groups`:
    the file's group with the same parameters (the model states' `param_shapes` name each
    group's), in whatever order the two list them;
  - ZeRO-3: one step tensor per sub-group;
  - native MoE (`deepspeed.moe.layer.MoE`) at ep > 1: each rank's local experts from their
    own global files (DeepSpeed's loader reads `...deepspeed_experts.{j}` by the *local*
    number j, so every expert-parallel rank gets rank 0's experts).

  Trainable parameters in `module` are skipped (the optimizer path restores them from fp32),
  and so are empty placeholders (DeepSpeed's own ZeRO-3 model states hold no values).

  Example:
    >>> engine.load_checkpoint("ds_universal")  # doctest: +SKIP
    >>> ucp_jax.deepspeed.finish_load(engine, "ds_universal")  # doctest: +SKIP
    ['gate', 'scale']

  Args:
    engine: the `deepspeed.DeepSpeedEngine`, after `load_checkpoint(load_dir)`.
    load_dir: the directory given to `load_checkpoint` (holds `latest_universal`).
    tag: the checkpoint tag; default: the one `latest_universal` names.

  Returns:
    The buffers and frozen parameters copied, in file order.

  Raises:
    KeyError: a name in `module` that the engine's model has neither as buffer nor parameter.
    ValueError: an engine param group whose parameters are not one group's of the checkpoint,
      or part of one (DeepSpeed puts experts in groups of their own): the checkpoint was
      made with other param groups.
  """
  import torch

  load_dir = os.fspath(load_dir)
  if tag is None:
    with open(os.path.join(load_dir, _deepspeed.LATEST)) as f:
      tag = f.read().strip()
  zero3 = engine.zero_optimization_partition_weights()
  name = _deepspeed.MODEL_STATES_3 if zero3 else _deepspeed.MODEL_STATES_1_2
  # DeepSpeed's load_checkpoint has just loaded these files with weights_only=False; the
  # files ucp_jax writes also load with weights_only=True, ds_to_universal's do not.
  states = torch.load(os.path.join(load_dir, tag, name), map_location="cpu", weights_only=False)
  optim = torch.load(
    os.path.join(load_dir, tag, "zero", "optimizer_state.pt"),
    map_location="cpu",
    weights_only=False,
  )
  saved = _matching_groups(engine, optim.get("param_groups") or [], states.get("param_shapes"))
  copied = _copy_module(engine, states["module"], f"{load_dir}/{tag}/{name}")
  for group, hyper in zip(engine.optimizer.optimizer.param_groups, saved):
    group.update((k, v) for k, v in hyper.items() if k not in _ENGINE_KEYS)
  if zero3:
    _unshare_zero3_steps(engine.optimizer)
  _moe_load.place_native_experts(engine, os.path.join(load_dir, tag, "zero"))
  return copied


_ENGINE_KEYS = ("params", "moe", "name")
"""Group keys that say how the engine built a group (its expert groups), kept as they are."""


def _copy_module(engine, module: dict, where: str) -> list[str]:
  import deepspeed
  import torch

  buffers = dict(engine.module.named_buffers())
  params = dict(engine.module.named_parameters(remove_duplicate=False))
  unknown = [n for n in module if n not in buffers and n not in params]
  if unknown:
    raise KeyError(f"{where}: not in the engine's model: {', '.join(unknown)}")
  copied = []
  with torch.no_grad():
    for key, value in module.items():
      target = buffers.get(key)
      if target is None and params[key].requires_grad:
        continue
      if value.numel() == 0:
        continue  # DeepSpeed's ZeRO-3 placeholder, not a value
      if target is not None:
        target.copy_(value)
      elif hasattr(params[key], "ds_id"):  # ZeRO-3: partitioned; gather, set, re-partition
        with deepspeed.zero.GatheredParameters([params[key]], modifier_rank=0):
          params[key].data.copy_(value)
      else:
        params[key].data.copy_(value)
      copied.append(key)
  return copied


def _matching_groups(engine, saved: list[dict], shapes) -> list[dict]:
  """The file's param group for each of the engine's, matched by parameter names.

  By position where the files do not name one group's parameters per group (DeepSpeed's
  own ZeRO-3 files list sub-groups) or the engine keeps no per-group parameter lists.
  """
  engine_groups = _moe_load.global_names(engine, _engine_groups(engine))
  per_group = isinstance(shapes, list) and len(shapes) == len(saved)
  if engine_groups is None or not per_group or not all(hasattr(s, "keys") for s in shapes):
    return saved
  files = [set(s.keys()) for s in shapes]
  split = any(g.get("moe") for g in engine.optimizer.optimizer.param_groups)
  out, problems = [], []
  for i, names in enumerate(engine_groups):
    match = [saved[j] for j, f in enumerate(files) if f == names]
    if not match and split:  # DeepSpeed puts experts in groups of their own, one EP rank's
      match = [saved[j] for j, f in enumerate(files) if names and names <= f]
    out += match[:1]
    if not match:
      problems.append(f"engine group {i}: {', '.join(sorted(names))}")
  if problems:
    listed = [f"checkpoint group {j}: {', '.join(sorted(f))}" for j, f in enumerate(files)]
    raise ValueError(
      "the engine's param groups are not the checkpoint's (each must hold exactly the "
      "parameters of one checkpoint group, in any order):\n  " + "\n  ".join([*problems, *listed])
    )
  return out


def _engine_groups(engine) -> list[set[str]] | None:
  """The parameter names of each of the engine's param groups (None: not known)."""
  opt, names = engine.optimizer, engine.param_names
  groups: list[set[str]] = [set() for _ in opt.optimizer.param_groups]
  if engine.zero_optimization_partition_weights():  # ZeRO-3: sub-groups of param groups
    owner = getattr(opt, "sub_group_to_group_id", None)
    if owner is None:
      return None
    for sub, params in enumerate(opt.fp16_groups):
      groups[owner[sub]].update(names[p] for p in params)
    return groups
  lp = getattr(opt, "bit16_groups", None) or getattr(opt, "bf16_groups", None)  # ZeRO-1/2, BF16
  if lp is None or len(lp) != len(groups):
    return None
  return [{names[p] for p in params} for params in lp]


def _unshare_zero3_steps(optimizer) -> None:
  base = optimizer.optimizer
  seen = set()
  for flat in optimizer.fp32_partitioned_groups_flat:
    state = base.state.get(flat, {})
    step = state.get("step")
    if step is not None and id(step) in seen:
      state["step"] = step.clone()
    elif step is not None:
      seen.add(id(step))
