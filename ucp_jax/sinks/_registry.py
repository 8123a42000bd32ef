"""The sinks ucp_jax writes, by format name.

A sink is a module with `NAME`, `DESCRIPTION`, `check_options(dst, *, overwrite, **options)`
and `export(ckpt, dst, *, overwrite, progress, **options) -> ExportReport`, where `ckpt` is
an open checkpoint whose parameters have torch names (`export` maps Flax names first).
Adding a format is adding a module and a line here.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Protocol

from ucp_jax import _errors
from ucp_jax.sinks._report import ExportReport

SINKS = {
  "deepspeed": "ucp_jax.sinks._deepspeed",
  "hf": "ucp_jax.sinks._hf",
  "orbax": "ucp_jax.sinks._orbax",
  "dcp": "ucp_jax.sinks._dcp",
}
"""Format name -> the module that writes it (imported on first use)."""


class Sink(Protocol):
  """What a sink module provides."""

  NAME: str
  DESCRIPTION: str

  def check_options(self, dst, *, overwrite: bool, **options) -> None:
    """Raises for bad options or a destination in the way, before anything is read."""

  def export(self, ckpt, dst: str, *, overwrite: bool, progress, **options) -> ExportReport:
    """Writes `ckpt` (torch names) to `dst`."""


def find(format: str) -> Sink:
  """The sink of `format`.

  Raises:
    InvalidArgumentError: no sink of that name (the message lists them).
  """
  module = SINKS.get(format)
  if module is None:
    raise _errors.InvalidArgumentError(
      f"format {format!r}: ucp_jax exports to {', '.join(sorted(SINKS))}"
    )
  return _load(module)


def check_option_names(sink: Sink, options: dict) -> None:
  """Raises for options the sink does not take, naming those it does."""
  accepted = [
    name
    for name, p in inspect.signature(sink.check_options).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name != "overwrite"
  ]
  unknown = sorted(set(options) - set(accepted))
  if unknown:
    raise _errors.InvalidArgumentError(
      f"format {sink.NAME!r} takes no {', '.join(unknown)}; its options: "
      f"{', '.join(accepted) or 'none'}"
    )


def _load(name: str) -> ModuleType:
  return importlib.import_module(name)
