"""Round trips of `save` / `restore` / `open` across meshes, specs and dtypes on 8 CPU devices."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from chunk_reads import ChunkReads
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax


def _mesh(shape, names, devices=None):
  return jax.make_mesh(shape, names, devices=devices)


MESHES = {
  "8": lambda: _mesh((8,), ("x",)),
  "2x4": lambda: _mesh((2, 4), ("x", "y")),
  "4x2": lambda: _mesh((4, 2), ("x", "y")),
  "1x8": lambda: _mesh((1, 8), ("x", "y")),
  "sub4": lambda: _mesh((4,), ("x",), devices=jax.devices()[4:]),
}
SPECS = {
  "8": [P("x"), P(None, "x"), P()],
  "2x4": [P("x", "y"), P("y", "x"), P(("x", "y")), P(None, "y"), P()],
  "4x2": [P("x", "y"), P("y"), P()],
  "1x8": [P("x", "y"), P(None, ("x", "y"))],
  "sub4": [P("x"), P(None, "x"), P()],
}
LAYOUTS = [(m, s) for m, specs in SPECS.items() for s in specs]


def _layout_id(layout):
  return f"{layout[0]}-{layout[1]}"


def _data(shape=(16, 24), dtype=np.float32, seed=0):
  rng = np.random.default_rng(seed)
  return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("src", LAYOUTS, ids=_layout_id)
def test_save_from_any_layout_restore_onto_8_way(tmp_path, src):
  data = _data()
  x = jax.device_put(data, NamedSharding(MESHES[src[0]](), src[1]))
  ucp_jax.save(tmp_path / "ckpt", {"w": x}, step=7)
  target = jax.ShapeDtypeStruct(
    data.shape, data.dtype, sharding=NamedSharding(MESHES["8"](), P("x"))
  )
  out = ucp_jax.restore(tmp_path / "ckpt", {"w": target})["w"]
  np.testing.assert_array_equal(np.asarray(out), data)
  assert out.sharding == target.sharding


@pytest.mark.parametrize("dst", LAYOUTS, ids=_layout_id)
def test_restore_onto_any_layout(tmp_path, dst):
  data = _data(seed=1)
  x = jax.device_put(data, NamedSharding(MESHES["2x4"](), P("x", "y")))
  ucp_jax.save(tmp_path / "ckpt", {"w": x})
  sharding = NamedSharding(MESHES[dst[0]](), dst[1])
  out = ucp_jax.restore(
    tmp_path / "ckpt", {"w": jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)}
  )["w"]
  assert out.sharding == sharding
  for shard in out.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), data[shard.index])


JAX_DTYPES = [
  np.float32,
  ml_dtypes.bfloat16,
  np.float16,
  np.int8,
  np.int32,
  np.uint32,
  np.bool_,
  np.uint8,
  np.complex64,
  ml_dtypes.float8_e4m3fn,
]
NUMPY_ONLY_DTYPES = [
  np.float64,
  np.int64,
  np.uint64,
  np.complex128,
]  # jax without x64 narrows these


@pytest.mark.parametrize("dtype", JAX_DTYPES + NUMPY_ONLY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_dtypes_round_trip(tmp_path, dtype):
  rng = np.random.default_rng(2)
  data = (rng.standard_normal((8, 6)) * 50).astype(dtype)
  sharding = NamedSharding(MESHES["8"](), P("x"))
  on_jax = dtype in JAX_DTYPES
  tree = {"np": data, **({"jax": jax.device_put(data, sharding)} if on_jax else {})}
  ucp_jax.save(tmp_path / "c", tree)
  target = {"np": np.zeros_like(data)}
  if on_jax:
    target["jax"] = jax.ShapeDtypeStruct(data.shape, dtype, sharding=sharding)
  out = ucp_jax.restore(tmp_path / "c", target)
  for key in target:
    assert out[key].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out[key]), data)
    assert ucp_jax.open(tmp_path / "c")[key].dtype == np.dtype(dtype).name


def test_scalars_zero_d_empty_and_prng_keys(tmp_path):
  mesh = MESHES["2x4"]()
  keys = jax.random.split(jax.random.key(42), 8)
  tree = {
    "ints": 3,
    "float": 2.5,
    "flag": True,
    "complex": 1 + 2j,
    "np_scalar": np.float32(1.25),
    "zero_d": jnp.asarray(7, jnp.int32),
    "empty": jnp.zeros((0, 4)),
    "empty_np": np.zeros((3, 0), np.int8),
    "key": jax.random.key(0),
    "keys": jax.device_put(keys, NamedSharding(mesh, P("x"))),
    "rbg": jax.random.key(5, impl="rbg"),
  }
  ucp_jax.save(tmp_path / "c", tree, step=1)
  target = {
    "ints": 0,
    "float": 0.0,
    "flag": False,
    "complex": 0j,
    "np_scalar": np.float32(0),
    "zero_d": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
    "empty": jax.ShapeDtypeStruct((0, 4), jnp.float32, sharding=NamedSharding(mesh, P())),
    "empty_np": np.zeros((3, 0), np.int8),
    "key": jax.random.key(1),
    "keys": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=NamedSharding(mesh, P(("x", "y")))),
    "rbg": jax.random.key(0, impl="rbg"),
  }
  out = ucp_jax.restore(tmp_path / "c", target)
  assert out["ints"] == 3 and type(out["ints"]) is int
  assert out["float"] == 2.5 and type(out["float"]) is float
  assert out["flag"] is True
  assert out["complex"] == 1 + 2j
  assert out["np_scalar"] == np.float32(1.25)
  assert int(out["zero_d"]) == 7
  assert out["empty"].shape == (0, 4) and out["empty_np"].shape == (3, 0)
  np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(tree["key"]))
  np.testing.assert_array_equal(jax.random.key_data(out["keys"]), jax.random.key_data(keys))
  assert out["keys"].sharding.spec == P(("x", "y"))
  assert str(jax.random.key_impl(out["rbg"])) == "rbg"
  np.testing.assert_array_equal(jax.random.uniform(out["key"]), jax.random.uniform(tree["key"]))


def test_restore_without_target_gives_nested_numpy(tmp_path):
  tree = {
    "params": {"layers": [{"w": np.ones((2, 2))}, {"w": np.zeros((2, 2))}], "b": np.arange(3)},
    "step": 4,
  }
  ucp_jax.save(tmp_path / "c", tree)
  out = ucp_jax.restore(tmp_path / "c")
  assert out["step"] == 4
  np.testing.assert_array_equal(out["params"]["layers"][0]["w"], np.ones((2, 2)))
  np.testing.assert_array_equal(out["params"]["b"], np.arange(3))
  sub = ucp_jax.restore(tmp_path / "c", subtree="params/layers")
  assert isinstance(sub, list) and len(sub) == 2


def test_partial_restore_subtree_and_subset(tmp_path):
  sharding = NamedSharding(MESHES["8"](), P("x"))
  tree = {"params": {"a": jnp.arange(8.0), "b": jnp.ones(8)}, "opt": {"mu": jnp.zeros(8)}}
  ucp_jax.save(tmp_path / "c", tree)
  spec = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)
  params = ucp_jax.restore(tmp_path / "c", {"a": spec, "b": spec}, subtree="params")
  np.testing.assert_array_equal(np.asarray(params["a"]), np.arange(8.0))
  only_a = ucp_jax.restore(tmp_path / "c", {"params": {"a": spec}}, partial=True)
  assert list(only_a["params"]) == ["a"]


def test_cast_only_when_asked(tmp_path):
  ucp_jax.save(tmp_path / "c", {"w": np.arange(6, dtype=np.float32)})
  sharding = NamedSharding(MESHES["8"](), P())
  target = {"w": jax.ShapeDtypeStruct((6,), jnp.bfloat16, sharding=sharding)}
  with pytest.raises(ucp_jax.DtypeMismatchError):
    ucp_jax.restore(tmp_path / "c", target)
  out = ucp_jax.restore(tmp_path / "c", target, cast=True)
  assert out["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out["w"], np.float32), np.arange(6))


def test_target_of_arrays_and_bare_shardings(tmp_path):
  data = _data((8, 8))
  ucp_jax.save(tmp_path / "c", {"a": data, "b": data * 2})
  s1 = NamedSharding(MESHES["4x2"](), P("x", "y"))
  like = jax.device_put(np.zeros_like(data), s1)
  out = ucp_jax.restore(
    tmp_path / "c", {"a": like, "b": NamedSharding(MESHES["8"](), P(None, "x"))}
  )
  assert out["a"].sharding == s1
  np.testing.assert_array_equal(np.asarray(out["b"]), data * 2)


def test_slice_shared_by_devices_is_read_once(tmp_path, monkeypatch):
  from ucp_jax.store import _direct
  from ucp_jax.tree import _restore

  data = _data((8, 8))
  ucp_jax.save(tmp_path / "c", {"w": data}, chunk_bytes=64)  # 4 chunks of 2 rows
  # 2x4 mesh, sharded over "x" only: 4 devices share each half.
  sharding = NamedSharding(MESHES["2x4"](), P("x"))
  target = {"w": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=sharding)}

  reads = ChunkReads(monkeypatch)
  out = ucp_jax.restore(tmp_path / "c", target)
  np.testing.assert_array_equal(np.asarray(out["w"]), data)
  assert sorted(os.path.relpath(p, tmp_path / "c" / "w") for p in reads.files) == [
    f"c/0/0 (chunk {i}/0)" for i in range(4)
  ]  # each chunk once, from the one file that bundles them

  monkeypatch.setattr(_direct, "ENABLED", False)  # the TensorStore path: one read per slice
  slice_reads = []
  real_read = _restore._Reads._read
  monkeypatch.setattr(
    _restore._Reads,
    "_read",
    lambda self, key, index: (
      slice_reads.append(tuple((s.start, s.stop) for s in index)),
      real_read(self, key, index),
    )[1],
  )
  out = ucp_jax.restore(tmp_path / "c", target)
  assert sorted(slice_reads) == [((0, 4), (0, 8)), ((4, 8), (0, 8))]
  np.testing.assert_array_equal(np.asarray(out["w"]), data)


def test_tiny_host_budget_still_restores(tmp_path):
  data = _data((64, 32))
  sharding = NamedSharding(MESHES["8"](), P("x"))
  ucp_jax.save(tmp_path / "c", {"w": jax.device_put(data, sharding)}, max_host_bytes=1)
  out = ucp_jax.restore(
    tmp_path / "c",
    {"w": jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)},
    max_host_bytes=1,
  )
  np.testing.assert_array_equal(np.asarray(out["w"]), data)


def test_overwrite_replaces_atomically(tmp_path):
  ucp_jax.save(tmp_path / "c", {"w": np.zeros(3)}, step=1)
  ucp_jax.save(tmp_path / "c", {"v": np.ones(2)}, step=2, overwrite=True)
  ckpt = ucp_jax.open(tmp_path / "c")
  assert ckpt.step == 2 and ckpt.keys() == ["v"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no staging, lock or old copy left


def test_memory_kvstore_and_compression(tmp_path):
  data = _data((32, 32))
  url = "memory://ucp_test_memory/ckpt"
  ucp_jax.save(url, {"w": data}, compression="zstd", metadata={"run": "a"})
  ckpt = ucp_jax.open(url)
  assert ckpt.metadata == {"run": "a"}
  np.testing.assert_array_equal(ckpt.read("w"), data)
  with pytest.raises(ucp_jax.CheckpointExistsError):
    ucp_jax.save(url, {"w": data})
  ucp_jax.save(url, {"w": data + 1}, overwrite=True)
  np.testing.assert_array_equal(ucp_jax.restore(url)["w"], data + 1)


def test_zarr_layout_is_plain_zarr_v3(tmp_path):
  import json

  import tensorstore as ts

  data = _data((16, 8))
  sharding = NamedSharding(MESHES["8"](), P("x"))
  tree = {"params": {"dense": {"kernel": jax.device_put(data, sharding)}}}
  ucp_jax.save(tmp_path / "c", tree, bundle_bytes=None)  # a file per chunk
  ucp_jax.save(tmp_path / "b", tree)  # the process's 8 shards in one bundle
  meta = json.loads((tmp_path / "c/params/dense/kernel/zarr.json").read_text())
  assert meta["node_type"] == "array"
  assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [2, 8]
  assert [c["name"] for c in meta["codecs"]] == ["bytes", "crc32c"]
  bundled = json.loads((tmp_path / "b/params/dense/kernel/zarr.json").read_text())
  assert bundled["chunk_grid"]["configuration"]["chunk_shape"] == [16, 8]
  (codec,) = bundled["codecs"]
  assert codec["name"] == "sharding_indexed"
  assert codec["configuration"]["chunk_shape"] == [2, 8]
  assert [c["name"] for c in codec["configuration"]["codecs"]] == ["bytes", "crc32c"]
  for root in ("c", "b"):
    assert json.loads((tmp_path / root / "params/zarr.json").read_text())["node_type"] == "group"
    plain = ts.open(
      {"driver": "zarr3", "kvstore": f"file://{tmp_path}/{root}/params/dense/kernel"}
    ).result()
    np.testing.assert_array_equal(plain.read().result(), data)


def test_keys_with_odd_characters(tmp_path):
  tree = {
    "a/b": np.ones(1),
    "": np.zeros(1),
    "..": np.full(1, 2.0),
    "__x": np.full(1, 3.0),
    "é z": np.full(1, 4.0),
  }
  ucp_jax.save(tmp_path / "c", tree)
  out = ucp_jax.restore(tmp_path / "c", {k: np.zeros(1) for k in tree})
  for k, v in tree.items():
    np.testing.assert_array_equal(out[k], v)


def test_nnx_state_and_optimizer_round_trip(tmp_path):
  import optax
  from flax import nnx

  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  state = {"model": nnx.state(model), "opt": nnx.state(opt)}
  ucp_jax.save(tmp_path / "c", state)
  assert "model/kernel" in ucp_jax.open(tmp_path / "c").keys()
  fresh = nnx.Linear(4, 3, rngs=nnx.Rngs(1))
  fresh_opt = nnx.Optimizer(fresh, optax.adamw(1e-2), wrt=nnx.Param)
  abstract = {"model": nnx.state(fresh), "opt": nnx.state(fresh_opt)}
  out = ucp_jax.restore(tmp_path / "c", abstract)
  nnx.update(fresh, out["model"])
  np.testing.assert_array_equal(np.asarray(fresh.kernel[...]), np.asarray(model.kernel[...]))


def test_reshard_matches_device_put():
  data = _data((16, 32))
  src = jax.device_put(data, NamedSharding(MESHES["8"](), P("x")))
  for mesh, spec in LAYOUTS:
    dst = NamedSharding(MESHES[mesh](), spec)
    for method in ("host", "device_put", "auto"):
      out = ucp_jax.reshard({"w": src}, {"w": dst}, method=method)["w"]
      assert out.sharding == dst
      for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), data[shard.index])
  np.testing.assert_array_equal(np.asarray(src), data)  # input untouched


@pytest.mark.parametrize("columns, threshold, path", [(40, 0, "host"), (56, 1 << 40, "device_put")])
def test_reshard_auto_follows_a_fixed_rule(monkeypatch, columns, threshold, path):
  """`auto` picks by the arrays' mean size against HOST_COPY_MIN_BYTES (CPU, one process):
  the same inputs take the same path on every call, and `reshard_method` says which."""
  from ucp_jax.tree import _reshard

  monkeypatch.setattr(_reshard, "HOST_COPY_MIN_BYTES", threshold)
  src = NamedSharding(MESHES["8"](), P("x"))
  dst = NamedSharding(MESHES["2x4"](), P("y", "x"))
  x = jax.device_put(np.arange(64 * columns, dtype=np.float32).reshape(64, -1), src)
  used = []
  for name in ("_host_reshard", "_device_put"):
    real = getattr(_reshard, name)
    monkeypatch.setattr(
      _reshard, name, lambda a, t, real=real, name=name: used.append(name) or real(a, t)
    )
  want = np.asarray(x)
  for _ in range(7):
    out = ucp_jax.reshard({"w": x}, {"w": dst})["w"]
    assert out.sharding == dst
    np.testing.assert_array_equal(np.asarray(out), want)
  assert used == [f"_{path}" if path == "device_put" else "_host_reshard"] * 7
  assert _reshard.reshard_method({"w": x}, {"w": dst})[0] == path


def test_reshard_auto_rule_reads_sizes_platforms_and_processes():
  from ucp_jax.tree import _reshard

  src = NamedSharding(MESHES["8"](), P("x"))
  dst = NamedSharding(MESHES["2x4"](), P("y", "x"))
  small = jax.device_put(np.zeros((64, 64), np.float32), src)
  big = jax.device_put(np.zeros((2048, 2048 + 64), np.float32), src)  # 16.5 MiB
  assert _reshard.reshard_method({"w": small}, dst) == (
    "device_put",
    "CPU arrays of 0.02 MiB on average, below 16 MiB: device_put's lower cost per array wins",
  )
  assert _reshard.reshard_method({"w": big}, dst) == (
    "host",
    "CPU arrays of this process, 16.5 MiB each on average",
  )
  # one large and one small array: their mean decides
  bigger = jax.device_put(np.zeros((2048, 4096 + 64), np.float32), src)  # 32.5 MiB
  assert _reshard.reshard_method({"a": big, "b": small}, dst)[0] == "device_put"
  assert _reshard.reshard_method({"a": bigger, "b": small}, dst)[0] == "host"


def test_reshard_refuses_an_unknown_method():
  x = jnp.ones(8)
  dst = NamedSharding(MESHES["8"](), P("x"))
  with pytest.raises(ucp_jax.InvalidArgumentError, match=r"method='fast': use 'auto'"):
    ucp_jax.reshard({"w": x}, dst, method="fast")


def test_reshard_auto_survives_a_failed_move(monkeypatch):
  from ucp_jax.tree import _reshard

  monkeypatch.setattr(_reshard, "HOST_COPY_MIN_BYTES", 0)  # auto: the host copy
  src = NamedSharding(MESHES["8"](), P("x"))
  dst = NamedSharding(MESHES["2x4"](), P("x", "y"))
  x = jax.device_put(np.arange(8 * 24, dtype=np.float32).reshape(8, 24), src)
  real = _reshard._host_reshard
  fail = [True]

  def host(a, t):
    if fail.pop() if fail else False:
      raise KeyboardInterrupt  # the first host copy is interrupted
    return real(a, t)

  monkeypatch.setattr(_reshard, "_host_reshard", host)
  with pytest.raises(KeyboardInterrupt):
    ucp_jax.reshard({"w": x}, {"w": dst})
  for _ in range(7):  # the same path again, whole
    out = ucp_jax.reshard({"w": x}, {"w": dst})["w"]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
  assert _reshard.reshard_method({"w": x}, {"w": dst})[0] == "host"


def test_reshard_keys_and_one_sharding_for_all():
  keys = jax.random.split(jax.random.key(0), 8)
  dst = NamedSharding(MESHES["8"](), P("x"))
  out = ucp_jax.reshard({"k": keys, "w": jnp.ones(8)}, dst)
  np.testing.assert_array_equal(jax.random.key_data(out["k"]), jax.random.key_data(keys))
  assert out["w"].sharding == dst


def test_reshard_passes_python_numbers_through():
  dst = NamedSharding(MESHES["8"](), P("x"))
  state = {"w": jnp.ones(8), "step": 100, "lr": 0.5}
  for method in ("host", "device_put", "auto"):
    out = ucp_jax.reshard(state, dst, method=method)
    assert out["w"].sharding == dst and out["step"] == 100 and out["lr"] == 0.5
  # in a shardings tree, a number's entry may be a sharding or missing
  assert ucp_jax.reshard(state, {"w": dst, "step": dst, "lr": None})["step"] == 100
  with pytest.raises(ucp_jax.UnsupportedLeafError, match="a: ndarray"):
    ucp_jax.reshard({"a": np.ones(8)}, dst)  # host arrays are not moved silently
  with pytest.raises(ucp_jax.TreeMismatchError, match="w: array without a sharding"):
    ucp_jax.reshard(state, {"step": dst})


def test_restore_slices_smaller_than_a_chunk(tmp_path):
  data = np.arange(10, dtype=np.int32)
  ucp_jax.save(tmp_path / "c", {"v": data})  # one chunk of 10
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  out = ucp_jax.restore(tmp_path / "c", {"v": NamedSharding(mesh, P("x"))})["v"]
  for shard in out.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), data[shard.index])


def test_local_zstd_round_trip_and_both_read_paths_agree(tmp_path, monkeypatch):
  from ucp_jax.store import _direct

  data = _data((64, 16))
  sharding = NamedSharding(MESHES["2x4"](), P("x", "y"))
  ucp_jax.save(tmp_path / "z", {"w": jax.device_put(data, sharding)}, compression="zstd")
  assert ucp_jax.open(tmp_path / "z")["w"].compression == "zstd"
  target = {"w": jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)}
  np.testing.assert_array_equal(np.asarray(ucp_jax.restore(tmp_path / "z", target)["w"]), data)
  ucp_jax.save(tmp_path / "raw", {"w": data})  # written by the direct path
  monkeypatch.setattr(_direct, "ENABLED", False)
  ucp_jax.save(tmp_path / "ts", {"w": data})  # written by TensorStore
  for name in ("raw", "ts"):
    np.testing.assert_array_equal(np.asarray(ucp_jax.restore(tmp_path / name, target)["w"]), data)
  raw_files = sorted(p.relative_to(tmp_path / "raw") for p in (tmp_path / "raw").rglob("c/*"))
  ts_files = sorted(p.relative_to(tmp_path / "ts") for p in (tmp_path / "ts").rglob("c/*"))
  assert raw_files == ts_files
  for f in (tmp_path / "raw").rglob("*"):
    if f.is_file() and "c" in f.relative_to(tmp_path / "raw").parts[1:2]:
      assert f.read_bytes() == (tmp_path / "ts" / f.relative_to(tmp_path / "raw")).read_bytes()


def test_save_bounds_host_bytes_in_flight(tmp_path, monkeypatch):
  from ucp_jax.store import _writer

  inflight, peak = [0], [0]
  original = _writer.Writer._write

  def tracked(self, key, host, index, immutable):
    done = original(self, key, host, index, immutable)
    inflight[0] += host.nbytes
    peak[0] = max(peak[0], inflight[0])

    class Waited:
      def result(self):
        done.result()
        inflight[0] -= host.nbytes

    return Waited()

  monkeypatch.setattr(_writer.Writer, "_write", tracked)
  tree = {f"a{i}": np.full((256, 256), i, np.float32) for i in range(8)}  # 256 KiB each
  ucp_jax.save(tmp_path / "c", tree, max_host_bytes=600 << 10)
  assert 256 << 10 < peak[0] <= 600 << 10  # two leaves at a time, never three
  restored = ucp_jax.restore(tmp_path / "c")
  assert all((restored[k] == v).all() for k, v in tree.items())


def test_every_save_keyword_is_a_save_option():
  """`save` and `save_async` pass their keywords down as one `SaveOptions`: none left out."""
  import dataclasses
  import inspect

  from ucp_jax.orbax import UcpSave
  from ucp_jax.tree._options import SaveOptions

  fields = {f.name for f in dataclasses.fields(SaveOptions)} - {"pool_levels"}
  for function in (ucp_jax.save, ucp_jax.save_async):
    keywords = {
      name
      for name, p in inspect.signature(function).parameters.items()
      if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert keywords == fields, function.__name__
  handler = {f.name for f in dataclasses.fields(UcpSave)} - {"item", "incremental"}
  assert handler <= fields  # overwrite, source and base are the handler's to decide
