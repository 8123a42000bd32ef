"""Where a Megatron-LM checkpoint is, and its common state.

Megatron-LM saves under one root (`--save`):

  latest_checkpointed_iteration.txt     the latest iteration, or `release`
  iter_0000002/                         one `torch_dist` checkpoint per iteration
  release/                              a checkpoint converted for release

An iteration folder is a torch DCP folder (`.metadata`, `__R_0.distcp`) with megatron-core's
`metadata.json` (`{"sharded_backend": "torch_dist", ...}`). Its common state (`args`, the
iteration, the scheduler, the optimizer's param groups) is the pickled `common_state` entry
of the rank files since megatron-core 0.19, and `common.pt` beside them before. Both are read
with the safe unpickler: `argparse.Namespace` and Megatron's enums become inert records.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _files
from ucp_jax.sources._torch_reader import _torch_file
from ucp_jax.sources._torch_reader._pickle_records import InertObject

TRACKER = "latest_checkpointed_iteration.txt"
CONFIG = "metadata.json"
COMMON_PT = "common.pt"
COMMON_KEY = "common_state/shard_0_1"
ITERATION_DIR = re.compile(r"iter_(\d{7,})$")
MAX_TRACKER_BYTES = 64


def is_iteration_folder(path: str, fs: _files.Files) -> bool:
  """A DCP folder that megatron-core's `metadata.json` calls `torch_dist`."""
  config = os.path.join(path, CONFIG)
  if not (fs.isdir(path) and fs.isfile(config) and fs.isfile(os.path.join(path, ".metadata"))):
    return False
  try:
    return _config(config, fs).get("sharded_backend") == "torch_dist"
  except SourceFormatError:
    return True  # megatron's to explain: reading it names the problem


def is_root(path: str, fs: _files.Files) -> bool:
  """A folder with Megatron-LM's tracker file (any kind of file: reading it says what it is)."""
  found = fs.isfile if fs.remote else os.path.lexists
  return fs.isdir(path) and found(os.path.join(path, TRACKER))


def iteration_folder(path: str, fs: _files.Files, iteration: int | str | None) -> str:
  """The iteration folder `path` names: itself, or a root's latest (or `iteration`).

  Raises:
    SourceFormatError: an unreadable tracker file, or no folder for the iteration.
  """
  if not is_root(path, fs):
    if iteration is not None:
      raise SourceFormatError(
        f"{path}: an iteration folder; --iteration {iteration} picks one under a Megatron-LM "
        f"root (the folder with {TRACKER})"
      )
    return path
  if iteration is None:
    iteration = read_tracker(os.path.join(path, TRACKER), fs)
  name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
  folder = os.path.join(path, name)
  if not is_iteration_folder(folder, fs):
    held = sorted(n for n in fs.listdir(path) if ITERATION_DIR.match(n) or n == "release")
    raise SourceFormatError(
      f"{folder}: no torch_dist checkpoint for iteration {iteration} (a .metadata and "
      f"{CONFIG}); the root holds {', '.join(held) or 'no iteration folders'}"
    )
  return folder


def check_backend(folder: str, fs: _files.Files) -> None:
  """The folder's `metadata.json` names the `torch_dist` backend (megatron's older `zarr` one
  and others are refused, naming it)."""
  path = os.path.join(folder, CONFIG)
  if not fs.isfile(path):
    raise SourceFormatError(f"{folder}: no {CONFIG}: not a megatron-core dist checkpoint")
  backend = _config(path, fs).get("sharded_backend")
  if backend != "torch_dist":
    raise SourceFormatError(
      f"{path}: sharded_backend {backend!r:.40}; ucp_jax reads megatron-core's torch_dist "
      "checkpoints (Megatron-LM's --ckpt-format torch_dist, the default)"
    )


def read_tracker(tracker: str, fs: _files.Files) -> int | str:
  """The iteration `latest_checkpointed_iteration.txt` names: a number or `release`."""
  text = fs.read(tracker, MAX_TRACKER_BYTES).decode("utf-8", "replace").strip()
  if text == "release":
    return text
  if not text.isdigit():
    raise SourceFormatError(
      f"{tracker}: {text[:40]!r} is not an iteration number or 'release' (Megatron-LM writes "
      "the latest saved iteration there)"
    )
  return int(text)


def _config(path: str, fs: _files.Files) -> dict:
  data = fs.read(path, MAX_TRACKER_BYTES * 64)
  try:
    config = json.loads(data)
  except ValueError as e:
    raise SourceFormatError(f"{path}: not JSON ({e})") from None
  if not isinstance(config, dict):
    raise SourceFormatError(f"{path}: not a JSON object")
  return config


def common_state(folder: str, fs: _files.Files, files, layout) -> tuple[dict, str]:
  """The common state dict and where it was read (the `common_state` entry, or `common.pt`).

  Raises:
    SourceFormatError: there is none, or it is not a dict.
  """
  entry = layout.entries.get(COMMON_KEY)
  if entry is not None and hasattr(entry, "stored"):
    where = f"{os.path.join(folder, '.metadata')}: `{COMMON_KEY}`"
    state = files.load(entry.stored, f"`{COMMON_KEY}`")
    if isinstance(state, list) and len(state) == 1:  # megatron wraps the object in a list
      state = state[0]
  elif fs.isfile(os.path.join(folder, COMMON_PT)):
    where = os.path.join(folder, COMMON_PT)
    state = _torch_file.load_named(where)
  else:
    raise SourceFormatError(
      f"{folder}: no common state: neither a `{COMMON_KEY}` entry (megatron-core 0.19) nor "
      f"{COMMON_PT} (earlier versions)"
    )
  if not isinstance(state, dict):
    raise SourceFormatError(f"{where}: the common state is {type(state).__name__}, not a dict")
  return state, where


def record_fields(value: Any) -> dict:
  """The fields of an inert `argparse.Namespace` (or a dict), else {}."""
  if isinstance(value, InertObject):
    state = value.state
    return dict(state) if isinstance(state, dict) else {}
  return dict(value) if isinstance(value, dict) else {}
