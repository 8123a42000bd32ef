"""`save`: a pytree on any mesh -> a committed checkpoint, each process writing its own shards."""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from ucp_jax import _commit, _direct, _errors, _manifest, _multihost, _store, _tree

DEFAULT_HOST_BYTES = 1 << 30
"""Default bound on host memory held by array data in flight during a save or restore."""

_PY_SCALARS = {bool: ("bool", np.bool_), int: ("int", np.int64), float: ("float", np.float64)}
_PY_SCALARS[complex] = ("complex", np.complex128)


@dataclasses.dataclass(frozen=True)
class _Entry:
  key: str
  info: _manifest.ArrayInfo
  value: Any  # a jax.Array (key data for PRNG keys) or a numpy array
  # Host copies of the (index, data) this process writes, taken by `save_async`; None: use `value`.
  owned: tuple[tuple[tuple[slice, ...], np.ndarray], ...] | None = None


def save(
  path: str | os.PathLike,
  tree: Any,
  *,
  step: int | None = None,
  metadata: dict | None = None,
  overwrite: bool = False,
  compression: str | None = None,
  max_host_bytes: int = DEFAULT_HOST_BYTES,
  chunk_bytes: int = _store.CHUNK_BYTES,
  schema: dict | None = None,
  source: dict | None = None,
) -> str:
  """Saves a pytree as a universal checkpoint.

  Leaves may be `jax.Array`s on any mesh and sharding (typed PRNG keys included),
  numpy arrays and scalars, and Python `bool`/`int`/`float`/`complex`; Flax NNX
  `Variable`s are looked through. Every process of a multi-process run calls
  `save` with its part of the same global arrays; each writes only the shards
  it owns (`replica_id == 0`), and process 0 commits once all have written.

  Example:
    >>> import jax.numpy as jnp, ucp_jax
    >>> _ = ucp_jax.save("/tmp/ucp_doc_ckpt", {"w": jnp.ones((4, 2))}, step=1, overwrite=True)
    >>> ucp_jax.open("/tmp/ucp_doc_ckpt").keys()
    ['w']

  Args:
    path: local directory or kvstore URL (`memory://`, `gs://`, `s3://`, `file://`).
    tree: the state to save.
    step: training step recorded in the manifest.
    metadata: JSON-serializable user metadata recorded in the manifest.
    overwrite: replace an existing checkpoint at `path` (atomically on local disks).
    compression: None (default: the disk is faster than the codec) or "zstd".
    max_host_bytes: bound on array bytes held in host memory at once.
    chunk_bytes: largest zarr chunk; chunks align to the shards and split below this.
    schema: universal parameter schema (filled by the Flax/Optax helpers).
    source: description of where the state came from (filled by converters).

  Returns:
    The checkpoint's location as a string.
  """
  from ucp_jax import _async  # here: _async imports this module

  _async.wait_until_finished()  # the async save before this one, and its error
  target = _store.resolve(path)
  sync = _multihost.Sync(str(target))

  def plan() -> tuple[list[_Entry], _manifest.Manifest]:
    return prepare(
      tree, step=step, metadata=metadata, chunk_bytes=chunk_bytes, schema=schema, source=source
    )

  # A tree rejected on one process only must stop every process, not leave them waiting.
  entries, manifest = _together(sync, target, "checking the tree", plan)
  write(
    target,
    entries,
    manifest,
    sync,
    overwrite=overwrite,
    compression=compression,
    max_host_bytes=max_host_bytes,
  )
  return str(target)


def prepare(
  tree: Any,
  *,
  step: int | None,
  metadata: dict | None,
  chunk_bytes: int,
  schema: dict | None,
  source: dict | None,
) -> tuple[list[_Entry], _manifest.Manifest]:
  """What `save` writes: an entry per leaf, and the manifest (raises for bad leaves)."""
  flat, _ = _tree.flatten(tree)
  entries = _plan(flat, chunk_bytes)
  manifest = _manifest.Manifest(
    arrays={e.key: e.info for e in entries},
    tree=_tree.structure(list(flat)),
    step=None if step is None else int(step),
    metadata=_json_checked(metadata or {}, "metadata"),
    source=source or _jax_source(entries),
    schema=schema,
  )
  return entries, manifest


