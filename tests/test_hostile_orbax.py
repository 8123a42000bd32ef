"""Hostile Orbax checkpoints through every entry point (tests/hostile_run.py).

Every case starts from a checkpoint Orbax itself writes here (`StandardCheckpointer`,
`PyTreeCheckpointHandler` with OCDBT or a folder per array, zarr v2 or v3, a
`CheckpointManager` step) and corrupts it as a hostile user would: deeply nested, truncated
or garbage metadata; wrong types in every field the reader reads; FIFOs, sockets and links
out of the folder in place of metadata, chunk and database files; leaf names that leave the
folder or hold control characters; huge declared counts and sizes. Each case runs through
`ucp inspect`, `verify`, `convert`, `diff`, `open().read`, `restore` to numpy and onto an
8-device mesh, in one limited subprocess per batch: no signal, no hang, no blowup, and every
refusal one line naming the file. The object-store (`memory://`) path of the metadata checks,
which a subprocess cannot share, runs in process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import threading
from pathlib import Path

import hostile_run
import jax
import numpy as np
import orbax.checkpoint as ocp
import orbax_states as S
import pytest
import tensorstore as ts

import ucp_jax
from ucp_jax.sources._source_plan import Tensor
from ucp_jax.sources.orbax import _train_state

Case = hostile_run.Case
TREE = {  # what a PyTreeCheckpointHandler save of a small training state holds
  "params": {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.ones(8, np.float32)},
  "count": np.int32(3),
  "lr": 0.5,
  "key": jax.random.key(0),
  "pair": (np.zeros(2, np.float32), 7),
}
LAYOUTS = {  # name -> PyTreeCheckpointHandler options
  "ocdbt2": dict(ocdbt=True, zarr3=False),
  "ocdbt3": dict(ocdbt=True, zarr3=True),
  "folders2": dict(ocdbt=False, zarr3=False),
  "folders3": dict(ocdbt=False, zarr3=True),
}
BASES: dict[str, Path] = {}  # layout -> the checkpoint Orbax wrote (filled by `bases`)
DEEP = 100_000  # TensorStore's JSON parser: a SIGSEGV; Python's: a RecursionError
READS_ONLY = {"inspect": "ok"}  # metadata sound, data not: opening works, reading refuses


@pytest.fixture(scope="module", autouse=True)
def bases(tmp_path_factory):
  root = tmp_path_factory.mktemp("orbax_bases")
  for name, options in LAYOUTS.items():
    S.save(root / name, TREE, **options)
    BASES[name] = root / name
  with ocp.StandardCheckpointer() as checkpointer:
    standard = {"params": TREE["params"], "step": 3, "key": TREE["key"]}
    checkpointer.save(root / "standard", standard)
  BASES["standard"] = root / "standard"
  with ocp.CheckpointManager(root / "manager") as manager:
    manager.save(1, args=ocp.args.StandardSave({"params": TREE["params"]}))
    manager.wait_until_finished()
  BASES["manager"] = root / "manager"
  yield BASES
  BASES.clear()


def _copy(layout: str, *edits, at: str = ""):
  """`make`: a copy of the `layout` checkpoint at `ROOT/ckpt`, edited by each of `edits`
  (called with the copy's folder); the path given to `ucp` is `ckpt/AT`."""

  def make(root: Path) -> Path:
    dst = root / "ckpt"
    shutil.copytree(BASES[layout], dst, symlinks=True)
    for edit in edits:
      edit(dst)
    return dst / at if at else dst

  return make


def _batch(cases: list[Case], tmp_path) -> None:
  problems = hostile_run.run_batch(cases, tmp_path)
  assert not problems, "\n\n".join(problems)


# Edits: each takes the copy's folder.


def _write(rel: str, data: bytes):
  def edit(dst: Path) -> None:
    (dst / rel).write_bytes(data)

  return edit


def _json(rel: str, change):
  """Replaces the JSON document `rel` by `change(document)`."""

  def edit(dst: Path) -> None:
    path = dst / rel
    path.write_text(json.dumps(change(json.loads(path.read_text()))))

  return edit


def _deep(rel: str, depth: int = DEEP):
  """`rel` still holds its fields, and one more nested `depth` levels deep."""

  def edit(dst: Path) -> None:
    text = (dst / rel).read_bytes().rstrip()
    (dst / rel).write_bytes(text[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}")

  return edit


def _truncate(rel: str, keep: float = 0.5):
  def edit(dst: Path) -> None:
    data = (dst / rel).read_bytes()
    (dst / rel).write_bytes(data[: int(len(data) * keep)])

  return edit


def _garbage(rel: str):
  def edit(dst: Path) -> None:
    size = (dst / rel).stat().st_size
    (dst / rel).write_bytes(np.random.default_rng(0).bytes(max(size, 64)))

  return edit


def _remove(rel: str):
  def edit(dst: Path) -> None:
    path = dst / rel
    shutil.rmtree(path) if path.is_dir() else path.unlink()

  return edit


def _fifo(rel: str):
  def edit(dst: Path) -> None:
    if os.path.lexists(dst / rel):
      _remove(rel)(dst)
    os.mkfifo(dst / rel)

  return edit


def _socket(rel: str):
  def edit(dst: Path) -> None:
    _remove(rel)(dst)
    with socket.socket(socket.AF_UNIX) as s:
      s.bind(str(dst / rel))

  return edit


def _link_out(rel: str, content: bytes | None = None):
  """`rel` becomes a link to a file (or folder) outside the checkpoint: its own content
  moved out, or `content`."""

  def edit(dst: Path) -> None:
    outside = dst.parent / "outside" / rel.replace("/", "_")
    outside.parent.mkdir(exist_ok=True)
    if content is None:
      shutil.move(dst / rel, outside)
    else:
      _remove(rel)(dst)
      outside.write_bytes(content)
    os.symlink(outside, dst / rel)

  return edit


def _link_inside(rel: str, to: str):
  def edit(dst: Path) -> None:
    (dst / to).parent.mkdir(parents=True, exist_ok=True)
    shutil.move(dst / rel, dst / to)
    os.symlink(os.path.relpath(dst / to, (dst / rel).parent), dst / rel)

  return edit


def _ocdbt_put(key: str, value: bytes):
  """Writes `key` inside the checkpoint's OCDBT database, through TensorStore itself."""

  def edit(dst: Path) -> None:
    spec = {"driver": "ocdbt", "base": f"file://{dst}/"}
    ts.KvStore.open(spec).result().write(key, value).result()

  return edit


def _ocdbt_deep(key: str):
  def edit(dst: Path) -> None:
    spec = {"driver": "ocdbt", "base": f"file://{dst}/"}
    store = ts.KvStore.open(spec).result()
    text = store.read(key).result().value.rstrip()
    store.write(key, text[:-1] + b', "x": ' + b"[" * DEEP + b"]" * DEEP + b"}").result()

  return edit


def _tree(change):
  """Replaces `_METADATA`'s `tree_metadata` by `change(tree_metadata)`."""
  return _json("_METADATA", lambda d: {**d, "tree_metadata": change(d["tree_metadata"])})


def _entry(label: str, change):
  """Replaces one `tree_metadata` entry by `change(entry)`."""
  return _tree(lambda t: {**t, label: change(t[label])})


def _path_of(*keys: str):
  """An entry for the path `keys` (dict keys), a jax.Array leaf."""
  return {
    "key_metadata": [{"key": k, "key_type": 2} for k in keys],
    "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False},
  }


W = "('params', 'w')"  # the `tree_metadata` label of params/w


def _uncommitted(dst: Path) -> None:
  """No commit marker: `_CHECKPOINT_METADATA` says whether the save finished."""
  (dst / "commit_success.txt").unlink()


def _zstd_bomb(total: int) -> bytes:
  """A zstd frame of `total` zero bytes in 32 KB (run-length blocks of 128 KiB)."""
  out = bytearray(b"\x28\xb5\x2f\xfd\xe0" + struct.pack("<Q", total))
  blocks = -(-total // (1 << 17))
  for i in range(blocks):
    size = min(1 << 17, total - i * (1 << 17))
    out += ((i == blocks - 1) | (1 << 1) | (size << 3)).to_bytes(3, "little") + b"\0"
  return bytes(out)


# The corpus, by class. `names`: the file every refusal must name.


def _controls() -> list[Case]:
  cases = [Case(f"intact {name}", _copy(name), default="ok") for name in LAYOUTS]
  cases.append(Case("intact StandardCheckpointer", _copy("standard"), default="ok"))
  cases.append(Case("intact manager step", _copy("manager", at="1"), default="ok"))
  return cases


def _deep_json() -> list[Case]:
  return [
    Case("deep .zarray", _copy("folders2", _deep("params.w/.zarray")), "ckpt/params.w/.zarray"),
    Case(
      "deep zarr.json", _copy("folders3", _deep("params.w/zarr.json")), "ckpt/params.w/zarr.json"
    ),
    Case(
      "deep .zarray in OCDBT",
      _copy("ocdbt2", _ocdbt_deep("params.w/.zarray")),
      "ckpt/params.w/.zarray",
    ),
    Case(
      "deep zarr.json in OCDBT",
      _copy("ocdbt3", _ocdbt_deep("params.w/zarr.json")),
      "ckpt/params.w/zarr.json",
    ),
    Case("deep _METADATA", _copy("ocdbt2", _deep("_METADATA")), "ckpt/_METADATA"),
    Case(
      "_METADATA past Python's recursion limit",
      _copy("folders2", _deep("_METADATA", 5000)),
      "ckpt/_METADATA",
    ),
    Case(
      "deep _CHECKPOINT_METADATA",
      _copy("standard", _uncommitted, _deep("_CHECKPOINT_METADATA")),
      "ckpt/_CHECKPOINT_METADATA",
    ),
    Case(
      "deep _CHECKPOINT_METADATA of a manager step",
      _copy("manager", _uncommitted_step, _deep("1/_CHECKPOINT_METADATA"), at="1"),
      "ckpt/1/_CHECKPOINT_METADATA",
    ),
    Case(
      "deep array_metadatas",
      _copy("ocdbt2", _deep("array_metadatas/process_0")),
      "ckpt/array_metadatas/process_0",
    ),
    Case(
      "deep .zarray through a file:// URL",
      lambda root: f"file://{_copy('folders2', _deep('params.w/.zarray'))(root)}",
      "ckpt/params.w/.zarray",
    ),
    # files no reader parses: TensorStore reads no `.zattrs`, ucp_jax no `_sharding`
    Case("deep .zattrs", _copy("folders2", _write("params.w/.zattrs", b"[" * DEEP)), default="ok"),
    Case("deep _sharding", _copy("ocdbt2", _deep("_sharding")), default="ok"),
  ]


def _uncommitted_step(dst: Path) -> None:
  for folder in (dst / "1", dst / "1" / "default"):
    (folder / "commit_success.txt").unlink()


def _names() -> list[Case]:
  cases = [
    Case(f"a leaf named {what}", _copy("folders2", _entry(W, lambda e, k=key: _path_of(*k))))
    for what, key in (
      ("..", ("..",)),
      ("as an absolute path", ("/etc",)),
      ("climbing out of the folder", ("params", "w/../../../outside")),
      ("with a NUL", ("params", "w\0x")),
      ("with 300 characters", ("params", "w" * 300)),
    )
  ]
  for case in cases:
    case.names = "ckpt/_METADATA"
  cases += [
    Case(
      "control characters in a name whose array is missing",
      _copy("folders2", _entry(W, lambda e: _path_of("params", "w\n\x1b[31m\r"))),
      "ckpt",
      pattern=r"w\\n\\x1b\[31m\\r",
    ),
    Case(
      "two leaves with one key",
      _copy("folders2", _tree(lambda t: {**t, "x": _path_of("lr", "value")})),
      "ckpt/_METADATA",
    ),
    Case(
      "a lone surrogate in a name",
      _copy("ocdbt2", _write("_METADATA", b'{"tree_metadata": {"a": ' + _lone() + b"}}")),
      "ckpt/_METADATA",
    ),
  ]
  return cases


def _lone() -> bytes:
  """An entry whose key is a lone surrogate (valid JSON, not valid Unicode)."""
  return json.dumps(_path_of("params", "SURROGATE")).replace("SURROGATE", "\\ud800").encode()


def _counts() -> list[Case]:
  """Each case's cost is in reading the metadata (the same for every entry point): two of
  them suffice."""
  huge_label = repr(("a",) * 2_000_000)
  value = {"value_type": "jax.Array", "skip_deserialize": False}
  two = dict(default=None, expect={"inspect": "refused", "convert": "refused"})
  return [
    Case(
      "a tuple label of 2M elements",
      _copy("folders2", _tree(lambda t: {huge_label: {"value_metadata": value}})),
      "ckpt/_METADATA",
      **two,
    ),
    Case(
      "a tuple label nested 30,000 deep",
      _copy("folders2", _tree(lambda t: {"(" * 30_000 + ")" * 30_000: {"value_metadata": value}})),
      "ckpt/_METADATA",
    ),
    Case(
      "key_metadata of 200,000 parts",
      _copy("folders2", _entry(W, lambda e: _path_of(*(["a"] * 200_000)))),
      "ckpt/_METADATA",
      **two,
    ),
    Case(
      "tree_metadata of 150,000 entries",
      _copy("ocdbt2", _tree(lambda t: {f"x{i}": _path_of(f"x{i}") for i in range(150_000)})),
      "ckpt/_METADATA",
      **two,
    ),
    Case(
      "20,000 leaves whose arrays are missing",
      _copy("ocdbt2", _tree(lambda t: {f"x{i}": _path_of(f"x{i}") for i in range(20_000)})),
      "ckpt",
      pattern="19999 more arrays alike",
      default=None,
      expect={"inspect": "refused", "read": "refused"},
    ),
    Case(
      "array_metadatas of 200,000 entries",
      _copy(
        "folders2",
        _json(
          "array_metadatas/process_0",
          lambda d: {
            "array_metadatas": d["array_metadatas"]
            + [{"array_metadata": {"param_name": "x", "ext_metadata": None}}] * 200_000
          },
        ),
      ),
      default=None,
      expect={"inspect": "ok", "read": "ok"},
    ),
  ]


def _special_files() -> list[Case]:
  fifos = [
    ("folders2", "_METADATA"),
    ("ocdbt2", "array_metadatas/process_0"),
    ("folders2", "params.w/.zarray"),
    ("folders3", "params.w/zarr.json"),
    ("folders2", "params.w/0.0"),
    ("folders3", "params.w/c/0/0"),
    ("ocdbt2", "manifest.ocdbt"),
    ("ocdbt2", "ocdbt.process_0/manifest.ocdbt"),
    ("folders2", "commit_success.txt"),
    ("folders2", "unrelated"),
  ]
  cases = [
    Case(f"a FIFO as {rel} ({layout})", _copy(layout, _fifo(rel)), f"ckpt/{rel}")
    for layout, rel in fifos
  ]
  cases += [
    Case("a FIFO as an OCDBT data file", _copy("ocdbt2", _fifo_data_file), "ckpt/d"),
    Case(
      "a FIFO as _CHECKPOINT_METADATA",
      _copy("standard", _uncommitted, _fifo("_CHECKPOINT_METADATA")),
      "ckpt/_CHECKPOINT_METADATA",
    ),
    Case(
      "a FIFO as a manager step's _CHECKPOINT_METADATA",
      _copy("manager", _uncommitted_step, _fifo("1/_CHECKPOINT_METADATA"), at="1"),
      "ckpt/1/_CHECKPOINT_METADATA",
    ),
    Case("a socket as a chunk", _copy("folders2", _socket("params.w/0.0")), "ckpt/params.w/0.0"),
  ]
  return cases


def _fifo_data_file(dst: Path) -> None:
  name = sorted(os.listdir(dst / "d"))[0]
  _fifo(f"d/{name}")(dst)


def _sizes() -> list[Case]:
  def zarray(**fields):
    return _json("params.w/.zarray", lambda d: {**d, **fields})

  def missing_chunks(dst: Path) -> None:  # an old save: chunks equal to the fill value not stored
    _remove("params.w/0.0")(dst)
    _json("_METADATA", lambda d: {**d, "store_array_data_equal_to_fill_value": False})(dst)

  return [
    Case(
      "shape [2**40] in one chunk (28 KB)",
      _copy("folders2", zarray(shape=[2**40], chunks=[2**40])),
      "ckpt/params.w",
    ),
    Case(
      "shape [2**40] in chunks of 1024",
      _copy("folders2", zarray(shape=[2**40], chunks=[1024])),
      "ckpt",
      expect=READS_ONLY,
    ),
    Case(  # `diff` compares them in bounded memory, for as long as 8 GiB takes: not run
      "8 GiB of missing chunks, read as fill values",
      _copy("folders2", zarray(shape=[2**31], chunks=[2**20]), missing_chunks),
      "ckpt",
      expect=READS_ONLY | {"diff": None},
    ),
    Case(
      "chunks larger than the array",
      _copy("folders2", zarray(chunks=[2**20, 2**20])),
      "ckpt/params.w",
    ),
    Case(
      "a shard index of 2**29 entries (8 GiB)",
      _copy(
        "folders3",
        _json(
          "params.w/zarr.json",
          lambda d: _shard(d, shape=[2**29], shard=[2**29], inner=[1]),
        ),
      ),
      "ckpt/params.w",
    ),
    Case(
      "a shape of 2**62 elements",
      _copy("folders2", zarray(shape=[2**62], chunks=[8])),
      "ckpt/params.w",
    ),
    Case(
      "a shape of 40 dimensions",
      _copy("folders2", zarray(shape=[1] * 40, chunks=[1] * 40)),
      "ckpt/params.w",
    ),
    Case(
      "a zstd bomb of 1 GiB as a chunk",
      _copy("folders2", _write("params.w/0.0", _zstd_bomb(1 << 30))),
      "ckpt/params.w/0.0",
      expect=READS_ONLY,
    ),
  ]


def _shard(d: dict, *, shape, shard, inner) -> dict:
  codec = d["codecs"][0]
  codec = {**codec, "configuration": {**codec["configuration"], "chunk_shape": inner}}
  grid = {**d["chunk_grid"], "configuration": {"chunk_shape": shard}}
  return {**d, "shape": shape, "chunk_grid": grid, "codecs": [codec]}


def _wrong_types() -> list[Case]:
  label = W
  step_meta = "_CHECKPOINT_METADATA"
  arrays = "array_metadatas/process_0"

  def key_meta(change):  # the PRNG key's entry in array_metadatas
    def apply(d):
      entries = [
        change(e) if e["array_metadata"]["param_name"] == "key" else e for e in d["array_metadatas"]
      ]
      return {"array_metadatas": entries}

    return _json(arrays, apply)

  def meta(**fields):
    return lambda e: {**e, "array_metadata": {**e["array_metadata"], **fields}}

  tree_cases = {
    "_METADATA a list": _json("_METADATA", lambda d: [d]),
    "tree_metadata a list": _json("_METADATA", lambda d: {**d, "tree_metadata": [1]}),
    "an entry a string": _entry(label, lambda e: "x"),
    "key_metadata a string": _entry(label, lambda e: {**e, "key_metadata": "params.w"}),
    "a key a number": _entry(label, lambda e: {**e, "key_metadata": [{"key": 1, "key_type": 2}]}),
    "a key_type a string": _entry(
      label, lambda e: {**e, "key_metadata": [{"key": "w", "key_type": "2"}]}
    ),
    "value_metadata a list": _entry(label, lambda e: {**e, "value_metadata": []}),
    "value_type a number": _entry(label, lambda e: {**e, "value_metadata": {"value_type": 3}}),
    "skip_deserialize a string": _entry(
      label, lambda e: {**e, "value_metadata": {**e["value_metadata"], "skip_deserialize": "no"}}
    ),
    "use_ocdbt a string": _json("_METADATA", lambda d: {**d, "use_ocdbt": "no"}),
    "use_zarr3 a number": _json("_METADATA", lambda d: {**d, "use_zarr3": 0}),
    "store_array_data_equal_to_fill_value a string": _json(
      "_METADATA", lambda d: {**d, "store_array_data_equal_to_fill_value": "yes"}
    ),
  }
  cases = [
    Case(name, _copy("folders2", edit), "ckpt/_METADATA") for name, edit in tree_cases.items()
  ]
  cases += [
    Case(name, _copy("standard", _uncommitted, _json(step_meta, change)), f"ckpt/{step_meta}")
    for name, change in {
      "_CHECKPOINT_METADATA a list": lambda d: [d],
      "commit_timestamp_nsecs a string": lambda d: {**d, "commit_timestamp_nsecs": "1"},
    }.items()
  ]
  cases += [
    Case(name, _copy("folders2", edit), f"ckpt/{arrays}")
    for name, edit in {
      "array_metadatas a dict": _json(arrays, lambda d: {"array_metadatas": {}}),
      "an array_metadatas entry a list": _json(arrays, lambda d: {"array_metadatas": [[]]}),
      "ext_metadata a string": key_meta(meta(ext_metadata="threefry2x32")),
      "random_key_impl a number": key_meta(meta(ext_metadata={"random_key_impl": 2})),
      "random_key_impl unknown": key_meta(meta(ext_metadata={"random_key_impl": "threefry9"})),
      "param_name a list": key_meta(meta(param_name=["key"])),
    }.items()
  ]

  def zarray(rel="params.w/.zarray", **fields):
    return _json(rel, lambda d: {**d, **fields})

  cases += [
    Case(f".zarray {name}", _copy("folders2", zarray(**fields)), "ckpt/params.w")
    for name, fields in {
      "dtype a list": {"dtype": ["<f4"]},
      "dtype an object array": {"dtype": "|O"},
      "shape a string": {"shape": "8,8"},
      "shape negative": {"shape": [-8, 8]},
      "chunks zero": {"chunks": [0, 8]},
      "compressor unknown": {"compressor": {"id": "bz9"}},
      "fill_value an object": {"fill_value": {"a": 1}},
      "zarr_format 3": {"zarr_format": 3},
    }.items()
  ]
  cases += [
    Case(
      f"zarr.json {name}", _copy("folders3", _json("params.w/zarr.json", change)), "ckpt/params.w"
    )
    for name, change in {
      "data_type unknown": lambda d: {**d, "data_type": "float7"},
      "codecs an object": lambda d: {**d, "codecs": {}},
    }.items()
  ]
  cases.append(
    Case(
      "a PRNG key of 3 words",
      _copy("folders2", zarray("key/.zarray", shape=[3], chunks=[3])),
      "ckpt/key",
    )
  )
  return cases


def _broken() -> list[Case]:
  metadata = {
    "_METADATA truncated": ("_METADATA", _truncate("_METADATA")),
    "_METADATA garbage": ("_METADATA", _garbage("_METADATA")),
    "_METADATA empty": ("_METADATA", _write("_METADATA", b"")),
    "array_metadatas truncated": (
      "array_metadatas/process_0",
      _truncate("array_metadatas/process_0"),
    ),
    ".zarray truncated": ("params.w/.zarray", _truncate("params.w/.zarray")),
  }
  cases = [
    Case(name, _copy("folders2", edit), f"ckpt/{rel}") for name, (rel, edit) in metadata.items()
  ]
  cases += [
    Case(
      "_CHECKPOINT_METADATA truncated",
      _copy("standard", _uncommitted, _truncate("_CHECKPOINT_METADATA")),
      "ckpt/_CHECKPOINT_METADATA",
    ),
    Case("zarr.json garbage", _copy("folders3", _garbage("params.w/zarr.json")), "ckpt/params.w"),
    Case("manifest.ocdbt truncated", _copy("ocdbt2", _truncate("manifest.ocdbt")), "ckpt"),
    Case("manifest.ocdbt garbage", _copy("ocdbt2", _garbage("manifest.ocdbt")), "ckpt"),
    Case("OCDBT data files truncated", _copy("ocdbt2", _truncate_data_files), "ckpt"),
    Case(
      "the merged process database removed",
      _copy("ocdbt2", _remove("ocdbt.process_0")),
      default="ok",
    ),
    Case(
      "a chunk truncated",
      _copy("folders2", _truncate("params.w/0.0")),
      "ckpt/params.w/0.0",
      expect=READS_ONLY,
    ),
    Case(
      "a chunk garbage (zarr3)",
      _copy("folders3", _garbage("params.w/c/0/0")),
      "ckpt/params.w/c/0/0",
      expect=READS_ONLY,
    ),
    Case(
      "a chunk missing",
      _copy("folders2", _remove("params.w/0.0")),
      "ckpt/params.w/0.0",
      expect=READS_ONLY,
    ),
  ]
  return cases


def _truncate_data_files(dst: Path) -> None:
  for folder in (dst / "d", dst / "ocdbt.process_0" / "d"):
    for name in os.listdir(folder):
      _truncate(str((folder / name).relative_to(dst)))(dst)


def _links() -> list[Case]:
  secret = b"SECRET-" + b"k" * 64
  return [
    Case("_METADATA linked out", _copy("folders2", _link_out("_METADATA")), "ckpt/_METADATA"),
    Case(
      ".zarray linked out",
      _copy("folders2", _link_out("params.w/.zarray")),
      "ckpt/params.w/.zarray",
    ),
    Case("a chunk linked out", _copy("folders2", _link_out("params.w/0.0")), "ckpt/params.w/0.0"),
    Case("an array folder linked out", _copy("folders3", _link_out("params.w")), "ckpt/params.w"),
    Case("the OCDBT data folder linked out", _copy("ocdbt2", _link_out("d")), "ckpt/d"),
    Case(
      "manifest.ocdbt linked out",
      _copy("ocdbt2", _link_out("manifest.ocdbt")),
      "ckpt/manifest.ocdbt",
    ),
    Case(
      "array metadata linked to a secret",
      _copy("folders2", _link_out("array_metadatas/process_0", secret)),
      "ckpt/array_metadatas/process_0",
      pattern=r"^(?!.*SECRET)",
    ),
    Case(
      "a manager step's item linked out",
      _copy("manager", _link_out("1/default"), at="1"),
      "ckpt/1/default",
    ),
    Case(
      "links inside the folder",
      _copy(
        "folders2", _link_inside("params.w/0.0", "moved/0.0"), _link_inside("_METADATA", "m/meta")
      ),
      default="ok",
    ),
  ]


@pytest.mark.slow
def test_metadata_that_crashed_or_hung_the_reader(tmp_path):
  _batch(_controls() + _deep_json() + _names() + _counts(), tmp_path)


@pytest.mark.slow
def test_special_files_and_links(tmp_path):
  _batch(_special_files() + _links(), tmp_path)


@pytest.mark.slow
def test_declared_sizes_wrong_types_and_broken_files(tmp_path):
  _batch(_sizes() + _wrong_types() + _broken(), tmp_path)


# In process: what a subprocess cannot share (a `memory://` store) and linear-time checks.


def _upload(local: Path, url: str) -> str:
  from ucp_jax.store import _location

  store = _location.kvstore(_location.resolve(url + "/"))
  for path in sorted(p for p in local.rglob("*") if p.is_file()):
    store.write(path.relative_to(local).as_posix(), path.read_bytes()).result()
  return url


@pytest.mark.parametrize("layout", ["folders2", "ocdbt2"])
def test_deep_zarr_metadata_on_an_object_store_is_refused(tmp_path, layout):
  make = _copy(
    layout, _deep("params.w/.zarray") if layout == "folders2" else _ocdbt_deep("params.w/.zarray")
  )
  url = _upload(make(tmp_path), f"memory://hostile_orbax_{layout}/ckpt")
  with pytest.raises(ucp_jax.SourceFormatError) as caught:
    ucp_jax.open(url)  # (TensorStore's parser would end the process here)
  message = str(caught.value)
  inside = " in the OCDBT database" if layout == "ocdbt2" else ""
  assert message.startswith(
    f"{url}/params.w/.zarray{inside} (`params/w`): JSON nested {DEEP + 1} levels deep"
  )
  assert "\n" not in message


def test_the_training_state_schema_is_found_in_linear_time():
  """30,000 parameters, each with a slot node of its own and an injected learning rate:
  comparing every node with every key (as it once did) would take hours."""
  n = 30_000
  none = Tensor((2,), np.dtype(np.float32), lambda: [np.zeros(2, np.float32)], "x")
  lr = Tensor((), np.dtype(np.float32), lambda: [np.full(1, 0.1, np.float32)], "lr")
  tensors = {f"params/p{i}": none for i in range(n)}
  for i in range(n):
    tensors |= {f"opt_state/s{i}/mu/p{i}": none, f"opt_state/s{i}/nu/p{i}": none}
    tensors[f"opt_state/s{i}/hyperparams/learning_rate"] = lr
  found: list = []
  worker = threading.Thread(target=lambda: found.append(_train_state.infer(tensors, None)))
  worker.daemon = True
  worker.start()
  worker.join(120)  # a watchdog against a hang, not a measure of speed
  assert found, "the schema was not found within 120 s"
  schema = found[0].schema.to_json()
  assert len(schema["params"]) == n and len(schema["optimizer"]["groups"]) == n
  assert schema["optimizer"]["groups"][7] == {"lr": 0.1}
