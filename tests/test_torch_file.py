"""Tests of the safe torch file reader against files written by torch itself."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import io
import mmap
import os
import zipfile

import hostile_corpus as corpus
import ml_dtypes
import numpy as np
import pytest

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources._torch_reader import _pickle_limits, _torch_file, _torch_zip
from ucp_jax.sources._torch_reader._torch_file import InertObject, TorchDtype, load


@pytest.fixture
def torch():
  return pytest.importorskip("torch")


class _Config:
  def __init__(self, lr, stage):
    self.lr = lr
    self.stage = stage


class _Stage(enum.Enum):
  TWO = 2


@dataclasses.dataclass
class _Address:
  start: int
  numel: int


def _save(torch, obj, path, **kwargs):
  torch.save(obj, path, **kwargs)
  return path


def _bases(array):
  """The chain of objects that keep `array`'s memory alive, ending in what owns it."""
  chain = []
  while array is not None:
    chain.append(array)
    array = getattr(array, "obj" if isinstance(array, memoryview) else "base", None)
  return chain


def _rewrite(src, dst, edit=lambda name, data: data, compression=zipfile.ZIP_STORED):
  """Copies a zip, passing each entry through `edit` (None drops it)."""
  with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression) as zout:
    for info in zin.infolist():
      data = edit(info.filename, zin.read(info))
      if data is not None:
        zout.writestr(info.filename, data)
  return dst


_DTYPES = {
  "float16": np.float16,
  "float32": np.float32,
  "float64": np.float64,
  "bfloat16": ml_dtypes.bfloat16,
  "int8": np.int8,
  "int16": np.int16,
  "int32": np.int32,
  "int64": np.int64,
  "uint8": np.uint8,
  "uint16": np.uint16,
  "uint32": np.uint32,
  "uint64": np.uint64,
  "bool": np.bool_,
  "complex64": np.complex64,
  "complex128": np.complex128,
  "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
  "float8_e5m2": ml_dtypes.float8_e5m2,
  "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
  "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
  "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
}


def test_every_dtype_round_trips_bit_for_bit(torch, tmp_path):
  values = torch.tensor([[0.5, 1.0, 2.0], [4.0, 0.25, 8.0]])
  tensors = {name: values.to(getattr(torch, name)) for name in _DTYPES}
  out = load(_save(torch, tensors, tmp_path / "dtypes.pt"))
  for name, tensor in tensors.items():
    array = out[name]
    assert array.dtype == np.dtype(_DTYPES[name]), name
    assert array.shape == (2, 3), name
    assert array.tobytes() == tensor.view(torch.uint8).numpy().tobytes(), name


def test_views_keep_offset_stride_and_shared_memory(torch, tmp_path):
  base = torch.arange(24.0).reshape(4, 6)
  views = {
    "base": base,
    "transposed": base.t(),
    "block": base[1:3, 2:5],
    "row": base[2],
    "every_other": base[:, ::2],
    "expanded": base[0, :3].expand(2, 3),
  }
  out = load(_save(torch, views, tmp_path / "views.pt"))
  for name, tensor in views.items():
    np.testing.assert_array_equal(out[name], tensor.numpy(), err_msg=name)
    assert not out[name].flags.writeable, name
    assert np.shares_memory(out[name], out["base"]), name


def test_zero_dim_and_empty_tensors(torch, tmp_path):
  tensors = {"scalar": torch.tensor(3.5), "empty": torch.zeros(0), "empty_2d": torch.zeros(2, 0, 3)}
  out = load(_save(torch, tensors, tmp_path / "small.pt"))
  assert out["scalar"].shape == () and out["scalar"] == 3.5
  assert out["empty"].shape == (0,) and out["empty"].dtype == np.float32
  assert out["empty_2d"].shape == (2, 0, 3)


def test_nested_containers_and_python_values(torch, tmp_path):
  tree = {
    "list": [1, 2.5, "three", None, True],
    "tuple": (torch.ones(2), (b"bytes", bytearray(b"ba"))),
    "ordered": collections.OrderedDict(b=2, a=1),
    "set": {1, 2},
    "frozenset": frozenset({"x"}),
    "complex": 1 + 2j,
    "slice": slice(1, 5, 2),
    "range": range(3),
    "numpy": [np.arange(4, dtype=np.int16), np.float32(1.5), np.int64(7)],
  }
  out = load(_save(torch, tree, tmp_path / "tree.pt"))
  assert out["list"] == tree["list"]
  assert out["tuple"][1] == (b"bytes", bytearray(b"ba"))
  np.testing.assert_array_equal(out["tuple"][0], np.ones(2, np.float32))
  assert isinstance(out["ordered"], collections.OrderedDict)
  assert list(out["ordered"].items()) == [("b", 2), ("a", 1)]
  for key in ("set", "frozenset", "complex", "slice", "range"):
    assert out[key] == tree[key], key
  np.testing.assert_array_equal(out["numpy"][0], tree["numpy"][0])
  assert out["numpy"][1:] == [np.float32(1.5), np.int64(7)]
  assert out["numpy"][1].dtype == np.float32


