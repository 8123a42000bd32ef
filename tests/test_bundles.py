"""Bundles: each process's part of an array in one file (zarr v3's sharding_indexed codec).

A checkpoint holds a few files per array and writer; zarr readers (TensorStore,
zarr-python) read them; a restore reads only the byte ranges of its chunks; and a
damaged or rearranged bundle is an error on every path, as a damaged chunk file is.
"""

import filecmp
import itertools
import math
import os
import re

import jax
import numpy as np
import pytest
from chunk_reads import ChunkReads
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax.store import _bundle, _location

_ids = itertools.count()


def _sharded(shape=(64, 32), spec=None):
  """An array over a 2x4 mesh: by default 4 row shards of (16, 32), each held by 2 devices."""
  x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  return x, jax.device_put(x, NamedSharding(mesh, P("y", None) if spec is None else spec))


def _files(path, key):
  root = os.path.join(path, key, "c")
  return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize(
  ("bundle_bytes", "bundle", "files"),
  [
    (_bundle.BUNDLE_BYTES, (64, 32), ["0/0"]),  # the process's part (all 4 shards): one file
    (2048, (16, 32), ["0/0", "1/0", "2/0", "3/0"]),  # bounded: one file per shard here
  ],
)
def test_each_process_part_is_one_file_that_any_mesh_and_zarr_python_read(
  tmp_path, bundle_bytes, bundle, files
):
  x, a = _sharded()
  path = tmp_path / "c"
  ucp_jax.save(path, {"a": a}, chunk_bytes=512, bundle_bytes=bundle_bytes)  # (4, 32) chunks
  info = ucp_jax.open(path)["a"]
  assert (info.chunks, info.bundle) == ((4, 32), bundle)
  assert _files(path, "a") == files
  ucp_jax.save(tmp_path / "u", {"a": a}, chunk_bytes=512, bundle_bytes=None)
  assert len(_files(tmp_path / "u", "a")) == 16

  for spec in (P(None, "x"), P(("x", "y")), P()):
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    target = {"a": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))}
    np.testing.assert_array_equal(np.asarray(ucp_jax.restore(path, target)["a"]), x)
  assert ucp_jax.open(path).verify() == {}
  np.testing.assert_array_equal(ucp_jax.open(path).read("a", np.s_[5:37, 3]), x[5:37, 3])

  zarr = pytest.importorskip("zarr")
  stored = zarr.open_group(str(path), mode="r")["a"]
  assert (stored.shards, stored.chunks) == (bundle, (4, 32))
  np.testing.assert_array_equal(stored[:], x)


def test_a_restore_reads_only_the_chunks_under_its_slices(tmp_path, monkeypatch):
  x, a = _sharded()
  ucp_jax.save(tmp_path / "c", {"a": a}, chunk_bytes=512)
  reads = ChunkReads(monkeypatch)
  mesh = jax.make_mesh((8,), ("z",))
  # 8 slices of 8 rows: each is 2 of the 16 chunks of the one bundle
  target = {"a": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("z")))}
  np.testing.assert_array_equal(np.asarray(ucp_jax.restore(tmp_path / "c", target)["a"]), x)
  read = sorted(os.path.relpath(p, tmp_path / "c" / "a") for p in reads.files)
  assert read == sorted(f"c/0/0 (chunk {i}/0)" for i in range(16))  # each chunk once


