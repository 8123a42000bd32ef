"""Hostile torch DCP folders through every entry point (`hostile_run`): one line, never a crash.

Every folder starts as a real DCP checkpoint written by `torch.distributed.checkpoint.save`
in this test (a model and its AdamW state, as `get_state_dict` lays them out), or as the
FSDP2 fixture (two ranks, two chunks per tensor, tests/fixtures/dcp); then its `.metadata`
pickle is rewritten with forged values, as a hostile user would: the pickle holds torch's
own classes, with fields the classes would never hold (`_size` forges a `torch.Size` of any
values). Rank files are replaced by FIFOs, links out of the folder, sparse files declaring
gigabytes, or a folder saved with the safetensors serialization.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from hostile_run import Case, run_batch
from test_hostile_deepspeed import sparse_torch_file

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.filesystem import (  # noqa: E402
  FileSystemWriter,
  SerializationFormat,
  _StorageInfo,
)

FSDP2 = Path(__file__).parent / "fixtures" / "dcp" / "fsdp2_adamw"
pytestmark = pytest.mark.slow


def _state() -> dict:
  """A model and its AdamW state as `get_state_dict` lays them out (`head` tied to `wte`)."""
  rng = np.random.default_rng(0)
  model = {
    "wte.weight": rng.standard_normal((16, 8)),
    "fc.weight": rng.standard_normal((8, 8)),
    "fc.bias": rng.standard_normal(8),
    "norm.running_mean": np.zeros(8),
  }
  model = {k: torch.tensor(v, dtype=torch.float32) for k, v in model.items()}
  model["head.weight"] = model["wte.weight"].clone()
  names = ["wte.weight", "fc.weight", "fc.bias"]
  state = {
    n: {"exp_avg": torch.ones_like(model[n]), "exp_avg_sq": torch.ones_like(model[n])}
    for n in names
  }
  for n in names:
    state[n]["step"] = torch.tensor(3.0)
  groups = [{"lr": 0.01, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": names}]
  return {"model": model, "optim": {"state": state, "param_groups": groups}}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
  """Real DCP folders: `base` (torch_save), `safetensors` (serialization_format), `nan`
  (`base` with a step of NaN)."""
  root = tmp_path_factory.mktemp("dcp")
  nan = _state()
  nan["optim"]["state"]["fc.bias"]["step"] = torch.tensor(float("nan"))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.save(_state(), checkpoint_id=str(root / "base"), no_dist=True)
    dcp.save(nan, checkpoint_id=str(root / "nan"), no_dist=True)
    writer = FileSystemWriter(
      str(root / "safetensors"), serialization_format=SerializationFormat.SAFETENSORS
    )
    dcp.save(_state(), storage_writer=writer, no_dist=True)
  return {name: root / name for name in ("base", "safetensors", "nan")}


# Forging a `.metadata`: it is ours (made above), so plain pickle reads it back.


class _size:
  """Pickles as `torch.Size(values)` whatever the values (torch.Size refuses most forgeries)."""

  def __init__(self, values):
    self.values = list(values)

  def __reduce__(self):
    return (torch.Size, (self.values,))


def _set(obj, **fields) -> None:
  for name, value in fields.items():
    object.__setattr__(obj, name, value)


def _entries_of(meta, key: str) -> list:
  return [k for k in meta.storage_data if k.fqn == key]


def _rechunk(meta, key: str, size, boxes) -> None:
  """Gives tensor `key` the size `size` and chunks `boxes`: (offsets, sizes, _StorageInfo)."""
  md = meta.state_dict_metadata[key]
  chunk, index = md.chunks[0], _entries_of(meta, key)[0]
  for k in _entries_of(meta, key):
    del meta.storage_data[k]
  chunks = []
  for offsets, sizes, info in boxes:
    c, i = copy.copy(chunk), copy.copy(index)
    _set(c, offsets=offsets, sizes=sizes)
    _set(i, offset=offsets)
    meta.storage_data[i] = info
    chunks.append(c)
  _set(md, size=size, chunks=chunks)


def _info(meta, key: str, **fields):
  info = copy.copy(meta.storage_data[_entries_of(meta, key)[0]])
  _set(info, **fields)
  return info


def _copy(src: Path, folder: Path) -> Path:
  dst = folder / "ckpt"
  shutil.copytree(src, dst)
  return dst


def _forged(src: Path, edit):
  """A maker: a copy of `src` whose `.metadata` is rewritten after `edit(meta, folder)`."""

  def make(folder: Path) -> Path:
    dst = _copy(src, folder)
    meta = pickle.loads((dst / ".metadata").read_bytes())  # made by this test: trusted
    edit(meta, dst)
    (dst / ".metadata").write_bytes(pickle.dumps(meta))
    return dst

  return make


def _changed(src: Path, change):
  """A maker: a copy of `src` after `change(folder)` (files replaced, linked, ...)."""

  def make(folder: Path) -> Path:
    dst = _copy(src, folder)
    change(dst)
    return dst

  return make


def _md(key: str, **fields):
  return lambda meta, _: _set(meta.state_dict_metadata[key], **fields)


def _index_field(key: str, **fields):
  return lambda meta, _: _set(_entries_of(meta, key)[0], **fields)


def _info_field(key: str, **fields):
  return lambda meta, _: _set(meta.storage_data[_entries_of(meta, key)[0]], **fields)


def _chunk_field(key: str, **fields):
  return lambda meta, _: _set(meta.state_dict_metadata[key].chunks[0], **fields)


def _nested(depth: int):
  value: tuple = ("model", "fc.weight")
  for _ in range(depth):
    value = (value,)
  return value


# Rank files built by hand: many chunks, and gigabytes declared by sparse files.


def _blob(value) -> bytes:
  """A torch.save file of `value`, as dcp.save writes each chunk into a rank file."""
  import io

  buffer = io.BytesIO()
  torch.save(value, buffer)
  return buffer.getvalue()


def _wide(n: int):
  """`model.norm.running_mean` (a buffer) as (1, n) in n chunks of one element, each its own span of a new rank
  file: the first a real torch.save blob, the rest 4 bytes of zeros (refused when read)."""

  def edit(meta, folder: Path) -> None:
    first = _blob(torch.zeros((1, 1)))
    (folder / "__7_0.distcp").write_bytes(first + bytes(4 * n))
    boxes = [((0, 0), (1, 1), _StorageInfo("__7_0.distcp", 0, len(first)))]
    boxes += [
      ((0, i), (1, 1), _StorageInfo("__7_0.distcp", len(first) + 4 * i, 4)) for i in range(1, n)
    ]
    _rechunk(meta, "model.norm.running_mean", torch.Size([1, n]), boxes)

  return edit


def _gigabytes(rows: int, row: int):
  """`model.norm.running_mean` (a buffer) as (rows, row) float32, a chunk per row, each a sparse torch.save file
  of `row` zeros in one rank file: the declared bytes are really there (as holes)."""

  def edit(meta, folder: Path) -> None:
    boxes = []
    with open(folder / "__8_0.distcp", "wb") as f:
      for r in range(rows):
        at = f.tell()
        length = sparse_torch_file(f, row, (1, row))
        boxes.append(((r, 0), (1, row), _StorageInfo("__8_0.distcp", at, length)))
    _rechunk(meta, "model.norm.running_mean", torch.Size([rows, row]), boxes)

  return edit


def _shared_span(meta, _) -> None:
  """`model.fc.weight` stored in bytes that begin inside those of `model.fc.bias`."""
  info = meta.storage_data[_entries_of(meta, "model.fc.bias")[0]]
  shifted = copy.copy(info)
  _set(shifted, offset=info.offset + 100)
  meta.storage_data[_entries_of(meta, "model.fc.weight")[0]] = shifted


def _renamed(key: str, new: str):
  """Tensor `key` renamed `new` everywhere the metadata names it."""

  def edit(meta, _) -> None:
    meta.state_dict_metadata[new] = meta.state_dict_metadata.pop(key)
    meta.planner_data.pop(key)
    for index in _entries_of(meta, key):
      info = meta.storage_data.pop(index)
      _set(index, fqn=new)
      meta.storage_data[index] = info

  return edit


# Folder-level hostility.


def _fifo(name: str):
  def change(folder: Path) -> None:
    (folder / name).unlink()
    os.mkfifo(folder / name)

  return change


def _link(name: str, target):
  """`name` replaced by a symbolic link to `target(folder)`."""

  def change(folder: Path) -> None:
    to = target(folder)
    (folder / name).unlink()
    (folder / name).symlink_to(to)

  return change


def _outside(name: str):
  """A genuine copy of `name` outside the folder (beside it), as a link target."""

  def target(folder: Path) -> Path:
    out = folder.parent / f"outside-{name}"
    shutil.copy(folder / name, out)
    return out

  return target


def _inside(name: str):
  def target(folder: Path) -> Path:
    (folder / "sub").mkdir(exist_ok=True)
    shutil.copy(folder / name, folder / "sub" / name)
    return Path("sub") / name

  return target


def _cases(made: dict[str, Path]) -> list[Case]:
  base = made["base"]
  meta, rank = ".metadata", "__0_0.distcp"
  bias = "model.fc.bias"
  S = Case
  return [
    S("control: a genuine folder", lambda d: _copy(base, d), default="ok"),
    S("control: FSDP2 fixture", lambda d: _copy(FSDP2, d), default="ok"),
    S(
      "20,000 chunks of one tensor",
      _forged(base, _wide(20_000)),
      # every entry point reads .metadata alike (5 s of safe unpickling here): these three
      # cover describing it and both kinds of read (lazy cells, and a mesh)
      expect={"inspect": "ok", "verify": None, "convert": None, "diff": None, "restore": None},
      pattern=r"__7_0\.distcp",
    ),
    S(
      "a size of zero times huge",
      _forged(
        base,
        lambda m, _: _rechunk(
          m, bias, _size([0, 2**70]), [((0, 0), _size([0, 2**70]), _info(m, bias))]
        ),
      ),
      pattern=r"more than 2\*\*62 bytes",
    ),
    S(
      "2**31 floats declared in a small blob",
      _forged(
        base,
        lambda m, _: _rechunk(m, bias, torch.Size([2**31]), [((0,), (2**31,), _info(m, bias))]),
      ),
      pattern=r"needs 8589934592 bytes of float32, and it is stored in \d+: its file cannot",
    ),
    S(
      "8 GiB of float32 really stored (sparse rank file)",
      _forged(base, _gigabytes(4, 2**29)),
      expect={"inspect": "ok", "diff": None},  # diff works, 32 MiB at a time: minutes of zeros
      pattern=r"needs 8 GiB of memory",
    ),
    S(
      "a negative chunk offset", _forged(base, _chunk_field(bias, offsets=(-1,))), pattern="chunk 0"
    ),
    S(
      "a span past the end of its file",
      _forged(base, _info_field(bias, offset=10**12)),
      pattern=r"truncated: \d+ of \d+ bytes",
    ),
    S(
      "a span of 2**70 bytes",
      _forged(base, _info_field(bias, length=2**70)),
      pattern=r"truncated: \d+ of \d+ bytes",
    ),
    S("two entries in overlapping bytes", _forged(base, _shared_span), pattern="overlap those"),
    S("version: a list", _forged(base, lambda m, _: _set(m, version=["1.0.0"])), pattern="version"),
    S("version: 2**1000", _forged(base, lambda m, _: _set(m, version=2**1000)), pattern="version"),
    S(
      "state_dict_metadata: a list",
      _forged(base, lambda m, _: _set(m, state_dict_metadata=[1])),
      pattern="state_dict_metadata is a list",
    ),
    S(
      "storage_data: a string",
      _forged(base, lambda m, _: _set(m, storage_data="x")),
      pattern="storage_data is a str",
    ),
    S("planner_data: an int", _forged(base, lambda m, _: _set(m, planner_data=5)), default="ok"),
    S(
      "planner_data: a path nested 90 deep",
      _forged(base, lambda m, _: m.planner_data.__setitem__("model.fc.weight", _nested(90))),
      pattern=r"planner_data\[`model\.fc\.weight`\] is \(\(\(",
    ),
    S(
      "planner_data: a path nested 200 deep",
      _forged(base, lambda m, _: m.planner_data.__setitem__("model.fc.weight", _nested(200))),
      pattern="MAX_DEPTH",
    ),
    S("chunk offsets: a string", _forged(base, _chunk_field(bias, offsets="0")), pattern="chunk 0"),
    S("chunk sizes: a float", _forged(base, _chunk_field(bias, sizes=3.5)), pattern="chunk 0"),
    S("chunks: a dict", _forged(base, _md(bias, chunks={})), pattern="chunks is a dict"),
    S("properties: None", _forged(base, _md(bias, properties=None)), pattern="name no dtype"),
    S(
      "dtype: a string",
      _forged(base, lambda m, _: _set(m.state_dict_metadata[bias].properties, dtype="float32")),
      pattern="name no dtype",
    ),
    S(
      "dtype: complex32 (no numpy dtype)",
      _forged(
        base, lambda m, _: _set(m.state_dict_metadata[bias].properties, dtype=torch.complex32)
      ),
      pattern="name no dtype",
    ),
    S(
      "size: 40 dimensions",
      _forged(base, _md(bias, size=torch.Size([1] * 40))),
      pattern="40 dimensions",
    ),
    S("size: a string", _forged(base, _md(bias, size="8")), pattern="size"),
    S(
      "relative_path: an int",
      _forged(base, _info_field(bias, relative_path=7)),
      pattern="relative_path 7",
    ),
    S(
      "relative_path: ../",
      _forged(base, _info_field(bias, relative_path="../ckpt/__0_0.distcp")),
      pattern="relative_path",
    ),
    S(
      "relative_path: absolute",
      _forged(base, _info_field(bias, relative_path="/etc/passwd")),
      pattern="relative_path",
    ),
    S(
      "relative_path: 10,000 characters",
      _forged(base, _info_field(bias, relative_path="a" * 10_000)),
      pattern="relative_path 'aaa",
    ),
    S(
      "relative_path: the .metadata pickle",
      _forged(base, _info_field(bias, relative_path=".metadata", offset=0, length=64)),
      pattern="where no torch.save file starts",
    ),
    S(
      "transform_descriptors: 100,000 names",
      _forged(base, _info_field(bias, transform_descriptors=["zstd"] * 100_000)),
      pattern="stream transforms",
    ),
    S(
      "MetadataIndex.fqn: an int",
      _forged(base, _index_field(bias, fqn=5)),
      pattern="fqn 5 is not a printable string",
    ),
    S(
      "MetadataIndex.offset: a list",
      _forged(base, _index_field(bias, offset=[0])),
      pattern=r"offset \[0\] is not a torch\.Size",
    ),
    S(
      "a _StorageInfo that is None",
      _forged(base, lambda m, _: m.storage_data.__setitem__(_entries_of(m, bias)[0], None)),
      pattern="not a _StorageInfo",
    ),
    S(
      "TensorStorageMetadata: a string",
      _forged(base, lambda m, _: m.state_dict_metadata.__setitem__(bias, "x")),
      pattern="neither Tensor- nor BytesStorageMetadata",
    ),
    S(
      "a state_dict_metadata key that is an int",
      _forged(base, lambda m, _: m.state_dict_metadata.__setitem__(5, m.state_dict_metadata[bias])),
      pattern="key 5 is not a printable string",
    ),
    S(
      "a key with a newline",
      _forged(base, _renamed("model.norm.running_mean", "model.norm.running\nmean")),
      pattern="not a printable string",
    ),
    S(
      "a key with a lone surrogate",
      _forged(base, _renamed("model.norm.running_mean", "model.norm.\udcff")),
      pattern="not a printable string",
    ),
    S(
      "Metadata: a dict",
      lambda d: (
        (_copy(base, d) / meta).write_bytes(pickle.dumps({"version": "1.0.0"})) and d / "ckpt"
      ),
      pattern="not torch.distributed.checkpoint's Metadata",
    ),
    S("a step of NaN (saved by torch)", lambda d: _copy(made["nan"], d), pattern="finite"),
    S(
      "saved with the safetensors serialization",
      lambda d: _copy(made["safetensors"], d),
      pattern="serialization_format=SAFETENSORS",
    ),
    S("a FIFO as .metadata", _changed(base, _fifo(meta)), default="refused"),
    S(
      "a FIFO as .metadata, read as dcp", _changed(base, _fifo(meta)), source="dcp", pattern="FIFO"
    ),
    S("a FIFO as a rank file", _changed(base, _fifo(rank)), pattern="FIFO"),
    S(
      ".metadata: a link out of the folder",
      _changed(base, _link(meta, _outside(meta))),
      pattern="outside",
    ),
    S(
      "a rank file: a link out of the folder",
      _changed(base, _link(rank, _outside(rank))),
      pattern="outside",
    ),
    S(
      "a rank file: a link to /dev/zero",
      _changed(base, _link(rank, lambda _: "/dev/zero")),
      pattern="outside|character device",
    ),
    S(
      "a rank file: a link inside the folder",
      _changed(base, _link(rank, _inside(rank))),
      default="ok",
    ),
  ]


def _check(cases: list[Case], tmp_path: Path) -> None:
  problems = run_batch(cases, tmp_path)
  assert not problems, "\n".join(p.splitlines()[0][:400] for p in problems)


def test_forged_metadata_through_every_entry_point(made, tmp_path):
  cases = _cases(made)
  _check([c for c in cases if "FIFO" not in c.name and "link" not in c.name], tmp_path)


def test_fifos_and_links_through_every_entry_point(made, tmp_path):
  cases = _cases(made)
  _check([c for c in cases if "FIFO" in c.name or "link" in c.name], tmp_path)
