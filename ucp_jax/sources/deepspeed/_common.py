"""What every DeepSpeed source shares: its files, their keys, and the model-states file.

docs/deepspeed_layouts.md is the contract (DeepSpeed 0.19.8). Every check here collects all
offending items, each naming its file and key, and raises one `SourceFormatError`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _files
from ucp_jax.sources._source_plan import SourceParam, jsonable, number
from ucp_jax.sources._torch_reader import _optimizer, _torch_file
from ucp_jax.sources._torch_reader._torch_file import is_tensor
from ucp_jax.sources.deepspeed import _contract as contract
from ucp_jax.store import _schema, _untrusted

MODEL_KEYS = (
  "module",
  "buffer_names",
  "param_shapes",
  "shared_params",
  "global_steps",
  "dp_world_size",
  "ds_version",
)
"""Keys every `*model_states.pt` of a ZeRO checkpoint has (§4)."""

# Top-level keys of model states that are DeepSpeed's own; the rest is client state.
_ENGINE_KEYS = frozenset(
  {*MODEL_KEYS, "optimizer", "frozen_param_shapes", "frozen_param_fragments", "lr_scheduler"}
  | {"data_sampler", "random_ltd", "skipped_steps", "global_samples", "mp_world_size"}
  | {"checkpoint_parallel_dimensions", "ds_config", "sparse_tensor_module_names"}
)
MAX_NAME = 1024
"""Characters of a parameter name (patterns match names: their time grows with the length)."""
MODEL_RE = re.compile(r"^mp_rank_([0-9]+)_model_states\.pt\Z")
ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)_model_states\.pt\Z")
OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)_optim_states\.pt\Z")
EXPERT_FILE_RE = re.compile(r"^layer_([0-9]+)_expert_([0-9]+)_mp_rank_([0-9]+)_model_states\.pt\Z")
"""A native MoE expert's own file: its layer, its global expert number, its TP rank."""


@dataclasses.dataclass(frozen=True)
class TagFiles:
  """The `.pt` files of one DeepSpeed tag folder, by dp rank."""

  folder: str
  models: list[str]  # [mp_rank_00_model_states.pt], or one per dp rank for ZeRO-3
  optims: dict[int, str]  # dp rank -> *optim_states.pt
  zero3: bool


def fail(header: str, problems: Sequence[str]) -> None:
  """Raises one `SourceFormatError` listing `problems` under `header`, if there are any
  (one line when there is one)."""
  _errors.raise_problems(SourceFormatError, header, problems)


_ROOT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
  "ucp_jax_deepspeed_root", default=None
)


@contextlib.contextmanager
def reading(root: str) -> Iterator[None]:
  """Within it, `load` reads only files inside the checkpoint folder `root`: a link (to a
  file or a folder on the way) that leaves it is refused before anything of it is read."""
  token = _ROOT.set(root)
  try:
    yield
  finally:
    _ROOT.reset(token)


def load(path: str) -> Any:
  """Reads a torch file with the safe reader (memory-mapped); errors name the file."""
  root = _ROOT.get()
  if root is not None and "://" not in path and os.path.isfile(path):  # (special files:
    _untrusted.check_inside(path, root)  # the reader refuses them, saying what they are)
  return _torch_file.load_named(path)


def load_checked(path: str, spec: Any, what: str) -> Any:
  """`load(path)`, checked against a `_contract` spec; one error, `{path}: not a {what}`,
  lists every problem."""
  data = load(path)
  fail(f"{path}: not a {what}", contract.check(data, spec, path))
  return data


MAX_TAG_BYTES = 4096
"""The most a `latest` file may hold: one folder name."""


def read_tag(path: str) -> str:
  """The tag that a `latest` file names: one folder beside it, never a path out of the folder.

  Raises:
    SourceFormatError: `path` is not a regular file of UTF-8 text naming one folder (no
      separator, not ``..``, not absolute), or a link out of its folder (not read).
  """
  if "://" not in path and os.path.isfile(path):
    _untrusted.check_inside(path, os.path.dirname(path) or ".")
  try:
    raw = _files.head(path, MAX_TAG_BYTES + 1)
  except OSError as e:
    raise SourceFormatError(f"{path}: cannot read this tag file ({e.strerror or e})") from e
  try:
    tag = raw.decode("utf-8").strip()
  except UnicodeDecodeError:
    raise SourceFormatError(f"{path}: not UTF-8 text, so it names no tag folder") from None
  separators = {"/", "\\", "\0", os.sep, os.altsep} - {None}
  if len(raw) > MAX_TAG_BYTES or not tag or tag in (".", "..") or any(c in tag for c in separators):
    raise SourceFormatError(
      f"{path}: names {tag!r:.80}, not a tag folder beside it; a tag is one folder name, so "
      "convert never follows it out of the checkpoint folder"
    )
  return tag


