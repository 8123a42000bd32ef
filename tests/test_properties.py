"""Property tests: random shapes, dtypes and shardings round-trip exactly, and chunks stay aligned."""

import math

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax.store import _zarr

MESH_SHAPES = [
  ((8,), ("a",)),
  ((2, 4), ("a", "b")),
  ((4, 2), ("a", "b")),
  ((2, 2, 2), ("a", "b", "c")),
]


@st.composite
def sharded_arrays(draw):
  mesh_shape, names = draw(st.sampled_from(MESH_SHAPES))
  ndim = draw(st.integers(0, 3))
  spec, used = [], set()
  shape = []
  for _ in range(ndim):
    free = [n for n in names if n not in used]
    axes = draw(st.sampled_from([None, *free]))
    parts = 1
    if axes is not None:
      used.add(axes)
      parts = dict(zip(names, mesh_shape))[axes]
    shape.append(parts * draw(st.integers(0 if axes is None else 1, 5)))
    spec.append(axes)
  dtype = draw(st.sampled_from([np.float32, np.int32, np.uint8, np.bool_, "bfloat16", np.float16]))
  return tuple(shape), np.dtype(dtype), (mesh_shape, names), P(*spec)


def _values(shape, dtype, seed):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * 100).astype(dtype)


@settings(
  max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
  src=sharded_arrays(),
  dst_mesh=st.sampled_from(MESH_SHAPES),
  seed=st.integers(0, 1000),
  chunk_bytes=st.sampled_from([16, 256, 4 << 20]),
)
def test_round_trip_random_layouts(tmp_path_factory, src, dst_mesh, seed, chunk_bytes):
  shape, dtype, (mesh_shape, names), spec = src
  data = _values(shape, dtype, seed)
  x = jax.device_put(data, NamedSharding(jax.make_mesh(mesh_shape, names), spec))
  path = tmp_path_factory.mktemp("prop") / "c"
  ucp_jax.save(path, {"x": x}, chunk_bytes=chunk_bytes)
  # Restore replicated onto another mesh, and sharded like the source on a fresh mesh object.
  mesh2 = jax.make_mesh(*dst_mesh)
  sizes = dict(zip(dst_mesh[1], dst_mesh[0]))
  free, other = list(mesh2.axis_names), []
  for d in shape:  # shard some dimensions over an unused axis that divides them
    axis = next((a for a in free if d % sizes[a] == 0 and (seed + len(other)) % 2), None)
    if axis is not None:
      free.remove(axis)
    other.append(axis)
  shardings = (
    NamedSharding(mesh2, P()),
    NamedSharding(mesh2, P(*other)),
    NamedSharding(jax.make_mesh(mesh_shape, names), spec),
  )
  for sharding in shardings:
    out = ucp_jax.restore(path, {"x": jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)})["x"]
    for shard in out.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), data[shard.index])
  assert ucp_jax.open(path).verify() == {}


@given(
  shape=st.lists(st.integers(1, 64), min_size=0, max_size=4),
  splits=st.lists(st.integers(1, 4), min_size=4, max_size=4),
  itemsize=st.sampled_from([1, 2, 4, 8]),
  limit=st.integers(1, 1 << 16),
)
def test_chunks_divide_sharded_dims_and_respect_limit(shape, splits, itemsize, limit):
  shape = tuple(s * k for s, k in zip(shape, splits))
  shard = tuple(s // k for s, k in zip(shape, splits))
  chunks = _zarr.choose_chunks(shape, shard, itemsize, limit)
  for full, sh, c in zip(shape, shard, chunks):
    assert 1 <= c <= max(1, sh)
    if sh < full:
      assert sh % c == 0  # no chunk straddles two shards
  if math.prod(chunks) * itemsize > limit:
    assert all(c == 1 for c in chunks)  # only when nothing can be split further


@given(st.lists(st.text(min_size=0, max_size=6), min_size=1, max_size=4))
def test_key_parts_round_trip(parts):
  from ucp_jax.store import _keypath

  key = _keypath.join(parts)
  assert _keypath.split(key) == parts
  assert all(p and not p.startswith("__") and p not in (".", "..") for p in key.split("/"))
