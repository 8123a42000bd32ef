"""safetensors files, read without the `safetensors` package and checked before any data is.

A file is an 8-byte little-endian header length N, N bytes of JSON naming each tensor's
dtype, shape and `[begin, end)` byte range in the data that follows, then the data. A
sharded checkpoint adds an index, whose `weight_map` names the file of each tensor
(`_shard_index` checks it). Every tensor comes back as a read-only memory map of exactly
its bytes: a read of a slice touches only the pages under it.

The header is untrusted: its size is bounded by the file's (and by `MAX_HEADER_BYTES`), its
JSON is checked for size, values (`check_values`) and depth before it is parsed
(`store._untrusted.loads_json`), names must be unique and valid Unicode, the tensors at most
`MAX_TENSORS`, shapes sizes an array can have, every range must lie in the data, match its
dtype and shape exactly, and no two may overlap (one sort: O(n log n) in the tensors
declared). The file is opened once (a regular file, never blocking, a link only if it stays
in the checkpoint's folder: `store._untrusted.check_inside`) and mapped from that
descriptor, so the bytes read are those of the file whose header was checked. Messages
never show bytes of a file that failed a check beyond the names and values its header
declares, shortened.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import mmap
import os
from collections.abc import Callable

import ml_dtypes
import numpy as np

from ucp_jax.base import _errors
from ucp_jax.base._errors import InsufficientMemoryError, SourceFormatError
from ucp_jax.sources import _files
from ucp_jax.store import _untrusted
from ucp_jax.store._untrusted import loads_json, open_regular

MAX_HEADER_BYTES = 100 << 20
"""The safetensors library's own bound on the JSON header."""
MAX_TENSORS = 1 << 16
"""The most tensors one safetensors file may declare (real shards hold a few thousand)."""
HEADER_DEPTH = 3
"""A header nests three deep: the header, a tensor entry, its shape."""
MAX_METADATA = 1 << 10
"""The most `__metadata__` entries a header may hold (writers put a few: `format`); they go
into the manifest."""
MAX_VALUES = 1 << 22
"""The most `,` and `:` a header or an index may hold: a bound, counted before parsing, on
the values a parser would build (a 100 MiB list of zeros is 50 million; 65,536 tensors of 32
dimensions about 2.6 million)."""
SHOWN = 5
"""Problems a message lists before `(and N more)`."""

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
      _untrusted.check_allocation(info.end - info.begin, info.where)
      raw = self.fetch(info.begin, info.end)
      return np.frombuffer(raw, info.dtype).reshape(info.shape)
    if info.begin == info.end or self.mapped is None:
      return np.zeros(info.shape, info.dtype)
    count = math.prod(info.shape)
    return np.frombuffer(self.mapped, info.dtype, count, info.begin).reshape(info.shape)


def fail(where: str, what: str, problems: list[str]) -> None:
  """Raises one `SourceFormatError` on one line: `where: what: problem; problem (and N more)`."""
  if problems:
    more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
    raise SourceFormatError(f"{where}: {what}: {'; '.join(problems[:SHOWN])}{more}")


def read_header(path: str, folder: str | None = None) -> SafetensorsFile:
  """Reads and checks the header of one safetensors file, and maps the file.

  Args:
    path: the file.
    folder: the checkpoint's folder (default: the file's): a link may not leave it.

  Raises:
    SourceFormatError: not a regular file, a link out of `folder`, a header that is
      truncated, too large or not JSON, a duplicated name, an unknown dtype, an impossible
      shape, or a byte range that overruns the file, does not match the shape, or overlaps
      another (one line per file, the first problems named).
    InsufficientMemoryError: the file is larger than the address space left to map it.
  """
  folder = folder or os.path.dirname(os.path.abspath(path))
  try:
    f = open_regular(path, inside=folder)
  except FileNotFoundError:
    raise SourceFormatError(f"{path}: no such file") from None
  with f:
    st = os.fstat(f.fileno())
    size, identity = st.st_size, file_identity(st)
    head = f.read(8)
    if len(head) < 8:
      raise SourceFormatError(f"{path}: not a safetensors file ({size} bytes, no header)")
    length = int.from_bytes(head, "little")
    if length > size - 8:  # the length is the file's bytes: not shown
      raise SourceFormatError(
        f"{path}: not a safetensors file (its header length runs past the end of the file, "
        f"{size} bytes): truncated, or another kind of file"
      )
    if length > MAX_HEADER_BYTES:
      raise SourceFormatError(
        f"{path}: a safetensors header longer than the {MAX_HEADER_BYTES} bytes the format allows"
      )
    raw = f.read(length)
    try:
      mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    except OSError as e:
      raise InsufficientMemoryError(
        f"{path}: cannot be memory-mapped ({e.strerror or e}): its {size} bytes need that much "
        "address space"
      ) from None
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
  if length > MAX_HEADER_BYTES:  # the length is the object's bytes: not shown
    raise SourceFormatError(
      f"{path}: not a safetensors file (its header length is more than the "
      f"{MAX_HEADER_BYTES} bytes the format allows)"
    )
  try:
    raw, _ = folder.read(name, 8, 8 + length, generation)
  except SourceFormatError as e:
    if "past its end" not in str(e):
      raise
    raise SourceFormatError(
      f"{path}: not a safetensors file (its header length runs past the end of the object): "
      "truncated, or another kind of file"
    ) from None
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
      cut = _untrusted.truncated(None, end, "the header puts tensor data up to there")
      raise SourceFormatError(f"{path}: {cut}") from None
  _files.note_size(path, max(end, 8 + length))
  return file


