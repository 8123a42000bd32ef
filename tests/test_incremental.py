"""Incremental saves on a local disk: `save(path, tree, base=earlier)` writes only what changed,
and every step stays complete on its own (hard links; deleting any step breaks no other)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax import cli
from ucp_jax.store import _reuse
from ucp_jax.tree import _device_arrays as _shards


def _frozen(devices) -> dict:
  mesh = jax.make_mesh((8,), ("d",), devices=devices)
  sharding = NamedSharding(mesh, P("d"))
  return {
    f"w{i}": jax.device_put(jnp.arange(64 * 256, dtype=jnp.float32).reshape(64, 256) + i, sharding)
    for i in range(3)
  }


def _state(frozen: dict, step: int) -> dict:
  return {"frozen": frozen, "adapter": jnp.full((16, 8), float(step)), "step": step}


def _files(path: Path) -> dict[str, int]:
  """Every file of a checkpoint, by path relative to it: its inode."""
  return {str(p.relative_to(path)): p.stat().st_ino for p in path.rglob("*") if p.is_file()}


def _shared_arrays(a: Path, b: Path) -> set[str]:
  """The arrays whose chunk files two checkpoints share (the same inodes)."""
  fa, fb = _files(a), _files(b)
  return {k.split("/c/")[0] for k in fa if "/c/" in k and fb.get(k) == fa[k]}


def _assert_holds(path: Path, frozen: dict, step: int) -> None:
  assert ucp_jax.open(path).verify() == {}
  out = ucp_jax.restore(path)
  for key, value in frozen.items():
    np.testing.assert_array_equal(out["frozen"][key], np.asarray(value))
  np.testing.assert_array_equal(out["adapter"], np.full((16, 8), float(step)))
  assert out["step"] == step


def test_each_step_takes_the_unchanged_arrays_and_restores_alone(tmp_path, devices):
  frozen = _frozen(devices)
  for step in range(1, 6):
    base = tmp_path / str(step - 1) if step > 1 else None
    ucp_jax.save(tmp_path / str(step), _state(frozen, step), step=step, base=base)
  assert _shared_arrays(tmp_path / "4", tmp_path / "5") == {"frozen/w0", "frozen/w1", "frozen/w2"}
  assert _shared_arrays(tmp_path / "1", tmp_path / "5") == {"frozen/w0", "frozen/w1", "frozen/w2"}
  for step in range(1, 5):  # older steps deleted, oldest first
    shutil.rmtree(tmp_path / str(step))
    _assert_holds(tmp_path / "5", frozen, 5)
  assert sorted(os.listdir(tmp_path)) == ["5"]


def test_any_step_alone_after_the_others_are_deleted(tmp_path, devices):
  frozen = _frozen(devices)
  for step in range(1, 4):
    base = tmp_path / "a" / str(step - 1) if step > 1 else None
    ucp_jax.save(tmp_path / "a" / str(step), _state(frozen, step), base=base)
  for survivor in (1, 2, 3):
    copy = tmp_path / f"copy{survivor}"
    shutil.copytree(tmp_path / "a", copy, copy_function=os.link)  # links: the same files
    for step in range(1, 4):
      if step != survivor:
        shutil.rmtree(copy / str(step))
    _assert_holds(copy / str(survivor), frozen, survivor)


def test_every_reader_works_on_an_incremental_checkpoint_alone(tmp_path, devices, capsys):
  frozen = _frozen(devices)
  ucp_jax.save(tmp_path / "1", _state(frozen, 1))
  ucp_jax.save(tmp_path / "2", _state(frozen, 2), base=tmp_path / "1")
  shutil.rmtree(tmp_path / "1")
  path = tmp_path / "2"
  ckpt = ucp_jax.open(path)
  np.testing.assert_array_equal(ckpt.read("frozen/w2", np.s_[3:5]), np.asarray(frozen["w2"])[3:5])
  assert cli.main(["inspect", str(path)]) == 0
  assert "frozen/w1" in capsys.readouterr().out
  assert cli.main(["verify", str(path)]) == 0
  report = ucp_jax.export(path, tmp_path / "orbax", format="orbax")
  assert report is not None
  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as checkpointer:
    exported = checkpointer.restore(tmp_path / "orbax")
  np.testing.assert_array_equal(exported["frozen"]["w0"], np.asarray(frozen["w0"]))
  assert ucp_jax.diff(path, path).identical


def test_an_array_replaced_with_new_values_is_written(tmp_path, devices):
  frozen = _frozen(devices)
  mutable = np.arange(12.0)
  ucp_jax.save(tmp_path / "1", {"frozen": frozen, "numpy": mutable})
  mutable += 1  # a numpy array changes in place: never taken as unchanged
  replaced = {**frozen, "w1": frozen["w1"] + 0}  # equal values, another object: written
  changed = {**replaced, "w2": frozen["w2"] * 2}
  ucp_jax.save(tmp_path / "2", {"frozen": changed, "numpy": mutable}, base=tmp_path / "1")
  assert _shared_arrays(tmp_path / "1", tmp_path / "2") == {"frozen/w0"}
  shutil.rmtree(tmp_path / "1")
  out = ucp_jax.restore(tmp_path / "2")
  np.testing.assert_array_equal(out["numpy"], np.arange(12.0) + 1)
  np.testing.assert_array_equal(out["frozen"]["w2"], np.asarray(frozen["w2"]) * 2)
  np.testing.assert_array_equal(out["frozen"]["w1"], np.asarray(frozen["w1"]))


def test_sha256_takes_equal_arrays_whatever_objects_hold_them(tmp_path):
  weights = {f"w{i}": np.full((64, 64), i, np.float32) for i in range(3)}
  ucp_jax.save(tmp_path / "1", {"w": weights}, unchanged="sha256", chunk_bytes=4096)
  assert ucp_jax.open(tmp_path / "1")["w/w0"].hashes.shape == (4, 1, 32)
  again = {k: v.copy() for k, v in weights.items()}  # new objects, equal values
  again["w2"][63, 63] = 7  # one element of one chunk
  ucp_jax.save(
    tmp_path / "2", {"w": again}, base=tmp_path / "1", unchanged="sha256", chunk_bytes=4096
  )
  assert _shared_arrays(tmp_path / "1", tmp_path / "2") == {"w/w0", "w/w1"}
  assert ucp_jax.open(tmp_path / "2")["w/w0"].hashes is not None  # carried on for the next save
  # identity alone does not compare values: everything is written
  ucp_jax.save(tmp_path / "3", {"w": {k: v.copy() for k, v in again.items()}}, base=tmp_path / "2")
  assert _shared_arrays(tmp_path / "2", tmp_path / "3") == set()
  shutil.rmtree(tmp_path / "1")
  np.testing.assert_array_equal(ucp_jax.restore(tmp_path / "2")["w"]["w2"], again["w2"])


@pytest.mark.parametrize(
  "change",
  [
    {"chunk_bytes": 4096},  # another chunk grid
    {"compression": "zstd"},
    {"bundle_bytes": None},  # a file per chunk instead of bundles
    {"dtype": jnp.bfloat16},
  ],
)
def test_a_base_stored_another_way_is_not_reused(tmp_path, devices, change):
  mesh = jax.make_mesh((8,), ("d",), devices=devices)
  w = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P("d")))
  ucp_jax.save(tmp_path / "1", {"w": w}, chunk_bytes=2048)  # 4 chunks per shard, bundled
  options = {k: v for k, v in change.items() if k != "dtype"}
  options.setdefault("chunk_bytes", 2048)
  if "dtype" in change:  # the base holds another dtype under the same key
    ucp_jax.save(tmp_path / "0", {"w": w.astype(change["dtype"])}, chunk_bytes=2048)
    ucp_jax.save(tmp_path / "2", {"w": w}, base=tmp_path / "0", **options)
  else:
    ucp_jax.save(tmp_path / "2", {"w": w}, base=tmp_path / "1", **options)
  assert _shared_arrays(tmp_path / "1", tmp_path / "2") == set()
  assert ucp_jax.open(tmp_path / "2").verify() == {}
  np.testing.assert_array_equal(ucp_jax.restore(tmp_path / "2")["w"], np.ones((64, 256)))


def test_a_base_changed_underneath_is_detected(tmp_path, devices):
  frozen = _frozen(devices)
  ucp_jax.save(tmp_path / "1", _state(frozen, 1))
  ucp_jax.save(tmp_path / "2", _state(frozen, 2), base=tmp_path / "1")
  shared = tmp_path / "1" / "frozen" / "w1" / "c" / "0" / "0"  # the array's one bundle
  with open(shared, "r+b") as f:  # in place: the file both checkpoints hold
    f.seek(8196 * 3 + 100)
    f.write(b"\xff\xff\xff\xff")
  problems = ucp_jax.open(tmp_path / "2").verify()
  assert list(problems) == ["frozen/w1"] and "checksum mismatch" in problems["frozen/w1"]
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=r"frozen/w1/c/0/0 \(chunk 3/0\)"):
    ucp_jax.open(tmp_path / "2").read("frozen/w1")
  with pytest.raises(ucp_jax.CorruptCheckpointError):
    ucp_jax.restore(tmp_path / "2")
  # a base file replaced by another (a new inode) leaves the newer step alone
  other = tmp_path / "1" / "frozen" / "w0" / "c" / "0" / "0"
  data = other.read_bytes()
  other.unlink()
  other.write_bytes(data[::-1])
  assert "frozen/w0" not in ucp_jax.open(tmp_path / "2").verify()


def test_overwriting_the_base_path_keeps_what_the_new_one_takes(tmp_path, devices):
  frozen = _frozen(devices)
  path = tmp_path / "ckpt"
  ucp_jax.save(path, _state(frozen, 1))
  for step in (2, 3, 4):
    before = _files(path)
    ucp_jax.save(path, _state(frozen, step), base=path, overwrite=True)
    after = _files(path)
    assert all(after[k] == before[k] for k in before if k.startswith("frozen/") and "/c/" in k)
    _assert_holds(path, frozen, step)
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_save_async_takes_no_copy_of_unchanged_arrays(tmp_path, devices, monkeypatch):
  frozen = _frozen(devices)
  ucp_jax.save(tmp_path / "1", _state(frozen, 1))
  copied = []
  start = _shards.start_host_copy
  monkeypatch.setattr(_shards, "start_host_copy", lambda d: copied.append(d.shape) or start(d))
  handle = ucp_jax.save_async(tmp_path / "2", _state(frozen, 2), base=tmp_path / "1")
  assert copied == [(16, 8)]  # the adapter's one shard; none of the frozen arrays'
  handle.result()
  assert _shared_arrays(tmp_path / "1", tmp_path / "2") == set(f"frozen/{k}" for k in frozen)
  shutil.rmtree(tmp_path / "1")
  _assert_holds(tmp_path / "2", frozen, 2)


def test_restored_arrays_are_known_unchanged(tmp_path, devices):
  frozen = _frozen(devices)
  ucp_jax.save(tmp_path / "1", _state(frozen, 1))
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), frozen
  )
  restored = ucp_jax.restore(tmp_path / "1", {"frozen": target}, partial=True)["frozen"]
  ucp_jax.save(tmp_path / "2", _state(restored, 2), base=tmp_path / "1")
  assert _shared_arrays(tmp_path / "1", tmp_path / "2") == set(f"frozen/{k}" for k in frozen)
  cast = ucp_jax.restore(  # values converted: not what the checkpoint holds
    tmp_path / "1",
    {
      "frozen": {
        k: jax.ShapeDtypeStruct(v.shape, jnp.bfloat16, sharding=v.sharding)
        for k, v in target.items()
      }
    },
    partial=True,
    cast=True,
  )["frozen"]
  ucp_jax.save(tmp_path / "3", _state(cast, 3), base=tmp_path / "1")
  assert _shared_arrays(tmp_path / "1", tmp_path / "3") == set()


def test_a_base_on_another_file_system_is_copied(tmp_path, devices, monkeypatch):
  frozen = _frozen(devices)
  ucp_jax.save(tmp_path / "1", _state(frozen, 1))
  link = os.link

  def cross_device(src, dst, **kwargs):
    if "frozen/w1" in str(src):
      raise OSError(errno.EXDEV, "Invalid cross-device link")
    return link(src, dst, **kwargs)

  monkeypatch.setattr(os, "link", cross_device)
  ucp_jax.save(tmp_path / "2", _state(frozen, 2), base=tmp_path / "1")
  assert _shared_arrays(tmp_path / "1", tmp_path / "2") == {"frozen/w0", "frozen/w2"}
  shutil.rmtree(tmp_path / "1")
  _assert_holds(tmp_path / "2", frozen, 2)


@pytest.mark.parametrize(
  ("options", "lost", "fifo"),
  [
    ({}, "c/0/0", "c/0/0"),  # an array's one bundle (its 8 shards): written whole instead
    ({"bundle_bytes": None}, "c/5/0", "c/2/0"),  # a file per chunk: only the lost ones
  ],
)
def test_a_region_the_base_lost_is_written_from_memory(tmp_path, devices, options, lost, fifo):
  frozen = _frozen(devices)
  ucp_jax.save(tmp_path / "1", _state(frozen, 1), **options)
  (tmp_path / "1" / "frozen" / "w2" / lost).unlink()
  os.mkfifo(tmp_path / "1" / "frozen" / "w1" / f"{fifo}.tmp")
  (tmp_path / "1" / "frozen" / "w1" / fifo).unlink()
  os.rename(
    tmp_path / "1" / "frozen" / "w1" / f"{fifo}.tmp", tmp_path / "1" / "frozen" / "w1" / fifo
  )
  base = _files(tmp_path / "1")
  ucp_jax.save(tmp_path / "2", _state(frozen, 2), base=tmp_path / "1", **options)
  files = _files(tmp_path / "2")
  shared = {k for k, inode in files.items() if base.get(k) == inode}
  frozen_files = {k for k in files if k.startswith("frozen/") and "/c/" in k}
  assert frozen_files - shared == {f"frozen/w2/{lost}", f"frozen/w1/{fifo}"}
  _assert_holds(tmp_path / "2", frozen, 2)
  # save_async holds no copy of an unchanged array: it says so, and commits nothing
  handle = ucp_jax.save_async(tmp_path / "3", _state(frozen, 3), base=tmp_path / "1", **options)
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=r"missing from the base|FIFO"):
    handle.result()
  assert not (tmp_path / "3").exists()


def test_links_from_a_durable_base_need_no_fsync(tmp_path, devices, monkeypatch):
  frozen = _frozen(devices)
  ucp_jax.save(tmp_path / "durable", _state(frozen, 1))
  ucp_jax.save(tmp_path / "quick", _state(frozen, 1), durable=False)
  synced = []
  real = os.fsync

  def fsync(fd):
    if stat.S_ISREG(os.fstat(fd).st_mode):  # files, not the folders every durable save syncs
      synced.append(os.readlink(f"/proc/self/fd/{fd}"))
    return real(fd)

  monkeypatch.setattr(os, "fsync", fsync)
  ucp_jax.save(tmp_path / "a", _state(frozen, 2), base=tmp_path / "durable")
  assert not [p for p in synced if "/frozen/" in p and "/c/" in p]
  synced.clear()
  ucp_jax.save(tmp_path / "b", _state(frozen, 2), base=tmp_path / "quick")
  linked = {p for p in synced if "/frozen/" in p and "/c/" in p}
  assert len(linked) == 3  # 3 arrays of one bundle each, each linked file made durable
  manifest = ucp_jax.open(tmp_path / "b").manifest
  assert manifest.durable is True and len(manifest.token) == 16 and manifest.format_version == 3
  assert ucp_jax.open(tmp_path / "quick").manifest.durable is False


def test_bad_bases_and_modes_are_refused(tmp_path, devices):
  import safetensors.numpy

  state = {"w": np.ones(3)}
  with pytest.raises(ucp_jax.InvalidArgumentError, match="unchanged='md5'"):
    ucp_jax.save(tmp_path / "a", state, unchanged="md5")
  with pytest.raises(ucp_jax.CheckpointNotFoundError):
    ucp_jax.save(tmp_path / "a", state, base=tmp_path / "missing")
  (tmp_path / "hf").mkdir()
  safetensors.numpy.save_file(
    {"w": np.ones(3, np.float32)}, str(tmp_path / "hf" / "model.safetensors")
  )
  with pytest.raises(ucp_jax.InvalidArgumentError, match="not a ucp_jax checkpoint"):
    ucp_jax.save(tmp_path / "a", state, base=tmp_path / "hf")
  assert not (tmp_path / "a").exists()
  ucp_jax.save("memory://incremental_bad/x", state)
  ucp_jax.save(tmp_path / "b", state, base="memory://incremental_bad/x")  # not reachable: written
  assert ucp_jax.open(tmp_path / "b").verify() == {}


def test_the_linker_never_writes_into_a_shared_file(tmp_path):
  base = tmp_path / "base"
  (base / "k" / "c").mkdir(parents=True)
  (base / "k" / "c" / "0").write_bytes(b"base")
  from ucp_jax.store import _location, _manifest

  info = _manifest.ArrayInfo(shape=(4,), dtype="uint8", chunks=(4,))
  linker = _reuse.Linker(
    _location.resolve(base), str(tmp_path / "new"), base_durable=True, durable=False
  )
  linker.start("k", info, [(slice(0, 4),)]).result()
  assert (tmp_path / "new" / "k" / "c" / "0").stat().st_ino == (
    base / "k" / "c" / "0"
  ).stat().st_ino
  linker.discard("k", info, [(slice(0, 4),)])  # before the region is written instead
  assert not (tmp_path / "new" / "k" / "c" / "0").exists()
  assert (base / "k" / "c" / "0").read_bytes() == b"base"


def test_array_metadata_written_without_tensorstore_is_what_tensorstore_writes(tmp_path):
  import tensorstore as ts

  from ucp_jax.store import _location, _zarr

  tree = {
    "f": np.ones((8, 6), np.float32),
    "b": np.ones((64, 64), jnp.bfloat16),  # bundled below
    "i": np.arange(5, dtype=np.int8),
    "s": 3,
  }
  for name in ("one", "two"):  # the second save writes what the first learned
    ucp_jax.save(tmp_path / name, tree, chunk_bytes=1024)
  for key in ("f", "b", "i", "s"):
    info = ucp_jax.open(tmp_path / "two")[key]
    spec = _zarr.array_spec(
      _location.resolve(tmp_path / "ts"),
      key,
      shape=info.shape,
      dtype=np.dtype(info.dtype),
      chunks=info.chunks,
      bundle=info.bundle,
    )
    ts.open(spec, context=_location.context()).result()
    expected = (tmp_path / "ts" / key / "zarr.json").read_bytes()
    assert (tmp_path / "two" / key / "zarr.json").read_bytes() == expected, key
  assert ucp_jax.open(tmp_path / "two")["b"].bundle is not None
  assert ucp_jax.open(tmp_path / "two").verify() == {}


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_bundled_and_compressed_arrays_are_taken_too(tmp_path, devices, compression):
  mesh = jax.make_mesh((8,), ("d",), devices=devices)
  w = jax.device_put(jnp.arange(64 * 256.0).reshape(64, 256), NamedSharding(mesh, P("d")))
  options = {"chunk_bytes": 2048, "compression": compression}  # 4 chunks per shard, bundled
  ucp_jax.save(tmp_path / "1", {"w": w, "a": jnp.ones(3)}, **options)
  assert ucp_jax.open(tmp_path / "1")["w"].bundle is not None
  ucp_jax.save(tmp_path / "2", {"w": w, "a": jnp.zeros(3)}, base=tmp_path / "1", **options)
  assert _shared_arrays(tmp_path / "1", tmp_path / "2") == {"w"}
  shutil.rmtree(tmp_path / "1")
  assert ucp_jax.open(tmp_path / "2").verify() == {}
  np.testing.assert_array_equal(ucp_jax.restore(tmp_path / "2")["w"], np.asarray(w))
