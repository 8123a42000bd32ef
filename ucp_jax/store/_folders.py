"""The folders and group nodes of a checkpoint being written.

zarr v3 group nodes for the root and every inner path (so zarr readers can walk the tree),
and every folder a local save creates, which a durable save fsyncs before its commit.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import numpy as np

from ucp_jax.store import _chunk_writes, _chunks, _location, _manifest, _swap, _threads


def array_dirs(root: str, arrays: dict[str, _manifest.ArrayInfo]) -> set[str]:
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


def fsync(dirs: set[str]) -> None:
  futures = [_threads.submit(_fsync_if_present, d) for d in dirs]
  for f in futures:
    f.result()


def _fsync_if_present(path: str) -> None:
  with contextlib.suppress(FileNotFoundError):
    _swap.fsync_dir(path)


def write_groups(location: _location.Location, keys: list[str], durable: bool = True) -> None:
  """zarr v3 group nodes for the root and every inner path, so zarr readers can walk the tree."""
  groups = {""}
  for key in keys:
    parts = key.split("/")
    groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
  names = {
    f"{group}/zarr.json" if group else "zarr.json": group_json(not group) for group in groups
  }
  if location.local_dir is not None:
    root = location.local_dir
    futures: list[Any] = [  # (a file's, or an object's write)
      _threads.submit_or_run(write_file, os.path.join(root, name), raw, durable)
      for name, raw in names.items()
    ]
  else:
    store = _location.kvstore(location, durable)
    futures = [store.write(name, raw) for name, raw in names.items()]
  for f in futures:
    f.result()


def write_file(path: str, data: bytes, durable: bool) -> None:
  """A small file of a new checkpoint (a `zarr.json`), its folders made; fsynced if `durable`."""
  _chunk_writes.makedirs(os.path.dirname(path))
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
  try:
    view = memoryview(data)
    while view:
      view = view[os.write(fd, view) :]
    if durable:
      os.fsync(fd)
  finally:
    os.close(fd)


def group_json(root: bool) -> bytes:
  attributes = {"ucp_jax": {"format_version": _manifest.FORMAT_VERSION}} if root else {}
  return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes}).encode()