def _checked(path, size, length, raw, identity, mapped, fetch=None) -> SafetensorsFile:
  """The header `raw` (of `length` bytes, in a file of `size`, None where unknown) checked."""
  header, repeated = parse_json(
    raw, f"{path}: the safetensors header", HEADER_DEPTH, MAX_HEADER_BYTES
  )
  if not isinstance(header, dict):
    raise SourceFormatError(f"{path}: the safetensors header is not a JSON object")
  metadata = header.pop("__metadata__", None)
  metadata = {} if metadata is None else metadata
  if not isinstance(metadata, dict):
    raise SourceFormatError(f"{path}: `__metadata__` is not a JSON object")
  if len(metadata) > MAX_METADATA:
    raise SourceFormatError(
      f"{path}: `__metadata__` holds {len(metadata)} entries, more than the {MAX_METADATA} a "
      "header may hold"
    )
  if len(header) > MAX_TENSORS:
    raise SourceFormatError(
      f"{path}: the safetensors header declares {len(header)} tensors, more than the "
      f"{MAX_TENSORS} a file may hold"
    )
  problems = [
    f"tensor {_errors.shown(k)} appears twice"
    if k in header
    else f"the key {_errors.shown(k)} appears twice in an entry"
    for k in repeated
  ]
  problems += [
    f"`__metadata__` {_errors.shown(k)}: {_errors.shown(v)} is not a string"
    for k, v in metadata.items()
    if not isinstance(v, str)
  ]
  start = 8 + length
  tensors = {}
  past_end: list[int] = []  # where the tensors that lie past the end of the file end
  for name, entry in header.items():
    limit = math.inf if size is None else size
    info = _tensor(path, name, entry, start, limit, problems, past_end)
    if info is not None:
      tensors[name] = info
  if past_end:  # one cause, said once: the file was cut short (a copy or download stopped)
    cut = _untrusted.truncated(
      size, max(past_end), f"{len(past_end)} of {len(header)} tensors lie past its end"
    )
    if not problems:
      raise SourceFormatError(f"{path}: {cut}")
    problems.append(cut)
  spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
  for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
    if begin < end:
      problems.append(
        f"tensors {_errors.shown(first)} and {_errors.shown(second)} overlap (both hold bytes [{begin}, {end}))"
      )
  fail(path, "a damaged or forged safetensors header", problems)
  ordered = dict(sorted(tensors.items(), key=lambda kv: kv[1].begin))
  return SafetensorsFile(path, ordered, metadata, mapped, identity, fetch)


def file_identity(st: os.stat_result) -> tuple:
  """What tells a file from another put at its path since: device, inode, size, mtime."""
  return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_values(raw: bytes, where: str, limit: int = MAX_VALUES) -> None:
  """Refuses a JSON document with more than `limit` separators (`,` and `:`, inside strings
  too: an upper bound), before a parser builds millions of objects from a few MiB."""
  count = raw.count(b",") + raw.count(b":")
  if count > limit:
    raise SourceFormatError(
      f"{where}: more than {limit} values (it holds {count} separators); refusing to parse it"
    )


def parse_json(raw: bytes, where: str, depth: int, max_bytes: int) -> tuple[object, list[str]]:
  """Parses a JSON document (checked for size, values, depth, NaN and lone surrogates first),
  noting every object key that appears twice (the last one would win)."""
  if len(raw) <= max_bytes:  # else `loads_json` says how large it is
    check_values(raw, where)
  repeated: list[str] = []

  def pairs(items):
    seen = dict(items)
    if len(seen) != len(items):
      keys: set[str] = set()
      for key, _ in items:
        if key in keys:
          repeated.append(key)
        keys.add(key)
    return seen

  data = loads_json(raw, where, max_bytes=max_bytes, max_depth=depth, object_pairs_hook=pairs)
  return data, repeated


def _tensor(path, name, entry, start, size, problems, past_end) -> TensorInfo | None:
  if not isinstance(entry, dict):
    problems.append(f"tensor {_errors.shown(name)}: not a tensor entry")
    return None
  kind = entry.get("dtype")
  dtype = DTYPES.get(kind) if isinstance(kind, str) else None
  shape, offsets = entry.get("shape"), entry.get("data_offsets")
  if dtype is None:
    packed = isinstance(kind, str) and kind in PACKED
    why = f"packed {PACKED[kind]}" if packed else "not a safetensors dtype"
    problems.append(
      f"tensor {_errors.shown(name)}: dtype {_errors.shown(kind)} ({why}) is not one ucp_jax reads"
    )
    return None
  if not _ints(offsets) or len(offsets) != 2:
    problems.append(
      f"tensor {_errors.shown(name)}: data_offsets {_errors.shown(offsets)} are not two offsets"
    )
    return None
  problem = _untrusted.shape_problem(shape, dtype.itemsize)
  if problem:
    problems.append(f"tensor {_errors.shown(name)}: {problem}")
    return None
  begin, end = start + offsets[0], start + offsets[1]
  expected = math.prod(shape) * dtype.itemsize
  if not start <= begin <= end:
    problems.append(
      f"tensor {_errors.shown(name)}: data_offsets {_errors.shown(offsets)} put its bytes at [{begin}, {end}): "
      "not a range of the data"
    )
  elif end - begin != expected:
    problems.append(
      f"tensor {_errors.shown(name)}: {end - begin} bytes for shape {list(shape)} of {kind} ({expected})"
    )
  elif end > size:
    past_end.append(end)
  else:
    return TensorInfo(name, dtype, tuple(shape), begin, end, path)
  return None


def _ints(value) -> bool:
  return isinstance(value, list) and all(
    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
  )
