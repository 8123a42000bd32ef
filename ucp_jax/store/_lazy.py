"""TensorStore (and ml_dtypes with it), imported when first used, not when the store is.

Importing TensorStore costs half a second of CPU, nearly all of it ml_dtypes registering its
types with numpy; `ucp --help` and `ucp inspect` of a local checkpoint never touch either.
The store's modules hold `ts = _lazy.tensorstore` and use it as the module: the first
attribute read imports it (under Python's import lock, so threads may race to it) and keeps
the attribute, so later reads cost what a module's do.
"""

from __future__ import annotations

import importlib
from typing import Any


class _Module:
  def __init__(self, *names: str):
    self._names = names  # the module, then what must load with it

  def __getattr__(self, attr: str) -> Any:
    for name in self._names[1:]:
      importlib.import_module(name)
    value = getattr(importlib.import_module(self._names[0]), attr)
    setattr(self, attr, value)
    return value

  def __repr__(self) -> str:
    return f"<lazy module {self._names[0]!r}>"


tensorstore: Any = _Module("tensorstore", "ml_dtypes")
"""The `tensorstore` module, imported on first use (with ml_dtypes: numpy then knows
`bfloat16` and the float8 types by name)."""


def attributes(module: str, namespace: dict[str, Any], table: dict[str, tuple[str, str | None]]):
  """A package's `__getattr__` and `__dir__` (PEP 562) for the names of `table`, each loaded
  on first use: name -> (module, attribute, or None for the module itself), then kept in
  `namespace` (the package's globals)."""

  def __getattr__(name: str) -> Any:
    if name not in table:
      raise AttributeError(f"module {module!r} has no attribute {name!r}")
    where, attr = table[name]
    value = importlib.import_module(where)
    value = value if attr is None else getattr(value, attr)
    namespace[name] = value
    return value

  def __dir__() -> list[str]:
    return sorted(set(namespace) | set(table))

  return __getattr__, __dir__
