"""Reads return what one save wrote, or raise: never zeros, never another chunk's bytes.

Each case runs on every store path: raw chunks on a local disk (read without
TensorStore), zstd chunks (read through TensorStore) and `memory://` (an object
store), through `restore`, `open().read`, a rule-set view and `verify`.
"""

import errno
import itertools
import json
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax import rules as R
from ucp_jax.store import _location

_ids = itertools.count()
UNBUNDLED = {"chunk_bytes": 64, "bundle_bytes": None}  # a file per (2, 8) chunk
A = np.arange(64, dtype=np.float32).reshape(8, 8)
B = -np.arange(64, dtype=np.float32).reshape(8, 8)


@pytest.fixture(params=["raw", "zstd", "memory"])
def saved(request, tmp_path):
  """A checkpoint of two (8, 8) arrays in (2, 8) chunks, and a way to reach its chunk objects.

  Each chunk is a file of its own here; tests/test_bundles.py damages bundled chunks.
  """
  where = f"memory://ucp_trust_{next(_ids)}" if request.param == "memory" else tmp_path / "c"
  compression = "zstd" if request.param == "zstd" else None
  ucp_jax.save(where, {"a": A, "b": B}, **UNBUNDLED, compression=compression)
  return _Chunks(where)


class _Chunks:
  """The chunk objects of a saved checkpoint, as raw bytes by key."""

  def __init__(self, where):
    self.path = where
    data = ucp_jax.open(where).manifest.data  # "" on disk, this save's generation on memory://
    self.store = _location.kvstore(_location.resolve(where).child(data))

  def get(self, key):
    return self.store.read(key).result().value

  def put(self, key, value):
    self.store.write(key, value).result()

  def delete(self, key):
    self.store.write(key, None).result()


def _every_read_fails(path, error, match):
  """restore, read, a rule-set view and verify all refuse the damaged array `a`."""
  with pytest.raises(error, match=match):
    ucp_jax.restore(path)
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  target = {"a": NamedSharding(mesh, P("x")), "b": NamedSharding(mesh, P("x"))}
  with pytest.raises(error, match=match):
    ucp_jax.restore(path, target)
  with pytest.raises(error, match=match):
    ucp_jax.open(path).read("a")
  view = R.RuleSet([R.Rule(r"a", "t", [R.transpose()])]).view(path, partial=True)
  with pytest.raises(error, match=match):
    view.read("t")
  problems = ucp_jax.open(path).verify()
  assert list(problems) == ["a"], problems
  return problems["a"]


def test_a_missing_chunk_is_an_error_on_every_path(saved):
  saved.delete("a/c/1/0")
  problem = _every_read_fails(saved.path, ucp_jax.CorruptCheckpointError, r"a/c/1/0")
  assert "1 of 4 chunks missing" in problem


def test_swapped_chunks_are_an_error_on_every_path(saved):
  first, second = saved.get("a/c/0/0"), saved.get("a/c/1/0")
  saved.put("a/c/0/0", second)
  saved.put("a/c/1/0", first)
  problem = _every_read_fails(saved.path, ucp_jax.CorruptCheckpointError, r"does not belong here")
  assert "a/c/0/0" in problem or "a/c/1/0" in problem


def test_a_chunk_of_another_array_is_an_error(saved):
  saved.put("a/c/2/0", saved.get("b/c/2/0"))  # same size, valid on its own
  _every_read_fails(saved.path, ucp_jax.CorruptCheckpointError, r"a/c/2/0.*does not belong here")


def test_a_chunk_of_another_save_is_an_error(saved, tmp_path):
  other = (
    f"memory://ucp_trust_other_{next(_ids)}" if "memory" in str(saved.path) else tmp_path / "o"
  )
  compression = ucp_jax.open(saved.path)["a"].compression
  ucp_jax.save(other, {"a": A + 1, "b": B}, **UNBUNDLED, compression=compression)
  saved.put("a/c/3/0", _Chunks(other).get("a/c/3/0"))
  _every_read_fails(saved.path, ucp_jax.CorruptCheckpointError, r"a/c/3/0.*does not belong here")


