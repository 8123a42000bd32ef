"""ucp_jax's own checkpoints, tampered with as a hostile user would, through every entry point.

Each case starts from a real save and edits it: metadata documents too deep for any parser
(TensorStore's recurses on the C stack), manifests whose fields have the wrong types or
declare impossible or huge sizes, FIFOs and links where files belong. Every entry point must
answer with one line naming the file, in bounded time and memory (`hostile_run`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hostile_run as hr
import numpy as np
import pytest

import ucp_jax
from ucp_jax.store import _location
from ucp_jax.store._manifest import seal

ENTRIES = tuple(e for e in hr.ENTRY_POINTS if e != "convert")  # nothing to convert: ours
A = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
DEEP = "[" * 100_000 + "]" * 100_000  # SIGSEGV in TensorStore's parser, RecursionError in json


def _save(folder: Path, **options) -> Path:
  path = folder / "ckpt"
  ucp_jax.save(path, {"a": A, "step": 3}, **options)
  return path


def _edited(edit):
  """A case maker: a save whose sealed manifest `edit(manifest_dict)` changes."""

  def make(folder: Path) -> Path:
    path = _save(folder)
    manifest = path / "manifest.json"
    data = json.loads(manifest.read_text())
    edit(data)
    manifest.write_bytes(seal(data))
    return path

  return make


def _raw_manifest(text_of):
  """A case maker: a save whose manifest file is replaced by `text_of(old_text)`."""

  def make(folder: Path) -> Path:
    path = _save(folder)
    manifest = path / "manifest.json"
    manifest.write_text(text_of(manifest.read_text()))
    return path

  return make


def _replaced(relative: str, how: str, **options):
  """A case maker: a save whose file `relative` is replaced by a FIFO, a link or a document."""

  def make(folder: Path) -> Path:
    path = _save(folder, **options)
    target = path / relative
    assert target.exists(), sorted(os.listdir(path / "a"))
    if how == "deep":
      target.write_text(DEEP)
      return path
    original = target.read_bytes()
    target.unlink()
    if how == "fifo":
      os.mkfifo(target)
    elif how == "link out":
      outside = folder / "outside"
      outside.write_bytes(original)  # even the right bytes may not be read through a link
      target.symlink_to(outside)
    elif how == "link in":
      (path / "kept").write_bytes(original)
      target.symlink_to(path / "kept")
    elif how == "dev zero":
      target.symlink_to("/dev/zero")
    elif how == "directory":
      target.mkdir()
    return path

  return make


def _huge(shape, chunks):
  def edit(data):
    entry = data["arrays"]["a"]
    count = np.prod([-(-s // c) for s, c in zip(shape, chunks)], dtype=object)
    count = count if count < 1 << 20 else 1  # refused before the table is read
    entry.update(shape=shape, chunks=chunks, chunk_crc32c=_crcs(count))
    entry.pop("bundle", None)

  return _edited(edit)


def _crcs(count: int) -> str:
  import base64

  return base64.b64encode(np.zeros(count, "<u4").tobytes()).decode()


def _set(**fields):
  return _edited(lambda data: data.update(fields))


def _set_entry(**fields):
  return _edited(lambda data: data["arrays"]["a"].update(fields))


def _pooled_at(up: str):
  def edit(data):
    data.update(format_version=4, pool=up + ".ucp-pool/")
    for entry in data["arrays"].values():
      entry["at"] = "g0000000000000000/"

  return edit


_pooled = _pooled_at("../")

MANIFEST = "ckpt/manifest.json"
CHUNK = "ckpt/a/c/0/0"
READS_CHUNKS = {"inspect": "ok"}  # listing needs the manifest only
CASES = [
  hr.Case("a sound checkpoint", _save, default="ok"),
  # metadata documents
  hr.Case("deep manifest", _raw_manifest(lambda t: t[:-2] + ', "x": ' + DEEP + "}"), MANIFEST),
  hr.Case(
    "manifest 200 deep",
    _raw_manifest(lambda t: t[:-2] + ', "x": ' + "[" * 200 + "]" * 200 + "}"),
    MANIFEST,
    pattern="nested 20[0-9] levels deep",
  ),
  hr.Case("manifest with NaN", _raw_manifest(lambda t: t[:-2] + ', "x": NaN}'), MANIFEST),
  hr.Case("manifest truncated", _raw_manifest(lambda t: t[: len(t) // 2]), MANIFEST),
  hr.Case("source not an object", _set(source="deepspeed"), MANIFEST, pattern='"source"'),
  hr.Case("metadata a list", _set(metadata=[1, 2]), MANIFEST, pattern='"metadata"'),
  hr.Case("step a string", _set(step="3"), MANIFEST, pattern='"step"'),
  hr.Case("arrays a list", _set(arrays=[]), MANIFEST, pattern='"arrays"'),
  hr.Case(
    "a scalar with a shape",
    _set_entry(kind="scalar", python_type="float"),
    MANIFEST,
    pattern="a scalar with shape",
  ),
  hr.Case("shape of 2**62", _huge([2**62, 64], [1, 64]), MANIFEST, pattern="2\\*\\*62"),
  hr.Case("zero times huge", _huge([0, 2**70], [1, 2**70]), MANIFEST, pattern="2\\*\\*62"),
  hr.Case("100 dimensions", _huge([1] * 100, [1] * 100), MANIFEST, pattern="100 dimensions"),
  hr.Case("a lone surrogate key", _set(x={"\ud800": 1}), MANIFEST, pattern="surrogate"),
  hr.Case(
    "8 GiB declared in one chunk",
    _huge([2**31], [2**31]),
    "ckpt",
    expect=READS_CHUNKS,
    pattern="needs 8 GiB of memory|zarr metadata says",
  ),
  hr.Case(
    "8 GiB declared in 2048 chunks",
    _huge([2**31], [2**20]),
    "ckpt",
    expect={**READS_CHUNKS, "verify": "refused"},
  ),
  hr.Case(
    "deep zarr.json",
    _replaced("a/zarr.json", "deep"),
    "ckpt/a/zarr.json",
    expect={
      **READS_CHUNKS,
      "read": "either",
      "restore": "either",
      "restore_mesh": "either",
      "diff": "either",
    },
  ),
  hr.Case(
    "deep zarr.json, compressed",
    _replaced("a/zarr.json", "deep", compression="zstd"),
    "ckpt/a/zarr.json",
    expect=READS_CHUNKS,
    pattern="nested 100000 levels deep",
  ),
  # files that are not what they seem
  hr.Case("manifest a FIFO", _replaced("manifest.json", "fifo"), MANIFEST, pattern="FIFO"),
  hr.Case("manifest a directory", _replaced("manifest.json", "directory"), MANIFEST),
  hr.Case(
    "chunk a FIFO",
    _replaced("a/c/0/0", "fifo", bundle_bytes=None),
    CHUNK,
    expect=READS_CHUNKS,
    pattern="FIFO",
  ),
  hr.Case(
    "bundle a FIFO",
    _replaced("a/c/0/0", "fifo", chunk_bytes=4096),
    CHUNK,
    expect=READS_CHUNKS,
    pattern="FIFO",
  ),
  hr.Case(
    "compressed chunk a FIFO",
    _replaced("a/c/0/0", "fifo", compression="zstd"),
    CHUNK,
    expect=READS_CHUNKS,
    pattern="FIFO",
  ),
  hr.Case(
    "zarr.json a FIFO",
    _replaced("a/zarr.json", "fifo"),
    "ckpt/a/zarr.json",
    expect={
      **READS_CHUNKS,
      "read": "either",
      "restore": "either",
      "restore_mesh": "either",
      "diff": "either",
    },
  ),
  hr.Case(
    "chunk linked outside",
    _replaced("a/c/0/0", "link out"),
    CHUNK,
    expect=READS_CHUNKS,
    pattern="outside",
  ),
  hr.Case(
    "chunk linked to /dev/zero", _replaced("a/c/0/0", "dev zero"), CHUNK, expect=READS_CHUNKS
  ),
  hr.Case("chunk linked inside", _replaced("a/c/0/0", "link in"), default="ok"),
  # references: a local checkpoint holds its files (links made by incremental saves)
  hr.Case("a pool in a local manifest", _edited(_pooled), MANIFEST, pattern="object stores"),
  hr.Case("a pool far up", _edited(_pooled_at("../" * 9)), MANIFEST, pattern="8 ancestors"),
  hr.Case("a bad token", _set(token="../x"), MANIFEST, pattern="token"),
  hr.Case("short chunk hashes", _set_entry(chunk_sha256="AAAA"), MANIFEST, pattern="hashes"),
]


@pytest.mark.slow
def test_every_entry_point_refuses_tampered_checkpoints(tmp_path):
  problems = hr.run_batch(CASES, tmp_path, ENTRIES)
  assert not problems, "\n\n".join(problems)


def test_deep_metadata_on_an_object_store_is_refused(tmp_path):
  """memory:// checkpoints live in this process: the same checks, in process."""
  import tensorstore as ts

  url = "memory://hostile_ucp/"
  ucp_jax.save(url, {"a": A}, overwrite=True)
  store = ts.KvStore.open(url, context=_location.context()).result()
  data = ucp_jax.open(url).manifest.data  # arrays live below a prefix of their save
  store.write(f"{data}a/zarr.json", DEEP.encode()).result()
  assert "nested 100000 levels deep" in ucp_jax.open(url).verify()["a"]
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=r"a/zarr.json: JSON nested"):
    ucp_jax.open(url).read("a")
  store.write("manifest.json", DEEP.encode()).result()
  with pytest.raises(ucp_jax.ManifestError, match=r"manifest.json: JSON nested 100000"):
    ucp_jax.open(url)