def test_bundle_files_are_byte_for_byte_what_tensorstore_writes(tmp_path):
  # (10, 7) int32 in (1, 4) chunks; bundles of (3, 8): the last holds 1 row of its 3 and
  # every bundle a padded column chunk, so the index marks places outside the array.
  # `many`: 3,000 chunks of 8 bytes in one bundle, written in runs of many per `pwritev`.
  x = np.arange(70, dtype=np.int32).reshape(10, 7)
  many = np.arange(6000, dtype=np.int32).reshape(3000, 2)
  options = {"chunk_bytes": 16, "bundle_bytes": 100}
  ucp_jax.save(tmp_path / "direct", {"x": x}, **options)
  ucp_jax.save(tmp_path / "direct-many", {"many": many}, chunk_bytes=8)
  spec = {"driver": "file", "path": str(tmp_path / "ts")}  # written through TensorStore
  ucp_jax.save(spec, {"x": x}, **options)
  spec_many = {"driver": "file", "path": str(tmp_path / "ts-many")}
  ucp_jax.save(spec_many, {"many": many}, chunk_bytes=8)
  ts_many = tmp_path / "ts-many" / ucp_jax.open(spec_many).manifest.data / "many" / "c" / "0" / "0"
  assert ucp_jax.open(tmp_path / "direct-many")["many"].bundle == (3000, 2)
  assert filecmp.cmp(tmp_path / "direct-many" / "many" / "c" / "0" / "0", ts_many, shallow=False)
  np.testing.assert_array_equal(ucp_jax.restore(tmp_path / "direct-many")["many"], many)
  ts_root = tmp_path / "ts" / ucp_jax.open(spec).manifest.data
  info = ucp_jax.open(tmp_path / "direct")["x"]
  assert (info.chunks, info.bundle) == ((1, 4), (3, 8))
  names = _files(tmp_path / "direct", "x")
  assert names == ["0/0", "1/0", "2/0", "3/0"] == _files(ts_root, "x")
  for name in names:
    direct, ts = (root / "x" / "c" / name for root in (tmp_path / "direct", ts_root))
    assert filecmp.cmp(direct, ts, shallow=False), name
  table = _bundle.decode_index((tmp_path / "direct/x/c/3/0").read_bytes()[-(16 * 6 + 4) :], 6)
  assert (table[2:] == _bundle.MISSING).all() and table[1, 0] == 20  # 2 chunks of 16 + 4 bytes
  np.testing.assert_array_equal(ucp_jax.restore(tmp_path / "direct")["x"], x)


@pytest.mark.parametrize("where", ["raw", "zstd", "memory"])
def test_bundles_round_trip_on_every_store_path(tmp_path, where):
  x, a = _sharded((48, 40), P(None, "y"))
  path = f"memory://ucp_bundles_{next(_ids)}" if where == "memory" else tmp_path / "c"
  compression = "zstd" if where == "zstd" else None
  # `a`: 4 column shards (each of 6 chunks) of one process in one bundle, written together
  ucp_jax.save(path, {"a": a, "n": x[:7]}, chunk_bytes=256, compression=compression)
  ckpt = ucp_jax.open(path)
  assert ckpt["a"].bundle == (48, 40) and ckpt["n"].bundle is not None
  mesh = jax.make_mesh((8,), ("z",))
  target = {
    "a": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("z"))),
    "n": x[:7],
  }
  out = ucp_jax.restore(path, target)
  np.testing.assert_array_equal(np.asarray(out["a"]), x)
  np.testing.assert_array_equal(out["n"], x[:7])
  assert ckpt.verify() == {}


def test_bundle_bytes_bounds_a_bundle_and_none_writes_a_file_per_chunk(tmp_path):
  x = np.zeros((64, 64), np.float32)  # one replicated shard of 16 KiB, in 1 KiB chunks
  ucp_jax.save(tmp_path / "a", {"x": x}, chunk_bytes=1024, bundle_bytes=4096)
  assert ucp_jax.open(tmp_path / "a")["x"].bundle == (16, 64)
  assert len(_files(tmp_path / "a", "x")) == 4
  ucp_jax.save(tmp_path / "b", {"x": x}, chunk_bytes=1024, bundle_bytes=None)
  assert ucp_jax.open(tmp_path / "b")["x"].bundle is None
  assert len(_files(tmp_path / "b", "x")) == 16
  with pytest.raises(ucp_jax.InvalidArgumentError, match="bundle_bytes=0"):
    ucp_jax.save(tmp_path / "c", {"x": x}, bundle_bytes=0)


