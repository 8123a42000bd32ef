"""The distributed optimizer's `dp_reshardable` state, rebuilt per parameter.

In this format (Megatron-LM's default since megatron-core 0.16) the optimizer state of each
model-parallel domain (a TP x PP rank, `dp_group_idx_<i>`) is saved as megatron-core holds it
in memory: one flat tensor per gradient bucket and per state (`param`, the fp32 master;
`exp_avg`; `exp_avg_sq`), the concatenation of the domain's parameters, each flattened in its
TP-local shape. The checkpoint records the bucket sizes (`per_bucket_numel` and
`per_bucket_numel_unpadded`) but not where each parameter lies. That is fixed by
megatron-core's `DistributedOptimizer._compute_per_buffer_param_layout`:

* parameters in reverse order of `model.parameters()` (the order the model's sharded state
  dict lists them, the `.metadata`'s, with stacked layers layer by layer);
* each start aligned to 64 elements (`param_layout.pad_param_start`);
* a bucket closed where its unpadded size is reached; the next starts after its padded size.

The walk is checked against both recorded sizes of every bucket: a checkpoint whose layout
differs (another order, expert parameters in their own buffers, pipeline stages) is refused
with what is missing, never read wrong.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources.dcp import _chunks
from ucp_jax.sources.dcp._metadata import BytesEntry, Layout, TensorEntry
from ucp_jax.sources.megatron._readable import Readable

PREFIX = "optimizer.distributed.dp_group_idx_"
BUCKET = re.compile(
  r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)"
  r"\.([A-Za-z0-9_]+)$"
)
ALIGN = 64  # megatron-core's pad_param_start
MASTER = "param"
REFUSAL = (
  "; resave with Megatron-LM's --dist-ckpt-optim-fully-reshardable, which stores each "
  "parameter's optimizer state under its own key"
)


@dataclasses.dataclass
class Rebuilt:
  masters: dict[str, Readable]
  slots: dict[str, dict[str, Readable]]
  param_groups: list[dict]


@dataclasses.dataclass(frozen=True)
class _Place:
  """Where one layer of one parameter lies in one domain's buffer."""

  bucket: int
  start: int  # in the bucket's checkpoint tensor
  local_shape: tuple[int, ...]
  pieces: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]  # (global, local) regions
  replicated: bool  # every domain holds a copy: domain 0's is read, as megatron-core's gather


def rebuild(layout: Layout, files, model: dict, tensors: dict, args: dict, meta: str) -> Rebuilt:
  """Per-parameter masters and slots of a `dp_reshardable` checkpoint.

  Raises:
    SourceFormatError: the buckets cannot be matched to the parameters (the message says what
      the checkpoint lacks and how to save one that has it).
  """
  tp = args.get("tensor_model_parallel_size", 1)
  pp = args.get("pipeline_model_parallel_size", 1)
  if not isinstance(tp, int) or tp < 1:
    raise SourceFormatError(
      f"{meta}: dp_reshardable optimizer state without args.tensor_model_"
      f"parallel_size, which says how its domains split the model{REFUSAL}"
    )
  if pp != 1 or args.get("num_experts"):
    what = "pipeline stages" if pp != 1 else "expert parameters (their own buffers)"
    raise SourceFormatError(
      f"{meta}: dp_reshardable optimizer state with {what}: which stage or expert buffer "
      f"holds each parameter is not recorded{REFUSAL}"
    )
  buckets = _bucket_tensors(layout, files, meta)
  domains = sorted({d for d, _, _ in buckets})
  if domains != list(range(tp)):
    raise SourceFormatError(
      f"{meta}: dp_reshardable buckets for domains {domains}, but TP {tp} makes "
      f"{list(range(tp))}{REFUSAL}"
    )
  order = _parameter_order(list(model), tensors, meta)
  sizes = {d: _bucket_sizes(layout, files, d, meta) for d in domains}
  places = {d: _walk(order, layout, model, d, tp, sizes[d], meta) for d in domains}
  held: dict[str, list] = {name: [] for name in model}  # a replicated one: domain 0's copy
  for domain, by_param in places.items():
    for (name, _), place in by_param.items():
      if domain == 0 or not place.replicated:
        held[name].append((domain, place))
  states = sorted({s for _, _, s in buckets})
  per_state: dict[str, dict[str, Readable]] = {}
  for state in states:
    for name, key in model.items():
      dtype = buckets[(0, 0, state)].dtype
      where = f"{meta}: `{PREFIX}*.{state}` of `{key}`"
      per_state.setdefault(state, {})[name] = _lazy(
        tensors[name].shape, dtype, held[name], buckets, state, where
      )
  masters = per_state.pop(MASTER, {})
  slots: dict[str, dict[str, Readable]] = {}
  for state, by_name in per_state.items():
    for name, value in by_name.items():
      slots.setdefault(name, {})[state] = value
  return Rebuilt(masters, slots, _param_groups(layout, files, meta))


