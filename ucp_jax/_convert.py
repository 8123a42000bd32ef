"""`convert`: a DeepSpeed training checkpoint -> a universal ucp_jax checkpoint.

The source is detected (docs/deepspeed_layouts.md; checks in `_deepspeed_*`), read into a
`Plan` from its metadata only, then written one logical array at a time: each array is
assembled from memory-mapped slices of the rank files, written, and dropped, and the mapped
pages are released, so host memory stays near a few parameters whatever the model size. The
checkpoint is committed atomically by `_save.Writer`; a failure leaves nothing readable.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from ucp_jax import _deepspeed_common, _deepspeed_universal, _errors, _keypath, _store, _tree
from ucp_jax._convert_plan import Plan, Tensor, release
from ucp_jax._errors import SourceFormatError
from ucp_jax._manifest import ArrayInfo, Manifest
from ucp_jax._writer import Writer

_MIN_IN_FLIGHT = 64 << 20
"""Bytes of assembled arrays that may wait for their writes (at least two of the largest)."""
MAX_GROWTH = 4
"""How many times the bytes of its source files a conversion may write (plus `GROWTH_SLACK`).

The arrays are the source's own elements, so a checkpoint writes about as many bytes as it
reads (fp32 masters and slots; bf16 weights are not written). More means tensors that alias
each other: a forged file that makes a few bytes of storage into terabytes of output."""
GROWTH_SLACK = 256 << 20

Progress = Callable[[str, int, int], None]


@dataclasses.dataclass(frozen=True)
class ConvertReport:
  """What `convert` did.

  Attributes:
    src: the folder read (a DeepSpeed tag folder or universal folder).
    dst: the converted checkpoint.
    format: `deepspeed` (a ZeRO-1/2/3 or BF16-optimizer training checkpoint) or
      `deepspeed_universal` (the output of DeepSpeed's `ds_to_universal`).
    step: the training step (DeepSpeed's `global_steps`).
    params: parameters in the schema (optimized, frozen and tied).
    arrays: arrays written.
    bytes: bytes written (before chunk checksums).
    seconds: wall time of the conversion.
  """

  src: str
  dst: str
  format: str
  step: int | None
  params: int
  arrays: int
  bytes: int
  seconds: float


def convert(
  src: str | os.PathLike,
  dst: str | os.PathLike,
  *,
  overwrite: bool = False,
  progress: Progress | None = None,
  patterns: Sequence = (),
) -> ConvertReport:
  """Converts a DeepSpeed checkpoint into a universal checkpoint, optimizer state included.

  `src` is a DeepSpeed checkpoint folder (with `latest`), a tag folder (`global_step100/`),
  or a universal folder written by DeepSpeed's `ds_to_universal`. ZeRO-1/2/3 and the BF16
  optimizer are read at any dp degree. The result holds `params/NAME` (the fp32 master value;
  frozen parameters in their own dtype), `exp_avg/NAME`, `exp_avg_sq/NAME` and `buffers/NAME`,
  and the manifest's schema names them with the param groups, steps and DeepSpeed's state
  (docs/schema.md).

  Example:
    >>> import ucp_jax
    >>> report = ucp_jax.convert("tests/fixtures/deepspeed/z2_bf16_dp3/ckpt",
    ...                          "/tmp/ucp_doc_convert", overwrite=True)
    >>> report.step, report.params
    (3, 9)
    >>> ucp_jax.open("/tmp/ucp_doc_convert").read("exp_avg/fc1.bias").shape
    (19,)

  Args:
    src: the DeepSpeed checkpoint.
    dst: where the universal checkpoint goes (local directory or kvstore URL).
    overwrite: replace an existing checkpoint at `dst` (atomically on local disks).
    progress: called as `progress(key, nbytes, total_bytes)`: once with `("", 0, total)`
      before writing, then after each array is written.
    patterns: for tensor-parallel sources, `(regex, pattern)` rules for parameters the
      checkpoint's `universal_checkpoint_info` does not describe (`_pattern_rules.classify`).

  Returns:
    A `ConvertReport`.

  Raises:
    SourceFormatError: `src` is not a checkpoint of a known layout, or its files are missing,
      damaged, forged (`_deepspeed_contract`, `_torch_file`), or from different runs; the
      message lists every problem with file and key. Also when the arrays would take more than
      `MAX_GROWTH` times the bytes of the source files (tensors aliasing each other).
    CheckpointExistsError: `dst` exists and `overwrite` is False.
  """
  start = time.perf_counter()
  kind, plan = read_plan(src, patterns=patterns)
  target = _store.resolve(dst)
  jobs, schema = _layout(plan)
  arrays = {key: info for key, (info, _) in jobs.items()}
  manifest = Manifest(
    arrays=arrays,
    tree=_tree.structure(list(arrays)),
    step=plan.step,
    source=plan.source,
    schema=schema,
  )
  _check_growth(plan.path, manifest.nbytes)
  _write(target, jobs, manifest, overwrite=overwrite, progress=progress)
  return ConvertReport(
    src=plan.path,
    dst=str(target),
    format=kind,
    step=plan.step,
    params=len(plan.params),
    arrays=len(arrays),
    bytes=manifest.nbytes,
    seconds=time.perf_counter() - start,
  )


def read_plan(src: str | os.PathLike, *, patterns: Sequence = ()) -> tuple[str, Plan]:
  """(format, plan) of a source checkpoint, detected from its files."""
  from ucp_jax import _deepspeed_zero, _deepspeed_zero3

  kind, folder = detect(src)
  if kind == "deepspeed_universal":
    return kind, _deepspeed_universal.plan(folder)
  from ucp_jax import _deepspeed_tp

  if _deepspeed_tp.is_model_parallel(folder):  # TP/PP/EP ranks: merged by pattern
    return kind, _deepspeed_tp.plan(folder, rules=patterns)
  files = _deepspeed_common.list_tag(folder)
  return kind, (_deepspeed_zero3 if files.zero3 else _deepspeed_zero).plan(files)


def detect(src: str | os.PathLike) -> tuple[str, str]:
  """(format, folder to read) of `src`; see `convert` for what is recognized."""
  path = os.fspath(src)
  if not os.path.exists(path):
    raise SourceFormatError(f"{path}: no such file or directory")
  if not os.path.isdir(path):
    raise SourceFormatError(
      f"{path}: a single file; convert reads a DeepSpeed checkpoint folder (single .pt and "
      "safetensors files are not supported yet)"
    )
  kind = _folder_kind(path)
  if kind is not None:
    return kind, path
  for pointer in ("latest", "latest_universal"):
    file = os.path.join(path, pointer)
    if os.path.lexists(file) and not os.path.isdir(file):
      tag = _deepspeed_common.read_tag(file)
      folder = os.path.join(path, tag)
      kind = _folder_kind(folder) if os.path.isdir(folder) else None
      if kind is None:
        raise SourceFormatError(
          f"{file} names the tag {tag!r}, but {folder} is not a DeepSpeed tag or universal folder"
        )
      return kind, folder
  names = sorted(os.listdir(path))
  found = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "") if names else "nothing"
  raise SourceFormatError(
    f"{path}: not a checkpoint that convert reads. Looked for: a DeepSpeed checkpoint folder "
    "(a `latest` file naming its tag folder); a DeepSpeed tag folder "
    "(mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt, with "
    "*_optim_states.pt); a DeepSpeed universal folder (zero/optimizer_state.pt, or a "
    f"`latest_universal` file naming one). Found: {found}"
  )


def _folder_kind(folder: str) -> str | None:
  if _deepspeed_universal.is_universal(folder):
    return "deepspeed_universal"
  names = os.listdir(folder)
  if any(n.endswith("model_states.pt") or n.endswith("optim_states.pt") for n in names):
    return "deepspeed"
  return None


def _check_growth(folder: str, nbytes: int) -> None:
  """Refuses to write more than `MAX_GROWTH` times the bytes of the files in `folder`."""
  read = sum(
    os.stat(os.path.join(root, name)).st_size
    for root, _, names in os.walk(folder)
    for name in names
    if os.path.isfile(os.path.join(root, name))
  )
  if nbytes > MAX_GROWTH * read + GROWTH_SLACK:
    raise SourceFormatError(
      f"{folder}: its arrays would take {nbytes} bytes, more than {MAX_GROWTH} times the {read} "
      "bytes of its files (MAX_GROWTH): tensors that alias each other, as only a forged or "
      "corrupt checkpoint has"
    )


def _layout(plan: Plan) -> tuple[dict[str, tuple[ArrayInfo, Tensor]], dict]:
  """The arrays to write, in write order, and the manifest's schema."""
  jobs: dict[str, tuple[ArrayInfo, Tensor]] = {}

  def add(prefix: str, name: str, tensor: Tensor, role: str, shard=None) -> str:
    key = _keypath.join([prefix, name])
    dtype = np.dtype(tensor.dtype)
    chunks = _store.choose_chunks(tensor.shape, shard or tensor.shape, dtype.itemsize)
    jobs[key] = (ArrayInfo(tensor.shape, _store.zarr_dtype(dtype), chunks, role=role), tensor)
    return key

  entries = {}
  values = {}
  for p in plan.params:
    if p.value is not None:
      values[p.name] = add("params", p.name, p.value, "value", p.shard_shape)
    slots = {slot: add(slot, p.name, t, slot, p.shard_shape) for slot, t in p.slots.items()}
    entries[p.name] = {
      "value": values.get(p.name),
      "slots": slots,
      "group": p.group,
      "frozen": p.frozen,
      "tied_to": p.tied_to,
    }
    if p.pattern is not None:  # how the source split it over TP/PP/EP ranks (_patterns)
      entries[p.name]["pattern"] = p.pattern
  for p in plan.params:  # a tied parameter points at the key that holds its data
    if p.tied_to is not None:
      entries[p.name]["value"] = values.get(p.tied_to)
  buffers = {name: add("buffers", name, t, "buffer") for name, t in plan.buffers.items()}
  schema = {
    "version": 1,
    "naming": "torch",
    "params": entries,
    "buffers": buffers,
    "optimizer": plan.optimizer,
    "extra": plan.extra,
  }
  return jobs, schema


def _write(
  target: _store.Location,
  jobs: dict[str, tuple[ArrayInfo, Tensor]],
  manifest: Manifest,
  *,
  overwrite: bool,
  progress: Progress | None,
) -> None:
  total = sum(info.nbytes for info, _ in jobs.values())
  largest = max((info.nbytes for info, _ in jobs.values()), default=0)
  budget = max(_MIN_IN_FLIGHT, 2 * largest)
  if progress is not None:
    progress("", 0, total)
  with Writer(target, overwrite=overwrite) as writer:
    writer.create({key: info for key, (info, _) in jobs.items()}, compression=None)
    pending: collections.deque = collections.deque()
    held = 0

    def finish_one() -> int:
      key, future, nbytes, pieces = pending.popleft()
      try:
        future.result()
      except Exception as e:
        raise _errors.UcpError(f"{target}: writing `{key}` failed: {e}") from e
      release(pieces)
      if progress is not None:
        progress(key, nbytes, total)
      return nbytes

    for key, (info, tensor) in jobs.items():
      while pending and held + info.nbytes > budget:
        held -= finish_one()
      data, pieces = _assemble(tensor)
      pending.append((key, writer.write_array(key, data), info.nbytes, pieces))
      held += info.nbytes
      del data
    while pending:
      finish_one()
    writer.commit(manifest)


def _assemble(tensor: Tensor) -> tuple[np.ndarray, list[np.ndarray]]:
  """The logical array from its pieces (a view when it is one piece), and the pieces."""
  pieces = list(tensor.pieces())
  dtype = np.dtype(tensor.dtype)
  held = sum(p.size for p in pieces)
  bad = sorted({str(p.dtype) for p in pieces if p.dtype != dtype or p.ndim != 1})
  if held != tensor.numel or bad:
    raise SourceFormatError(
      f"{tensor.where}: its pieces hold {held} elements"
      + (f" of {bad}" if bad else "")
      + f"; expected {tensor.numel} of {dtype} for shape {tensor.shape}"
    )
  if not pieces:
    return np.zeros(tensor.shape, dtype), pieces
  data = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
  return data.reshape(tensor.shape), pieces
