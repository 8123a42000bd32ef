"""Every kind of bad input: one clear error naming every offending key, and nothing lost."""

import json
import os
import re
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax.store import _commit, _location
from ucp_jax.store._manifest import seal
from ucp_jax.tree import _save


def _sds(shape, dtype=np.float32, spec=None):
  mesh = jax.make_mesh((8,), ("x",))
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or P()))


@pytest.fixture
def ckpt(tmp_path):
  path = tmp_path / "ckpt"
  ucp_jax.save(
    path,
    {"a": np.ones((8, 4), np.float32), "b": {"c": np.zeros(3, np.int32), "d": np.ones(2)}},
    step=1,
  )
  return path


def test_error_hierarchy():
  for cls in (
    ucp_jax.CheckpointNotFoundError,
    ucp_jax.CheckpointExistsError,
    ucp_jax.ConcurrentWriteError,
    ucp_jax.ManifestError,
    ucp_jax.CorruptCheckpointError,
    ucp_jax.TreeMismatchError,
    ucp_jax.ShapeMismatchError,
    ucp_jax.DtypeMismatchError,
    ucp_jax.ShardingError,
    ucp_jax.UnsupportedLeafError,
  ):
    assert issubclass(cls, ucp_jax.UcpError)
  assert issubclass(ucp_jax.CheckpointNotFoundError, FileNotFoundError)
  assert issubclass(ucp_jax.ShapeMismatchError, ValueError)


def test_missing_checkpoint(tmp_path):
  with pytest.raises(ucp_jax.CheckpointNotFoundError, match=r"nope: no such file or directory$"):
    ucp_jax.open(tmp_path / "nope")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ucp_jax.CheckpointNotFoundError, match=r"manifest\.json is missing"):
    ucp_jax.restore(tmp_path / "empty")


def test_tree_mismatch_lists_every_key(ckpt):
  target = {"a": _sds((8, 4)), "b": {"c": np.zeros(3, np.int32)}, "x": _sds((1,)), "y": 0}
  with pytest.raises(ucp_jax.TreeMismatchError) as e:
    ucp_jax.restore(ckpt, target)
  assert str(e.value) == (
    f"{ckpt}: target and checkpoint keys differ:\n"
    "  x: in target, not in checkpoint\n"
    "  y: in target, not in checkpoint\n"
    "  b/d: in checkpoint, not in target (pass partial=True to skip)"
  )


def test_shape_mismatch_lists_every_key(ckpt):
  target = {"a": _sds((4, 8)), "b": {"c": np.zeros(4, np.int32), "d": np.ones(2)}}
  with pytest.raises(ucp_jax.ShapeMismatchError) as e:
    ucp_jax.restore(ckpt, target)
  assert str(e.value) == (
    f"{ckpt}: shapes differ:\n"
    "  a: shape (4, 8) in target, (8, 4) in checkpoint\n"
    "  b/c: shape (4,) in target, (3,) in checkpoint"
  )


def test_dtype_mismatch_without_cast(ckpt):
  target = {"a": _sds((8, 4), jnp.bfloat16), "b": {"c": np.zeros(3, np.int8), "d": np.ones(2)}}
  with pytest.raises(ucp_jax.DtypeMismatchError) as e:
    ucp_jax.restore(ckpt, target)
  assert "a: bfloat16 in target, float32 in checkpoint" in str(e.value)
  assert "b/c: int8 in target, int32 in checkpoint" in str(e.value)
  key_dtype = jax.random.key(0).dtype
  with pytest.raises(ucp_jax.DtypeMismatchError, match=r"b/d: key<fry> in target, float64 in"):
    ucp_jax.restore(ckpt, {"b": {"d": _sds((2,), key_dtype)}}, partial=True)


def test_sharding_that_does_not_fit(tmp_path):
  ucp_jax.save(tmp_path / "c", {"odd": np.ones(10), "vec": np.ones(8)})
  mesh = jax.make_mesh((8,), ("x",))
  target = {"odd": _sds((10,), np.float64, P("x")), "vec": NamedSharding(mesh, P(None, "x"))}
  with pytest.raises(ucp_jax.ShardingError) as e:
    ucp_jax.restore(tmp_path / "c", target, cast=True)
  assert "odd: " in str(e.value) and "10 into 8 uneven parts" in str(e.value)
  assert "vec: " in str(e.value) and "2 dimensions, the array 1" in str(e.value)


