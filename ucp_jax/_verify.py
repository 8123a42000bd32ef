"""Reads every chunk of a checkpoint back and checks it against the manifest."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np

from ucp_jax import _reader, _store

_BLOCK_BYTES = 64 << 20


def verify(
  ckpt: _reader.Checkpoint, on_array: Callable[[str, int], None] | None = None
) -> dict[str, str]:
  """Problems found, by key (empty when the checkpoint is sound).

  Checks, for every array: the zarr metadata agrees with the manifest, every
  chunk is present, and every chunk reads back with a valid crc32c checksum.
  `on_array(key, nbytes)` is called after each array, for progress reporting.
  """
  problems: dict[str, str] = {}
  kvstore = _store.kvstore(ckpt.location)
  for key in ckpt.keys():
    info = ckpt[key]
    try:
      problem = _check_array(ckpt, kvstore, key)
    except Exception as e:  # report every bad key, not just the first
      problem = _store.error_text(e).removeprefix(f"{ckpt.location}: `{key}`: ")
      problem = problem.removeprefix("cannot read stored data: ")
    if problem:
      problems[key] = problem
    if on_array is not None:
      on_array(key, info.nbytes)
  return problems


def _check_array(ckpt: _reader.Checkpoint, kvstore, key: str) -> str | None:
  info = ckpt[key]
  store = ckpt.tensorstore(key)
  if tuple(store.shape) != info.shape or store.dtype.numpy_dtype != np.dtype(info.dtype):
    return (
      f"stored as {tuple(store.shape)} {store.dtype.numpy_dtype}, "
      f"manifest says {info.shape} {info.dtype}"
    )
  chunks = info.chunks
  expected = (
    math.prod(-(-d // c) for d, c in zip(info.shape, chunks)) if math.prod(info.shape) else 0
  )
  if info.shape:
    listed = kvstore.list(_prefix_range(f"{key}/c")).result()
    found = {k.decode().removeprefix(f"{key}/") for k in listed}
  else:  # the one chunk of a 0-d array is the key `c` itself
    found = {"c"} if kvstore.read(f"{key}/c").result().state == "value" else set()
  if len(found) < expected:
    return f"{expected - len(found)} of {expected} chunks missing: {_missing(ckpt, key, found)}"
  step = max(1, _BLOCK_BYTES // max(1, math.prod(info.shape[1:]) * np.dtype(info.dtype).itemsize))
  if info.shape:
    step = max(chunks[0], step - step % chunks[0])
    n = info.shape[0]
    blocks = [store[i : min(i + step, n)] for i in range(0, n, step)]
  else:
    blocks = [store]
  pending = []
  for block in blocks:  # a few blocks in flight: bounded memory, overlapped reads
    pending.append(block.read())
    if len(pending) >= 4:
      _reader.wait_read(ckpt.location, key, pending.pop(0))
  for f in pending:
    _reader.wait_read(ckpt.location, key, f)
  return None


def _missing(ckpt: _reader.Checkpoint, key: str, found: set[str], limit: int = 3) -> str:
  """The first few missing chunk files, by path (`found`: the chunk keys present)."""
  info = ckpt[key]
  grid = [range(-(-d // c)) for d, c in zip(info.shape, info.chunks)]
  names = ("/".join(["c", *map(str, index)]) for index in itertools.product(*grid))
  missing = list(itertools.islice((n for n in names if n not in found), limit + 1))
  shown = [f"{ckpt.location}/{key}/{name}" for name in missing[:limit]]
  return ", ".join(shown) + (", ..." if len(missing) > limit else "")


def _prefix_range(prefix: str):
  import tensorstore as ts

  return ts.KvStore.KeyRange(prefix + "/", prefix + "0")
