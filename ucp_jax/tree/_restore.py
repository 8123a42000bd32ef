"""`restore`: a checkpoint -> a pytree on any mesh, each device reading only its slice."""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from typing import Any, Protocol

import jax
import numpy as np
import tensorstore as ts

from ucp_jax.base import _errors
from ucp_jax.store import _checkpoint, _hostmem, _keypath, _reader, _regions, _untrusted, _zarr
from ucp_jax.store._manifest import ArrayInfo
from ucp_jax.tree import _devices, _save, _tree, _unchanged


class Rules(Protocol):
  """What `restore(rules=)` asks of a rule set (`ucp_jax.rules.RuleSet` is one): the
  checkpoint as the rules present it."""

  def view(
    self, ckpt: _checkpoint.Checkpoint, *, subtree: str | None = None, partial: bool = False
  ) -> _checkpoint.Checkpoint: ...


_PY_TYPES = {"bool": bool, "int": int, "float": float, "complex": complex}


@dataclasses.dataclass(frozen=True)
class _Want:
  """What the target asks of one key."""

  key: str
  as_: str  # "jax", "numpy" or "scalar"
  shape: tuple[int, ...] | None = None  # None: whatever is stored
  dtype: np.dtype | None = None  # None: whatever is stored
  sharding: jax.sharding.Sharding | None = None
  python_type: type | None = None
  prng: bool = False


def restore(
  path: str | os.PathLike | _checkpoint.Checkpoint,
  target: Any = None,
  *,
  subtree: str | None = None,
  partial: bool = False,
  cast: bool = False,
  rules: Rules | None = None,
  max_host_bytes: int = _save.DEFAULT_HOST_BYTES,
) -> Any:
  """Restores a checkpoint onto the layout `target` describes.

  Each leaf of `target` says what to build: a `jax.ShapeDtypeStruct` with a
  sharding, or a `jax.Array` whose sharding is used, gives a `jax.Array` on that
  sharding (any mesh, any PartitionSpec, one process or many); a bare
  `jax.sharding.Sharding` takes shape and dtype from the checkpoint; a numpy
  array gives a numpy array; a Python number gives a Python number. Each process
  reads only the slices its devices hold, a slice shared by several local devices
  once. The whole target is checked against the manifest before any data is read.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, ucp_jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> _ = ucp_jax.save("/tmp/ucp_doc_restore", {"w": jnp.arange(8.0)}, overwrite=True)
    >>> mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    >>> spec = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    >>> ucp_jax.restore("/tmp/ucp_doc_restore", {"w": spec})["w"].sum()
    Array(28., dtype=float32)

  Args:
    path: the checkpoint (local directory or kvstore URL).
    target: the pytree to build, or None for nested dicts of numpy arrays.
    subtree: restore only the keys below this key prefix (e.g. `"params"`);
      `target` then describes that subtree.
    partial: allow the checkpoint to hold keys that `target` does not ask for.
    cast: convert stored dtypes to the target's; without it a dtype difference is an error.
    rules: a `ucp_jax.rules.RuleSet` that renames and re-lays-out the stored arrays
      (below `subtree`, when given) into the target's keys, e.g. a torch state dict
      into a Flax model; devices still read only their slices.
    max_host_bytes: bound on array bytes held in host memory at once.

  Returns:
    A pytree of `target`'s structure, each leaf built as its target leaf says (a
    `jax.Array` on its sharding, a numpy array, a Python number); with no target,
    nested dicts of numpy arrays by key path.

  Raises:
    CheckpointNotFoundError, ManifestError: no readable checkpoint at `path`.
    TreeMismatchError: keys missing from the checkpoint, or unexpected ones (all listed).
    MappingError: names or layouts that `rules` cannot carry (all listed).
    ShapeMismatchError, DtypeMismatchError, ShardingError: per key, all listed.
    CorruptCheckpointError: a chunk fails its checksum.
  """
  ckpt = _reader.open(path)
  prefix = (subtree or "").strip("/")
  if rules is not None:
    ckpt = rules.view(ckpt, subtree=prefix, partial=partial)
  if target is None:
    return _restore_untargeted(ckpt, prefix, max_host_bytes)
  flat, unflatten = _tree.flatten(target, prefix=prefix)
  wants = _wants(flat)
  _validate(ckpt, wants, prefix, partial, cast)
  values = _read_all(ckpt, wants, max_host_bytes)
  if rules is None:  # the arrays hold what the checkpoint's save held: a save may reuse it
    _unchanged.remember(ckpt.manifest.token, _unchanged.identities(_exact(ckpt, wants, values)))
  return unflatten(values)


