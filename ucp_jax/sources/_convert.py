"""`convert`: a checkpoint of another format -> a universal ucp_jax checkpoint.

The source is found by name or by sniffing the path (`_registry`), described as a `Plan`
from its metadata only, then written one logical array at a time: each array is assembled
from memory-mapped slices of the source files, written, and dropped, and the mapped pages
are released, so host memory stays near a few parameters whatever the model size. The
checkpoint is committed atomically by the store's `Writer`; a failure leaves nothing
readable.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import os
import time
from collections.abc import Callable

from ucp_jax.base import _errors, _multihost
from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _registry, _source_plan
from ucp_jax.sources._source_plan import Tensor, release
from ucp_jax.store import _bundle, _location
from ucp_jax.store._manifest import ArrayInfo, Manifest
from ucp_jax.store._writer import Writer

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
    src: the folder or file read (DeepSpeed: the tag folder or universal folder).
    dst: the converted checkpoint.
    format: what was read: `deepspeed` (a ZeRO-1/2/3 or BF16-optimizer training checkpoint),
      `deepspeed_universal` (the output of DeepSpeed's `ds_to_universal`), ...
    step: the training step (DeepSpeed's `global_steps`), None where the source has none.
    params: parameters in the schema (optimized, frozen and tied).
    arrays: arrays written.
    bytes: bytes written (before chunk checksums).
    seconds: wall time of the conversion.
    processes: how many processes converted it (each its share of the arrays).
  """

  src: str
  dst: str
  format: str
  step: int | None
  params: int
  arrays: int
  bytes: int
  seconds: float
  processes: int = 1


def convert(
  src: str | os.PathLike,
  dst: str | os.PathLike,
  *,
  source: str | None = None,
  overwrite: bool = False,
  progress: Progress | None = None,
  durable: bool = True,
  **options,
) -> ConvertReport:
  """Converts a checkpoint of another format into a universal checkpoint.

  DeepSpeed: `src` is a checkpoint folder (with `latest`), a tag folder (`global_step100/`),
  or a universal folder written by DeepSpeed's `ds_to_universal`. ZeRO-1/2/3 and the BF16
  optimizer are read at any dp degree. The result holds `params/NAME` (the fp32 master value;
  frozen parameters in their own dtype), `exp_avg/NAME`, `exp_avg_sq/NAME` and `buffers/NAME`,
  and the manifest's schema names them with the param groups, steps and the source's state
  (docs/schema.md). `ucp_jax.open(src)` shows the same arrays without converting.

  Called with the same arguments on every process of a `jax.distributed` run (hosts that
  share the source and destination), the processes convert disjoint shares of the arrays,
  about equal in bytes, and one commit covers them all (`ucp convert --processes N` runs N
  such processes on one host).

  Example:
    >>> import ucp_jax
    >>> report = ucp_jax.convert("tests/fixtures/deepspeed/z2_bf16_dp3/ckpt",
    ...                          "/tmp/ucp_doc_convert", overwrite=True)
    >>> report.step, report.params
    (3, 9)
    >>> ucp_jax.open("/tmp/ucp_doc_convert").read("exp_avg/fc1.bias").shape
    (19,)

  Args:
    src: the checkpoint to convert.
    dst: where the universal checkpoint goes (local directory or kvstore URL).
    source: the source format (`ucp_jax.sources._registry.SOURCES`); default: the one that
      recognizes `src`.
    overwrite: replace an existing checkpoint at `dst`, atomically.
    progress: called as `progress(key, nbytes, total_bytes)`: once with `("", 0, total)`
      before writing, then after each array this process writes.
    durable: fsync before the commit (see `ucp_jax.save`).
    **options: the source's own options. DeepSpeed: `patterns`, for tensor-parallel
      sources, `(regex, pattern)` rules for parameters the checkpoint's
      `universal_checkpoint_info` does not describe (`_pattern_rules.classify`).

  Returns:
    A `ConvertReport`.

  Raises:
    SourceFormatError: `src` is not a checkpoint of a known layout, or its files are missing,
      damaged, forged (`sources.deepspeed._contract`, `sources._torch_reader._torch_file`), or from different runs; the
      message lists every problem with file and key. Also when the arrays would take more than
      `MAX_GROWTH` times the bytes of the source files (tensors aliasing each other).
    CheckpointExistsError: `dst` exists and `overwrite` is False.
  """
  start = time.perf_counter()
  plan = _registry.describe(src, source, **options)
  target = _location.resolve(dst)
  bundle_bytes = _bundle.limit_for(target.local_dir is not None)
  manifest, tensors = _source_plan.manifest_of(plan, bundle_bytes)
  _check_growth(plan, manifest.nbytes)
  _write(target, manifest, tensors, overwrite=overwrite, progress=progress, durable=durable)
  return ConvertReport(
    src=plan.path,
    dst=str(target),
    format=plan.format,
    step=plan.step,
    params=0 if manifest.typed_schema is None else len(manifest.typed_schema.params),
    arrays=len(manifest.arrays),
    bytes=manifest.nbytes,
    seconds=time.perf_counter() - start,
    processes=_multihost.process_count(),
  )


