"""A tensor read by region through a plain function: what the Megatron views compose.

A lazy `Tensor`'s cell callback must not wait on another TensorStore read (the cells share
one executor), so views of views compose these functions, and only the outermost becomes a
`Tensor` (`lazy_tensor`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ucp_jax.sources._source_plan import Tensor, lazy_tensor
from ucp_jax.sources.dcp import _chunks
from ucp_jax.sources.dcp._metadata import TensorEntry

Read = Callable[[tuple[slice, ...], np.ndarray], None]


@dataclasses.dataclass(frozen=True)
class Readable:
  """An array of `shape` and `dtype` whose region `read(region, out)` fills `out` with."""

  shape: tuple[int, ...]
  dtype: np.dtype
  read: Read
  where: str
  as_tensor: Callable[[], Tensor] | None = None  # a better `Tensor` of the same array

  def tensor(self) -> Tensor:
    if self.as_tensor is not None:
      return self.as_tensor()
    return lazy_tensor(self.shape, self.dtype, self.read, where=self.where)


def of_entry(files: _chunks.RankFiles, entry: TensorEntry, where: str) -> Readable:
  """A DCP tensor, read from its chunks in the rank files."""
  reader = _chunks.Reader(files, entry, where)
  tensor = lambda: _chunks.tensor(files, entry, where)  # noqa: E731  (its cells, its pieces)

  def read(region: tuple[slice, ...], out: np.ndarray) -> None:
    reader.read(region, out)

  return Readable(entry.shape, np.dtype(entry.dtype), read, where, tensor)
