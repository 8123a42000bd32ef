"""Whether the chunks of a DCP tensor tile it exactly, and which chunks a region meets.

A chunk is a box (`offsets`, `sizes` per dimension). The chunks of a tensor must cover every
element exactly once: no overlap, no hole. Comparing every pair of chunks is quadratic (a
metadata file of 20,000 chunks took minutes), so `problems` checks corners instead, in time
linear in the chunks for the few dimensions a tensor is split along:

Let `f` count, for each element, the chunks that hold it. Its mixed difference along the k
split dimensions (the k-th order finite difference) is +1 or -1 at each corner of each chunk
(-1 where an odd number of its coordinates are upper bounds) and 0 elsewhere, summed over
the chunks; and a function that is 0 far enough down is the k-fold prefix sum of its
difference. So `f` is 1 on the tensor and 0 outside it, an exact tiling, if and only if the
chunks' signed corners add up to the tensor's own. The work is `chunks * 2**k`, bounded by
`MAX_CORNERS` over a whole metadata file. Only when the check fails is a pair that overlaps
looked for (`MAX_COMPARISONS`), to name it.

`Index` finds the chunks under a region for reads: by bisection on each dimension when the
chunks form a grid (DTensor shardings, FSDP2), else along the dimension split the most.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from typing import Any

MAX_CORNERS = 1 << 20
"""Corners (chunks times 2**split dimensions) that the checks of one metadata file may add up:
a few seconds and 100 MB at most. The pickle's own limits (`_pickle_limits.MAX_STEPS`) keep
a metadata file under about 180,000 chunks, so only a file split along 3 or more dimensions
can reach it."""
MAX_COMPARISONS = 1 << 16
"""Chunk pairs compared to name an overlap once the corners show one (else the message says
how many elements the chunks hold)."""

Box = Any  # has `offsets` and `sizes`, tuples of ints (`_metadata.Chunk`)


class Budget:
  """The corners a metadata file's checks may still spend (`MAX_CORNERS`)."""

  def __init__(self, corners: int = MAX_CORNERS):
    self.left = corners

  def spend(self, n: int) -> bool:
    self.left -= n
    return self.left >= 0


def problems(shape: tuple[int, ...], chunks: Sequence[Box], budget: Budget) -> list[str]:
  """What keeps `chunks` (each inside `shape`) from tiling `shape` exactly (none: they do)."""
  total = math.prod(shape)
  live = [c for c in chunks if math.prod(c.sizes)]
  if not live:
    return ["no chunks: the tensor is stored nowhere"] if total else []
  split = [d for d in range(len(shape)) if any(c.sizes[d] != shape[d] for c in live)]
  if not budget.spend(len(live) << len(split)):
    return [
      f"{len(live)} chunks split along {len(split)} dimensions: more corners to check than "
      f"the {MAX_CORNERS} a metadata file may ask for (MAX_CORNERS)"
    ]
  if _corners_match(shape, live, split):
    return []
  held = sum(math.prod(c.sizes) for c in live)
  pair = _overlap(live)
  if pair is not None:
    a, b = pair
    return [f"chunks at {a.offsets} (sizes {a.sizes}) and {b.offsets} (sizes {b.sizes}) overlap"]
  if held >= total:
    return [f"chunks overlap: they hold {held} elements, and the tensor has {total}"]
  return [f"chunks cover {held} of its {total} elements: holes{_holes(shape, live)}"]


def _corners_match(shape: tuple[int, ...], live: Sequence[Box], split: list[int]) -> bool:
  """Whether the chunks' signed corners (along the `split` dimensions) are the tensor's."""
  count: dict[tuple, int] = {}
  # itertools.product picks lower or upper bounds in binary order: its n-th corner has as
  # many upper bounds as n has bits set
  signs = [-1 if n.bit_count() & 1 else 1 for n in range(1 << len(split))]
  boxes = [[(c.offsets[d], c.offsets[d] + c.sizes[d]) for d in split] for c in live]
  boxes.append([(0, shape[d]) for d in split])
  whole = len(boxes) - 1
  for i, box in enumerate(boxes):
    flip = -1 if i == whole else 1  # the tensor's own corners are taken away
    for corner, sign in zip(itertools.product(*box), signs):
      count[corner] = count.get(corner, 0) + sign * flip
  return not any(count.values())


