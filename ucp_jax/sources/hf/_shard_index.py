"""A sharded safetensors checkpoint's index, checked, and its shards matched against it.

The index (`model.safetensors.index.json`, and the same for `pytorch_model.bin`) maps each
tensor name to the shard file that holds it (`weight_map`). It is untrusted like a header
(`_safetensors`): its JSON is checked for size, values and depth before it is parsed, it
lists at most `MAX_INDEX_TENSORS` tensors in at most `MAX_SHARDS` files, each a plain file
name of the index's folder, and every shard must hold exactly the tensors the index puts
in it.
"""

from __future__ import annotations

import os

from ucp_jax.base import _errors
from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources.hf._safetensors import (
  SafetensorsFile,
  TensorInfo,
  fail,
  parse_json,
  read_header,
  read_remote_header,
)
from ucp_jax.store._untrusted import open_regular

MAX_INDEX_BYTES = 100 << 20
"""The most an index (`*.index.json`) may hold."""
MAX_INDEX_TENSORS = 1 << 18
"""The most tensors an index may list (the largest open models list about 150,000)."""
MAX_SHARDS = 1 << 12
"""The most shard files an index may name (real ones: a few hundred)."""
INDEX_DEPTH = 8
"""An index nests two deep (`weight_map`, `metadata`); a little room for writers' metadata."""
INDEX_SUFFIX = ".safetensors.index.json"


def read_index(path: str, folder: str | None = None) -> dict[str, str]:
  """`weight_map` of a sharded checkpoint's index: tensor name -> shard file (absolute).

  Works for `model.safetensors.index.json` and `pytorch_model.bin.index.json` alike.

  Args:
    path: the index.
    folder: the checkpoint's folder (default: the index's): a link may not leave it.

  Raises:
    SourceFormatError: not JSON, no `weight_map` of names to file names, too many tensors or
      shards, a name listed twice, a shard that is not a file name of the index's folder,
      or a shard file that is missing (one line, naming the first problems).
  """
  here = os.path.dirname(os.path.abspath(path))
  try:
    with open_regular(path, inside=folder or here) as f:
      raw = f.read(MAX_INDEX_BYTES + 1)
  except FileNotFoundError:
    raise SourceFormatError(f"{path}: no such file") from None
  if len(raw) > MAX_INDEX_BYTES:
    raise SourceFormatError(f"{path}: an index larger than {MAX_INDEX_BYTES} bytes")
  weight_map, problems = parse_index(raw, path)
  _check_shards(path, weight_map, problems, lambda file: os.path.lexists(os.path.join(here, file)))
  return {name: os.path.join(here, file) for name, file in weight_map.items()}


def parse_index(raw: bytes, path: str) -> tuple[dict[str, str], list[str]]:
  """(`weight_map` as written, problems so far) of an index's bytes.

  Raises:
    SourceFormatError: not a JSON object with a `weight_map` of names to file names, or
      one of more than `MAX_INDEX_TENSORS` tensors or `MAX_SHARDS` files.
  """
  index, repeated = parse_json(raw, path, INDEX_DEPTH, MAX_INDEX_BYTES)
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(weight_map, dict):
    raise SourceFormatError(f"{path}: no `weight_map` of tensor names to file names")
  bad = next((k for k, v in weight_map.items() if not isinstance(v, str)), None)
  if bad is not None:
    raise SourceFormatError(
      f"{path}: `weight_map` {_errors.shown(bad)}: {_errors.shown(weight_map[bad])} is not a file name"
    )
  if len(weight_map) > MAX_INDEX_TENSORS:
    raise SourceFormatError(
      f"{path}: `weight_map` lists {len(weight_map)} tensors, more than the "
      f"{MAX_INDEX_TENSORS} an index may list"
    )
  shards = len(set(weight_map.values()))
  if shards > MAX_SHARDS:
    raise SourceFormatError(
      f"{path}: `weight_map` names {shards} shard files, more than the {MAX_SHARDS} an index "
      "may name"
    )
  return weight_map, [
    f"tensor {_errors.shown(k)} is listed twice" for k in repeated if k in weight_map
  ]


