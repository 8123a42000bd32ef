"""safetensors files, read without the `safetensors` package and checked before any data is.

A file is an 8-byte little-endian header length N, N bytes of JSON naming each tensor's
dtype, shape and `[begin, end)` byte range in the data that follows, then the data. A
sharded checkpoint adds `*.safetensors.index.json`, whose `weight_map` names the file of
each tensor. Every tensor comes back as a read-only memory map of its bytes: a read of a
slice touches only the pages under it.

The header is untrusted: its size is bounded by the file's, names must be unique, every
range must lie in the data, match its dtype and shape exactly, and no two may overlap.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import mmap
import os
import stat
from collections.abc import Iterator

import ml_dtypes
import numpy as np

from ucp_jax._errors import SourceFormatError

MAX_HEADER_BYTES = 100 << 20
"""The safetensors library's own bound on the JSON header."""

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
  "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
"""safetensors dtype names -> numpy (bfloat16 and the float8 types from ml_dtypes)."""

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

  def array(self, name: str) -> np.ndarray:
    """The tensor `name` as a read-only memory map (no bytes read until used)."""
    info = self.tensors[name]
    if info.begin == info.end:
      return np.zeros(info.shape, info.dtype)
    mapped = _map(self.path)
    return np.frombuffer(mapped, info.dtype, math.prod(info.shape), info.begin).reshape(info.shape)


def read_header(path: str) -> SafetensorsFile:
  """Reads and checks the header of one safetensors file.

  Raises:
    SourceFormatError: not a regular file, a header that is truncated, too large or not
      JSON, a duplicated name, an unknown dtype, or a byte range that overruns the file,
      does not match the shape, or overlaps another (one message per file, all problems).
  """
  size = _regular_size(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise SourceFormatError(f"{path}: not a safetensors file ({size} bytes, no header)")
    length = int.from_bytes(head, "little")
    if length > min(MAX_HEADER_BYTES, size - 8):
      raise SourceFormatError(
        f"{path}: not a safetensors file (its header claims {length} bytes; the file has {size})"
      )
    raw = f.read(length)
  try:
    header = json.loads(raw, object_pairs_hook=_unique_keys)
  except (UnicodeDecodeError, ValueError) as e:
    raise SourceFormatError(f"{path}: the safetensors header is not valid JSON: {e}") from None
  if not isinstance(header, dict):
    raise SourceFormatError(f"{path}: the safetensors header is not a JSON object")
  metadata = header.pop("__metadata__", None) or {}
  if not isinstance(metadata, dict):
    raise SourceFormatError(f"{path}: `__metadata__` is not a JSON object")
  start = 8 + length
  tensors, problems = {}, []
  for name, entry in header.items():
    info = _tensor(path, name, entry, start, size, problems)
    if info is not None:
      tensors[name] = info
  spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
  for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
    if begin < end:
      problems.append(f"tensors {first!r} and {second!r} overlap")
  if problems:
    raise SourceFormatError(
      f"{path}: a damaged or forged safetensors header:\n"
      + "\n".join(f"  {p}" for p in problems[:20])
      + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
    )
  ordered = dict(sorted(tensors.items(), key=lambda kv: kv[1].begin))
  return SafetensorsFile(path, ordered, {str(k): str(v) for k, v in metadata.items()})


def _tensor(path, name, entry, start, size, problems) -> TensorInfo | None:
  if not isinstance(entry, dict):
    problems.append(f"{name!r}: not a tensor entry")
    return None
  dtype = DTYPES.get(entry.get("dtype"))
  shape, offsets = entry.get("shape"), entry.get("data_offsets")
  if dtype is None:
    problems.append(f"{name!r}: dtype {entry.get('dtype')!r} is not one ucp_jax reads")
    return None
  if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
    problems.append(f"{name!r}: shape {shape!r} / data_offsets {offsets!r} are not sizes")
    return None
  begin, end = start + offsets[0], start + offsets[1]
  expected = math.prod(shape) * dtype.itemsize
  if not begin <= end <= size:
    problems.append(f"{name!r}: bytes [{begin}, {end}) lie outside the file ({size} bytes)")
  elif end - begin != expected:
    problems.append(
      f"{name!r}: {end - begin} bytes for shape {list(shape)} of {entry['dtype']} ({expected})"
    )
  else:
    return TensorInfo(name, dtype, tuple(shape), begin, end, path)
  return None


def _ints(value) -> bool:
  return isinstance(value, list) and all(
    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
  )


def _unique_keys(pairs):
  seen = {}
  for key, value in pairs:
    if key in seen:
      raise ValueError(f"the name {key!r} appears twice")
    seen[key] = value
  return seen


def _regular_size(path: str) -> int:
  try:
    st = os.stat(path)
  except FileNotFoundError:
    raise SourceFormatError(f"{path}: no such file") from None
  if not stat.S_ISREG(st.st_mode):
    raise SourceFormatError(f"{path}: not a regular file")
  return st.st_size


_MAPS: dict[str, mmap.mmap] = {}


def _map(path: str) -> mmap.mmap:
  """One read-only mapping per file, shared by its tensors."""
  mapped = _MAPS.get(path)
  if mapped is None or mapped.closed:
    with open(path, "rb") as f:
      mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    _MAPS[path] = mapped
  return mapped


def read_index(path: str) -> dict[str, str]:
  """`weight_map` of a sharded checkpoint's index: tensor name -> shard file (absolute).

  Raises:
    SourceFormatError: not JSON, no `weight_map`, a shard outside the folder, or a shard
      file that is missing (all named).
  """
  folder = os.path.dirname(os.path.abspath(path))
  try:
    with open(path, "rb") as f:
      index = json.loads(f.read(MAX_HEADER_BYTES + 1), object_pairs_hook=_unique_keys)
  except (UnicodeDecodeError, ValueError) as e:
    raise SourceFormatError(f"{path}: not a valid safetensors index: {e}") from None
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
    raise SourceFormatError(f"{path}: no `weight_map` of tensor names to file names")
  out, problems = {}, []
  for name, file in weight_map.items():
    full = os.path.normpath(os.path.join(folder, file))
    if os.path.dirname(full) != folder:
      problems.append(f"{name!r}: shard {file!r} lies outside the folder")
    elif not os.path.isfile(full):
      problems.append(f"{name!r}: shard file {file} is missing")
    else:
      out[name] = full
  if problems:
    raise SourceFormatError(
      f"{path}: the index names shards that cannot be read:\n"
      + "\n".join(f"  {p}" for p in sorted(set(problems))[:20])
    )
  return out


def read_sharded(index_path: str) -> tuple[list[SafetensorsFile], dict[str, TensorInfo]]:
  """Every shard of an index, checked against it: each tensor where the index says."""
  weight_map = read_index(index_path)
  files = [read_header(f) for f in sorted(set(weight_map.values()))]
  tensors, problems = {}, []
  for file in files:
    for name, info in file.tensors.items():
      if name in tensors:
        problems.append(f"{name!r} is in both {tensors[name].file} and {file.path}")
      elif weight_map.get(name) != file.path:
        problems.append(f"{file.path}: {name!r} is not listed for this file in the index")
      tensors[name] = info
  problems += [
    f"{n!r}: listed in the index, not in {f}" for n, f in weight_map.items() if n not in tensors
  ]
  if problems:
    raise SourceFormatError(
      f"{index_path}: the shards do not match the index:\n"
      + "\n".join(f"  {p}" for p in problems[:20])
    )
  return files, tensors


def iter_files(folder: str) -> Iterator[str]:
  """The safetensors files of a folder, sorted."""
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      yield os.path.join(folder, name)