def test_a_chunk_outside_the_grid_is_reported_by_verify(saved):
  saved.put("a/c/9/0", saved.get("a/c/0/0"))
  np.testing.assert_array_equal(ucp_jax.restore(saved.path)["a"], A)  # reads are unaffected
  problems = ucp_jax.open(saved.path).verify()
  assert list(problems) == ["a"] and "outside the chunk grid" in problems["a"]
  assert "a/c/9/0" in problems["a"]


def test_undamaged_checkpoints_read_back_exactly(saved):
  out = ucp_jax.restore(saved.path)
  np.testing.assert_array_equal(out["a"], A)
  np.testing.assert_array_equal(out["b"], B)
  assert ucp_jax.open(saved.path).verify() == {}


# --- keys ---


def _reseal(path, edit):
  """Rewrites the manifest with `edit` applied and a valid checksum (a crafted manifest)."""
  from ucp_jax.store._manifest import seal

  manifest = os.path.join(path, "manifest.json")
  with open(manifest) as f:
    data = json.load(f)
  edit(data)
  with open(manifest, "wb") as f:
    f.write(seal(data))


@pytest.mark.parametrize(
  "key",
  ["../outside/secret", "/abs", "a//b", ".", "manifest.json", "x/zarr.json", "__x", "a b"],
)
def test_keys_that_leave_the_checkpoint_or_name_its_files_are_refused(tmp_path, key):
  outside = tmp_path / "outside"
  ucp_jax.save(outside, {"secret": np.ones(3)})
  root = tmp_path / "root"
  ucp_jax.save(root, {"a": np.zeros(3)})
  shutil.copytree(outside / "secret", root / "sub" / "secret")

  def edit(data):
    data["arrays"][key] = data["arrays"].pop("a")
    data["tree"] = {"k": key}

  _reseal(root, edit)
  with pytest.raises(ucp_jax.ManifestError, match="cannot name arrays inside the checkpoint"):
    ucp_jax.restore(root)


def test_two_spellings_of_one_leaf_are_refused(tmp_path):
  # `a%41` decodes to the leaf `aA` too: a crafted manifest could offer either for `aA`.
  ucp_jax.save(tmp_path / "c", {"aA": np.zeros(3), "b": np.ones(3)})
  os.rename(tmp_path / "c" / "b", tmp_path / "c" / "a%41")

  def edit(data):
    data["arrays"]["a%41"] = data["arrays"].pop("b")
    data["tree"] = {"aA": "aA", "x": "a%41"}

  _reseal(tmp_path / "c", edit)
  with pytest.raises(ucp_jax.ManifestError, match="'a%41' is not encoded as a save encodes it"):
    ucp_jax.open(tmp_path / "c")


def test_a_key_below_another_array_is_refused(tmp_path):
  ucp_jax.save(tmp_path / "c", {"a": np.zeros(3), "b": np.ones(3)})

  def edit(data):
    data["arrays"]["a/c"] = data["arrays"].pop("b")
    data["tree"] = {"a": "a", "x": "a/c"}

  _reseal(tmp_path / "c", edit)
  with pytest.raises(ucp_jax.ManifestError, match="lies below the array 'a'"):
    ucp_jax.open(tmp_path / "c")


def test_leaf_names_the_store_uses_itself_are_escaped(tmp_path):
  tree = {"manifest.json": np.ones(2), "zarr.json": {"x": np.zeros(1)}, "..": 1, "c": {"c": 2.0}}
  ucp_jax.save(tmp_path / "c", tree)
  assert ucp_jax.open(tmp_path / "c").keys() == [
    "%2E%2E",
    "%6Danifest.json",
    "%7Aarr.json/x",
    "c/c",
  ]
  out = ucp_jax.restore(tmp_path / "c")
  assert out[".."] == 1 and out["c"] == {"c": 2.0}
  np.testing.assert_array_equal(out["manifest.json"], np.ones(2))
  assert ucp_jax.open(tmp_path / "c").verify() == {}


