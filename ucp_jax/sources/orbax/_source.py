"""Orbax as a source: a checkpoint of `ocp.StandardCheckpointer`, `PyTreeCheckpointHandler`
or a `CheckpointManager` step, read in place through TensorStore (Orbax is not imported).

Each leaf is opened as the zarr array Orbax wrote (zarr v2 or v3, zstd or raw, in an OCDBT
database or a folder of its own) from the metadata alone; a restore through `ucp_jax.open`
then reads each device's slice from it, and `convert` reads one array at a time. Keys are
the leaves' pytree paths (NNX Variables looked through, `_tree_metadata`), with no prefix:
`ucp_jax.restore(path, target)` takes the target `ocp.StandardCheckpointer().restore`
would. docs/orbax.md has the layouts and what each bad input gets.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import tensorstore as ts

from ucp_jax.base import _errors
from ucp_jax.sources import _files
from ucp_jax.sources._source_plan import Plan, Tensor
from ucp_jax.sources.orbax import _checks, _folders, _train_state, _tree_metadata
from ucp_jax.store import _location, _untrusted
from ucp_jax.store._location import error_text

NAME = "orbax"
DESCRIPTION = (
  "an Orbax checkpoint folder (_METADATA, _CHECKPOINT_METADATA, manifest.ocdbt, d/; from "
  "ocp.StandardCheckpointer or PyTreeCheckpointHandler), a CheckpointManager step folder "
  "holding one such item, or a CheckpointManager folder of numbered steps (which lists them)"
)
_CONTEXT = {
  "cache_pool": {"total_bytes_limit": 0},  # array data: read once, never cached
  "cache_pool#ocdbt": {"total_bytes_limit": 64 << 20},  # the OCDBT B-tree nodes
  "file_io_concurrency": {"limit": 16},
}
"""Each `describe` opens its arrays in a context of its own: nothing cached by an earlier
open of the same path (a checkpoint Orbax has replaced since) is seen."""
_PY_TYPES = {"b": "bool", "i": "int", "u": "int", "f": "float", "c": "complex"}


def sniff(path: str) -> bool:
  """Whether `path` looks like an Orbax checkpoint, step or manager folder (names only)."""
  return _folders.looks_like(path)


def sniff_remote(url: str) -> bool:
  """`sniff` for a URL: one listing of the prefix."""
  try:
    return _folders.looks_like(url)
  except _errors.SourceFormatError:
    return False


def sniff_weak(path: str) -> bool:
  """False: a path no source recognizes is never Orbax's to explain."""
  return False


def describe(path: str, *, hyperparams: dict | list[dict] | None = None) -> Plan:
  """Every leaf of the checkpoint as a lazily read array, from the metadata only.

  Args:
    path: an Orbax item folder, a `CheckpointManager` step folder with one pytree item.
    hyperparams: for a training state (docs/orbax.md), the optimizer's hyperparameters
      (`{"lr": ..., "weight_decay": ...}`, or one dict per parameter group) for the
      schema an export reads; default: those `optax.inject_hyperparams` stored, if any.

  Raises:
    CheckpointNotFoundError: a save that did not finish.
    SourceFormatError: a manager folder (the message lists the steps), a missing OCDBT
      manifest, metadata or array files that are missing or not Orbax's (all listed).
  """
  fs = _files.for_path(path)
  item = _folders.find(path, fs)
  local = _folders.local_path(fs, item.folder)
  if local is not None:  # nothing TensorStore would block on, no link out of the item
    _checks.check_local_files(local)
  meta = _tree_metadata.read(item.folder, fs)
  manifest = os.path.join(item.folder, _folders.OCDBT_MANIFEST)
  if meta.use_ocdbt and not _folders.present(fs, manifest):
    first = f" (`{meta.leaves[0].key}`, ...)" if meta.leaves else ""
    raise _errors.SourceFormatError(
      f"{manifest}: missing: the OCDBT manifest that indexes all {len(meta.leaves)} arrays"
      f"{first} of this checkpoint (`use_ocdbt` in {_folders.TREE_METADATA})"
    )
  tensors = _open_all(meta, fs.kvstore_spec(item.folder))
  state = _train_state.infer(tensors, hyperparams)
  step = item.step if item.step is not None else state.step
  variables = [leaf.key for leaf in meta.leaves if leaf.variable]
  source: dict[str, Any] = {
    "framework": "orbax",
    "format": NAME,
    "ocdbt": meta.use_ocdbt,
    "zarr": 3 if meta.use_zarr3 else 2,
    "orbax_tree": {  # what an Orbax export needs to write the same tree (sinks._orbax)
      "nnx_variables": "all" if len(variables) == len(meta.leaves) > 0 else variables,
      "sequences": meta.sequences,
      "empty": meta.empty,
    },
  }
  if item.step is not None:
    source["manager_step"] = {"step": item.step, "item": item.name}
  if meta.not_read:
    source["not_read"] = meta.not_read  # strings and other non-array leaves
  return Plan(
    params=[],
    buffers={},
    optimizer=None if state.schema is None else state.schema.optimizer,
    extra={},
    source=source,
    step=step,
    path=item.folder,
    format=NAME,
    arrays=tensors,
    schema=state.schema,
    # zstd turns a fresh optimizer's zeros into almost nothing: allow a codec's ratio, not 4x.
    max_growth=MAX_COMPRESSION_RATIO,
  )


MAX_COMPRESSION_RATIO = 1032.0
"""How much larger than its files an Orbax checkpoint's arrays may be (deflate's limit, as the
torch reader's zip bound: zstd of all-zero chunks reaches it, forged metadata goes past it)."""


