"""A DCP folder's `.metadata`, read with the safe reader and checked against the rank files.

`torch.distributed.checkpoint.save` (torch 2.13, `FileSystemWriter`) writes:

* `.metadata`: a plain pickle of `Metadata(state_dict_metadata, planner_data, storage_data,
  storage_meta, version)`. `state_dict_metadata` maps each flattened key (`model.h.0.fc.weight`,
  `optim.state.h.0.fc.weight.exp_avg`, `optim.param_groups.0.lr`) to a
  `TensorStorageMetadata(properties, size, chunks)` (each chunk `offsets`, `sizes`) or a
  `BytesStorageMetadata()` (any other object); `planner_data` maps the key to its path in the
  saved tree (`('optim', 'param_groups', 0, 'lr')`); `storage_data` maps
  `MetadataIndex(fqn, offset)` (one per chunk; `offset` None for bytes) to
  `_StorageInfo(relative_path, offset, length)`.
* `__R_N.distcp`: rank R's N-th file; every chunk and every object is a whole `torch.save`
  file (zip) at `[offset, offset + length)` of it.

The pickle's classes are never imported: the safe reader (`_torch_pickle`) turns them into
inert records, whose fields are read here and checked (types, printable keys, shapes, chunks
inside their tensor and tiling it without overlap or hole (`_tiling`, linear in the chunks),
each chunk's elements within its span) before any blob is read, and the rank files against
the spans (`_rank_files`: regular files inside the folder, spans inside them, none
overlapping, torch.save blobs); every problem is reported at once, one line each naming the
file and key (one problem: one line in all).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _files
from ucp_jax.sources._torch_reader import _pickle_limits, _torch_pickle
from ucp_jax.sources._torch_reader._pickle_records import Allowed, InertGlobal, InertObject
from ucp_jax.sources._torch_reader._torch_file import TorchDtype
from ucp_jax.sources.dcp import _rank_files, _tiling
from ucp_jax.store import _untrusted

METADATA = ".metadata"
VERSIONS = (None, "1.0.0")
"""DCP format versions read: torch 2.13's `CURRENT_DCP_VERSION`, and none (earlier torch)."""
_MODULE = "torch.distributed.checkpoint.metadata"
_STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"
MAX_NAME = 255
"""Characters of a rank file's name (a file name, as file systems allow)."""


@dataclasses.dataclass(frozen=True)
class Stored:
  """Where one `torch.save` blob lies: `length` bytes at `offset` of rank file `file`."""

  file: str
  offset: int
  length: int


@dataclasses.dataclass(frozen=True)
class Chunk:
  """A block of a tensor (`offsets`, `sizes` per dimension) and where it is stored."""

  offsets: tuple[int, ...]
  sizes: tuple[int, ...]
  stored: Stored


@dataclasses.dataclass(frozen=True)
class TensorEntry:
  """A tensor of the saved state: shape, dtype and the chunks that tile it."""

  key: str
  shape: tuple[int, ...]
  dtype: np.dtype
  chunks: tuple[Chunk, ...]


@dataclasses.dataclass(frozen=True)
class BytesEntry:
  """Any other object of the saved state (an int, a list of names), `torch.save`d whole."""

  key: str
  stored: Stored


@dataclasses.dataclass(frozen=True)
class Layout:
  """A DCP folder, checked.

  Attributes:
    folder: the folder.
    version: the DCP format version (`Metadata.version`).
    entries: flattened key -> its tensor or object.
    paths: flattened key -> its path in the saved tree (`planner_data`).
    files: the rank files the entries use, sorted.
  """

  folder: str
  version: str | None
  entries: dict[str, TensorEntry | BytesEntry]
  paths: dict[str, tuple]
  files: tuple[str, ...]


