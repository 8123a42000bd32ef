"""torch DCP as a sink: a folder that `torch.distributed.checkpoint.load` reads on any ranks.

```
dst/.metadata             torch's own Metadata (pickled by torch's classes, as dcp.save does)
dst/__R_0.distcp          rank file R of `ranks`: each tensor's rows R of `ranks` (dimension 0
                          cut as FSDP2 shards it), each chunk a torch.save blob
dst/ucp_export.json       {"written_by": "ucp_jax", "format": "dcp", "files": [...]}
```
The state is laid out as `torch.distributed.checkpoint.state_dict.get_state_dict` gives it and
training scripts save it, `{"model": model_sd, "optim": optim_sd}`: `model.<fqn>` for every
parameter (a tied one on the same bytes as the one holding the data) and buffer;
`optim.state.<fqn>.<slot>` and `optim.state.<fqn>.step` (a 0-d float32 tensor, as torch's
Adam keeps it) for every trainable parameter; `optim.param_groups.<g>.<hyper>` with torch's
defaults for the optimizer type where the checkpoint has none (a fresh optimizer's
`get_state_dict` asks for every one) and `params`, the group's names. So, on any number of
ranks and with FSDP2 or without:

```python
model_sd, optim_sd = get_state_dict(model, optimizer)
dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=dst)
set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
```
A checkpoint without optimizer state (a Hugging Face folder) gives `model.<fqn>` alone. Arrays
are read one at a time (host memory: the largest), files are synced, and the folder appears
in one rename (`_folder.staged`). torch is imported here, lazily (an optional extra).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import time
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.sinks import _folder, _resolved
from ucp_jax.sinks._registry import Destination, option
from ucp_jax.sinks._report import ExportReport
from ucp_jax.store import _checkpoint

NAME = "dcp"
TORCH_NAMES = True  # writes torch names: a rule set maps a Flax-named checkpoint first
DESCRIPTION = (
  "a torch.distributed.checkpoint folder that dcp.load reads onto any number of ranks "
  "(model and optimizer as get_state_dict lays them out)"
)
METADATA = ".metadata"
_ML_DTYPES_AS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
_TORCH_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}


@dataclasses.dataclass(frozen=True)
class Options:
  """How a DCP export lays out its files."""

  ranks: int = option(1, "the number of rank files (__R_0.distcp) the rows are split over")

  def __post_init__(self) -> None:
    ranks = self.ranks
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 65536:
      raise _errors.InvalidArgumentError(f"ranks={ranks!r}: a number of rank files from 1 to 65536")


def export(
  ckpt: _checkpoint.Checkpoint, destination: Destination, options: Options | None = None
) -> ExportReport:
  """Writes `ckpt` (torch names) as a DCP folder; see the module docstring.

  Args:
    ckpt: the checkpoint, with torch names (`export` maps Flax names first).
    destination: the folder to create (or an earlier export to replace), and progress.
    options: `ranks`, how many rank files to write, each tensor's dimension 0 cut in as many
      row blocks (as FSDP2 shards it on that many ranks); any number of ranks loads any.
  """
  options = Options() if options is None else options
  start = time.perf_counter()
  ranks = options.ranks
  progress = destination.progress
  dst = check_options(destination)
  torch = import_torch()
  schema = ckpt.manifest.typed_schema
  with_optimizer = schema is not None and schema.optimizer is not None and schema.optimizer.groups
  state = _resolved.resolve(ckpt) if with_optimizer else None
  weights = _resolved.weights(ckpt)
  entries = _entries(weights, state)
  total = sum(ckpt[key].nbytes for _, key, _ in entries if key is not None)
  notes = list(state.not_carried) if state is not None else []
  params = {} if schema is None else schema.params
  if state is None and any(entry.slots for entry in params.values()):
    notes.append("the schema names optimizer slots but no optimizer groups: weights only")
  client = None if schema is None else schema.extra.get("client_state")
  if isinstance(client, dict) and client:
    notes.append(
      f"not written: the source's other entries ({', '.join(sorted(map(str, client)))}); "
      "the checkpoint keeps them in its schema's extra.client_state, not as DCP state"
    )
  names = [f"__{r}_0.distcp" for r in range(ranks)]
  written = 0
  with _folder.staged(dst) as staging:
    writer = RankFileWriter(torch, staging, names)
    try:
      for flat, key, path in entries:
        if key is None:  # a tied parameter: the bytes of the one it names
          writer.alias(flat, f"model.{weights.tied[path[1]]}", path)
          continue
        array = np.ascontiguousarray(ckpt.read(key))
        if not array.flags.writeable:  # torch.from_numpy takes writable arrays only
          array = array.copy()
        writer.tensor(flat, array, path)
        written += array.nbytes
        if progress is not None:
          progress(key, array.nbytes, total)
      if state is not None:
        _optimizer_entries(torch, writer, state)
    finally:
      writer.close()
    writer.commit()
    _folder.write_marker(staging, NAME, files=names)
  return ExportReport(
    path=dst,
    tag=None,
    zero_stages=(),
    params=len(state.trainable) if state is not None else len(weights.params),
    frozen=weights.frozen,
    buffers=tuple(b.name for b in weights.buffers),
    tied=dict(weights.tied),
    step=state.step if state is not None else ckpt.step,
    nbytes=written,
    seconds=time.perf_counter() - start,
    notes=tuple(notes),
    format=NAME,
    summary=(
      f"DCP folder, {ranks} rank file(s): {len(weights.params)} params"
      + (f" with {', '.join(state.slot_names)} and {len(state.groups)} group(s)" if state else "")
      + f", {len(weights.buffers)} buffers, {len(weights.tied)} tied"
    ),
  )


def import_torch():
  try:
    import torch
  except ImportError as e:
    raise _errors.MissingDependencyError(
      "exporting to DCP writes torch files with torch, which is not installed; install the "
      "extra: pip install 'ucp_jax[torch]'"
    ) from e
  return torch


def check_options(destination: Destination, options: Options | None = None) -> str:
  """The absolute export path, or an error: an existing folder must be an earlier DCP export."""
  return _folder.check_destination(destination, not_an_export=_not_an_export, what="a DCP export")


def _not_an_export(path: str) -> list[str]:
  return _folder.foreign_entries(path, NAME, "a DCP export", ours=(METADATA,))


def _entries(
  weights: _resolved.ResolvedWeights, state: _resolved.ResolvedState | None
) -> list[tuple]:
  """(flattened key, checkpoint key or None for an alias, tree path) of every tensor."""
  out: list[tuple[str, str | None, tuple[str, ...]]]
  out = [(f"model.{p.name}", p.value, ("model", p.name)) for p in weights.params]
  out += [(f"model.{alias}", None, ("model", alias)) for alias in weights.tied]
  out += [(f"model.{b.name}", b.value, ("model", b.name)) for b in weights.buffers]
  for p in state.trainable if state is not None else ():
    out += [
      (f"optim.state.{p.name}.{s}", k, ("optim", "state", p.name, s)) for s, k in p.slots.items()
    ]
  return out


def _optimizer_entries(torch, writer: RankFileWriter, state: _resolved.ResolvedState) -> None:
  """Each parameter's step and each group's hyperparameters and names."""
  step = torch.tensor(float(state.step), dtype=torch.float32)
  for p in state.trainable:
    writer.tensor(f"optim.state.{p.name}.step", step, ("optim", "state", p.name, "step"))
  defaults = _defaults(torch, state.optimizer_type)
  for g, hyper in enumerate(state.groups):
    group = {**defaults, **hyper}
    group["params"] = [p.name for p in state.trainable if p.group == g]
    for name, value in group.items():
      writer.object(f"optim.param_groups.{g}.{name}", value, ("optim", "param_groups", g, name))


def _defaults(torch, kind: str) -> dict[str, Any]:
  """The hyperparameters torch's optimizer of `kind` keeps in every group, at their defaults."""
  name = _TORCH_OPTIMIZERS.get(kind)
  if name is None:
    return {}
  kwargs = {"lr": 0.0} if name == "SGD" else {}
  return dict(getattr(torch.optim, name)([torch.zeros(1)], **kwargs).defaults)


