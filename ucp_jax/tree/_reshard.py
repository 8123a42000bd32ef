"""`reshard`: live state moved to another mesh or sharding, in memory."""

from __future__ import annotations

from typing import Any, Literal

import jax
import numpy as np

from ucp_jax.base import _errors
from ucp_jax.store import _caches, _hostmem, _regions, _threads
from ucp_jax.tree import _devices, _tree

Method = Literal["auto", "host", "device_put"]
METHODS = ("auto", "host", "device_put")

HOST_COPY_MIN_BYTES = 16 << 20
"""`method="auto"` copies on the host when the arrays average at least this many bytes. A
host copy compiles nothing (device_put compiles a layout change on its first call), and on
repeated calls it moves large arrays faster than device_put, whose lower cost per array
wins with smaller ones. Measured on 8 CPU devices of a 2-core VM, 256 MiB moved from
`P("x", None)` to a (2, 4) mesh, repeated calls: 1 MiB arrays 0.28 s host, 0.12 s device_put;
4 MiB 0.09 s, 0.06 s; 16 MiB 0.071 s, 0.069 s; 64 MiB 0.048 s, 0.076 s (docs/benchmarks.md)."""


def reshard(tree: Any, shardings: Any, *, method: Method = "auto") -> Any:
  """Moves every array of `tree` onto the matching sharding of `shardings`.

  `method="auto"` picks one path per call by a fixed rule (`reshard_method` tells which,
  and why): the same arrays, shardings and platform always get the same path.
  - A move that involves other processes' devices, or devices other than CPUs (GPU, TPU),
    goes through `jax.device_put`: XLA's collectives do it.
  - On CPU devices of this process, arrays that average at least `HOST_COPY_MIN_BYTES`
    (16 MiB) are copied on the host, each target slice out of the source shards, into
    buffers the devices adopt without a copy (and that a later reshard reuses once these
    arrays are dropped). It compiles nothing, and moves large arrays faster than a
    compiled device_put. Smaller arrays go through device_put, whose cost per array is
    lower once it has compiled the change (on its first call).
  `"host"` and `"device_put"` pin a path.

  Example:
    >>> import jax, jax.numpy as jnp, ucp_jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    >>> x = ucp_jax.reshard({"w": jnp.ones((4, 4)), "step": 3}, NamedSharding(mesh, P("x")))
    >>> x["w"].sharding.spec == P("x"), x["step"]
    (True, 3)

  Args:
    tree: a pytree of `jax.Array`s; Python numbers in it (a step count) come back as
      they are.
    shardings: a matching pytree of `jax.sharding.Sharding`s (a Python number's entry,
      if any, is ignored), or one sharding for all.
    method: "auto", "host" (host copy; CPU arrays on one process only) or "device_put".

  Returns:
    The same tree on the new shardings; the input is left as it was.

  Raises:
    InvalidArgumentError: an unknown `method`, or `"host"` for arrays it cannot move.
    UnsupportedLeafError: a leaf that is neither a `jax.Array` nor a Python number.
    TreeMismatchError: `tree` and `shardings` name different leaves.
    ShardingError: a sharding that cannot lay out its array.
  """
  _check_method(method)
  unflatten, numbers, arrays, targets = _prepare(tree, shardings)
  if method == "auto":
    method = _auto(arrays, targets)[0]
  if method == "host":
    problems = _host_copy_problems(arrays, targets)
    if problems:
      raise _errors.InvalidArgumentError(
        "method='host' copies in this process's memory, which cannot move these arrays "
        "(use method='auto' or 'device_put'):\n" + _errors.bullet_list(problems)
      )
  move = _host_reshard if method == "host" else _device_put
  return unflatten({**numbers, **move(arrays, targets)})


def reshard_method(tree: Any, shardings: Any) -> tuple[str, str]:
  """The path `reshard(tree, shardings, method="auto")` takes, and why.

  Example:
    >>> import jax, jax.numpy as jnp, ucp_jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    >>> ucp_jax.reshard_method({"w": jnp.ones((4, 4))}, NamedSharding(mesh, P("x")))[0]
    'device_put'

  Returns:
    ("host" or "device_put", the reason in words).

  Raises:
    The errors `reshard` raises for its `tree` and `shardings`.
  """
  _, _, arrays, targets = _prepare(tree, shardings)
  return _auto(arrays, targets)