def write(
  target: _store.Location,
  entries: list[_Entry],
  manifest: _manifest.Manifest,
  sync: _multihost.Sync,
  *,
  overwrite: bool,
  compression: str | None,
  max_host_bytes: int,
) -> None:
  """Creates, writes and commits the checkpoint `prepare` planned, with the other processes."""
  with Writer(target, overwrite=overwrite, sync=sync) as writer:
    writer.create({e.key: e.info for e in entries}, compression=compression)
    writer.write_entries(entries, max_host_bytes)
    writer.commit(manifest)


class Writer:
  """One save in progress: lock, staging location, array creation, commit.

  Used as a context manager; leaving it without `commit` (an exception, a crash)
  removes the staging data and leaves the previous checkpoint as it was.
  Converters use it directly to write logical arrays from host memory.
  """

  def __init__(
    self,
    target: _store.Location,
    *,
    overwrite: bool = False,
    sync: _multihost.Sync | None = None,
  ):
    self.target = target
    self._overwrite = overwrite
    self._sync = sync or _multihost.Sync(str(target))
    self._primary = _multihost.is_primary()
    self._lock: _commit.Lock | None = None
    self._stores: dict[str, Any] = {}
    self._arrays: dict[str, _manifest.ArrayInfo] = {}
    self.staging: _store.Location | None = None

  def __enter__(self) -> Writer:
    status = np.zeros(2, dtype=np.uint64)
    error: Exception | None = None
    if self._primary:  # the others learn the outcome from the broadcast below
      token = secrets.randbits(63)
      try:
        _commit.check_writable(self.target, self._overwrite)
        lock = _commit.Lock(self.target, token)
        lock.acquire()
        self._lock = lock
        _commit.remove_stale_staging(self.target)
        _commit.prepare_kvstore_target(self.target)
        status[:] = (1, token)
      except Exception as e:  # reported to the other processes, then raised here
        error = e
    status = self._sync.broadcast_from_primary(status, "starting the save")
    if error is not None:
      self._release()
      raise error
    if status[0] != 1:
      raise _errors.UcpError(f"{self.target}: process 0 could not start the save (see its log)")
    self.staging = _commit.staging_location(self.target, int(status[1]))
    return self

  def _together(self, what: str, fn, *args) -> None:
    _together(self._sync, self.target, what, fn, *args)

  def create(self, arrays: dict[str, _manifest.ArrayInfo], *, compression: str | None) -> None:
    """Creates every array (process 0), then opens them on the other processes."""
    self._arrays = {
      key: dataclasses.replace(info, compression=compression) for key, info in arrays.items()
    }
    if self._primary:
      self._together("creating the arrays", self._create, arrays, compression)
    else:
      self._together("creating the arrays", lambda: None)
      futures = {key: _store.open_array(self.staging, key) for key in arrays}
      self._stores = {key: f.result() for key, f in futures.items()}

  def _create(self, arrays: dict[str, _manifest.ArrayInfo], compression: str | None) -> None:
    futures = {
      key: _store.create_array(
        _store.array_spec(
          self.staging,
          key,
          shape=info.shape,
          dtype=np.dtype(info.dtype),
          chunks=info.chunks,
          compression=compression,
        )
      )
      for key, info in arrays.items()
    }
    _write_groups(self.staging, list(arrays))
    self._stores = {key: f.result() for key, f in futures.items()}

  def write_entries(self, entries: list[_Entry], max_host_bytes: int) -> None:
    """Writes this process's shards of every entry, holding at most ~max_host_bytes."""
    self._together("writing shards", self._write_entries, entries, max_host_bytes)

  def _write_entries(self, entries: list[_Entry], max_host_bytes: int) -> None:
    pending: list[tuple[Any, int]] = []
    held = 0
    for entry, index, data in _owned_shards(entries, self._primary):
      nbytes = (
        int(np.prod([s.stop - s.start for s in index], dtype=np.int64))
        * np.dtype(entry.info.dtype).itemsize
      )
      while pending and held + nbytes > max_host_bytes:
        future, n = pending.pop(0)
        future.result()
        held -= n
      host = np.asarray(data)
      immutable = isinstance(data, jax.Array) or entry.owned is not None  # never changes
      pending.append((self._write(entry.key, host, index, immutable), nbytes))
      held += nbytes
    for future, _ in pending:
      future.result()

  def _write(self, key: str, host: np.ndarray, index: tuple[slice, ...], immutable: bool):
    """Starts writing `host` into the region `index` of `key`; returns something to wait on."""
    info = self._arrays[key]
    if self.staging.local_dir is not None and info.compression is None and _direct.ENABLED:
      futures = _direct.write_region(
        os.path.join(self.staging.local_dir, key), host, index, info.chunks, info.shape
      )
      return _AllOf(futures)
    return (
      self._stores[key][index].write(host, can_reference_source_data_indefinitely=immutable).commit
    )

  def write_array(self, key: str, value: np.ndarray, index: tuple[slice, ...] | None = None):
    """Starts writing host data into `key` (all of it, or the chunk-aligned region `index`).

    Returns an object whose `.result()` waits for the write.
    """
    if index is None:
      index = tuple(slice(0, d) for d in self._arrays[key].shape)
    return self._write(key, np.asarray(value), _normalize(index, self._arrays[key].shape), False)

  def commit(self, manifest: _manifest.Manifest) -> None:
    """Writes the manifest and makes the checkpoint visible, once every process is done."""
    arrays = {
      k: dataclasses.replace(v, compression=self._arrays[k].compression) if k in self._arrays else v
      for k, v in manifest.arrays.items()
    }
    manifest = dataclasses.replace(manifest, arrays=arrays)
    self._together("writing", lambda: None)
    if self._primary:
      self._together("the commit", _commit.commit, self.staging, self.target, manifest.to_bytes())
    else:
      self._together("the commit", lambda: None)
    self.staging = None

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is not None and self._primary and self.staging is not None:
      _commit.abort(self.staging, self.target)
    self._release()

  def _release(self) -> None:
    if self._lock is not None:
      self._lock.release()
      self._lock = None