def _exact(ckpt: _checkpoint.Checkpoint, wants: dict[str, _Want], values: dict) -> dict:
  """The restored jax.Arrays that hold exactly the stored values (not cast)."""
  return {
    key: values[key]
    for key, want in wants.items()
    if want.as_ == "jax" and (want.prng or want.dtype in (None, np.dtype(ckpt[key].dtype)))
  }


def _read_all(ckpt: _checkpoint.Checkpoint, wants: dict[str, _Want], max_host_bytes: int) -> dict:
  try:
    return _Reads(ckpt, max_host_bytes).run(wants)
  except _errors.CorruptCheckpointError as e:
    raise _checkpoint.if_replaced(ckpt, e) from e


def _restore_untargeted(ckpt: _checkpoint.Checkpoint, prefix: str, max_host_bytes: int) -> Any:
  keys = [k for k in ckpt.keys() if not prefix or k == prefix or k.startswith(prefix + "/")]
  if not keys:
    raise _errors.TreeMismatchError(f"{ckpt.location}: no keys under subtree {prefix!r}")
  wants = {k: _Want(k, "numpy") for k in keys}
  values = _read_all(ckpt, wants, max_host_bytes)
  for key in keys:
    info = ckpt[key]
    if info.kind == "scalar":
      values[key] = _PY_TYPES[info.python_type](values[key].item())
  relative = {k[len(prefix) :].lstrip("/") if prefix else k: v for k, v in values.items()}
  if list(relative) == [""]:
    return relative[""]
  return _keypath.nest(relative)


def _wants(flat: dict[str, Any]) -> dict[str, _Want]:
  wants, bad = {}, []
  for key, leaf in flat.items():
    want = _want(key, leaf)
    if want is None:
      bad.append(f"{key}: {type(leaf).__module__}.{type(leaf).__qualname__}")
    else:
      wants[key] = want
  if bad:
    raise _errors.UnsupportedLeafError(
      "target leaves must be jax.ShapeDtypeStruct, jax.Array, jax.sharding.Sharding, numpy "
      "arrays or Python numbers; these are not:\n" + _errors.bullet_list(bad)
    )
  return wants


def _want(key: str, leaf: Any) -> _Want | None:
  if isinstance(leaf, jax.sharding.Sharding):
    return _Want(key, "jax", sharding=leaf)
  if isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)):
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
      sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    prng = jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    dtype = leaf.dtype if prng else np.dtype(leaf.dtype)
    return _Want(key, "jax", tuple(leaf.shape), dtype, sharding, prng=prng)
  if isinstance(leaf, (np.ndarray, np.generic)):
    return _Want(key, "numpy", tuple(leaf.shape), np.dtype(leaf.dtype))
  if type(leaf) in _save.PY_SCALARS:
    return _Want(
      key, "scalar", (), np.dtype(_save.PY_SCALARS[type(leaf)][1]), python_type=type(leaf)
    )
  return None