def read(folder: str, fs: _files.Files | None = None) -> Layout:
  """Reads and checks `folder/.metadata` (see the module docstring).

  Raises:
    SourceFormatError: the metadata is unreadable, of another DCP version, or does not
      describe the rank files beside it (every problem listed, with file and key; one line
      when there is one).
    UnsafePickleError: the metadata pickle asks for something that can run code.
  """
  fs = fs or _files.for_path(folder)
  path = os.path.join(folder, METADATA)
  meta = _load(path, fs)
  state = meta.state if isinstance(meta, InertObject) else None
  if (
    not isinstance(meta, InertObject)
    or meta.qualname != f"{_MODULE}.Metadata"
    or not isinstance(state, dict)
  ):
    shown = _name(meta)
    raise SourceFormatError(
      f"{path}: holds a {shown}, not torch.distributed.checkpoint's Metadata: not a DCP "
      "checkpoint of a known layout"
    )
  version = state.get("version")
  if type(version) not in (str, type(None)) or version not in VERSIONS:
    raise SourceFormatError(
      f"{path}: DCP format version {_shown(version)}; this reader knows "
      f"{', '.join(repr(v) for v in VERSIONS)} (torch 2.13 writes '1.0.0'): re-save it with "
      "a torch whose format it knows, or load it with that torch's dcp.load"
    )
  for name in ("state_dict_metadata", "storage_data"):
    if not isinstance(state.get(name), dict):
      raise SourceFormatError(
        f"{path}: Metadata.{name} is a {type(state.get(name)).__name__}, not a dict"
      )
  problems: list[str] = []
  storage = _storage_data(state["storage_data"], path, problems)
  _raise(folder, problems)  # a chunk without storage would only repeat these
  planner = state.get("planner_data")
  paths = planner if isinstance(planner, dict) else {}
  entries: dict[str, TensorEntry | BytesEntry] = {}
  budget = _tiling.Budget()
  for key, md in state["state_dict_metadata"].items():
    where = f"{path}: `{key}`"
    if not isinstance(key, str) or not key.isprintable():
      problems.append(f"{path}: state_dict_metadata key {_shown(key)} is not a printable string")
    elif _is(md, "BytesStorageMetadata"):
      stored = storage.get((key, None))
      if stored is None:
        problems.append(f"{where}: no storage_data entry (the object is stored nowhere)")
      else:
        entries[key] = BytesEntry(key, stored)
    elif _is(md, "TensorStorageMetadata"):
      entry = _tensor(key, md.state, storage, where, problems, budget)
      if entry is not None:
        entries[key] = entry
    else:
      problems.append(f"{where}: {_name(md)} is neither Tensor- nor BytesStorageMetadata")
  clean = {}
  for key, at in paths.items():
    if key not in entries:
      continue
    if not _path_of(key, at):
      problems.append(f"{path}: planner_data[`{key}`] is {_shown(at)}, not the key's path")
    clean[key] = at
  files = sorted({e.stored.file for e in _blobs(entries)})
  problems += _rank_files.check(folder, _spans(entries), fs)
  _raise(folder, problems)
  return Layout(folder, version, entries, clean, tuple(files))


def _path_of(key: str, at: Any) -> bool:
  """Whether `at` is a path in a saved tree (names and indices) that flattens to `key`."""
  return (
    isinstance(at, tuple)
    and all(type(p) in (str, int) for p in at)
    and ".".join(map(str, at)) == key
  )


def _raise(folder: str, problems: list[str]) -> None:
  _errors.raise_problems(SourceFormatError, f"{folder}: not a DCP checkpoint it can read", problems)


def _shown(value: Any) -> str:
  """`value` as a message shows it (a record of the pickle by its class name)."""
  if isinstance(value, InertObject | InertGlobal):
    return f"<{_name(value)}>"
  return _errors.shown(value)


def _load(path: str, fs: _files.Files) -> Any:
  extra = {
    ("torch", "Size"): Allowed("torch.Size", _size),
    ("pathlib", "PosixPath"): Allowed("pathlib.PosixPath", _path_parts),
  }
  try:
    if fs.remote and not fs.isfile(path):
      raise FileNotFoundError(path)
    if not fs.remote and os.path.isfile(path):  # (a special file: refused by what it is)
      _untrusted.check_inside(path, os.path.dirname(path))
    data = fs.read(path, _pickle_limits.MAX_PICKLE_BYTES)
  except FileNotFoundError:
    folder = os.path.dirname(path)
    if fs.isfile(os.path.join(folder, "__0" + METADATA)):
      raise SourceFormatError(
        f"{path}: missing, and __0{METADATA} is there: each rank's own metadata (a save "
        "without collectives), which this reader does not merge"
      ) from None
    raise SourceFormatError(
      f"{path}: missing: not a DCP checkpoint (dcp.save writes it last)"
    ) from None
  except OSError as e:
    raise SourceFormatError(f"{path}: cannot read it ({e.strerror or e})") from e
  return _torch_pickle.loads(data, source=path, extra_globals=extra)


def _size(sizes: Any = ()) -> tuple:
  if not isinstance(sizes, (tuple, list)):
    raise SourceFormatError(f"torch.Size({_shown(sizes)}): not a sequence")
  return tuple(sizes)


def _path_parts(*parts: Any) -> str:
  return "/".join(str(p) for p in parts if isinstance(p, str)).replace("//", "/")


def _is(obj: Any, name: str) -> bool:
  return isinstance(obj, InertObject) and obj.qualname == f"{_MODULE}.{name}"


def _name(obj: Any) -> str:
  if not isinstance(obj, InertObject | InertGlobal):
    return type(obj).__name__
  name = obj.qualname[:80]
  return name if name.isprintable() else repr(name)


