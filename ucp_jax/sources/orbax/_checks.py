"""What the Orbax reader checks before TensorStore touches an item's files.

TensorStore reads an Orbax item's arrays itself (zarr metadata, chunks, the OCDBT manifest
and data files), so nothing it would block on, crash on or allocate without bound may reach
it:
- `check_local_files`: on a local disk (a path or a `file://` URL), every entry below the item
  is a regular file or a folder (a FIFO in place of a chunk blocks a read forever), and every
  link stays inside the item (`_untrusted.check_inside`): one `os.scandir` walk;
- `metadata_problems`: each array's zarr metadata (`.zarray`, `zarr.json`), read first through
  the kvstore TensorStore will read it from (the OCDBT database, an object store), is small
  and shallow enough for TensorStore's JSON parser, which recurses on the C stack;
- `array_problem`: an opened array's shape is one an array can have, its chunks are no larger
  than it, and a chunk (which any read touching it decodes whole) and a shard's index fit in
  the memory this process can allocate.
"""

from __future__ import annotations

import math
import os
import stat

import numpy as np
import tensorstore as ts

from ucp_jax.base import _errors
from ucp_jax.store import _untrusted
from ucp_jax.store._location import error_text

MAX_ZARR_METADATA_BYTES = 1 << 20
"""The most one array's `.zarray` or `zarr.json` may hold (Orbax writes under 1 KB)."""
SHARD_INDEX_ENTRY_BYTES = 16  # zarr v3 `sharding_indexed`: an offset and a length per chunk


def check_local_files(folder: str) -> None:
  """Raises unless every entry below `folder` is a regular file or a folder, and every link
  points inside `folder` (followed once: a linked folder is walked too, never twice).

  Raises:
    SourceFormatError: naming the first entry that is not (a FIFO, a device, a socket, a
      link out of the item).
  """
  seen: set[tuple[int, int]] = set()
  stack = [folder]
  while stack:
    with os.scandir(stack.pop()) as entries:
      for entry in entries:
        if entry.is_symlink():
          _untrusted.check_inside(entry.path, folder)
          try:
            info = os.stat(entry.path)
          except OSError:
            continue  # a broken link: nothing to read there (TensorStore says what is missing)
          mode = info.st_mode
          if stat.S_ISDIR(mode) and (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            stack.append(entry.path)
          elif not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            _refuse(entry.path, mode)
        elif entry.is_dir(follow_symlinks=False):
          stack.append(entry.path)
        elif not entry.is_file(follow_symlinks=False):
          _refuse(entry.path, entry.stat(follow_symlinks=False).st_mode)


def _refuse(path: str, mode: int) -> None:
  raise _errors.SourceFormatError(f"{path}: {_untrusted.not_regular(mode)}; refusing to read it")


def metadata_problems(
  kvstore: dict, names: list[str], document: str, shown: dict[str, str], context: ts.Context
) -> dict[str, str]:
  """Array name -> why its zarr metadata must not reach TensorStore's parser (without the
  document's name, which `shown` gives).

  Args:
    kvstore: the spec of the kvstore TensorStore opens the arrays from (an OCDBT database,
      a local folder, an object store prefix).
    names: the arrays' names in it.
    document: `.zarray` or `zarr.json`.
    shown: name -> where the document is, as messages print it.
    context: TensorStore's context for the reads (the one the arrays are then opened in,
      so that an OCDBT database's nodes are read once).

  A document that cannot be read is not a problem here: opening the array says why.
  """
  try:
    store = ts.KvStore.open(kvstore, context=context).result()
  except ValueError:
    return {}  # opening the arrays says why
  keys = {name: f"{name}/{document}" for name in names}
  limit = MAX_ZARR_METADATA_BYTES
  probes = {name: store.read(key, byte_range=slice(limit, limit + 1)) for name, key in keys.items()}
  small = []
  problems = {}
  for name, probe in probes.items():
    try:
      if probe.result().state == "value":
        problems[name] = f"larger than {limit} bytes, more than zarr metadata holds"
        continue
    except ValueError as e:
      if "OUT_OF_RANGE" not in error_text(e):
        continue  # missing or unreadable
    small.append(name)
  reads = {name: store.read(keys[name]) for name in small}
  for name, read in reads.items():
    try:
      result = read.result()
    except ValueError:
      continue
    if result.state != "value":
      continue
    try:
      _untrusted.check_json_text(result.value, shown[name], max_bytes=limit)
    except _errors.SourceFormatError as e:
      problems[name] = str(e).removeprefix(f"{shown[name]}: ")
  return problems


def array_problem(store: ts.TensorStore, free: int) -> str | None:
  """Why the opened array `store` must not be read (None when it may be); `free`: the bytes
  this process can allocate (`_untrusted.available_memory()`, asked once for all arrays)."""
  dtype = np.dtype(store.dtype.numpy_dtype)
  shape = tuple(store.shape)
  problem = _untrusted.shape_problem(list(shape), dtype.itemsize)
  if problem:
    return problem
  layout = store.chunk_layout
  chunk = tuple(layout.read_chunk.shape or shape)
  shard = tuple(layout.write_chunk.shape or chunk)
  if any(c > max(n, 1) for c, n in zip(shard, shape)) or any(c > s for c, s in zip(chunk, shard)):
    return f"chunks of shape {list(shard)} larger than the array {list(shape)}: not Orbax's"
  chunk_bytes = math.prod(chunk) * dtype.itemsize
  index_bytes = (
    math.prod(-(-s // c) for s, c in zip(shard, chunk)) * SHARD_INDEX_ENTRY_BYTES
    if shard != chunk
    else 0
  )
  for nbytes, what in ((chunk_bytes, "a chunk"), (index_bytes, "a shard's index")):
    if nbytes > free:
      return (
        f"{what} of shape {list(chunk if what == 'a chunk' else shard)} takes "
        f"{_gib(nbytes)}, more than the {_gib(free)} this process can allocate (any read "
        "of it decodes it whole)"
      )
  return None


def _gib(n: int) -> str:
  return f"{n / (1 << 30):.3g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.3g} MiB"