def _adam_state_dict(torch, params):
  """What `torch.optim.Adam(params, lr=1e-3).state_dict()` holds after one step, written out:
  building a real torch optimizer imports torch._dynamo, which takes seconds."""
  state = {
    i: {"step": torch.tensor(1.0), "exp_avg": p * 0.1, "exp_avg_sq": p * p * 1e-3}
    for i, p in enumerate(params)
  }
  group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0, "amsgrad": False}
  group |= {"maximize": False, "foreach": None, "capturable": False, "differentiable": False}
  group |= {"fused": None, "decoupled_weight_decay": False, "params": list(range(len(params)))}
  return {"state": state, "param_groups": [group]}


def test_module_and_optimizer_state_dicts(torch, tmp_path):
  model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
  adam = _adam_state_dict(torch, [p.detach() for p in model.parameters()])
  state = {"model": model.state_dict(), "optimizer": adam}
  out = load(_save(torch, state, tmp_path / "train.pt"))
  assert list(out["model"]) == list(state["model"])
  for name, tensor in state["model"].items():
    np.testing.assert_array_equal(out["model"][name], tensor.numpy())
  assert out["model"]._metadata == state["model"]._metadata
  groups = out["optimizer"]["param_groups"]
  assert groups == adam["param_groups"]
  assert out["optimizer"]["state"].keys() == {0, 1, 2, 3}
  np.testing.assert_array_equal(
    out["optimizer"]["state"][3]["exp_avg"], adam["state"][3]["exp_avg"]
  )
  assert out["optimizer"]["state"][0]["step"] == 1.0


def test_torch_values_become_plain_records(torch, tmp_path):
  tree = {
    "size": torch.Size([2, 3]),
    "dtypes": [torch.float32, torch.bfloat16, torch.complex32],
    "devices": [torch.device("cpu"), torch.device("cuda", 1), torch.device("cuda:0")],
  }
  out = load(_save(torch, tree, tmp_path / "values.pt"))
  assert out["size"] == (2, 3) and type(out["size"]) is tuple
  assert out["dtypes"] == [TorchDtype("float32"), TorchDtype("bfloat16"), TorchDtype("complex32")]
  assert [d.numpy_dtype for d in out["dtypes"]] == [np.float32, ml_dtypes.bfloat16, None]
  assert str(out["dtypes"][1]) == "torch.bfloat16"
  assert out["devices"] == ["cpu", "cuda:1", "cuda:0"]


def test_parameters_become_arrays(torch, tmp_path):
  plain = torch.nn.Parameter(torch.ones(2))
  with_state = torch.nn.Parameter(torch.zeros(3))
  with_state.tag = "ds"
  out = load(_save(torch, {"plain": plain, "state": with_state}, tmp_path / "params.pt"))
  np.testing.assert_array_equal(out["plain"], np.ones(2, np.float32))
  np.testing.assert_array_equal(out["state"], np.zeros(3, np.float32))


def test_raw_storages_tensor_attributes_and_meta_tensors(torch, tmp_path):
  with_attr = torch.ones(2)
  with_attr.note = "kept by torch, dropped here"
  tree = {
    "attr": with_attr,
    "storage": torch.arange(3.0).untyped_storage(),
    "meta": torch.empty(2, device="meta"),
  }
  out = load(_save(torch, tree, tmp_path / "odd.pt"))
  np.testing.assert_array_equal(out["attr"], [1.0, 1.0])
  assert out["storage"].dtype is None
  assert out["storage"].data.tobytes() == np.arange(3, dtype=np.float32).tobytes()
  assert out["meta"].qualname == "torch._utils._rebuild_meta_tensor_no_storage"
  assert out["meta"].args[:2] == (TorchDtype("float32"), (2,))


def test_root_folder_is_found_whatever_its_name(torch, tmp_path):
  named = _save(torch, {"x": torch.ones(1)}, tmp_path / "foo.pt")
  buffer = io.BytesIO()
  torch.save({"x": torch.ones(1)}, buffer, _use_new_zipfile_serialization=True)
  anonymous = tmp_path / "bar.pt"
  anonymous.write_bytes(buffer.getvalue())
  assert zipfile.ZipFile(named).namelist()[0] == "foo/data.pkl"
  assert zipfile.ZipFile(anonymous).namelist()[0] == "archive/data.pkl"
  for path in (named, anonymous):
    np.testing.assert_array_equal(load(path)["x"], [1.0])


