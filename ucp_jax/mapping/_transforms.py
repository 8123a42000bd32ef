"""Per-array transforms of the mapping layer: transpose, split, merge, cast, stack.

A transform carries one array from the source layout (a torch `Linear.weight`,
`[out, in]`) to the target layout (a Flax kernel, `[in, out]`) in three forms that
agree with each other:
- on shapes and dtypes, so a whole mapping is checked before anything is read;
- on lazy TensorStore views, built from index transforms (`transpose`, slicing,
  `ts.stack`, `ts.concat`, `ts.cast`) only, so a restore reads just the chunks under
  each device's slice;
- on numpy arrays, forward (import in memory) and backward (export).

`stack` is not a per-array transform: it marks where, in a rule's transform list,
the per-layer arrays are stacked into one (see `_mapping.Rule`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy)
import numpy as np
import tensorstore as ts

Shape = tuple[int, ...]


class Transform:
  """One step of a rule, run forward on import and backward on export."""

  def shape(self, shape: Shape, dtype: np.dtype) -> tuple[Shape, np.dtype]:
    """The target shape and dtype of a source array; `ValueError` says why it does not apply."""
    raise NotImplementedError

  def inverse_shape(self, shape: Shape, dtype: np.dtype) -> tuple[Shape, np.dtype]:
    """The source shape and dtype of a target array; `ValueError` says why it does not apply."""
    raise NotImplementedError

  def view(self, store: ts.TensorStore) -> ts.TensorStore:
    """The lazy target view of a source TensorStore (origin 0 in, origin 0 out)."""
    raise NotImplementedError

  def forward(self, x: np.ndarray) -> np.ndarray:
    raise NotImplementedError

  def inverse(self, x: np.ndarray) -> np.ndarray:
    raise NotImplementedError

  def chunks(self, chunks: Shape, shape: Shape) -> Shape:
    """The chunk shape the view presents (exact for transpose and stack, a guide otherwise)."""
    return chunks


@dataclasses.dataclass(frozen=True)
class Transpose(Transform):
  axes: tuple[int, ...] | None = None  # None: reverse the axes

  def _axes(self, ndim: int) -> tuple[int, ...]:
    if self.axes is None:
      return tuple(range(ndim))[::-1]
    if sorted(self.axes) != list(range(ndim)):
      raise ValueError(f"{self} does not permute the {ndim} axes of the array")
    return self.axes

  def shape(self, shape, dtype):
    return tuple(shape[a] for a in self._axes(len(shape))), dtype

  def inverse_shape(self, shape, dtype):
    axes = self._axes(len(shape))
    return tuple(shape[a] for a in np.argsort(axes)), dtype

  def view(self, store):
    return store[ts.d[self._axes(store.rank)].transpose[:]]

  def forward(self, x):
    return np.transpose(x, self._axes(x.ndim))

  def inverse(self, x):
    return np.transpose(x, np.argsort(self._axes(x.ndim)))

  def chunks(self, chunks, shape):
    return tuple(chunks[a] for a in self._axes(len(chunks)))

  def __str__(self) -> str:
    return "transpose()" if self.axes is None else f"transpose({self.axes})"


def _resolve(sizes: Sequence[int], total: int) -> tuple[int, ...] | None:
  """`sizes` with its one `-1` filled in so that they multiply to `total`; None if impossible."""
  known = math.prod(s for s in sizes if s != -1)
  if list(sizes).count(-1) == 1:
    if known == 0 or total % known:
      return None
    return tuple(total // known if s == -1 else s for s in sizes)
  return tuple(sizes) if known == total else None


@dataclasses.dataclass(frozen=True)
class Split(Transform):
  """One axis -> `len(sizes)` axes (a head split: `[d, h*k] -> [d, h, k]`)."""

  axis: int
  sizes: tuple[int, ...]

  def _check(self, shape: Shape) -> tuple[int, tuple[int, ...]]:
    if not -len(shape) <= self.axis < len(shape):
      raise ValueError(f"{self} needs axis {self.axis}; the array has {len(shape)}")
    axis = self.axis % len(shape)
    sizes = _resolve(self.sizes, shape[axis])
    if sizes is None:
      raise ValueError(f"{self} cannot split axis {axis} of size {shape[axis]}")
    return axis, sizes

  def shape(self, shape, dtype):
    axis, sizes = self._check(shape)
    return shape[:axis] + sizes + shape[axis + 1 :], dtype

  def inverse_shape(self, shape, dtype):
    return Merge(self.axis, self.sizes).shape(shape, dtype)

  def view(self, store):
    axis, sizes = self._check(tuple(store.shape))
    for i in range(len(sizes) - 1):  # peel the outermost size off, one axis at a time
      store = _split_view(store, axis + i, sizes[i], math.prod(sizes[i + 1 :]))
    return store

  def forward(self, x):
    axis, sizes = self._check(x.shape)
    return x.reshape(x.shape[:axis] + sizes + x.shape[axis + 1 :])

  def inverse(self, x):
    return Merge(self.axis, self.sizes).forward(x)

  def chunks(self, chunks, shape):
    axis, sizes = self._check(shape)
    return chunks[:axis] + _split_chunk(chunks[axis], sizes) + chunks[axis + 1 :]

  def __str__(self) -> str:
    return f"split({self.axis}, {self.sizes})"


@dataclasses.dataclass(frozen=True)
class Merge(Transform):
  """`len(sizes)` adjacent axes starting at `axis` -> one axis (`[d, h, k] -> [d, h*k]`).

  A negative `axis` counts from the end of the merged shape, as `Split`'s does from
  the end of the shape it splits, so `Split(a, s)` and `Merge(a, s)` invert each other.
  """

  axis: int
  sizes: tuple[int, ...]

  def _check(self, shape: Shape) -> int:
    n = len(self.sizes)
    merged_rank = len(shape) - n + 1  # a negative axis counts from the end of the merged shape
    axis = self.axis + merged_rank if self.axis < 0 else self.axis
    if not 0 <= axis <= len(shape) - n:
      raise ValueError(f"{self} needs {n} axes from axis {self.axis}; the array has {len(shape)}")
    got = shape[axis : axis + n]
    if _resolve(self.sizes, math.prod(got)) != got:
      raise ValueError(f"{self} does not fit axes {axis}..{axis + n - 1} of shape {shape}")
    return axis

  def shape(self, shape, dtype):
    axis = self._check(shape)
    n = len(self.sizes)
    return (*shape[:axis], math.prod(shape[axis : axis + n]), *shape[axis + n :]), dtype

  def inverse_shape(self, shape, dtype):
    return Split(self.axis, self.sizes).shape(shape, dtype)

  def view(self, store):
    axis = self._check(tuple(store.shape))
    for _ in range(len(self.sizes) - 1):
      store = _merge_view(store, axis)
    return store

  def forward(self, x):
    return x.reshape(self.shape(x.shape, x.dtype)[0])

  def inverse(self, x):
    return Split(self.axis, self.sizes).forward(x)

  def chunks(self, chunks, shape):
    axis = self._check(shape)
    n = len(self.sizes)
    inner = chunks[axis : axis + n]
    whole = all(c == s for c, s in zip(inner[1:], shape[axis + 1 : axis + n]))
    merged = math.prod(inner) if whole else inner[-1]
    return (*chunks[:axis], merged, *chunks[axis + n :])

  def __str__(self) -> str:
    return f"merge({self.axis}, {self.sizes})"


@dataclasses.dataclass(frozen=True)
class SubParam(Transform):
  """Sub-parameter `index` of a fused array: axis `axis` holds sub-parameters in order, of
  relative sizes `sizes` (Phi-3's `qkv_proj`: `(heads, kv_heads, kv_heads)`; its
  `gate_up_proj`: `(1, 1)`), as DeepSpeed's `sub_params` pattern names them.

  On import it is a slice (a view: a read touches only the slice's chunks); on export the
  rules that take the sub-parameters of one name fuse them back, in order. It must be a
  rule's first transform.
  """

  axis: int
  sizes: tuple[int, ...]
  index: int

  def bounds(self, shape: Shape) -> tuple[int, int, int]:
    """`(axis, start, stop)` of the sub-parameter in an array of `shape`."""
    if not -len(shape) <= self.axis < len(shape):
      raise ValueError(f"{self} needs axis {self.axis}; the array has {len(shape)}")
    if not 0 <= self.index < len(self.sizes) or min(self.sizes, default=0) < 1:
      raise ValueError(f"{self}: index {self.index} of {len(self.sizes)} positive sizes")
    axis, total = self.axis % len(shape), sum(self.sizes)
    if shape[axis] % total:
      raise ValueError(f"{self} cannot cut axis {axis} of size {shape[axis]} in {self.sizes}")
    unit = shape[axis] // total
    start = unit * sum(self.sizes[: self.index])
    return axis, start, start + unit * self.sizes[self.index]

  def shape(self, shape, dtype):
    axis, start, stop = self.bounds(shape)
    return (*shape[:axis], stop - start, *shape[axis + 1 :]), dtype

  def inverse_shape(self, shape, dtype):
    """The whole fused array's shape, from this sub-parameter's."""
    axis = self.axis % len(shape)
    if not 0 <= self.index < len(self.sizes) or shape[axis] % self.sizes[self.index]:
      raise ValueError(f"{self} does not fit axis {axis} of shape {shape}")
    unit = shape[axis] // self.sizes[self.index]
    return (*shape[:axis], unit * sum(self.sizes), *shape[axis + 1 :]), dtype

  def view(self, store):
    axis, start, stop = self.bounds(tuple(store.shape))
    return store[_at(axis, slice(start, stop))].translate_to[0]

  def forward(self, x):
    axis, start, stop = self.bounds(x.shape)
    return x[_at(axis, slice(start, stop))]

  def inverse(self, x):
    return x  # this sub-parameter only; `fuse` joins them

  def chunks(self, chunks, shape):
    axis, start, stop = self.bounds(shape)
    return (*chunks[:axis], min(chunks[axis], stop - start), *chunks[axis + 1 :])

  def __str__(self) -> str:
    return f"sub_param({self.axis}, {self.sizes}, {self.index})"


def fuse(parts: dict[int, np.ndarray], sub: SubParam) -> np.ndarray:
  """The fused array from its sub-parameters `{index: array}` (every index present)."""
  return np.concatenate([parts[i] for i in range(len(sub.sizes))], axis=sub.axis)


@dataclasses.dataclass(frozen=True)
class Cast(Transform):
  dtype: str
  source: str | None = None  # the dtype export casts back to; None: keep the target's

  def shape(self, shape, dtype):
    return shape, np.dtype(self.dtype)

  def inverse_shape(self, shape, dtype):
    return shape, np.dtype(self.source) if self.source else dtype

  def view(self, store):
    return ts.cast(store, self.dtype)

  def forward(self, x):
    return x.astype(self.dtype)

  def inverse(self, x):
    return x.astype(self.source) if self.source else x

  def __str__(self) -> str:
    return f"cast({self.dtype!r})" if not self.source else f"cast({self.dtype!r}, {self.source!r})"


@dataclasses.dataclass(frozen=True)
class Stack(Transform):
  """Marks where a rule stacks its per-layer arrays along a new axis `axis`.

  The layer number is the rule's capture group `group` (0-based); layers must be
  numbered 0..n-1. Transforms before the marker apply to each layer, those after
  it to the stacked array.
  """

  group: int = 0
  axis: int = 0

  def __str__(self) -> str:
    return f"stack(group={self.group}, axis={self.axis})"


def stack_shape(shape: Shape, dtype: np.dtype, n: int, axis: int) -> tuple[Shape, np.dtype]:
  if not 0 <= axis <= len(shape):
    raise ValueError(f"cannot stack arrays of rank {len(shape)} along axis {axis}")
  return (*shape[:axis], n, *shape[axis:]), dtype


# Lazy reshapes. An index transform maps each stored dimension from one view dimension, so
# splitting or merging a dimension is a virtual stack (or concat) of strided slices: every
# piece is still an index transform of the stored array, and a read touches only its chunks.


def _at(axis: int, index) -> tuple:
  return (slice(None),) * axis + (index,)


def _split_view(store: ts.TensorStore, axis: int, outer: int, inner: int) -> ts.TensorStore:
  """Axis `axis` (size outer*inner) -> axes (outer, inner), stacking the fewer pieces."""
  if outer == 1 or inner == 1:
    return store[_at(axis + (outer != 1), ts.newaxis)].translate_to[0]
  if outer <= inner:  # piece i holds [i*inner, (i+1)*inner)
    pieces = [store[_at(axis, slice(i * inner, (i + 1) * inner))] for i in range(outer)]
    return ts.stack([p.translate_to[0] for p in pieces], axis=axis)
  pieces = [store[_at(axis, slice(j, None, inner))] for j in range(inner)]  # piece j: [j::inner]
  return ts.stack([p.translate_to[0] for p in pieces], axis=axis + 1)


def _merge_view(store: ts.TensorStore, axis: int) -> ts.TensorStore:
  """Axes (axis, axis+1) -> one axis, row-major: a concat of the outer axis's slices."""
  outer = store.shape[axis]
  if outer == 1:
    return store[_at(axis, 0)]
  if store.shape[axis + 1] == 1:
    return store[_at(axis + 1, 0)]
  return ts.concat([store[_at(axis, i)] for i in range(outer)], axis=axis)


def _split_chunk(chunk: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
  out, rest = [], chunk
  for size in reversed(sizes):
    c = min(size, rest) if rest % min(size, rest) == 0 else 1
    out.append(max(1, c))
    rest = max(1, rest // max(1, c))
  return tuple(reversed(out))
