"""The sources ucp_jax reads: found by name (`get`) or from a path (`sniff`, `find`).

A source is a module (or any object) with the members of `Source`: `sniff(path)` from file
names (at most a small pointer file read), `describe(path, **options) -> Plan` (the
parameters, slots, buffers and groups, or plain arrays, from metadata only; the arrays stay
on disk as lazy `Tensor`s). `ucp_jax.open`, `restore`, `convert` and `ucp inspect` find
the source of a path here. Other packages add sources through `ucp_jax.sources` entry
points, code through `register` (docs/plugins.md).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Protocol

from ucp_jax.base import _errors, _plugins

if TYPE_CHECKING:
  from ucp_jax.sources._source_plan import Plan


class Source(Protocol):
  """What a source provides (a module's globals and functions, or an object's attributes).

  Attributes:
    NAME: its name (`ucp convert --from NAME`, `ucp_jax.open(path, source=NAME)`).
    DESCRIPTION: what it recognizes, for the error that says what each source looks for.
  """

  NAME: str
  DESCRIPTION: str

  def sniff(self, path: str) -> bool:
    """Whether the local `path` looks like this source's (file names, at most a small
    pointer file read)."""

  def sniff_remote(self, url: str) -> bool:
    """`sniff` for a `gs://`, `s3://` or `memory://` URL (False if the source reads none)."""

  def sniff_weak(self, path: str) -> bool:
    """Whether `path` (a local path or URL) is this source's to explain when no source
    recognizes it (a DeepSpeed pointer to a missing tag folder: the error names the tag)."""

  def describe(self, path: str, **options) -> Plan:
    """Everything but the array data, which `Plan`'s tensors read lazily."""


SOURCES = _plugins.Registry(
  "source",
  "ucp_jax.sources",
  {
    "deepspeed": "ucp_jax.sources.deepspeed._source",
    "orbax": "ucp_jax.sources.orbax._source",
    "hf": "ucp_jax.sources.hf._source",
    "megatron": "ucp_jax.sources.megatron._source",
    "dcp": "ucp_jax.sources.dcp._source",
    "torch": "ucp_jax.sources.torch._source",
  },
  _plugins.protocol_members(Source),
)
"""Source name -> the source (imported on first use), in sniffing order: the built-in
ones, then other packages' and registered ones."""


register = SOURCES.register
"""`register(source, *, replace=False)`: adds a source (sniffed after the built-in ones)."""


def get(name: str) -> Source:
  """The source called `name`.

  Raises:
    InvalidArgumentError: no source of that name (the message lists them).
  """
  return SOURCES.lookup(
    name, lambda names: f"source {name!r}: ucp_jax reads {names} (and its own checkpoints)"
  )


def sniff(path: str | os.PathLike) -> Source | None:
  """The first source that recognizes `path`, else the first that weakly does, or None."""
  from ucp_jax.sources import _files  # on use: the names above import no TensorStore
  from ucp_jax.store import _location

  with _files.session():
    return _sniff(_location.named(path))


def _sniff(path: str | os.PathLike) -> Source | None:
  text = os.fspath(path) if not isinstance(path, dict) else ""
  remote = "://" in text  # on an object store: the sources that read by byte ranges
  if not remote and (not text or not os.path.exists(text)):
    return None
  sources = [get(name) for name in SOURCES]
  for source in sources:
    if source.sniff_remote(text) if remote else source.sniff(text):
      return source
  return next((s for s in sources if s.sniff_weak(text)), None)


def find(path: str | os.PathLike, name: str | None = None) -> Source:
  """The source of `path`: `name`'s, or the first that recognizes it.

  Raises:
    SourceFormatError: no source recognizes `path` (the message says what each looks for).
  """
  from ucp_jax.store import _location, _manifest  # on use: the names above need no TensorStore

  if name is not None:
    return get(name)
  text = _location.named(path)  # a kvstore spec: the URL that names it
  if "://" not in text and not os.path.exists(text):
    raise _errors.SourceFormatError(_manifest.no_such_path(os.path.abspath(text)))
  source = sniff(text)
  if source is None and os.path.isfile(os.path.join(text, "manifest.json")):
    raise _errors.SourceFormatError(
      f"{text}: already a ucp_jax checkpoint (it has a manifest.json): there is nothing to "
      "convert; read it as it is (ucp_jax.open, ucp_jax.restore), copy it, or write another "
      "format with `ucp export`"
    )
  if source is None and os.path.isfile(text):
    raise _errors.SourceFormatError(_manifest.file_not_read(os.path.abspath(text)))
  if source is None:
    looked_for = "; ".join(get(n).DESCRIPTION for n in SOURCES)
    found = ""
    if os.path.isdir(text):
      found = f". Found: {_errors.listed(sorted(os.listdir(text)))}"
    raise _errors.SourceFormatError(
      f"{text}: not a checkpoint ucp_jax reads. Looked for: {looked_for}{found}"
    )
  return source


def describe(path: str | os.PathLike, name: str | None = None, **options) -> Plan:
  """The plan of `path`, read by its source (`name`'s, or the one that recognizes it)."""
  from ucp_jax.sources import _files  # on use: the names above import no TensorStore
  from ucp_jax.store import _location

  text = _location.named(path)
  with _files.session():  # a URL's prefixes listed once for sniffing and describing
    plan = find(text, name).describe(text, **options)
    if "://" in plan.path:  # object stores list no sizes: the bytes its readers saw
      plan = dataclasses.replace(plan, source_bytes=_files.seen_bytes(plan.path))
    return plan
