"""What the safe pickle reader makes of the globals a pickle names: records, never code.

`InertGlobal` and `InertObject` keep what a pickle said about classes the reader does not import;
`Allowed` wraps the few functions a pickle may call; `call` is the one place a pickled call is
made, and `unsafe` the error for a pickle that asks for more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ucp_jax.base._errors import SourceFormatError, UnsafePickleError


@dataclasses.dataclass(frozen=True)
class InertGlobal:
  """A class or function that the pickle names and the reader never imports or calls."""

  qualname: str


@dataclasses.dataclass(frozen=True)
class InertObject:
  """What a pickle said about an object of a class the reader does not call, kept as data.

  Attributes:
    qualname: ``module.qualname`` of the class (or of the function the pickle called).
    args: the positional arguments of the call; ``(value,)`` for an enum member.
    kwargs: the keyword arguments (NEWOBJ_EX only), else None.
    state: what the pickle passed to ``__setstate__`` (BUILD): usually the instance ``__dict__``,
      or a ``(__dict__, slots)`` pair; None if there was no BUILD.
    listitems: items appended to it (a list subclass), else None.
    dictitems: items set on it (a dict subclass), else None.
  """

  qualname: str
  args: tuple = ()
  kwargs: dict | None = None
  state: Any = None
  listitems: list | None = None
  dictitems: dict | None = None

  def __hash__(self) -> int:
    # Records of one class made by NEWOBJ differ only in their state (DCP's MetadataIndex,
    # thousands of them as dict keys): hashing (qualname, args) alone made every insertion
    # compare against all the others, quadratic time. A bounded digest of the state keeps
    # equal records equal in hash and tells apart those that differ in a small field. The
    # hash is kept once taken: a BUILD after the record became a dict key strands no entry.
    cached = self.__dict__.get("_hash")
    if cached is None:
      cached = hash((self.qualname, self.args, _digest(self.state)))
      object.__setattr__(self, "_hash", cached)
    return cached

  def get(self, name: str, default: Any = None) -> Any:
    """Returns attribute `name` from the recorded state, or `default`."""
    parts = self.state if isinstance(self.state, tuple) else (self.state,)
    for part in parts:
      if isinstance(part, dict) and name in part:
        return part[name]
    return default

  @property
  def value(self) -> Any:
    """The single constructor argument: an enum member's value."""
    if len(self.args) != 1:
      raise AttributeError(f"{self.qualname} record has {len(self.args)} arguments, not one value")
    return self.args[0]


_DIGEST_ITEMS = 64
_DIGEST_SCALARS = (str, int, float, bytes, bool, type(None))


def _digest(state: Any) -> tuple:
  """At most `_DIGEST_ITEMS` items summing up `state`, the same for equal states (dicts of
  string keys in key order; other containers by kind and length). Not recursive."""
  out: list = []
  stack = [state]
  while stack and len(out) < _DIGEST_ITEMS:
    node = stack.pop()
    kind = type(node)
    if kind in _DIGEST_SCALARS:
      out.append(node)
    elif kind in (tuple, list):
      out.append((kind.__name__, len(node)))
      stack.extend(reversed(node[:_DIGEST_ITEMS]))
    elif isinstance(node, dict) and len(node) <= _DIGEST_ITEMS:
      keys = list(node)
      out.append(("dict", len(node)))
      if all(type(k) is str for k in keys):
        for key in sorted(keys, reverse=True):
          stack += [node[key], key]
    elif isinstance(node, (dict, set, frozenset)):
      out.append(("mapping or set", len(node)))
    else:
      out.append(kind.__name__)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Allowed:
  """An allowed global: the pickle may call `fn` (which must check its own arguments)."""

  qualname: str
  fn: Callable[..., Any]


NDARRAY = InertGlobal("numpy.ndarray")


def call(func: Any, args: Any, *, source: str, kwargs: Any = None) -> Any:
  """Calls what the pickle calls: an `Allowed` global runs, an `InertGlobal` gives a record."""
  if not isinstance(args, tuple) or not isinstance(kwargs, dict | None):
    raise SourceFormatError(f"{source}: call arguments are a {type(args).__name__}, not a tuple")
  if isinstance(func, InertGlobal):
    return InertObject(func.qualname, args, kwargs=kwargs)
  if isinstance(func, Allowed):
    return func.fn(*args, **(kwargs or {}))
  raise unsafe(source, f"it calls an object of type {type(func).__name__}, not an allowed global")


def unsafe(source: str, what: str) -> UnsafePickleError:
  """The error for a pickle that asks for `what`."""
  return UnsafePickleError(
    f"{source}: refusing to unpickle: {what}. The safe reader only builds data; load the file "
    "with torch.load(..., weights_only=False) only if you trust where it came from."
  )
