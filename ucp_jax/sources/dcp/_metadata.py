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
inert records, whose fields are read here and checked (types, shapes, chunks inside their
tensor, tiling it without overlap or hole, spans inside existing rank files) before any rank
file is opened; every problem is reported at once, one line each naming the file and key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from ucp_jax._errors import SourceFormatError, bullet_list
from ucp_jax.sources import _files, _remote
from ucp_jax.sources.torch import _pickle_limits, _torch_pickle
from ucp_jax.sources.torch._pickle_records import Allowed, InertGlobal, InertObject
from ucp_jax.sources.torch._torch_file import TorchDtype
from ucp_jax.store import _untrusted

METADATA = ".metadata"
VERSIONS = (None, "1.0.0")
"""DCP format versions read: torch 2.13's `CURRENT_DCP_VERSION`, and none (earlier torch)."""
_MODULE = "torch.distributed.checkpoint.metadata"
_STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"


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
      describe the rank files beside it (every problem listed, with file and key).
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
    shown = meta.qualname if isinstance(meta, InertObject) else type(meta).__name__
    raise SourceFormatError(
      f"{path}: holds a {shown}, not torch.distributed.checkpoint's Metadata: not a DCP "
      "checkpoint of a known layout"
    )
  version = state.get("version")
  if version not in VERSIONS:
    raise SourceFormatError(
      f"{path}: DCP format version {version!r}; this reader knows "
      f"{', '.join(repr(v) for v in VERSIONS)} (torch 2.13 writes '1.0.0'): re-save it with "
      "a torch whose format it knows, or load it with that torch's dcp.load"
    )
  problems: list[str] = []
  sdm = _field(state, "state_dict_metadata", dict, path, problems)
  storage = _storage_data(_field(state, "storage_data", dict, path, problems), path, problems)
  planner = state.get("planner_data")
  paths = planner if isinstance(planner, dict) else {}
  entries: dict[str, TensorEntry | BytesEntry] = {}
  for key, md in (sdm or {}).items():
    where = f"{path}: `{key}`"
    if not isinstance(key, str):
      problems.append(f"{path}: state_dict_metadata key {key!r:.60} is not a string")
    elif _is(md, "BytesStorageMetadata"):
      stored = storage.get((key, None))
      if stored is None:
        problems.append(f"{where}: no storage_data entry (the object is stored nowhere)")
      else:
        entries[key] = BytesEntry(key, stored)
    elif _is(md, "TensorStorageMetadata"):
      entry = _tensor(key, md.state, storage, where, problems)
      if entry is not None:
        entries[key] = entry
    else:
      problems.append(f"{where}: {_name(md)} is neither Tensor- nor BytesStorageMetadata")
  files = sorted({e.stored.file for e in _blobs(entries)})
  problems += _check_files(folder, entries, files, fs)
  if problems:
    raise SourceFormatError(f"{folder}: not a DCP checkpoint it can read:\n{bullet_list(problems)}")
  clean = {k: tuple(v) for k, v in paths.items() if isinstance(v, tuple) and k in entries}
  return Layout(folder, version, entries, clean, tuple(files))


def _load(path: str, fs: _files.Files) -> Any:
  extra = {
    ("torch", "Size"): Allowed("torch.Size", _size),
    ("pathlib", "PosixPath"): Allowed("pathlib.PosixPath", _path_parts),
  }
  try:
    if fs.remote and not fs.isfile(path):
      raise FileNotFoundError(path)
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
    raise SourceFormatError(f"torch.Size({sizes!r:.60}): not a sequence")
  return tuple(sizes)


def _path_parts(*parts: Any) -> str:
  return "/".join(str(p) for p in parts).replace("//", "/")


def _is(obj: Any, name: str) -> bool:
  return isinstance(obj, InertObject) and obj.qualname == f"{_MODULE}.{name}"


def _name(obj: Any) -> str:
  return obj.qualname if isinstance(obj, InertObject) else type(obj).__name__


