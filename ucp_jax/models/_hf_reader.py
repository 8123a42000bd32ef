"""Reading a `config.json` field by field, as `transformers` 5 reads it, every problem collected.

A field absent from the file takes its `transformers` config class's default (the family's
`defaults`); a field present as `null` is None, which means something of its own for some
fields (no sliding window, no soft-capping, as many key/value heads as query heads). Every
value is checked for its type and range (the file is untrusted input), and every problem is
kept, to be raised at once, one line naming the file and each field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ucp_jax.base import _errors

MAX_SIZE = 1 << 31
"""The largest size (vocabulary, width, layers, heads, positions) a config may give."""

ACTIVATIONS = {
  "silu": "silu",
  "swish": "silu",
  "gelu_new": "gelu_tanh",
  "gelu_pytorch_tanh": "gelu_tanh",
  "gelu_python_tanh": "gelu_tanh",
  "gelu_fast": "gelu_tanh",
  "gelu_accurate": "gelu_tanh",
  "gelu": "gelu",
  "gelu_python": "gelu",
  "quick_gelu": "quick_gelu",
  "relu": "relu",
  "relu2": "relu2",
  "relu6": "relu6",
  "tanh": "tanh",
  "sigmoid": "sigmoid",
}
"""`transformers` activation names (`ACT2FN`) -> `ucp_jax.models._common.ACTIVATIONS` keys."""

_ABSENT = object()


def is_int(value: Any, low: int, high: int) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Reader:
  """Reads a config's fields, each checked for its type, collecting every problem.

  `defaults` are the `transformers` config class's defaults of the fields read (what an
  absent field is).
  """

  def __init__(self, config: Mapping[str, Any], where: str, defaults: Mapping[str, Any]):
    self.config, self.where, self.defaults = config, where, defaults
    self.problems: list[str] = []
    self.names("architectures")  # read by `ucp_jax.rules.from_hf` for the names' prefix

  def __call__(self, key: str) -> Any:
    """The field's value: the file's (None for `null`), else the class default (else None)."""
    value = self.config.get(key, _ABSENT)
    return self.defaults.get(key) if value is _ABSENT else value

  def present(self, key: str) -> bool:
    return key in self.config

  def problem(self, text: str) -> None:
    self.problems.append(text)

  def refuse(self, condition: bool, problem: str) -> None:
    if condition:
      self.problems.append(problem)

  def checked(self, key: str, value: Any, ok: bool, what: str, fallback: Any) -> Any:
    if value is None or ok:
      return value
    self.problems.append(f"`{key}`: {_errors.shown(value)} is not {what}")
    return fallback

  def size(self, key: str, fallback: Any = None) -> int:
    """A positive integer (at most `MAX_SIZE`); None (or absent without a default) takes
    `fallback`, and is a problem without one."""
    value = self(key)
    if value is None:
      value = fallback
      if value is None:
        self.problems.append(f"`{key}`: missing")
        return 1
    return self.checked(key, value, is_int(value, 1, MAX_SIZE), "a positive integer", 1)

  def optional_size(self, key: str) -> int | None:
    """A positive integer, or None (`null`: the feature is off)."""
    value = self(key)
    return self.checked(key, value, is_int(value, 1, MAX_SIZE), "a positive integer", None)

  def number(self, key: str, *, value: Any = _ABSENT) -> float:
    """A positive finite number (`value` when given, else the field `key`)."""
    value = self(key) if value is _ABSENT else value
    if value is None:
      self.problems.append(f"`{key}`: null is not a positive number")
      return 1.0
    ok = is_number(value) and value > 0
    return float(self.checked(key, value, ok, "a positive number", 1.0))

  def optional_number(self, key: str) -> float | None:
    """A positive finite number, or None (`null`: the feature is off)."""
    value = self(key)
    ok = is_number(value) and value > 0
    value = self.checked(key, value, ok, "a positive number", None)
    return None if value is None else float(value)

  def flag(self, key: str) -> bool:
    """True or false (`null` is false, as `transformers` tests it)."""
    value = self(key)
    return bool(self.checked(key, value, isinstance(value, bool), "true or false", False))

  def text(self, key: str) -> str | None:
    value = self(key)
    return self.checked(key, value, isinstance(value, str), "a name", None)

  def mapping(self, key: str) -> dict | None:
    """An object, or None (absent or `null`)."""
    value = self(key)
    value = self.checked(key, value, isinstance(value, Mapping), "an object", None)
    return None if value is None else dict(value)

  def names(self, key: str) -> list[str] | None:
    value = self(key)
    ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    return self.checked(key, value, ok, "a list of names", None)

  def act(self, key: str) -> str:
    """An activation name `ACTIVATIONS` knows, as its `ucp_jax.models._common` key."""
    name = self.text(key)
    if name not in ACTIVATIONS:
      if name is not None or self.present(key):
        self.problems.append(
          f"`{key}`: {_errors.shown(name)} is not one of {', '.join(ACTIVATIONS)}"
        )
      return "silu"
    return ACTIVATIONS[name]

  def done(self, kind: str, make):
    if self.problems:
      raise _errors.MappingError(
        f"{self.where} ({kind}): the reference Flax model cannot run it: "
        + "; ".join(self.problems)
      )
    return make()