class RankFileWriter:
  """Rank files written in step; the metadata dcp.save would write for them."""

  def __init__(self, torch, folder: str, names: list[str]):
    from torch.distributed.checkpoint import metadata as md

    self._torch, self._md, self._folder, self._names = torch, md, folder, names
    self._files = [open(os.path.join(folder, n), "wb") for n in names]  # noqa: SIM115
    self._sdm: dict[str, Any] = {}
    self._storage: dict[Any, Any] = {}
    self._paths: dict[str, tuple] = {}
    self._by_key: dict[str, dict] = {}

  def _blob(self, rank: int, obj: Any):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    f = self._files[rank]
    start = f.tell()
    self._torch.save(obj, f)
    return _StorageInfo(self._names[rank], start, f.tell() - start)

  def tensor(self, flat: str, array: Any, path: tuple) -> None:
    """`array` (numpy or a torch tensor), its dimension 0 cut into one row block per rank."""
    torch, md = self._torch, self._md
    data = array if isinstance(array, torch.Tensor) else _to_torch(torch, array)
    blocks = data.chunk(len(self._files), 0) if data.dim() else (data,)
    chunks: list = []
    stored: dict = {}
    at = 0
    for rank, block in enumerate(blocks):
      offsets = (at,) + (0,) * (data.dim() - 1) if data.dim() else ()
      index = md.MetadataIndex(flat, offsets, len(chunks))
      stored[index] = self._blob(rank, block.clone())  # a block of its own, not a view
      chunks.append(md.ChunkStorageMetadata(torch.Size(offsets), block.size()))
      at += block.shape[0] if data.dim() else 0
    properties = md.TensorProperties(dtype=data.dtype)
    self._sdm[flat] = md.TensorStorageMetadata(properties, data.size(), chunks)
    self._storage.update(stored)
    self._paths[flat] = path
    self._by_key[flat] = stored

  def alias(self, flat: str, holder: str, path: tuple) -> None:
    """`flat` on the bytes of `holder` (a tied parameter), as one tensor stored once."""
    md = self._md
    self._sdm[flat] = self._sdm[holder]
    for index, info in self._by_key[holder].items():
      self._storage[md.MetadataIndex(flat, index.offset, index.index)] = info
    self._paths[flat] = path

  def object(self, flat: str, value: Any, path: tuple) -> None:
    buffer = io.BytesIO()
    self._torch.save(value, buffer)
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    f = self._files[0]
    start = f.tell()
    f.write(buffer.getbuffer())
    self._storage[self._md.MetadataIndex(flat)] = _StorageInfo(
      self._names[0], start, f.tell() - start
    )
    self._sdm[flat] = self._md.BytesStorageMetadata()
    self._paths[flat] = path

  def close(self) -> None:
    for f in self._files:
      if not f.closed:
        f.flush()
        os.fsync(f.fileno())
        f.close()

  def commit(self) -> None:
    """Writes `.metadata` (last, synced), as `FileSystemWriter.finish` does."""
    from torch.distributed.checkpoint import filesystem

    meta = self._md.Metadata(
      state_dict_metadata=self._sdm,
      planner_data=self._paths,
      storage_data=self._storage,
      storage_meta=self._md.StorageMeta(),
      version=getattr(filesystem, "CURRENT_DCP_VERSION", None),
    )
    with open(os.path.join(self._folder, METADATA), "wb") as f:
      pickle.dump(meta, f)
      f.flush()
      os.fsync(f.fileno())


def _to_torch(torch, array: np.ndarray):
  raw = _ML_DTYPES_AS.get(array.dtype.name)
  if raw is not None:
    return torch.from_numpy(array.view(raw)).view(getattr(torch, array.dtype.name))
  return torch.from_numpy(array)