def _open_all(meta: _tree_metadata.TreeMetadata, folder: dict) -> dict[str, Tensor]:
  """Opens every leaf's array (metadata reads only, all at once); lists every failure.

  `folder` is the kvstore spec of the item folder.
  """
  # Resources it does not name (a `memory://` store's data, credentials) are ucp_jax's own.
  context = ts.Context(_CONTEXT, parent=_location.context())
  document = "zarr.json" if meta.use_zarr3 else ".zarray"
  inside = " in the OCDBT database" if meta.use_ocdbt else ""
  shown = {leaf.name: f"{meta.folder}/{leaf.shown}/{document}{inside}" for leaf in meta.leaves}
  refused = _checks.metadata_problems(_kvstore(meta, folder), list(shown), document, shown, context)
  failures = _Failures()
  futures: list[tuple[Any, Any]] = []  # (leaf, an opening TensorStore or why it was refused)
  for leaf in meta.leaves:
    if leaf.name in refused:
      failures.add(refused[leaf.name], f"{shown[leaf.name]} (`{leaf.key}`)")
      continue
    try:  # TensorStore refuses some specs at once (a name it cannot take as a path)
      futures.append((leaf, ts.open(_spec(meta, folder, leaf.name), read=True, context=context)))
    except ValueError as e:
      futures.append((leaf, e))
  tensors: dict[str, Tensor] = {}
  free = _untrusted.available_memory()
  for leaf, future in futures:
    where = f"{meta.folder}/{leaf.shown} (`{leaf.key}`)"
    try:
      if isinstance(future, ValueError):
        raise future
      store = future.result()
    except ValueError as e:
      text = _errors.named(error_text(e))
      failures.add(text, where, alike=text.rsplit(": ", 1)[-1].replace(leaf.shown, "\0"))
      continue
    problem = _checks.array_problem(store, free) or _key_problem(leaf, store)
    if problem:
      failures.add(problem, where)
      continue
    tensors[leaf.key] = _tensor(leaf, store, where)
  failures.raise_any(meta.folder)
  return tensors


class _Failures:
  """The arrays that cannot be opened, by cause: arrays failing alike make one line."""

  def __init__(self) -> None:
    self._lines: dict[str, list[str]] = {}

  def add(self, problem: str, where: str, *, alike: str | None = None) -> None:
    """`where` cannot be opened for `problem`; `alike`: what other arrays failing for the
    same cause share (default: the problem)."""
    self._lines.setdefault(alike or problem, []).append(f"{where}: {problem}")

  def raise_any(self, folder: str) -> None:
    problems = [
      lines[0] if len(lines) == 1 else f"{lines[0]} (and {len(lines) - 1} more arrays alike)"
      for lines in self._lines.values()
    ]
    if len(problems) == 1:
      raise _errors.SourceFormatError(problems[0])
    if problems:
      raise _errors.SourceFormatError(
        f"{folder}: {sum(map(len, self._lines.values()))} arrays cannot be opened:\n"
        + _errors.bullet_list(problems)
      )


def _kvstore(meta: _tree_metadata.TreeMetadata, folder: dict) -> dict:
  """The kvstore that holds the arrays, each below its name."""
  if meta.use_ocdbt:
    return {"driver": "ocdbt", "base": folder, "cache_pool": "cache_pool#ocdbt"}
  return folder


def _spec(meta: _tree_metadata.TreeMetadata, folder: dict, name: str) -> dict:
  """The TensorStore spec of the array `name`, as Orbax's `ArrayReadSpec` builds it."""
  kvstore = _kvstore(meta, folder)
  return {
    "driver": "zarr3" if meta.use_zarr3 else "zarr",
    "kvstore": {**kvstore, "path": f"{kvstore.get('path', '')}{name}/"},
    "recheck_cached_data": False,
    "recheck_cached_metadata": False,
    "fill_missing_data_reads": meta.fill_missing,  # a lost chunk is an error, never zeros
  }


def _tensor(leaf: _tree_metadata.Leaf, store: ts.TensorStore, where: str) -> Tensor:
  dtype = np.dtype(store.dtype.numpy_dtype)
  info: dict[str, Any] = {}
  if leaf.prng_impl is not None:
    info = {"kind": "prng_key", "prng_impl": leaf.prng_impl}
  elif leaf.value_type == "scalar" and dtype.kind in _PY_TYPES:
    info = {"kind": "scalar", "python_type": _PY_TYPES[dtype.kind]}

  def pieces() -> list[np.ndarray]:
    _untrusted.check_allocation(math.prod(store.shape) * dtype.itemsize, where)
    try:
      return [np.asarray(store.read().result()).reshape(-1)]
    except ValueError as e:
      raise _errors.SourceFormatError(f"{where}: cannot read: {error_text(e)}") from e

  return Tensor(tuple(store.shape), dtype, pieces, where, store=store, info=info)


def _key_problem(leaf: _tree_metadata.Leaf, store: ts.TensorStore) -> str | None:
  """Why a typed PRNG key's data is not one JAX can wrap (None for any other leaf)."""
  if leaf.prng_impl is None:
    return None
  words = _tree_metadata.PRNG_KEY_SIZES[leaf.prng_impl]
  dtype, shape = np.dtype(store.dtype.numpy_dtype), tuple(store.shape)
  if dtype == np.uint32 and shape and shape[-1] == words:
    return None
  return f"{leaf.prng_impl} key data of {dtype} {list(shape)}, not uint32 [..., {words}]"
