"""The Writer: one save in progress (lock, staging location, arrays, commit), on every process.

`save`, `save_async`, the Orbax handler and the converters all write through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from typing import Any

import crc32c
import numpy as np

from ucp_jax.base import _errors, _multihost
from ucp_jax.store import (
  _bundle_commits,
  _chunk_writes,
  _chunks,
  _commit,
  _creation,
  _direct,
  _folders,
  _keypath,
  _location,
  _manifest,
  _pool,
  _regions,
  _reuse,
  _sealed,
  _shards,
  _together,
  _zarr,
)
from ucp_jax.store._shards import Entry as Entry
from ucp_jax.store._together import together as together


class Writer:
  """One save in progress: lock, staging location, array creation, commit.

  Used as a context manager; leaving it without `commit` (an exception, a crash)
  removes the staging data and leaves the previous checkpoint as it was.
  Converters use it directly to write logical arrays from host memory.

  Every chunk written gets its checksum recorded (`_chunks`); the commit gathers
  them from every process into the manifest and refuses to commit an array with
  a chunk nobody wrote (`_sealed`). With `durable` (the default) every file is fsynced by the
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
    base: Any = None,
    hashed: bool = False,
    pool_levels: int = 0,
  ):
    self.target = target
    self._overwrite = overwrite
    self._sync = sync or _multihost.Sync(str(target))
    self._durable = durable
    self._base = base  # the checkpoint (`_checkpoint.Checkpoint`) that reused arrays come from
    self._hashed = hashed  # record the sha256 of every chunk
    self._reused: dict[str, _manifest.ArrayInfo] = {}  # key -> its entry in the base
    self._nodes: list[Any] = []  # writes of zarr.json files still running
    self._pool = _pool.of(target, pool_levels)  # where the arrays go on an object store
    self.token = 0  # this save's, once started
    self._primary = _multihost.is_primary()
    self._lock: _commit.Lock | None = None
    self._stores: dict[str, Any] = {}
    self._arrays: dict[str, _manifest.ArrayInfo] = {}
    self._tables: dict[str, _chunks.Table] = {}
    self._inflight: list[Any] = []  # chunk writes started (direct, TensorStore): an abort waits
    self._bundle_files = _chunk_writes.BundleFiles(durable)  # local bundles being written
    self._bundle_commits = _bundle_commits.BundleCommits()  # TensorStore's, one PUT each
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
        if self._pool is not None:  # before any data: the collector spares what it names
          _pool.register(self._pool, token, [self._pool.generation(token)])
        status[:] = (1, token)
      except Exception as e:  # reported to the other processes, then raised here
        error = _location.storage_error(e, self.target, "starting the save", _together.NOTHING_LOST)
      except BaseException:  # an interrupt: the lock must not stay held by this process
        self._release()
        raise
    status = self._sync.broadcast_from_primary(status, "starting the save")
    if error is not None:
      self._release()
      raise error
    if status[0] != 1:
      raise _errors.UcpError(f"{self.target}: process 0 could not start the save (see its log)")
    self.token = int(status[1])
    if self._pool is not None:
      self.staging = self._pool.location.child(self._pool.generation(self.token))
    else:
      self.staging = _commit.staging_location(self.target, self.token)
      self._data = _commit.data_prefix(self.target, self.token)
    return self

  def together(self, what: str, fn, *args) -> Any:
    return together(self._sync, self.target, what, fn, *args)

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
    self._tables = {
      key: _chunks.Table(info.shape, info.chunks, self._hashed) for key, info in arrays.items()
    }
    if self._pool is not None:  # a reused array stays in the base's generation of the pool
      arrays = {key: info for key, info in arrays.items() if key not in self._reused}
    if self._primary:
      self.together("creating the arrays", self._create, arrays, compression)
    elif self.staging.local_dir is None:
      self.together("creating the arrays", lambda: None)
      self._stores = _creation.open_created(
        self.staging, arrays, compression=compression, durable=self._durable
      )
    else:
      self.together("creating the arrays", lambda: None)
      futures = {
        key: _zarr.open_array(self.staging, key, self._durable)
        for key in arrays
        if not self._direct(self._arrays[key])
      }
      self._stores = {key: f.result() for key, f in futures.items()}

  def _create(self, arrays: dict[str, _manifest.ArrayInfo], compression: str | None) -> None:
    self._stores, self._nodes = _creation.create_arrays(
      self.staging,
      self.target,
      arrays,
      compression=compression,
      durable=self._durable,
      direct={k for k in arrays if self._direct(self._arrays[k])},
      started=self._inflight,
    )

  def _direct(self, info: _manifest.ArrayInfo) -> bool:
    """Whether `info`'s chunks are written as files, without TensorStore (`_write`)."""
    return self.staging.local_dir is not None and info.compression is None and _direct.ENABLED

  def confirm_reuse(self, entries: list[Entry]) -> list[Entry]:
    """The entries, reuse kept where the base's data can be taken: on a local disk always
    (a region whose files the base lost is written instead, `_link_reused`); on an object
    store where the base's generation in the pool is registered as used by this save and
    neither condemned nor deleted by a collector (`_pool`)."""
    if self.target.local_dir is not None:
      self._reused = {e.key: self._base[e.key] for e in entries if e.reuse}
      return entries
    if self._pool is None or not any(e.reuse for e in entries):
      return [dataclasses.replace(e, reuse=False) if e.reuse else e for e in entries]
    flags = np.array([e.reuse for e in entries], dtype=np.uint8)
    if self._primary:
      flags = self.together("taking the base's arrays", self._confirm, entries, flags)
    else:
      self.together("taking the base's arrays", lambda: None)
    flags = self._sync.broadcast_from_primary(flags, "taking the base's arrays")
    lost = [e.key for e, f in zip(entries, flags) if e.reuse and not f and _shards.no_data(e)]
    self.together("taking the base's arrays", _refuse_lost, self.target, lost)
    entries = [dataclasses.replace(e, reuse=bool(f)) for e, f in zip(entries, flags)]
    self._reused = {e.key: self._base[e.key] for e in entries if e.reuse}
    return entries

  def _confirm(self, entries: list[Entry], flags: np.ndarray) -> np.ndarray:
    by_generation: dict[str, list[str]] = {}
    for e in entries:
      if e.reuse:
        by_generation.setdefault(self._base[e.key].at, []).append(e.key)
    own = self._pool.generation(self.token)
    _pool.register(self._pool, self.token, [own, *sorted(by_generation)])
    usable = {g for g, keys in by_generation.items() if _pool.usable(self._pool, g, keys)}
    return np.array([e.reuse and self._base[e.key].at in usable for e in entries], dtype=np.uint8)

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
    rewritten = self._link_reused([e for e in entries if e.reuse])
    entries = [e for e in entries if not e.reuse] + rewritten
    pending: list[tuple[Any, int]] = []
    held = 0
    for entry, index, data, origin in _shards.owned_shards(entries, self._primary):
      device = isinstance(entry.value, _shards.DeviceArray)
      nbytes = (
        0  # a CPU device's buffer is written in place: no host copy to bound
        if device and entry.value.in_host_memory
        # the host holds all of `data` (a whole shard) while one slab of it is written
        else int(np.prod([s.stop - s.start for s in origin], dtype=np.int64))
        * np.dtype(entry.info.dtype).itemsize
      )
      while pending and held + nbytes > max_host_bytes:
        future, n = pending.pop(0)
        future.result()
        held -= n
      host = _shards.slab(np.asarray(data), index, origin)
      immutable = device or entry.owned is not None  # never changes
      pending.append((self._write(entry.key, host, index, immutable), nbytes))
      held += nbytes
    for future, _ in pending:
      future.result()

  def _link_reused(self, entries: list[Entry]) -> list[Entry]:
    """Links the base's files of the reused arrays' regions this process owns (a local
    staging folder; on an object store the manifest references them). Returns entries to
    write instead for the regions the base could not give (a file missing or not regular)."""
    if not entries or self.staging.local_dir is None:
      return []
    return _reuse.link_owned(
      self._base,
      self.staging.local_dir,
      entries,
      primary=self._primary,
      durable=self._durable,
      started=self._inflight,
      target=self.target,
    )

  def _write(self, key: str, host: np.ndarray, index: tuple[slice, ...], immutable: bool):
    """Starts writing `host` into the region `index` of `key`; returns something to wait on."""
    if len(self._inflight) > 4096:  # keep the list short without scanning it per shard
      self._inflight = [f for f in self._inflight if not f.done()]
    info = self._arrays[key]
    table = self._tables[key]
    if self._direct(info):
      futures = _chunk_writes.write_region(
        os.path.join(self.staging.local_dir, key),
        host,
        index,
        info.chunks,
        info.shape,
        record=table.set,
        durable=self._durable,
        bundle=info.bundle,
        files=self._bundle_files,
      )
      self._inflight += futures
      return _AllOf(futures)
    for chunk in _chunks.chunks_in(index, info.chunks):
      region = _chunks.chunk_region(chunk, info.chunks, info.shape)
      raw = _chunks.raw_bytes(_chunks.padded(host[_regions.relative(region, index)], info.chunks))
      table.set(chunk, crc32c.crc32c(raw), raw)
    store = self._stores[key]
    if info.bundle is not None:
      futures = self._bundle_commits.write(key, store, info, index, host, immutable)
      self._inflight += futures  # an abort waits for them before removing the staging
      return _AllOf(futures)
    future = store[index].write(host, can_reference_source_data_indefinitely=immutable).commit
    self._inflight.append(future)  # an abort waits for it before removing the staging
    return future

  def write_array(self, key: str, value: np.ndarray, index: tuple[slice, ...] | None = None):
    """Starts writing host data into `key` (all of it, or the chunk-aligned region `index`;
    every chunk of a bundle must be written by one process, in one or several calls).

    Returns an object whose `.result()` waits for the write.
    """
    if index is None:
      index = tuple(slice(0, d) for d in self._arrays[key].shape)
    return self._write(
      key, np.asarray(value), _regions.normalize(index, self._arrays[key].shape), False
    )

  def commit(self, manifest: _manifest.Manifest) -> None:
    """Writes the manifest and makes the checkpoint visible, once every process is done."""
    self.together("writing", self._bundle_commits.check_complete, str(self.target))
    raw = _chunks.pack_entries(self._tables, self._hashed)
    entries = self._sync.gather_to_primary(raw, "gathering checksums")
    if self._primary:
      self.together("the commit", self._commit, manifest, entries)
    else:
      self.together("the commit", lambda: None)
    self.staging = None

  def _commit(self, manifest: _manifest.Manifest, entries: list[bytes]) -> None:
    for write in self._nodes:
      write.result()
    _sealed.merge_tables(self.target, self._tables, entries, self._reused, self._hashed)
    manifest = _sealed.sealed_manifest(
      manifest,
      self._arrays,
      self._tables,
      self._reused,
      pool=self._pool,
      token=self.token,
      data=self._data,
      durable=self._durable,
    )
    if self._durable and self.staging.local_dir is not None:
      _folders.fsync(_folders.array_dirs(self.staging.local_dir, self._arrays))
    try:
      _commit.commit(self.staging, self.target, manifest.to_bytes(), durable=self._durable)
    except BaseException:
      if self.staging.local_dir is None:  # a manifest PUT may land after it failed: its data
        self.staging = None  # stays for the next save's collector, which keeps what is live
      raise
    self.staging = None  # committed: what follows may fail, and leave garbage, nothing else
    if self.target.local_dir is None:
      _commit.after_remote_commit(self.target, self._data, self._replaced)
      _sealed.collect_after_commit(self.target, self._pool, self._replaced)

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      if exc_type is not None:
        self._wait_inflight()  # no chunk may land in the staging folder after it is gone
      if exc_type is not None and self._primary and self.staging is not None:
        if self._pool is not None:
          _commit.tidy(
            self.target, "removing this save's data", _pool.abort, self._pool, self.token
          )
        else:
          _commit.abort(self.staging, self.target)  # puts back an old checkpoint left aside
    finally:
      self._bundle_files.close()  # those a failed save left open
      self._release()

  def _release(self) -> None:
    if self._lock is not None:
      self._lock.release()
      self._lock = None


def _refuse_lost(target: _location.Location, lost: list[str]) -> None:
  if lost:
    raise _errors.UcpError(
      f"{target}: a collector of the pool deleted the base's data of these unchanged arrays "
      "during this save_async, which holds no copy of them; save again:\n"
      + _errors.bullet_list(lost)
    )


class _AllOf:
  """Waits for several futures as one."""

  def __init__(self, futures):
    self._futures = futures

  def result(self):
    for f in self._futures:
      f.result()