def _check_shards(where: str, weight_map: dict[str, str], problems: list[str], present) -> dict:
  """The index's shards (file -> the names listed in it), once each is a plain file name of
  the folder that `present(file)` finds there; else raises with `problems` and those."""
  by_shard: dict[str, list[str]] = {}
  for name, file in weight_map.items():
    by_shard.setdefault(file, []).append(name)
  for file, names in by_shard.items():
    if not _file_name(file):
      problems.append(
        f"shard {_errors.shown(file)}, listed for tensor {_some(names)}, lies outside the folder"
      )
    elif not present(file):
      problems.append(f"shard {file}, listed for tensor {_some(names)}, is missing")
  fail(where, "the index names shards that cannot be read", problems)
  return by_shard


def _file_name(name: str) -> bool:
  """Whether `name` is a plain file name: no folder, no parent, nothing a terminal acts on
  (no control character, no line break)."""
  return (
    name not in ("", ".", "..") and "/" not in name and os.sep not in name and name.isprintable()
  )


def match_index(index_path: str, weight_map: dict[str, str], found: dict[str, list[str]]) -> None:
  """Checks the shards against their index: each tensor in the file it names, once.

  Args:
    index_path: the index, for messages.
    weight_map: `read_index(index_path)`.
    found: shard file -> the tensor names it holds.

  Raises:
    SourceFormatError: a tensor in two shards, in a shard the index does not name for it,
      or listed in the index and in no shard (all named).
  """
  problems: list[str] = []
  seen: dict[str, str] = {}
  for file, names in found.items():
    for name in names:
      if name in seen:
        problems.append(
          f"tensor {_errors.shown(name)} is in both {os.path.basename(seen[name])} and "
          f"{os.path.basename(file)}"
        )
      else:
        problems += _misplaced(file, name, weight_map.get(name))
      seen.setdefault(name, file)
  problems += [
    f"tensor {_errors.shown(n)}: listed in the index for {os.path.basename(f)}, which does not hold it"
    for n, f in weight_map.items()
    if n not in seen
  ]
  fail(index_path, "the shards do not match the index", problems)


def _misplaced(file: str, name: str, listed: str | None) -> list[str]:
  """What is wrong with shard `file` holding tensor `name`, which the index lists in `listed`."""
  shard = os.path.basename(file)
  if listed is None:
    return [f"{shard} holds tensor {_errors.shown(name)}, which the index does not list"]
  if listed != file:
    return [
      f"{shard} holds tensor {_errors.shown(name)}, which the index puts in {os.path.basename(listed)}"
    ]
  return []


def read_remote_sharded(folder, index_name: str, names: list[str]) -> list[SafetensorsFile]:
  """`read_sharded` for a folder on an object store (a `_remote.Folder` holding `names`)."""
  where = folder.path(index_name)
  weight_map, problems = parse_index(folder.read_small(index_name, MAX_INDEX_BYTES), where)
  by_shard = _check_shards(where, weight_map, problems, set(names).__contains__)
  full = {name: folder.path(file) for name, file in weight_map.items()}
  files = []
  for file in sorted(by_shard):
    files.append(read_remote_header(folder, file))
    _only_listed(where, files[-1], full)
  match_index(where, full, {f.path: list(f.tensors) for f in files})
  return files


def read_sharded(
  index_path: str, folder: str | None = None
) -> tuple[list[SafetensorsFile], dict[str, TensorInfo]]:
  """Every shard of an index, checked against it: each tensor where the index says.

  A shard holding a tensor the index does not list in it is refused as soon as it is read,
  so the tensors parsed are at most those the index lists, and one shard's.
  """
  weight_map = read_index(index_path, folder)
  files = []
  for file in sorted(set(weight_map.values())):
    files.append(read_header(file, folder))
    _only_listed(index_path, files[-1], weight_map)
  match_index(index_path, weight_map, {f.path: list(f.tensors) for f in files})
  tensors = {name: info for f in files for name, info in f.tensors.items()}
  return files, tensors


def _only_listed(index: str, file: SafetensorsFile, weight_map: dict[str, str]) -> None:
  """Refuses a shard holding a tensor the index does not list in it, as soon as it is read:
  the tensors parsed are then at most those the index lists, and one shard's."""
  problems = [p for name in file.tensors for p in _misplaced(file.path, name, weight_map.get(name))]
  fail(index, "the shards do not match the index", problems)


def _some(names: list[str]) -> str:
  return _errors.shown(names[0]) + (f" and {len(names) - 1} more" if len(names) > 1 else "")