def _validate(
  ckpt: _checkpoint.Checkpoint, wants: dict[str, _Want], prefix: str, partial: bool, cast: bool
) -> None:
  """Checks the whole target against the manifest, raising once per kind with every key."""
  stored = ckpt.manifest.arrays
  if prefix:
    stored = {k: v for k, v in stored.items() if k == prefix or k.startswith(prefix + "/")}
  missing = sorted(set(wants) - set(stored))
  unexpected = [] if partial else sorted(set(stored) - set(wants))
  if missing or unexpected:
    lines = [f"{k}: in target, not in checkpoint" for k in missing]
    lines += [f"{k}: in checkpoint, not in target (pass partial=True to skip)" for k in unexpected]
    raise _errors.TreeMismatchError(
      f"{ckpt.location}: target and checkpoint keys differ:\n" + _errors.bullet_list(lines)
    )
  shapes, dtypes, shardings = [], [], []
  for key, want in wants.items():
    info = stored[key]
    shape = _logical_shape(info)
    where = ckpt.comes_from(key)  # a mapped view says where a key comes from
    origin = f" ({where})" if where else ""
    if want.shape is not None and want.shape != shape:
      shapes.append(f"{key}: shape {want.shape} in target, {shape} in checkpoint{origin}")
    problem = _dtype_problem(want, info, cast)
    if problem:
      dtypes.append(f"{key}: {problem}{origin}")
    if want.sharding is not None:
      problem = _devices.sharding_problem(want.sharding, shape)
      if problem:
        shardings.append(f"{key}: {problem}")
  for kind, lines, what in (
    (_errors.ShapeMismatchError, shapes, "shapes differ"),
    (_errors.DtypeMismatchError, dtypes, "dtypes differ (pass cast=True to convert)"),
    (_errors.ShardingError, shardings, "shardings do not fit their arrays"),
  ):
    if lines:
      raise kind(f"{ckpt.location}: {what}:\n" + _errors.bullet_list(lines))


def _logical_shape(info: ArrayInfo) -> tuple[int, ...]:
  """The user-visible shape: PRNG key data carries trailing key dimensions."""
  if info.kind == "prng_key":
    return info.shape[:-1] if info.shape else info.shape
  return info.shape


def _dtype_problem(want: _Want, info: ArrayInfo, cast: bool) -> str | None:
  if want.prng or info.kind == "prng_key":
    if want.dtype is None:
      return None
    if not (want.prng and info.kind == "prng_key"):
      stored = f"{info.prng_impl} PRNG keys" if info.kind == "prng_key" else info.dtype
      return f"{want.dtype} in target, {stored} in checkpoint"
    impl = getattr(getattr(want.dtype, "_impl", None), "name", None)
    if impl is not None and impl != info.prng_impl:
      return f"PRNG impl {impl} in target, {info.prng_impl} in checkpoint"
    return None
  if want.dtype is None or want.dtype == np.dtype(info.dtype) or cast:
    return None
  return f"{want.dtype} in target, {info.dtype} in checkpoint"