# --- damage ---


A = np.arange(64, dtype=np.float32).reshape(8, 8)  # (2, 8) chunks: 4 places in one bundle


@pytest.fixture(params=["raw", "zstd", "memory"])
def bundled(request, tmp_path):
  """A checkpoint whose array `a` is one bundle of 4 chunks, and its bundle file's bytes."""
  where = f"memory://ucp_bundles_{next(_ids)}" if request.param == "memory" else tmp_path / "c"
  compression = "zstd" if request.param == "zstd" else None
  ucp_jax.save(where, {"a": A, "b": A + 1}, chunk_bytes=64, compression=compression)
  assert ucp_jax.open(where)["a"].bundle == (8, 8)
  return _Bundle(where, "a/c/0/0")


class _Bundle:
  def __init__(self, where, key):
    self.path, self.key = where, key
    data = ucp_jax.open(where).manifest.data
    self.store = _location.kvstore(_location.resolve(where).child(data))

  def get(self) -> bytes:
    return self.store.read(self.key).result().value

  def put(self, value: bytes) -> None:
    self.store.write(self.key, value).result()

  def index(self) -> np.ndarray:
    return _bundle.decode_index(self.get()[-(16 * 4 + 4) :], 4).copy()

  def put_index(self, table: np.ndarray, reseal: bool = True) -> None:
    raw = table.astype("<u8").tobytes()
    crc = _bundle.crc32c.crc32c(raw) if reseal else 0
    self.put(self.get()[: -(16 * 4 + 4)] + raw + crc.to_bytes(4, "little"))


def _every_read_fails(path, match):
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=match):
    ucp_jax.restore(path)
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=match):
    ucp_jax.restore(path, {"a": NamedSharding(mesh, P("x")), "b": NamedSharding(mesh, P("x"))})
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=match):
    ucp_jax.open(path).read("a")
  problems = ucp_jax.open(path).verify()
  assert list(problems) == ["a"], problems
  return problems["a"]


def _index_damage_is_caught(bundled, match):
  """Through TensorStore (which follows the index) every read fails. Reading raw chunks on a
  local disk ucp_jax looks where a save put each chunk and checks it against the manifest:
  those reads return the saved values, and `verify` reports the index zarr readers follow."""
  if "memory" in str(bundled.path) or ucp_jax.open(bundled.path)["a"].compression:
    _every_read_fails(bundled.path, match)
    return
  np.testing.assert_array_equal(ucp_jax.restore(bundled.path)["a"], A)
  problems = ucp_jax.open(bundled.path).verify()
  assert list(problems) == ["a"] and "bundle indexes that zarr readers follow" in problems["a"]
  assert "a/c/0/0" in problems["a"] and re.search(match, problems["a"]), problems


def test_chunks_swapped_by_a_resealed_index_are_an_error(bundled):
  table = bundled.index()
  table[[0, 1]] = table[[1, 0]]  # each place points at the other's sound chunk
  bundled.put_index(table)
  _index_damage_is_caught(bundled, "does not belong here")


def test_a_damaged_chunk_inside_a_bundle_is_an_error(bundled):
  raw = bytearray(bundled.get())
  raw[10] ^= 0xFF  # inside the first chunk
  bundled.put(bytes(raw))
  _every_read_fails(bundled.path, "a/c/0/0")


def test_a_damaged_index_is_an_error(bundled):
  table = bundled.index()
  table[2, 0] += 1
  bundled.put_index(table, reseal=False)
  _index_damage_is_caught(bundled, "a/c/0/0")


def test_a_chunk_marked_missing_in_the_index_is_an_error(bundled):
  table = bundled.index()
  table[3] = _bundle.MISSING
  bundled.put_index(table)
  _index_damage_is_caught(bundled, "a/c/0/0")