def test_too_long_a_key_is_refused_before_anything_is_written(tmp_path):
  with pytest.raises(ucp_jax.InvalidKeyError, match="path component of 300 characters"):
    ucp_jax.save(tmp_path / "c", {"a" * 300: 1, "b": 2})
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
  ("options", "match"),
  [
    ({"compression": "gzip"}, "compression='gzip': use None"),
    ({"chunk_bytes": 0}, "chunk_bytes=0"),
    ({"chunk_bytes": -1}, "chunk_bytes=-1"),
  ],
)
def test_bad_options_are_refused_before_anything_is_written(tmp_path, options, match):
  for save in (ucp_jax.save, ucp_jax.save_async):
    with pytest.raises(ucp_jax.InvalidArgumentError, match=match):
      save(tmp_path / "c", {"a": np.ones(2)}, **options)
  assert os.listdir(tmp_path) == []


# --- storage failures ---


@pytest.mark.parametrize(
  ("error", "advice"),
  [
    (errno.ENOSPC, "no space left on the device: free some or save elsewhere"),
    (errno.EACCES, "permission denied: check who may write there"),
    (errno.EROFS, "the file system is read-only: save elsewhere"),
  ],
)
def test_a_failing_disk_is_a_storage_error_and_loses_nothing(tmp_path, monkeypatch, error, advice):
  path = tmp_path / "ckpt"
  ucp_jax.save(path, {"a": A})

  def refuse(fd, buffers):
    raise OSError(error, os.strerror(error))

  monkeypatch.setattr(os, "writev", refuse)
  with pytest.raises(ucp_jax.StorageError) as e:
    ucp_jax.save(path, {"a": B}, overwrite=True)
  message = str(e.value)
  assert message.startswith(f"{path}: writing shards: {advice} (")
  assert "/a/c/0" in message and message.endswith("is intact.")
  assert isinstance(e.value, OSError) and e.value.errno == error
  monkeypatch.undo()
  np.testing.assert_array_equal(ucp_jax.restore(path)["a"], A)
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_unreadable_chunk_is_a_storage_error(tmp_path, monkeypatch):
  ucp_jax.save(tmp_path / "ckpt", {"a": A})
  real = os.open

  def failing_open(file, *args, **kwargs):
    if "/c/" in str(file):
      raise PermissionError(errno.EACCES, "Permission denied", str(file))
    return real(file, *args, **kwargs)

  monkeypatch.setattr(os, "open", failing_open)
  with pytest.raises(ucp_jax.StorageError, match=r"ckpt/a/c/0/0: `a`: cannot read the chunk"):
    ucp_jax.restore(tmp_path / "ckpt")