class _Reads:
  """Issues every read a restore needs, at most ~max_host_bytes in flight."""

  def __init__(self, ckpt: _checkpoint.Checkpoint, max_host_bytes: int):
    self._ckpt = ckpt
    self._budget = max_host_bytes
    self._stores: dict[str, Any] = {}

  def run(self, wants: dict[str, _Want]) -> dict[str, Any]:
    ts_keys = [k for k in wants if not self._ckpt.reads_directly(k)]
    futures = {k: self._ckpt.open_future(k) for k in ts_keys}
    location = self._ckpt.location
    self._stores = {k: _zarr.wait_open(location, k, f) for k, f in futures.items()}
    pieces: dict[str, dict] = {k: {} for k in wants}
    window: deque = deque()
    held = 0
    units = list(self._units(wants))
    self._check_memory(wants, units)
    for unit in units:
      while window and held + unit[-1] > self._budget:
        held -= self._finish(window.popleft(), pieces)
      window.append(self._start(unit))
      held += unit[-1]
    while window:
      self._finish(window.popleft(), pieces)
    return {key: self._assemble(wants[key], pieces[key]) for key in wants}

  def _check_memory(self, wants: dict[str, _Want], units: list) -> None:
    """Refuses a restore whose host memory (every slice, where the devices adopt host buffers
    or numpy arrays are asked for; else the reads in flight) this process cannot allocate:
    the sizes come from the checkpoint's files, which may declare terabytes."""
    by_key: dict[str, int] = {}
    for unit in units:
      by_key[unit[0].key] = by_key.get(unit[0].key, 0) + unit[-1]
    total = sum(by_key.values())
    kept = all(w.as_ != "jax" or _devices.on_cpu(w.sharding) for w in wants.values())
    nbytes = total if kept else min(total, self._budget + max((u[-1] for u in units), default=0))
    largest = max(by_key, key=by_key.get, default=None)
    what = f"{self._ckpt.location}: restoring {len(wants)} arrays (the largest `{largest}`)"
    _untrusted.check_allocation(nbytes, what)

  def _units(self, wants: dict[str, _Want]):
    """Units of reading: every slice of a direct-read array together, else one slice each."""
    for key, want in wants.items():
      tasks = list(self._tasks(want))
      if self._ckpt.reads_directly(key):
        yield want, [t[1] for t in tasks], [t[2] for t in tasks], sum(t[3] for t in tasks)
      else:
        for _, index, devices, nbytes in tasks:
          yield want, [index], [devices], nbytes

  def _start(self, unit):
    want, indices, devices, nbytes = unit
    info = self._ckpt[want.key]
    if self._ckpt.reads_directly(want.key):
      regions = [_regions.normalize(index, info.shape) for index in indices]
      hosts, wait = self._ckpt.start_read(want.key, regions)
    else:
      hosts, futures = zip(*(self._read(want.key, index) for index in indices))

      def wait():
        for f in futures:
          _zarr.wait_read(self._ckpt.location, want.key, f)

    return want, indices, list(hosts), devices, wait, nbytes

  def _tasks(self, want: _Want):
    """(want, index, devices, nbytes) per distinct slice this process needs."""
    info = self._ckpt[want.key]
    itemsize = np.dtype(info.dtype).itemsize
    if want.as_ != "jax":
      yield want, (), None, max(1, int(np.prod(info.shape))) * itemsize
      return
    by_slice = _devices.group_by_slice(want.sharding, _logical_shape(info))
    for index, devices in by_slice:
      size = _regions.size(index)
      full_index = index + (slice(None),) * (len(info.shape) - len(index))
      yield want, full_index, devices, max(1, size) * itemsize * (2 if want.prng else 1)

  def _read(self, key: str, index: tuple) -> tuple[np.ndarray, ts.Future]:
    """Starts reading `index` of `key` into an aligned buffer that devices can adopt."""
    view = self._stores[key][index]
    out = _hostmem.aligned_empty(tuple(view.shape), view.dtype.numpy_dtype)
    return out, ts.array(out, copy=False, write=True).write(view).commit

  def _finish(self, item, pieces: dict[str, dict]) -> int:
    """Waits for a unit's reads; its slices go to accelerators now (freeing host memory), and
    stay in host buffers that CPU devices adopt together when the array is built."""
    want, indices, hosts, devices_per_host, wait, nbytes = item
    wait()
    data_shape = self._ckpt[want.key].shape
    for index, host, devices in zip(indices, hosts, devices_per_host):
      if want.dtype is not None and not want.prng and host.dtype != want.dtype:
        host = host.astype(want.dtype)
      if devices is None:
        pieces[want.key][None] = host
      elif _devices.on_cpu(want.sharding):
        pieces[want.key][_regions.bounds(index, data_shape)] = host
      else:
        for device in devices:
          pieces[want.key][device] = _devices.to_device(host, device)
    return nbytes

  def _assemble(self, want: _Want, pieces: dict) -> Any:
    info = self._ckpt[want.key]
    if want.as_ == "numpy":
      return pieces[None]
    if want.as_ == "scalar":
      return want.python_type(pieces[None].item())
    shape = _logical_shape(info)
    sharding = want.sharding
    prng = want.prng or info.kind == "prng_key"  # (a bare Sharding target: typed keys too)
    if prng:
      shape, sharding = info.shape, _key_data_sharding(sharding, len(shape), len(info.shape))
    if _devices.on_cpu(sharding):
      data = _devices.adopt(shape, sharding, pieces)
    else:
      data = jax.make_array_from_single_device_arrays(
        shape, sharding, [pieces[d] for d in sharding.addressable_devices]
      )
    return jax.random.wrap_key_data(data, impl=info.prng_impl) if prng else data


def _key_data_sharding(
  sharding: jax.sharding.Sharding, ndim: int, data_ndim: int
) -> jax.sharding.Sharding:
  """The sharding of PRNG key data: the keys' sharding, trailing key dimensions whole."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (data_ndim - len(sharding.spec))
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return sharding
  raise _errors.ShardingError(
    f"PRNG keys restore onto a NamedSharding or a single device, not {type(sharding).__name__}"
  )
