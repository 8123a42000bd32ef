"""`open`: a read-only view of a checkpoint, for inspection and for other tools.

Every read checks what it returns: a chunk that is missing, damaged, or not the
one the manifest recorded at its place is an error, never zeros or another
chunk's data. A local checkpoint is read through a descriptor of the directory
opened with the manifest, so an overwrite during the read cannot mix two saves.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np

from ucp_jax.base import _errors
from ucp_jax.store import (
  _batched_reads,
  _bundle,
  _byte_runs,
  _chunks,
  _commit,
  _direct,
  _lazy,
  _location,
  _manifest,
  _pool,
  _threads,
  _untrusted,
  _verify,
  _zarr,
)
from ucp_jax.store._checkpoint import Checkpoint

if TYPE_CHECKING:
  import tensorstore as ts
else:
  ts = _lazy.tensorstore


class StoredCheckpoint(Checkpoint):
  """A committed ucp_jax checkpoint, opened read-only (what `ucp_jax.open` returns for one).

  Attributes:
    data: where its arrays live.
    pool: in a version 4 checkpoint, the pool that holds its arrays' generations, else None.
    origin: where it was opened from: its manifest is read there again to tell whether
      another save has replaced it (`replaced`).
  """

  checksummed = True

  def __init__(
    self,
    location: _location.Location,
    manifest: _manifest.Manifest,
    *,
    origin: _location.Location | None = None,
  ):
    super().__init__(location, manifest)
    self.data = location.child(manifest.data)
    self.pool = _pool.location_of(location, manifest)
    self.origin = origin or dataclasses.replace(location, io_dir=None, pin=None)
    self._zarr_opens: dict[str, ts.Future] = {}

  def array_location(self, key: str) -> _location.Location:
    """Where the zarr array of `key` lives: below `data`, or in its generation of the pool."""
    at = self[key].at
    return self.data if at is None or self.pool is None else self.pool.child(at)

  def open_future(self, key: str) -> ts.Future:
    """Opens `key` as a lazy, read-only TensorStore whose every chunk read is checked."""
    return _checked_store(self, key)

  def zarr_future(self, key: str) -> ts.Future:
    """Opens the zarr array of `key` as it is stored (unchecked), once per checkpoint: its
    `zarr.json` is one request on an object store, whoever asks (`verify`, reads)."""
    if key not in self._zarr_opens:
      self._zarr_opens[key] = _zarr.open_array(self.array_location(key), key)
    return self._zarr_opens[key]

  def files(self, key: str) -> _direct.ArrayFiles | None:
    """The chunk files of `key`, when they can be read without TensorStore (local, raw)."""
    info = self[key]
    data = self.array_location(key)
    if data.local_dir is None or not _direct.ENABLED or info.compression is not None:
      return None
    if self.manifest.format_version < 2 and not self._raw_v1(key):
      return None  # version 1 manifests did not record compression: zarr.json says
    return _direct.ArrayFiles(
      data.io_path(key), os.path.join(data.local_dir, key), key, info, data.pin
    )

  def _raw_v1(self, key: str) -> bool:
    """Whether a version 1 array's chunks are stored raw (its zarr.json has no codec but
    `bytes` and `crc32c`); anything unreadable counts as not raw (TensorStore then says)."""
    where = f"{self.data}/{key}/zarr.json"
    try:
      raw = _location.read_small(self.data, f"{key}/zarr.json", _errors.CorruptCheckpointError)
      codecs = _untrusted.loads_json(raw, where, _errors.CorruptCheckpointError).get("codecs")
      return {c.get("name") for c in codecs or []} <= {"bytes", "crc32c"}
    except (_errors.UcpError, AttributeError, TypeError):
      return False

  def reads_directly(self, key: str) -> bool:
    """Whether `start_read` reads `key` into aligned buffers itself: its chunk files on a
    local disk, or its chunks on an object store in coalesced batches (`_batched_reads`)."""
    return self.files(key) is not None or self.array_location(key).local_dir is None

  def start_read(self, key: str, regions: list) -> tuple[list[np.ndarray], Any]:
    """Starts reading `regions` of `key` into aligned host buffers (`reads_directly` keys).

    Returns the buffers and a function that waits for them to be filled (and raises what
    went wrong).
    """
    files = self.files(key)
    if files is not None:
      tasks = _direct.chunk_reads(files, regions)
      return _byte_runs.start_read(regions, files.info.dtype, tasks)
    data = self.array_location(key)
    if data.local_dir is not None:
      raise ValueError(f"`{key}` is not read directly; read it through open_future")
    info = self[key]
    stored = _zarr.wait_open(self.location, key, self.zarr_future(key))
    problem = _zarr.metadata_problem(stored, info)
    if problem:  # TensorStore would decode by the unsealed zarr.json: never trust it alone
      raise _errors.CorruptCheckpointError(f"{data}/{key}: `{key}`: {problem}")
    return _batched_reads.start_read(self.location, f"{data}/{key}", key, info, stored, regions)

  def replaced(self) -> bool:
    """Whether another save has replaced the checkpoint at this path since it was opened.

    The manifest is read again where the checkpoint was opened from (the same kvstore spec;
    for a checkpoint read where an interrupted swap left it, that directory), not through
    the pinned directory, which still shows the old one.
    """
    origin = self.origin
    try:
      now = _manifest.read(origin, staged=origin.local_dir != self.location.local_dir)
    except _errors.UcpError:
      return True
    return now.to_bytes() != self.manifest.to_bytes()

  def verify(self, on_array=None) -> dict[str, str]:
    """Reads every chunk back; returns the problems found by key (empty if sound).

    Example:
      >>> import numpy as np, ucp_jax
      >>> _ = ucp_jax.save("/tmp/ucp_doc_verify", {"x": np.ones(3)}, overwrite=True)
      >>> ucp_jax.open("/tmp/ucp_doc_verify").verify()
      {}
    """
    return _verify.verify(self, on_array)

  def __repr__(self) -> str:
    return (
      f"Checkpoint({str(self.location)!r}, step={self.step}, arrays={len(self.manifest.arrays)}, "
      f"bytes={self.nbytes})"
    )


def open(path: str | os.PathLike | Checkpoint, *, source: str | None = None) -> Checkpoint:
  """Opens a checkpoint read-only: a committed ucp_jax checkpoint, or another format's.

  A path that holds no ucp_jax checkpoint is offered to the sources (`ucp_jax.sources`): a
  DeepSpeed folder, for instance, opens as a read-only view of the arrays `convert`
  would write. `source` names the format to read it as (`"torch"`, `"hf"`, ...) when
  its files are ambiguous.

  Args:
    path: a checkpoint directory or kvstore URL (`memory://`, `gs://`, `s3://`,
      `file://`), another format's folder or file, or an opened checkpoint (returned as is).
    source: the format to read a foreign path as (a name `ucp convert --from` takes);
      None finds it from the files.

  Returns:
    A read-only `Checkpoint`: its `manifest`, `keys()`, lazy reads of each array, `verify`.

  Raises:
    CheckpointNotFoundError: no committed checkpoint at `path`, and no source recognizes it.
    ManifestError: the manifest is truncated, foreign, edited, or of a newer format.
    SourceFormatError: a source recognized `path` but cannot read it.
    InvalidArgumentError: `source` names no reader.

  Example:
    >>> import numpy as np, ucp_jax
    >>> _ = ucp_jax.save("/tmp/ucp_doc_open_fn", {"x": np.zeros(3)}, step=2, overwrite=True)
    >>> ckpt = ucp_jax.open("/tmp/ucp_doc_open_fn")
    >>> ckpt.keys(), ckpt.manifest.step
    (['x'], 2)
  """
  if isinstance(path, Checkpoint):  # already open (or a mapped view of one)
    return path
  if source is not None:
    view = _open_foreign(path, source)
    if view is None:
      raise _errors.InvalidArgumentError(f"source={source!r}: no reader of that name is loaded")
    return view
  try:
    return _open_committed(path)
  except _errors.CheckpointNotFoundError:
    view = _open_foreign(path, None)
    if view is None:
      raise
    return view


FOREIGN_FORMATS = "ucp_jax.sources._view"
"""The module whose `open_source(path, source)` reads other formats as read-only views. The
sources sit above the store, which knows no format but its own: like the format registries'
built-in plugins, it is named here and imported on first use (and `ucp --help` imports none)."""


def _open_foreign(path: str | os.PathLike, source: str | None) -> Checkpoint | None:
  return importlib.import_module(FOREIGN_FORMATS).open_source(path, source)


def _open_committed(path: str | os.PathLike) -> StoredCheckpoint:
  location = _location.resolve(path)
  if location.local_dir is not None and _location.staged_for(location.local_dir) is None:
    staged = _commit.interrupted_swap(location.local_dir)
    if staged is not None:  # committed, the rename into place cut short: read it where it is
      pinned = _location.pin(location, staged)
      location = pinned if pinned.io_dir is not None else _location.resolve(staged)
      manifest = _manifest.read(location, staged=True)
      return StoredCheckpoint(location, manifest, origin=_location.resolve(staged))
  location = _location.pin(location)
  return StoredCheckpoint(location, _manifest.read(location))


def _checked_store(ckpt: StoredCheckpoint, key: str) -> ts.Future:
  """A future of `key` as a read-only virtual TensorStore that checks each chunk it reads.

  TensorStore asks for whole chunks (the stored chunk grid); each is read either
  from its file directly (local, raw) or through the zarr array, and compared with
  the manifest's checksum for its place before TensorStore sees it.
  """
  info = ckpt[key]
  data = ckpt.array_location(key)
  chunk_bytes = math.prod(info.chunks) * np.dtype(info.dtype).itemsize
  _untrusted.check_allocation(chunk_bytes, f"{data}/{key}: `{key}`: one chunk")
  files = ckpt.files(key)
  if files is not None:
    return _ready(_virtual(info, lambda index, out: _read_file_chunk(files, index, out)))
  opened = ckpt.zarr_future(key)
  where = f"{data}/{key}"

  def build(stored: ts.TensorStore) -> ts.TensorStore:
    problem = _zarr.metadata_problem(stored, info)
    if problem:  # TensorStore would decode by the unsealed zarr.json: never trust it alone
      raise _errors.CorruptCheckpointError(f"{where}: `{key}`: {problem}")
    return _virtual(info, _ZarrChunks(stored, where, key, info, ckpt))

  return _then(opened, build)


def _virtual(info: _manifest.ArrayInfo, read_chunk) -> ts.TensorStore:
  chunks = info.chunks

  def read(domain: ts.IndexDomain, out: np.ndarray, _params) -> ts.Future:
    index = tuple(d.inclusive_min // c for d, c in zip(domain, chunks))
    promise, future = ts.Promise.new()

    def run():
      try:
        done = read_chunk(index, out)
      except BaseException as e:
        promise.set_exception(e)
        return
      if done is None:
        promise.set_result(None)
        return
      done.add_done_callback(lambda f: _settle(promise, f))

    _threads.submit(run)
    return future

  layout = ts.ChunkLayout(read_chunk_shape=chunks) if chunks else None
  return ts.virtual_chunked(
    read,
    dtype=ts.dtype(info.dtype),
    shape=info.shape,
    chunk_layout=layout,
    context=_location.context(),
  )


def _settle(promise: ts.Promise, future) -> None:
  try:
    future.result()
  except BaseException as e:
    promise.set_exception(e)
  else:
    promise.set_result(None)


def _read_file_chunk(files: _direct.ArrayFiles, index: tuple[int, ...], out: np.ndarray) -> None:
  if out.shape == tuple(files.info.chunks) and out.flags.c_contiguous:
    _direct.read_chunk_into(files, index, out)
  else:  # an edge chunk: stored padded to the full chunk shape
    out[...] = _direct.mapped_chunk(files, index)[tuple(slice(0, n) for n in out.shape)]


class _ZarrChunks:
  """Reads chunks of a stored zarr array through TensorStore, each checked against the manifest.

  Holds the checkpoint's directory pin: the store may outlive the `Checkpoint` object.
  """

  def __init__(self, stored: ts.TensorStore, where: str, key: str, info, ckpt: StoredCheckpoint):
    self._stored, self._where, self._key, self._info = stored, where, key, info
    data = ckpt.array_location(key)
    self._pin = data.pin
    self._files = None
    if data.local_dir is not None:  # compressed: each file is checked before TensorStore's read
      self._files = _direct.ArrayFiles(
        data.io_path(key), os.path.join(data.local_dir, key), key, info, data.pin
      )

  def __call__(self, index: tuple[int, ...], out: np.ndarray) -> ts.Future:
    """Starts reading chunk `index`; checks it before filling `out`."""
    info = self._info
    if self._files is not None:
      self._files.check_file(index)
    read = self._stored[_chunks.chunk_region(index, info.chunks, info.shape)].read()
    promise, future = ts.Promise.new()

    def check(done: ts.Future) -> None:
      try:
        data = done.result()
        expected = info.expected_crc(index)
        if expected is not None:
          computed = crc32c.crc32c(_chunks.raw_bytes(_chunks.padded(data, info.chunks)))
          if computed != expected:
            shown = f"{self._where}/{_bundle.chunk_name(info, index)}"
            message = _direct.misplaced(shown, self._key, computed, expected)
            raise _errors.CorruptCheckpointError(message)
        out[...] = data
      except BaseException as e:
        promise.set_exception(e)
      else:
        promise.set_result(None)

    read.add_done_callback(check)
    return future


def _ready(value: Any) -> ts.Future:
  promise, future = ts.Promise.new()
  promise.set_result(value)
  return future


def _then(future: ts.Future, fn) -> ts.Future:
  """A future of `fn(result)`, once `future` is done."""
  promise, result = ts.Promise.new()

  def done(f: ts.Future) -> None:
    try:
      promise.set_result(fn(f.result()))
    except BaseException as e:
      promise.set_exception(e)

  future.add_done_callback(done)
  return result
