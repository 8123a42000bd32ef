"""Which arrays of a save did not change since its base checkpoint (incremental saves).

An array is unchanged, and its stored data reused from the base (`store/_reuse`), when:
- `"identity"` (always on): the leaf is the very `jax.Array` object that this process saved
  in the base's save, or restored from it. A jax.Array is immutable, so it still holds what
  the base holds; knowing it costs nothing. An array replaced by new values, even equal
  ones, is another object, and is written. (A jitted step returns new objects for every
  output, frozen ones passed through included: keep frozen arrays out of its outputs, or
  use `"sha256"`.)
- `"sha256"` (opt-in): the sha256 of each of its chunks equals the one the base recorded
  (a save with `unchanged="sha256"` records one per chunk). It costs a host copy and a hash
  of every chunk this process holds, and catches equal arrays that are new objects (a
  restart that restored another way, numpy arrays).

And the base stores it the same way (shape, dtype, chunk grid, bundles, codec): an array
chunked otherwise is written. Each process judges the parts it holds; an array is reused
only if every process finds its parts unchanged (`agree`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Any, Literal

import jax
import numpy as np

from ucp_jax.base import _errors, _multihost
from ucp_jax.store import (
  _checkpoint,
  _chunks,
  _location,
  _pool,
  _reader,
  _regions,
  _reuse,
  _shards,
  _writer,
)
from ucp_jax.store._manifest import ArrayInfo

Unchanged = Literal["identity", "sha256"]
MODES = ("identity", "sha256")

_KEEP = 16  # saves (and restores) whose arrays are remembered, most recent first
_lock = threading.Lock()
_saved: collections.OrderedDict[str, dict[str, weakref.ref]] = collections.OrderedDict()


def check_mode(unchanged: Any) -> None:
  if unchanged not in MODES:
    raise _errors.InvalidArgumentError(
      f"unchanged={unchanged!r}: use 'identity' (the same jax.Array objects as the base's "
      "save, the default) or 'sha256' (also arrays whose chunks hash as the base's)"
    )


def open_base(base: Any) -> _reader.StoredCheckpoint:
  """The base checkpoint of an incremental save: a committed ucp_jax checkpoint.

  Raises:
    CheckpointNotFoundError, ManifestError: no readable checkpoint there.
    InvalidArgumentError: another format's checkpoint.
  """
  ckpt = _reader.open(base)
  if not isinstance(ckpt, _reader.StoredCheckpoint):
    raise _errors.InvalidArgumentError(
      f"base={base!s}: not a ucp_jax checkpoint ({type(ckpt).__name__}); an incremental save "
      "reuses the files of an earlier ucp_jax save"
    )
  return ckpt


def identities(flat: dict[str, Any]) -> dict[str, weakref.ref]:
  """The jax.Array leaves of a save, by key, held weakly (a save_async must not keep them)."""
  return {key: weakref.ref(leaf) for key, leaf in flat.items() if isinstance(leaf, jax.Array)}


def remember(token: str, saved: dict[str, weakref.ref]) -> None:
  """Records that the save (or restore) `token` holds exactly these arrays' values."""
  if not token:
    return
  with _lock:
    known = _saved.pop(token, {})
    known.update(saved)
    _saved[token] = known
    while len(_saved) > _KEEP:
      _saved.popitem(last=False)


def _same(token: str, key: str, leaf: Any) -> bool:
  with _lock:
    ref = _saved.get(token, {}).get(key)
  return ref is not None and ref() is leaf


def mark(
  entries: list[_writer.Entry],
  flat: dict[str, Any],
  base: _checkpoint.Checkpoint | None,
  target: _location.Location,
  *,
  unchanged: Unchanged,
  compression: str | None,
  pool_levels: int = 0,
) -> list[_writer.Entry]:
  """The entries, with `reuse` set on those this process finds unchanged since `base`
  (`pool_levels`: where the save's pool is, on an object store)."""
  pool = _pool.of(target, pool_levels)
  if base is None or not _reuse.reachable(base, target, pool.location if pool else None):
    return entries
  out = []
  for entry in entries:
    stored = base.manifest.arrays.get(entry.key)
    reuse = (
      stored is not None
      and _reuse.compatible(stored, entry.info, compression)
      and (
        _same(base.manifest.token, entry.key, flat[entry.key])
        or (unchanged == "sha256" and stored.hashes is not None and _hashes_equal(entry, stored))
      )
    )
    out.append(dataclasses.replace(entry, reuse=True) if reuse else entry)
  return out


def _hashes_equal(entry: _writer.Entry, stored: ArrayInfo) -> bool:
  """Whether every chunk of `entry` this process holds hashes as the base recorded."""
  info, hashes = entry.info, stored.hashes
  assert hashes is not None  # asked only of arrays whose save recorded them
  for region in _shards.owned_regions(entry, _multihost.is_primary()):
    host = _shards.region_data(entry, region)
    for chunk in _chunks.chunks_in(region, info.chunks):
      part = _chunks.chunk_region(chunk, info.chunks, info.shape)
      block = _chunks.padded(host[_regions.relative(part, region)], info.chunks)
      if _chunks.hash_of(_chunks.raw_bytes(block)) != hashes[chunk].tobytes():
        return False
  return True


def agree(sync: _multihost.Sync, entries: list[_writer.Entry]) -> list[_writer.Entry]:
  """The entries with `reuse` kept only where every process found the array unchanged."""
  if _multihost.process_count() == 1:
    return entries
  flags = np.array([e.reuse for e in entries], dtype=np.uint8)
  gathered = sync.gather_to_primary(flags.tobytes(), "agreeing on unchanged arrays")
  if gathered:  # process 0
    flags = np.bitwise_and.reduce([np.frombuffer(g, np.uint8) for g in gathered])
  flags = sync.broadcast_from_primary(flags, "agreeing on unchanged arrays")
  return [dataclasses.replace(e, reuse=bool(f)) for e, f in zip(entries, flags)]
