"""The leaves of an Orbax pytree item, read from its metadata files.

`_METADATA` holds the tree: every leaf's path (`key_metadata`), its type (`jax.Array`,
`np.ndarray`, `scalar`, `string`, or an empty node to skip) and the storage options
(`use_ocdbt`, `use_zarr3`); `array_metadatas/process_N` hold the PRNG implementation of each
typed key. Each array is stored under its name, the path joined by `.`
(`model.l1.kernel.value`).

Keys are ucp_jax's own (`store._keypath.join` of the path), except that a Flax NNX
`Variable`, which Orbax stores as a node with the single child `value`, is looked through as
`ucp_jax.save` does: `model.l1.kernel.value` is the key `model/l1/kernel`.

Both files are untrusted: every field read is checked for its type, counts are limited
(`MAX_LEAVES`, `MAX_PATH_PARTS`), and each check is linear in what the files declare.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from typing import Any

from ucp_jax.base import _errors
from ucp_jax.sources import _files
from ucp_jax.sources.orbax import _folders
from ucp_jax.store import _keypath

ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
VARIABLE_VALUE = "value"
PRNG_KEY_SIZES = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}
"""The PRNG implementations JAX ships, and the uint32 words of one key of each."""
MAX_LEAVES = 100_000
"""The most entries `_METADATA` may list (each is an array to open: about 0.1 ms apiece;
training states of the largest models hold tens of thousands)."""
MAX_PATH_PARTS = 64
"""The deepest a leaf's path may be (training states nest under 20 levels)."""
MAX_TREE_METADATA_BYTES = 64 << 20
"""The most `_METADATA` may hold (about 300 bytes per leaf)."""
MAX_ARRAY_METADATA_BYTES = 64 << 20
"""The most one `array_metadatas/process_N` file may hold."""
MAX_ARRAY_METADATA_FILES = 65_536
"""The most files `array_metadatas/` may hold (one per process that saved)."""
_MAX_LABEL_CHARS = 64 << 10  # a path tuple's repr, parsed when `key_metadata` is absent
_SEQUENCE = 1  # Orbax's `KeyType.SEQUENCE` (2: a dict key or attribute)
_FLAGS = ("use_ocdbt", "use_zarr3", "store_array_data_equal_to_fill_value")


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

  @property
  def shown(self) -> str:
    """`name` as messages print it: on one line, control characters escaped."""
    return _errors.named(self.name)


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
  data = _folders.read_json(
    fs,
    file,
    folder,
    what="the tree of the checkpoint (every leaf's path and type)",
    max_bytes=MAX_TREE_METADATA_BYTES,
  )
  tree = data.get("tree_metadata") if isinstance(data, dict) else None
  if not isinstance(tree, dict):
    raise _errors.SourceFormatError(
      f"{file}: no `tree_metadata` object: not the metadata of an Orbax pytree checkpoint"
    )
  if len(tree) > MAX_LEAVES:
    raise _errors.SourceFormatError(
      f"{file}: {len(tree)} entries in `tree_metadata`, more than the {MAX_LEAVES} read"
    )
  flags = {}
  problems: list[tuple[str, str]] = []  # (what, what is wrong with it)
  for flag in _FLAGS:
    value = data.get(flag)
    if value is not None and not isinstance(value, bool):
      problems.append((f"`{flag}`", f"{_errors.shown(value)} is not true or false"))
    flags[flag] = value
  entries = []
  sequences: set[str] = set()
  for label, entry in tree.items():
    path, in_sequence, problem = _path(label, entry)
    value = entry.get("value_metadata") if isinstance(entry, dict) else None
    problem = problem or _value_problem(value)
    if problem:
      problems.append((f"entry {_errors.shown(label)}", problem))
      continue
    entries.append((path, value))
    sequences |= {_keypath.join(path[:i]) for i, s in enumerate(in_sequence) if s}
  if problems:
    raise _errors.SourceFormatError(_report(file, problems))
  variables = _variables([p for p, _ in entries])
  prng = _prng_impls(fs, folder)
  leaves, not_read, empty = [], {}, {}
  for path, value in entries:
    kind = value["value_type"]
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
  bad = [_split(text) for text in _keypath.problems([leaf.key for leaf in leaves])]
  bad += [(f"'{leaf.shown}'", p) for leaf in leaves for p in [_name_problem(leaf.name)] if p]
  bad += _duplicates(leaves)
  if bad:
    named = [(f"the tree path of {what}", problem) for what, problem in bad]
    raise _errors.SourceFormatError(_report(file, named, "cannot name arrays"))
  use_ocdbt = flags["use_ocdbt"]
  if use_ocdbt is None:
    use_ocdbt = _folders.present(fs, os.path.join(folder, _folders.OCDBT_MANIFEST))
  return TreeMetadata(
    folder=folder,
    leaves=leaves,
    not_read=not_read,
    use_ocdbt=use_ocdbt,
    use_zarr3=bool(flags["use_zarr3"]),
    fill_missing=not flags["store_array_data_equal_to_fill_value"],
    sequences=sorted(sequences),
    empty=empty,
  )


