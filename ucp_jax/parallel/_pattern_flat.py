"""`merge` for fragments that are still flat pieces (ZeRO partitions), with one copy.

A ZeRO-1/2 checkpoint holds each TP rank's fragment of a parameter as 1-D pieces of its dp
partitions. Concatenating them into the fragment and then merging the fragments copies every
element twice; `merge_flat` copies each piece straight to its place in the logical array
(by the same `_patterns.layout` geometry), and for a replicated parameter compares the ranks'
pieces in place and hands back rank 0's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ucp_jax.base._errors import MappingError, bullet_list
from ucp_jax.parallel._patterns import CAT_KINDS, Pattern, check_equal, layout, merge, segments_of


def merge_flat(
  shards: Sequence[Sequence[np.ndarray]],
  shapes: Sequence[tuple[int, ...]],
  pattern: Pattern,
  *,
  name: str = "parameter",
) -> np.ndarray | list[np.ndarray]:
  """`merge` of fragments still in flat pieces (ZeRO partitions), copying each element once.

  Args:
    shards: per rank, 1-D arrays whose concatenation is that rank's fragment in C order.
    shapes: per rank, the fragment's shape.
    pattern: the parameter's pattern.
    name: the parameter, for messages.

  Returns:
    The logical array; for `replicated` (after checking every rank's copy against rank 0's),
    rank 0's pieces as they are, to be concatenated by the caller.
  """
  problems = [
    f"rank {r}: pieces of {sum(p.size for p in ps)} elements for a fragment of {tuple(shape)}"
    for r, (ps, shape) in enumerate(zip(shards, shapes))
    if sum(p.size for p in ps) != int(np.prod(shape))
  ]
  if problems:
    raise MappingError(f"`{name}`: fragments do not fill their shapes:\n{bullet_list(problems)}")
  if pattern.kind == "replicated" and len({tuple(s) for s in shapes}) == 1:
    for r in range(1, len(shards)):
      for a, b in _aligned(shards[0], shards[r]):
        if not np.array_equal(a, b):  # the slow path names the difference
          copies = [whole(ps, shape) for ps, shape in zip(shards, shapes)]
          check_equal(copies, name=name)
    return _strip_vocab(list(shards[0]), shapes[0], pattern)
  if pattern.kind not in CAT_KINDS:
    return merge([whole(ps, shape) for ps, shape in zip(shards, shapes)], pattern, name=name)
  dim = pattern.cat_dim
  total = list(shapes[0])
  total[dim] = sum(s[dim] for s in shapes)
  widths = None
  if pattern.kind != "sub_params" or len(segments_of(pattern, total[dim], name)) == 1:
    widths = [[s[dim] for s in shapes]]
  lay = layout(
    dataclasses.replace(pattern, vocab_size=None), total, len(shards), widths=widths, name=name
  )
  wrong = [
    f"rank {r} holds {tuple(s)}, expected {lay.fragment_shapes[r]}"
    for r, s in enumerate(shapes)
    if tuple(s) != lay.fragment_shapes[r]
  ]
  if wrong:
    raise MappingError(
      f"`{name}`: fragments do not fit the pattern {pattern.to_json()}:\n{bullet_list(wrong)}"
    )
  dtype = np.result_type(*[p.dtype for ps in shards for p in ps])
  out = np.empty(lay.padded_shape, dtype)
  outer = int(np.prod(total[:dim]))
  inner = int(np.prod(total[dim + 1 :]))
  out2 = out.reshape(outer, total[dim] * inner)
  for r, pieces in enumerate(shards):
    row = shapes[r][dim] * inner  # one outer index of the fragment, flat
    blocks = [
      (d[dim].start * inner, d[dim].stop * inner, s[dim].start * inner) for s, d in lay.pieces[r]
    ]
    at = 0
    for piece in pieces:
      _scatter(out2, piece, at, row, blocks)
      at += piece.size
  if pattern.vocab_size is not None:
    return out[: pattern.vocab_size]
  return out


def _scatter(out2: np.ndarray, piece: np.ndarray, at: int, row: int, blocks) -> None:
  """Copies `piece` (fragment-flat elements [at, at + size)) into `out2` ([outer, C*inner]).

  A fragment's outer index `o` holds `row` elements; its elements [d0, d1) of that row go to
  `out2[o, s0 : s0 + d1 - d0]` for each block `(d0, d1, s0)`.
  """
  end = at + piece.size
  if not piece.size or not row:
    return
  first, last = at // row, (end - 1) // row
  full_lo = first if at == first * row else first + 1
  full_hi = last + 1 if end == (last + 1) * row else last
  if full_hi > full_lo:
    rows = piece[full_lo * row - at : full_hi * row - at].reshape(full_hi - full_lo, row)
    for d0, d1, s0 in blocks:
      out2[full_lo:full_hi, s0 : s0 + d1 - d0] = rows[:, d0:d1]
  for o in sorted({first, last}):
    if full_lo <= o < full_hi:
      continue
    for d0, d1, s0 in blocks:
      lo, hi = max(at, o * row + d0), min(end, o * row + d1)
      if lo < hi:
        out2[o, s0 + lo - o * row - d0 : s0 + hi - o * row - d0] = piece[lo - at : hi - at]


def _aligned(a: Sequence[np.ndarray], b: Sequence[np.ndarray]):
  """Pairs of equal-length segments of two piece lists over the same flat range."""
  i = j = 0
  ia = ib = 0  # offsets inside a[i], b[j]
  while i < len(a) and j < len(b):
    n = min(a[i].size - ia, b[j].size - ib)
    yield a[i][ia : ia + n], b[j][ib : ib + n]
    ia, ib = ia + n, ib + n
    if ia == a[i].size:
      i, ia = i + 1, 0
    if ib == b[j].size:
      j, ib = j + 1, 0


def whole(pieces: Sequence[np.ndarray], shape) -> np.ndarray:
  """The fragment of `shape` that `pieces` make up (a view when it is one piece)."""
  flat = pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.zeros(0)
  return flat.reshape(shape)


def _strip_vocab(pieces: list[np.ndarray], shape, pattern: Pattern):
  if pattern.vocab_size is None or pattern.vocab_size == shape[0]:
    return pieces
  return whole(pieces, shape)[: pattern.vocab_size]