def _together(sync: _multihost.Sync, target: _store.Location, what: str, fn, *args) -> Any:
  """`fn(*args)` on every process; if it fails on any process, every process raises."""
  error, result = None, None
  try:
    result = fn(*args)
  except Exception as e:
    error = e
  if not sync.all_ok(error is None, what):
    if error is not None:
      raise error
    raise _errors.UcpError(f"{target}: {what} failed on another process (see its log)")
  return result


class _AllOf:
  """Waits for several futures as one."""

  def __init__(self, futures):
    self._futures = futures

  def result(self):
    for f in self._futures:
      f.result()


def _owned_shards(entries: list[_Entry], primary: bool) -> Iterator[tuple[_Entry, tuple, Any]]:
  """(entry, index, data) for every shard this process must write, device copies started early."""
  jax_shards = []
  for entry in entries:
    if entry.owned is not None:
      for index, data in entry.owned:
        yield entry, index, data
    elif isinstance(entry.value, jax.Array):
      for shard in entry.value.addressable_shards:
        if shard.replica_id == 0:
          jax_shards.append((entry, _normalize(shard.index, entry.info.shape), shard.data))
    elif primary:
      full = tuple(slice(0, d) for d in entry.info.shape)
      yield entry, full, entry.value
  for _, _, data in jax_shards:
    data.copy_to_host_async()
  yield from jax_shards