def _check_method(method: Any) -> None:
  if method not in METHODS:
    raise _errors.InvalidArgumentError(
      f"method={method!r}: use 'auto' (a fixed rule, see `reshard_method`), 'host' (host "
      "copies; CPU arrays of this process) or 'device_put'"
    )


def _prepare(tree: Any, shardings: Any) -> tuple[Any, dict, dict, dict]:
  """(the function that rebuilds `tree`, its Python numbers, its arrays, their target
  shardings), by key, every leaf checked."""
  flat, unflatten = _tree.flatten(tree)
  numbers = {k: x for k, x in flat.items() if isinstance(x, _NUMBERS)}
  arrays = {k: x for k, x in flat.items() if k not in numbers}
  targets = _target_shardings(arrays, shardings, numbers)
  _check(arrays, targets)
  return unflatten, numbers, arrays, targets


def _auto(
  arrays: dict[str, jax.Array], targets: dict[str, Any]
) -> tuple[Literal["host", "device_put"], str]:
  """`method="auto"`'s rule: (path, reason), from the platforms, the processes and the sizes."""
  problems = _host_copy_problems(arrays, targets, first=True)
  if problems:
    return "device_put", f"XLA moves it: {problems[0]}"
  if not arrays:
    return "device_put", "nothing to move"
  mean = sum(x.nbytes for x in arrays.values()) / len(arrays)
  if mean >= HOST_COPY_MIN_BYTES:
    return "host", f"CPU arrays of this process, {mean / 2**20:.1f} MiB each on average"
  return "device_put", (
    f"CPU arrays of {mean / 2**20:.2f} MiB on average, below {HOST_COPY_MIN_BYTES >> 20} MiB: "
    "device_put's lower cost per array wins"
  )


def _host_reshard(arrays: dict[str, jax.Array], targets: dict[str, Any]) -> dict[str, jax.Array]:
  started = {k: _start_host_reshard(x, targets[k]) for k, x in arrays.items()}
  return {k: finish() for k, finish in started.items()}


_NUMBERS = (bool, int, float, complex)  # Python numbers: no device, nothing to move


def _device_put(arrays: dict[str, jax.Array], targets: dict[str, Any]) -> dict[str, jax.Array]:
  """jax.device_put of every array; typed PRNG keys travel as their key data.

  (device_put refuses key arrays that span several processes.)
  """
  values, impls = [], {}
  for key, x in arrays.items():
    # A NamedSharding lays out the key data too: its trailing key dimensions stay whole.
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) and isinstance(
      targets[key], jax.sharding.NamedSharding
    ):
      impls[key] = jax.random.key_impl(x)
      x = jax.random.key_data(x)
    values.append(x)
  moved = dict(zip(arrays, jax.device_put(values, [targets[k] for k in arrays])))
  for key, impl in impls.items():
    moved[key] = jax.random.wrap_key_data(moved[key], impl=impl)
  return moved


def _target_shardings(
  flat: dict[str, Any], shardings: Any, numbers: dict[str, Any]
) -> dict[str, jax.sharding.Sharding]:
  if isinstance(shardings, jax.sharding.Sharding):
    return dict.fromkeys(flat, shardings)
  targets, _ = _tree.flatten(shardings)
  targets = {k: s for k, s in targets.items() if k not in numbers}
  missing = sorted(set(flat) - set(targets))
  unexpected = sorted(set(targets) - set(flat))
  if missing or unexpected:
    lines = [f"{k}: array without a sharding" for k in missing]
    lines += [f"{k}: sharding without an array" for k in unexpected]
    raise _errors.TreeMismatchError("tree and shardings differ:\n" + _errors.bullet_list(lines))
  return targets


