"""`export`: a checkpoint with a parameter schema -> files another framework loads."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from ucp_jax import _export_schema, _reader

FORMATS = ("deepspeed",)


@dataclasses.dataclass(frozen=True)
class ExportReport:
  """What `export` wrote.

  Attributes:
    path: the export directory (`dst`).
    tag: the checkpoint tag inside it (`dst/<tag>/`, named by `dst/latest_universal`).
    zero_stages: the ZeRO stages whose `load_universal` finds the files.
    params: number of trainable parameters (each with its fp32 value and slots).
    frozen: frozen parameters (value only).
    buffers: buffers.
    tied: aliases of tied parameters -> the parameter holding the data.
    step: the optimizer step written.
    nbytes: bytes of array data written.
    seconds: wall time of the export.
    notes: what the target framework's loader will not restore from these files, and why,
      and the JAX state the files leave out (`optax.MultiSteps` accumulation, an EMA tree).
  """

  path: str
  tag: str
  zero_stages: tuple[int, ...]
  params: int
  frozen: tuple[str, ...]
  buffers: tuple[str, ...]
  tied: dict[str, str]
  step: int
  nbytes: int
  seconds: float
  notes: tuple[str, ...] = ()


def export(
  ckpt: str | os.PathLike | _reader.Checkpoint,
  dst: str | os.PathLike,
  *,
  format: str = "deepspeed",
  zero_stage: int | None = None,
  tag: str | None = None,
  overwrite: bool = False,
  rules: Any = None,
  progress: Callable[[str, int, int], None] | None = None,
) -> ExportReport:
  """Exports a checkpoint to another framework's format (DeepSpeed universal checkpoints).

  The checkpoint must carry a parameter schema (docs/schema.md): converted DeepSpeed
  checkpoints do, and so do saves made with the Flax/Optax helpers. The export is
  written to a staging directory beside `dst` and renamed into place at the end.

  DeepSpeed 0.19.8 loads the result with `"checkpoint": {"load_universal": true}` and
  `engine.load_checkpoint(dst)`, at any data-parallel degree. With `zero_stage=None`
  one export serves ZeRO-1, ZeRO-2 (and the BF16 optimizer) and ZeRO-3 targets alike,
  whatever the source's stage; docs/export.md lists what DeepSpeed restores from it.

  Example:
    >>> import ucp_jax
    >>> report = ucp_jax.export("ckpt", "ds_universal")  # doctest: +SKIP
    >>> report.tag, report.zero_stages  # doctest: +SKIP
    ('global_step3', (1, 2, 3))

  Args:
    ckpt: a checkpoint path or an open `Checkpoint`.
    dst: local directory to create (`dst/<tag>/...` and `dst/latest_universal`).
    format: "deepspeed" (a DeepSpeed universal checkpoint).
    zero_stage: the target's ZeRO stage: 1 or 2 (one layout), 3, or None for all of them.
    tag: checkpoint tag; default `global_step<N>` with N the engine's global step.
    overwrite: replace an existing export at `dst`.
    rules: for a checkpoint with Flax names (`save_train_state`), the `ucp_jax.rules`
      rule set from torch names to the model's keys; it runs backwards to give DeepSpeed
      torch names and layouts for every parameter and optimizer slot.
    progress: called as `progress(item, nbytes, total_nbytes)` after each item is written.

  Returns:
    An `ExportReport`, including the gaps DeepSpeed's loader leaves (`notes`).

  Raises:
    ValueError: an unknown `format` or `zero_stage`, or a bad `tag`.
    CheckpointExistsError: `dst` exists and `overwrite` is false, or is not an export.
    CheckpointNotFoundError: no committed checkpoint at `ckpt`.
    MappingError: no parameter schema, or one with problems (all listed), among them
      optimizer state DeepSpeed has no names for (Lion, Adafactor, `optax.ema`, ...).
    MissingDependencyError: torch is not installed (`pip install ucp_jax[torch]`).
  """
  if format not in FORMATS:
    raise ValueError(f"format {format!r}: ucp_jax exports to {', '.join(FORMATS)}")
  if zero_stage is not None and (isinstance(zero_stage, bool) or zero_stage not in (1, 2, 3)):
    raise ValueError(f"zero_stage {zero_stage!r}: expected 1, 2, 3 or None (all stages)")
  from ucp_jax import _deepspeed_export

  target = _deepspeed_export.check_destination(dst, overwrite=overwrite, tag=tag)
  opened = ckpt if isinstance(ckpt, _reader.Checkpoint) else _reader.open(ckpt)
  naming = (opened.manifest.schema or {}).get("naming", "torch")
  if rules is not None and naming != "torch":
    from ucp_jax import _export_flax

    _export_schema.check_jax_only(opened)
    opened = _export_flax.torch_named(opened, rules)
  resolved = _export_schema.plan(opened)
  report = _deepspeed_export.write(
    opened, resolved, target, zero_stage=zero_stage, tag=tag, progress=progress
  )
  if rules is not None and naming == "torch":
    note = "rules were not used: the checkpoint's parameters already have torch names"
    report = dataclasses.replace(report, notes=(*report.notes, note))
  return report
