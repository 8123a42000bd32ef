"""safetensors files, read without the `safetensors` package and checked before any data is.

A file is an 8-byte little-endian header length N, N bytes of JSON naming each tensor's
dtype, shape and `[begin, end)` byte range in the data that follows, then the data. A
sharded checkpoint adds an index (`model.safetensors.index.json`, and the same for
`pytorch_model.bin`), whose `weight_map` names the file of each tensor. Every tensor comes
back as a read-only memory map of exactly its bytes: a read of a slice touches only the
pages under it.

The header is untrusted: its size is bounded by the file's, names must be unique, every
range must lie in the data, match its dtype and shape exactly, and no two may overlap. The
file is opened once (a regular file, never blocking) and mapped from that descriptor, so the
bytes read are those of the file whose header was checked.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import mmap
import os
from collections.abc import Callable, Iterator

import ml_dtypes
import numpy as np

from ucp_jax._errors import SourceFormatError, bullet_list
from ucp_jax.sources import _files
from ucp_jax.store._untrusted import open_regular

MAX_HEADER_BYTES = 100 << 20
"""The safetensors library's own bound on the JSON header."""
MAX_INDEX_BYTES = 100 << 20
"""The most an index (`*.index.json`) may hold."""

DTYPES = {
  "BOOL": np.dtype(np.bool_),
  "U8": np.dtype(np.uint8),
  "I8": np.dtype(np.int8),
  "U16": np.dtype("<u2"),
  "I16": np.dtype("<i2"),
  "U32": np.dtype("<u4"),
  "I32": np.dtype("<i4"),
  "U64": np.dtype("<u8"),
  "I64": np.dtype("<i8"),
  "F16": np.dtype("<f2"),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "F32": np.dtype("<f4"),
  "F64": np.dtype("<f8"),
  "C64": np.dtype("<c8"),
  "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
  "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
  "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
  "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
"""safetensors dtype names -> numpy (bfloat16 and the float8 types from ml_dtypes)."""

PACKED = {"F4": "4-bit floats, two per byte", "F6_E2M3": "6-bit floats", "F6_E3M2": "6-bit floats"}
"""safetensors dtypes whose elements are smaller than a byte: refused, by name."""

NAMES = {dtype: name for name, dtype in DTYPES.items()}
"""numpy dtype -> safetensors name, for writers."""

INDEX_SUFFIX = ".safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor of a safetensors file: where its bytes are and what they hold."""

  name: str
  dtype: np.dtype
  shape: tuple[int, ...]
  begin: int  # byte offset in the file (header included)
  end: int
  file: str

  @property
  def where(self) -> str:
    return f"{self.file}: tensor {self.name!r}"


@dataclasses.dataclass(frozen=True)
class SafetensorsFile:
  """A checked safetensors file: its tensors (in file order) and the header's metadata."""

  path: str
  tensors: dict[str, TensorInfo]
  metadata: dict[str, str]
  mapped: mmap.mmap | None = dataclasses.field(default=None, repr=False, compare=False)
  identity: tuple = ()  # (device, inode, size, mtime) of the file whose header was checked
  # (begin, end) -> those bytes, for a file on an object store (`read_remote_header`)
  fetch: Callable[[int, int], bytes] | None = dataclasses.field(default=None, compare=False)

  def array(self, name: str) -> np.ndarray:
    """The tensor `name` as a read-only memory map of its bytes (none read until used); on
    an object store, its bytes read by range."""
    info = self.tensors[name]
    if info.begin != info.end and self.fetch is not None:
      raw = self.fetch(info.begin, info.end)
      return np.frombuffer(raw, info.dtype).reshape(info.shape)
    if info.begin == info.end or self.mapped is None:
      return np.zeros(info.shape, info.dtype)
    count = math.prod(info.shape)
    return np.frombuffer(self.mapped, info.dtype, count, info.begin).reshape(info.shape)


def fail(where: str, what: str, problems: list[str]) -> None:
  """Raises one `SourceFormatError`: `where: what: problem` on one line, or a list."""
  if len(problems) == 1:
    raise SourceFormatError(f"{where}: {what}: {problems[0]}")
  if problems:
    raise SourceFormatError(f"{where}: {what}:\n{bullet_list(problems, 20)}")


def read_header(path: str) -> SafetensorsFile:
  """Reads and checks the header of one safetensors file, and maps the file.

  Raises:
    SourceFormatError: not a regular file, a header that is truncated, too large or not
      JSON, a duplicated name, an unknown dtype, or a byte range that overruns the file,
      does not match the shape, or overlaps another (one message per file, all problems;
      one line when there is one).
  """
  try:
    f = open_regular(path)
  except FileNotFoundError:
    raise SourceFormatError(f"{path}: no such file") from None
  with f:
    st = os.fstat(f.fileno())
    size, identity = st.st_size, file_identity(st)
    head = f.read(8)
    if len(head) < 8:
      raise SourceFormatError(f"{path}: not a safetensors file ({size} bytes, no header)")
    length = int.from_bytes(head, "little")
    if length > min(MAX_HEADER_BYTES, size - 8):
      raise SourceFormatError(
        f"{path}: not a safetensors file (its header claims {length} bytes; the file has {size})"
      )
    raw = f.read(length)
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
  return _checked(path, size, length, raw, identity, mapped)


def read_remote_header(folder, name: str) -> SafetensorsFile:
  """`read_header` for a file on an object store (a `_remote.Folder`): the header is read by
  byte range, and so are the tensors later, each from the same generation of the object."""
  path = folder.path(name)
  try:
    head, generation = folder.read(name, 0, 8)
  except SourceFormatError as e:
    if "past its end" not in str(e):
      raise
    raise SourceFormatError(f"{path}: not a safetensors file (no header)") from None
  length = int.from_bytes(head, "little")
  if length > MAX_HEADER_BYTES:
    raise SourceFormatError(
      f"{path}: not a safetensors file (its header claims {length} bytes, more than "
      f"{MAX_HEADER_BYTES})"
    )
  raw, _ = folder.read(name, 8, 8 + length, generation)
  file = _checked(
    path,
    None,
    length,
    raw,
    (generation,),
    None,
    lambda begin, end: folder.read(name, begin, end, generation)[0],
  )
  end = max((t.end for t in file.tensors.values()), default=0)
  if end > 8 + length:  # the data the header describes is all there
    try:
      folder.read(name, end - 1, end, generation)
    except SourceFormatError as e:
      if "past its end" not in str(e):
        raise
      raise SourceFormatError(
        f"{path}: the header puts tensor data up to byte {end}, past the end of the file: truncated"
      ) from None
  _files.note_size(path, max(end, 8 + length))
  return file


def _checked(path, size, length, raw, identity, mapped, fetch=None) -> SafetensorsFile:
  """The header `raw` (of `length` bytes, in a file of `size`, None where unknown) checked."""
  header, repeated = _json(raw, path, "the safetensors header")
  if not isinstance(header, dict):
    raise SourceFormatError(f"{path}: the safetensors header is not a JSON object")
  metadata = header.pop("__metadata__", None) or {}
  if not isinstance(metadata, dict):
    raise SourceFormatError(f"{path}: `__metadata__` is not a JSON object")
  problems = [
    f"tensor {k!r} appears twice" if k in header else f"the key {k!r} appears twice in an entry"
    for k in repeated
  ]
  start = 8 + length
  tensors = {}
  for name, entry in header.items():
    info = _tensor(path, name, entry, start, math.inf if size is None else size, problems)
    if info is not None:
      tensors[name] = info
  spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
  for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
    if begin < end:
      problems.append(
        f"tensors {first!r} and {second!r} overlap (both hold bytes [{begin}, {end}))"
      )
  fail(path, "a damaged or forged safetensors header", problems)
  ordered = dict(sorted(tensors.items(), key=lambda kv: kv[1].begin))
  metadata = {str(k): str(v) for k, v in metadata.items()}
  return SafetensorsFile(path, ordered, metadata, mapped, identity, fetch)


def file_identity(st: os.stat_result) -> tuple:
  """What tells a file from another put at its path since: device, inode, size, mtime."""
  return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _json(raw: bytes, path: str, what: str) -> tuple[object, list[str]]:
  """Parses JSON, noting every object key that appears twice (the last one would win)."""
  repeated: list[str] = []

  def pairs(items):
    seen = {}
    for key, value in items:
      if key in seen:
        repeated.append(key)
      seen[key] = value
    return seen

  try:
    return json.loads(raw, object_pairs_hook=pairs), repeated
  except (UnicodeDecodeError, ValueError) as e:
    raise SourceFormatError(f"{path}: {what} is not valid JSON: {e}") from None


def _tensor(path, name, entry, start, size, problems) -> TensorInfo | None:
  if not isinstance(entry, dict):
    problems.append(f"tensor {name!r}: not a tensor entry")
    return None
  kind = entry.get("dtype")
  dtype = DTYPES.get(kind) if isinstance(kind, str) else None
  shape, offsets = entry.get("shape"), entry.get("data_offsets")
  if dtype is None:
    why = f"packed {PACKED[kind]}" if kind in PACKED else "not a safetensors dtype"
    problems.append(f"tensor {name!r}: dtype {kind!r} ({why}) is not one ucp_jax reads")
    return None
  if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
    problems.append(f"tensor {name!r}: shape {shape!r} / data_offsets {offsets!r} are not sizes")
    return None
  begin, end = start + offsets[0], start + offsets[1]
  expected = math.prod(shape) * dtype.itemsize
  if not begin <= end <= size:
    problems.append(
      f"tensor {name!r}: data_offsets {offsets} put its bytes at [{begin}, {end}), outside the "
      f"file ({size} bytes): truncated or forged"
    )
  elif end - begin != expected:
    problems.append(
      f"tensor {name!r}: {end - begin} bytes for shape {list(shape)} of {kind} ({expected})"
    )
  else:
    return TensorInfo(name, dtype, tuple(shape), begin, end, path)
  return None


def _ints(value) -> bool:
  return isinstance(value, list) and all(
    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
  )


def read_index(path: str) -> dict[str, str]:
  """`weight_map` of a sharded checkpoint's index: tensor name -> shard file (absolute).

  Works for `model.safetensors.index.json` and `pytorch_model.bin.index.json` alike.

  Raises:
    SourceFormatError: not JSON, no `weight_map`, a name listed twice, a shard outside the
      folder, or a shard file that is missing (one line per shard, naming its tensors).
  """
  folder = os.path.dirname(os.path.abspath(path))
  try:
    with open_regular(path) as f:
      raw = f.read(MAX_INDEX_BYTES + 1)
  except FileNotFoundError:
    raise SourceFormatError(f"{path}: no such file") from None
  if len(raw) > MAX_INDEX_BYTES:
    raise SourceFormatError(f"{path}: an index larger than {MAX_INDEX_BYTES} bytes")
  weight_map, problems = parse_index(raw, path)
  out, by_shard = {}, {}
  for name, file in weight_map.items():
    by_shard.setdefault(file, []).append(name)
    out[name] = os.path.normpath(os.path.join(folder, file))
  for file, names in by_shard.items():
    full = os.path.normpath(os.path.join(folder, file))
    if os.path.dirname(full) != folder:
      problems.append(f"shard {file!r}, listed for tensor {_some(names)}, lies outside the folder")
    elif not os.path.isfile(full):
      problems.append(f"shard {file}, listed for tensor {_some(names)}, is missing")
  fail(path, "the index names shards that cannot be read", problems)
  return out


def parse_index(raw: bytes, path: str) -> tuple[dict[str, str], list[str]]:
  """(`weight_map` as written, problems so far) of an index's bytes."""
  index, repeated = _json(raw, path, "the index")
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
    raise SourceFormatError(f"{path}: no `weight_map` of tensor names to file names")
  return weight_map, [f"tensor {k!r} is listed twice" for k in repeated if k in weight_map]


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
  problems, seen = [], {}
  for file, names in found.items():
    shard = os.path.basename(file)
    for name in names:
      listed = weight_map.get(name)
      if name in seen:
        problems.append(f"tensor {name!r} is in both {os.path.basename(seen[name])} and {shard}")
      elif listed is None:
        problems.append(f"{shard} holds tensor {name!r}, which the index does not list")
      elif listed != file:
        problems.append(
          f"{shard} holds tensor {name!r}, which the index puts in {os.path.basename(listed)}"
        )
      seen.setdefault(name, file)
  problems += [
    f"tensor {n!r}: listed in the index for {os.path.basename(f)}, which does not hold it"
    for n, f in weight_map.items()
    if n not in seen
  ]
  fail(index_path, "the shards do not match the index", problems)


def read_remote_sharded(folder, index_name: str, names: list[str]) -> list[SafetensorsFile]:
  """`read_sharded` for a folder on an object store (a `_remote.Folder` holding `names`)."""
  where = folder.path(index_name)
  weight_map, problems = parse_index(folder.read_small(index_name, MAX_INDEX_BYTES), where)
  present = set(names)
  by_shard: dict[str, list[str]] = {}
  for name, file in weight_map.items():
    by_shard.setdefault(file, []).append(name)
  for file, names in by_shard.items():
    if "/" in file or file in ("", ".", ".."):
      problems.append(f"shard {file!r}, listed for tensor {_some(names)}, lies outside the folder")
    elif file not in present:
      problems.append(f"shard {file}, listed for tensor {_some(names)}, is missing")
  fail(where, "the index names shards that cannot be read", problems)
  files = [read_remote_header(folder, file) for file in sorted(by_shard)]
  full = {name: folder.path(file) for name, file in weight_map.items()}
  match_index(where, full, {f.path: list(f.tensors) for f in files})
  return files


def read_sharded(index_path: str) -> tuple[list[SafetensorsFile], dict[str, TensorInfo]]:
  """Every shard of an index, checked against it: each tensor where the index says."""
  weight_map = read_index(index_path)
  files = [read_header(f) for f in sorted(set(weight_map.values()))]
  match_index(index_path, weight_map, {f.path: list(f.tensors) for f in files})
  tensors = {name: info for f in files for name, info in f.tensors.items()}
  return files, tensors


def iter_files(folder: str) -> Iterator[str]:
  """The safetensors files of a folder, sorted."""
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      yield os.path.join(folder, name)


def _some(names: list[str]) -> str:
  shown = repr(names[0])
  return shown + (f" and {len(names) - 1} more" if len(names) > 1 else "")
