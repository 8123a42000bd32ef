"""Reads every chunk of a checkpoint back and checks it against the manifest."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.store import _chunks, _location, _zarr

if TYPE_CHECKING:
  import tensorstore as ts

  from ucp_jax.store._direct import ArrayFiles
  from ucp_jax.store._location import Location
  from ucp_jax.store._manifest import ArrayInfo


class Verifiable(Protocol):
  """What `verify` reads of a committed checkpoint (`_reader.StoredCheckpoint`)."""

  location: Location

  def keys(self) -> list[str]: ...
  def __getitem__(self, key: str) -> ArrayInfo: ...
  def array_location(self, key: str) -> Location: ...
  def zarr_future(self, key: str) -> ts.Future: ...
  def tensorstore(self, key: str) -> ts.TensorStore: ...
  def start_read(self, key: str, regions: list) -> tuple[list, Callable[[], None]]: ...
  def files(self, key: str) -> ArrayFiles | None: ...


_BLOCK_BYTES = 64 << 20


def verify(ckpt: Verifiable, on_array: Callable[[str, int], None] | None = None) -> dict[str, str]:
  """Problems found, by key (empty when the checkpoint is sound).

  Checks, for every array: the zarr metadata agrees with the manifest, the chunk (or
  bundle) files are exactly those of the grid (none missing, none extra), and every
  chunk reads back with a valid crc32c that is the one the manifest recorded for
  its place. `on_array(key, nbytes)` is called after each array, for progress.
  """
  problems: dict[str, str] = {}
  kvstores: dict[str, object] = {}  # by data location: a pooled checkpoint uses several
  for key in ckpt.keys():
    info = ckpt[key]
    try:
      data = ckpt.array_location(key)
      if data.url not in kvstores:
        kvstores[data.url] = _location.kvstore(data)
      problem = _check_array(ckpt, kvstores[data.url], key)
    except Exception as e:  # report every bad key, not just the first
      if isinstance(e, _errors.StorageError) and ckpt.location.local_dir is None:
        raise  # an object store that does not answer says nothing of the data: no verdict
      problem = _location.error_text(e).removeprefix(f"{ckpt.location}: `{key}`: ")
      problem = problem.removeprefix("cannot read stored data: ")
    if problem:
      problems[key] = problem
    if on_array is not None:
      on_array(key, info.nbytes)
  return problems


def _check_array(ckpt: Verifiable, kvstore, key: str) -> str | None:
  info = ckpt[key]
  data = ckpt.array_location(key)
  stored = _zarr.wait_open(ckpt.location, key, ckpt.zarr_future(key))
  problem = _zarr.metadata_problem(stored, info)
  if problem:
    return problem
  store = ckpt.tensorstore(key)
  if info.shape:
    listed = kvstore.list(_location.prefix_range(f"{key}/c/")).result()
    found = {k.decode().removeprefix(f"{key}/") for k in listed}
  else:  # the one chunk of a 0-d array is the key `c` itself
    found = {"c"} if kvstore.read(f"{key}/c").result().state == "value" else set()
  grid = _chunks.grid(info.shape, info.bundle or info.chunks)
  extra = sorted(n for n in found if _grid_index(n, grid) is None)
  missing = math.prod(grid) - (len(found) - len(extra))
  if missing:
    what = "bundle files" if info.bundle else "chunks"
    return f"{missing} of {math.prod(grid)} {what} missing: {_missing(ckpt, key, found)}"
  if extra:
    shown = ", ".join(f"{data}/{key}/{name}" for name in extra[:3])
    return f"{len(extra)} files outside the chunk grid: {shown}" + (
      ", ..." if len(extra) > 3 else ""
    )
  if data.local_dir is None:  # an object store: each block's chunks in coalesced batches
    for region in _block_regions(info):
      _, wait = ckpt.start_read(key, [region])
      wait()
  else:
    pending = []
    for region in _block_regions(info):  # a few blocks in flight: bounded memory, overlap
      pending.append((store[region] if region else store).read())
      if len(pending) >= 4:
        _zarr.wait_read(ckpt.location, key, pending.pop(0))
    for f in pending:
      _zarr.wait_read(ckpt.location, key, f)
  files = ckpt.files(key)  # read without the bundles' indexes: check they agree
  bad = files.index_problems() if files is not None else []
  if bad:
    more = f"; ... ({len(bad)} in all)" if len(bad) > 3 else ""
    return "bundle indexes that zarr readers follow are wrong: " + "; ".join(bad[:3]) + more
  return None


def _block_regions(info) -> Iterator[tuple]:
  """The array in blocks of whole chunks, each about `_BLOCK_BYTES` or one chunk: rows of
  chunks when a row is small, else chunk by chunk (a row may be larger than memory)."""
  if not info.shape:
    yield ()
    return
  chunks = info.chunks
  row = math.prod(info.shape[1:]) * np.dtype(info.dtype).itemsize * chunks[0]
  if row <= _BLOCK_BYTES:
    step = chunks[0] * max(1, _BLOCK_BYTES // max(1, row))
    n = info.shape[0]
    rest = tuple(slice(0, d) for d in info.shape[1:])
    yield from ((slice(i, min(i + step, n)), *rest) for i in range(0, n, step))
    return
  for index in itertools.product(*(range(n) for n in _chunks.grid(info.shape, chunks))):
    yield _chunks.chunk_region(index, chunks, info.shape)


def _grid_index(name: str, grid: tuple[int, ...]) -> tuple[int, ...] | None:
  """The place in `grid` of the chunk (or bundle) file `name` (`c/0/1`), None if outside."""
  parts = name.split("/")
  digits = parts[1:]
  if parts[0] != "c" or len(digits) != len(grid):
    return None
  if not all(p.isascii() and p.isdigit() and str(int(p)) == p for p in digits):
    return None
  index = tuple(int(p) for p in digits)
  return index if all(0 <= i < n for i, n in zip(index, grid)) else None


def _chunk_names(info) -> Iterator[str]:
  """The chunk (or bundle) keys of an array, relative to it (`c/0/1`; `c` for a 0-d array)."""
  grid = [range(n) for n in _chunks.grid(info.shape, info.bundle or info.chunks)]
  return ("/".join(["c", *map(str, index)]) for index in itertools.product(*grid))


def _missing(ckpt: Verifiable, key: str, found: set[str], limit: int = 3) -> str:
  """The first few missing chunk files, by path (`found`: the chunk keys present)."""
  names = _chunk_names(ckpt[key])
  missing = list(itertools.islice((n for n in names if n not in found), limit + 1))
  data = ckpt.array_location(key)
  shown = [f"{data}/{key}/{name}" for name in missing[:limit]]
  return ", ".join(shown) + (", ..." if len(missing) > limit else "")