def _bucket_tensors(layout: Layout, files, meta: str) -> dict[tuple[int, int, str], Any]:
  """(domain, bucket, state) -> a reader of the bucket's flat checkpoint tensor (one buffer,
  one dtype)."""
  out = {}
  buffers = set()
  for key, entry in layout.entries.items():
    found = BUCKET.match(key)
    if found is None or not isinstance(entry, TensorEntry):
      continue
    domain, gbuf, dtypes, bucket, state = found.groups()
    buffers.add((gbuf, dtypes))
    out[(int(domain), int(bucket), state)] = _chunks.Reader(files, entry, f"{meta}: `{key}`")
  if len(buffers) != 1:
    raise SourceFormatError(
      f"{meta}: dp_reshardable state in {len(buffers)} buffers ({sorted(buffers)}); ucp_jax "
      f"rebuilds one buffer of one dtype (no expert or mixed-precision buffers){REFUSAL}"
    )
  return out


def _bucket_sizes(layout: Layout, files, domain: int, meta: str) -> list[tuple[int, int]]:
  """Each bucket's (padded, unpadded) size, as the domain recorded them."""
  sizes = []
  for field in ("per_bucket_numel", "per_bucket_numel_unpadded"):
    key = f"{PREFIX}{domain}.{field}/shard_0_1"
    entry = layout.entries.get(key)
    if not isinstance(entry, BytesEntry):
      raise SourceFormatError(f"{meta}: no `{key}`: the bucket sizes are not recorded{REFUSAL}")
    value = files.load(entry.stored, f"`{key}`")
    try:
      (buffers,) = value  # megatron's ShardedObject list wrapper
      (by_dtype,) = buffers
      (numels,) = by_dtype.values()
      sizes.append([int(n) for n in numels])
    except (TypeError, ValueError, AttributeError):
      raise SourceFormatError(
        f"{meta}: `{key}` is {value!r:.80}, not one buffer's bucket sizes{REFUSAL}"
      ) from None
  padded, unpadded = sizes
  if len(padded) != len(unpadded) or any(u > p for p, u in zip(padded, unpadded)):
    raise SourceFormatError(
      f"{meta}: domain {domain}'s bucket sizes {padded} and {unpadded} disagree"
    )
  return list(zip(padded, unpadded))


def _parameter_order(names: list[str], tensors: dict, meta: str) -> list[tuple[str, int | None]]:
  order: list[tuple[str, int | None]]
  """`model.parameters()` order: (name, layer) in the `.metadata`'s order, layers expanded."""
  stacked = [n for n in names if n.startswith("decoder.layers.")]
  if stacked:
    first = names.index(stacked[0])
    if names[first : first + len(stacked)] != stacked:
      raise SourceFormatError(f"{meta}: the layer tensors are not listed together{REFUSAL}")
    counts = {tensors[n].shape[0] for n in stacked}
    if len(counts) != 1:
      raise SourceFormatError(f"{meta}: layer tensors of {sorted(counts)} layers{REFUSAL}")
    (layers,) = counts
    order = [(n, None) for n in names[:first]]
    order += [(n, layer) for layer in range(layers) for n in stacked]
    return order + [(n, None) for n in names[first + len(stacked) :]]
  order = [(n, None) for n in names]
  return order