def _field(state: dict, name: str, kind: type, path: str, problems: list) -> Any:
  value = state.get(name)
  if not isinstance(value, kind):
    problems.append(f"{path}: Metadata.{name} is a {type(value).__name__}, not a {kind.__name__}")
    return None
  return value


def _storage_data(data: dict | None, path: str, problems: list) -> dict[tuple, Stored]:
  """storage_data as `(fqn, offsets or None) -> Stored`, each entry checked."""
  out: dict[tuple, Stored] = {}
  for index, info in (data or {}).items():
    fields = index.state if _is(index, "MetadataIndex") else None
    fqn = fields.get("fqn") if isinstance(fields, dict) else None
    offset = fields.get("offset") if isinstance(fields, dict) else None
    if not isinstance(fqn, str) or not (offset is None or _ints(offset)):
      problems.append(f"{path}: storage_data key {_name(index)} {fields!r:.80} is no MetadataIndex")
      continue
    where = f"{path}: storage_data[`{fqn}`" + ("" if offset is None else f" at {offset}") + "]"
    got = info.state if isinstance(info, InertObject) and info.qualname == _STORAGE_INFO else None
    if not isinstance(got, dict):
      problems.append(f"{where}: a {_name(info)}, not a _StorageInfo")
      continue
    file, start, length = got.get("relative_path"), got.get("offset"), got.get("length")
    if got.get("transform_descriptors"):
      problems.append(
        f"{where}: stored through stream transforms {got['transform_descriptors']!r:.60} "
        "(DCP extensions), which this reader does not undo"
      )
    elif not _plain_name(file) or not _ints((start, length)):
      problems.append(
        f"{where}: relative_path {file!r:.60}, offset {start!r:.20}, length {length!r:.20}: "
        "expected a file name in the folder and two integers >= 0"
      )
    else:
      out[(fqn, offset)] = Stored(file, start, length)
  return out


def _plain_name(name: Any) -> bool:
  return (
    isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name
  )


def _ints(values: Any) -> bool:
  return isinstance(values, tuple) and all(type(v) is int and v >= 0 for v in values)


def _tensor(key: str, fields: Any, storage: dict, where: str, problems: list) -> TensorEntry | None:
  if not isinstance(fields, dict):
    problems.append(f"{where}: TensorStorageMetadata without fields")
    return None
  shape, chunks = fields.get("size"), fields.get("chunks")
  dtype = _dtype(fields.get("properties"))
  bad = []
  if not _ints(shape) or len(shape) > 64:
    bad.append(f"size {shape!r:.60} is not a torch.Size")
  if dtype is None:
    bad.append(f"properties {fields.get('properties')!r:.80} name no dtype numpy has")
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
      problems.append(f"{where}: chunk {i} ({_name(chunk)} {got!r:.80}) has no offsets and sizes")
      continue
    ends = tuple(o + s for o, s in zip(offsets, sizes))
    if any(e > n for e, n in zip(ends, shape)):
      problems.append(
        f"{where}: chunk at {offsets} of sizes {sizes} ends at {ends}, past the declared "
        f"size {shape}"
      )
      continue
    stored = storage.get((key, offsets))
    if stored is None:
      problems.append(f"{where}: chunk at {offsets} has no storage_data entry")
      continue
    out.append(Chunk(offsets, sizes, stored))
  if len(out) == len(chunks):
    problems += [f"{where}: {p}" for p in _tiling(shape, out)]
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


def _tiling(shape: tuple[int, ...], chunks: list[Chunk]) -> list[str]:
  """Overlaps and holes among chunks that all lie inside `shape`."""
  if not chunks and math.prod(shape):
    return ["no chunks: the tensor is stored nowhere"]
  problems = []
  live = [c for c in chunks if math.prod(c.sizes)]
  order = sorted(live, key=lambda c: c.offsets[:1])
  for i, a in enumerate(order):  # a sweep along dimension 0: compare only chunks that meet there
    for b in order[i + 1 :]:
      if shape and b.offsets[0] >= a.offsets[0] + a.sizes[0]:
        break
      if all(
        max(x, y) < min(x + n, y + m) for x, n, y, m in zip(a.offsets, a.sizes, b.offsets, b.sizes)
      ):
        problems.append(
          f"chunks at {a.offsets} (sizes {a.sizes}) and {b.offsets} (sizes {b.sizes}) overlap"
        )
  if not problems:
    held = sum(math.prod(c.sizes) for c in live)
    if held != math.prod(shape):
      problems.append(
        f"chunks cover {held} of its {math.prod(shape)} elements: holes{_holes(shape, live)}"
      )
  return problems