def test_foreign_classes_become_inert_records(torch, tmp_path):
  tree = {
    "args": argparse.Namespace(lr=0.1, name="run"),
    "config": _Config(lr=0.5, stage=_Stage.TWO),
    "address": _Address(start=4, numel=8),
  }
  out = load(_save(torch, tree, tmp_path / "objects.pt"))
  assert out["args"] == InertObject("argparse.Namespace", state={"lr": 0.1, "name": "run"})
  config = out["config"]
  assert config.qualname.endswith("._Config")
  assert config.get("lr") == 0.5 and config.get("missing", "x") == "x"
  stage = config.get("stage")
  assert stage.qualname.endswith("._Stage") and stage.value == 2
  assert out["address"].get("start") == 4 and out["address"].get("numel") == 8


def test_tensors_are_mapped_from_the_file_not_copied(torch, tmp_path):
  path = _save(torch, {"a": torch.ones(64), "t": torch.ones(4, 8).t()}, tmp_path / "m.pt")
  out = load(path)
  for array in out.values():
    assert not array.flags.owndata and not array.flags.writeable
    assert isinstance(_bases(array)[-1], mmap.mmap)
  copied = load(path, mmap=False)
  for array in copied.values():
    assert not any(isinstance(b, mmap.mmap) for b in _bases(array))
    assert not array.flags.writeable
  np.testing.assert_array_equal(copied["t"], out["t"])


def test_compressed_and_unaligned_entries_are_read(torch, tmp_path):
  tensors = {"a": torch.arange(10.0), "b": torch.arange(6, dtype=torch.int16).reshape(2, 3).t()}
  path = _save(torch, tensors, tmp_path / "c.pt")
  for compression in (zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED):
    out = load(_rewrite(path, tmp_path / f"c{compression}.pt", compression=compression))
    for name, tensor in tensors.items():
      np.testing.assert_array_equal(out[name], tensor.numpy())


def test_big_endian_files_are_swapped(torch, tmp_path):
  tensors = {"f32": torch.arange(4.0), "u16": torch.arange(3).to(torch.uint16)}
  path = _save(torch, tensors, tmp_path / "le.pt")
  itemsize = {"le/data/0": 4, "le/data/1": 2}

  def to_big(name, data):
    if name == "le/byteorder":
      return b"big"
    if name in itemsize:
      return np.frombuffer(data, f"<u{itemsize[name]}").astype(f">u{itemsize[name]}").tobytes()
    return data

  out = load(_rewrite(path, tmp_path / "be.pt", to_big))
  np.testing.assert_array_equal(out["f32"], [0.0, 1.0, 2.0, 3.0])
  np.testing.assert_array_equal(out["u16"], np.arange(3, dtype=np.uint16))


