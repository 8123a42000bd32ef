"""The error hierarchy: one base class, one subclass per kind of bad input.

Every subclass is also the builtin exception a caller would expect
(`FileNotFoundError`, `ValueError`, ...), so `except ValueError` keeps working.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Any


class UcpError(Exception):
  """Base class of every error ucp_jax raises on purpose."""


class CheckpointNotFoundError(UcpError, FileNotFoundError):
  """No committed checkpoint at the path (missing, or a save that never finished)."""


class CheckpointExistsError(UcpError, FileExistsError):
  """Saving over an existing checkpoint without `overwrite=True`."""


class ConcurrentWriteError(UcpError, RuntimeError):
  """Another writer holds the path."""


class ManifestError(UcpError, ValueError):
  """The manifest is truncated, foreign, or of an unknown format version."""


class CorruptCheckpointError(UcpError, ValueError):
  """Stored data fails its checksum or disagrees with the manifest."""


class TreeMismatchError(UcpError, ValueError):
  """The keys of the target tree and of the checkpoint differ."""


class ArrayNotFoundError(UcpError, KeyError):
  """A key that names no array of the checkpoint (`ckpt["typo"]`)."""

  def __str__(self) -> str:  # a KeyError would show its message quoted, as a key
    return str(self.args[0]) if self.args else ""


class RegionError(UcpError, IndexError):
  """An index outside an array's shape (`ckpt.read(key, np.s_[100:])` of 10 rows)."""


class ShapeMismatchError(UcpError, ValueError):
  """An array's shape in the target differs from the stored one."""


class DtypeMismatchError(UcpError, TypeError):
  """An array's dtype in the target differs from the stored one and no cast was asked for."""


class ShardingError(UcpError, ValueError):
  """A sharding that does not fit the array it is meant for."""


class UnsupportedLeafError(UcpError, TypeError):
  """A pytree leaf that ucp_jax cannot store."""


class SourceFormatError(UcpError, ValueError):
  """A foreign checkpoint (torch, DeepSpeed, ...) that cannot be read as what it claims to be."""


class UnsafePickleError(SourceFormatError):
  """A pickle that asks for something the safe reader refuses to do."""


class MissingDependencyError(UcpError, ImportError):
  """An optional dependency (an extra such as `ucp_jax[torch]`) is not installed."""


class MappingError(UcpError, ValueError):
  """Names or layouts that a mapping cannot carry between a checkpoint and a target."""


class InvalidArgumentError(UcpError, ValueError):
  """An option with a value ucp_jax cannot use (`compression="gzip"`, `chunk_bytes=0`, ...)."""


class InvalidKeyError(UcpError, ValueError):
  """A pytree path that cannot name an array in a checkpoint (too long a name, ...)."""


class InsufficientMemoryError(UcpError, MemoryError):
  """A read would need more memory than this process can allocate (sizes declared by files)."""


class StorageError(UcpError, OSError):
  """The storage refused a read or write: disk full, permission denied, unreachable, ..."""


class CommitUncertainError(StorageError):
  """A save's commit got no answer, nor did the read that would tell whether it landed: the
  path holds one whole checkpoint, the one before or the new one (`open` tells which)."""


def bullet_list(lines: list[str], limit: int = 50) -> str:
  """Formats offending items one per line, eliding past `limit` so messages stay readable."""
  shown = [f"  {line}" for line in lines[:limit]]
  if len(lines) > limit:
    shown.append(f"  ... and {len(lines) - limit} more")
  return "\n".join(shown)


# Foreign input in messages: one way to show a value, a name, a listing, and to raise what
# was collected, so that a hostile name looks the same whichever format or layer met it.

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 76, 76, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdict = 6
SHOWN_CHARS = 80
"""The most characters a value takes in a message."""


def shown(value: Any) -> str:
  """`value` as a message shows it, however large, deep or hostile: a repr bounded while it
  is built (a list of millions, a nesting thousands deep), control and bidi characters
  escaped (repr escapes what is not printable), at most `SHOWN_CHARS` characters."""
  return clipped(_REPR.repr(value))


def clipped(text: str) -> str:
  """`text` (already escaped) cut to `SHOWN_CHARS` characters, "..." marking the cut."""
  return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def named(text: str) -> str:
  """A name from foreign input (a file, a key) on one line: as it is when printable, else
  its repr (a newline, a terminal escape or a bidi override shown escaped)."""
  return text if text.isprintable() else repr(text)


def listed(names: Sequence[str], limit: int = 12) -> str:
  """The first `limit` of `names`, each `named`, comma-separated ("nothing" when none)."""
  shown_names = ", ".join(named(n) for n in names[:limit])
  return (shown_names + (" ..." if len(names) > limit else "")) or "nothing"


def raise_problems(error: type[UcpError], header: str, problems: Sequence[str]) -> None:
  """Raises `error` for the problems collected, if any: `header: problem` for one, the
  header above a bullet list for several."""
  if len(problems) == 1:
    raise error(f"{header}: {problems[0]}")
  if problems:
    raise error(f"{header}:\n{bullet_list(list(problems))}")