def _path(label: str, entry: Any) -> tuple[tuple[str, ...], list[bool], str | None]:
  """The leaf's path, for each part whether it indexes a sequence, and what is wrong (None
  when nothing is)."""
  if not isinstance(entry, dict):
    return (), [], "not an object with `key_metadata` and `value_metadata`"
  keys = entry.get("key_metadata")
  if keys is None:  # metadata without key types: the label is the path tuple's repr
    return _label_path(label)
  if not isinstance(keys, list) or not keys:
    return (), [], "`key_metadata` is not a list of path entries"
  if len(keys) > MAX_PATH_PARTS:
    return (), [], f"a path of {len(keys)} parts (at most {MAX_PATH_PARTS})"
  path, in_sequence = [], []
  for part in keys:
    name = part.get("key") if isinstance(part, dict) else None
    key_type = part.get("key_type") if isinstance(part, dict) else None
    if not isinstance(name, str):
      return (), [], "an entry of `key_metadata` without a string `key`"
    if key_type is not None and (isinstance(key_type, bool) or not isinstance(key_type, int)):
      return (), [], f"`key_type` {_errors.shown(key_type)} is not a number"
    path.append(name)
    in_sequence.append(key_type == _SEQUENCE)
  return tuple(path), in_sequence, None


def _label_path(label: str) -> tuple[tuple[str, ...], list[bool], str | None]:
  wrong = "no `key_metadata` list, and its label is not a path tuple"
  if len(label) > _MAX_LABEL_CHARS:
    return (), [], f"no `key_metadata` list, and a label of {len(label)} characters"
  try:
    parsed = ast.literal_eval(label)
  except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
    return (), [], wrong
  if not isinstance(parsed, tuple) or not parsed:
    return (), [], wrong
  if len(parsed) > MAX_PATH_PARTS:
    return (), [], f"a path of {len(parsed)} parts (at most {MAX_PATH_PARTS})"
  if not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in parsed):
    return (), [], wrong
  return tuple(map(str, parsed)), [False] * len(parsed), None


def _value_problem(value: Any) -> str | None:
  if not isinstance(value, dict):
    return "no `value_metadata` object"
  if not isinstance(value.get("value_type"), str):
    return "`value_type` is not a string"
  if not isinstance(value.get("skip_deserialize", False), bool):
    return "`skip_deserialize` is not true or false"
  return None


def _name_problem(name: str) -> str | None:
  """Why `name` cannot be the stored name of an array inside the item (None if it can).

  The name is a path below the item (Orbax keeps a `/` of a dict key), so none of its
  parts may be empty, `.` or `..`, and it may hold no NUL (no file name does).
  """
  if "\0" in name:
    return "a stored name holding a NUL character"
  if any(part in ("", ".", "..") for part in name.split("/")):
    return "a stored name that is not a relative path below the item (an empty, `.` or `..` part)"
  return None


