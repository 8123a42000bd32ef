"""Creating a save's arrays in its staging location (process 0), before any chunk is written."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ucp_jax.store import _folders, _location, _manifest, _threads, _zarr


def create_arrays(
  staging: _location.Location,
  target: _location.Location,
  arrays: dict[str, _manifest.ArrayInfo],
  *,
  compression: str | None,
  durable: bool,
  direct: set[str],
  started: list,
) -> tuple[dict[str, Any], list]:
  """Creates `arrays` below `staging`, with their groups (and, on an object store, the root
  group of `target`).

  An array in `direct` (its chunks written as files, without TensorStore: `_chunk_writes`)
  gets the zarr.json TensorStore wrote for the same metadata before, without TensorStore
  (one file write instead of an open and a create).

  Returns:
    The open TensorStores of the other arrays, and the zarr.json writes still running (also
    appended to `started`, which an abort waits for); nobody reads those files before the
    commit, which waits for them.
  """
  specs = _specs(staging, arrays, compression)
  if staging.local_dir is None:
    return _create_on_object_store(staging, target, specs, durable, started)
  known = {k: _zarr.known_metadata(spec) for k, spec in specs.items() if k in direct}
  futures = {
    key: _zarr.create_array(spec, durable) for key, spec in specs.items() if known.get(key) is None
  }
  root = staging.local_dir
  writes = [
    _threads.submit_or_run(_folders.write_file, os.path.join(root, key, "zarr.json"), raw, durable)
    for key, raw in known.items()
    if raw is not None
  ]
  _folders.write_groups(staging, list(arrays), durable)
  if target.local_dir is None:  # the root group, above its generation (or pool)
    _location.kvstore(target, durable).write("zarr.json", _folders.group_json(True)).result()
  stores = {key: f.result() for key, f in futures.items()}
  started.extend(writes)
  for key in futures.keys() & known.keys():
    with open(os.path.join(root, key, "zarr.json"), "rb") as f:
      _zarr.learn_metadata(specs[key], f.read())
  return stores, writes


def _create_on_object_store(
  staging: _location.Location, target: _location.Location, specs: dict, durable: bool, started
) -> tuple[dict[str, Any], list]:
  """Each array's `zarr.json` one unconditional PUT (its retry after a lost answer changes
  nothing, where TensorStore's create is a conditional write that then fails), and the
  arrays opened on the metadata their specs say, without a request."""
  store = _location.kvstore(staging, durable)
  writes = [
    store.write(f"{key}/zarr.json", _zarr.metadata_json(spec)) for key, spec in specs.items()
  ]
  started.extend(writes)
  futures = {key: _zarr.open_assumed(spec, durable) for key, spec in specs.items()}
  _folders.write_groups(staging, list(specs), durable)
  _location.kvstore(target, durable).write("zarr.json", _folders.group_json(True)).result()
  return {key: f.result() for key, f in futures.items()}, writes


def open_created(
  staging: _location.Location,
  arrays: dict[str, _manifest.ArrayInfo],
  *,
  compression: str | None,
  durable: bool,
) -> dict[str, Any]:
  """The arrays process 0 created on an object store, opened for writing by another process
  on the metadata it knows (no request: their `zarr.json` writes may still be in flight)."""
  specs = _specs(staging, arrays, compression)
  futures = {key: _zarr.open_assumed(spec, durable) for key, spec in specs.items()}
  return {key: f.result() for key, f in futures.items()}


def _specs(staging: _location.Location, arrays: dict[str, _manifest.ArrayInfo], compression):
  return {
    key: _zarr.array_spec(
      staging,
      key,
      shape=info.shape,
      dtype=np.dtype(info.dtype),
      chunks=info.chunks,
      compression=compression,
      bundle=info.bundle,
    )
    for key, info in arrays.items()
  }