def _walk(order, layout, model, domain, tp, sizes, meta) -> dict[tuple[str, int | None], _Place]:
  """Where each (parameter, layer) lies in `domain`'s buckets, as megatron-core placed it."""
  places = {}
  bucket, bucket_start, pos = 0, 0, 0
  for name, layer in reversed(order):
    entry = layout.entries[model[name]]
    assert isinstance(entry, TensorEntry)  # _source.model_entries holds tensors only
    local_shape, pieces, replicated = _local(entry, layer, domain, tp, meta)
    numel = math.prod(local_shape)
    start = -(-pos // ALIGN) * ALIGN
    if bucket >= len(sizes):
      raise SourceFormatError(
        f"{meta}: domain {domain}'s {len(sizes)} buckets end before `{model[name]}`: its "
        f"parameters are not laid out as its metadata lists them{REFUSAL}"
      )
    end = start + numel
    padded, unpadded = sizes[bucket]
    if end - bucket_start > unpadded:
      raise SourceFormatError(
        f"{meta}: domain {domain}'s bucket {bucket} holds {unpadded} elements, but its "
        f"parameters in Megatron's order need {end - bucket_start} by `{model[name]}`: they are "
        f"not laid out as its metadata lists them (another layer spec or bucket order){REFUSAL}"
      )
    places[(name, layer)] = _Place(bucket, start - bucket_start, local_shape, pieces, replicated)
    if end - bucket_start == unpadded:
      bucket_start += padded
      bucket, pos = bucket + 1, bucket_start
    else:
      pos = end
  if bucket != len(sizes):
    raise SourceFormatError(
      f"{meta}: domain {domain}'s parameters fill {bucket} of its {len(sizes)} buckets: "
      f"the checkpoint holds state for parameters the model lacks{REFUSAL}"
    )
  return places


def _local(entry: TensorEntry, layer: int | None, domain: int, tp: int, meta: str):
  """The TP-local shape of one layer of `entry` in `domain`, and its (global, local) regions.

  TP ranks hold the chunks along the one split axis in turn: rank t holds chunks t, t + tp,
  ... (SwiGLU's `[gate_t; up_t]`); a tensor with no split axis is replicated.
  """
  lead = 0 if layer is None else 1
  chunks = [c for c in entry.chunks if layer is None or c.offsets[0] == layer]
  shape = entry.shape[lead:]
  split = [d for d in range(lead, len(entry.shape)) if len({c.offsets[d] for c in chunks}) > 1]
  head = (slice(layer, layer + 1),) if layer is not None else ()
  if not split:
    whole = tuple(slice(0, n) for n in shape)
    return shape, ((head + whole, whole),), True
  (axis,) = split if len(split) == 1 else (None,)
  starts = sorted({c.offsets[axis] for c in chunks}) if axis is not None else []
  if axis is None or len(starts) % tp:
    raise SourceFormatError(
      f"{meta}: `{entry.key}` is split {len(starts) or 'on several axes'} ways, not in "
      f"multiples of TP {tp}{REFUSAL}"
    )
  width = {c.offsets[axis]: c.sizes[axis] for c in chunks}
  mine = starts[domain::tp]
  local_axis = axis - lead
  pieces, at = [], 0
  for start in mine:
    region = [slice(0, n) for n in shape]
    local = list(region)
    region[local_axis] = slice(start, start + width[start])
    local[local_axis] = slice(at, at + width[start])
    pieces.append((head + tuple(region), tuple(local)))
    at += width[start]
  local_shape = tuple(at if d == local_axis else n for d, n in enumerate(shape))
  return local_shape, tuple(pieces), False


def _lazy(shape, dtype, entries: list, buckets, state, where) -> Readable:
  """A parameter's `state`, read by region from the `(domain, place)`s that hold it: each
  place's run of its bucket read once, when some piece of it lies in the region."""

  def read(region: tuple[slice, ...], out: np.ndarray) -> None:
    covered = 0
    for domain, place in entries:
      local = None
      for global_box, local_box in place.pieces:
        overlap = [
          slice(max(g.start, r.start), min(g.stop, r.stop)) for g, r in zip(global_box, region)
        ]
        if any(o.start >= o.stop for o in overlap):
          continue
        if local is None:
          span = slice(place.start, place.start + math.prod(place.local_shape))
          local = buckets[(domain, place.bucket, state)].read((span,)).reshape(place.local_shape)
        lead = len(global_box) - len(local_box)
        source = tuple(
          slice(o.start - g.start + lb.start, o.stop - g.start + lb.start)
          for o, g, lb in zip(overlap[lead:], global_box[lead:], local_box)
        )
        target = tuple(slice(o.start - r.start, o.stop - r.start) for o, r in zip(overlap, region))
        out[target] = local[source].reshape(out[target].shape)
        covered += math.prod(o.stop - o.start for o in overlap)
    if covered != out.size:
      raise SourceFormatError(f"{where}: the buckets cover {covered} of {out.size} elements")

  return Readable(tuple(shape), np.dtype(dtype), read, where)


def _param_groups(layout: Layout, files, meta: str) -> list[dict]:
  """The torch optimizer's param groups, as domain 0 saved them (every domain has the same)."""
  key = f"{PREFIX}0.optimizer/shard_0_1"
  entry = layout.entries.get(key)
  if not isinstance(entry, BytesEntry):
    return []
  value = files.load(entry.stored, f"`{key}`")
  value = value[0] if isinstance(value, list) and len(value) == 1 else value
  groups = value.get("param_groups") if isinstance(value, dict) else None
  return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []
