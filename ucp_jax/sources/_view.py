"""A checkpoint of another format, seen as a ucp_jax checkpoint: read-only, nothing read up front.

`ucp_jax.open(path)` returns one for any path a source recognizes, so `restore` (each
device reading only its slice, straight from the source's files), `ucp inspect`,
`ucp verify` and rule-set views work on DeepSpeed, Hugging Face and torch files without
a conversion. The keys and schema are those `convert` would write (`params/NAME`,
`exp_avg/NAME`, ...).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tensorstore as ts

from ucp_jax.base import _errors
from ucp_jax.sources import _file_reads, _files, _registry, _source_plan
from ucp_jax.store import _byte_runs, _location
from ucp_jax.store._checkpoint import Checkpoint

_BLOCK_BYTES = 64 << 20


class SourceCheckpoint(Checkpoint):
  """The arrays of a source's `Plan`, as a read-only `Checkpoint`.

  An array held in one piece of a file (a safetensors tensor, a torch storage, a ZeRO-3
  partition) is a memory map: a read of a slice touches only the pages under it. An array
  made of several pieces (a ZeRO-1/2 flat partition split over ranks) is assembled when
  first read. An array the source opened as a TensorStore (Orbax) is read through it, each
  slice on its own.
  """

  checksummed = False

  def __init__(self, path: str, plan: _source_plan.Plan):
    manifest, self._tensors = _source_plan.manifest_of(plan)
    manifest = dataclasses.replace(manifest, source={**plan.source, "format": plan.format})
    super().__init__(_location.resolve(path), manifest)
    self.plan = plan

  def reads_directly(self, key: str) -> bool:
    """Whether `key`'s bytes are one run in a file, read by slice with `pread`."""
    self[key]
    return self._tensors[key].file is not None

  def start_read(self, key: str, regions: list):
    """Starts reading `regions` of `key` with `pread` (`reads_directly` keys)."""
    if not self.reads_directly(key):
      return super().start_read(key, regions)
    tensor = self._tensors[key]
    assert tensor.file is not None  # a key read directly is one run of a file
    path, offset, identity = tensor.file
    tasks = _file_reads.tensor_reads(path, offset, tensor.shape, tensor.dtype, regions, identity)
    return _byte_runs.start_read(regions, tensor.dtype, tasks)

  def array(self, key: str) -> np.ndarray:
    """`key` as a numpy array: a memory map where it is one piece of a file."""
    self[key]
    data, _ = _source_plan.assemble(self._tensors[key])
    return data

  def open_future(self, key: str) -> ts.Future:
    promise: ts.Promise[ts.TensorStore]
    future: ts.Future[ts.TensorStore]
    promise, future = ts.Promise.new()
    tensor = self._tensors.get(key)
    store = None if tensor is None else tensor.store
    if store is None and tensor is not None and tensor.file is not None and tensor.shape:
      store = _file_store(tensor)  # a view's slice reads its rows, not the mapped pages around
    try:
      promise.set_result(store if store is not None else ts.array(self.array(key), copy=False))
    except Exception as e:  # raised by whoever waits on it, named by key
      promise.set_exception(e)
    return future

  def verify(self, on_array=None) -> dict[str, str]:
    """Reads every array through; returns the problems found by key (empty if sound).

    Sources carry no checksums of their own beyond what their readers check (zip CRCs of
    torch files, the structure of safetensors headers): this finds unreadable, truncated
    or inconsistent files.
    """
    problems = {}
    for key in self.keys():
      try:
        _read_through(self.array(key))
      except (_errors.UcpError, OSError, ValueError) as e:
        problems[key] = str(e)
      if on_array is not None:
        on_array(key, self[key].nbytes)
    return problems

  def __repr__(self) -> str:
    return f"SourceCheckpoint({str(self.location)!r}, format={self.plan.format!r})"


def _file_store(tensor: _source_plan.Tensor):
  """`tensor` (one C-order run in a file) as a lazy TensorStore: each cell it reads (whole
  rows, about `ROWS_BYTES`) is one `pread` of exactly its bytes, from the checked file."""
  assert tensor.file is not None  # asked only of a tensor that is one run of a file
  path, offset, identity = tensor.file
  shape, dtype = tensor.shape, np.dtype(tensor.dtype)
  row = max(1, int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize)

  def read(region: tuple[slice, ...], out: np.ndarray) -> None:
    got = np.empty((region[0].stop - region[0].start, *shape[1:]), dtype)
    fd = _file_reads.open_unchanged(path, identity)
    try:
      if hasattr(os, "posix_fadvise"):  # exactly these bytes: no readahead past them
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
      _file_reads.pread_into(fd, path, offset + region[0].start * row, got, "a tensor")
    finally:
      os.close(fd)
    out[...] = got[(slice(None), *region[1:])]

  return _source_plan.lazy_store(shape, dtype, _source_plan.row_cells(shape, dtype), read)


def _read_through(array: np.ndarray) -> None:
  """Touches every byte, a block at a time (bounded memory)."""
  flat = array.reshape(-1)
  step = max(1, _BLOCK_BYTES // max(1, flat.itemsize))
  for start in range(0, flat.size, step):
    np.array(flat[start : start + step])


def open_source(path, source: str | None = None) -> SourceCheckpoint | None:
  """The source view of `path` if a source recognizes it (or `source`, by name), else None
  (how `ucp_jax.open` reads other formats: `store._reader.FOREIGN_FORMATS`)."""
  import ml_dtypes  # noqa: F401  (numpy then knows the bfloat16 and float8 a source may hold)

  text = _location.named(path)  # a kvstore spec: the URL that names it
  with _files.session():  # a URL's prefixes listed once for sniffing and describing
    if source is None and _registry.sniff(text) is None:
      return None
    return SourceCheckpoint(text, _registry.describe(text, source))
