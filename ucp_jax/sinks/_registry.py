"""The sinks ucp_jax writes, found by format name (`get`).

A sink is a module (or any object) with the members of `Sink`: its `Options` (a frozen
dataclass: one field per option, made with `option`, whose values it checks when built; the
`ucp export` flags come from it), `check_options` (the destination, before anything is read)
and `export(ckpt, dst, ...)`, which writes an open `Checkpoint` whose
parameters have torch names (`export` maps Flax names first) or, for a sink of JAX keys
(`TORCH_NAMES = False`), the checkpoint's own keys. Other packages add sinks through
`ucp_jax.sinks` entry points, code through `register` (docs/plugins.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

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
  Options: Callable[..., Any]
  """A frozen dataclass of the options the sink takes (`option` makes each field); building
  one checks the values (raises `InvalidArgumentError`)."""

  def check_options(self, destination: Destination, options: Any) -> object:
    """Raises for a destination in the way (given the options), before anything is read;
    what it returns is not used (the built-in sinks return the checked path)."""

  def export(self, ckpt: Checkpoint, destination: Destination, options: Any) -> ExportReport:
    """Writes `ckpt` to `destination.path`, reporting each item to `destination.progress`."""


@dataclasses.dataclass(frozen=True)
class Destination:
  """Where an export writes, whatever the format.

  Attributes:
    path: the folder to create, or an earlier export of the same format to replace.
    overwrite: replace an earlier export of the same format at `path` (nothing else).
    progress: called as `progress(item, nbytes, total)` after each item is written.
  """

  path: str
  overwrite: bool = False
  progress: Callable[[str, int, int], None] | None = None


def option(
  default: Any,
  help: str,
  *,
  parse: Callable[[str], Any] | None = None,
  choices: Sequence[Any] | None = None,
  flag: bool = True,
) -> Any:
  """A field of a sink's `Options`: its default, what it does (the flag's help), and how
  `ucp export --NAME VALUE` reads VALUE (`parse`: default from the default's type: int,
  true/false, else the text; `choices` to list). `flag=False`: Python only (an object)."""
  meta = {"help": help, "parse": parse, "choices": choices, "flag": flag}
  return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class NoOptions:
  """The `Options` of a sink that takes none."""


SINKS = _plugins.Registry(
  "sink",
  "ucp_jax.sinks",
  {
    "deepspeed": "ucp_jax.sinks._deepspeed",
    "hf": "ucp_jax.sinks._hf",
    "orbax": "ucp_jax.sinks._orbax",
    "dcp": "ucp_jax.sinks._dcp",
    "megatron": "ucp_jax.sinks._megatron",
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
  return SINKS.lookup(format, lambda names: f"format {format!r}: ucp_jax exports to {names}")


def option_fields(sink: Sink) -> tuple[dataclasses.Field, ...]:
  """The fields of `sink.Options`: one per option the sink takes."""
  return dataclasses.fields(sink.Options)  # type: ignore[arg-type]


def option_names(sink: Sink) -> list[str]:
  """The options `sink` takes."""
  return [f.name for f in option_fields(sink)]


def options_of(sink: Sink, given: dict[str, Any]) -> Any:
  """`sink.Options` of the `given` options, checked.

  Raises:
    InvalidArgumentError: options the sink does not take (naming those it does), or values
      it cannot use.
  """
  accepted = option_names(sink)
  unknown = sorted(set(given) - set(accepted))
  if unknown:
    raise _errors.InvalidArgumentError(
      f"format {sink.NAME!r} takes no {', '.join(unknown)}; its options: "
      f"{', '.join(accepted) or 'none'}"
    )
  return sink.Options(**given)


def flag_parser(field: dataclasses.Field) -> Callable[[str], Any]:
  """How `ucp export --NAME VALUE` reads VALUE for `field`."""
  parse = field.metadata.get("parse")
  if parse is not None:
    return parse
  kinds = {part.strip() for part in str(field.type).split("|")} - {"None"}
  if isinstance(field.default, bool) or kinds == {"bool"}:
    return true_or_false
  if (isinstance(field.default, int) and not kinds) or kinds == {"int"}:
    return int
  return str


def true_or_false(text: str) -> bool:
  """`true` or `false` (any case) as a bool (a flag's value)."""
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  raise ValueError(f"{text!r}: true or false")
