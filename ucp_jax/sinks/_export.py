"""`export`: a checkpoint with a parameter schema -> files another framework loads.

The format's sink (`_registry`) writes the files; what is common to every format happens
here: opening the checkpoint, and running a rule set backwards to give a Flax-named
checkpoint (`save_train_state`) torch names and layouts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from ucp_jax.base import _errors
from ucp_jax.sinks import _flax_names, _registry, _resolved
from ucp_jax.sinks._report import ExportReport
from ucp_jax.store import _checkpoint, _reader


def export(
  ckpt: str | os.PathLike | _checkpoint.Checkpoint,
  dst: str | os.PathLike,
  *,
  format: str,
  overwrite: bool = False,
  rules: Any = None,
  progress: Callable[[str, int, int], None] | None = None,
  **options: Any,
) -> ExportReport:
  """Exports a checkpoint to another framework's format.

  The checkpoint must carry a parameter schema (docs/schema.md): converted DeepSpeed
  checkpoints do, and so do saves made with the Flax/Optax helpers. The export is
  written to a staging directory beside `dst` and renamed into place at the end.

  DeepSpeed 0.19.8 loads the result with `"checkpoint": {"load_universal": true}` and
  `engine.load_checkpoint(dst)`, at any data-parallel degree. With `zero_stage=None`
  one export serves ZeRO-1, ZeRO-2 (and the BF16 optimizer) and ZeRO-3 targets alike,
  whatever the source's stage; docs/export.md lists what DeepSpeed restores from it.

  Example:
    >>> import ucp_jax
    >>> report = ucp_jax.export("ckpt", "ds_universal", format="deepspeed")  # doctest: +SKIP
    >>> report.tag, report.zero_stages  # doctest: +SKIP
    ('global_step3', (1, 2, 3))

  Args:
    ckpt: a checkpoint path or an open `Checkpoint`.
    dst: local directory to create (`dst/<tag>/...` and `dst/latest_universal`).
    format: the sink, always named: "deepspeed" (a DeepSpeed universal checkpoint), "hf",
      "dcp" or "orbax" (docs/export.md).
    overwrite: replace an existing export at `dst`.
    rules: for a checkpoint with Flax names (`save_train_state`), the `ucp_jax.rules`
      rule set from torch names to the model's keys, or its name as `--rules` takes it
      (`"gpt2:num_heads=4"`, `"hf"`; docs/mapping.md); it runs backwards to give DeepSpeed
      torch names and layouts for every parameter and optimizer slot.
    progress: called as `progress(item, nbytes, total_nbytes)` after each item is written.
    **options: the format's own options, the fields of its sink's `Options`
      (docs/export.md). DeepSpeed: `zero_stage` (the target's ZeRO stage: 1 or 2, one layout;
      3; or None for all of them) and `tag` (default `global_step<N>` with N the engine's
      global step).

  Returns:
    An `ExportReport`, including the gaps DeepSpeed's loader leaves (`notes`).

  Raises:
    InvalidArgumentError: an unknown `format` or option, or a bad option value.
    CheckpointExistsError: `dst` exists and `overwrite` is false, or is not an export.
    CheckpointNotFoundError: no committed checkpoint at `ckpt`.
    MappingError: no parameter schema, or one with problems (all listed), among them
      optimizer state DeepSpeed has no names for (Lion, Adafactor, `optax.ema`, ...).
    MissingDependencyError: torch is not installed (`pip install ucp_jax[torch]`).
  """
  sink = _registry.get(format)
  chosen = _registry.options_of(sink, options)
  destination = _registry.Destination(os.fspath(dst), overwrite, progress)
  sink.check_options(destination, chosen)  # before anything is read
  opened = ckpt if isinstance(ckpt, _checkpoint.Checkpoint) else _reader.open(ckpt)
  opened, inferred = _resolved.inferred(opened)
  schema = opened.manifest.typed_schema
  naming = "torch" if schema is None else schema.naming
  if rules is not None and not sink.TORCH_NAMES:  # a sink of JAX keys (Orbax)
    raise _errors.InvalidArgumentError(
      f"format {format!r} writes the checkpoint's own keys; rules=... map them to torch names, "
      "which it does not use: drop --rules"
    )
  if rules is not None and naming != "torch":
    _resolved.check_jax_only(opened)
    opened = _flax_names.torch_named(opened, rules)
  report = sink.export(opened, destination, chosen)
  notes = [inferred] if inferred else []
  if rules is not None and naming == "torch":
    notes.append("rules were not used: the checkpoint's parameters already have torch names")
  return dataclasses.replace(report, notes=(*report.notes, *notes)) if notes else report