def test_short_writes_and_reads_are_completed(tmp_path, monkeypatch):
  """One writev or read moves at most ~2 GiB on Linux; chunks past that must not be cut."""
  real_writev = os.writev

  def short_writev(fd, buffers):  # as the kernel does past 0x7ffff000 bytes
    first = memoryview(buffers[0]).cast("B")
    return real_writev(fd, [first[: max(1, first.nbytes // 3)]])

  monkeypatch.setattr(os, "writev", short_writev)
  data = np.arange(4096, dtype=np.float32).reshape(64, 64)
  ucp_jax.save(tmp_path / "c", {"w": data}, chunk_bytes=1 << 20)
  monkeypatch.undo()

  real_preadv = os.preadv

  def short_preadv(fd, buffers, offset):  # a read that returns a third of what was asked
    first = memoryview(buffers[0]).cast("B")
    return real_preadv(fd, [first[: max(1, first.nbytes // 3)]], offset)

  monkeypatch.setattr(os, "preadv", short_preadv)
  np.testing.assert_array_equal(ucp_jax.restore(tmp_path / "c")["w"], data)
  assert ucp_jax.open(tmp_path / "c").verify() == {}


# --- review findings: metadata TensorStore decodes by, old manifests, versions ---


@pytest.mark.parametrize("where", ["zstd", "memory"])
def test_an_array_metadata_of_another_dtype_is_refused(tmp_path, where):
  path = str(tmp_path / "c") if where == "zstd" else f"memory://ucp_trust_meta_{next(_ids)}"
  ucp_jax.save(
    path,
    {"f": np.array([1.5, 2.5], np.float32), "i": np.array([3, 4], np.int32)},
    compression="zstd" if where == "zstd" else None,
  )
  chunks = _Chunks(path)
  chunks.put("f/zarr.json", chunks.get("i/zarr.json"))  # TensorStore would decode float as int
  with pytest.raises(ucp_jax.CorruptCheckpointError, match="zarr metadata says"):
    ucp_jax.open(path).read("f")
  assert "zarr metadata says" in ucp_jax.open(path).verify()["f"]


def _as_version_1(path, *, drop_compression: bool) -> None:
  """Rewrites a checkpoint's manifest and root group as format version 1 wrote them."""
  manifest = os.path.join(path, "manifest.json")
  with open(manifest) as f:
    data = json.load(f)
  data.pop("checksum")
  data["format_version"] = 1
  for entry in data["arrays"].values():
    entry.pop("chunk_crc32c")
    if drop_compression:
      entry.pop("compression", None)
  with open(manifest, "w") as f:
    json.dump(data, f)
  root = os.path.join(path, "zarr.json")
  with open(root) as f:
    group = json.load(f)
  group["attributes"]["ucp_jax"]["format_version"] = 1
  with open(root, "w") as f:
    json.dump(group, f)


def test_version_1_zstd_checkpoints_are_read(tmp_path):
  ucp_jax.save(tmp_path / "c", {"a": A}, compression="zstd", chunk_bytes=64)
  _as_version_1(tmp_path / "c", drop_compression=True)  # version 1 did not record it
  np.testing.assert_array_equal(ucp_jax.open(tmp_path / "c").read("a"), A)
  assert ucp_jax.open(tmp_path / "c").verify() == {}


def test_a_manifest_edited_down_to_version_1_is_refused(tmp_path):
  ucp_jax.save(tmp_path / "c", {"a": A}, chunk_bytes=64)
  manifest = tmp_path / "c" / "manifest.json"
  data = json.loads(manifest.read_text())
  data["format_version"] = 1  # checksums left in: plainly a version 2 manifest
  manifest.write_text(json.dumps(data))
  with pytest.raises(ucp_jax.ManifestError, match="version 2 manifest marked version 1"):
    ucp_jax.open(tmp_path / "c")
  ucp_jax.save(tmp_path / "d", {"a": A}, chunk_bytes=64)
  data = json.loads((tmp_path / "d" / "manifest.json").read_text())
  data.pop("checksum")
  data["format_version"] = 1
  for entry in data["arrays"].values():
    entry.pop("chunk_crc32c")
  (tmp_path / "d" / "manifest.json").write_text(json.dumps(data))  # the root group says 2
  with pytest.raises(ucp_jax.ManifestError, match=r"whose zarr\.json says version 2"):
    ucp_jax.open(tmp_path / "d")


def test_a_missing_chunk_of_a_kvstore_spec_checkpoint_is_corruption_not_a_replacement(tmp_path):
  spec = {"driver": "file", "path": str(tmp_path / "s")}
  ucp_jax.save(spec, {"a": A}, **UNBUNDLED)
  data = ucp_jax.open(spec).manifest.data
  os.remove(tmp_path / "s" / data / "a" / "c" / "1" / "0")
  with pytest.raises(ucp_jax.CorruptCheckpointError, match="a/c/1/0"):
    ucp_jax.open(spec).read("a")