def list_tag(folder: str) -> TagFiles:
  """Finds the model-states and optimizer-states files of a tag folder (§2)."""
  names = sorted(_files.listdir(folder))
  models, zero3_models, optims, other_mp = [], {}, {}, []
  prefixes: dict[str, list[str]] = {}
  for name in names:
    if m := MODEL_RE.match(name):
      (models if int(m.group(1)) == 0 else other_mp).append(name)
    elif m := ZERO3_MODEL_RE.match(name):
      if int(m.group(2)) == 0:
        zero3_models[int(m.group(1))] = name
      else:
        other_mp.append(name)
    elif m := OPTIM_RE.match(name):
      if int(m.group(3)) == 0:
        optims[int(m.group(2))] = name
        prefixes.setdefault(m.group(1) or "", []).append(name)
      else:
        other_mp.append(name)
  layers = [n for n in names if n.startswith("layer_") and n.endswith("model_states.pt")]
  fail(
    f"{folder}: files of model-parallel ranks other than mp_rank_00, or pipeline layer files, in "
    "a data-parallel tag folder (`ucp_jax.convert` reads such folders with its TP/PP source)",
    other_mp + layers,
  )
  if len(prefixes) > 1:
    fail(
      f"{folder}: optimizer-states files of two runs (with and without the bf16_ prefix)",
      sorted(n for names in prefixes.values() for n in names),
    )
  if not (models or zero3_models) or not optims:
    found = _errors.listed(names)
    raise SourceFormatError(
      f"{folder}: not a DeepSpeed ZeRO tag folder: expected mp_rank_00_model_states.pt (ZeRO-1/2, "
      "BF16 optimizer) or zero_pp_rank_K_mp_rank_00_model_states.pt (ZeRO-3), and "
      f"[bf16_]zero_pp_rank_K_mp_rank_00_optim_states.pt for every dp rank K; found: {found}"
    )
  zero3 = bool(zero3_models) and not models
  paths = [zero3_models[k] for k in sorted(zero3_models)] if zero3 else models
  if zero3 and sorted(zero3_models) != list(range(len(zero3_models))):
    # within 0..n-1 (n files): a rank a file names may be huge, and one of them is missing
    missing = [k for k in range(len(zero3_models)) if k not in zero3_models]
    fail(
      f"{folder}: model-states files are missing for dp ranks {missing}",
      [f"zero_pp_rank_{k}_mp_rank_00_model_states.pt" for k in missing],
    )
  return TagFiles(
    folder=folder,
    models=[os.path.join(folder, n) for n in paths],
    optims={k: os.path.join(folder, optims[k]) for k in sorted(optims)},
    zero3=zero3,
  )


def check_ranks(files: TagFiles, dp: int, model_path: str) -> list[str]:
  """The optimizer-states paths of ranks 0..dp-1, or an error naming the missing ones."""
  prefix = os.path.basename(next(iter(files.optims.values()))).split("zero_pp_rank_")[0]
  missing = [k for k in range(dp) if k not in files.optims]
  extra = [k for k in files.optims if k >= dp]
  problems = [f"{prefix}zero_pp_rank_{k}_mp_rank_00_optim_states.pt is missing" for k in missing]
  problems += [f"{os.path.basename(files.optims[k])}: rank {k} >= dp_world_size" for k in extra]
  if files.zero3:
    problems += [
      f"zero_pp_rank_{k}_mp_rank_00_model_states.pt is missing"
      for k in range(len(files.models), dp)
    ]
    problems += [f"{os.path.basename(p)}: rank >= dp_world_size" for p in files.models[dp:]]
  fail(
    f"{files.folder}: the rank files do not match dp_world_size {dp} (from "
    f"{os.path.basename(model_path)}['dp_world_size'])",
    problems,
  )
  return [files.optims[k] for k in range(dp)]