def _check_growth(plan: _source_plan.Plan, nbytes: int) -> None:
  """Refuses to write more than `plan.max_growth` (`MAX_GROWTH`) times the bytes of the
  source's files: those below `plan.path` (a folder, or one file), or, on an object store,
  those its readers saw (`plan.source_bytes`; unknown for Orbax's there: not checked)."""
  folder, growth = plan.path, plan.max_growth or MAX_GROWTH
  if "://" in folder:
    if plan.source_bytes is None:
      return
    read = plan.source_bytes
  elif os.path.isfile(folder):
    read = os.stat(folder).st_size
  else:
    read = sum(
      os.stat(os.path.join(root, name)).st_size
      for root, _, names in os.walk(folder)
      for name in names
      if os.path.isfile(os.path.join(root, name))
    )
  if nbytes > growth * read + GROWTH_SLACK:
    raise SourceFormatError(
      f"{folder}: its arrays would take {nbytes} bytes, more than {growth:g} times the {read} "
      "bytes of its files (MAX_GROWTH): tensors that alias each other, as only a forged or "
      "corrupt checkpoint has"
    )


def _write(
  target: _location.Location,
  manifest: Manifest,
  tensors: dict[str, Tensor],
  *,
  overwrite: bool,
  progress: Progress | None,
  durable: bool = True,
) -> None:
  arrays = manifest.arrays
  mine = share(arrays, _multihost.process_count())[_multihost.process_index()]
  jobs = {key: (arrays[key], tensor) for key, tensor in tensors.items() if key in mine}
  total = sum(info.nbytes for info, _ in jobs.values())
  largest = max((info.nbytes for info, _ in jobs.values()), default=0)
  budget = max(_MIN_IN_FLIGHT, 2 * largest)
  if progress is not None:
    progress("", 0, total)
  with Writer(target, overwrite=overwrite, durable=durable) as writer:
    writer.create(arrays, compression=None)
    # Agreed by every process: one that fails makes all of them fail, none waits forever.
    writer.together("writing arrays", _write_share, writer, target, jobs, budget, total, progress)
    writer.commit(manifest)


def _write_share(writer, target, jobs, budget: int, total: int, progress) -> None:
  """Writes this process's arrays, at most ~`budget` bytes assembled and waiting at once."""
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
    data, pieces = _source_plan.assemble(tensor)
    pending.append((key, writer.write_array(key, data), info.nbytes, pieces))
    held += info.nbytes
    del data
  while pending:
    finish_one()


def share(arrays: dict[str, ArrayInfo], processes: int) -> list[set[str]]:
  """The arrays each process converts: disjoint, about equal in bytes, the same on every process.

  Largest first, each to the process with the fewest bytes so far (ties: the lowest).
  """
  loads = [(0, p) for p in range(processes)]
  shares: list[set[str]] = [set() for _ in range(processes)]
  for key in sorted(arrays, key=lambda k: (-arrays[k].nbytes, k)):
    load, p = heapq.heappop(loads)
    shares[p].add(key)
    heapq.heappush(loads, (load + arrays[key].nbytes, p))
  return shares
