"""The leaves of an Orbax pytree item, read from its metadata files.

`_METADATA` holds the tree: every leaf's path (`key_metadata`), its type (`jax.Array`,
`np.ndarray`, `scalar`, `string`, or an empty node to skip) and the storage options
(`use_ocdbt`, `use_zarr3`); `array_metadatas/process_N` hold the PRNG implementation of each
typed key. Each array is stored under its name, the path joined by `.`
(`model.l1.kernel.value`).

Keys are ucp_jax's own (`store._keypath.join` of the path), except that a Flax NNX
`Variable`, which Orbax stores as a node with the single child `value`, is looked through as
`ucp_jax.save` does: `model.l1.kernel.value` is the key `model/l1/kernel`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
from typing import Any

from ucp_jax import _errors
from ucp_jax.sources import _files
from ucp_jax.sources.orbax import _folders
from ucp_jax.store import _keypath

ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
VARIABLE_VALUE = "value"
_SEQUENCE = 1  # Orbax's `KeyType.SEQUENCE` (2: a dict key or attribute)


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One stored leaf.

  Attributes:
    key: the ucp_jax key.
    path: the pytree path as Orbax names it.
    name: the stored array's name in the item (`model.l1.kernel.value`).
    value_type: Orbax's type of the leaf (`jax.Array`, `np.ndarray`, `scalar`).
    prng_impl: for a typed PRNG key, its implementation (`threefry2x32`, ...).
    variable: whether the key dropped the path's trailing `value` (an NNX Variable).
  """

  key: str
  path: tuple[str, ...]
  name: str
  value_type: str
  prng_impl: str | None = None
  variable: bool = False


@dataclasses.dataclass(frozen=True)
class TreeMetadata:
  """What an item's metadata files say, before any array is opened."""

  folder: str
  leaves: list[Leaf]
  not_read: dict[str, str]  # key -> Orbax type, for leaves that are not arrays (strings, ...)
  use_ocdbt: bool
  use_zarr3: bool
  fill_missing: bool  # chunks equal to the fill value were not stored (older Orbax saves)
  sequences: list[str]  # keys of the nodes that are lists or tuples ("": the root)
  empty: dict[str, str]  # key -> Orbax type of each empty node (`None`, `Dict`, `Tuple`, ...)


def read(folder: str, fs: _files.Files) -> TreeMetadata:
  """The item's leaves and storage options.

  Raises:
    SourceFormatError: `_METADATA` missing or not Orbax's, or an entry that is not
      (every problem listed at once, each with its file and key).
  """
  file = os.path.join(folder, _folders.TREE_METADATA)
  data = _json(fs, file, what="the tree of the checkpoint (every leaf's path and type)")
  tree = data.get("tree_metadata") if isinstance(data, dict) else None
  if not isinstance(tree, dict):
    raise _errors.SourceFormatError(
      f"{file}: no `tree_metadata` object: not the metadata of an Orbax pytree checkpoint"
    )
  problems: list[str] = []
  entries = []
  sequences: set[str] = set()
  for label, entry in tree.items():
    path, in_sequence = _path(label, entry)
    value = entry.get("value_metadata") if isinstance(entry, dict) else None
    if path is None or not isinstance(value, dict):
      problems.append(f"{file}: entry {label!r}: no `key_metadata` list or `value_metadata`")
      continue
    entries.append((path, value))
    sequences |= {_keypath.join(path[:i]) for i, s in enumerate(in_sequence) if s}
  if problems:
    raise _errors.SourceFormatError(_lines(problems))
  variables = _variables([p for p, _ in entries])
  prng = _prng_impls(fs, folder)
  leaves, not_read, empty = [], {}, {}
  for path, value in entries:
    kind = str(value.get("value_type"))
    parts = path[:-1] if path in variables else path
    key = _keypath.join(parts)
    if value.get("skip_deserialize"):
      empty[key] = kind  # an empty node (None, {}, ()): nothing to read, part of the tree
      continue
    if kind not in ARRAY_TYPES:
      not_read[key] = kind
      continue
    name = ".".join(path)
    leaves.append(Leaf(key, path, name, kind, prng.get(name), path in variables))
  bad = _keypath.problems([leaf.key for leaf in leaves])
  if bad:
    raise _errors.SourceFormatError(
      _lines([f"{file}: the tree path of {b}" for b in bad], "cannot name arrays")
    )
  return TreeMetadata(
    folder=folder,
    leaves=leaves,
    not_read=not_read,
    use_ocdbt=bool(data.get("use_ocdbt", fs.isfile(os.path.join(folder, _folders.OCDBT_MANIFEST)))),
    use_zarr3=bool(data.get("use_zarr3", False)),
    fill_missing=not data.get("store_array_data_equal_to_fill_value", False),
    sequences=sorted(sequences),
    empty=empty,
  )


def _json(fs: _files.Files, file: str, *, what: str) -> Any:
  if not fs.isfile(file):
    raise _errors.SourceFormatError(f"{file}: missing: the file that holds {what}")
  try:
    return json.loads(fs.read(file))
  except (OSError, ValueError) as e:
    raise _errors.SourceFormatError(f"{file}: not readable JSON ({e})") from e


def _path(label: str, entry: Any) -> tuple[tuple[str, ...] | None, list[bool]]:
  """The leaf's path, and for each part whether it indexes a sequence."""
  keys = entry.get("key_metadata") if isinstance(entry, dict) else None
  if isinstance(keys, list) and keys and all(isinstance(k, dict) and "key" in k for k in keys):
    return tuple(str(k["key"]) for k in keys), [k.get("key_type") == _SEQUENCE for k in keys]
  try:  # metadata without key types: the label is the path tuple's repr
    parsed = ast.literal_eval(label)
  except (ValueError, SyntaxError):
    return None, []
  if not isinstance(parsed, tuple) or not parsed:
    return None, []
  return tuple(map(str, parsed)), [False] * len(parsed)


def _variables(paths: list[tuple[str, ...]]) -> set[tuple[str, ...]]:
  """The paths that end in an NNX Variable's `value`: the only child of their parent."""
  children: dict[tuple[str, ...], set[str]] = {}
  for path in paths:
    for i in range(1, len(path)):
      children.setdefault(path[:i], set()).add(path[i])
  return {
    p
    for p in paths
    if len(p) > 1 and p[-1] == VARIABLE_VALUE and children.get(p[:-1]) == {VARIABLE_VALUE}
  }


def _prng_impls(fs: _files.Files, folder: str) -> dict[str, str]:
  """Stored array name -> PRNG implementation, from every process's array metadata."""
  out = {}
  metadatas = os.path.join(folder, "array_metadatas")
  names = [n for n in fs.listdir(metadatas) if not n.startswith(".")] if fs.isdir(metadatas) else []
  for file in (os.path.join(metadatas, n) for n in names):
    data = _json(fs, file, what="the array metadata of one process")
    entries = data.get("array_metadatas") if isinstance(data, dict) else None
    for entry in entries if isinstance(entries, list) else []:
      meta = entry.get("array_metadata") if isinstance(entry, dict) else None
      ext = meta.get("ext_metadata") if isinstance(meta, dict) else None
      if isinstance(ext, dict) and ext.get("random_key_impl"):
        out[str(meta.get("param_name"))] = str(ext["random_key_impl"])
  return out


def _lines(problems: list[str], what: str = "not an Orbax checkpoint it can read") -> str:
  if len(problems) == 1:
    return problems[0]
  return f"{len(problems)} problems, {what}:\n" + _errors.bullet_list(problems)
