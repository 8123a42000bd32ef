"""Inside a DeepSpeed job: finishing what `engine.load_checkpoint` leaves undone.

DeepSpeed 0.19.8's `load_checkpoint` with `"checkpoint": {"load_universal": true}` restores
the trainable parameters (fp32 masters, then the low-precision copies) and the optimizer
state from `zero/`. Measured against its source (docs/export.md), it also:

- never loads the model-states `module` (engine.py `_load_checkpoint` skips
  `load_module_state_dict` for universal loads): buffers and frozen parameters keep the values
  the model was built with;
- ZeRO-3 (stage3.py `load_hp_checkpoint_state_from_checkpoint_dir_stage3`): applies
  `param_groups[0]`'s hyperparameters to every group, and gives every sub-group the *same*
  step tensor, which torch's Adam increments in place once per sub-group: with S sub-groups
  the step count advances S times per optimizer step (wrong bias correction).

No file can change that code. `finish_load`, called right after `load_checkpoint`, fixes all
three from the files `ucp_jax.export` writes (and, except frozen parameters, from
`ds_to_universal`'s). Needs torch and deepspeed (imported when called).
"""

from __future__ import annotations

import os

from ucp_jax import _deepspeed_export


def finish_load(engine, load_dir: str | os.PathLike, tag: str | None = None) -> list[str]:
  """Restores what DeepSpeed's universal `load_checkpoint` leaves out; call it on every rank.

  - buffers and frozen parameters from the model-states `module` (ZeRO-3: each frozen
    parameter is gathered, set and re-partitioned, a collective);
  - ZeRO-3: each param group's own hyperparameters from `zero/optimizer_state.pt`'s
    `param_groups`, and one step tensor per sub-group.

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
  """
  import torch

  load_dir = os.fspath(load_dir)
  if tag is None:
    with open(os.path.join(load_dir, _deepspeed_export.LATEST)) as f:
      tag = f.read().strip()
  zero3 = engine.zero_optimization_partition_weights()
  name = _deepspeed_export.MODEL_STATES_3 if zero3 else _deepspeed_export.MODEL_STATES_1_2
  # DeepSpeed's load_checkpoint has just loaded these files with weights_only=False; the
  # files ucp_jax writes also load with weights_only=True, ds_to_universal's do not.
  states = torch.load(os.path.join(load_dir, tag, name), map_location="cpu", weights_only=False)
  copied = _copy_module(engine, states["module"], f"{load_dir}/{tag}/{name}")
  if zero3:
    optim = torch.load(
      os.path.join(load_dir, tag, "zero", "optimizer_state.pt"),
      map_location="cpu",
      weights_only=False,
    )
    _fix_zero3_optimizer(engine.optimizer, optim.get("param_groups") or [])
  return copied


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


def _fix_zero3_optimizer(optimizer, groups: list[dict]) -> None:
  base = optimizer.optimizer
  for group, saved in zip(base.param_groups, groups):
    group.update((k, v) for k, v in saved.items() if k != "params")
  seen = set()
  for flat in optimizer.fp32_partitioned_groups_flat:
    state = base.state.get(flat, {})
    step = state.get("step")
    if step is not None and id(step) in seen:
      state["step"] = step.clone()
    elif step is not None:
      seen.add(id(step))
