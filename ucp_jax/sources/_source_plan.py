"""What a source describes: parameters, slots, buffers and groups, still on disk.

A source (DeepSpeed ZeRO-1/2/3, DeepSpeed's universal folders, ...) reads only the small
metadata of its files and describes every logical array as the flat pieces that make it up:
memory-mapped views into the source files, in order. `_convert` then assembles one array at a
time, writes it and drops it, so host memory stays bounded by a few parameters.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import mmap
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources._byte_span import ByteSpan
from ucp_jax.sources._torch_reader._torch_file import InertObject, TorchDtype
from ucp_jax.store import _bundle, _keypath, _schema, _zarr
from ucp_jax.store._manifest import ArrayInfo, Manifest

Pieces = Callable[[], Sequence[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One logical array of the converted checkpoint, described by where its elements are.

  Attributes:
    shape: the logical shape.
    dtype: the element type, as found in the source (never converted).
    pieces: returns 1-D arrays whose concatenation, in order, is the array in C order
      (memory-mapped views where possible; may load a file on demand).
    where: the source file and key, for messages.
    file: `(path, byte offset, identity)` when the array's bytes are one C-order,
      little-endian run in a file (a safetensors tensor): a checkpoint view then reads each
      device's slice with `pread` straight into the buffer the device adopts, nothing mapped,
      from the same file whose header was checked (`identity`: device, inode, size, mtime).
    store: the array as an opened TensorStore, for a source whose files TensorStore reads
      (Orbax): a checkpoint view reads each slice from it, nothing whole (`pieces` still
      reads the whole array, for `convert`).
    info: `ArrayInfo` fields of a leaf that is not a plain array (`kind`: `scalar` with its
      `python_type`, or `prng_key` with its `prng_impl`), for `Plan.arrays`.
  """

  shape: tuple[int, ...]
  dtype: np.dtype
  pieces: Pieces
  where: str
  file: tuple[str, int, tuple] | None = None
  store: Any = None
  info: dict = dataclasses.field(default_factory=dict)

  @property
  def numel(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.numel * np.dtype(self.dtype).itemsize


def lazy_store(
  shape: tuple[int, ...],
  dtype,
  cells: Sequence[int],
  read: Callable[[tuple[slice, ...], np.ndarray], None],
):
  """A `Tensor.store`: a lazy TensorStore that fills each cell it reads (of shape `cells`,
  clipped at the edges) with `read(region, out)`."""
  import tensorstore as ts

  from ucp_jax.store import _location

  def read_cell(domain: ts.IndexDomain, out: np.ndarray, _params) -> None:
    read(tuple(slice(d.inclusive_min, d.exclusive_max) for d in domain), out)

  global _CELL_CONTEXT
  if _CELL_CONTEXT is None:  # devices whose slices share a cell read it once (it is cached)
    # `read` blocks the thread TensorStore calls it on: its own executor, so that a cell
    # waiting on an object store's answer never holds a thread that the answer needs
    _CELL_CONTEXT = ts.Context(
      {
        "cache_pool": {"total_bytes_limit": CELL_CACHE_BYTES},
        "data_copy_concurrency": {"limit": CELL_READS},
      },
      parent=_location.context(),
    )
  layout = ts.ChunkLayout(read_chunk_shape=[max(1, c) for c in cells]) if shape else None
  return ts.virtual_chunked(
    read_cell,
    dtype=ts.dtype(np.dtype(dtype).name),
    shape=shape,
    chunk_layout=layout,
    context=_CELL_CONTEXT,
  )


ROWS_BYTES = 4 << 20
"""A lazy array's cells by default: whole rows, about this many bytes (a device's slice
reads its rows, not much around them)."""


def row_cells(shape: Sequence[int], dtype) -> tuple[int, ...]:
  """Cells of whole rows, about `ROWS_BYTES` each, for a lazy array of `shape`."""
  row = max(1, int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize)
  return (max(1, ROWS_BYTES // row), *shape[1:]) if len(shape) else ()


def lazy_tensor(
  shape: Sequence[int],
  dtype,
  read: Callable[[tuple[slice, ...], np.ndarray], None],
  *,
  where: str,
  cells: Sequence[int] | None = None,
) -> Tensor:
  """A `Tensor` read by region, for a source that can read any part of an array.

  `read(region, out)` fills `out` (a C-contiguous array of `dtype`, of the region's shape)
  with the elements of `region` (one `slice(start, stop)` per axis). A restore or a view
  reads each device's slice through it, a cell at a time (`cells`, default whole rows of
  about `ROWS_BYTES`), possibly from several threads at once; `convert` reads the whole
  array in one call.

  Example:
    >>> import numpy as np
    >>> data = np.arange(12.0).reshape(3, 4)
    >>> t = lazy_tensor((3, 4), "float64", lambda r, out: out.__setitem__(..., data[r]),
    ...                 where="example")
    >>> t.store[1:, :2].read().result()
    array([[4., 5.],
           [8., 9.]])
  """
  shape = tuple(int(n) for n in shape)
  dtype = np.dtype(dtype)

  def whole() -> list[np.ndarray]:
    out = np.empty(shape, dtype)
    read(tuple(slice(0, n) for n in shape), out)
    return [out.reshape(-1)]

  store = lazy_store(shape, dtype, cells or row_cells(shape, dtype), read)
  return Tensor(shape, dtype, whole, where, store=store)


CELL_READS = 16
"""Cells of lazy source arrays read at once (each may wait on an object store)."""
CELL_CACHE_BYTES = 64 << 20
"""Memory the cells of lazy source arrays may hold at once, so that the devices of a restore
whose slices share a cell read it once (each array opened anew: none sees an older file's)."""
_CELL_CONTEXT: Any = None  # a ts.Context, made on first use


def fixed(pieces: Sequence[np.ndarray]) -> Pieces:
  """A `Tensor.pieces` that returns pieces already at hand."""
  held = tuple(pieces)
  return lambda: held


@dataclasses.dataclass(frozen=True)
class SourceParam:
  """A parameter: its value (fp32 master where one exists) and optimizer slots.

  A frozen parameter has a value and no slots; a tied parameter has neither and names the
  parameter that holds its data in `tied_to`.
  """

  name: str
  value: Tensor | None
  slots: dict[str, Tensor] = dataclasses.field(default_factory=dict)
  group: int | None = None
  frozen: bool = False
  tied_to: str | None = None
  pattern: dict | None = None  # TP/PP/EP layout of the source (_patterns.Pattern.to_json())
  shard_shape: tuple[int, ...] | None = None  # chunk alignment: the source's shard blocks


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """A converted checkpoint before any data is read (what a source's `describe` returns).

  A source of a training state fills `params` (with their optimizer slots), `buffers`,
  `optimizer` and `extra`, which make the schema of docs/schema.md; a source of plain
  arrays fills `arrays` alone. Only `path` is required.

  Attributes:
    params: every parameter, in the source's flat order (optimized, then frozen, then tied).
    buffers: persistent buffers by name.
    optimizer: the schema's `optimizer` entry (`type`, `step`, `groups`); None for weights alone.
    extra: the schema's `extra` entry (steps, scheduler, config, source layout).
    source: the manifest's `source` entry.
    step: the training step recorded in the manifest.
    path: the folder or file actually read (DeepSpeed: the tag folder), for the report.
    format: the source's name for what it read (`deepspeed`, `deepspeed_universal`, `hf`,
      `torch`, `orbax`).
    arrays: arrays kept at their own keys, for a source that stores a pytree (Orbax: each
      leaf at its tree path); with no `params` and `buffers`, `schema` is the manifest's.
    schema: the manifest's schema for a plan of `arrays` alone (it names their keys), or None.
    max_growth: how many times the bytes of its files the arrays may take (`convert` refuses
      more: tensors aliasing each other, a decompression bomb); None for `MAX_GROWTH`.
    source_bytes: for a source on an object store (whose listings give no sizes), the bytes
      its readers saw its files hold; None where they read none themselves (Orbax's arrays,
      which TensorStore reads and checks chunk by chunk against their metadata).
      Compressed sources set the bound of their codec.
  """

  params: list[SourceParam] = dataclasses.field(default_factory=list)
  buffers: dict[str, Tensor] = dataclasses.field(default_factory=dict)
  optimizer: _schema.Optimizer | None = None
  extra: dict = dataclasses.field(default_factory=dict)
  source: dict = dataclasses.field(default_factory=dict)
  step: int | None = None
  path: str
  format: str = ""
  arrays: dict[str, Tensor] = dataclasses.field(default_factory=dict)
  schema: _schema.Schema | None = None
  max_growth: float | None = None
  source_bytes: int | None = None


def number(value: Any) -> int | float:
  """A Python number from a 0-d array or scalar: an int when it is integral (steps)."""
  if isinstance(value, (np.ndarray, np.generic, ByteSpan)):
    value = np.asarray(value).item()
  if isinstance(value, float) and value.is_integer():
    return int(value)
  return value


def jsonable(obj: Any, *, max_list: int = 1024) -> Any:
  """`obj` as JSON data: tuples as lists, arrays as lists (or a shape/dtype note when large),
  non-finite floats as strings, records of unknown classes as `{"__class__": ..., ...}`."""
  if obj is None or isinstance(obj, (bool, int, str)):
    return obj
  if isinstance(obj, float):
    return obj if math.isfinite(obj) else str(obj)
  if isinstance(obj, np.generic):
    return jsonable(obj.item(), max_list=max_list)
  if isinstance(obj, ByteSpan) and (obj.ndim == 0 or obj.size <= max_list):
    obj = obj.read()  # a small tensor of a file on an object store
  if isinstance(obj, (np.ndarray, ByteSpan)):
    if obj.ndim == 0 or obj.size <= max_list:
      held = np.asarray(obj)
      return jsonable(held.astype(np.float64).tolist() if held.dtype.kind == "V" else held.tolist())
    return {"__array__": {"shape": list(obj.shape), "dtype": str(obj.dtype)}}
  if isinstance(obj, dict):
    return {str(k): jsonable(v, max_list=max_list) for k, v in obj.items()}
  if isinstance(obj, (list, tuple, set, frozenset)):
    return [jsonable(v, max_list=max_list) for v in obj]
  if isinstance(obj, TorchDtype):
    return str(obj)
  if isinstance(obj, InertObject):
    out: dict[str, Any] = {"__class__": obj.qualname}
    for name in ("args", "kwargs", "state"):
      value = getattr(obj, name)
      if value not in (None, ()):
        out[name] = jsonable(value, max_list=max_list)
    return out
  return repr(obj)


def release(arrays: Sequence[np.ndarray]) -> None:
  """Drops the memory-mapped pages behind `arrays` from this process (`MADV_DONTNEED`).

  The pages stay in the page cache and fault back in if read again; the process's resident
  memory no longer grows with every source byte read. A no-op for arrays not backed by a
  `mmap` and where `madvise` is unavailable.
  """
  advice = getattr(mmap, "MADV_DONTNEED", None)
  if advice is None:
    return
  for array in arrays:
    mapping = _mapping(array)
    if mapping is None or array.nbytes == 0:
      continue
    origin = np.frombuffer(mapping, np.uint8, 1).__array_interface__["data"][0]
    start = array.__array_interface__["data"][0] - origin
    end = min(len(mapping), start + array.nbytes)
    start -= start % mmap.PAGESIZE
    if 0 <= start < end:
      mapping.madvise(advice, start, end - start)


def _mapping(array: np.ndarray) -> mmap.mmap | None:
  base: Any = array
  while isinstance(base, np.ndarray):
    base = base.base
  if isinstance(base, memoryview):
    base = base.obj
  return base if isinstance(base, mmap.mmap) and not base.closed else None


def _stored_as(tensor: Tensor, shard, bundle_bytes: int | None, **fields) -> ArrayInfo:
  """How a converted tensor is stored: chunks aligned to the shards the source split it
  into, if any, so that restoring onto that split reads each shard's own bytes; bundles as
  large as one writer's (the whole array, up to the bundle limit)."""
  dtype = np.dtype(tensor.dtype)
  chunks = _zarr.choose_chunks(tensor.shape, shard or tensor.shape, dtype.itemsize)
  bundle = _bundle.choose(tensor.shape, tensor.shape, chunks, dtype.itemsize, bundle_bytes)
  return ArrayInfo(tensor.shape, _zarr.zarr_dtype(dtype), chunks, bundle=bundle, **fields)


def layout(
  plan: Plan, bundle_bytes: int | None = _bundle.BUNDLE_BYTES
) -> tuple[dict[str, tuple[ArrayInfo, Tensor]], _schema.Schema | None]:
  """The arrays of the plan by checkpoint key, in write order, and the manifest's schema.

  `params/NAME` holds each parameter's value, `SLOT/NAME` its optimizer slots
  (`exp_avg/NAME`, ...), `buffers/NAME` the buffers; the schema names them (docs/schema.md).
  """
  jobs: dict[str, tuple[ArrayInfo, Tensor]] = {}

  def add(prefix: str, name: str, tensor: Tensor, role: str, shard=None) -> str:
    key = _keypath.join([prefix, name])
    jobs[key] = (_stored_as(tensor, shard, bundle_bytes, role=role), tensor)
    return key

  values: dict[str, str] = {}
  slots: dict[str, dict[str, str]] = {}
  for p in plan.params:
    if p.value is not None:
      values[p.name] = add("params", p.name, p.value, "value", p.shard_shape)
    slots[p.name] = {slot: add(slot, p.name, t, slot, p.shard_shape) for slot, t in p.slots.items()}
  entries = {  # a tied parameter points at the key that holds its data
    p.name: _schema.ParamEntry(
      value=values.get(p.name if p.tied_to is None else p.tied_to),
      slots=slots[p.name],
      group=p.group,
      frozen=p.frozen,
      tied_to=p.tied_to,
      pattern=p.pattern,  # how the source split it over TP/PP/EP ranks (_patterns)
    )
    for p in plan.params
  }
  buffers = {name: add("buffers", name, t, "buffer") for name, t in plan.buffers.items()}
  for key, tensor in plan.arrays.items():  # a pytree's leaves, at their own keys
    jobs[key] = (_stored_as(tensor, None, bundle_bytes, **tensor.info), tensor)
  if plan.arrays and not plan.params and not plan.buffers:
    return jobs, plan.schema
  schema = _schema.Schema(entries, buffers, plan.optimizer, naming="torch", extra=plan.extra)
  return jobs, schema


def assemble(tensor: Tensor) -> tuple[np.ndarray, list[np.ndarray]]:
  """The logical array from its pieces (a view when it is one piece), and the pieces."""
  pieces = list(tensor.pieces())
  dtype = np.dtype(tensor.dtype)
  held = sum(p.size for p in pieces)
  bad = sorted({str(p.dtype) for p in pieces if p.dtype != dtype or p.ndim != 1})
  if held != tensor.numel or bad:
    raise SourceFormatError(
      f"{tensor.where}: its pieces hold {held} elements"
      + (f" of {bad}" if bad else "")
      + f"; expected {tensor.numel} of {dtype} for shape {tensor.shape}"
    )
  if not pieces:
    return np.zeros(tensor.shape, dtype), pieces
  if any(isinstance(p, ByteSpan) for p in pieces):
    return _fetched(pieces, dtype).reshape(tensor.shape), pieces
  data = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
  return data.reshape(tensor.shape), pieces


def _fetched(pieces: Sequence[Any], dtype: np.dtype) -> np.ndarray:
  """The concatenated pieces, those located in files on an object store (`ByteSpan`s) fetched
  straight into place, several requests in flight at once."""
  out = np.empty(sum(p.size for p in pieces), dtype)
  starts = np.cumsum([0, *(p.size for p in pieces)])
  _fill(pieces, [out[a:b] for a, b in itertools.pairwise(starts)])
  return out


def read_pieces(pieces: Sequence[Any]) -> list[np.ndarray]:
  """`pieces` as arrays: those located in files on an object store (`ByteSpan`s) fetched,
  the requests of all of them in flight together."""
  outs = [np.empty(p.shape, p.dtype) if isinstance(p, ByteSpan) else p for p in pieces]
  located = [i for i, p in enumerate(pieces) if isinstance(p, ByteSpan)]
  _fill([pieces[i] for i in located], [outs[i] for i in located])
  return outs


def _fill(pieces: Sequence[Any], outs: Sequence[np.ndarray]) -> None:
  """Copies each piece into its C-contiguous `out`; a located one's blocks are requested on
  the pool of range requests, all at once."""
  from ucp_jax.sources import _remote

  tasks = []
  for piece, out in zip(pieces, outs):
    if isinstance(piece, ByteSpan) and piece.contiguous:
      tasks += piece.read_into(out, _remote.submit)
    else:
      out[...] = np.asarray(piece).reshape(out.shape)
  for task in tasks:
    task.result()


def manifest_of(
  plan: Plan, bundle_bytes: int | None = _bundle.BUNDLE_BYTES
) -> tuple[Manifest, dict[str, Tensor]]:
  """The manifest a conversion of `plan` writes (bundles of at most `bundle_bytes`), and the
  tensor behind each of its arrays."""
  jobs, schema = layout(plan, bundle_bytes)
  arrays = {key: info for key, (info, _) in jobs.items()}
  manifest = Manifest(
    arrays=arrays,
    tree=_keypath.structure(list(arrays)),
    step=plan.step,
    source=plan.source,
    schema=_schema.written(schema, f"{plan.path}: the schema of its conversion"),
  )
  return manifest, {key: tensor for key, (_, tensor) in jobs.items()}
