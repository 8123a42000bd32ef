"""Megatron-core as a sink: a Megatron-LM root that `dist_checkpointing.load` reads on any TP x DP.

```
dst/latest_checkpointed_iteration.txt    the iteration
dst/iter_0000100/.metadata               torch DCP metadata, as megatron-core's torch_dist writes
dst/iter_0000100/__0_0.distcp            the tensors, and the common state (`common_state`)
dst/iter_0000100/metadata.json           {"sharded_backend": "torch_dist", ...}
dst/ucp_export.json                      {"written_by": "ucp_jax", "format": "megatron", ...}
```

The model goes under Megatron's sharded keys (layers stacked, QKV by query group, SwiGLU's
`[gate; up]`): as the checkpoint names them when it came from Megatron, else laid out from a
Llama's Hugging Face names and config (`_megatron_layout.from_llama`: a Hugging Face folder,
a DeepSpeed, DCP or torch checkpoint of a Llama, or a Flax Llama through `--rules hf`). The optimizer is written in the distributed optimizer's `fully_reshardable`
form, the one megatron-core reshards onto any TP and DP size: `optimizer.state.param.KEY` (the
fp32 master), `optimizer.state.exp_avg.KEY`, `optimizer.state.exp_avg_sq.KEY`, with the param
groups (and their step) in the common state. The model tensors are the masters cast to the
run's parameter dtype (`args.params_dtype`, or `dtype=`).

The common state holds what Megatron-LM's `load_checkpoint` reads: `args` (an
`argparse.Namespace` of the recorded fields), `checkpoint_version` 3.0, `iteration`, the
scheduler and the FLOPs count where recorded, and `content_metadata` naming the optimizer
format. Per-rank RNG states are not written: resume Megatron-LM with `--no-load-rng`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.sinks import _folder, _resolved
from ucp_jax.sinks import _megatron_layout as _layout
from ucp_jax.sinks._dcp import RankFileWriter, import_torch
from ucp_jax.sinks._registry import Destination, option
from ucp_jax.sinks._report import ExportReport
from ucp_jax.store import _checkpoint

NAME = "megatron"
TORCH_NAMES = True  # Megatron's names, or Llama's torch names (a rule set maps Flax names first)
DESCRIPTION = (
  "a Megatron-LM root (iter_NNNNNNN, torch_dist) that megatron-core's dist_checkpointing.load "
  "reads onto any TP and DP size, model and distributed optimizer (fully_reshardable)"
)
TRACKER = "latest_checkpointed_iteration.txt"
CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
SHARDING = "fully_reshardable"
DTYPES = ("float32", "bfloat16", "float16")


def _dtype_or_none(value: Any) -> str | None:
  return None if value in (None, "") else str(value)


@dataclasses.dataclass(frozen=True)
class Options:
  """How a Megatron export writes the model."""

  dtype: str | None = option(
    None,
    "the model tensors' dtype (default: the run's args.params_dtype, else float32)",
    parse=_dtype_or_none,
    choices=DTYPES,
  )
  iteration: int | None = option(
    None, "the iteration folder to write (default: the recorded iteration, else the step)"
  )
  vocab_multiple: int = option(
    128,
    "from Hugging Face names: pad the vocabulary to a multiple of this (Megatron-LM's "
    "make_vocab_size_divisible_by times the TP size it loads with)",
  )
  # `ucp export --config` is the command's own flag (as for the hf format)
  config: str | os.PathLike | dict | None = option(
    None, "from Hugging Face names: the Llama's config.json", flag=False
  )

  def __post_init__(self) -> None:
    if self.dtype is not None and self.dtype not in DTYPES:
      raise _errors.InvalidArgumentError(f"dtype={self.dtype!r}: one of {', '.join(DTYPES)}")
    it = self.iteration
    if it is not None and (isinstance(it, bool) or not isinstance(it, int) or it < 0):
      raise _errors.InvalidArgumentError(f"iteration={it!r}: a number of iterations, 0 or more")
    multiple = self.vocab_multiple
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
      raise _errors.InvalidArgumentError(f"vocab_multiple={multiple!r}: a positive number")


def check_options(destination: Destination, options: Options | None = None) -> str:
  """The absolute export path; an existing folder must be an earlier Megatron export."""
  return _folder.check_destination(
    destination, not_an_export=_not_an_export, what="a Megatron export"
  )


def _not_an_export(path: str) -> list[str]:
  return _folder.foreign_entries(path, NAME, "a Megatron export", ours=(TRACKER,), files_only=False)


def export(
  ckpt: _checkpoint.Checkpoint, destination: Destination, options: Options | None = None
) -> ExportReport:
  """Writes `ckpt` (Megatron names) as a Megatron-LM root; see the module docstring.

  Raises:
    MappingError: the checkpoint has no Megatron names, or no parameter schema.
    MissingDependencyError: torch is not installed.
  """
  options = Options() if options is None else options
  start = time.perf_counter()
  dst = check_options(destination)
  schema = ckpt.manifest.typed_schema
  state = _resolved.resolve(ckpt) if schema is not None and schema.optimizer else None
  weights = _resolved.weights(ckpt)
  if weights.buffers:
    raise _errors.MappingError(
      f"{ckpt.location}: buffers ({', '.join(b.name for b in weights.buffers)}), which a "
      "Megatron checkpoint of a GPT model does not have"
    )
  megatron = (schema.extra.get("megatron") if schema is not None else None) or {}
  as_saved = _layout.is_megatron([p.name for p in weights.params])
  if as_saved:
    if weights.tied:
      raise _errors.MappingError(f"{ckpt.location}: tied parameters ({', '.join(weights.tied)})")
    tensors = _layout.as_saved(ckpt, weights, state)
    args = dict(megatron.get("args") or {})
    groups = [dict(g) for g in state.groups] if state is not None else None
  else:
    config = _llama_config(ckpt, options.config)
    tensors, args, groups = _layout.from_llama(ckpt, weights, state, config, options.vocab_multiple)
  dtype = options.dtype or _params_dtype(args)
  iteration = options.iteration
  if iteration is None:
    recorded = megatron.get("iteration")
    iteration = recorded if isinstance(recorded, int) else (ckpt.step or 0)
  torch = import_torch()
  folder = f"iter_{iteration:07d}"
  total = sum(t.nbytes for t in tensors)
  progress = destination.progress
  written = 0
  with _folder.staged(dst) as staging:
    os.mkdir(os.path.join(staging, folder))
    writer = RankFileWriter(torch, os.path.join(staging, folder), ["__0_0.distcp"])
    try:
      for t in tensors:
        master = np.ascontiguousarray(t.read("value"))
        writer.tensor(t.name, _cast(master, dtype), (t.name,))
        arrays = {"param": master} if state is not None else {}
        arrays.update((slot, t.read(slot)) for slot in (t.slots if state is not None else ()))
        for kind, array in arrays.items():
          flat = f"optimizer.state.{kind}.{t.name}"
          writer.tensor(flat, np.ascontiguousarray(array, dtype=np.float32), (flat,))
        written += t.nbytes
        if progress is not None:
          progress(t.name, t.nbytes, total)
      for key in _extra_state_keys(tensors, megatron):
        writer.object(key, [None], (key,))
      common = _common(megatron, args, dtype, iteration, state, groups)
      writer.object("common_state/shard_0_1", [common], ("common_state/shard_0_1",))
    finally:
      writer.close()
    writer.commit()
    with open(os.path.join(staging, folder, "metadata.json"), "w") as f:
      json.dump(CONFIG, f)
    with open(os.path.join(staging, TRACKER), "w") as f:
      f.write(str(iteration))
    _folder.write_marker(staging, NAME, files=[folder])
  notes = list(state.not_carried) if state is not None else []
  recorded = (megatron.get("extra_state") or {}).values()
  if any(value not in (None, [None]) for value in recorded):
    notes.append("not written: TransformerEngine's FP8 scaling state (_extra_state)")
  if megatron.get("not_carried"):
    notes.append("not written: the per-rank RNG states (resume Megatron-LM with --no-load-rng)")
  if state is not None and not isinstance(megatron.get("opt_param_scheduler"), dict):
    notes.append(
      "the learning-rate schedule is written constant at the source's lr (it recorded no "
      "Megatron schedule): resume Megatron-LM with --override-opt_param-scheduler for yours"
    )
  if not as_saved:
    notes.append(
      f"laid out as Megatron's Llama-style GPT from Hugging Face names; vocabulary padded to "
      f"{args['padded_vocab_size']} rows (a multiple of {options.vocab_multiple})"
    )
  return ExportReport(
    path=dst,
    tag=folder,
    zero_stages=(),
    params=len(tensors),
    frozen=weights.frozen,
    buffers=(),
    tied=dict(weights.tied),
    step=state.step if state is not None else ckpt.step,
    nbytes=written,
    seconds=time.perf_counter() - start,
    notes=tuple(notes),
    format=NAME,
    summary=(
      f"Megatron-LM root, {folder}: {len(tensors)} params in {dtype}"
      + (f" with the fp32 masters, {', '.join(state.slot_names)} ({SHARDING})" if state else "")
    ),
  )


def _llama_config(ckpt: _checkpoint.Checkpoint, config: str | os.PathLike | dict | None) -> dict:
  """The Llama config.json: `config`, or the one the checkpoint recorded from its source."""
  if isinstance(config, dict):
    return config
  if config is not None:
    from ucp_jax.sinks import _hf

    return _hf.read_config(config)
  recorded = (ckpt.manifest.source or {}).get("config")
  if not isinstance(recorded, dict):
    raise _errors.MappingError(
      f"{ckpt.location}: no Megatron names, and no Hugging Face config.json recorded: a Llama "
      "under Hugging Face names is laid out as Megatron's GPT from its config (pass --config)"
    )
  return recorded


def _extra_state_keys(tensors: list[_layout.MegatronTensor], megatron: dict) -> list[str]:
  """The `_extra_state` objects megatron-core loads for each layer's linear modules.

  They hold TransformerEngine's FP8 scaling state; megatron-core asks for one per layer and
  module (`<module>._extra_state/shard_<layer>_<layers>`), None with the local layer spec.
  They are written as None: a TE run starts its FP8 scaling history afresh.
  """
  keys = set(megatron.get("extra_state") or {})
  for t in tensors:
    module, _, leaf = t.name.rpartition(".")
    if leaf == "weight" and module.startswith("decoder.layers.") and ".linear_" in module:
      keys.update(
        f"{module}._extra_state/shard_{layer}_{t.shape[0]}" for layer in range(t.shape[0])
      )
  return sorted(keys)


def _params_dtype(args: dict) -> str:
  recorded = str(args.get("params_dtype") or "")
  if args.get("bf16") or recorded.endswith("bfloat16"):
    return "bfloat16"
  if args.get("fp16") or recorded.endswith("float16"):
    return "float16"
  return "float32"


def _cast(array: np.ndarray, dtype: str) -> np.ndarray:
  if dtype == "bfloat16":
    import ml_dtypes

    return array.astype(ml_dtypes.bfloat16)
  return array.astype(dtype, copy=False)


def _common(
  megatron: dict,
  args: dict,
  dtype: str,
  iteration: int,
  state: _resolved.ResolvedState | None,
  groups: list[dict] | None,
) -> dict:
  """The common state megatron-core saves beside the tensors (Megatron-LM's layout)."""
  content: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
  fields = {**args, "iteration": iteration, "ckpt_format": "torch_dist"}
  fields["params_dtype"] = f"torch.{dtype}"
  common: dict[str, Any] = {
    "args": argparse.Namespace(**fields),
    "checkpoint_version": 3.0,
    "iteration": iteration,
    "num_floating_point_operations_so_far": megatron.get("num_floating_point_operations_so_far", 0),
  }
  if isinstance(megatron.get("opt_param_scheduler"), dict):
    common["opt_param_scheduler"] = megatron["opt_param_scheduler"]
  elif state is not None:  # Megatron-LM's load reads one: the source's lr, held constant
    common["opt_param_scheduler"] = constant_schedule(groups or [{}], state.step)
  if state is not None:
    content["distrib_optim_sharding_type"] = SHARDING
    content["distrib_optim_fully_reshardable_mem_efficient"] = False
    fields["use_distributed_optimizer"] = True
    fields["dist_ckpt_optim_fully_reshardable"] = True
    common["optimizer"] = {
      "optimizer": {"param_groups": [_group(hyper, state.step) for hyper in groups or []]},
      "param_state_sharding_type": SHARDING,
    }
    common["args"] = argparse.Namespace(**fields)
  common["content_metadata"] = content
  return common


def constant_schedule(groups: list[dict], step: int) -> dict:
  """An `OptimizerParamScheduler` state at `step` that holds the first group's learning rate
  and weight decay, for a source that recorded no Megatron schedule (Megatron-LM's
  `--override-opt_param-scheduler` puts the run's own in its place)."""
  lr = float(groups[0].get("lr", 0.0))
  wd = float(groups[0].get("weight_decay", 0.0))
  return {
    "max_lr": lr,
    "min_lr": lr,
    "lr_warmup_steps": 0,
    "num_steps": step,
    "lr_decay_style": "constant",
    "lr_decay_steps": max(1, step),
    "start_wd": wd,
    "end_wd": wd,
    "wd_incr_style": "constant",
    "wd_incr_steps": max(1, step),
  }


def _group(hyper: dict, step: int) -> dict:
  """A torch param group as Megatron's distributed optimizer saves it (no `params`)."""
  group = {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in hyper.items()}
  group["step"] = float(step)
  return group