def _storage_data(data: dict, path: str, problems: list) -> dict[tuple, Stored]:
  """storage_data as `(fqn, offsets or None) -> Stored`, each entry checked."""
  out: dict[tuple, Stored] = {}
  for index, info in data.items():
    fields = index.state if _is(index, "MetadataIndex") else None
    if not isinstance(fields, dict):
      problems.append(f"{path}: storage_data key {_shown(index)} is no MetadataIndex")
      continue
    fqn, offset = fields.get("fqn"), fields.get("offset")
    if not isinstance(fqn, str) or not fqn.isprintable():
      problems.append(
        f"{path}: storage_data key {_name(index)}: fqn {_shown(fqn)} is not a printable string"
      )
      continue
    if not (offset is None or _ints(offset)):
      problems.append(f"{path}: storage_data[`{fqn}`]: offset {_shown(offset)} is not a torch.Size")
      continue
    where = f"{path}: storage_data[`{fqn}`" + ("" if offset is None else f" at {offset}") + "]"
    got = info.state if isinstance(info, InertObject) and info.qualname == _STORAGE_INFO else None
    if not isinstance(got, dict):
      problems.append(f"{where}: a {_name(info)}, not a _StorageInfo")
      continue
    file, start, length = got.get("relative_path"), got.get("offset"), got.get("length")
    if got.get("transform_descriptors") is not None:
      problems.append(
        f"{where}: stored through stream transforms {_shown(got['transform_descriptors'])} "
        "(DCP extensions), which this reader does not undo"
      )
    elif not _plain_name(file) or not _ints((start, length)):
      problems.append(
        f"{where}: relative_path {_shown(file)}, offset {_shown(start)}, length "
        f"{_shown(length)}: expected a file name in the folder and two integers >= 0"
      )
    else:
      out[(fqn, offset)] = Stored(file, start, length)
  return out


def _plain_name(name: Any) -> bool:
  return (
    isinstance(name, str)
    and 0 < len(name) <= MAX_NAME
    and name not in (".", "..")
    and not any(c in name for c in ("/", "\\", "\0"))
  )


def _ints(values: Any) -> bool:
  return isinstance(values, tuple) and all(type(v) is int and v >= 0 for v in values)


def _tensor(
  key: str, fields: Any, storage: dict, where: str, problems: list, budget: _tiling.Budget
) -> TensorEntry | None:
  if not isinstance(fields, dict):
    problems.append(f"{where}: TensorStorageMetadata without fields")
    return None
  shape, chunks = fields.get("size"), fields.get("chunks")
  dtype = _dtype(fields.get("properties"))
  bad = []
  if dtype is None:
    bad.append(f"properties {_shown(fields.get('properties'))} name no dtype numpy has")
  shape_bad = _untrusted.shape_problem(shape, dtype.itemsize if dtype is not None else 1)
  if shape_bad or not isinstance(shape, tuple):
    bad.append(f"size: {shape_bad or 'not a torch.Size'}")
  if not isinstance(chunks, list):
    bad.append(f"chunks is a {type(chunks).__name__}, not a list")
  if bad:
    problems += [f"{where}: {b}" for b in bad]
    return None
  out = []
  for i, chunk in enumerate(chunks):
    got = chunk.state if _is(chunk, "ChunkStorageMetadata") else None
    offsets = got.get("offsets") if isinstance(got, dict) else None
    sizes = got.get("sizes") if isinstance(got, dict) else None
    if not _ints(offsets) or not _ints(sizes) or not len(offsets) == len(sizes) == len(shape):
      problems.append(f"{where}: chunk {i} ({_name(chunk)} {_shown(got)}) has no offsets and sizes")
      continue
    ends = tuple(o + s for o, s in zip(offsets, sizes))
    if any(e > n for e, n in zip(ends, shape)):
      problems.append(
        f"{where}: chunk at {_shown(offsets)} of sizes {_shown(sizes)} ends at {_shown(ends)}, "
        f"past the declared size {shape}"
      )
      continue
    stored = storage.get((key, offsets))
    if stored is None:
      problems.append(f"{where}: chunk at {_shown(offsets)} has no storage_data entry")
      continue
    nbytes = math.prod(sizes) * dtype.itemsize
    if stored.length < nbytes:
      problems.append(
        f"{where}: chunk at {_shown(offsets)} of sizes {_shown(sizes)} needs {nbytes} bytes of "
        f"{dtype}, and it is stored in {stored.length}: its file cannot hold it"
      )
      continue
    out.append(Chunk(offsets, sizes, stored))
  if len(out) == len(chunks):
    problems += [f"{where}: {p}" for p in _tiling.problems(shape, out, budget)]
  return TensorEntry(key, shape, dtype, tuple(out))


def _dtype(properties: Any) -> np.dtype | None:
  state = properties.state if _is(properties, "TensorProperties") else None
  if isinstance(state, dict):  # a TensorProperties pickled without its __getstate__
    state = (state.get("dtype"),)
  if not isinstance(state, tuple) or not state:
    return None
  dtype = state[0]
  if isinstance(dtype, InertGlobal) and dtype.qualname.startswith("torch."):
    dtype = TorchDtype(dtype.qualname.removeprefix("torch."))
  return dtype.numpy_dtype if isinstance(dtype, TorchDtype) else None


def _blobs(entries: dict) -> list:
  out = []
  for entry in entries.values():
    out += list(entry.chunks) if isinstance(entry, TensorEntry) else [entry]
  return out


def _spans(entries: dict) -> dict[str, list[tuple[str, str, Any]]]:
  """Rank file -> (key, what, blob) of every blob stored in it, in the order of the keys."""
  out: dict[str, list] = {}
  for key, entry in entries.items():
    for blob in _blobs({key: entry}):
      at = f" chunk at {_shown(blob.offsets)}" if isinstance(blob, Chunk) else ""
      out.setdefault(blob.stored.file, []).append((key, at, blob))
  return out