def _duplicates(leaves: list[Leaf]) -> list[tuple[str, str]]:
  seen: dict[str, Leaf] = {}
  out = []
  for leaf in leaves:
    other = seen.setdefault(leaf.key, leaf)
    if other is not leaf:
      out.append((f"'{leaf.shown}'", f"the key {leaf.key!r} of another array, '{other.shown}'"))
  return out


def _split(problem: str) -> tuple[str, str]:
  """`_keypath.problems`' "'KEY': why" as ('KEY', why) (an encoded key holds no `: `)."""
  what, _, why = problem.partition(": ")
  return what, why


def _variables(paths: list[tuple[str, ...]]) -> set[tuple[str, ...]]:
  """The paths that end in an NNX Variable's `value`: the only child of their parent."""
  children: dict[tuple[str, ...], set[str]] = {}
  for path in paths:
    for i in range(1, len(path)):
      node = children.setdefault(path[:i], set())
      if len(node) < 2:  # only whether `value` is the only child matters
        node.add(path[i])
  return {
    p
    for p in paths
    if len(p) > 1 and p[-1] == VARIABLE_VALUE and children.get(p[:-1]) == {VARIABLE_VALUE}
  }


def _prng_impls(fs: _files.Files, folder: str) -> dict[str, str]:
  """Stored array name -> PRNG implementation, from every process's array metadata."""
  out: dict[str, str] = {}
  metadatas = os.path.join(folder, "array_metadatas")
  if not fs.isdir(metadatas):
    return out
  names = [n for n in fs.listdir(metadatas) if not n.startswith(".")]
  if len(names) > MAX_ARRAY_METADATA_FILES:
    raise _errors.SourceFormatError(
      f"{metadatas}: {len(names)} files, more than the {MAX_ARRAY_METADATA_FILES} read"
    )
  for file in (os.path.join(metadatas, n) for n in names):
    data = _folders.read_json(
      fs,
      file,
      folder,
      what="the array metadata of one process",
      max_bytes=MAX_ARRAY_METADATA_BYTES,
    )
    entries = data.get("array_metadatas") if isinstance(data, dict) else None
    if not isinstance(entries, list):
      raise _errors.SourceFormatError(f"{file}: no `array_metadatas` list: not Orbax's")
    for index, entry in enumerate(entries):
      found = _prng_entry(entry)
      if isinstance(found, str):
        raise _errors.SourceFormatError(f"{file}: `array_metadatas` entry {index}: {found}")
      if found is not None:
        out[found[0]] = found[1]
  return out


def _prng_entry(entry: Any) -> tuple[str, str] | str | None:
  """(stored name, PRNG implementation) of an entry of `array_metadatas` that holds a key,
  None for another array, or what is wrong with it."""
  meta = entry.get("array_metadata") if isinstance(entry, dict) else None
  if not isinstance(meta, dict):
    return "no `array_metadata` object"
  ext = meta.get("ext_metadata")
  if ext is None:
    return None
  if not isinstance(ext, dict):
    return "`ext_metadata` is not an object"
  impl = ext.get("random_key_impl")
  if impl is None:
    return None
  if not isinstance(impl, str) or impl not in PRNG_KEY_SIZES:
    known = ", ".join(PRNG_KEY_SIZES)
    return f"`random_key_impl` {_errors.shown(impl)} is not a PRNG implementation of JAX ({known})"
  name = meta.get("param_name")
  if not isinstance(name, str):
    return "`param_name` is not a string"
  return name, impl


def _report(
  file: str, problems: list[tuple[str, str]], what: str = "not an Orbax checkpoint it can read"
) -> str:
  """One line per distinct problem (`FILE: WHAT: WHY (and N more alike)`); several of them
  one line each below a heading."""
  by_problem: dict[str, list[str]] = {}
  for subject, problem in problems:
    by_problem.setdefault(problem, []).append(subject)
  lines = [
    f"{file}: {_errors.clipped(subjects[0])}: {problem}"
    + (f" (and {len(subjects) - 1} more alike)" if len(subjects) > 1 else "")
    for problem, subjects in by_problem.items()
  ]
  if len(lines) == 1:
    return lines[0]
  return f"{file}: {len(problems)} problems, {what}:\n" + _errors.bullet_list(lines)
