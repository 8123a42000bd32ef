"""DeepSpeed as a source: a checkpoint folder, a tag folder, or a `ds_to_universal` folder.

What is recognized and how each layout is read: docs/deepspeed_layouts.md; the readers are
`_zero` (ZeRO-1/2 and the BF16 optimizer), `_zero3`, `_tp` (TP/PP/EP ranks merged by
pattern) and `_universal`, each checking its files against `_contract` first.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from ucp_jax.base import _errors
from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _files
from ucp_jax.sources._source_plan import Plan
from ucp_jax.sources.deepspeed import _common, _universal
from ucp_jax.store import _untrusted

NAME = "deepspeed"
DESCRIPTION = (
  "a DeepSpeed checkpoint folder (a `latest` file naming its tag folder), tag folder "
  "(mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt, with "
  "*_optim_states.pt; ZeRO-1/2/3, BF16 optimizer, TP/PP/EP ranks) or universal folder "
  "(zero/optimizer_state.pt, from `ds_to_universal`)"
)
_POINTERS = ("latest", "latest_universal")


def sniff(path: str) -> bool:
  """Whether `path` is a DeepSpeed tag or universal folder, or holds a `latest` or
  `latest_universal` pointer naming one (a stray pointer, say in a Hugging Face Trainer
  folder whose `global_stepN` was pruned, does not make a folder DeepSpeed's)."""
  if not _files.isdir(path):
    return False
  if _folder_kind(path) is not None:
    return True
  for pointer in _POINTERS:
    file = os.path.join(path, pointer)
    if _files.isfile(file):
      try:
        folder = os.path.join(path, _common.read_tag(file))
      except SourceFormatError:
        continue
      if _files.isdir(folder) and _folder_kind(folder) is not None:
        return True
  return False


def sniff_remote(url: str) -> bool:
  """`sniff` for a URL (listings of the prefix and of a pointer's tag folder)."""
  return sniff(url.rstrip("/"))


def sniff_weak(path: str) -> bool:
  """A folder holding a `latest` or `latest_universal` pointer: DeepSpeed's, if no source
  recognizes it, so that `detect` says what is wrong with the pointer or its tag folder."""
  return _files.isdir(path) and any(_files.lexists(os.path.join(path, p)) for p in _POINTERS)


def describe(path: str, *, patterns: Sequence = ()) -> Plan:
  """The checkpoint's parameters, slots, buffers and groups, read from its metadata only.

  Args:
    path: a DeepSpeed checkpoint folder, tag folder or universal folder.
    patterns: for tensor-parallel sources, `(regex, pattern)` rules for parameters the
      checkpoint's `universal_checkpoint_info` does not describe (`_pattern_rules.classify`).
  """
  from ucp_jax.sources.deepspeed import _moe, _tp, _zero, _zero3

  kind, folder = detect(path)
  with _common.reading(os.fspath(path)):  # no link out of the checkpoint folder is followed
    if kind == "deepspeed_universal":
      plan = _universal.plan(folder)
    elif _moe.is_moe(folder):  # experts: stacked per layer, with their optimizer state
      plan = _moe.plan(folder)
    elif _tp.is_model_parallel(folder):  # TP/PP ranks: merged by pattern
      plan = _tp.plan(folder, rules=patterns)
    else:
      files = _common.list_tag(folder)
      plan = (_zero3 if files.zero3 else _zero).plan(files)
  return dataclasses.replace(plan, format=kind)


def detect(src: str | os.PathLike) -> tuple[str, str]:
  """(`deepspeed` or `deepspeed_universal`, the folder to read) of `src`."""
  path = os.fspath(src)
  if not _files.exists(path):
    raise SourceFormatError(f"{path}: no such file or directory")
  if not _files.isdir(path):
    raise SourceFormatError(f"{path}: a single file, not a DeepSpeed checkpoint folder")
  kind = _folder_kind(path)
  if kind is not None:
    return kind, path
  for pointer in _POINTERS:
    file = os.path.join(path, pointer)
    if _files.lexists(file) and not _files.isdir(file):
      tag = _common.read_tag(file)
      folder = os.path.join(path, tag)
      if "://" not in folder and os.path.lexists(folder):
        _untrusted.check_inside(folder, path)  # a tag folder that is a link out: not listed
      kind = _folder_kind(folder) if _files.isdir(folder) else None
      if kind is None:
        raise SourceFormatError(
          f"{file} names the tag {tag!r}, but {folder} is not a DeepSpeed tag or universal folder"
        )
      return kind, folder
  names = sorted(_files.listdir(path))
  found = _errors.listed(names)
  raise SourceFormatError(
    f"{path}: not a DeepSpeed checkpoint. Looked for: a checkpoint folder (a `latest` file "
    "naming its tag folder); a tag folder (mp_rank_00_model_states.pt or "
    "zero_pp_rank_0_mp_rank_00_model_states.pt, with *_optim_states.pt); a universal folder "
    f"(zero/optimizer_state.pt, or a `latest_universal` file naming one). Found: {found}"
  )


def _folder_kind(folder: str) -> str | None:
  if _universal.is_universal(folder):
    return "deepspeed_universal"
  names = _files.listdir(folder)
  if any(n.endswith("model_states.pt") or n.endswith("optim_states.pt") for n in names):
    return "deepspeed"
  return None
