"""Tensor-parallel shards of one parameter -> the logical parameter, merged by its pattern.

Each TP rank's shard (value and every optimizer slot) is read lazily; the shards of every
pipeline stage that holds the parameter merge by the pattern (`parallel._patterns`: column, row,
replicated, average, sub-params, vocabulary padding), and the stages' copies must be equal (a tied
embedding). `shard_block` gives the chunk block that keeps the source's TP pieces apart.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from ucp_jax.base._errors import MappingError
from ucp_jax.parallel import _pattern_flat, _patterns
from ucp_jax.parallel._patterns import Pattern
from ucp_jax.sources._source_plan import SourceParam, Tensor, read_pieces, release
from ucp_jax.store import _untrusted


def merged_shape(pattern: Pattern, shapes: Sequence[tuple[int, ...]], name: str) -> tuple[int, ...]:
  """The logical shape that TP shards of `shapes` merge into (without reading them)."""
  if pattern.kind in ("replicated", "average"):
    shape = list(shapes[0])
  else:
    dim = pattern.cat_dim
    if any(len(s) <= dim for s in shapes):
      raise MappingError(f"`{name}`: shards {list(shapes)} have no dim {dim} ({pattern.kind})")
    shape = list(shapes[0])
    shape[dim] = sum(s[dim] for s in shapes)
  if pattern.vocab_size is not None:
    if not 0 < pattern.vocab_size <= shape[0]:
      raise MappingError(f"`{name}`: vocabulary size {pattern.vocab_size} of {shape[0]} rows")
    shape[0] = pattern.vocab_size
  return tuple(shape)


def merged_param(
  name: str, stages: dict[int, dict[int, SourceParam]], tp: int, pattern: Pattern, problems
):
  """One parameter from its shards on every TP rank of every stage that holds it."""
  missing = [
    f"stage {s} tp {t}" for s, by_tp in stages.items() for t in range(tp) if t not in by_tp
  ]
  if missing:
    problems.append(f"`{name}`: no shard on {', '.join(missing)}")
    return None
  first = stages[min(stages)][0]
  keys = ["value", *first.slots]
  shards = {s: [by_tp[t] for t in range(tp)] for s, by_tp in stages.items()}
  try:
    shape = merged_shape(pattern, [p.value.shape for p in shards[min(stages)]], name)
    for s, ps in shards.items():
      if merged_shape(pattern, [p.value.shape for p in ps], name) != shape:
        raise MappingError(
          f"`{name}`: stage {s}'s shards make a different shape than stage {min(stages)}'s"
        )
    resolved = pattern.resolved(shape)
  except MappingError as e:
    problems.append(str(e))
    return None
  tensors = {}
  for key in keys:
    per_stage = {
      s: [p.value if key == "value" else p.slots.get(key) for p in ps] for s, ps in shards.items()
    }
    if any(t is None for ts in per_stage.values() for t in ts):
      problems.append(f"`{name}`: slot {key} is missing on some rank")
      return None
    where = f"{name} ({key}; tp {tp}, stages {sorted(stages)})"
    tensors[key] = Tensor(
      shape,
      per_stage[min(stages)][0].dtype,
      _merge_pieces(name, per_stage, pattern, shape, where),
      where,
    )
  value = tensors.pop("value")
  shard = shard_block(resolved, shape, [p.value.shape for p in shards[min(stages)]], name)
  return SourceParam(
    name, value, tensors, group=first.group, pattern=resolved.to_json(), shard_shape=shard
  )


def shard_block(
  pattern: Pattern, shape: tuple[int, ...], shards: Sequence[tuple[int, ...]], name: str
) -> tuple[int, ...] | None:
  """A block that tiles the logical array along the source's TP piece boundaries (for chunks).

  Chunks of this extent along `cat_dim` never straddle two TP pieces, so restoring onto a
  mesh split like the source (or finer, by a divisor) reads only the chunks of each slice.
  """
  if pattern.kind not in ("column", "row", "sub_params") or len(shards) < 2:
    return None
  dim = pattern.cat_dim
  unpadded = dataclasses.replace(pattern, vocab_size=None)
  padded = list(shape)
  padded[dim] = sum(s[dim] for s in shards)
  widths = [[s[dim] for s in shards]] if pattern.kind != "sub_params" else None
  lay = _patterns.layout(unpadded, padded, len(shards), widths=widths, name=name)
  starts = {src[dim].start for pieces in lay.pieces for src, _ in pieces} - {0}
  starts = {b for b in starts if b < shape[dim]}
  if not starts:
    return None
  block = list(shape)
  block[dim] = math.gcd(*starts)
  return tuple(block)


def _merge_pieces(
  name: str, per_stage: dict[int, list[Tensor]], pattern: Pattern, shape: tuple, where: str
):
  def pieces() -> list[np.ndarray]:
    itemsize = np.dtype(per_stage[min(per_stage)][0].dtype).itemsize
    _untrusted.check_allocation(math.prod(shape) * itemsize, where)  # sizes from the files
    merged = {}
    for s, tensors in per_stage.items():
      shards = [read_pieces(t.pieces()) for t in tensors]
      out = _pattern_flat.merge_flat(shards, [t.shape for t in tensors], pattern, name=name)
      if len(per_stage) == 1 and isinstance(out, list):  # replicated: rank 0's pieces
        release([p for ps in shards[1:] for p in ps])
        return out
      if isinstance(out, list):
        out = _pattern_flat.whole(out, tensors[0].shape)
      merged[s] = np.ascontiguousarray(out)
      release([p for ps in shards for p in ps])
    out = (
      merged[min(merged)] if len(merged) == 1 else _patterns.merge_stage_copies(merged, name=name)
    )
    return [out.reshape(-1)]

  return pieces
