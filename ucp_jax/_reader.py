"""`open`: a read-only view of a checkpoint, for inspection and for other tools."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import tensorstore as ts

from ucp_jax import _errors, _manifest, _store


class Checkpoint:
  """A committed checkpoint, opened read-only.

  Example:
    >>> import numpy as np, ucp_jax
    >>> _ = ucp_jax.save("/tmp/ucp_doc_open", {"a": {"b": np.arange(6).reshape(2, 3)}},
    ...                  overwrite=True)
    >>> ckpt = ucp_jax.open("/tmp/ucp_doc_open")
    >>> ckpt.keys(), ckpt["a/b"].shape
    (['a/b'], (2, 3))
    >>> ckpt.read("a/b", np.s_[:, 1:])
    array([[1, 2],
           [4, 5]])
  """

  def __init__(self, location: _store.Location, manifest: _manifest.Manifest):
    self.location = location
    self.manifest = manifest
    self._stores: dict[str, ts.TensorStore] = {}

  @property
  def step(self) -> int | None:
    return self.manifest.step

  @property
  def metadata(self) -> dict:
    return self.manifest.metadata

  @property
  def nbytes(self) -> int:
    return self.manifest.nbytes

  def keys(self) -> list[str]:
    return sorted(self.manifest.arrays)

  def __contains__(self, key: str) -> bool:
    return key in self.manifest.arrays

  def __getitem__(self, key: str) -> _manifest.ArrayInfo:
    try:
      return self.manifest.arrays[key]
    except KeyError:
      raise KeyError(f"{self.location}: no array {key!r} in this checkpoint") from None

  def tensorstore(self, key: str) -> ts.TensorStore:
    """The stored array as a TensorStore handle (lazy; index it, then `.read()`)."""
    self[key]
    if key not in self._stores:
      self._stores[key] = wait_open(self.location, key, self.open_future(key))
    return self._stores[key]

  def open_future(self, key: str) -> ts.Future:
    return _store.open_array(self.location, key)

  def read(self, key: str, index: Any = ()) -> np.ndarray:
    """Reads `key` (or the region `index` of it, numpy-style) into host memory.

    Raises:
      CorruptCheckpointError: a chunk fails its checksum or is missing.
    """
    store = self.tensorstore(key)
    return read_region(self.location, key, store[index] if index != () else store)

  def verify(self, on_array=None) -> dict[str, str]:
    """Reads every chunk back; returns the problems found by key (empty if sound).

    Example:
      >>> import numpy as np, ucp_jax
      >>> _ = ucp_jax.save("/tmp/ucp_doc_verify", {"x": np.ones(3)}, overwrite=True)
      >>> ucp_jax.open("/tmp/ucp_doc_verify").verify()
      {}
    """
    from ucp_jax import _verify

    return _verify.verify(self, on_array)

  def __repr__(self) -> str:
    return (
      f"Checkpoint({str(self.location)!r}, step={self.step}, arrays={len(self.manifest.arrays)}, "
      f"bytes={self.nbytes})"
    )


def read_region(location: _store.Location, key: str, view: ts.TensorStore) -> np.ndarray:
  return wait_read(location, key, view.read())


def wait_read(location: _store.Location, key: str, future: ts.Future) -> np.ndarray:
  """The result of a read, with storage errors named by checkpoint and key."""
  return _wait(location, key, future, "cannot read stored data")


def wait_open(location: _store.Location, key: str, future: ts.Future) -> ts.TensorStore:
  """The result of opening a stored array, with storage errors named by checkpoint and key."""
  return _wait(location, key, future, "cannot open stored array")


def _wait(location: _store.Location, key: str, future: ts.Future, what: str) -> Any:
  try:
    return future.result()
  except ValueError as e:
    raise _errors.CorruptCheckpointError(
      f"{location}: `{key}`: {what}: {_store.error_text(e)}"
    ) from e


def open(path: str | os.PathLike | Checkpoint) -> Checkpoint:
  """Opens a committed checkpoint read-only.

  Raises:
    CheckpointNotFoundError: no committed checkpoint at `path`.
    ManifestError: the manifest is truncated, foreign or of a newer format.
  """
  if isinstance(path, Checkpoint):  # already open (or a mapped view of one)
    return path
  location = _store.resolve(path)
  return Checkpoint(location, _manifest.read(location))
