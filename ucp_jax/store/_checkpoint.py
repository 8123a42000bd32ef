"""`Checkpoint`: what every read-only checkpoint offers, declared once.

`tree/` restores from it, `sinks/` export from it, `mapping/` wraps it. Its implementations:
a committed ucp_jax checkpoint (`_reader.StoredCheckpoint`), another format's files seen as
one (`sources/_view.SourceCheckpoint`), a checkpoint seen through a rule set
(`mapping/_mapped.MappedCheckpoint`) and in-memory arrays (`mapping/_load.ArraysCheckpoint`).
Each implements `open_future` and `verify`, and overrides the other members where it can do
better than their defaults; none gets an attribute from outside.
"""

from __future__ import annotations

import abc
import difflib
import math
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.store import _lazy, _location, _manifest, _untrusted, _zarr

if TYPE_CHECKING:
  import tensorstore as ts
else:
  ts = _lazy.tensorstore


class Checkpoint(abc.ABC):
  """A checkpoint opened read-only: its arrays by key, their metadata, lazy reads.

  `ucp_jax.open` returns one for a ucp_jax checkpoint and for any format a source reads.

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

  Attributes:
    location: where it was opened (for messages, and where its files are).
    manifest: every array's `ArrayInfo` (shape, dtype, chunks), the tree, step, schema and
      source, as a ucp_jax checkpoint's manifest says them.
    checksummed: whether `verify` checks every chunk against a checksum (False for other
      formats' files and in-memory arrays).
  """

  checksummed: bool = False

  def __init__(self, location: _location.Location, manifest: _manifest.Manifest):
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
    except (KeyError, TypeError):
      near = difflib.get_close_matches(str(key), self.manifest.arrays, n=3)
      hint = f" (did you mean {', '.join(near)}?)" if near else ""
      raise _errors.ArrayNotFoundError(
        f"{self.location}: no array {key!r} in this checkpoint{hint}"
      ) from None

  @abc.abstractmethod
  def open_future(self, key: str) -> ts.Future:
    """Opens `key` as a lazy, read-only TensorStore (a `ts.Future[ts.TensorStore]`)."""

  @abc.abstractmethod
  def verify(self, on_array=None) -> dict[str, str]:
    """Reads every array back; returns the problems found by key (empty if sound).

    `on_array(key, nbytes)` is called after each array.
    """

  def tensorstore(self, key: str) -> ts.TensorStore:
    """The stored array as a TensorStore handle (lazy; index it, then `.read()`)."""
    self[key]
    if key not in self._stores:
      self._stores[key] = _zarr.wait_open(self.location, key, self.open_future(key))
    return self._stores[key]

  def reads_directly(self, key: str) -> bool:
    """Whether `start_read` reads `key` (by `pread` into aligned buffers, no TensorStore)."""
    self[key]
    return False

  def start_read(self, key: str, regions: list) -> tuple[list[np.ndarray], Any]:
    """Starts reading `regions` of `key` into aligned host buffers (`reads_directly` keys).

    Returns the buffers and a function that waits for them to be filled (and raises what
    went wrong).
    """
    raise ValueError(f"`{key}` is not read directly; read it through open_future")

  def comes_from(self, key: str) -> str | None:
    """Where `key`'s data comes from, for messages (a view says its source), or None."""
    self[key]
    return None

  def replaced(self) -> bool:
    """Whether another save has replaced the checkpoint since it was opened (its old files
    may be gone under a read). False where nothing can replace it."""
    return False

  def read(self, key: str, index: Any = ()) -> np.ndarray:
    """Reads `key` (or the region `index` of it, numpy-style) into host memory.

    Raises:
      RegionError: `index` is outside the array.
      CorruptCheckpointError: a chunk fails its checksum or is missing.
      ConcurrentWriteError: another save replaced the checkpoint during the read.
    """
    info = self[key]
    if index == () and info.shape and math.prod(info.shape) and self.reads_directly(key):
      # the whole array, as a restore reads it: straight from the files into one buffer
      _untrusted.check_allocation(
        math.prod(info.shape) * np.dtype(info.dtype).itemsize, f"{self.location}: reading `{key}`"
      )
      try:
        (out,), wait = self.start_read(key, [tuple(slice(0, n) for n in info.shape)])
        wait()
      except _errors.CorruptCheckpointError as e:
        raise if_replaced(self, e) from e
      return out
    store = self.tensorstore(key)
    try:
      view = store[index] if index != () else store
    except IndexError as e:
      why = re.sub(r" \[(domain|transform)=.*$", "", _location.error_text(e))
      raise _errors.RegionError(
        f"{self.location}: `{key}` of shape {self[key].shape}: index {index!r} is outside it "
        f"({why.removeprefix('OUT_OF_RANGE: ')})"
      ) from None
    nbytes = math.prod(view.shape) * view.dtype.numpy_dtype.itemsize
    _untrusted.check_allocation(nbytes, f"{self.location}: reading `{key}`")
    try:
      return _zarr.read_region(self.location, key, view)
    except _errors.CorruptCheckpointError as e:
      raise if_replaced(self, e) from e

  def __repr__(self) -> str:
    return f"{type(self).__name__}({str(self.location)!r}, arrays={len(self.manifest.arrays)})"


def if_replaced(ckpt: Checkpoint, error: _errors.CorruptCheckpointError) -> Exception:
  """The error to raise for a failed read: a ConcurrentWriteError if another save replaced
  the checkpoint meanwhile (its old chunks deleted under the read), else `error`."""
  if ckpt.replaced():
    return _errors.ConcurrentWriteError(
      f"{ckpt.location}: the checkpoint was replaced by another save during the read, "
      f"whose files went away under it ({error}); open it again to read the new one"
    )
  return error