def test_legacy_format_is_refused(torch, tmp_path):
  path = _save(
    torch, {"a": torch.ones(1)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False
  )
  with pytest.raises(SourceFormatError, match=r"old\.pt: legacy torch format .* torch>=1\.6"):
    load(path)


def test_not_a_zip_is_refused(tmp_path):
  path = tmp_path / "notes.pt"
  path.write_bytes(b"hello, not a checkpoint")
  with pytest.raises(SourceFormatError, match=r"notes\.pt: not a torch file"):
    load(path)


def test_truncated_zip_is_refused(torch, tmp_path):
  path = _save(torch, {"a": torch.ones(100)}, tmp_path / "cut.pt")
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  with pytest.raises(SourceFormatError, match=r"cut\.pt: truncated or corrupt zip file"):
    load(path)


def test_zip_without_data_pkl_is_refused(tmp_path):
  path = tmp_path / "other.zip"
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("other/readme.txt", "hi")
  with pytest.raises(SourceFormatError, match=r"other\.zip: no single <root>/data\.pkl entry"):
    load(path)


def test_missing_storage_entry_is_named(torch, tmp_path):
  path = _save(torch, {"a": torch.ones(6)}, tmp_path / "foo.pt")
  drop = lambda name, data: None if name == "foo/data/0" else data  # noqa: E731
  with pytest.raises(SourceFormatError, match=r"gone\.pt: entry 'foo/data/0' is missing"):
    load(_rewrite(path, tmp_path / "gone.pt", drop))


def test_truncated_storage_is_named(torch, tmp_path):
  path = _save(torch, {"a": torch.ones(6)}, tmp_path / "foo.pt")
  halve = lambda name, data: data[:12] if name == "foo/data/0" else data  # noqa: E731
  message = r"short\.pt: storage 'foo/data/0' holds 12 bytes, but the pickle needs 24 \(6 x torch\.float32\)"
  with pytest.raises(SourceFormatError, match=message):
    load(_rewrite(path, tmp_path / "short.pt", halve))


# Forged containers: each refused with one error naming the file, in bounded time and memory.


def _small(tmp_path, name="t.pt", storages=None, data=None):
  path = tmp_path / name
  fragment = corpus.tensor("0", 4, 0, (4,), (1,)) if data is None else data
  path.write_bytes(corpus.torch_zip(corpus.pickled(fragment), storages or {"0": bytes(16)}))
  return path


def test_only_regular_files_are_opened(tmp_path):
  fifo = tmp_path / "fifo.pt"
  os.mkfifo(fifo)
  (tmp_path / "dir.pt").mkdir()
  (tmp_path / "zero.pt").symlink_to("/dev/zero")
  for name, kind in [("fifo", "FIFO"), ("dir", "directory"), ("zero", "character device")]:
    with pytest.raises(SourceFormatError, match=rf"{name}\.pt: a {kind}.*not a regular file"):
      load(tmp_path / f"{name}.pt")
  (tmp_path / "link.pt").symlink_to(_small(tmp_path))
  np.testing.assert_array_equal(load(tmp_path / "link.pt"), np.zeros(4, np.float32))


@pytest.mark.parametrize(
  ("forge", "message"),
  [
    (lambda d: corpus.encrypted(d, "archive/data.pkl"), r"'archive/data\.pkl' is encrypted"),
    (lambda d: corpus.stored_past_end(d, "archive/data/0"), r"'archive/data/0' claims .* past"),
    (lambda d: corpus.bzip2_member(), r"uses compression method 12"),
    (lambda d: corpus.deflate_bomb_claimed(), r"'archive/data/0' claims to inflate 5 bytes"),
    (lambda d: corpus.deflate_bomb_hidden(), r"'archive/data\.pkl' is corrupt \(BadZipFile"),
    (lambda d: d[: len(d) // 2], r"truncated or corrupt zip file"),
    (lambda d: d[:-30] + bytes(30), r"truncated or corrupt zip file"),
  ],
  ids=["encrypted", "past the end", "bzip2", "deflate ratio", "inflates past", "cut", "no eocd"],
)
def test_forged_zip_entries(forge, message, tmp_path):
  path = _small(tmp_path)
  path.write_bytes(forge(path.read_bytes()))
  with pytest.raises(SourceFormatError, match=r"t\.pt: .*" + message):
    load(path)


@pytest.mark.parametrize("mmap_", [True, False])
def test_deflated_entries_read_into_memory_are_bounded(mmap_, tmp_path, monkeypatch):
  path = _small(tmp_path, storages={"0": bytes(4096)}, data=corpus.tensor("0", 4, 0, (4,), (1,)))
  _rewrite(path, tmp_path / "d.pt", compression=zipfile.ZIP_DEFLATED)
  np.testing.assert_array_equal(load(tmp_path / "d.pt", mmap=mmap_), np.zeros(4, np.float32))
  monkeypatch.setattr(_torch_zip, "MAX_INFLATED_BYTES", 1024)
  with pytest.raises(SourceFormatError, match=r"'archive/data/0' holds 4096 bytes, more than"):
    load(tmp_path / "d.pt", mmap=mmap_)
  monkeypatch.setattr(_pickle_limits, "MAX_PICKLE_BYTES", 10)
  with pytest.raises(SourceFormatError, match=r"'archive/data\.pkl' holds \d+ bytes, more than"):
    load(path, mmap=mmap_)


def test_repeated_elements_are_bounded(tmp_path, monkeypatch):
  expanded = corpus.tensor("0", 4, 0, (1000, 4), (0, 1))  # 16 bytes read as 16000
  path = _small(tmp_path, data=expanded)
  assert load(path).shape == (1000, 4)
  monkeypatch.setattr(_torch_file, "MAX_BROADCAST_BYTES", 15_000)
  with pytest.raises(SourceFormatError, match=r"repeats its 4 elements to 4000.*MAX_BROADCAST"):
    load(path)
  overlapping = corpus.tensor("0", 4, 0, (2, 3), (1, 1))  # 6 elements from 4
  assert load(_small(tmp_path, "o.pt", data=overlapping)).shape == (2, 3)
  many_dims = corpus.tensor("0", 4, 0, (1,) * 65, (1,) * 65)
  with pytest.raises(SourceFormatError, match=r"disagree"):
    load(_small(tmp_path, "d.pt", data=many_dims))
