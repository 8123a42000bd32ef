"""The package's caches of computed plans, and the one `clear_caches` that empties them.

Plans (which devices hold which region, who writes what, which copies build a slice) are
pure functions of shardings and shapes, and a state's arrays share a few layouts, so they
are computed once per layout. A custom sharding may be unhashable: its plans are then
computed on every call, never a `TypeError`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable
from typing import Any

_CLEARS: list[Callable[[], None]] = []


def clear_caches() -> None:
  """Empties every cache made here (tests, or a process that drops its meshes)."""
  for clear in _CLEARS:
    clear()


def cached_when_hashable(maxsize: int):
  """`functools.lru_cache`, except for calls with an unhashable argument (a custom
  sharding), which are computed each time."""

  def wrap(fn):
    cached = functools.lru_cache(maxsize=maxsize)(fn)
    _CLEARS.append(cached.cache_clear)

    @functools.wraps(fn)
    def call(*args):
      if not hashable(args):
        return fn(*args)
      return cached(*args)

    call.cache_clear = cached.cache_clear
    return call

  return wrap


class Memo:
  """A bounded map from keys to computed values (emptied whole when full): `get(key, make)`
  returns the value of `key`, made by `make()` the first time; an unhashable key is made
  each time."""

  def __init__(self, maxsize: int):
    self._maxsize = maxsize
    self._values: dict[Hashable, Any] = {}
    self._lock = threading.Lock()
    _CLEARS.append(self.clear)

  def get(self, key: Any, make: Callable[[], Any]) -> Any:
    if not hashable(key):
      return make()
    with self._lock:
      if key in self._values:
        return self._values[key]
    value = make()  # outside the lock: two threads may both make it, with the same result
    with self._lock:
      if len(self._values) >= self._maxsize:
        self._values.clear()
      self._values[key] = value
    return value

  def clear(self) -> None:
    with self._lock:
      self._values.clear()


def hashable(value: Any) -> bool:
  try:
    hash(value)
  except TypeError:
    return False
  return True
