"""The one place that turns a pytree path into a checkpoint key and back.

A key is a `/`-joined string such as `params/blocks/0/fc1/kernel`. Each part is
percent-encoded where it would otherwise be ambiguous (a `/` inside a dict key,
an empty name, `.` or `..`, or a leading `__` that zarr reserves), so that every
key is also a valid zarr v3 node path and maps back to exactly one pytree path.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable
from typing import Any

_SAFE = "-_.~+=,@[]()"


def encode_part(name: str) -> str:
  """Encodes one path component (a dict key, attribute or index)."""
  if name in ("", ".", ".."):
    return {"": "%00empty", ".": "%2E", "..": "%2E%2E"}[name]
  encoded = urllib.parse.quote(name, safe=_SAFE)
  if encoded.startswith("__"):
    encoded = "%5F" + encoded[1:]
  return encoded


def decode_part(part: str) -> str:
  if part == "%00empty":
    return ""
  return urllib.parse.unquote(part)


def entry_name(entry: Any) -> str:
  """The plain name of one `jax.tree_util` path entry."""
  import jax

  if isinstance(entry, jax.tree_util.DictKey):
    return str(entry.key)
  if isinstance(entry, jax.tree_util.SequenceKey):
    return str(entry.idx)
  if isinstance(entry, jax.tree_util.GetAttrKey):
    return entry.name
  if isinstance(entry, jax.tree_util.FlattenedIndexKey):
    return str(entry.key)
  key = getattr(entry, "key", None)  # flax NNX and other custom path entries
  return str(key) if key is not None else str(entry)


def join(parts: Iterable[str]) -> str:
  return "/".join(encode_part(p) for p in parts)


def split(key: str) -> list[str]:
  return [decode_part(p) for p in key.split("/")] if key else []


def from_path(path: tuple[Any, ...]) -> str:
  """The checkpoint key of a `jax.tree_util` key path."""
  return join(entry_name(e) for e in path)


def under(prefix: str, key: str) -> str:
  """`key` placed below the subtree `prefix` (either may be empty)."""
  prefix = prefix.strip("/")
  if not prefix:
    return key
  return f"{prefix}/{key}" if key else prefix
