"""The sources ucp_jax reads, found by name or by sniffing a path.

A source is a module with `NAME`, `DESCRIPTION`, `sniff(path) -> bool` (from file names,
at most a small pointer file read) and `describe(path, **options) -> Plan` (the parameters, slots,
buffers and groups, from metadata only; the arrays stay on disk as lazy `Tensor`s).
`ucp_jax.open`, `restore`, `convert` and `ucp inspect` find the source of a path here;
adding a format is adding a module and a line below.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Protocol

from ucp_jax import _errors
from ucp_jax.sources import _files
from ucp_jax.sources._source_plan import Plan

SOURCES = {
  "deepspeed": "ucp_jax.sources.deepspeed._source",
  "orbax": "ucp_jax.sources.orbax._source",
  "hf": "ucp_jax.sources.hf._source",
  "dcp": "ucp_jax.sources.dcp._source",
  "torch": "ucp_jax.sources.torch._source",
}
"""Source name -> the module that reads it (imported on first use), in sniffing order."""


class Source(Protocol):
  """What a source module provides."""

  NAME: str
  DESCRIPTION: str

  def sniff(self, path: str) -> bool:
    """Whether `path` looks like this source's (file names, at most a small pointer file read)."""

  def describe(self, path: str, **options) -> Plan:
    """Everything but the array data, which `Plan`'s tensors read lazily."""

  # Optional: `sniff_weak(path) -> bool`, a path this source should explain when no source
  # recognizes it (a DeepSpeed pointer to a missing tag folder: the error names the tag).


def get(name: str) -> Source:
  """The source called `name`.

  Raises:
    InvalidArgumentError: no source of that name (the message lists them).
  """
  module = SOURCES.get(name)
  if module is None:
    raise _errors.InvalidArgumentError(
      f"source {name!r}: ucp_jax reads {', '.join(SOURCES)} (and its own checkpoints)"
    )
  return importlib.import_module(module)


def sniff(path: str | os.PathLike) -> Source | None:
  """The first source that recognizes `path`, else the first that weakly does, or None."""
  with _files.session():
    return _sniff(path)


def _sniff(path: str | os.PathLike) -> Source | None:
  text = os.fspath(path) if not isinstance(path, dict) else ""
  if "://" in text:  # on an object store: the sources that read by byte ranges
    remote = [get(name) for name in SOURCES]
    found = next(
      (s for s in remote if getattr(s, "sniff_remote", None) and s.sniff_remote(text)), None
    )
    return found or next(
      (s for s in remote if getattr(s, "sniff_weak", None) and s.sniff_weak(text)), None
    )
  if not text or not os.path.exists(text):
    return None
  sources = [get(name) for name in SOURCES]
  for source in sources:
    if source.sniff(text):
      return source
  for source in sources:
    if getattr(source, "sniff_weak", None) and source.sniff_weak(text):
      return source
  return None


def find(path: str | os.PathLike, name: str | None = None) -> Source:
  """The source of `path`: `name`'s, or the first that recognizes it.

  Raises:
    SourceFormatError: no source recognizes `path` (the message says what each looks for).
  """
  if name is not None:
    return get(name)
  text = os.fspath(path)
  if "://" not in text and not os.path.exists(text):
    raise _errors.SourceFormatError(f"{text}: no such file or directory")
  source = sniff(text)
  if source is None and os.path.isfile(os.path.join(text, "manifest.json")):
    raise _errors.SourceFormatError(
      f"{text}: already a ucp_jax checkpoint (it has a manifest.json): there is nothing to "
      "convert; read it as it is (ucp_jax.open, ucp_jax.restore), copy it, or write another "
      "format with `ucp export`"
    )
  if source is None:
    looked_for = "; ".join(get(n).DESCRIPTION for n in SOURCES)
    found = ""
    if os.path.isdir(text):
      names = sorted(os.listdir(text))
      shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
      found = f". Found: {shown or 'nothing'}"
    raise _errors.SourceFormatError(
      f"{text}: not a checkpoint ucp_jax reads. Looked for: {looked_for}{found}"
    )
  return source


def describe(path: str | os.PathLike, name: str | None = None, **options) -> Plan:
  """The plan of `path`, read by its source (`name`'s, or the one that recognizes it)."""
  with _files.session():  # a URL's prefixes listed once for sniffing and describing
    plan = find(path, name).describe(os.fspath(path), **options)
    if "://" in plan.path:  # object stores list no sizes: the bytes its readers saw
      plan = dataclasses.replace(plan, source_bytes=_files.seen_bytes(plan.path))
    return plan