def test_corrupted_chunk_is_caught(ckpt):
  chunk = next(p for p in (ckpt / "a" / "c").rglob("*") if p.is_file())
  raw = bytearray(chunk.read_bytes())
  raw[5] ^= 0xFF
  chunk.write_bytes(bytes(raw))
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=r"a/c/0/0: `a`: checksum mismatch"):
    ucp_jax.restore(ckpt)
  sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=r"a/c/0/0: `a`: checksum mismatch"):
    ucp_jax.restore(ckpt, {"a": sharding}, partial=True)
  problems = ucp_jax.open(ckpt).verify()
  assert list(problems) == ["a"] and "checksum mismatch" in problems["a"]


def test_missing_or_short_chunk_is_caught(ckpt):
  chunk = next(p for p in (ckpt / "b" / "c" / "c").rglob("*") if p.is_file())
  chunk.unlink()
  assert ucp_jax.open(ckpt).verify() == {"b/c": f"1 of 1 chunks missing: {chunk}"}
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=r"b/c/c/0: `b/c`: chunk file missing"):
    ucp_jax.restore(ckpt)
  chunk.write_bytes(b"abc")
  with pytest.raises(
    ucp_jax.CorruptCheckpointError, match=r"`b/c`: chunk file holds 3 bytes, expected 16"
  ):
    ucp_jax.restore(ckpt)


def test_bad_chunk_read_into_several_slices_is_caught(ckpt):
  # One (8, 4) chunk feeds 8 devices' rows: it is mapped once and copied out to each.
  target = {"a": NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))}
  restored = ucp_jax.restore(ckpt, target, partial=True)
  np.testing.assert_array_equal(np.asarray(restored["a"]), np.ones((8, 4), np.float32))
  chunk = ckpt / "a" / "c" / "0" / "0"
  raw = chunk.read_bytes()
  chunk.write_bytes(raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:])  # last data byte
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=r"a/c/0/0: `a`: checksum mismatch"):
    ucp_jax.restore(ckpt, target, partial=True)
  chunk.write_bytes(raw[:-1])
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=r"holds 131 bytes, expected 132"):
    ucp_jax.restore(ckpt, target, partial=True)
  chunk.unlink()
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=r"a/c/0/0: `a`: chunk file missing"):
    ucp_jax.restore(ckpt, target, partial=True)


