"""Writes a DeepSpeed universal checkpoint that `load_universal` reads at any DP degree.

Layout (docs/export.md; DeepSpeed 0.19.8's reader is described in docs/deepspeed_layouts.md §12):

  dst/latest_universal                      the tag, as text
  dst/ucp_export.json                       {"written_by": "ucp_jax", "tags": [tag]}: an export
  dst/<tag>/zero/<name>/fp32.pt             {'cat_dim': 0, 'param': fp32 tensor, full shape}
  dst/<tag>/zero/<name>/<slot>.pt           the same for exp_avg, exp_avg_sq (every slot)
  dst/<tag>/zero/<name>/step.pt             0-d float32 tensor, the optimizer step
  dst/<tag>/zero/<frozen|buffer|alias>/fp32.pt   {'param': tensor.float()}, as ds_to_universal
  dst/<tag>/zero/optimizer_state.pt         ds_version, per-group param_groups (ZeRO-1/2, BF16);
                                            optimizer_state_dict (step, group hyperparameters)
                                            for the ZeRO-3 loader
  dst/<tag>/mp_rank_00_model_states.pt              ZeRO-1/2 and BF16 targets
  dst/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   ZeRO-3 targets (a hard link: same bytes)

The dict form of `fp32.pt` is what ZeRO-1/2 need and ZeRO-3 accepts, so one export serves
every stage. The files hold only tensors, dicts, lists, numbers and `torch.Size`: they load
with `torch.load(weights_only=True)`. torch is imported here, lazily: it is an optional extra.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.sinks import _folder, _moe_sink, _resolved
from ucp_jax.sinks._registry import Destination, option
from ucp_jax.sinks._report import ExportReport
from ucp_jax.store import _checkpoint, _schema

DS_VERSION = "0.19.8"
"""The DeepSpeed version whose `load_universal` this layout is written for (and tested with)."""

MODEL_STATES_1_2 = "mp_rank_00_model_states.pt"
MODEL_STATES_3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"
LATEST = "latest_universal"
NAME = "deepspeed"
TORCH_NAMES = True  # writes torch names: a rule set maps a Flax-named checkpoint first
DESCRIPTION = "a DeepSpeed universal checkpoint (`load_universal`), ZeRO-1/2/3, any DP degree"
MARKER = _folder.MARKER
"""Written into every export: an existing `dst` is replaced only if it is an earlier export."""
_ML_DTYPES_AS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


MissingDependencyError = _errors.MissingDependencyError


def import_torch():
  try:
    import torch
  except ImportError as e:
    raise MissingDependencyError(
      "exporting to DeepSpeed writes .pt files with torch, which is not installed; "
      "install the extra: pip install 'ucp_jax[torch]'"
    ) from e
  return torch


def check_options(destination: Destination, options: Options) -> str:
  """The absolute export path, or an error if writing there would lose something (or a bad
  `tag`).

  An existing, non-empty destination is replaced only if it is an earlier export, exactly: its
  `ucp_export.json`, `latest_universal` and the tag folders that file names, holding
  nothing but what an export writes. A DeepSpeed training folder (`latest`, `global_stepN/`
  with rank files) is refused whatever `overwrite` says, and nothing in it is touched.
  """
  tag = options.tag
  if tag is not None and not _resolved.valid_name(tag):
    raise _errors.InvalidArgumentError(f"tag {tag!r}: not usable as a directory name")
  return _folder.check_destination(
    destination, not_an_export=_not_an_export, what="a DeepSpeed export"
  )


_TAG_FILES = {"zero": True, MODEL_STATES_1_2: False, MODEL_STATES_3: False}  # name -> a folder


def _not_an_export(path: str) -> list[str]:
  """What in `path` an export does not write (empty: `path` is an earlier export)."""
  names = sorted(os.listdir(path))
  tags = _marked_tags(path)
  if tags is None:
    return [f"no {MARKER} (every export writes one)", *(_shown(path, n) for n in names)]
  out = []
  for name in names:
    full = os.path.join(path, name)
    if name in (LATEST, MARKER) and _plain(full, folder=False):
      continue
    if name in tags and _plain(full, folder=True):
      out += [
        _shown(path, f"{name}/{inner}")
        for inner in sorted(os.listdir(full))
        if not _plain(os.path.join(full, inner), folder=_TAG_FILES.get(inner))
      ]
      continue
    out.append(_shown(path, name))
  if LATEST not in names:
    out.insert(0, f"no {LATEST}")
  return out


def _marked_tags(path: str) -> list[str] | None:
  """The tags `ucp_export.json` names, or None if it is missing or not ours."""
  marker = _folder.read_marker(path, "deepspeed universal")
  if marker is None:
    return None
  tags = marker.get("tags")
  return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else None


def _plain(path: str, *, folder: bool | None) -> bool:
  """`path` is a folder (or a file) and no link; `folder` None: not expected at all."""
  if folder is None or os.path.islink(path):
    return False
  return os.path.isdir(path) if folder else os.path.isfile(path)


def _shown(root: str, name: str) -> str:
  return name + ("/" if os.path.isdir(os.path.join(root, name)) else "")


@dataclasses.dataclass(frozen=True)
class Options:
  """What a DeepSpeed export writes besides the checkpoint."""

  zero_stage: int | None = option(None, "target ZeRO stage (default: all)", choices=(1, 2, 3))
  tag: str | None = option(None, "checkpoint tag (default: global_step<N>)")

  def __post_init__(self) -> None:
    stage = self.zero_stage
    if stage is not None and (isinstance(stage, bool) or stage not in (1, 2, 3)):
      raise _errors.InvalidArgumentError(
        f"zero_stage {stage!r}: expected 1, 2, 3 or None (all stages)"
      )


def export(
  ckpt: _checkpoint.Checkpoint, destination: Destination, options: Options | None = None
) -> ExportReport:
  """Writes a DeepSpeed universal checkpoint of `ckpt` (torch names) at `dst`.

  Written to a staging directory beside `dst`, then renamed into place.
  """
  options = Options() if options is None else options
  tag, progress = options.tag, destination.progress
  dst = check_options(destination, options)
  state = _resolved.resolve(ckpt)
  return write(ckpt, state, dst, zero_stage=options.zero_stage, tag=tag, progress=progress)


def write(
  ckpt: _checkpoint.Checkpoint,
  state: _resolved.ResolvedState,
  dst: str,
  *,
  zero_stage: int | None,
  tag: str | None,
  progress: Callable[[str, int, int], None] | None,
) -> ExportReport:
  """Writes `state` to a staging directory beside `dst`, then renames it into place."""
  start = time.perf_counter()
  stages = _stages(state, zero_stage)
  torch = import_torch()
  global_steps = _int(state.extra.get("global_steps"), state.step)
  tag = tag or f"global_step{global_steps}"
  with _folder.staged(dst) as staging:  # a second export to `dst` is turned away
    writer = _Writer(torch, ckpt, state, os.path.join(staging, tag), progress)
    writer.write_params()
    writer.write_optimizer_state(3 in stages)
    writer.write_model_states(stages, global_steps)
    with open(os.path.join(staging, LATEST), "w") as f:
      f.write(tag)
    _folder.write_marker(staging, "deepspeed universal", tags=[tag])
  seconds = time.perf_counter() - start
  shown = "/".join(str(s) for s in stages)
  return ExportReport(
    path=dst,
    tag=tag,
    zero_stages=stages,
    params=len(state.trainable),
    frozen=tuple(p.name for p in state.frozen),
    buffers=tuple(b.name for b in state.buffers),
    tied=dict(state.tied),
    step=state.step,
    nbytes=writer.nbytes,
    seconds=seconds,
    notes=tuple(notes(state, stages)),
    format=NAME,
    summary=(
      f"DeepSpeed universal checkpoint {tag} (step {state.step}) for ZeRO-{shown} targets: "
      f"{len(state.trainable)} trainable params, {len(state.frozen)} frozen, "
      f"{len(state.buffers)} buffers, {len(state.tied)} tied"
    ),
  )


def _stages(state: _resolved.ResolvedState, zero_stage: int | None) -> tuple[int, ...]:
  adam = all(s in state.slot_names for s in _resolved.ADAM_SLOTS)
  if zero_stage == 3 and not adam:
    raise _errors.MappingError(
      f"zero_stage=3: DeepSpeed's ZeRO-3 universal loader reads exactly fp32, exp_avg and "
      f"exp_avg_sq per parameter (Adam); this checkpoint's slots are {list(state.slot_names)}"
    )
  if zero_stage is None:
    return (1, 2, 3) if adam else (1, 2)
  return (3,) if zero_stage == 3 else (1, 2)


def common_hyperparameters(groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """The hyperparameters every group shares (all that DeepSpeed's ZeRO-3 loader can apply)."""
  first = groups[0]
  return {k: v for k, v in first.items() if all(k in g and g[k] == v for g in groups[1:])}


def notes(state: _resolved.ResolvedState, stages: tuple[int, ...]) -> list[str]:
  """What DeepSpeed 0.19.8's universal `load_checkpoint` does not restore from these files."""
  out = []
  extras = [*(p.name for p in state.frozen), *(b.name for b in state.buffers)]
  if extras:
    out.append(
      f"buffers and frozen parameters ({', '.join(extras)}): DeepSpeed's universal "
      "load_checkpoint never loads the model-states `module` that holds them; call "
      "ucp_jax.deepspeed.finish_load(engine, dst) after it"
    )
  if 3 in stages:
    differ = sorted(
      {k for g in state.groups for k in g} - set(common_hyperparameters(state.groups))
    )
    kept = (
      f"; this export leaves out {', '.join(differ)} (they differ between groups), so each "
      "group keeps its configured value"
      if differ
      else ""
    )
    out.append(
      "ZeRO-3 targets: DeepSpeed's loader applies one set of hyperparameters to every group"
      f"{kept}; it also shares one step tensor between sub-groups, so Adam's step count "
      "advances once per sub-group. ucp_jax.deepspeed.finish_load fixes both"
    )
  if 3 not in stages and len(stages) > 1:
    out.append(f"no ZeRO-3 files: its loader needs exp_avg and exp_avg_sq ({state.optimizer_type})")
  return [*out, *state.not_carried]


class _Writer:
  """Writes the files of one export under `root` (`staging/<tag>`)."""

  def __init__(self, torch, ckpt, state, root: str, progress):
    self.torch = torch
    self.ckpt = ckpt
    self.resolved = state
    self.root = root
    self.zero = os.path.join(root, "zero")
    self.progress = progress
    self.nbytes = 0
    self.step = torch.tensor(float(state.step), dtype=torch.float32)

  def _save(self, obj: Any, *parts: str) -> None:
    path = os.path.join(self.zero, *parts)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _save_synced(self.torch, obj, path)

  def _read(self, key: str) -> np.ndarray:
    array = self.ckpt.read(key)
    self.nbytes += array.nbytes
    return array

  def _done(self, item: str, nbytes: int) -> None:
    if self.progress is not None:
      self.progress(item, nbytes, self.resolved.nbytes)

  def write_params(self) -> None:
    from ucp_jax.sources.deepspeed import universal_meta

    fp32 = self._fp32
    schema = self.ckpt.manifest.typed_schema
    entries = {} if schema is None else schema.params
    self.expert_names: dict[str, list[str]] = {}
    patterns = {p.name: _pattern(entries.get(p.name)) for p in self.resolved.trainable}
    self.groups, self.group_of = _moe_sink.deepspeed_groups(self.resolved, patterns)
    for p in self.resolved.trainable:
      before = self.nbytes
      pattern = patterns[p.name]
      names = _moe_sink.native_names(p.name, pattern, p.shape)
      if names is not None:  # native MoE: one parameter per expert, as its engine names them
        self.expert_names[p.name] = names
        arrays = {"fp32": self._read(p.value)} | {s: self._read(k) for s, k in p.slots.items()}
        for e, name in enumerate(names):
          for slot, array in arrays.items():
            one = tensor(self.torch, np.ascontiguousarray(array[e], np.float32))
            self._save({"cat_dim": 0, "param": one}, name, f"{slot}.pt")
          self._save(self.step.clone(), name, "step.pt")
        self._done(p.name, self.nbytes - before)
        continue
      # TP/PP/EP pattern (cat_dim, sub-params, vocabulary) for a target of another TP degree
      meta = universal_meta(_moe_sink.expert_pattern(p.name, pattern, p.shape), p.name)
      self._save({**meta, "param": fp32(p.value)}, p.name, "fp32.pt")
      for slot, key in p.slots.items():
        self._save({**meta, "param": fp32(key)}, p.name, f"{slot}.pt")
      self._save(self.step.clone(), p.name, "step.pt")
      self._done(p.name, self.nbytes - before)
    self.extras: dict[str, Any] = {}
    for p in (*self.resolved.frozen, *self.resolved.buffers):
      before = self.nbytes
      self.extras[p.name] = tensor(self.torch, self._read(p.value))
      self._save({"param": self.extras[p.name].float()}, p.name, "fp32.pt")
      self._done(p.name, self.nbytes - before)
    values = {p.name: p.value for p in (*self.resolved.trainable, *self.resolved.frozen)}
    for alias, real in self.resolved.tied.items():
      self._save(
        {"param": tensor(self.torch, self.ckpt.read(values[real])).float()}, alias, "fp32.pt"
      )

  def _fp32(self, key: str):
    return tensor(self.torch, self._read(key).astype(np.float32, copy=False))

  def write_optimizer_state(self, zero3: bool) -> None:
    groups = self.groups
    state: dict[str, Any] = {
      "ds_version": DS_VERSION,
      # ZeRO-1/2 and BF16: group i's hyperparameters come from param_groups[i].
      "param_groups": [{**g, "params": [i]} for i, g in enumerate(groups)],
    }
    if zero3:
      # ZeRO-3 reads the step from state[0] and applies param_groups[0] to every group.
      state["optimizer_state_dict"] = {
        "state": {0: {"step": self.step.clone()}},
        "param_groups": [{**common_hyperparameters(groups), "params": []}],
      }
    self._save(state, "optimizer_state.pt")

  def write_model_states(self, stages: tuple[int, ...], global_steps: int) -> None:
    torch, state, extra = self.torch, self.resolved, self.resolved.extra
    module = collections.OrderedDict((p.name, self.extras[p.name]) for p in state.frozen)
    for alias, real in state.tied.items():
      if real in module:
        module[alias] = module[real]
    module.update((b.name, self.extras[b.name]) for b in state.buffers)
    shapes: list[collections.OrderedDict[str, Any]] = [
      collections.OrderedDict() for _ in self.groups
    ]
    for p in state.trainable:
      for name in self.expert_names.get(p.name, [p.name]):
        shape = p.shape[1:] if p.name in self.expert_names else p.shape
        shapes[self.group_of[p.name]][name] = torch.Size(shape)
    frozen = collections.OrderedDict((p.name, torch.Size(p.shape)) for p in state.frozen)
    states = {
      "module": module,
      "buffer_names": [b.name for b in state.buffers],
      "optimizer": None,
      "param_shapes": shapes,
      "frozen_param_shapes": frozen or None,
      "shared_params": dict(state.tied),
      "frozen_param_fragments": None,
      "lr_scheduler": extra.get("lr_scheduler") or None,
      "data_sampler": None,
      "random_ltd": None,
      "skipped_steps": _int(extra.get("skipped_steps"), 0),
      "global_steps": global_steps,
      "dp_world_size": _source_dp(extra),
      "mp_world_size": 1,
      "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
      "ds_version": DS_VERSION,
      "ucp_jax": {"exported_from": str(self.ckpt.location), "step": state.step},
    }
    if isinstance(extra.get("global_samples"), int):
      states["global_samples"] = extra["global_samples"]
    if isinstance(extra.get("ds_config"), dict):
      states["ds_config"] = extra["ds_config"]
    # The source's client state (as JSON data): DeepSpeed hands it back from load_checkpoint.
    client = extra.get("client_state")
    if isinstance(client, dict):
      states.update((k, v) for k, v in client.items() if k not in states)
    names = [MODEL_STATES_1_2] if 1 in stages else []
    names += [MODEL_STATES_3] if 3 in stages else []
    first = os.path.join(self.root, names[0])
    _save_synced(torch, states, first)
    for other in names[1:]:
      try:
        os.link(first, os.path.join(self.root, other))
      except OSError:
        shutil.copyfile(first, os.path.join(self.root, other))
        _folder.sync_file(os.path.join(self.root, other))


def _save_synced(torch, obj: Any, path: str) -> None:
  """`torch.save`, then fsync: the export's data is on disk before its folder is renamed in."""
  with open(path, "wb") as f:
    torch.save(obj, f)
    f.flush()
    os.fsync(f.fileno())


def _int(value: Any, default: int) -> int:
  return value if isinstance(value, int) and not isinstance(value, bool) else default


def _source_dp(extra: dict[str, Any]) -> int:
  layout = extra.get("source_layout") or {}
  for key in ("dp", "dp_world_size", "data_parallel"):
    if isinstance(layout, dict) and isinstance(layout.get(key), int):
      return layout[key]
  return 1


def tensor(torch, array: np.ndarray):
  """A torch tensor on `array`'s data (bfloat16 and float8 through an integer view)."""
  if not (array.flags.c_contiguous and array.flags.writeable):
    array = np.array(array, order="C")
  raw = _ML_DTYPES_AS.get(array.dtype.name)
  if raw is not None:
    return torch.from_numpy(array.view(raw)).view(getattr(torch, array.dtype.name))
  return torch.from_numpy(array)


def _pattern(entry: _schema.ParamEntry | None) -> dict | None:
  """How a TP/PP/EP source split a parameter (its schema entry's `pattern`), if it did."""
  return None if entry is None or entry.pattern is None else dict(entry.pattern)