def group_by_slice(
  sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> list[tuple[tuple[slice, ...], list[jax.Device]]]:
  """This process's devices of `sharding`, grouped by the region of the array each holds."""
  groups: dict[tuple, list] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    bounds = tuple((s.start, s.stop) for s in _normalize(index, shape))
    groups.setdefault(bounds, []).append(device)
  return [(tuple(slice(*b) for b in bounds), devs) for bounds, devs in groups.items()]


def _normalize(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape))


def _plan(flat: dict[str, Any], chunk_bytes: int) -> list[_Entry]:
  """Classifies every leaf, collecting every unsupported one before raising."""
  entries, bad = [], []
  for key, leaf in flat.items():
    entry = _entry(key, leaf, chunk_bytes)
    if entry is None:
      bad.append(f"{key}: {type(leaf).__module__}.{type(leaf).__qualname__}")
    else:
      entries.append(entry)
  if bad:
    raise _errors.UnsupportedLeafError(
      "cannot save these leaves (supported: jax.Array, numpy arrays, Python numbers):\n"
      + _errors.bullet_list(bad)
    )
  return entries


def _entry(key: str, leaf: Any, chunk_bytes: int) -> _Entry | None:
  kind, python_type, impl = "array", None, None
  if isinstance(leaf, jax.Array):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      kind, impl = "prng_key", str(jax.random.key_impl(leaf))
      leaf = jax.random.key_data(leaf)
    shard_shape = leaf.sharding.shard_shape(leaf.shape)
    value = leaf
  elif type(leaf) in _PY_SCALARS:
    python_type, np_type = _PY_SCALARS[type(leaf)]
    kind, value = "scalar", np.asarray(leaf, dtype=np_type)
    shard_shape = ()
  elif isinstance(leaf, (np.ndarray, np.generic)):
    value = np.asarray(leaf)
    shard_shape = value.shape
  else:
    return None
  if not _storable(value.dtype):
    return None
  dtype = np.dtype(value.dtype)
  info = _manifest.ArrayInfo(
    shape=tuple(int(d) for d in value.shape),
    dtype=_store.zarr_dtype(dtype),
    chunks=_store.choose_chunks(value.shape, shard_shape, dtype.itemsize, chunk_bytes),
    kind=kind,
    python_type=python_type,
    prng_impl=impl,
  )
  return _Entry(key, info, value)


def _storable(dtype) -> bool:
  try:
    _store.zarr_dtype(np.dtype(dtype))
  except (TypeError, ValueError):
    return False
  return True


def _write_groups(location: _store.Location, keys: list[str]) -> None:
  """zarr v3 group nodes for the root and every inner path, so zarr readers can walk the tree."""
  groups = {""}
  for key in keys:
    parts = key.split("/")
    groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
  store = _store.kvstore(location)
  futures = []
  for group in groups:
    attributes = {"ucp_jax": {"format_version": _manifest.FORMAT_VERSION}} if not group else {}
    body = _json_bytes({"zarr_format": 3, "node_type": "group", "attributes": attributes})
    futures.append(store.write(f"{group}/zarr.json" if group else "zarr.json", body))
  for f in futures:
    f.result()


def _json_bytes(obj: Any) -> bytes:
  import json

  return json.dumps(obj).encode()


def _json_checked(obj: Any, what: str) -> Any:
  import json

  try:
    json.dumps(obj, allow_nan=False)
  except (TypeError, ValueError) as e:
    raise _errors.UcpError(f"{what} must be JSON-serializable: {e}") from e
  return obj


def _jax_source(entries: list[_Entry]) -> dict:
  meshes = []
  for e in entries:
    sharding = getattr(e.value, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and hasattr(mesh, "axis_names"):
      desc = {"axis_names": list(mesh.axis_names), "shape": [int(s) for s in mesh.devices.shape]}
      if desc not in meshes:
        meshes.append(desc)
  return {
    "framework": "jax",
    "jax_version": jax.__version__,
    "process_count": jax.process_count(),
    "device_count": jax.device_count(),
    "meshes": meshes,
  }
