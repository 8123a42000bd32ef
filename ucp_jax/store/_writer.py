"""The Writer: one save in progress (lock, staging location, arrays, commit), on every process.

`save`, `save_async`, the Orbax handler and the converters all write through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from ucp_jax import _errors
from ucp_jax.store import (
  _chunks,
  _commit,
  _direct,
  _keypath,
  _location,
  _manifest,
  _multihost,
  _regions,
  _swap,
  _write_plan,
  _zarr,
)


@dataclasses.dataclass(frozen=True)
class Entry:
  """One array of a save: its key, what the manifest says of it, and its data."""

  key: str
  info: _manifest.ArrayInfo
  value: Any  # a jax.Array (key data for PRNG keys) or a numpy array
  # Host copies of the (index, data) this process writes, taken by `save_async`; None: use `value`.
  owned: tuple[tuple[tuple[slice, ...], np.ndarray], ...] | None = None


class Writer:
  """One save in progress: lock, staging location, array creation, commit.

  Used as a context manager; leaving it without `commit` (an exception, a crash)
  removes the staging data and leaves the previous checkpoint as it was.
  Converters use it directly to write logical arrays from host memory.

  Every chunk written gets its checksum recorded (`_chunks`); the commit gathers
  them from every process into the manifest and refuses to commit an array with
  a chunk nobody wrote. With `durable` (the default) every file is fsynced by the
  thread that wrote it, and the directories before the commit, so a committed
  checkpoint survives a power loss.
  """

  def __init__(
    self,
    target: _location.Location,
    *,
    overwrite: bool = False,
    sync: _multihost.Sync | None = None,
    durable: bool = True,
  ):
    self.target = target
    self._overwrite = overwrite
    self._sync = sync or _multihost.Sync(str(target))
    self._durable = durable
    self._primary = _multihost.is_primary()
    self._lock: _commit.Lock | None = None
    self._stores: dict[str, Any] = {}
    self._arrays: dict[str, _manifest.ArrayInfo] = {}
    self._tables: dict[str, _chunks.Table] = {}
    self._inflight: list[Any] = []  # chunk writes started (direct, TensorStore): an abort waits
    self._data = ""  # the data prefix below the root (object stores)
    self._replaced = None  # the manifest this save replaces on an object store (False: unreadable)
    self.staging: _location.Location | None = None

  def __enter__(self) -> Writer:
    status = np.zeros(2, dtype=np.uint64)
    error: Exception | None = None
    if self._primary:  # the others learn the outcome from the broadcast below
      token = secrets.randbits(63)
      try:
        _commit.check_writable(self.target, self._overwrite)  # refused early, before the lock
        lock = _commit.Lock(self.target, token, self._durable)
        lock.acquire()
        self._lock = lock
        _commit.remove_stale_staging(self.target)  # completes a swap that died half way
        _commit.check_writable(self.target, self._overwrite)  # the answer that holds: locked
        if self.target.local_dir is None:
          self._replaced = _commit.live_manifest(self.target)
          _commit.remove_dead_generations(self.target, self._replaced)
        status[:] = (1, token)
      except Exception as e:  # reported to the other processes, then raised here
        error = _location.storage_error(e, self.target, "starting the save", _NOTHING_LOST)
      except BaseException:  # an interrupt: the lock must not stay held by this process
        self._release()
        raise
    status = self._sync.broadcast_from_primary(status, "starting the save")
    if error is not None:
      self._release()
      raise error
    if status[0] != 1:
      raise _errors.UcpError(f"{self.target}: process 0 could not start the save (see its log)")
    self.staging = _commit.staging_location(self.target, int(status[1]))
    self._data = _commit.data_prefix(self.target, int(status[1]))
    return self

  def together(self, what: str, fn, *args) -> None:
    together(self._sync, self.target, what, fn, *args)

  def create(self, arrays: dict[str, _manifest.ArrayInfo], *, compression: str | None) -> None:
    """Creates every array (process 0), then opens them on the other processes."""
    _zarr.check_compression(compression)
    bad = _keypath.problems(arrays)
    if bad:
      raise _errors.InvalidKeyError(
        f"{self.target}: these keys cannot name arrays in a checkpoint:\n"
        + _errors.bullet_list(bad)
      )
    self._arrays = {
      key: dataclasses.replace(info, compression=compression) for key, info in arrays.items()
    }
    self._tables = {key: _chunks.Table(info.shape, info.chunks) for key, info in arrays.items()}
    if self._primary:
      self.together("creating the arrays", self._create, arrays, compression)
    else:
      self.together("creating the arrays", lambda: None)
      futures = {key: _zarr.open_array(self.staging, key, self._durable) for key in arrays}
      self._stores = {key: f.result() for key, f in futures.items()}

  def _create(self, arrays: dict[str, _manifest.ArrayInfo], compression: str | None) -> None:
    futures = {
      key: _zarr.create_array(
        _zarr.array_spec(
          self.staging,
          key,
          shape=info.shape,
          dtype=np.dtype(info.dtype),
          chunks=info.chunks,
          compression=compression,
          bundle=info.bundle,
        ),
        self._durable,
      )
      for key, info in arrays.items()
    }
    _write_groups(self.staging, list(arrays), self._durable)
    if self._data:  # the root group of an object-store checkpoint, above its generation
      _location.kvstore(self.target, self._durable).write("zarr.json", _group_json(True)).result()
    self._stores = {key: f.result() for key, f in futures.items()}

  def write_entries(self, entries: list[Entry], max_host_bytes: int) -> None:
    """Writes this process's shards of every entry, holding at most ~max_host_bytes."""
    self.together("writing shards", self._write_entries, entries, max_host_bytes)

  def _write_entries(self, entries: list[Entry], max_host_bytes: int) -> None:
    try:
      self._write_shards(entries, max_host_bytes)
    except BaseException:
      self._wait_inflight()  # before the other processes hear of it and the staging goes
      raise

  def _wait_inflight(self) -> None:
    for future in self._inflight:
      with contextlib.suppress(Exception):  # the failure itself is reported by the caller
        future.exception()

  def _write_shards(self, entries: list[Entry], max_host_bytes: int) -> None:
    pending: list[tuple[Any, int]] = []
    held = 0
    for entry, index, data, origin in owned_shards(entries, self._primary):
      nbytes = (
        0  # a CPU device's buffer is written in place: no host copy to bound
        if _on_cpu_device(entry.value)
        # the host holds all of `data` (a whole shard) while one slab of it is written
        else int(np.prod([s.stop - s.start for s in origin], dtype=np.int64))
        * np.dtype(entry.info.dtype).itemsize
      )
      while pending and held + nbytes > max_host_bytes:
        future, n = pending.pop(0)
        future.result()
        held -= n
      host = slab(host_array(data), index, origin)
      immutable = _is_jax_array(entry.value) or entry.owned is not None  # never changes
      pending.append((self._write(entry.key, host, index, immutable), nbytes))
      held += nbytes
    for future, _ in pending:
      future.result()

  def _write(self, key: str, host: np.ndarray, index: tuple[slice, ...], immutable: bool):
    """Starts writing `host` into the region `index` of `key`; returns something to wait on."""
    if len(self._inflight) > 4096:  # keep the list short without scanning it per shard
      self._inflight = [f for f in self._inflight if not f.done()]
    info = self._arrays[key]
    table = self._tables[key]
    if self.staging.local_dir is not None and info.compression is None and _direct.ENABLED:
      futures = _direct.write_region(
        os.path.join(self.staging.local_dir, key),
        host,
        index,
        info.chunks,
        info.shape,
        record=table.set,
        durable=self._durable,
        bundle=info.bundle,
      )
      self._inflight += futures
      return _AllOf(futures)
    for chunk in _chunks.chunks_in(index, info.chunks):
      region = _chunks.chunk_region(chunk, info.chunks, info.shape)
      table.set(chunk, _chunks.of_block(host[_regions.relative(region, index)], info.chunks))
    future = (
      self._stores[key][index].write(host, can_reference_source_data_indefinitely=immutable).commit
    )
    self._inflight.append(future)  # an abort waits for it before removing the staging
    return future

  def write_array(self, key: str, value: np.ndarray, index: tuple[slice, ...] | None = None):
    """Starts writing host data into `key` (all of it, or the chunk-aligned region `index`;
    several writes into one bundle must come from one process).

    Returns an object whose `.result()` waits for the write.
    """
    if index is None:
      index = tuple(slice(0, d) for d in self._arrays[key].shape)
    return self._write(
      key, np.asarray(value), _regions.normalize(index, self._arrays[key].shape), False
    )

  def commit(self, manifest: _manifest.Manifest) -> None:
    """Writes the manifest and makes the checkpoint visible, once every process is done."""
    self.together("writing", lambda: None)
    entries = self._sync.gather_to_primary(_checksum_entries(self._tables), "gathering checksums")
    if self._primary:
      self.together("the commit", self._commit, manifest, entries)
    else:
      self.together("the commit", lambda: None)
    self.staging = None

  def _commit(self, manifest: _manifest.Manifest, entries: list[bytes]) -> None:
    keys = sorted(self._tables)
    for raw in entries[1:]:  # this process's own entries are in its tables already
      _merge_checksum_entries(self._tables, keys, raw)
    incomplete = [
      f"{k}: {t.missing()} of {t.written.size} chunks not written"
      for k, t in self._tables.items()
      if t.missing()
    ]
    if incomplete:
      raise _errors.UcpError(
        f"{self.target}: refusing to commit arrays that were not wholly written:\n"
        + _errors.bullet_list(incomplete)
      )
    arrays = {
      k: dataclasses.replace(
        v, compression=self._arrays[k].compression, checksums=self._tables[k].crcs
      )
      if k in self._arrays
      else v
      for k, v in manifest.arrays.items()
    }
    manifest = dataclasses.replace(manifest, arrays=arrays, data=self._data)
    if self._durable and self.staging.local_dir is not None:
      _fsync_dirs(_array_dirs(self.staging.local_dir, self._arrays))
    _commit.commit(self.staging, self.target, manifest.to_bytes(), durable=self._durable)
    if self._data:
      _commit.remove_replaced(self.target, self._data, self._replaced)

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      if exc_type is not None:
        self._wait_inflight()  # no chunk may land in the staging folder after it is gone
      if exc_type is not None and self._primary and self.staging is not None:
        _commit.abort(self.staging, self.target)  # puts back an old checkpoint left aside
    finally:
      self._release()

  def _release(self) -> None:
    if self._lock is not None:
      self._lock.release()
      self._lock = None