def missing_keys(data: Any, keys: Sequence[str], path: str, where: str = "") -> list[str]:
  """`path: missing key where['k']` for every key of `keys` that `data` lacks."""
  if not isinstance(data, dict):
    return [f"{path}: {where or 'the top level'} is a {type(data).__name__}, not a dict"]
  return [f"{path}: missing key {where}[{k!r}]" for k in keys if k not in data]


def same_everywhere(items: Sequence[tuple[str, Any]], what: str) -> list[str]:
  """Problems for every file whose `what` differs from the first file's."""
  first_path, first = items[0]
  return [
    f"{path}: {what} is {_short(value)}, but {_short(first)} in {os.path.basename(first_path)}"
    for path, value in items[1:]
    if not _equal(value, first)
  ]


def _equal(a: Any, b: Any) -> bool:
  if is_tensor(a) or is_tensor(b):
    return np.array_equal(np.asarray(a), np.asarray(b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
  return a == b


def _short(value: Any) -> str:
  return _errors.shown(jsonable(value, max_list=8))  # a torch record as the JSON it would be


def int_of(value: Any) -> int | None:
  """An int from an int or a ZeroStageEnum record; None otherwise."""
  if isinstance(value, _torch_file.InertObject) and len(value.args) == 1:
    value = value.value
  return value if type(value) is int else None


def flat(array: Any, path: str, key: str, problems: list[str]) -> np.ndarray | None:
  """`array` as a 1-D view (DeepSpeed's flat partitions), or None with a problem noted."""
  if not is_tensor(array):
    problems.append(f"{path}: {key} is a {type(array).__name__}, not a tensor")
    return None
  if array.ndim != 1:
    if not array.flags.c_contiguous:
      problems.append(f"{path}: {key} has shape {array.shape}, not a flat partition")
      return None
    return array.reshape(-1)
  return array


def shapes_of(model: dict, path: str, problems: list[str]) -> list[dict[str, tuple[int, ...]]]:
  """`param_shapes` as a list of {name: shape}, in flat order."""
  shapes = model.get("param_shapes")
  if isinstance(shapes, dict):
    shapes = [shapes]
  if not isinstance(shapes, list) or not all(isinstance(d, dict) for d in shapes):
    problems.append(f"{path}: ['param_shapes'] is not a list of {{name: shape}} dicts")
    return []
  out = []
  for g, group in enumerate(shapes):
    entry = {}
    for name, shape in group.items():
      if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not name.isprintable():
        problems.append(f"{path}: ['param_shapes'][{g}] has the key {name!r:.40}, not a name")
        continue
      if not (isinstance(shape, tuple) and all(type(d) is int and d >= 0 for d in shape)):
        problems.append(f"{path}: ['param_shapes'][{g}][{name!r}] = {shape!r:.40} is no shape")
        continue
      entry[name] = shape
    out.append(entry)
  return out


def model_extras(model: dict, path: str, optimized: set[str]) -> tuple[list, dict, list]:
  """Tied params, buffers and the frozen-param names of a model-states file (§9).

  Returns ([SourceParam(tied)], {buffer: Tensor}, [frozen names from `module`]).
  """
  module = model["module"] if isinstance(model.get("module"), dict) else {}
  buffer_names = list(model.get("buffer_names") or [])
  shared = model.get("shared_params") or {}
  problems = [
    f"{path}: ['buffer_names'] has {n!r}, which ['module'] lacks"
    for n in buffer_names
    if not is_tensor(module.get(n))
  ]
  problems += [
    f"{path}: ['shared_params'][{alias!r}] = {holder!r} names no optimized parameter"
    for alias, holder in shared.items()
    if holder not in optimized and holder not in module
  ]
  fail(f"{path}: inconsistent model states", problems)
  buffers = {name: whole(module[name], f"{path}['module'][{name!r}]") for name in buffer_names}
  tied = [SourceParam(name=alias, value=None, tied_to=holder) for alias, holder in shared.items()]
  taken = optimized | set(buffer_names) | set(shared)
  frozen = [n for n in module if n not in taken]
  return tied, buffers, frozen


whole = _optimizer.whole
"""A `Tensor` for an array that is in one piece in one file (a strided one copied when read)."""


def layout(model: dict, *, stage: int, optimizer_class: str) -> dict:
  """The schema's `extra.source_layout` (§4)."""
  dims = model.get("checkpoint_parallel_dimensions") or {}
  config = model.get("ds_config") or {}
  dtype = "float32"
  if isinstance(config, dict):
    if (config.get("bf16") or {}).get("enabled"):
      dtype = "bfloat16"
    elif (config.get("fp16") or {}).get("enabled"):
      dtype = "float16"
  return {
    "zero_stage": stage,
    "dp": model.get("dp_world_size"),
    "tp": dims.get("tp_degree", model.get("mp_world_size", 1)),
    "pp": dims.get("pp_degree", 1),
    "ds_version": model.get("ds_version"),
    "dtype": dtype,
    "optimizer_class": optimizer_class,
  }


def optimizer_class(osd: dict) -> tuple[int, str]:
  """(zero stage, DeepSpeed optimizer class) of an optimizer state dict (§5, checklist 10)."""
  if "zero_stage" not in osd:
    return 1, "BF16_Optimizer"
  stage = int_of(osd["zero_stage"])
  return stage, "DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer"


def optimizer_entry(groups: list[dict], steps: list[Any], config: Any) -> _schema.Optimizer:
  """The schema's `optimizer` entry: type, step, per-group hyperparameters and step."""
  out_groups = []
  for group, step in zip(groups, steps):
    hyper = {str(k): jsonable(v) for k, v in group.items() if k != "params"}
    out_groups.append({**hyper, "step": None if step is None else number(step)})
  known = [g["step"] for g in out_groups if g["step"] is not None]
  return _schema.Optimizer(
    type=_optimizer_type(groups, config),
    step=_schema.integer_or_none(known[0] if known else None),
    groups=tuple(map(_schema.GroupEntry, out_groups)),
  )


def _optimizer_type(groups: list[dict], config: Any) -> str:
  spec = (config.get("optimizer") or {}) if isinstance(config, dict) else {}
  name = str(spec.get("type", "")).lower()
  first = groups[0] if groups else {}
  if "betas" in first:
    if first.get("decoupled_weight_decay") is not None:
      return "adamw" if first["decoupled_weight_decay"] else "adam"
    if name == "adam":  # DeepSpeed's Adam is AdamW unless adam_w_mode is off
      return "adamw" if (spec.get("params") or {}).get("adam_w_mode", True) else "adam"
    return "adamw" if "w" in name else "adam"
  if "momentum" in first:
    return "sgd"
  return name or "unknown"


def extra(model: dict, source_layout: dict) -> dict:
  """The schema's `extra` entry: engine counters, scheduler, config, client state."""
  client = {k: v for k, v in model.items() if k not in _ENGINE_KEYS}
  return {
    "global_steps": number(model.get("global_steps")),
    "global_samples": jsonable(model.get("global_samples")),
    "skipped_steps": jsonable(model.get("skipped_steps")),
    "lr_scheduler": jsonable(model.get("lr_scheduler")),
    "ds_config": jsonable(model.get("ds_config")),
    "client_state": jsonable(client),
    "source_layout": source_layout,
  }


def source(plan_path: str, kind: str, source_layout: dict) -> dict:
  """The manifest's `source` entry."""
  folder = _files.absolute(plan_path)
  return {
    "framework": "deepspeed",
    "format": kind,
    "ds_version": source_layout["ds_version"],
    "path": folder,
    "tag": os.path.basename(folder),
    **{k: v for k, v in source_layout.items() if k != "ds_version"},
  }


OSD = "['optimizer_state_dict']"


def load_optim_files(
  paths: list[str], spec: contract.Spec, special=None
) -> tuple[list[dict | None], list, list[str]]:
  """Each rank file's `optimizer_state_dict`, its `(path, ds_version)`, and the problems.

  Each file is checked against `contract.optim_file(spec)`; `special(osd, path)`, if given,
  returns the problems of a known unsupported layout, which it names better than the contract.
  """
  problems, osds, versions = [], [], []
  for path in paths:
    data = load(path)
    versions.append((path, data.get("ds_version") if isinstance(data, dict) else None))
    osd = data.get("optimizer_state_dict") if isinstance(data, dict) else None
    osds.append(osd)
    found = special(osd, path) if special is not None and isinstance(osd, dict) else []
    problems += found or contract.check(data, contract.optim_file(spec), path)
  return osds, versions, problems
