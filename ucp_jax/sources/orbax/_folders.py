"""Which folder of an Orbax path holds the tree, and whether its save was committed.

Orbax writes a pytree item as a folder (`_METADATA`, `manifest.ocdbt`, `d/`, ...);
`CheckpointManager` puts the items of each step in a step folder (`ROOT/STEP/ITEM/`, the step
folder holding `_CHECKPOINT_METADATA`). A save is committed once its folder is renamed from
`NAME.orbax-checkpoint-tmp...` and holds `commit_success.txt`, both done after every array is
written; Orbax versions that write no marker record the commit time in
`_CHECKPOINT_METADATA` (`commit_timestamp_nsecs`). Anything else is a save that did not
finish, and is refused.

Every file read here is read as untrusted (`read_json`): a regular file only, inside the
folder it belongs to, small and shallow enough to parse, one line naming it when it is not.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from ucp_jax.base import _errors
from ucp_jax.sources import _files
from ucp_jax.store import _untrusted

TMP_SUFFIX = ".orbax-checkpoint-tmp"
COMMIT_MARKER = "commit_success.txt"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
TREE_METADATA = "_METADATA"
OCDBT_MANIFEST = "manifest.ocdbt"
UCP_MANIFEST = "manifest.json"  # an item written by ucp_jax.orbax.UcpSave
_ITEM_FILES = (TREE_METADATA, OCDBT_MANIFEST)
_STEP = re.compile(r"^(?:.*_)?(\d+)(?:\.orbax-checkpoint-tmp.*)?$")
MAX_CHECKPOINT_METADATA_BYTES = 16 << 20
"""The most `_CHECKPOINT_METADATA` may hold (Orbax writes a few hundred bytes, plus the
user's `custom_metadata`)."""


@dataclasses.dataclass(frozen=True)
class Item:
  """The pytree item a path names.

  Attributes:
    folder: the item folder (`_METADATA` and the arrays inside).
    step: the `CheckpointManager` step it belongs to, None for a standalone save.
    name: its item name in the step (`default`, `state`, ...), None for a standalone save.
  """

  folder: str
  step: int | None = None
  name: str | None = None


def looks_like(path: str, fs: _files.Files | None = None) -> bool:
  """Whether `path` is an Orbax item, step or `CheckpointManager` folder (file names only)."""
  fs = fs or _files.for_path(path)
  path = fs.absolute(path)
  if not fs.isdir(path):
    return False
  if TMP_SUFFIX in os.path.basename(path):
    return True
  names = set(fs.listdir(path))
  if names & {*_ITEM_FILES, CHECKPOINT_METADATA, COMMIT_MARKER}:
    return True
  return bool(_steps(fs, path))


def find(path: str, fs: _files.Files | None = None) -> Item:
  """The committed pytree item `path` names: an item folder, or a step folder with one item.

  Raises:
    CheckpointNotFoundError: a save that did not finish (no commit marker, a tmp name).
    SourceFormatError: a `CheckpointManager` root (the message lists its steps), a step
      folder with no pytree item or several, or an item written by ucp_jax itself.
  """
  fs = fs or _files.for_path(path)
  path = fs.absolute(path)
  names = set(fs.listdir(path))
  parent = os.path.dirname(path)
  if names & set(_ITEM_FILES):
    in_step = CHECKPOINT_METADATA not in names and fs.isfile(
      os.path.join(parent, CHECKPOINT_METADATA)
    )
    if in_step:
      _check_committed(fs, parent)
    _check_committed(fs, path)
    step = _step_number(parent) if in_step else None
    return Item(path, step, os.path.basename(path) if in_step else None)
  if CHECKPOINT_METADATA in names or TMP_SUFFIX in os.path.basename(path):
    return _item_of_step(fs, path)
  steps = _steps(fs, path)
  if steps:
    raise _errors.SourceFormatError(_root_message(fs, path, steps))
  raise _errors.SourceFormatError(
    f"{path}: no {TREE_METADATA} or {OCDBT_MANIFEST}: not an Orbax checkpoint folder"
  )


def _item_of_step(fs: _files.Files, step: str) -> Item:
  _check_committed(fs, step)
  items = [n for n in fs.listdir(step) if fs.isdir(os.path.join(step, n))]
  trees = [n for n in items if set(fs.listdir(os.path.join(step, n))) & set(_ITEM_FILES)]
  ours = [n for n in items if fs.isfile(os.path.join(step, n, UCP_MANIFEST))]
  if len(trees) == 1:
    folder = os.path.join(step, trees[0])
    local, local_step = local_path(fs, folder), local_path(fs, step)
    if local is not None and local_step is not None:
      _untrusted.check_inside(local, local_step)
    _check_committed(fs, folder)
    return Item(folder, _step_number(step), trees[0])
  if trees:
    shown = ", ".join(os.path.join(step, n) for n in trees)
    raise _errors.SourceFormatError(
      f"{step}: an Orbax step with {len(trees)} pytree items; pass one of them: {shown}"
    )
  if ours:
    raise _errors.SourceFormatError(
      f"{step}: its item {ours[0]!r} is a ucp_jax checkpoint (ucp_jax.orbax.UcpSave); "
      f"open it directly: {os.path.join(step, ours[0])}"
    )
  raise _errors.SourceFormatError(
    f"{step}: an Orbax step folder with no pytree item (no item folder holds {TREE_METADATA}); "
    f"found: {', '.join(items) or 'no item folders'}"
  )


def _check_committed(fs: _files.Files, folder: str) -> None:
  """Raises for a folder whose save did not finish."""
  why = _unfinished(fs, folder)
  if why is not None:
    raise _errors.CheckpointNotFoundError(
      f"{folder}: an Orbax save that did not finish ({why}); nothing of it is read"
      + _committed_steps(fs, os.path.dirname(folder))
    )


def _unfinished(fs: _files.Files, folder: str) -> str | None:
  """Why `folder` holds no committed save, or None when it does."""
  if TMP_SUFFIX in os.path.basename(folder):
    return f"its folder still has its temporary name, *{TMP_SUFFIX}*"
  if fs.isfile(os.path.join(folder, COMMIT_MARKER)):
    return None
  metadata_file = os.path.join(folder, CHECKPOINT_METADATA)
  if not present(fs, metadata_file):
    return None  # an Orbax version that committed by the rename alone
  metadata = read_json(
    fs,
    metadata_file,
    folder,
    what="the save's commit time",
    max_bytes=MAX_CHECKPOINT_METADATA_BYTES,
  )
  if not isinstance(metadata, dict):
    raise _errors.SourceFormatError(f"{metadata_file}: not a JSON object: not Orbax's")
  stamp = metadata.get("commit_timestamp_nsecs")
  if stamp is None:
    return f"no {COMMIT_MARKER}, and `commit_timestamp_nsecs` in {metadata_file} is not set"
  if isinstance(stamp, bool) or not isinstance(stamp, int):
    raise _errors.SourceFormatError(
      f"{metadata_file}: `commit_timestamp_nsecs` is a {type(stamp).__name__}, not a number "
      "of nanoseconds: not Orbax's"
    )
  return None


def local_path(fs: _files.Files, path: str) -> str | None:
  """Where `path` (a path or a `file://` URL) is on the local disk; None on an object store."""
  if not fs.remote:
    return path
  return os.path.abspath(path[len("file://") :]) if path.startswith("file://") else None


def present(fs: _files.Files, path: str) -> bool:
  """Whether a file is at `path`: on a local disk, any entry (a FIFO or a link too, which
  reading then refuses), not only a regular file."""
  local = local_path(fs, path)
  return fs.isfile(path) if local is None else os.path.lexists(local)


def read_json(fs: _files.Files, file: str, root: str, *, what: str, max_bytes: int) -> Any:
  """The JSON document `file`, read as untrusted: a regular file, inside `root` once links
  are followed (local), at most `max_bytes`, nested at most `_untrusted.MAX_JSON_DEPTH`.

  Raises:
    SourceFormatError: one line naming `file` (missing, not a regular file, a link out of
      `root`, too large or deep, not JSON).
  """
  if not present(fs, file):
    raise _errors.SourceFormatError(f"{file}: missing: the file that holds {what}")
  local, local_root = local_path(fs, file), local_path(fs, root)
  if local is not None and local_root is not None:  # a `file://` URL is read as a path
    _untrusted.check_inside(local, local_root)
    file, fs = local, _files.LocalFiles()
  try:
    raw = fs.read(file, max_bytes)
  except FileNotFoundError:
    raise _errors.SourceFormatError(f"{file}: missing: the file that holds {what}") from None
  except OSError as e:
    raise _errors.SourceFormatError(f"{file}: cannot be read ({e.strerror or e})") from None
  return _untrusted.loads_json(raw, file, max_bytes=max_bytes)


def _step_number(folder: str) -> int | None:
  match = _STEP.match(os.path.basename(folder))
  return int(match.group(1)) if match else None


def _steps(fs: _files.Files, root: str) -> dict[str, bool]:
  """The step folders of a `CheckpointManager` root: name -> committed."""
  out = {}
  for name in fs.listdir(root):
    folder = os.path.join(root, name)
    if not _STEP.match(name) or not fs.isdir(folder):
      continue
    inside = set(fs.listdir(folder))
    if CHECKPOINT_METADATA in inside or COMMIT_MARKER in inside:
      try:
        out[name] = _unfinished(fs, folder) is None
      except _errors.UcpError:
        out[name] = False
  return out


def _committed_steps(fs: _files.Files, root: str) -> str:
  steps = _steps(fs, root) if fs.isdir(root) else {}
  done = sorted((n for n, ok in steps.items() if ok), key=lambda n: _step_number(n) or 0)
  return f" (committed steps beside it: {', '.join(done)})" if done else ""


def _root_message(fs: _files.Files, root: str, steps: dict[str, bool]) -> str:
  done = sorted((n for n, ok in steps.items() if ok), key=lambda n: _step_number(n) or 0)
  left = sorted(n for n, ok in steps.items() if not ok)
  unfinished = f"; not committed, so not read: {', '.join(left)}" if left else ""
  if not done:
    return f"{root}: an Orbax CheckpointManager folder with no committed step{unfinished}"
  latest = os.path.join(root, done[-1])
  items = [n for n in fs.listdir(latest) if fs.isfile(os.path.join(latest, n, UCP_MANIFEST))]
  if len(items) == 1:  # saved by UcpSave: the item itself is the checkpoint (one hop, not two)
    return (
      f"{root}: an Orbax CheckpointManager folder with steps {', '.join(done)}{unfinished}, "
      f"saved by ucp_jax.orbax.UcpSave: pass one step's item {items[0]!r}, e.g. "
      f"{os.path.join(latest, items[0])}"
    )
  return (
    f"{root}: an Orbax CheckpointManager folder with steps {', '.join(done)} (latest "
    f"{done[-1]}){unfinished}; pass one step folder, e.g. {latest}"
  )