def _holes(shape: tuple[int, ...], chunks: list[Chunk]) -> str:
  """Where along dimension 0 nothing is stored, when every chunk spans the other dimensions."""
  if not shape or any(c.sizes[1:] != shape[1:] for c in chunks):
    return ""
  gaps, at = [], 0
  for c in sorted(chunks, key=lambda c: c.offsets[0]):
    if c.offsets[0] > at:
      gaps.append(f"[{at}, {c.offsets[0]})")
    at = max(at, c.offsets[0] + c.sizes[0])
  if at < shape[0]:
    gaps.append(f"[{at}, {shape[0]})")
  return f" at rows {', '.join(gaps)}" if gaps else ""


def _blobs(entries: dict) -> list:
  out = []
  for entry in entries.values():
    out += list(entry.chunks) if isinstance(entry, TensorEntry) else [entry]
  return out


def _check_files(folder: str, entries: dict, files: list[str], fs: _files.Files) -> list[str]:
  """Each rank file exists, is a regular file, and holds the spans stored in it."""
  users: dict[str, list[str]] = {}
  for key, entry in entries.items():
    for name in dict.fromkeys(b.stored.file for b in _blobs({key: entry})):
      users.setdefault(name, []).append(key)
  if fs.remote:
    return _check_objects(folder, entries, users, fs)
  problems = []
  sizes = {}
  for name in files:
    full = os.path.join(folder, name)
    keys = users[name]
    shown = _some(keys)
    try:
      with _untrusted.open_regular(full) as f:
        sizes[name] = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
      problems.append(
        f"{full}: missing (a rank file; {len(keys)} entries are stored in it: {shown})"
      )
    except (OSError, SourceFormatError) as e:
      problems.append(f"{full}: unreadable ({getattr(e, 'strerror', None) or e}); it holds {shown}")
  for key, entry in entries.items():
    for blob in _blobs({key: entry}):
      stored = blob.stored
      size = sizes.get(stored.file)
      if size is not None and stored.offset + stored.length > size:
        at = f" chunk at {blob.offsets}" if isinstance(blob, Chunk) else ""
        problems.append(
          f"{os.path.join(folder, stored.file)}: `{key}`{at} is stored at bytes "
          f"{stored.offset}..{stored.offset + stored.length}, past the end of the file ({size} "
          "bytes): truncated?"
        )
  return problems


def _some(keys: list[str]) -> str:
  return ", ".join(f"`{k}`" for k in keys[:3]) + (" ..." if len(keys) > 3 else "")


def _check_objects(
  folder: str, entries: dict, users: dict[str, list[str]], fs: _files.Files
) -> list[str]:
  """`_check_files` on an object store, where sizes are not listed: each rank file's last
  stored byte is read (one small request per file)."""
  ends: dict[str, int] = {}
  for blob in _blobs(entries):
    stored = blob.stored
    ends[stored.file] = max(ends.get(stored.file, 0), stored.offset + stored.length)
  problems = []
  objects = _remote.Folder.at(folder)
  for name, keys in users.items():
    full = os.path.join(folder, name)
    if not fs.isfile(full):
      problems.append(
        f"{full}: missing (a rank file; {len(keys)} entries are stored in it: {_some(keys)})"
      )
    elif ends[name]:
      try:
        objects.read(name, ends[name] - 1, ends[name])
        _files.note_size(full, ends[name])
      except SourceFormatError:
        problems.append(
          f"{full}: shorter than the {ends[name]} bytes its entries are stored in ({_some(keys)}): "
          "truncated?"
        )
  return problems
