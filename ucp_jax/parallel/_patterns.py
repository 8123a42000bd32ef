"""Tensor, pipeline and expert parallel layouts as reversible transforms (pure numpy).

A *pattern* says how the per-rank fragments of one parameter make up its logical array. It is
the second half of universal checkpointing (UCP): ZeRO fragments are cut by offsets, but
tensor-parallel (TP), pipeline (PP) and expert-parallel (EP) fragments need to know *what* a
parameter is. The kinds, with DeepSpeed's names (`deepspeed/checkpoint/constants.py`,
`ds_to_universal.merge_tp_slices`, `universal_checkpoint.load_hp_checkpoint_state`):

| kind | fragments | DeepSpeed key |
|---|---|---|
| `column` | concatenated on `cat_dim` 0 (a Linear's outputs) | the default |
| `row` | concatenated on `cat_dim` 1 (a Linear's inputs) | `PARAMETER_WITH_ROW_PARALLELISM_PATTERNS` |
| `replicated` | equal copies; a divergence is an error naming the max difference | `TP_REPLICATED_PARAMETER_PATTERNS` |
| `average` | copies that may differ; the logical array is their mean | `PARAMETER_TO_AVERAGE_PATTERNS` |
| `sub_params` | each rank holds its piece of every sub-parameter, in order, on `cat_dim` (SwiGLU `[gate_k; up_k]`, fused QKV `[q_k; k_k; v_k]`, GQA widths included) | `PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0`, `PARAMETER_WITH_SUB_PARAMS`, `SUB_PARAM_SHARD_WIDTHS` |
| `expert` | EP ranks' `[local_experts, ...]` stacks (or one array per expert) -> `[num_experts, ...]` | `EXPERT_PARAMETER_PATTERNS` |

Any kind may carry `vocab_size` (`VOCABULARY_PARAMETER_PATTERNS` + `ORIGINAL_VOCAB_SIZE`): the
merged array is stripped to the original vocabulary, and padded again (zeros) on split.
Pipeline stages hold disjoint layers, except tied parameters (an embedding shared by the first
and last stage, `PIPELINE_REPLICATED_PARAMETER_PATTERNS`): their stage copies merge like
`replicated` (`merge_stage_copies`).

`merge(fragments, pattern)` and `split(logical, degree, pattern)` are exact inverses; both go
through `layout`, which lists for each rank the pieces (logical region -> fragment region) it
holds, so the same geometry also tells a reader which slice of the logical array each rank or
device needs. `_pattern_flat.merge_flat` merges fragments still in flat pieces (ZeRO
partitions) with one copy; `_pattern_rules.classify` assigns one pattern to every parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ucp_jax.base._errors import MappingError, bullet_list

KINDS = ("column", "row", "replicated", "average", "sub_params", "expert")
CAT_KINDS = ("column", "row", "sub_params", "expert")
Region = tuple[slice, ...]
Piece = tuple[Region, Region]  # (region of the logical array, region of the fragment)


@dataclasses.dataclass(frozen=True)
class Pattern:
  """How one parameter is laid out over ranks.

  Attributes:
    kind: one of `KINDS`.
    cat_dim: the dimension fragments are concatenated on (`column` 0, `row` 1, `expert` 0).
    sub_params: for `sub_params`, the number of equal sub-parameters (an int) or their logical
      sizes along `cat_dim` (a tuple, e.g. `(q, kv, kv)` for grouped-query attention).
    shard_widths: per sub-parameter (one entry for a plain `column`/`row`), the width each
      rank holds in the source layout; None means an even split.
    vocab_size: the original vocabulary; rows past it are padding.
    num_experts: for `expert`, the number of experts.
  """

  kind: str
  cat_dim: int | None = None
  sub_params: int | tuple[int, ...] | None = None
  shard_widths: tuple[tuple[int, ...], ...] | None = None
  vocab_size: int | None = None
  num_experts: int | None = None

  def __post_init__(self) -> None:
    if self.kind not in KINDS:
      raise ValueError(f"pattern kind {self.kind!r} is not one of {', '.join(KINDS)}")
    if self.cat_dim is None and self.kind in CAT_KINDS:
      object.__setattr__(self, "cat_dim", 1 if self.kind == "row" else 0)
    if self.kind == "sub_params" and self.sub_params is None:
      raise ValueError("a sub_params pattern needs sub_params (a count or the sizes)")
    if isinstance(self.sub_params, list):
      object.__setattr__(self, "sub_params", tuple(self.sub_params))
    if self.shard_widths is not None:
      object.__setattr__(self, "shard_widths", tuple(tuple(w) for w in self.shard_widths))

  def to_json(self) -> dict:
    """The schema form: `{"kind": ..., "cat_dim": ..., ...}` without the unset fields."""
    out: dict[str, Any] = {"kind": self.kind}
    for field in ("cat_dim", "sub_params", "shard_widths", "vocab_size", "num_experts"):
      value = getattr(self, field)
      if value is not None:
        out[field] = [list(w) for w in value] if field == "shard_widths" else value
    if isinstance(out.get("sub_params"), tuple):
      out["sub_params"] = list(out["sub_params"])
    return out

  @classmethod
  def from_json(cls, data: Mapping[str, Any]) -> Pattern:
    return cls(**{k: v for k, v in data.items() if k in _FIELDS})

  def resolved(self, logical_shape: Sequence[int]) -> Pattern:
    """This pattern with a `sub_params` count turned into sizes (for the schema)."""
    if self.kind != "sub_params" or not isinstance(self.sub_params, int):
      return self
    sizes = segments_of(self, logical_shape[self.cat_dim], "parameter")
    return dataclasses.replace(self, sub_params=tuple(sizes))


_FIELDS = {f.name for f in dataclasses.fields(Pattern)}


def column(**kw: Any) -> Pattern:
  return Pattern("column", **kw)


def row(**kw: Any) -> Pattern:
  return Pattern("row", **kw)


def replicated(**kw: Any) -> Pattern:
  return Pattern("replicated", **kw)


def average(**kw: Any) -> Pattern:
  return Pattern("average", **kw)


def sub_params(sizes: int | Sequence[int], cat_dim: int = 0, **kw: Any) -> Pattern:
  return Pattern("sub_params", cat_dim=cat_dim, sub_params=sizes, **kw)


def expert(num_experts: int | None = None, **kw: Any) -> Pattern:
  return Pattern("expert", num_experts=num_experts, **kw)


# ---------------------------------------------------------------------------------------------
# Geometry


def even_widths(size: int, degree: int, *, name: str = "parameter") -> list[int]:
  """`size` split evenly over `degree` ranks; raises when it does not divide."""
  if size % degree:
    raise MappingError(
      f"`{name}`: size {size} does not split evenly over {degree} ranks; pass the per-rank "
      "widths (DeepSpeed AutoTP gives the first size % degree ranks one more)"
    )
  return [size // degree] * degree


def padded_vocab(vocab_size: int, degree: int, multiple: int = 1) -> int:
  """Megatron's padded vocabulary: the next multiple of `multiple * degree`."""
  step = multiple * degree
  return -(-vocab_size // step) * step


def segments_of(pattern: Pattern, total: int, name: str) -> list[int]:
  """Logical sizes, along `cat_dim`, of the sub-parameters (one segment for plain cat kinds)."""
  if pattern.kind != "sub_params":
    return [total]
  if isinstance(pattern.sub_params, int):
    if pattern.sub_params <= 0 or total % pattern.sub_params:
      raise MappingError(
        f"`{name}`: dimension {pattern.cat_dim} of size {total} does not hold "
        f"{pattern.sub_params} equal sub-parameters"
      )
    return [total // pattern.sub_params] * pattern.sub_params
  sizes = list(pattern.sub_params)
  if sum(sizes) != total:
    raise MappingError(
      f"`{name}`: sub-parameter sizes {sizes} sum to {sum(sizes)}, but dimension "
      f"{pattern.cat_dim} has size {total}"
    )
  return sizes


def _widths(
  pattern: Pattern, segments: list[int], degree: int, widths: Sequence[Sequence[int]] | None, name
) -> list[list[int]]:
  """Per segment, the width each of `degree` ranks holds."""
  given = widths if widths is not None else pattern.shard_widths
  if given is not None and all(len(w) == degree for w in given):
    out = [list(w) for w in given]
    if len(out) != len(segments) or any(sum(w) != s for w, s in zip(out, segments)):
      raise MappingError(
        f"`{name}`: shard widths {out} do not add up to the sub-parameter sizes {segments}"
      )
    return out
  if widths is not None:
    raise MappingError(f"`{name}`: {len(widths[0])} widths per sub-parameter, {degree} ranks")
  return [even_widths(s, degree, name=name) for s in segments]


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each rank's fragment comes from in the (padded) logical array.

  Attributes:
    shape: the logical shape (vocabulary padding stripped).
    padded_shape: the shape the fragments tile (`shape` unless there is vocabulary padding).
    fragment_shapes: one shape per rank.
    pieces: per rank, `(logical region, fragment region)` pairs; regions index `padded_shape`.
      Replicated and averaged parameters: each rank holds the whole array.
  """

  shape: tuple[int, ...]
  padded_shape: tuple[int, ...]
  fragment_shapes: tuple[tuple[int, ...], ...]
  pieces: tuple[tuple[Piece, ...], ...]


def layout(
  pattern: Pattern,
  shape: Sequence[int],
  degree: int,
  *,
  widths: Sequence[Sequence[int]] | None = None,
  padded_size: int | None = None,
  name: str = "parameter",
) -> Layout:
  """The fragments of a logical array of `shape` over `degree` ranks.

  Args:
    pattern: the parameter's pattern.
    shape: its logical shape (for `vocab_size`, the unpadded one).
    degree: the number of ranks (TP degree; EP degree for experts).
    widths: per sub-parameter, the width of each rank (default: `pattern.shard_widths` when
      they are for `degree` ranks, else an even split).
    padded_size: the padded vocabulary (default: the next multiple of `degree`).
    name: the parameter, for messages.
  """
  shape = tuple(int(d) for d in shape)
  padded = list(shape)
  if pattern.vocab_size is not None:
    if shape[0] != pattern.vocab_size:
      raise MappingError(f"`{name}`: {shape[0]} rows, vocabulary size {pattern.vocab_size}")
    padded[0] = padded_size if padded_size is not None else padded_vocab(shape[0], degree)
    if padded[0] < shape[0]:
      raise MappingError(f"`{name}`: padded vocabulary {padded[0]} < vocabulary {shape[0]}")
  padded_shape = tuple(padded)
  whole = tuple(slice(0, d) for d in padded_shape)
  if pattern.kind in ("replicated", "average"):
    return Layout(shape, padded_shape, (padded_shape,) * degree, (((whole, whole),),) * degree)
  dim = pattern.cat_dim
  if dim >= len(shape):
    raise MappingError(f"`{name}`: cat_dim {dim} of a {len(shape)}-d array {shape}")
  if pattern.kind == "expert" and pattern.num_experts not in (None, shape[0]):
    raise MappingError(f"`{name}`: {shape[0]} experts on dim 0, pattern says {pattern.num_experts}")
  segments = segments_of(pattern, padded_shape[dim], name)
  seg_widths = _widths(pattern, segments, degree, widths, name)
  fragment_shapes, all_pieces = [], []
  for r in range(degree):
    pieces, at = [], 0
    base = 0
    for size, w in zip(segments, seg_widths):
      start = base + sum(w[:r])
      src = list(whole)
      src[dim] = slice(start, start + w[r])
      dst = list(whole)
      dst[dim] = slice(at, at + w[r])
      if w[r]:
        pieces.append((tuple(src), tuple(dst)))
      at += w[r]
      base += size
    frag = list(padded_shape)
    frag[dim] = at
    fragment_shapes.append(tuple(frag))
    all_pieces.append(tuple(pieces))
  return Layout(shape, padded_shape, tuple(fragment_shapes), tuple(all_pieces))


# ---------------------------------------------------------------------------------------------
# Merge and split


def merge(
  fragments: Sequence[np.ndarray],
  pattern: Pattern,
  *,
  name: str = "parameter",
  per_expert: bool = False,
  atol: float = 0.0,
) -> np.ndarray:
  """The logical array of a parameter from its per-rank fragments, in rank order.

  Args:
    fragments: one array per rank (TP rank; EP rank or expert for `expert`).
    pattern: the parameter's pattern.
    name: the parameter, for messages.
    per_expert: `expert` fragments are one array per expert, without the expert axis.
    atol: for `replicated`, the largest difference tolerated between copies (default: none).

  Raises:
    MappingError: the fragments do not fit the pattern, or replicated copies diverge.
  """
  if not fragments:
    raise MappingError(f"`{name}`: no fragments to merge")
  frags = [np.asarray(f) for f in fragments]
  if per_expert:
    frags = [f[None] for f in frags]
  if pattern.kind == "replicated":
    out = check_equal(frags, name=name, atol=atol)
  elif pattern.kind == "average":
    _same_shapes(frags, name)
    out = frags[0]
    for f in frags[1:]:  # the order and dtype of DeepSpeed's `sum(slices) / len(slices)`
      out = out + f
    out = (out / len(frags)).astype(frags[0].dtype, copy=False) if len(frags) > 1 else out
  else:
    out = _merge_cat(frags, pattern, name)
  if pattern.vocab_size is not None:
    if out.shape[0] < pattern.vocab_size:
      raise MappingError(
        f"`{name}`: {out.shape[0]} rows merged, fewer than the vocabulary {pattern.vocab_size}"
      )
    out = out[: pattern.vocab_size]
  return out


def _same_shapes(frags: list[np.ndarray], name: str) -> None:
  shapes = {f.shape for f in frags}
  if len(shapes) > 1:
    listed = ", ".join(f"rank {r}: {f.shape}" for r, f in enumerate(frags))
    raise MappingError(f"`{name}`: fragments of different shapes ({listed})")


def _merge_cat(frags: list[np.ndarray], pattern: Pattern, name: str) -> np.ndarray:
  dim = pattern.cat_dim
  ndims = {f.ndim for f in frags}
  if len(ndims) > 1 or dim >= frags[0].ndim:
    raise MappingError(
      f"`{name}`: fragments of shapes {[f.shape for f in frags]} cannot be joined on dim {dim}"
    )
  rest = {f.shape[:dim] + f.shape[dim + 1 :] for f in frags}
  if len(rest) > 1:
    raise MappingError(
      f"`{name}`: fragments {[f.shape for f in frags]} differ outside the cat dim {dim}"
    )
  shape = list(frags[0].shape)
  shape[dim] = sum(f.shape[dim] for f in frags)
  widths = None
  if pattern.kind != "sub_params" or len(segments_of(pattern, shape[dim], name)) == 1:
    widths = [[f.shape[dim] for f in frags]]
  if pattern.vocab_size is not None:  # the layout of the padded array, then strip
    lay = layout(
      dataclasses.replace(pattern, vocab_size=None), shape, len(frags), widths=widths, name=name
    )
  else:
    lay = layout(pattern, shape, len(frags), widths=widths, name=name)
  wrong = [
    f"rank {r} holds {f.shape}, expected {lay.fragment_shapes[r]}"
    for r, f in enumerate(frags)
    if f.shape != lay.fragment_shapes[r]
  ]
  if wrong:
    raise MappingError(
      f"`{name}`: fragments do not fit the pattern {pattern.to_json()}:\n{bullet_list(wrong)}"
    )
  out = np.empty(lay.padded_shape, np.result_type(*frags))
  for f, pieces in zip(frags, lay.pieces):
    for src, dst in pieces:
      out[src] = f[dst]
  return out


def check_equal(copies: Sequence[np.ndarray], *, name: str, atol: float = 0.0) -> np.ndarray:
  """The first of `copies` after checking that all agree; else says by how much they differ."""
  frags = [np.asarray(c) for c in copies]
  _same_shapes(frags, name)
  first = frags[0]
  problems = []
  for r, f in enumerate(frags[1:], start=1):
    if np.array_equal(first, f) or np.array_equal(first, f, equal_nan=True):
      continue
    diff = np.abs(first.astype(np.float64) - f.astype(np.float64))
    worst = float(np.nanmax(diff)) if diff.size else 0.0
    if worst > atol or np.isnan(diff).any():
      at = np.unravel_index(int(np.nanargmax(diff)), diff.shape) if diff.size else ()
      count = int(np.count_nonzero(diff > atol))
      problems.append(
        f"copy {r} differs from copy 0 in {count} elements, max |difference| {worst:.6g} "
        f"at index {tuple(int(i) for i in at)}"
      )
  if problems:
    raise MappingError(
      f"`{name}`: replicated copies diverge (tolerance {atol}):\n{bullet_list(problems)}\n"
      "Classify it as `average` if the copies are meant to differ."
    )
  return first


def split(
  logical: np.ndarray,
  degree: int,
  pattern: Pattern,
  *,
  name: str = "parameter",
  widths: Sequence[Sequence[int]] | None = None,
  padded_size: int | None = None,
  per_expert: bool = False,
) -> list[np.ndarray]:
  """The per-rank fragments of a logical array: the inverse of `merge`.

  Fragments of a single contiguous piece are views of `logical`; replicated and averaged
  parameters give every rank the same (padded) array.

  Args:
    logical: the logical array.
    degree: the number of ranks.
    pattern: the parameter's pattern.
    name: the parameter, for messages.
    widths: per sub-parameter, each rank's width (default: even, or `pattern.shard_widths`).
    padded_size: the padded vocabulary (default: the next multiple of `degree`).
    per_expert: for `expert` with `degree == num_experts`, drop the expert axis.
  """
  logical = np.asarray(logical)
  lay = layout(pattern, logical.shape, degree, widths=widths, padded_size=padded_size, name=name)
  full = logical
  if lay.padded_shape != lay.shape:
    full = np.zeros(lay.padded_shape, logical.dtype)
    full[: lay.shape[0]] = logical
  out = []
  for frag_shape, pieces in zip(lay.fragment_shapes, lay.pieces):
    if len(pieces) == 1 and pieces[0][1] == tuple(slice(0, d) for d in frag_shape):
      frag = full[pieces[0][0]]
    else:
      frag = np.empty(frag_shape, logical.dtype)
      for src, dst in pieces:
        frag[dst] = full[src]
    out.append(frag[0] if per_expert else frag)
  return out


def merge_stage_copies(
  copies: Mapping[int, np.ndarray], *, name: str, atol: float = 0.0
) -> np.ndarray:
  """A tied parameter held by several pipeline stages (`{stage: array}`): checked equal."""
  stages = sorted(copies)
  try:
    return check_equal([copies[s] for s in stages], name=name, atol=atol)
  except MappingError as e:
    raise MappingError(f"{e}\n(pipeline stages {stages}, in that order)") from None