def _check(flat: dict[str, Any], targets: dict[str, jax.sharding.Sharding]) -> None:
  bad, problems = [], []
  for key, x in flat.items():
    if not isinstance(x, jax.Array):
      bad.append(f"{key}: {type(x).__qualname__} is not a jax.Array")
      continue
    problem = _devices.sharding_problem(targets[key], tuple(x.shape))
    if problem:
      problems.append(f"{key}: {problem}")
  if bad:
    raise _errors.UnsupportedLeafError(
      "reshard moves jax.Arrays only:\n" + _errors.bullet_list(bad)
    )
  if problems:
    raise _errors.ShardingError(
      "shardings do not fit their arrays:\n" + _errors.bullet_list(problems)
    )


def _host_copy_problems(
  flat: dict[str, Any], targets: dict[str, Any], first: bool = False
) -> list[str]:
  """Why a host copy cannot do the move: it needs CPU arrays held wholly by this process
  (`first`: the first reason only, which is all `method="auto"` needs)."""
  problems = []
  for key, x in flat.items():
    for what, sharding in (("array", x.sharding), ("target", targets[key])):
      if not sharding.is_fully_addressable:
        problems.append(f"{key}: the {what} spans devices of other processes")
      elif not _devices.on_cpu(sharding):
        problems.append(
          f"{key}: the {what} is on {sorted({d.platform for d in sharding.device_set})}"
        )
      if first and problems:
        return problems
  return problems


def _start_host_reshard(x: jax.Array, target: jax.sharding.Sharding):
  """Starts copying every target slice out of the source shards (threads: numpy frees the GIL).

  Returns a function that waits for the copies and builds the resharded array.
  """
  if x.sharding == target:
    return lambda: x
  shape = tuple(x.shape)
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # its shards' data is key data
    return lambda: jax.device_put(x, target)
  if x.sharding.is_equivalent_to(target, x.ndim):  # same data per device: relabel only
    by_device = {s.device: s.data for s in x.addressable_shards}
    return lambda: jax.make_array_from_single_device_arrays(
      x.shape, target, [by_device[d] for d in target.addressable_devices]
    )
  plan = _copy_plan(x.sharding, target, shape, x.dtype.itemsize)
  shards = {s.device: s.data for s in x.addressable_shards}
  copies = [_threads.submit(_copy_group, group, shards, x.dtype) for group in plan]

  def finish() -> jax.Array:
    return _devices.adopt(shape, target, {k: v for c in copies for k, v in c.result()})

  return finish


_TASK_BYTES = 8 << 20
"""Target slices are copied by one task per this many bytes (one per slice above it)."""


@_caches.cached_when_hashable(maxsize=512)
def _copy_plan(source, target, shape: tuple, itemsize: int) -> tuple:
  """The copies that build each target slice, in tasks of about `_TASK_BYTES` (a layout
  change of many arrays of one shape is planned once): per task, per target slice, its
  bounds, its shape, and (source device, index into its shard, index into the slice) per
  source shard it takes from.
  """
  sources = [(region, devices[0]) for region, devices in _devices.group_by_slice(source, shape)]
  tasks, task, task_size = [], [], 0
  for region, _ in _devices.group_by_slice(target, shape):
    parts = []
    for src_region, device in sources:
      part = _regions.overlap(region, src_region)
      if part is not None:
        parts.append((device, _regions.relative(part, src_region), _regions.relative(part, region)))
    slice_shape = tuple(s.stop - s.start for s in region)
    task.append((_regions.bounds(region, shape), slice_shape, tuple(parts)))
    task_size += _regions.size(region) * itemsize
    if task_size >= _TASK_BYTES:
      tasks.append(tuple(task))
      task, task_size = [], 0
  if task:
    tasks.append(tuple(task))
  return tuple(tasks)


def _copy_group(group: tuple, shards: dict, dtype) -> list[tuple[tuple, np.ndarray]]:
  """(bounds, host buffer) of each target slice of `group`, copied out of the source shards."""
  views: dict = {}
  outs = []
  for where, slice_shape, parts in group:
    out = _hostmem.aligned_empty(slice_shape, dtype)
    for device, src_index, dst_index in parts:
      view = views.get(device)
      if view is None:
        view = views[device] = np.asarray(shards[device])
      out[dst_index] = view[src_index]
    outs.append((where, out))
  return outs
