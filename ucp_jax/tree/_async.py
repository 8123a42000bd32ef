"""`save_async`: copy the state to host memory, then write it in a background thread.

Only the device-to-host copy blocks the caller. The copies are real host copies
(never views of device buffers), so the next training step may donate or
overwrite the state while the write goes on. One async save is in flight at a
time, whatever threads call it: the next `save`/`save_async`/`wait_until_finished`
waits for it first, and raises its error, once, if nobody has seen it yet
(`_pending`). Multi-process saves agree through `jax.distributed`'s key-value store
(`_multihost.Sync`), never through device collectives, so the background thread cannot
interleave collectives with a step.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Any, Literal

import jax
import numpy as np

from ucp_jax.base import _multihost
from ucp_jax.store import (
  _checkpoint,
  _location,
  _shards,
  _writer,
  _zarr,
)
from ucp_jax.tree import _device_arrays, _devices, _pending, _save, _unchanged
from ucp_jax.tree._options import SaveOptions
from ucp_jax.tree._pending import SaveHandle as SaveHandle


@dataclasses.dataclass
class Job:
  """An agreed save whose data is in host memory: `run` writes and commits it."""

  agreed: _save.Agreed  # without its leaves: the device arrays are not kept alive
  options: SaveOptions
  arrays: dict[str, weakref.ref] = dataclasses.field(default_factory=dict)  # for `_unchanged`

  @property
  def target(self) -> _location.Location:
    return self.agreed.target

  def run(self) -> str:
    token = _save.write(self.agreed, self.options)
    _unchanged.remember(token, self.arrays)
    return str(self.target)


def save_async(
  path: str | os.PathLike,
  tree: Any,
  *,
  step: int | None = None,
  metadata: dict | None = None,
  overwrite: bool = False,
  compression: str | None = None,
  max_host_bytes: int = _save.DEFAULT_HOST_BYTES,
  chunk_bytes: int = _zarr.CHUNK_BYTES,
  bundle_bytes: int | Literal["auto"] | None = "auto",
  durable: bool = True,
  schema: dict | None = None,
  source: dict | None = None,
  base: str | os.PathLike | _checkpoint.Checkpoint | None = None,
  unchanged: _unchanged.Unchanged = "identity",
) -> SaveHandle:
  """Saves like `save`, writing in the background once the state is in host memory.

  Blocks only while this process's shards are copied from the devices to host
  memory (every copy started at once); the arrays, creation, writes and commit
  then run in a background thread, so training continues, and may donate or
  overwrite the state. Host memory holds a copy of this process's shards until
  the write is done. A later `save`, `save_async` or `wait_until_finished`, from
  any thread, first waits for this save (one is in flight at a time); if it failed,
  the first of these (or `result()`) raises its error, once, and the previous
  checkpoint at `path` is left as it was. Options are those of `save`; every process
  of a multi-process run calls it.

  Example:
    >>> import jax.numpy as jnp, ucp_jax
    >>> handle = ucp_jax.save_async("/tmp/ucp_doc_async", {"w": jnp.ones(4)}, overwrite=True)
    >>> # ... the training goes on while the checkpoint is written ...
    >>> handle.result()
    '/tmp/ucp_doc_async'

  Args:
    path: local directory or kvstore URL (`memory://`, `gs://`, `s3://`, `file://`).
    tree: the state to save.
    step: training step recorded in the manifest.
    metadata: JSON-serializable user metadata recorded in the manifest.
    overwrite: replace an existing checkpoint at `path`.
    compression: None (default) or "zstd".
    max_host_bytes: bound on bytes handed to the store at once while writing.
    chunk_bytes: largest zarr chunk.
    bundle_bytes: largest bundle of chunks in one file (see `save`; "auto": 256 MiB on a
      local disk, 16 MiB on an object store); None: a file per chunk.
    durable: fsync before the commit (see `save`).
    schema: universal parameter schema (filled by the Flax/Optax helpers).
    source: description of where the state came from (filled by converters).
    base: an earlier checkpoint whose files the unchanged arrays take (see `save`); no
      host copy is taken of those arrays.
    unchanged: how an array is known unchanged since `base` (see `save`).

  Returns:
    A `SaveHandle`: `done()`, and `result()`, which returns the checkpoint's
    location or raises the save's error.

  Raises:
    UnsupportedLeafError, InvalidKeyError, InvalidArgumentError: a bad tree or option, as
      `save` says, before anything is copied or written.
    Exception: the error of the `save_async` before this one, if it failed and nobody has
      seen it yet; this save does not start then. The background write's own errors
      (`CheckpointExistsError`, `ConcurrentWriteError`, `StorageError`, ...) come from
      `SaveHandle.result`, or else from the next `save`, `save_async` or
      `wait_until_finished`.
  """
  options = SaveOptions.of(locals())  # every keyword above
  turn = _pending.claim()  # waits for the save_async before this one (any thread's) ...
  try:  # ... and raises its error; the turn passes to the background write, or back
    job = snapshot(path, tree, options)
    handle = SaveHandle(str(job.target))
    _pending.start(turn, handle, job.run, name=f"ucp_jax.save_async {path}")
  finally:
    _pending.release(turn)
  return handle


def snapshot(path: str | os.PathLike, tree: Any, options: SaveOptions) -> Job:
  """Agrees on a save with the other processes and copies this process's shards to host memory
  (except those of arrays unchanged since the base, whose files the save takes)."""
  agreed = _save.agree(path, tree, options, copies=_host_copies)
  arrays = _unchanged.identities(agreed.leaves)
  return Job(dataclasses.replace(agreed, leaves={}), options, arrays)


def _host_copies(entries: list[_writer.Entry]) -> list[_writer.Entry]:
  """The entries with host copies of the shards this process writes, and no device arrays
  (a reused entry keeps only the regions it owns: its files come from the base)."""
  primary = _multihost.is_primary()
  owned: dict[str, list] = {
    e.key: [(region, None) for region in _shards.owned_regions(e, primary)] if e.reuse else []
    for e in entries
  }
  # _owned_shards starts every device-to-host copy before the first one is waited for.
  for entry, index, data, origin in _shards.owned_shards(entries, _multihost.is_primary()):
    host = _shards.slab(_host_copy(data), index, origin)
    if index != origin and not _devices.array_on_cpu(
      data
    ):  # keep the slab, not the whole shard's copy
      host = np.array(host, copy=True)
    owned[entry.key].append((index, host))
  return [dataclasses.replace(e, value=None, owned=tuple(owned[e.key])) for e in entries]


def _host_copy(data: Any) -> np.ndarray:
  """Host data that nothing else can change, at the least cost.

  On GPU/TPU `np.asarray` transfers into fresh host memory. On CPU it is a view of the
  device buffer, which holds the values of this call for as long as the save needs them:
  jax arrays are immutable, and XLA does not reuse a donated buffer that a view still
  references (the donating step writes its result to fresh memory instead), so nothing is
  copied before the training loop goes on. A numpy leaf is the caller's own, mutable
  array: it is copied. A copy in pinned host memory (GPUs) is this save's own.
  """
  if isinstance(data, _device_arrays.PinnedCopy):
    return np.asarray(data)
  if isinstance(data, jax.Array) and (
    _devices.on_cpu(data.sharding) or data.sharding.memory_kind in (None, "device")
  ):
    return np.asarray(data)
  return np.array(data, copy=True)
