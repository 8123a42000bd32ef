"""The one place that turns a pytree path into a checkpoint key and back.

A key is a `/`-joined string such as `params/blocks/0/fc1/kernel`. Each part is
percent-encoded where it would otherwise be ambiguous (a `/` inside a dict key,
an empty name, `.` or `..`, a leading `__` that zarr reserves, or a name the store
uses itself, such as `zarr.json`), so that every key is also a valid zarr v3 node
path inside the checkpoint and maps back to exactly one pytree path.

Keys read from a manifest are checked against the same grammar (`problem`), so a
crafted manifest cannot name a file outside the checkpoint or one of its own files.
"""

from __future__ import annotations

import functools
import re
import urllib.parse
from collections.abc import Iterable
from typing import Any

from ucp_jax.base import _errors

_SAFE = "-_.~+=,@[]()"
_PART = re.compile(r"^(?:[A-Za-z0-9\-_.~+=,@\[\]()]|%[0-9A-Fa-f]{2})+$")
RESERVED = frozenset({"zarr.json", "manifest.json", ".ucp-lock"})
"""Names the store gives its own files: an encoded key part never equals one of them.

(An array's chunks live under `KEY/c/`; no key lies below an array, so `c` is free.)
"""
MAX_PART_BYTES = 255
"""The longest file name most file systems allow: a longer key part cannot be stored."""
MAX_PARTS = 100
"""The most parts a key may have: the manifest's tree outline nests one level per part, and
readers refuse documents nested deeper than `_untrusted.MAX_JSON_DEPTH`."""


@functools.lru_cache(maxsize=1 << 16)  # the same names recur in every save, restore, reshard
def encode_part(name: str) -> str:
  """Encodes one path component (a dict key, attribute or index).

  Raises:
    InvalidKeyError: a name that is not valid Unicode (a lone surrogate), which no file
      name, URL or JSON reader takes.
  """
  try:
    name.encode()
  except UnicodeEncodeError:
    raise _errors.InvalidKeyError(
      f"name {name!a} is not valid Unicode (a lone surrogate): no key can hold it"
    ) from None
  if name in ("", ".", ".."):
    return {"": "%00empty", ".": "%2E", "..": "%2E%2E"}[name]
  encoded = urllib.parse.quote(name, safe=_SAFE)
  if encoded.startswith("__"):
    encoded = "%5F" + encoded[1:]
  if encoded in RESERVED:
    encoded = "%" + f"{ord(encoded[0]):02X}" + encoded[1:]
  return encoded


def decode_part(part: str) -> str:
  if part == "%00empty":
    return ""
  return urllib.parse.unquote(part)


def join(parts: Iterable[str]) -> str:
  return "/".join(encode_part(p) for p in parts)


def split(key: str) -> list[str]:
  return [decode_part(p) for p in key.split("/")] if key else []


def problem(key: str) -> str | None:
  """Why `key` cannot name an array inside a checkpoint (None when it can).

  A valid key is what `join` makes: non-empty parts of safe characters and
  percent escapes, none `.` or `..` (so none leaves the checkpoint), none starting
  with `__`, none a name the store reserves, none longer than a file name may be,
  each spelled as `encode_part` spells its name (two keys never name one leaf).
  """
  if not isinstance(key, str) or not key:
    return "empty key"
  parts = key.split("/")
  if len(parts) > MAX_PARTS:
    return f"{len(parts)} path components (at most {MAX_PARTS})"
  for part in parts:
    if not part:
      return "empty path component (a leading, trailing or doubled `/`)"
    if part in (".", "..") or not _PART.match(part):
      return f"path component {part!r} is not an encoded key name"
    if part.startswith("__") or part in RESERVED:
      return f"path component {part!r} is reserved"
    if len(part) > MAX_PART_BYTES:
      return f"path component of {len(part)} characters (at most {MAX_PART_BYTES})"
    if encode_part(decode_part(part)) != part:  # one spelling per name: `a%41` is `aA`'s
      return f"path component {part!r} is not encoded as a save encodes it"
  return None


def problems(keys: Iterable[str]) -> list[str]:
  """Every key of a checkpoint that cannot be stored as given, with the reason: bad
  names (`problem`), and keys that lie below another key (an array cannot hold arrays)."""
  keys = list(keys)
  present = set(keys)
  out = [f"{k!r}: {p}" for k in keys for p in [problem(k)] if p]
  for key in keys:
    parts = key.split("/") if isinstance(key, str) else []
    above = next(
      (a for a in ("/".join(parts[:i]) for i in range(1, len(parts))) if a in present), None
    )
    if above is not None:
      out.append(f"{key!r}: lies below the array {above!r}")
  return out


def under(prefix: str, key: str) -> str:
  """`key` placed below the subtree `prefix` (either may be empty)."""
  prefix = prefix.strip("/")
  if not prefix:
    return key
  return f"{prefix}/{key}" if key else prefix


def structure(keys: list[str]) -> dict:
  """The nested-dict outline of a set of keys, leaves holding their full key."""
  root: dict = {}
  for key in keys:
    node = root
    parts = key.split("/")
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = key
  return root


def nest(values: dict[str, Any], outline: dict | None = None) -> Any:
  """Nested dicts (lists where every child name is 0..n-1) holding `values` by key."""
  outline = outline if outline is not None else structure(list(values))

  def build(node: Any) -> Any:
    if isinstance(node, str):
      return values[node]
    children = {decode_part(k): build(v) for k, v in node.items()}
    if (
      children
      and all(k.isdigit() for k in children)
      and sorted(map(int, children)) == list(range(len(children)))
    ):
      return [children[str(i)] for i in range(len(children))]
    return children

  return build(outline)
