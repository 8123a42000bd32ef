"""`save`: a pytree on any mesh -> a committed checkpoint, each process writing its own shards."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

import jax
import numpy as np

from ucp_jax.base import _errors, _multihost
from ucp_jax.store import (
  _bundle,
  _checkpoint,
  _keypath,
  _location,
  _manifest,
  _owners,
  _pool,
  _untrusted,
  _zarr,
)
from ucp_jax.store._writer import Entry
from ucp_jax.store._writer import Writer as Writer
from ucp_jax.store._writer import together as _together
from ucp_jax.tree import _device_arrays, _options, _pending, _tree, _unchanged
from ucp_jax.tree._options import SaveOptions

DEFAULT_HOST_BYTES = _options.DEFAULT_HOST_BYTES

PY_SCALARS = {bool: ("bool", np.bool_), int: ("int", np.int64), float: ("float", np.float64)}
PY_SCALARS[complex] = ("complex", np.complex128)


def save(
  path: str | os.PathLike,
  tree: Any,
  *,
  step: int | None = None,
  metadata: dict | None = None,
  overwrite: bool = False,
  compression: str | None = None,
  max_host_bytes: int = DEFAULT_HOST_BYTES,
  chunk_bytes: int = _zarr.CHUNK_BYTES,
  bundle_bytes: int | Literal["auto"] | None = "auto",
  durable: bool = True,
  schema: dict | None = None,
  source: dict | None = None,
  base: str | os.PathLike | _checkpoint.Checkpoint | None = None,
  unchanged: _unchanged.Unchanged = "identity",
) -> str:
  """Saves a pytree as a universal checkpoint.

  Leaves may be `jax.Array`s on any mesh and sharding (typed PRNG keys included),
  numpy arrays and scalars, and Python `bool`/`int`/`float`/`complex`; Flax NNX
  `Variable`s are looked through. Every process of a multi-process run calls
  `save` with its part of the same global arrays. Each shard is written once: a
  shard replicated over several processes is split into slabs along chunk
  boundaries, one per process that holds it (with one process, replica 0 writes
  it); nothing is gathered, and process 0 commits once all have written.
  A `save_async` still running is waited for first.

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
    overwrite: replace an existing checkpoint at `path`, atomically: a failed or killed
      save leaves the old one readable.
    compression: None (default: the disk is faster than the codec) or "zstd".
    max_host_bytes: bound on array bytes held in host memory at once.
    chunk_bytes: largest zarr chunk; chunks align to the shards and split below this.
    bundle_bytes: largest bundle of chunks stored as one file (zarr's sharding codec): the
      chunks each process holds of an array go in one file, or several when it is larger
      than this. "auto": 256 MiB on a local disk, 16 MiB on an object store (each bundle is
      one PUT: smaller ones keep more in flight). None writes one file per chunk.
    durable: fsync every file and directory before the commit (the default), so that a
      committed checkpoint survives a power loss or kernel crash; False skips the
      fsyncs (faster, for checkpoints that are cheap to lose).
    schema: universal parameter schema (filled by the Flax/Optax helpers).
    source: description of where the state came from (filled by converters).
    base: an earlier checkpoint (a path, or an opened one): arrays unchanged since it are
      not written again; the new checkpoint takes the base's files (hard links on a local
      disk, references into a shared pool on object stores) and stays complete on its
      own: deleting or overwriting the base never breaks it (docs/format.md).
    unchanged: how an array is known unchanged since `base`. `"identity"`: the same
      `jax.Array` object as this process saved in the base (or restored from it), which
      costs nothing; `"sha256"`: also arrays whose chunks hash as the base recorded (a
      host copy and a hash of every chunk; the checkpoint records the sha256 of every
      chunk, for the next save to compare with).

  Returns:
    The checkpoint's location as a string.

  Raises:
    CheckpointExistsError: a checkpoint (or a file, or a directory that is not a
      checkpoint) is at `path`, and `overwrite` is False where it is a checkpoint.
    ConcurrentWriteError: another save holds `path`.
    UnsupportedLeafError: a leaf is none of the kinds above.
    InvalidKeyError: a leaf's name no file system can hold.
    InvalidArgumentError: an option out of range (`compression`, `chunk_bytes`,
      `unchanged`, metadata that is not JSON, a `base` that is not a ucp_jax checkpoint).
    StorageError: the disk or store failed (full, permission denied, not answering).
    Exception: the error of an earlier `save_async` of this process that failed and that
      nobody has seen yet (through its handle's `result`, `wait_until_finished` or
      another save) is raised here, as it was raised in the background, before anything
      is written.
  """

  options = SaveOptions.of(locals())  # every keyword above
  return run(path, tree, options)


@dataclasses.dataclass(frozen=True)
class Agreed:
  """A save agreed with the other processes: what each array is, which the base gives."""

  target: _location.Location
  sync: _multihost.Sync
  entries: list[Entry]
  manifest: _manifest.Manifest
  base: _checkpoint.Checkpoint | None  # opened
  pool_levels: int
  leaves: dict[str, Any]  # the flattened tree, by key


def agree(path: str | os.PathLike, tree: Any, options: SaveOptions, *, copies=None) -> Agreed:
  """Agrees on a save of `tree` to `path` with the other processes (every one calls it): the
  entries and manifest, the entries unchanged since `options.base` marked for reuse, and
  agreed. `copies(entries)`, when given, runs in the same agreement on the entries of the
  arrays to be written (`save_async`'s host copies); a tree (or a base) rejected on one
  process only stops every process, none left waiting."""
  options = options.checked()
  target = _location.resolve(path)
  sync = _multihost.Sync(str(target))
  leaves: dict[str, Any] = {}
  found: dict[str, Any] = {}

  def marked() -> tuple[list[Entry], _manifest.Manifest]:
    bundle_bytes = options.bundle_limit(target.local_dir is not None)
    entries, manifest = prepare(
      tree,
      step=options.step,
      metadata=options.metadata,
      chunk_bytes=options.chunk_bytes,
      bundle_bytes=bundle_bytes,
      schema=options.schema_json,
      source=options.source,
      leaves=leaves,
    )
    base = found["base"] = None if options.base is None else _unchanged.open_base(options.base)
    levels = found["levels"] = _pool.levels_for(target, base, options.pool_levels)
    entries = _unchanged.mark(
      entries,
      leaves,
      base,
      target,
      unchanged=options.unchanged,
      compression=options.compression,
      pool_levels=levels,
    )
    if base is None and copies is not None:  # nothing to agree on: copy every shard now
      entries = copies(entries)
    return entries, manifest

  entries, manifest = _together(sync, target, "checking the tree", marked)
  base = found["base"]
  if base is not None:  # copies only of what the processes agree to write
    entries = _unchanged.agree(sync, entries)
    if copies is not None:
      entries = _together(sync, target, "copying the state", copies, entries)
  return Agreed(target, sync, entries, manifest, base, found["levels"], leaves)


def run(path: str | os.PathLike, tree: Any, options: SaveOptions) -> str:
  """`save` with its options as one value."""
  _pending.wait_until_finished()  # the async save before this one, and its error
  agreed = agree(path, tree, options)
  token = write(agreed, options)
  _unchanged.remember(token, _unchanged.identities(agreed.leaves))
  return str(agreed.target)


def prepare(
  tree: Any,
  *,
  step: int | None,
  metadata: dict | None,
  chunk_bytes: int,
  bundle_bytes: int | None = _bundle.BUNDLE_BYTES,
  schema: dict | None,
  source: dict | None,
  leaves: dict | None = None,
) -> tuple[list[Entry], _manifest.Manifest]:
  """What `save` writes: an entry per leaf, and the manifest (raises for bad leaves).

  `leaves`, when given, is filled with the flattened tree (key -> leaf).
  """
  _zarr.check_chunk_bytes(chunk_bytes)
  _bundle.check_limit(bundle_bytes)
  flat, _ = _tree.flatten(tree)
  if leaves is not None:
    leaves.update(flat)
  entries = _entries(flat, chunk_bytes, bundle_bytes)
  manifest = _manifest.Manifest(
    arrays={e.key: e.info for e in entries},
    tree=_keypath.structure(list(flat)),
    step=None if step is None else int(step),
    metadata=_json_checked(metadata or {}, "metadata"),
    source=source or _jax_source(entries),
    schema=schema,
  )
  return entries, manifest


def write(agreed: Agreed, options: SaveOptions) -> str:
  """Creates, writes and commits the checkpoint `plan` agreed, with the other processes.

  Entries marked `reuse` take their files from the base; on an object store the arrays go
  to the pool `agreed.pool_levels` folders up. Returns the save's token.
  """
  with Writer(
    agreed.target,
    overwrite=options.overwrite,
    sync=agreed.sync,
    durable=options.durable,
    base=agreed.base,
    hashed=options.hashed,
    pool_levels=agreed.pool_levels,
  ) as writer:
    entries = writer.confirm_reuse(agreed.entries)
    writer.create({e.key: e.info for e in entries}, compression=options.compression)
    writer.write_entries(entries, options.max_host_bytes)
    writer.commit(agreed.manifest)
  return f"{writer.token:016x}"


def _entries(flat: dict[str, Any], chunk_bytes: int, bundle_bytes: int | None) -> list[Entry]:
  """Classifies every leaf, collecting every unsupported one before raising."""
  entries, bad = [], []
  for key, leaf in flat.items():
    entry = _entry(key, leaf, chunk_bytes, bundle_bytes)
    if entry is None:
      bad.append(f"{key}: {type(leaf).__module__}.{type(leaf).__qualname__}")
    else:
      entries.append(entry)
  if bad:
    raise _errors.UnsupportedLeafError(
      "cannot save these leaves (supported: jax.Array, numpy arrays, Python numbers):\n"
      + _errors.bullet_list(bad)
    )
  bad = _keypath.problems(flat)
  if bad:
    raise _errors.InvalidKeyError(
      "these tree paths cannot name arrays in a checkpoint (rename the leaves):\n"
      + _errors.bullet_list(bad)
    )
  return entries


def _entry(key: str, leaf: Any, chunk_bytes: int, bundle_bytes: int | None) -> Entry | None:
  kind, python_type, impl, writers = "array", None, None, 1
  if isinstance(leaf, jax.Array):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      kind, impl = "prng_key", str(jax.random.key_impl(leaf))
      leaf = jax.random.key_data(leaf)
    shard_shape = leaf.sharding.shard_shape(leaf.shape)
    block = _owners.block_shape(leaf.sharding, leaf.shape) or shard_shape
    writers = _owners.writers(leaf.sharding, leaf.shape)
    value = leaf
  elif type(leaf) in PY_SCALARS:
    python_type, np_type = PY_SCALARS[type(leaf)]
    kind, value = "scalar", np.asarray(leaf, dtype=np_type)
    shard_shape = block = ()
  elif isinstance(leaf, (np.ndarray, np.generic)):
    value = np.asarray(leaf)
    shard_shape = block = value.shape
  else:
    return None
  if not _storable(value.dtype):
    return None
  dtype = np.dtype(value.dtype)
  shape = tuple(int(d) for d in value.shape)
  chunks = _zarr.choose_chunks(shape, shard_shape, dtype.itemsize, chunk_bytes)
  info = _manifest.ArrayInfo(
    shape=shape,
    dtype=_zarr.zarr_dtype(dtype),
    chunks=chunks,
    bundle=_bundle.choose(shape, block, chunks, dtype.itemsize, bundle_bytes, writers),
    kind=kind,
    python_type=python_type,
    prng_impl=impl,
  )
  return Entry(key, info, _device_arrays.Sharded(value) if isinstance(value, jax.Array) else value)


def _storable(dtype) -> bool:
  try:
    _zarr.zarr_dtype(np.dtype(dtype))
  except (TypeError, ValueError):
    return False
  return True


def _json_checked(obj: Any, what: str) -> Any:
  """`obj`, once it is known that a reader will take it back from the manifest: JSON with
  no NaN or lone surrogates, nested no deeper than readers accept."""
  import json

  try:
    text = json.dumps(obj, allow_nan=False, ensure_ascii=False).encode()
  except (TypeError, ValueError, RecursionError) as e:
    raise _errors.InvalidArgumentError(f"{what} must be JSON-serializable: {e}") from e
  # the manifest holds it one level down
  _untrusted.check_json_text(
    text, what, _errors.InvalidArgumentError, max_depth=_untrusted.MAX_JSON_DEPTH - 1
  )
  return obj


def _jax_source(entries: list[Entry]) -> dict:
  meshes = []
  for e in entries:
    if not isinstance(e.value, _device_arrays.Sharded):
      continue
    mesh = getattr(e.value.array.sharding, "mesh", None)
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