def test_chunks_in_another_order_are_found_through_the_index(tmp_path):
  # Another zarr writer may order a bundle's chunks differently: reads follow its index.
  ucp_jax.save(tmp_path / "c", {"a": A, "b": A + 1}, chunk_bytes=64)
  bundled = _Bundle(tmp_path / "c", "a/c/0/0")
  raw, table = bundled.get(), bundled.index()
  chunks = [raw[int(o) : int(o) + int(n)] for o, n in table]
  size = len(chunks[0])
  table[:, 0] = [size * (3 - i) for i in range(4)]
  bundled.put(b"".join(reversed(chunks)) + raw[4 * size :])
  bundled.put_index(table)
  np.testing.assert_array_equal(ucp_jax.restore(tmp_path / "c")["a"], A)
  np.testing.assert_array_equal(ucp_jax.open(tmp_path / "c").read("a", np.s_[2:5]), A[2:5])
  assert ucp_jax.open(tmp_path / "c").verify() == {}  # a sound bundle, laid out otherwise
  zarr = pytest.importorskip("zarr")
  np.testing.assert_array_equal(zarr.open_group(str(tmp_path / "c"), mode="r")["a"][:], A)


def test_a_truncated_or_missing_bundle_is_an_error(bundled):
  whole = bundled.get()
  bundled.put(whole[: len(whole) // 2])
  _every_read_fails(bundled.path, "a/c/0/0")
  bundled.store.write(bundled.key, None).result()
  assert "1 of 1 bundle files missing" in _every_read_fails(bundled.path, "a/c/0/0")


def test_a_bundle_of_another_array_is_an_error(bundled):
  other = bundled.store.read("b/c/0/0").result().value  # same shape, sound on its own
  bundled.put(other)
  _every_read_fails(bundled.path, "does not belong here")


def test_a_bundle_shape_that_is_not_whole_chunks_is_refused(tmp_path):
  import json

  from ucp_jax.store._manifest import seal

  ucp_jax.save(tmp_path / "c", {"a": A}, chunk_bytes=64)
  manifest = tmp_path / "c" / "manifest.json"
  data = json.loads(manifest.read_text())
  data["arrays"]["a"]["bundle"] = [3, 8]
  manifest.write_bytes(seal(data))
  with pytest.raises(ucp_jax.ManifestError, match=r"bundle \[3, 8\] is not a whole number"):
    ucp_jax.open(tmp_path / "c")


def test_version_2_checkpoints_a_file_per_chunk_are_read(tmp_path):
  import json

  from ucp_jax.store._manifest import seal

  x, a = _sharded()
  ucp_jax.save(tmp_path / "c", {"a": a}, chunk_bytes=512, bundle_bytes=None)
  manifest = tmp_path / "c" / "manifest.json"
  data = json.loads(manifest.read_text())
  data["format_version"] = 2  # what version 2 wrote: the same files and entries
  manifest.write_bytes(seal(data))
  group = json.loads((tmp_path / "c" / "zarr.json").read_text())
  group["attributes"]["ucp_jax"]["format_version"] = 2
  (tmp_path / "c" / "zarr.json").write_text(json.dumps(group))
  ckpt = ucp_jax.open(tmp_path / "c")
  assert ckpt.manifest.format_version == 2 and ckpt["a"].bundle is None
  np.testing.assert_array_equal(ucp_jax.restore(tmp_path / "c")["a"], x)
  assert ckpt.verify() == {}


def test_an_index_entry_half_marked_missing_is_corruption(tmp_path):
  ucp_jax.save(tmp_path / "c", {"a": A, "b": A + 1}, chunk_bytes=64)
  bundled = _Bundle(tmp_path / "c", "a/c/0/0")
  raw = bytearray(bundled.get())
  raw[0] ^= 0xFF  # chunk 0 damaged where a save put it: the read looks it up in the index
  bundled.put(bytes(raw))
  table = bundled.index()
  table[0, 0] = _bundle.MISSING  # its offset "missing", its size kept
  bundled.put_index(table)
  _every_read_fails(tmp_path / "c", "points past the chunks it holds")


def test_a_bundle_shorter_than_its_index_or_larger_than_its_array_is_refused(tmp_path):
  import json

  from ucp_jax.store._manifest import seal

  ucp_jax.save(tmp_path / "c", {"a": A, "b": A + 1}, chunk_bytes=64)
  bundled = _Bundle(tmp_path / "c", "a/c/0/0")
  raw = bytearray(bundled.get())
  raw[0] ^= 0xFF
  bundled.put(bytes(raw[:40]))
  _every_read_fails(tmp_path / "c", "less than its index")
  manifest = tmp_path / "c" / "manifest.json"
  data = json.loads(manifest.read_text())
  data["arrays"]["a"]["bundle"] = [2**37, 8]  # whole chunks, but more than the array
  manifest.write_bytes(seal(data))
  with pytest.raises(ucp_jax.ManifestError, match="larger than the array"):
    ucp_jax.open(tmp_path / "c")


def test_a_failed_bundle_write_closes_its_file(tmp_path, monkeypatch):
  from ucp_jax.store import _chunk_writes as _direct

  real = _direct._encode

  def flaky(block, chunks):
    if block.shape != tuple(chunks):
      raise MemoryError("injected: no memory for the padded edge chunk")
    return real(block, chunks)

  monkeypatch.setattr(_direct, "_encode", flaky)
  monkeypatch.setattr(_direct, "_GROUP_BYTES", 1)  # a task per chunk: the others open the file
  before = set(os.listdir("/proc/self/fd"))
  x = np.arange(10 * 64, dtype=np.float32).reshape(10, 64)  # (4, 64) chunks, the last padded
  with pytest.raises(MemoryError, match="injected"):
    ucp_jax.save(tmp_path / "c", {"x": x}, chunk_bytes=1024)
  leaked = [os.readlink(f"/proc/self/fd/{n}") for n in set(os.listdir("/proc/self/fd")) - before]
  assert not [p for p in leaked if "ucp-tmp" in p], leaked
  assert os.listdir(tmp_path) == []


def test_auto_bundles_are_smaller_on_object_stores(tmp_path):
  """`bundle_bytes="auto"` (the default): 256 MiB on a local disk, 16 MiB on an object store,
  where each bundle is one PUT and more of them keep more streams in flight."""
  x = np.zeros((2048, 4096), np.float32)  # 32 MiB, in 1 MiB chunks
  memory = f"memory://ucp_bundles_{next(_ids)}"
  for path in (tmp_path / "local", memory):
    ucp_jax.save(path, {"x": x}, chunk_bytes=1 << 20)
  assert ucp_jax.open(tmp_path / "local")["x"].bundle == (2048, 4096)
  assert ucp_jax.open(memory)["x"].bundle == (1024, 4096)
  ucp_jax.save(f"{memory}-256", {"x": x}, chunk_bytes=1 << 20, bundle_bytes=_bundle.BUNDLE_BYTES)
  assert ucp_jax.open(f"{memory}-256")["x"].bundle == (2048, 4096)
  safetensors = pytest.importorskip("safetensors.numpy")
  (tmp_path / "hf").mkdir()  # a conversion to an object store bundles the same way
  safetensors.save_file({"x": x}, str(tmp_path / "hf" / "model.safetensors"))
  ucp_jax.convert(tmp_path / "hf", tmp_path / "converted")
  ucp_jax.convert(tmp_path / "hf", f"{memory}-converted")
  on_disk, remote = (
    ucp_jax.open(p)["params/x"] for p in (tmp_path / "converted", f"{memory}-converted")
  )
  assert math.prod(on_disk.bundle) * 4 == 32 << 20
  assert math.prod(remote.bundle) * 4 == 16 << 20
