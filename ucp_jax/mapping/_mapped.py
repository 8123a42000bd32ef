"""A checkpoint seen through a mapping: target keys, target layouts, nothing read up front.

`MappedCheckpoint` offers what `restore` and `Checkpoint` readers use (`keys()`,
`[key] -> ArrayInfo`, `open_future`, `tensorstore`, `read`, `manifest`, `location`),
so it restores, reads and maps further like the checkpoint it wraps. Each target
array is a TensorStore view over the stored source arrays, built only from index
transforms and virtual stacks: indexing it with a device's slice and reading
touches only the stored chunks under that slice.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorstore as ts

from ucp_jax.mapping import _plan
from ucp_jax.store import _keypath, _reader
from ucp_jax.store._manifest import ArrayInfo


class MappedCheckpoint(_reader.Checkpoint):
  """A read-only view of `base` with the keys and layouts a mapping stage makes.

  Keys outside `subtree` (when given) are left out; keys inside it are matched
  relative to it, and the target keys are placed below it again.
  """

  def __init__(self, base: _reader.Checkpoint, entries: dict[str, _plan.Entry], subtree: str = ""):
    self.base = base
    self._prefix = subtree
    self._entries = {_keypath.under(subtree, k): e for k, e in entries.items()}
    arrays = {k: e.info for k, e in self._entries.items()}
    manifest = dataclasses.replace(
      base.manifest, arrays=arrays, tree=_keypath.structure(sorted(arrays))
    )
    super().__init__(base.location, manifest)

  def source_keys(self, key: str) -> tuple[str, ...]:
    """The keys of `base` that the target `key` is made of (one per layer when stacked)."""
    return tuple(_keypath.under(self._prefix, s) for s in self._entries[key].sources)

  def describe(self, key: str) -> str:
    """Where `key` comes from: `from params/h.0.w (8, 4) float32 via transpose()`."""
    entry = self._entries[key]
    sources = self.source_keys(key)
    first = self.base[sources[0]]
    what = sources[0] if len(sources) == 1 else f"{sources[0]} .. {sources[-1]}"
    steps = ", ".join(map(str, entry.rule.transforms))
    return f"from {what} {first.shape} {first.dtype}" + (f" via {steps}" if steps else "")

  def open_future(self, key: str) -> ts.Future:
    """Opens the lazy target view of `key` (a `ts.Future[ts.TensorStore]`)."""
    self[key]
    rule = self._entries[key].rule
    futures = [self.base.open_future(s) for s in self.source_keys(key)]

    def build(stores: list[ts.TensorStore]) -> ts.TensorStore:
      layers = [_apply(store, rule.before_stack) for store in stores]
      if rule.stack is None:
        return layers[0]
      return _apply(ts.stack(layers, axis=rule.stack.axis), rule.after_stack)

    return _after_all(futures, build)

  def files(self, key: str) -> None:
    """None: a mapped array is read through its view, never straight from files."""
    self[key]

  def verify(self, on_array=None) -> dict[str, str]:
    return self.base.verify(on_array)

  def __repr__(self) -> str:
    return f"MappedCheckpoint({self.base!r}, arrays={len(self._entries)})"


def _apply(store: ts.TensorStore, transforms) -> ts.TensorStore:
  for t in transforms:
    store = t.view(store)
  return store


def _after_all(futures: list[ts.Future], build: Callable[[list], Any]) -> ts.Future:
  """A future of `build(results)`, resolved when every one of `futures` is."""
  promise, result = ts.Promise.new()
  lock = threading.Lock()
  left = [len(futures)]

  def done(_):
    with lock:
      left[0] -= 1
      if left[0]:
        return
    try:
      promise.set_result(build([f.result() for f in futures]))
    except Exception as e:  # handed to whoever waits on the future
      promise.set_exception(e)

  for f in futures:
    f.add_done_callback(done)
  return result


def info_of(array: Any) -> ArrayInfo:
  """An in-memory array's ArrayInfo (what planning needs: shape, dtype)."""
  shape = tuple(np.shape(array))
  return ArrayInfo(shape, np.dtype(array.dtype).name, shape)