def _overlap(live: Sequence[Box]) -> tuple[Box, Box] | None:
  """Two chunks that overlap, found within `MAX_COMPARISONS` by a sweep along the dimension
  with the most distinct offsets."""
  d = _most_split(live)
  order = sorted(live, key=lambda c: c.offsets[d] if d is not None else 0)
  compared = 0
  for i, a in enumerate(order):
    for j in range(i + 1, len(order)):
      b = order[j]
      compared += 1
      if compared > MAX_COMPARISONS:
        return None
      if d is not None and b.offsets[d] >= a.offsets[d] + a.sizes[d]:
        break
      if all(
        max(x, y) < min(x + n, y + m) for x, n, y, m in zip(a.offsets, a.sizes, b.offsets, b.sizes)
      ):
        return a, b
  return None


def _most_split(live: Sequence[Box]) -> int | None:
  """The dimension along which the chunks have the most distinct offsets (None for 0-d)."""
  ndim = len(live[0].offsets) if live else 0
  return max(range(ndim), key=lambda d: len({c.offsets[d] for c in live}), default=None)


def _holes(shape: tuple[int, ...], chunks: Sequence[Box]) -> str:
  """Where along dimension 0 nothing is stored, when every chunk spans the other dimensions."""
  if not shape or any(tuple(c.sizes[1:]) != tuple(shape[1:]) for c in chunks):
    return ""
  gaps, at = [], 0
  for c in sorted(chunks, key=lambda c: c.offsets[0]):
    if c.offsets[0] > at:
      gaps.append(f"[{at}, {c.offsets[0]})")
    at = max(at, c.offsets[0] + c.sizes[0])
  if at < shape[0]:
    gaps.append(f"[{at}, {shape[0]})")
  shown = ", ".join(gaps[:8]) + (" ..." if len(gaps) > 8 else "")
  return f" at rows {shown}" if gaps else ""


class Index:
  """The chunks (of an exact tiling) under a region, without looking at the others."""

  def __init__(self, chunks: Sequence[Box]):
    live = [c for c in chunks if math.prod(c.sizes)]
    self._grid = _grid(live)
    if self._grid is None:  # sorted along the dimension with the most distinct offsets
      self._dim = _most_split(live)
      key = (lambda c: c.offsets[self._dim]) if self._dim is not None else (lambda c: 0)
      self._chunks = sorted(live, key=key)
      self._starts = [key(c) for c in self._chunks]
      ends = [key(c) + (c.sizes[self._dim] if self._dim is not None else 1) for c in self._chunks]
      self._reach = list(itertools.accumulate(ends, max))  # the furthest end reached so far

  def under(self, region: tuple[slice, ...]) -> list[Box]:
    """The chunks that meet `region` (and perhaps a few more, in the fallback)."""
    if self._grid is not None:
      bounds, cells = self._grid
      spans = []
      for s, b in zip(region, bounds):
        first = bisect.bisect_right(b, s.start) - 1
        spans.append(range(max(first, 0), bisect.bisect_left(b, s.stop, lo=first + 1)))
      return [cells[cell] for cell in itertools.product(*spans)]
    if self._dim is None:
      return list(self._chunks)
    first, last = region[self._dim].start, region[self._dim].stop
    out = []
    for k in range(bisect.bisect_left(self._starts, last) - 1, -1, -1):
      if self._reach[k] <= first:
        break
      out.append(self._chunks[k])
    return out


def _grid(live: Sequence[Box]) -> tuple[list[list[int]], dict[tuple, Box]] | None:
  """(boundaries per dimension, grid cell -> chunk) when each chunk is one cell of the grid
  that the chunks' boundaries draw, else None."""
  if not live:
    return None
  ndim = len(live[0].offsets)
  bounds = [
    sorted({c.offsets[d] for c in live} | {c.offsets[d] + c.sizes[d] for c in live})
    for d in range(ndim)
  ]
  if math.prod(len(b) - 1 for b in bounds) != len(live):
    return None
  where = [{v: i for i, v in enumerate(b)} for b in bounds]
  cells = {}
  for c in live:
    cell = tuple(where[d][c.offsets[d]] for d in range(ndim))
    if any(where[d][c.offsets[d] + c.sizes[d]] != cell[d] + 1 for d in range(ndim)):
      return None
    cells[cell] = c
  return (bounds, cells) if len(cells) == len(live) else None
