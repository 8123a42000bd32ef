"""The `ucp export` flags: one per field of every sink's `Options` (`sinks/_registry.option`),
plugin sinks included. Imported when a command line may run `export` (the sinks load then)."""

from __future__ import annotations

import argparse
from typing import Any


def sink_flags() -> dict[str, list[tuple[str, Any]]]:
  """Every export flag the sinks' `Options` declare: field name -> [(sink name, field)]."""
  from ucp_jax.sinks import _registry as sinks

  flags: dict[str, list[tuple[str, Any]]] = {}
  for name in sinks.SINKS:
    for field in sinks.option_fields(sinks.get(name)):
      if field.metadata.get("flag", True):
        flags.setdefault(field.name, []).append((name, field))
  return flags


def add(p: argparse.ArgumentParser) -> None:
  """Adds a flag for each option of every sink to the `export` parser `p`."""
  from ucp_jax.sinks import _registry as sinks

  for option, fields in sink_flags().items():
    field = fields[0][1]
    parse = sinks.flag_parser(field)
    p.add_argument(
      f"--{option.replace('_', '-')}",
      dest=option,
      type=parse,
      choices=field.metadata.get("choices"),
      metavar="{true,false}" if parse is sinks.true_or_false else None,
      help="; ".join(f"{sink}: {f.metadata.get('help', '')}" for sink, f in fields),
    )