def test_truncated_foreign_and_future_manifests(ckpt):
  manifest = ckpt / "manifest.json"
  good = manifest.read_bytes()
  manifest.write_bytes(good[: len(good) // 2])
  with pytest.raises(ucp_jax.ManifestError, match="not valid JSON"):
    ucp_jax.open(ckpt)
  manifest.write_text(json.dumps({"format": "orbax", "arrays": {}}))
  with pytest.raises(ucp_jax.ManifestError, match="not a ucp_jax manifest"):
    ucp_jax.open(ckpt)
  manifest.write_text(json.dumps({**json.loads(good), "format_version": 99}))
  with pytest.raises(ucp_jax.ManifestError, match="format version 99"):
    ucp_jax.open(ckpt)
  manifest.write_bytes(seal({**json.loads(good), "arrays": {"a": {"shape": [1]}}}))
  with pytest.raises(ucp_jax.ManifestError, match="malformed"):
    ucp_jax.open(ckpt)


def test_an_edited_manifest_is_detected(ckpt):
  manifest = ckpt / "manifest.json"
  good = json.loads(manifest.read_text())
  for edit in ({"step": 7}, {"metadata": {"lr": 1}}, {"tree": {"a": "a"}}):
    manifest.write_text(json.dumps({**good, **edit}, indent=1))
    with pytest.raises(ucp_jax.ManifestError, match="checksum does not match its content"):
      ucp_jax.open(ckpt)


def test_saving_over_existing_needs_overwrite(ckpt, tmp_path):
  with pytest.raises(ucp_jax.CheckpointExistsError, match="overwrite=True"):
    ucp_jax.save(ckpt, {"z": np.zeros(1)})
  assert ucp_jax.open(ckpt).keys() == ["a", "b/c", "b/d"]
  other = tmp_path / "user_files"
  other.mkdir()
  (other / "notes.txt").write_text("keep me")
  with pytest.raises(ucp_jax.CheckpointExistsError, match="not a ucp_jax checkpoint"):
    ucp_jax.save(other, {"z": np.zeros(1)}, overwrite=True)
  assert (other / "notes.txt").read_text() == "keep me"


def test_unsupported_leaves_fail_before_any_io(tmp_path):
  tree = {"ok": np.ones(1), "s": "text", "o": np.array([object()]), "f": lambda: 0}
  with pytest.raises(ucp_jax.UnsupportedLeafError) as e:
    ucp_jax.save(tmp_path / "c", tree)
  assert "f: builtins.function" in str(e.value) and "s: builtins.str" in str(e.value)
  assert "o: numpy.ndarray" in str(e.value)
  assert not os.listdir(tmp_path)
  with pytest.raises(ucp_jax.UcpError, match="JSON-serializable"):
    ucp_jax.save(tmp_path / "c", {"a": np.ones(1)}, metadata={"x": object()})
  assert not os.listdir(tmp_path)


def test_concurrent_writer_is_turned_away(ckpt):
  lock = _commit.Lock(_location.resolve(ckpt), token=1)
  lock.acquire()
  try:
    with pytest.raises(
      ucp_jax.ConcurrentWriteError, match="another save to this path is in progress"
    ):
      ucp_jax.save(ckpt, {"z": np.zeros(1)}, overwrite=True)
  finally:
    lock.release()
  assert ucp_jax.open(ckpt).step == 1


def test_two_threads_saving_one_path(tmp_path):
  big = {f"w{i}": np.random.default_rng(i).standard_normal((256, 256)) for i in range(16)}
  errors, barrier = [], threading.Barrier(2)

  def run(step):
    barrier.wait()
    try:
      ucp_jax.save(tmp_path / "c", big, step=step, overwrite=True)
    except ucp_jax.ConcurrentWriteError as e:
      errors.append(e)

  threads = [threading.Thread(target=run, args=(s,)) for s in (1, 2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  ckpt = ucp_jax.open(tmp_path / "c")
  assert ckpt.step in (1, 2) and len(ckpt.keys()) == 16
  assert len(errors) <= 1  # one may finish before the other starts
  assert ckpt.verify() == {}


def test_failed_save_leaves_previous_checkpoint(ckpt, monkeypatch):
  def boom(self, entries, budget):
    raise OSError("disk full")

  monkeypatch.setattr(_save.Writer, "_write_entries", boom)
  with pytest.raises(OSError, match="disk full"):
    ucp_jax.save(ckpt, {"a": np.zeros((2, 2))}, step=2, overwrite=True)
  assert ucp_jax.open(ckpt).step == 1
  assert sorted(p.name for p in ckpt.parent.iterdir()) == ["ckpt"]


def test_killed_save_leaves_previous_checkpoint_and_next_save_works(ckpt):
  script = textwrap.dedent(
    f"""
    import os, numpy as np, ucp_jax
    from ucp_jax.tree import _save
    real = _save.Writer.commit
    def die(self, manifest):
      os._exit(3)  # the process dies after writing its data, before the commit
    _save.Writer.commit = die
    ucp_jax.save({str(ckpt)!r}, {{"a": np.zeros((64, 64))}}, step=2, overwrite=True)
    """
  )
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 3, proc.stderr
  assert any(p.name.startswith(".ckpt.ucp-tmp-") for p in ckpt.parent.iterdir())
  assert ucp_jax.open(ckpt).step == 1
  np.testing.assert_array_equal(ucp_jax.restore(ckpt)["a"], np.ones((8, 4)))
  ucp_jax.save(ckpt, {"a": np.zeros(2)}, step=3, overwrite=True)  # stale lock and staging cleaned
  assert ucp_jax.open(ckpt).step == 3
  assert sorted(p.name for p in ckpt.parent.iterdir()) == ["ckpt"]


def test_interrupted_first_save_is_not_a_checkpoint(tmp_path, monkeypatch):
  monkeypatch.setattr(
    _save.Writer, "commit", lambda self, m: (_ for _ in ()).throw(KeyboardInterrupt())
  )
  with pytest.raises(KeyboardInterrupt):
    ucp_jax.save(tmp_path / "c", {"a": np.ones(3)})
  with pytest.raises(ucp_jax.CheckpointNotFoundError):
    ucp_jax.open(tmp_path / "c")


def test_restore_does_not_mutate_target(ckpt):
  target = {
    "a": np.full((8, 4), 5, np.float32),
    "b": {"c": np.zeros(3, np.int32), "d": np.zeros(2)},
  }
  ucp_jax.restore(ckpt, target)
  assert (target["a"] == 5).all()


def test_staging_directory_is_not_a_checkpoint(ckpt, tmp_path):
  # A save that died after writing its manifest, before the rename that commits it.
  staging = tmp_path / ".new.ucp-tmp-0123456789abcdef"
  ckpt.rename(staging)
  with pytest.raises(ucp_jax.CheckpointNotFoundError, match=r"staging directory of a save to"):
    ucp_jax.open(staging)
  with pytest.raises(ucp_jax.CheckpointNotFoundError, match="has not committed"):
    ucp_jax.open(tmp_path / "new")
  old = staging.rename(tmp_path / ".new.ucp-tmp-0123456789abcdef.old")
  with pytest.raises(
    ucp_jax.CheckpointNotFoundError, match=re.escape(f"a save to {tmp_path / 'new'}")
  ):
    ucp_jax.restore(old)


def test_malformed_manifest_entries_name_the_key(ckpt):
  manifest = ckpt / "manifest.json"
  good = json.loads(manifest.read_text())
  for edit, problem in (
    ({"dtype": "float33"}, "dtype 'float33' is not one a checkpoint stores"),
    ({"dtype": "object"}, "dtype 'object' is not one a checkpoint stores"),  # pointers
    ({"dtype": "<U2"}, "dtype '<U2' is not one"),
    ({"dtype": "string"}, "dtype 'string' is not one"),  # TensorStore's, not numpy's
    ({"dtype": ["int8"]}, "dtype \\['int8'\\] is not one"),
    ({"shape": [-8, 4]}, "shape \\[-8, 4\\] is not a list of sizes"),
    ({"shape": [2**62, 4]}, "declares more than 2\\*\\*62 bytes"),
    ({"shape": [0, 2**70], "chunks": [1, 2**70]}, "declares more than 2\\*\\*62 bytes"),
    ({"shape": [1] * 100, "chunks": [1] * 100}, "a shape of 100 dimensions \\(at most 32\\)"),
    ({"kind": "scalar", "python_type": "float"}, "a scalar with shape \\[8, 4\\]"),
    ({"chunks": [8]}, "do not fit shape"),
    ({"shape": None}, "TypeError"),
    ({"kind": "pickle"}, "kind 'pickle'"),
    ({"kind": "scalar"}, "a scalar's python_type None"),
    ({"kind": "scalar", "python_type": "os.system"}, "a scalar's python_type 'os.system'"),
    ({"python_type": "int"}, "python_type 'int' on an entry of kind 'array'"),
    ({"kind": "prng_key"}, "prng_impl None on an entry of kind 'prng_key'"),
    ({"role": 7}, "role 7"),
    ({"compression": "gzip"}, "compression 'gzip'"),
  ):
    bad = {**good, "arrays": {**good["arrays"], "a": {**good["arrays"]["a"], **edit}}}
    manifest.write_bytes(seal(bad))
    with pytest.raises(ucp_jax.ManifestError, match=f"malformed manifest entry `a`: .*{problem}"):
      ucp_jax.open(ckpt)
  for edit, problem in (
    ({"source": "deepspeed"}, "\"source\" is 'deepspeed', not an object"),
    ({"metadata": [1]}, '"metadata" is \\[1\\], not an object'),
    ({"step": "7"}, "\"step\" is '7', not an integer or null"),
    ({"step": True}, '"step" is True, not an integer or null'),
    ({"schema": 3}, '"schema" is 3, not an object or null'),
    ({"created": 3}, '"created" is 3, not a string'),
  ):
    manifest.write_bytes(seal({**good, **edit}))
    with pytest.raises(ucp_jax.ManifestError, match=f"malformed manifest: {problem}"):
      ucp_jax.open(ckpt)


def test_missing_array_metadata_is_named_without_tensorstore_spec(ckpt, tmp_path):
  zstd = tmp_path / "zstd"
  ucp_jax.save(zstd, ucp_jax.restore(ckpt), compression="zstd")
  a = ucp_jax.open(zstd).read("a")
  (zstd / "a" / "zarr.json").unlink()
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=r"`a`: cannot open stored array") as e:
    ucp_jax.open(zstd).read("a")
  assert "tensorstore_spec" not in str(e.value) and len(str(e.value).splitlines()) == 1
  assert f'"{zstd}/a/zarr.json" does not exist' in str(e.value)  # the path as the user named it
  (ckpt / "a" / "zarr.json").unlink()  # raw chunks read without it, checked by the manifest
  np.testing.assert_array_equal(ucp_jax.open(ckpt).read("a"), a)
  problems = ucp_jax.open(ckpt).verify()
  assert list(problems) == ["a"] and "zarr.json" in problems["a"]
  assert "tensorstore_spec" not in problems["a"]


def test_paths_that_cannot_hold_a_checkpoint(tmp_path):
  (tmp_path / "f").write_text("x")
  with pytest.raises(
    ucp_jax.CheckpointNotFoundError, match="a file that is no checkpoint ucp_jax reads"
  ):
    ucp_jax.open(tmp_path / "f")
  with pytest.raises(ucp_jax.CheckpointExistsError, match=r"f is a file, not a directory"):
    ucp_jax.save(tmp_path / "f" / "sub" / "c", {"a": np.ones(1)})
  assert sorted(os.listdir(tmp_path)) == ["f"]
  with pytest.raises(ValueError, match="names no bucket"):
    ucp_jax.open("gs://")
  with pytest.raises(ucp_jax.CheckpointNotFoundError, match="lives only in the process"):
    ucp_jax.open("memory://ucp_test_never_saved")
  # The root of the memory store: other tests' checkpoints live there, so a save is refused
  # unless the root holds a checkpoint already (its own data is never deleted).
  try:
    ucp_jax.save("memory://", {"a": np.ones(2)}, overwrite=True)
  except ucp_jax.CheckpointExistsError as e:
    assert "holds other data" in str(e)
  else:
    assert str(ucp_jax.open("memory://").location) == "memory://"


def test_universal_folder_of_a_model_parallel_run_is_refused(tmp_path):
  # Its zero/ files hold merged tensors while each rank's model states list only that
  # rank's (or pipeline stage's) parameters: reading rank 0's would drop the others.
  src = os.path.join(os.path.dirname(__file__), "fixtures", "tp", "pp2", "universal")
  with pytest.raises(ucp_jax.SourceFormatError, match=r"model-parallel .*mp_rank_01"):
    ucp_jax.convert(src, tmp_path / "out")
  assert not os.listdir(tmp_path)


def test_a_key_or_region_that_is_not_there_is_a_ucp_error(ckpt):
  opened = ucp_jax.open(ckpt)
  with pytest.raises(ucp_jax.ArrayNotFoundError) as e:
    opened["b/cc"]
  assert isinstance(e.value, KeyError) and isinstance(e.value, ucp_jax.UcpError)
  assert str(e.value) == f"{ckpt}: no array 'b/cc' in this checkpoint (did you mean b/c?)"
  with pytest.raises(ucp_jax.RegionError, match=r"`a` of shape \(8, 4\): index .* outside"):
    opened.read("a", np.s_[:, 9])
  with pytest.raises(IndexError):  # still what numpy code catches
    opened.read("a", (0, 0, 0))


def test_a_name_that_is_not_valid_unicode_is_an_invalid_key(tmp_path):
  with pytest.raises(ucp_jax.InvalidKeyError, match=r"name 'a\\ud800' is not valid Unicode"):
    ucp_jax.save(tmp_path / "x", {"a\ud800": np.ones(2)})
  assert not (tmp_path / "x").exists()


def test_a_hostile_file_name_looks_the_same_from_every_reader(tmp_path, capsys):
  """One kit shows foreign names in messages: a terminal escape and a newline in a file name
  come out escaped, the same from the sniffing of every source and from one source's own."""
  from ucp_jax import cli

  folder = tmp_path / "odd"
  folder.mkdir()
  hostile = "x\x1b[2J\nname"
  (folder / hostile).write_text("")
  expected = repr(hostile)
  for extra in ([], ["--from", "deepspeed"]):
    assert cli.main(["convert", str(folder), str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err
    assert f"Found: {expected}" in err or f"found: {expected}" in err.lower(), err
    assert "\x1b" not in err and len(err.strip().splitlines()) == 1, err
