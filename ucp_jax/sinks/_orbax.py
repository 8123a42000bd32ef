"""Orbax as a sink: a folder `ocp.StandardCheckpointer().restore` reads onto any mesh.

```
dst/_METADATA, _CHECKPOINT_METADATA, manifest.ocdbt, d/, ...   what Orbax writes: OCDBT and
                                      zarr v2 with zstd by default (StandardCheckpointer's)
dst/ucp_export.json                   {"written_by": "ucp_jax", "format": "orbax", ...}
```
Orbax itself writes the folder (`PyTreeCheckpointHandler`) from the checkpoint's tree, and
Orbax restores a tree only onto the same structure: `target=` gives the tree exactly (NNX
Variables, tuples, empty nodes); otherwise nested dicts by key, with lists, empty nodes and
NNX `value` leaves where the checkpoint records them (a checkpoint converted from Orbax, a
`save_train_state` of an NNX model), or as `nnx=True`/`False` says (docs/orbax.md). Scalars
are Orbax scalars of their stored dtype (numpy scalars where narrower than a Python number:
an `np.float32` stays float32), typed PRNG keys typed keys.

Memory: Orbax saves a tree held whole, so each array is copied, a block at a time, into a
memory-mapped scratch file beside `dst` (arrays under 1 MiB stay in memory) and Orbax writes
from those file-backed pages without copying them. With `ocdbt=False` the process's own
memory then stays near Orbax's writes in flight (measured: +65 MiB exporting 2 GiB); with
OCDBT, TensorStore's OCDBT writer holds the written data until Orbax commits, about the
checkpoint's size (+1.5 GiB for 2 GiB). The
scratch files take the checkpoint's size on disk until the export ends. One process writes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.sinks import _folder
from ucp_jax.sinks._registry import Destination, option
from ucp_jax.sinks._report import ExportReport
from ucp_jax.store import _checkpoint, _keypath, _zarr

NAME = "orbax"
TORCH_NAMES = False  # writes the checkpoint's own keys: no rule set applies
DESCRIPTION = "an Orbax checkpoint folder that ocp.StandardCheckpointer().restore reads"
SCRATCH_MIN_BYTES = 1 << 20
"""Arrays at least this large reach Orbax through a memory-mapped scratch file."""
BLOCK_BYTES = 64 << 20
"""Bytes read from the checkpoint at once into a scratch file."""
_PY_TYPES = {"bool": bool, "int": int, "float": float, "complex": complex}


def _none_or_text(text: str) -> str | None:
  return None if text.lower() in ("none", "null") else text


@dataclasses.dataclass(frozen=True)
class Options:
  """How the Orbax checkpoint is laid out, and the tree it holds.

  Attributes:
    nnx: leaves as NNX Variable values (`KEY/value`), or not; None: as the checkpoint records.
    ocdbt: one OCDBT database (Orbax's default) rather than a folder per array.
    zarr3: zarr v3 arrays rather than v2 (Orbax's default).
    compression: "zstd" (Orbax's default) or None.
    chunk_bytes: the largest chunk Orbax writes, so that a restore onto another mesh reads
      little more than each device's slice.
    target: the tree Orbax will be asked to restore onto (abstract or not; its leaves are
      only placeholders): the export writes exactly its structure (containers, NNX
      Variables, empty nodes), each leaf from the checkpoint's key for its path. Default:
      the checkpoint's keys as nested dicts, in the shape an Orbax source recorded.
  """

  nnx: bool | None = option(None, "leaves as NNX Variable values (default: as recorded)")
  ocdbt: bool = option(True, "one OCDBT database (default) rather than a folder per array")
  zarr3: bool = option(False, "zarr v3 arrays rather than v2 (Orbax's default)")
  compression: str | None = option("zstd", "zstd (default) or none", parse=_none_or_text)
  chunk_bytes: int = option(_zarr.CHUNK_BYTES, "the largest chunk Orbax writes, in bytes")
  target: Any = option(None, "the tree Orbax restores onto", flag=False)

  def __post_init__(self) -> None:
    problems = [
      f"{name}={value!r}: true or false" + (" (or None: as the checkpoint records)" if none else "")
      for name, value, none in (
        ("nnx", self.nnx, True),
        ("ocdbt", self.ocdbt, False),
        ("zarr3", self.zarr3, False),
      )
      if not (isinstance(value, bool) or (none and value is None))
    ]
    if self.compression not in (None, "zstd"):
      problems.append(f"compression={self.compression!r}: 'zstd' (Orbax's default) or None")
    chunk_bytes = self.chunk_bytes
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
      problems.append(f"chunk_bytes={chunk_bytes!r}: a positive number of bytes")
    if problems:
      raise _errors.InvalidArgumentError("; ".join(problems))


def export(
  ckpt: _checkpoint.Checkpoint, destination: Destination, options: Options | None = None
) -> ExportReport:
  """Writes every array of `ckpt` as an Orbax checkpoint of its tree.

  Args:
    ckpt: the checkpoint (any `ucp_jax.open` reads: a ucp_jax checkpoint, an Orbax folder).
    destination: the folder to create (or an earlier export to replace), and progress.
    options: the layout and tree (`Options`).

  Raises:
    TreeMismatchError: `options.target`'s keys and the checkpoint's differ (all listed).
  """
  options = Options() if options is None else options
  start = time.perf_counter()
  nnx, target = options.nnx, options.target
  ocdbt, zarr3, compression = options.ocdbt, options.zarr3, options.compression
  chunk_bytes = options.chunk_bytes
  progress = destination.progress
  dst = check_options(destination)
  keys = ckpt.keys()
  if not keys:
    raise _errors.InvalidArgumentError(f"{ckpt.location}: no arrays: Orbax saves no empty tree")
  shape = _shape_of(ckpt, nnx) if target is None else _target_shape(ckpt, target)
  total = sum(ckpt[k].nbytes for k in keys)
  with _folder.staged(dst) as staging:
    storage = (ocdbt, zarr3, compression, chunk_bytes)
    _write_tree(ckpt, keys, shape, staging, storage, progress, total)
    _folder.write_marker(staging, NAME, files=sorted(os.listdir(staging)), nnx=shape.nnx)
    for folder, _, files in os.walk(staging):
      for name in files:
        _folder.sync_file(os.path.join(folder, name))
  form = {True: "NNX Variable values (KEY/value)", False: "plain nested dicts"}.get(
    shape.nnx, "the target's tree"
  )
  layout = f"{'OCDBT' if ocdbt else 'a folder per array'}, zarr v{3 if zarr3 else 2}"
  layout += f", {compression or 'uncompressed'}"
  return ExportReport(
    path=dst,
    params=len(keys),
    step=ckpt.step,
    nbytes=total,
    seconds=time.perf_counter() - start,
    notes=(_restore_note(shape.nnx),),
    format=NAME,
    summary=f"Orbax checkpoint ({layout}): {len(keys)} arrays as {form}",
  )


def _write_tree(ckpt, keys: list[str], shape: _Shape, staging: str, storage, progress, total):
  """Orbax writes the tree of `keys` (`total` bytes) into `staging`, stored as `storage`
  says (`_save`'s ocdbt, zarr3, compression, chunk_bytes); each array from `SCRATCH_MIN_BYTES`
  up is held in a memory-mapped scratch file beside `staging` until Orbax has written it."""
  scratch = staging + ".scratch"
  os.makedirs(scratch)
  try:
    leaves = {}
    for index, key in enumerate(keys):
      leaves[key] = _leaf(ckpt, key, os.path.join(scratch, f"{index}.npy"))
      if progress is not None:
        progress(key, ckpt[key].nbytes, total)
    _save(staging, shape.build(leaves), *storage)
    del leaves
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def check_options(destination: Destination, options: Options | None = None) -> str:
  """The absolute export path, or an error: an existing folder must be an earlier Orbax export."""
  return _folder.check_destination(
    destination, not_an_export=_not_an_export, what="an Orbax export"
  )


def _not_an_export(path: str) -> list[str]:
  return _folder.foreign_entries(path, NAME, "an Orbax export", files_only=False)


@dataclasses.dataclass(frozen=True)
class _Shape:
  """How the tree Orbax saves is built from `{key: leaf}`, and whether its leaves are NNX
  Variable values (None: as the target has them)."""

  build: Callable[[dict[str, Any]], Any]
  nnx: bool | None


def _shape_of(ckpt: _checkpoint.Checkpoint, nnx: bool | None) -> _Shape:
  """Nested dicts by key; lists, empty nodes and NNX values where the checkpoint records them."""
  keys = set(ckpt.keys())
  recorded = (ckpt.manifest.source or {}).get("orbax_tree")
  recorded = recorded if isinstance(recorded, dict) else {}
  variables = recorded.get("nnx_variables")
  if nnx is not None:
    wrapped = keys if nnx else set()
  elif variables == "all":
    wrapped = keys
  elif isinstance(variables, list):
    wrapped = keys & set(variables)
  else:
    schema = ckpt.manifest.typed_schema
    nnx_state = all(k.startswith(("model/", "optimizer/")) for k in keys)
    wrapped = keys if schema is not None and schema.naming == "flax" and nnx_state else set()
  sequences = set(recorded.get("sequences") or [])
  empty = recorded.get("empty") if isinstance(recorded.get("empty"), dict) else {}

  def build(leaves: dict[str, Any]) -> Any:
    nodes = {k + "/value" if k in wrapped else k: _Leaf(v) for k, v in leaves.items()}
    nodes |= {k: _Leaf(_EMPTY.get(t)) for k, t in empty.items() if k not in nodes}
    return _nest(nodes, sequences)

  return _Shape(build, bool(wrapped))


def _target_shape(ckpt: _checkpoint.Checkpoint, target: Any) -> _Shape:
  """The target's own tree, each leaf replaced by the checkpoint's array for its key."""
  from ucp_jax.tree import _tree

  flat, unflatten = _tree.flatten(target)
  missing = sorted(set(flat) - set(ckpt.keys()))
  unexpected = sorted(set(ckpt.keys()) - set(flat))
  if missing or unexpected:
    lines = [f"{k}: in target, not in checkpoint" for k in missing]
    lines += [f"{k}: in checkpoint, not in target" for k in unexpected]
    raise _errors.TreeMismatchError(
      f"{ckpt.location}: the Orbax export's target and the checkpoint's keys differ:\n"
      + _errors.bullet_list(lines)
    )
  return _Shape(unflatten, None)


class _Leaf:
  """A leaf while the tree is built (an empty dict or list is a leaf too)."""

  def __init__(self, value: Any):
    self.value = value


_EMPTY = {"Dict": {}, "List": [], "Tuple": (), "None": None}


def _nest(nodes: dict[str, _Leaf], sequences: set[str]) -> Any:
  """Nested dicts holding `nodes` by key; lists for the keys in `sequences`."""
  root: dict = {}
  for key, leaf in nodes.items():
    parts = key.split("/")
    node = root
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = leaf

  def build(node: Any, key: str) -> Any:
    if isinstance(node, _Leaf):
      return node.value
    children = {_keypath.decode_part(k): build(v, _keypath.under(key, k)) for k, v in node.items()}
    if key in sequences and sorted(children) == sorted(map(str, range(len(children)))):
      return [children[str(i)] for i in range(len(children))]
    return children

  return build(root, "")


def _leaf(ckpt: _checkpoint.Checkpoint, key: str, scratch: str) -> Any:
  """`key` as Orbax saves it: a Python number, a typed PRNG key or a numpy array."""
  info = ckpt[key]
  if info.kind == "scalar":
    return _scalar(ckpt.read(key), info)
  if info.kind == "prng_key":
    import jax

    return jax.random.wrap_key_data(ckpt.read(key), impl=info.prng_impl)
  if info.nbytes < SCRATCH_MIN_BYTES or not info.shape:
    return np.asarray(ckpt.read(key), order="C")  # (ascontiguousarray makes 0-d arrays 1-d)
  out = np.lib.format.open_memmap(scratch, mode="w+", dtype=np.dtype(info.dtype), shape=info.shape)
  rows = max(1, BLOCK_BYTES // max(1, info.nbytes // info.shape[0]))
  for first in range(0, info.shape[0], rows):
    last = min(first + rows, info.shape[0])
    out[first:last] = ckpt.read(key, np.s_[first:last])
  out.flush()
  del out
  return np.load(scratch, mmap_mode="r")


def _scalar(value: np.ndarray, info) -> Any:
  """An Orbax scalar of the stored dtype: a Python number where that is the number's own
  width (int64, float64, bool, complex128), else a numpy scalar (`np.float32(2.0)` stays
  float32: Orbax writes a Python float as float64)."""
  python = _PY_TYPES[info.python_type or "float"]
  dtype = np.dtype(info.dtype)
  if python is bool or dtype == np.dtype(python):
    return python(value.item())
  return dtype.type(value.reshape(()))


def _save(folder: str, tree: Any, ocdbt: bool, zarr3: bool, compression, chunk_bytes) -> None:
  """Orbax writes `tree` into `folder` (replacing the empty staging folder)."""
  import jax
  import orbax.checkpoint as ocp

  handlers = ocp.type_handlers
  pairs = [(t, handlers.get_type_handler(t)) for t in (int, float, bytes, np.number, jax.Array)]
  try:  # Orbax's default copies every host array before writing it
    pairs.append((np.ndarray, handlers.NumpyHandler(deepcopy_host_arrays=False)))
  except TypeError:
    pairs.append((np.ndarray, handlers.NumpyHandler()))
  handler = ocp.PyTreeCheckpointHandler(
    use_ocdbt=ocdbt,
    use_zarr3=zarr3,
    use_compression=compression == "zstd",
    type_handler_registry=handlers.create_type_handler_registry(*pairs),
  )
  save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk_bytes), tree)
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(folder, args=ocp.args.PyTreeSave(tree, save_args=save_args), force=True)


def _restore_note(nnx: bool | None) -> str:
  if nnx is None:
    return (
      "written in the target's tree: restore with ocp.StandardCheckpointer().restore(dst, target)"
    )
  if nnx:
    return (
      "leaves are NNX Variable values (KEY/value): restore with ocp.StandardCheckpointer()"
      ".restore(dst, target) where target is nnx.state(...) of an abstract model/optimizer "
      "(with shardings for any mesh); nnx=False writes plain nested dicts"
    )
  return (
    "leaves are plain nested dicts: restore with ocp.StandardCheckpointer().restore(dst, "
    "target) where target has this tree (nnx.to_pure_dict(...) of NNX state, with "
    "shardings for any mesh), or without one; nnx=True writes NNX Variable values"
  )