def test_a_save_refuses_metadata_no_reader_would_take_back(tmp_path):
  for metadata, why in (
    ({"x": "\ud800"}, "surrogate"),
    ({"x": float("nan")}, "Out of range float values"),
    ({"x": [[[[[[[[[[[]]]]]]]]]]] * 20}, None),  # fine: 12 deep
  ):
    if why is None:
      ucp_jax.save(tmp_path / "ok", {"a": A}, metadata=metadata)
      assert ucp_jax.open(tmp_path / "ok").metadata == metadata
      continue
    with pytest.raises(ucp_jax.InvalidArgumentError, match=why):
      ucp_jax.save(tmp_path / "bad", {"a": A}, metadata=metadata)
  deep: list = []
  for _ in range(200):
    deep = [deep]
  with pytest.raises(
    ucp_jax.InvalidArgumentError, match="nested 202 levels deep, more than the 127 allowed"
  ):
    ucp_jax.save(tmp_path / "bad", {"a": A}, metadata={"x": deep})
  assert not (tmp_path / "bad").exists()
  deep_tree: dict = {"a": A}
  for _ in range(100):
    deep_tree = {"n": deep_tree}
  with pytest.raises(ucp_jax.InvalidKeyError, match="101 path components \\(at most 100\\)"):
    ucp_jax.save(tmp_path / "bad", deep_tree)
