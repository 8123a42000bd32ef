"""What an export wrote: one report for every sink."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportReport:
  """What `export` wrote (what a sink's `export` returns; a sink without tags, ZeRO stages,
  frozen parameters, buffers or ties leaves those fields out).

  Attributes:
    path: the export's destination (`dst`).
    tag: the checkpoint tag inside it, where the format has tags (DeepSpeed: `dst/<tag>/`,
      named by `dst/latest_universal`); None elsewhere.
    zero_stages: the ZeRO stages whose `load_universal` finds the files (DeepSpeed only).
    params: number of parameters written (trainable ones, for formats with optimizer state).
    frozen: frozen parameters (value only).
    buffers: buffers.
    tied: aliases of tied parameters -> the parameter holding the data.
    step: the optimizer step written (None where the format has none).
    nbytes: bytes of array data written.
    seconds: wall time of the export.
    notes: what the target framework's loader will not restore from these files, and why,
      and the JAX state the files leave out (`optax.MultiSteps` accumulation, an EMA tree).
    format: the sink that wrote it (`deepspeed`, `hf`, ...).
    summary: one line saying what was written, for the command line.
  """

  path: str
  tag: str | None = None
  zero_stages: tuple[int, ...] = ()
  params: int
  frozen: tuple[str, ...] = ()
  buffers: tuple[str, ...] = ()
  tied: dict[str, str] = dataclasses.field(default_factory=dict)
  step: int | None
  nbytes: int
  seconds: float
  notes: tuple[str, ...] = ()
  format: str = "deepspeed"
  summary: str = ""
