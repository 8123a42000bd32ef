"""Megatron-core `torch_dist` checkpoints as a source: Megatron-LM roots and iteration folders.

Underneath is a torch DCP folder, read by the DCP reader's metadata and chunk readers
(`sources.dcp`); this module knows what Megatron puts in it:

* the model under its sharded keys, transformer layers stacked on a leading axis
  (`decoder.layers.self_attention.linear_qkv.weight` is `(L, ...)`); the fused QKV rows go
  by query group (`[q_g; k_g; v_g]` for each group), and a SwiGLU `linear_fc1` is
  `[gate; up]`. NeMo 2's `module.` prefix is dropped from the names.
* the optimizer, in one of three forms, read as slots of their parameters:
  - the plain optimizer: `optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<key>`;
  - the distributed optimizer, `fully_reshardable`: `optimizer.state.{param,exp_avg,
    exp_avg_sq}.<key>`;
  - the distributed optimizer, `dp_reshardable` (Megatron-LM's default): flat buffers per
    bucket, rebuilt per parameter by `_buckets`.
  Where a fp32 master exists (`fp32_param`, `param`) it is the parameter's value.
* the common state (`_folders.common_state`): `args`, the iteration, the scheduler, the param
  groups and Adam's step. They go to the schema (`optimizer`, `extra["megatron"]`).

Each parameter carries the tensor-parallel pattern its chunks show (`column`, `row`,
`replicated`, SwiGLU's two sub-parameters), so that rules and sinks can split it again.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from ucp_jax.base._errors import InvalidArgumentError, SourceFormatError, bullet_list
from ucp_jax.sources import _files
from ucp_jax.sources._source_plan import Plan, SourceParam, jsonable, number
from ucp_jax.sources.dcp import _chunks, _metadata
from ucp_jax.sources.dcp._metadata import BytesEntry, Layout, TensorEntry
from ucp_jax.sources.megatron import _buckets, _folders, _hf_names, _readable
from ucp_jax.sources.megatron._readable import Readable
from ucp_jax.store import _schema

NAME = "megatron"
DESCRIPTION = (
  "a Megatron-core torch_dist checkpoint (Megatron-LM, NeMo 2): a root with "
  "latest_checkpointed_iteration.txt, or an iter_NNNNNNN folder with metadata.json and .metadata"
)
SLOTS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
MASTERS = ("fp32_param", "param")  # the plain optimizer's and the distributed one's
STATE = re.compile(r"optimizer\.state\.([A-Za-z0-9_]+)\.(.+)$")
LAYERS = "decoder.layers."
NEMO_PREFIX = "module."


def sniff(path: str, fs: _files.Files | None = None) -> bool:
  fs = fs or _files.for_path(path)
  return _folders.is_root(path, fs) or _folders.is_iteration_folder(path, fs)


def sniff_remote(url: str) -> bool:
  return sniff(url.rstrip("/"))


def sniff_weak(path: str) -> bool:
  return False


def describe(
  path: str, iteration: int | str | None = None, names: str = "megatron", padded_vocab: bool = False
) -> Plan:
  """The model, its optimizer slots and the common state of one iteration; data stays put.

  Args:
    path: a Megatron-LM root (its latest iteration is read) or one iteration folder.
    iteration: under a root, the iteration to read instead (a number, or "release").
    names: "megatron" (the checkpoint's own names and layouts), or "hf": a Llama-style GPT
      under Hugging Face Llama's names and layouts (`_hf_names`), with its `config.json`.
    padded_vocab: with `names="hf"`, keep the vocabulary's padded rows (training on then
      computes Megatron's loss exactly; its softmax spans them).

  Raises:
    SourceFormatError: not a checkpoint this reads (every problem listed, file and key), or a
      distributed optimizer's buckets that the checkpoint does not describe well enough to
      rebuild (the message says what is missing).
    UnsafePickleError: a pickle in it asks for something that can run code.
  """
  if names not in ("megatron", "hf"):
    raise InvalidArgumentError(f"names={names!r}: 'megatron' (as saved) or 'hf' (Llama's)")
  fs = _files.for_path(path)
  path = fs.absolute(path) if fs.remote else path
  folder = _folders.iteration_folder(path, fs, iteration)
  _folders.check_backend(folder, fs)
  layout = _metadata.read(folder, fs)
  files = _chunks.RankFiles(folder, fs)
  meta = os.path.join(folder, _metadata.METADATA)
  common, common_where = _folders.common_state(folder, fs, files, layout)
  args = _folders.record_fields(common.get("args"))
  problems: list[str] = []
  model = _model_entries(layout)
  if not model:
    raise SourceFormatError(f"{meta}: no model tensors (a checkpoint without the model?)")
  entries = {name: _tensor_entry(layout, key) for name, key in model.items()}
  tensors = {
    name: _readable.of_entry(files, entries[name], f"{meta}: `{key}`")
    for name, key in model.items()
  }
  optimizer_state = common.get("optimizer")
  optimizer_state = optimizer_state if isinstance(optimizer_state, dict) else None
  sharding = optimizer_state.get("param_state_sharding_type") if optimizer_state else None
  if sharding == "dp_reshardable":
    rebuilt = _buckets.rebuild(layout, files, model, tensors, args, meta)
    masters, slots, groups_state = rebuilt.masters, rebuilt.slots, rebuilt.param_groups
  elif sharding in (None, "fully_reshardable"):
    masters, slots = _per_parameter(layout, files, model, tensors, meta, problems)
    groups_state = _param_groups(optimizer_state)
  else:
    raise SourceFormatError(
      f"{common_where}: the distributed optimizer's `{sharding}` format; ucp_jax reads "
      "dp_reshardable, fully_reshardable and the plain optimizer's state"
    )
  if problems:
    raise SourceFormatError(
      f"{folder}: not a Megatron checkpoint it can read:\n" + bullet_list(problems)
    )
  has_optimizer = bool(slots)
  members = _group_members(model, tensors, groups_state, common_where) if has_optimizer else []
  group_of = {name: g for g, names in enumerate(members) for name in names}
  step = _step(optimizer_state, groups_state)
  extra = _extra(common, layout, files, sharding, args)
  source = _source(path, folder, layout, common)
  if names == "hf":
    arrays = {n: {"value": masters.get(n, tensors[n]), **slots.get(n, {})} for n in model}
    groups = {n: group_of.get(n) for n in model} if has_optimizer else {}
    params, config = _hf_names.params(arrays, groups, args, meta, padded_vocab)
    extra, source = {**extra, "names": "hf"}, {**source, "config": config}
  else:
    params = [
      SourceParam(
        name,
        masters.get(name, tensors[name]).tensor(),
        slots={slot: value.tensor() for slot, value in slots.get(name, {}).items()},
        group=group_of.get(name) if has_optimizer else None,
        pattern=_pattern(entries[name], name, args),
        shard_shape=_chunks.shard_shape(entries[name]),
      )
      for name in model
    ]
  return Plan(
    params=params,
    optimizer=_optimizer(groups_state, step) if has_optimizer else None,
    extra={"megatron": extra},
    source=source,
    step=_schema.integer_or_none(common.get("iteration")),
    path=folder,
    format=NAME,
  )


def _model_entries(layout: Layout) -> dict[str, str]:
  """Parameter name -> DCP key, for every model tensor (NeMo's `module.` dropped)."""
  out = {}
  for key, entry in layout.entries.items():
    if not isinstance(entry, TensorEntry) or key.startswith("optimizer."):
      continue
    name = key[len(NEMO_PREFIX) :] if key.startswith(NEMO_PREFIX) else key
    out[name] = key
  return out


def _tensor_entry(layout: Layout, key: str) -> TensorEntry:
  entry = layout.entries[key]
  assert isinstance(entry, TensorEntry)  # _model_entries keeps tensors only
  return entry


def _per_parameter(layout: Layout, files, model, tensors, meta, problems):
  """Masters and slots of the plain optimizer and of `fully_reshardable` (`optimizer.state.*`)."""
  masters: dict[str, Readable] = {}
  slots: dict[str, dict[str, Readable]] = {}
  for key, entry in layout.entries.items():
    found = STATE.match(key)
    if found is None or not isinstance(entry, TensorEntry):
      if key.startswith("optimizer.") and isinstance(entry, TensorEntry):
        problems.append(f"{meta}: `{key}`: an optimizer tensor of no parameter it knows")
      continue
    slot, target = found.groups()
    name = target[len(NEMO_PREFIX) :] if target.startswith(NEMO_PREFIX) else target
    if name not in model:
      problems.append(f"{meta}: `{key}`: optimizer state of `{target}`, which the model lacks")
      continue
    value = _readable.of_entry(files, entry, f"{meta}: `{key}`")
    if value.shape != tensors[name].shape:
      problems.append(
        f"{meta}: `{key}`: shape {value.shape}, but `{model[name]}` has {tensors[name].shape}"
      )
    elif slot in MASTERS:
      masters[name] = value
    else:
      slots.setdefault(name, {})[SLOTS.get(slot, slot)] = value
  return masters, slots


def _torch_state(optimizer_state: dict | None) -> dict:
  """The torch optimizer's state dict in the common state: under `optimizer` (mixed precision,
  the distributed optimizer) or the entry itself (the fp32 optimizer)."""
  if not optimizer_state:
    return {}
  inner = optimizer_state.get("optimizer")
  return inner if isinstance(inner, dict) else optimizer_state


def _param_groups(optimizer_state: dict | None) -> list[dict]:
  """The torch optimizer's param groups of the common state (none without an optimizer)."""
  groups = _torch_state(optimizer_state).get("param_groups")
  return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []


def _group_members(model, tensors, groups: list[dict], where: str) -> list[list[str]]:
  """Which parameters each group holds: Megatron's default rule, checked against the groups.

  The saved groups do not list their parameters. Megatron-LM puts biases and 1-D parameters
  (per layer: norms) in a group without weight decay (`wd_mult` 0) and the rest in one with
  it; other groupings (`--decoupled-lr`, per-parameter overrides) are not recorded, and are
  refused rather than guessed.
  """
  if not groups:
    return [list(model)]
  no_decay = [i for i, g in enumerate(groups) if g.get("wd_mult", 1.0) == 0.0]
  decay = [i for i, g in enumerate(groups) if g.get("wd_mult", 1.0) != 0.0]
  if len(groups) > 2 or len(no_decay) > 1 or len(decay) > 1:
    raise SourceFormatError(
      f"{where}: {len(groups)} optimizer param groups; the checkpoint does not say which "
      "parameters each holds beyond Megatron's default split (weight decay or not)"
    )
  members: list[list[str]] = [[] for _ in groups]
  for name in model:
    ndim = len(tensors[name].shape) - (1 if name.startswith(LAYERS) else 0)
    plain = name.endswith(".bias") or ndim == 1
    target = no_decay if plain else decay
    if not target:
      raise SourceFormatError(
        f"{where}: no param group {'without' if plain else 'with'} weight decay for `{name}`"
      )
    members[target[0]].append(name)
  return members


def _step(optimizer_state: dict | None, groups: list[dict]) -> int | None:
  """Adam's step: the plain optimizer's `common_step`, else the groups' `step`."""
  state = _torch_state(optimizer_state).get("state")
  if isinstance(state, dict) and state.get("common_step") is not None:
    return _schema.integer_or_none(number(state["common_step"]))
  steps = [g["step"] for g in groups if isinstance(g.get("step"), (int, float, np.generic))]
  return _schema.integer_or_none(number(max(steps))) if steps else None


def _optimizer(groups: list[dict], step: int | None) -> _schema.Optimizer:
  hypers = [{k: jsonable(v) for k, v in g.items() if k != "params"} for g in groups] or [{}]
  for hyper in hypers:
    hyper["step"] = step
  decoupled = all(h.get("decoupled_weight_decay", True) for h in hypers)
  kind = "adamw" if "betas" in hypers[0] and decoupled else "adam"
  return _schema.Optimizer(type=kind, step=step, groups=tuple(map(_schema.GroupEntry, hypers)))


COLUMN = (".linear_qkv.", ".linear_fc1.", "embedding.word_embeddings.", "output_layer.")
ROW = (".linear_proj.weight", ".linear_fc2.weight")


def _pattern(entry: TensorEntry, name: str, args: dict) -> dict | None:
  """How tensor parallelism splits the parameter in megatron-core's GPT (by module), with the
  layer axis counted: `column` splits outputs, `row` inputs; SwiGLU's `linear_fc1` holds two
  sub-parameters (`[gate; up]`); norms and row-parallel biases are replicated."""
  lead = 1 if name.startswith(LAYERS) else 0
  if "norm" in name.rpartition(".")[0].rpartition(".")[2] or name.endswith("layer_norm_weight"):
    return {"kind": "replicated"}
  if name.endswith(ROW):
    return {"kind": "row", "cat_dim": lead + 1}
  if name.endswith((".linear_proj.bias", ".linear_fc2.bias")):
    return {"kind": "replicated"}
  if name.endswith(".linear_fc1.weight") and _swiglu(entry, args, lead):
    return {"kind": "sub_params", "cat_dim": lead, "sub_params": 2}
  if any(part in name or name.startswith(part) for part in COLUMN):
    return {"kind": "column", "cat_dim": lead}
  return None


def _swiglu(entry: TensorEntry, args: dict, lead: int) -> bool:
  """Whether `linear_fc1` is SwiGLU's `[gate; up]`: `args.swiglu`, else its chunks (two per
  TP rank)."""
  if isinstance(args.get("swiglu"), bool):
    return args["swiglu"]
  tp = args.get("tensor_model_parallel_size")
  pieces = len({c.offsets[lead] for c in entry.chunks}) if len(entry.shape) > lead else 0
  return isinstance(tp, int) and tp > 0 and pieces == 2 * tp


def _extra(common: dict, layout: Layout, files, sharding: str | None, args: dict) -> dict:
  """What Megatron saved beside the tensors, as JSON: args, iteration, scheduler, ..."""
  out: dict[str, Any] = {"args": jsonable(args)}
  for key in (
    "iteration",
    "checkpoint_version",
    "opt_param_scheduler",
    "num_floating_point_operations_so_far",
    "content_metadata",
    "rerun_state_machine",
  ):
    if key in common:
      out[key] = jsonable(common[key])
  out["optimizer_format"] = sharding or ("plain" if "optimizer" in common else None)
  left = {
    k: e
    for k, e in sorted(layout.entries.items())
    if isinstance(e, BytesEntry) and k != _folders.COMMON_KEY and not k.startswith("optimizer.")
  }
  extra_state = {k: e for k, e in left.items() if "._extra_state/" in k}
  if extra_state:  # TransformerEngine's FP8 metadata per layer; None with the local spec
    out["extra_state"] = {
      k: jsonable(files.load(e.stored, f"`{k}`")) for k, e in extra_state.items()
    }
  others = [k for k in left if k not in extra_state]
  if others:  # rng_state: per-rank generator states, which no other framework resumes
    out["not_carried"] = others
  return out


def _source(path: str, folder: str, layout: Layout, common: dict) -> dict:
  shown = path if "://" in path else os.path.abspath(path)
  return {
    "framework": "megatron",
    "format": NAME,
    "path": shown,
    "iteration_folder": os.path.basename(folder),
    "dcp_version": layout.version,
    "files": len(layout.files),
  }
