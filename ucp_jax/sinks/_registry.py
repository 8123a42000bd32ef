"""The sinks ucp_jax writes, found by format name (`get`).

A sink is a module (or any object) with the members of `Sink`: `check_options` (before
anything is read) and `export(ckpt, dst, ...)`, which writes an open `Checkpoint` whose
parameters have torch names (`export` maps Flax names first) or, for a sink of JAX keys
(`TORCH_NAMES = False`), the checkpoint's own keys. Other packages add sinks through
`ucp_jax.sinks` entry points, code through `register` (docs/plugins.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ucp_jax.base import _errors, _plugins

if TYPE_CHECKING:
  from ucp_jax.sinks._report import ExportReport
  from ucp_jax.store._checkpoint import Checkpoint


class Sink(Protocol):
  """What a sink provides (a module's globals and functions, or an object's attributes).

  Attributes:
    NAME: its format name (`ucp export --format NAME`, `ucp_jax.export(..., format=NAME)`).
    DESCRIPTION: what it writes, one line.
    TORCH_NAMES: whether it writes torch names (a rule set maps a Flax-named checkpoint to
      them first), or the checkpoint's own keys (False: `rules=` is refused).
  """

  NAME: str
  DESCRIPTION: str
  TORCH_NAMES: bool

  def check_options(self, dst, *, overwrite: bool, **options) -> None:
    """Raises for bad options or a destination in the way, before anything is read. Its
    keyword-only parameters are the options the sink takes."""

  def export(
    self,
    ckpt: Checkpoint,
    dst: str,
    *,
    overwrite: bool,
    progress: Callable[[str, int, int], None] | None,
    **options,
  ) -> ExportReport:
    """Writes `ckpt` to `dst`, calling `progress(item, nbytes, total)` after each item."""


SINKS = _plugins.Registry(
  "sink",
  "ucp_jax.sinks",
  {
    "deepspeed": "ucp_jax.sinks._deepspeed",
    "hf": "ucp_jax.sinks._hf",
    "orbax": "ucp_jax.sinks._orbax",
    "dcp": "ucp_jax.sinks._dcp",
  },
  _plugins.protocol_members(Sink),
)
"""Format name -> the sink (imported on first use): the built-in ones, then other packages'
and registered ones."""


register = SINKS.register
"""`register(sink, *, replace=False)`: adds a sink."""


def get(format: str) -> Sink:
  """The sink of `format`.

  Raises:
    InvalidArgumentError: no sink of that name (the message lists them).
  """
  if format not in SINKS:
    raise _errors.InvalidArgumentError(
      f"format {format!r}: ucp_jax exports to {', '.join(sorted(SINKS))}"
    )
  return SINKS[format]


def option_names(sink: Sink) -> list[str]:
  """The options `sink` takes (the keyword-only parameters of its `check_options`)."""
  return [
    name
    for name, p in inspect.signature(sink.check_options).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name != "overwrite"
  ]


def check_option_names(sink: Sink, options: dict) -> None:
  """Raises for options the sink does not take, naming those it does."""
  accepted = option_names(sink)
  unknown = sorted(set(options) - set(accepted))
  if unknown:
    raise _errors.InvalidArgumentError(
      f"format {sink.NAME!r} takes no {', '.join(unknown)}; its options: "
      f"{', '.join(accepted) or 'none'}"
    )
