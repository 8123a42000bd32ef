"""A checkpoint seen through a mapping: target keys, target layouts, nothing read up front.

`MappedCheckpoint` is a `Checkpoint` (store/_checkpoint.py: `keys()`, `[key] -> ArrayInfo`,
`open_future`, `read`, `comes_from`, ...), so it restores, reads and maps further like the
checkpoint it wraps. Each target
array is a TensorStore view over the stored source arrays, built only from index
transforms and virtual stacks: indexing it with a device's slice and reading
touches only the stored chunks under that slice.

Where the source array is read directly (`reads_directly`: a checkpoint's chunk files, a
safetensors tensor) and the rule is a rename, transpose, head split, sub-parameter or
cast of one array, a restore reads that way too: each device's region is mapped back to
the source's region, read by `pread`, and transposed or reshaped on the host.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorstore as ts

from ucp_jax.mapping import _matching
from ucp_jax.mapping._transforms import Cast, Split, SubParam, Transpose
from ucp_jax.store import _hostmem, _keypath, _threads
from ucp_jax.store._checkpoint import Checkpoint
from ucp_jax.store._manifest import ArrayInfo


class MappedCheckpoint(Checkpoint):
  """A read-only view of `base` with the keys and layouts a mapping stage makes.

  Keys outside `subtree` (when given) are left out; keys inside it are matched
  relative to it, and the target keys are placed below it again.
  """

  def __init__(self, base: Checkpoint, entries: dict[str, _matching.Entry], subtree: str = ""):
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

  def comes_from(self, key: str) -> str:
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

  def reads_directly(self, key: str) -> bool:
    """Whether `start_read` reads `key`: its sources are read directly and its rule maps
    regions (a stack only as its last step)."""
    rule = self._entries[key].rule
    if rule.after_stack or not all(isinstance(t, _DIRECT) for t in rule.before_stack):
      return False
    return all(self.base.reads_directly(s) for s in self.source_keys(key))

  def start_read(self, key: str, regions: list) -> tuple[list[np.ndarray], Any]:
    """Starts reading `regions` of the target `key` (`reads_directly` keys).

    Each region (of a stack: each of its layers) is cut into pieces of at most
    `PIECE_BYTES` of source, each mapped back to its source region (`_source_region`);
    pieces that share their source rows read those rows once (`_row_blocks`), a block or
    two in flight at a time, each block laid out into its pieces' places in the regions'
    aligned buffers (transposed, reshaped) and freed: host memory stays the array plus a
    few pieces. A rename is the source's own read of the regions (straight into the
    buffers the devices adopt).
    """
    rule = self._entries[key].rule
    sources = self.source_keys(key)
    if rule.stack is None and not rule.transforms:  # a rename: read as the source reads
      return self.base.start_read(sources[0], regions)
    info = self.base[sources[0]]
    itemsize = np.dtype(info.dtype).itemsize
    shapes = [tuple(info.shape)]
    for t in rule.before_stack:
      shapes.append(t.shape(shapes[-1], np.dtype(info.dtype))[0])
    dtype = np.dtype(self[key].dtype)
    outs = [_hostmem.fresh_empty(tuple(s.stop - s.start for s in r), dtype) for r in regions]
    pieces: dict[str, list] = {}  # source -> [(where in a buffer, source region, steps)]
    for region, out in zip(regions, outs):
      for source, part, dst in _layers(rule, sources, region, out):
        for place, read, steps in _pieces(part, rule.before_stack, shapes, itemsize):
          pieces.setdefault(source, []).append((dst[place], read, steps))
    plan = []  # (source, its reads in one call, per read: [(index there, steps, buffer)])
    for source, parts in pieces.items():
      reads, uses = _row_blocks([p[1] for p in parts], shapes[0])
      users: list[list] = [[] for _ in reads]
      for (dst, _, steps), (block, index) in zip(parts, uses):
        users[block].append((index, steps, dst))
      for batch in _batches(reads, itemsize):  # one call each: chunks read once
        plan.append((source, [reads[b] for b in batch], [users[b] for b in batch]))

    def start(k: int):
      return self.base.start_read(plan[k][0], plan[k][1])

    pending = deque(start(k) for k in range(min(2, len(plan))))

    def finish() -> None:
      for k, (_, _, block_users) in enumerate(plan):
        hosts, wait = pending.popleft()
        if k + 2 < len(plan):  # the next batch is read while this one is laid out
          pending.append(start(k + 2))
        wait()
        copies = [
          _lay_out(host[index], steps, dst)
          for host, users in zip(hosts, block_users)
          for index, steps, dst in users
        ]
        for copy in copies:
          copy.result()
        hosts.clear()

    return outs, finish

  def replaced(self) -> bool:
    """Whether the checkpoint under the view was replaced since it was opened."""
    return self.base.replaced()

  def verify(self, on_array=None) -> dict[str, str]:
    """Verifies the checkpoint under the view (its arrays, by its keys)."""
    return self.base.verify(on_array)

  def __repr__(self) -> str:
    return f"MappedCheckpoint({self.base!r}, arrays={len(self._entries)})"


PIECE_BYTES = 32 << 20
"""The most source bytes one piece of a region reads (a block of rows at most twice that)."""


def _layers(rule, sources: tuple[str, ...], region: tuple, out: np.ndarray):
  """(source key, region of its layer's array, the buffer it fills) for each layer under
  `region`: the region and its buffer themselves where the rule does not stack."""
  if rule.stack is None:
    yield sources[0], region, out
    return
  axis = rule.stack.axis
  layers = region[axis]
  for layer in range(layers.start, layers.stop):
    at = (slice(None),) * axis + (layer - layers.start,)
    yield sources[layer], (*region[:axis], *region[axis + 1 :]), out[at]


def _pieces(region: tuple, transforms, shapes, itemsize: int) -> list[tuple]:
  """`region` cut along the axis that its source's rows follow, into pieces of at most
  `PIECE_BYTES` of source: (index in the region's buffer, source region, steps)."""
  source, steps = _source_region(transforms, shapes, region)
  extent = [s.stop - s.start for s in source]
  count = -(-int(np.prod(extent, dtype=np.int64)) * itemsize // PIECE_BYTES)
  whole = tuple(slice(None) for _ in region)
  axis = _rows_axis(region, transforms, shapes, extent) if count > 1 else None
  if axis is None:
    return [(whole, source, steps)]
  span = region[axis]
  cuts = np.linspace(span.start, span.stop, min(count, span.stop - span.start) + 1).astype(int)
  out = []
  for a, b in itertools.pairwise(cuts):
    if b > a:
      part = (*region[:axis], slice(int(a), int(b)), *region[axis + 1 :])
      place = (*whole[:axis], slice(int(a - span.start), int(b - span.start)))
      out.append((place, *_source_region(transforms, shapes, part)))
  return out


def _batches(reads: list, itemsize: int) -> list[list[int]]:
  """The reads in consecutive batches of about `2 * PIECE_BYTES` (at least one read each)."""
  batches: list[list[int]] = [[]]
  size = 0
  for b, region in enumerate(reads):
    nbytes = int(np.prod([s.stop - s.start for s in region], dtype=np.int64)) * itemsize
    if batches[-1] and size + nbytes > 2 * PIECE_BYTES:
      batches.append([])
      size = 0
    batches[-1].append(b)
    size += nbytes
  return batches


def _rows_axis(region: tuple, transforms, shapes, extent: list[int]) -> int | None:
  """The first axis of the target region whose narrowing narrows the source's rows."""
  for axis, s in enumerate(region):
    if s.stop - s.start > 1:
      one = (*region[:axis], slice(s.start, s.start + 1), *region[axis + 1 :])
      rows = _source_region(transforms, shapes, one)[0][0]
      if rows.stop - rows.start < extent[0]:
        return axis
  return None


def _row_blocks(regions: list, shape: tuple[int, ...]) -> tuple[list, list]:
  """The source reads for `regions` and, per region, (its read's number, its index there).

  Regions of a 2-D source that share their rows and whose columns together cover every
  column (a model axis over the columns) read those rows once, whole: one contiguous run,
  no block read twice or staged; other regions read as they are.
  """
  by_rows: dict[tuple[int, int], list[int]] = {}
  for i, region in enumerate(regions):
    if len(shape) == 2:
      by_rows.setdefault((region[0].start, region[0].stop), []).append(i)
  reads: list = []
  uses: list = [None] * len(regions)
  for (r0, r1), members in by_rows.items():
    columns = sorted((regions[i][1].start, regions[i][1].stop) for i in members)
    covered = 0
    for c0, c1 in columns:
      covered = max(covered, c1) if c0 <= covered else covered
    if covered < shape[1] or (len(members) == 1 and columns[0] == (0, shape[1])):
      continue  # some columns no region asks for, or one whole-row region: read as it is
    reads.append((slice(r0, r1), slice(0, shape[1])))
    for i in members:
      uses[i] = (len(reads) - 1, (slice(None), regions[i][1]))
  for i, region in enumerate(regions):
    if uses[i] is None:
      reads.append(region)
      uses[i] = (len(reads) - 1, tuple(slice(None) for _ in region))
  return reads, uses


_DIRECT = (Transpose, Split, SubParam, Cast)
"""The transforms whose target regions map back to source regions (plus a host-side step)."""


def _source_region(transforms, shapes, region) -> tuple[tuple[slice, ...], list]:
  """The source region a target `region` reads, and the steps (each with `view` on
  TensorStore views and `forward` on numpy views, from the source block's layout to the
  target block's) that lay it out as the target's.

  `shapes[i]` is the shape before transform i. A split's region reads its outer axis's rows
  whole in the inner axes (a head split: exactly the heads asked for), then slices.
  """
  steps = []
  for i in reversed(range(len(transforms))):
    t, before = transforms[i], shapes[i]
    if isinstance(t, Transpose):
      axes = t._axes(len(before))
      back = [None] * len(axes)
      for j, a in enumerate(axes):
        back[a] = region[j]
      region = tuple(back)
      steps.append(Transpose(axes))
    elif isinstance(t, Split):
      axis, sizes = t._check(before)
      n = len(sizes)
      inner = int(np.prod(sizes[1:], dtype=np.int64))
      outer = region[axis]
      cut = tuple(slice(r.start, r.stop) for r in region[axis + 1 : axis + n])
      region = (
        *region[:axis],
        slice(outer.start * inner, outer.stop * inner),
        *region[axis + n :],
      )
      block = Split(axis, (outer.stop - outer.start, *sizes[1:]))
      steps.append(_Heads(block, (slice(None),) * (axis + 1) + cut))
    elif isinstance(t, SubParam):
      axis, start, _ = t.bounds(before)
      span = region[axis]
      region = (*region[:axis], slice(span.start + start, span.stop + start), *region[axis + 1 :])
    else:  # Cast
      steps.append(t)
  return region, steps[::-1]


@dataclasses.dataclass(frozen=True)
class _Heads:
  """A split block's heads asked for: `block` splits the axis, `index` keeps those heads."""

  block: Split
  index: tuple

  def view(self, store: ts.TensorStore) -> ts.TensorStore:
    return self.block.view(store)[self.index].translate_to[0]

  def forward(self, x: np.ndarray) -> np.ndarray:
    return self.block.forward(x)[self.index]


def _lay_out(block: np.ndarray, steps: list, out: np.ndarray):
  """Starts laying `block` (a view of a read buffer) out into `out` through `steps`.

  Without a cast the steps are strides on a numpy view, copied by `_devices.dense_copy`
  (a tiled transposition through JAX's CPU device) on the I/O pool; a cast goes through
  TensorStore's copy, and so does everything where JAX is not loaded: a restore or
  `load_into` has it, a diff or export of files does not import it for a copy. Returns a
  future.
  """
  devices = None
  if "jax" in sys.modules:
    from ucp_jax.tree import _devices as devices
  plain = all(isinstance(s, (Transpose, _Heads)) for s in steps)
  if devices is not None and plain and devices.dense_copies(block.dtype):
    view = block
    for step in steps:
      view = step.forward(view)
    return _threads.submit(devices.dense_copy, view, out)
  view = ts.array(block, copy=False).translate_to[0]
  for step in steps:
    view = step.view(view)
  return ts.array(out, copy=False, write=True).write(view)


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