def together(sync: _multihost.Sync, target: _location.Location, what: str, fn, *args) -> Any:
  """`fn(*args)` on every process; if it fails on any process, every process raises."""
  error, result = None, None
  try:
    result = fn(*args)
  except Exception as e:
    error = _location.storage_error(e, target, what, _NOTHING_LOST)
    if error is not e:
      error.__cause__ = e
  if not sync.all_ok(error is None, what):
    if error is not None:
      raise error
    raise _errors.UcpError(f"{target}: {what} failed on another process (see its log)")
  return result


_NOTHING_LOST = "Nothing was committed; the checkpoint there before, if any, is intact."


class _AllOf:
  """Waits for several futures as one."""

  def __init__(self, futures):
    self._futures = futures

  def result(self):
    for f in self._futures:
      f.result()


def owned_shards(entries: list[Entry], primary: bool) -> Iterator[tuple[Entry, tuple, Any, tuple]]:
  """(entry, region, data, data's region) for every region this process must write.

  `data` holds `region` (a whole shard) or more (a replicated shard that several
  processes share: `slab` cuts out the region). Device-to-host copies start early.
  """
  jax_shards = []
  for entry in entries:
    if entry.owned is not None:
      for index, data in entry.owned:
        yield entry, index, data, index
    elif _is_jax_array(entry.value):
      jax_shards += _jax_pieces(entry)
    elif primary:
      full = tuple(slice(0, d) for d in entry.info.shape)
      yield entry, full, entry.value, full
  copies: dict[int, Any] = {}  # a shard holding several regions is copied once
  for entry, region, data, origin in jax_shards:
    copy = copies.get(id(data))
    if copy is None:
      copy = copies[id(data)] = start_host_copy(data)
    yield entry, region, copy, origin


# Platforms whose shards are copied to pinned host memory (Orbax does the same on GPUs). On an
# H200, 1 GiB took 0.6 s through `copy_to_host_async` (pageable memory), 0.03 s pinned.
PINNED_PLATFORMS = ("gpu",)


@dataclasses.dataclass(frozen=True)
class PinnedCopy:
  """A shard's copy in pinned host memory: a buffer this save alone holds."""

  array: Any  # a jax.Array whose memory kind is "pinned_host"


def start_host_copy(data: Any) -> Any:
  """Starts copying a device shard to host memory; `host_array` of the result waits for it."""
  jax = sys.modules["jax"]
  device = next(iter(data.devices()))
  if (
    device.platform in PINNED_PLATFORMS
    and data.sharding.memory_kind in (None, "device")
    and any(m.kind == "pinned_host" for m in device.addressable_memories())
  ):
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    return PinnedCopy(jax.device_put(data, pinned))
  data.copy_to_host_async()
  return data


def host_array(data: Any) -> np.ndarray:
  """The host values of what `owned_shards` yields (a view where that costs no copy)."""
  return np.asarray(data.array if isinstance(data, PinnedCopy) else data)


def slab(host: np.ndarray, region: tuple, origin: tuple) -> np.ndarray:
  """The part of `host` (which holds `origin`) that `region` names; a view."""
  return host if region == origin else host[_regions.relative(region, origin)]


def _jax_pieces(entry: Entry) -> list[tuple[Entry, tuple, Any, tuple]]:
  """(entry, region, shard data, shard region) for each slab of `entry` this process writes."""
  value, shape = entry.value, entry.info.shape
  if _multihost.process_count() == 1:  # the plan's answer, without computing it
    return [
      (entry, region, s.data, region)
      for s in value.addressable_shards
      if s.replica_id == 0
      for region in [_regions.normalize(s.index, shape)]
    ]
  unit = entry.info.bundle or entry.info.chunks  # a bundle file has one writer
  plan = _write_plan.of_sharding(entry.key, value.sharding, shape, unit, _multihost.process_index())
  pieces = []
  for shard in value.addressable_shards:
    origin = _regions.normalize(shard.index, shape)
    pieces += [(entry, region, shard.data, origin) for region in plan.get(shard.device, ())]
  return pieces


def _checksum_entries(tables: dict[str, _chunks.Table]) -> bytes:
  """The chunk checksums this process recorded, as bytes to send to process 0."""
  parts = []
  for number, key in enumerate(sorted(tables)):
    flat, crcs = tables[key].entries()
    part = np.empty(len(flat), dtype=_ENTRY)
    part["array"], part["chunk"], part["crc"] = number, flat, crcs
    parts.append(part)
  return np.concatenate(parts).tobytes() if parts else b""


def _merge_checksum_entries(tables: dict[str, _chunks.Table], keys: list[str], raw: bytes) -> None:
  entries = np.frombuffer(raw, dtype=_ENTRY)
  for number in np.unique(entries["array"]):
    mine = entries[entries["array"] == number]
    tables[keys[int(number)]].merge(mine["chunk"], mine["crc"])


_ENTRY = np.dtype([("array", "<u4"), ("chunk", "<u8"), ("crc", "<u4")])


def _array_dirs(root: str, arrays: dict[str, _manifest.ArrayInfo]) -> set[str]:
  """Every directory a local save created: groups, arrays, and chunk (or bundle) folders."""
  dirs = {root}
  for key, info in arrays.items():
    parts = key.split("/")
    dirs.update(os.path.join(root, *parts[:i]) for i in range(1, len(parts) + 1))
    grid = _chunks.grid(info.shape, info.bundle or info.chunks)
    if len(grid) >= 1 and all(grid):
      dirs.add(os.path.join(root, key, "c"))
      for depth in range(1, len(grid)):
        for prefix in np.ndindex(*grid[:depth]):
          dirs.add(os.path.join(root, key, "c", *map(str, prefix)))
  return dirs


def _fsync_dirs(dirs: set[str]) -> None:
  futures = [_direct.submit(_fsync_if_present, d) for d in dirs]
  for f in futures:
    f.result()


def _fsync_if_present(path: str) -> None:
  with contextlib.suppress(FileNotFoundError):
    _swap.fsync_dir(path)


def _write_groups(location: _location.Location, keys: list[str], durable: bool = True) -> None:
  """zarr v3 group nodes for the root and every inner path, so zarr readers can walk the tree."""
  groups = {""}
  for key in keys:
    parts = key.split("/")
    groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
  store = _location.kvstore(location, durable)
  futures = [
    store.write(f"{group}/zarr.json" if group else "zarr.json", _group_json(not group))
    for group in groups
  ]
  for f in futures:
    f.result()


def _group_json(root: bool) -> bytes:
  import json

  attributes = {"ucp_jax": {"format_version": _manifest.FORMAT_VERSION}} if root else {}
  return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes}).encode()


def _on_cpu_device(x: Any) -> bool:
  return _is_jax_array(x) and next(iter(x.devices())).platform == "cpu"


def _is_jax_array(x: Any) -> bool:
  """Without jax loaded nothing is a jax.Array (converters write from numpy, jax-free)."""
  jax = sys.modules.get("jax")
  return jax is not None and isinstance(x, jax.Array)
