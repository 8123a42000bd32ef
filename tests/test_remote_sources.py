"""Hugging Face folders on object stores, read by byte ranges through TensorStore kvstores.

`memory://` and `file://` URLs stand in for `gs://` and `s3://`: the same kvstore reads, so
what is checked here (headers parsed from ranges, each tensor's bytes read once, restores
reading only their rows, damaged or replaced objects refused) holds for buckets too.
"""

import itertools
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax import cli
from ucp_jax.sources import _remote
from ucp_jax.sources.hf import _source as hf_source
from ucp_jax.store import _location

safetensors_numpy = pytest.importorskip("safetensors.numpy")
_ids = itertools.count()

RNG = np.random.default_rng(0)
SD = {
  "model.embed_tokens.weight": RNG.standard_normal((256, 64)).astype(np.float32),
  "model.layers.0.mlp.up_proj.weight": RNG.standard_normal((96, 64)).astype(np.float32),
  "model.norm.weight": np.ones(64, np.float32),
}
CONFIG = {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}


def _upload(url: str, files: dict[str, bytes]) -> None:
  store = _location.kvstore(_location.resolve(url + "/"))
  for name, data in files.items():
    store.write(name, data).result()


def _folder(tmp_path, sharded: bool) -> dict[str, bytes]:
  """A save_pretrained-like folder's files: one safetensors file, or two shards and an index."""
  local = tmp_path / f"hf{next(_ids)}"
  local.mkdir()
  (local / "config.json").write_text(json.dumps(CONFIG))
  if sharded:
    names = sorted(SD)
    parts = {
      "model-00001-of-00002.safetensors": names[:1],
      "model-00002-of-00002.safetensors": names[1:],
    }
    for file, keys in parts.items():
      safetensors_numpy.save_file({k: SD[k] for k in keys}, str(local / file))
    weight_map = {k: file for file, keys in parts.items() for k in keys}
    (local / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  else:
    safetensors_numpy.save_file(SD, str(local / "model.safetensors"))
  return {p.name: p.read_bytes() for p in local.iterdir()}


class _Reads:
  """Records every byte range read from object stores."""

  def __init__(self, monkeypatch):
    self.ranges = []
    real = _remote.Folder.read

    def read(folder, name, start=0, stop=None, generation=None):
      out = real(folder, name, start, stop, generation)
      self.ranges.append((name, start, start + len(out[0])))
      return out

    monkeypatch.setattr(_remote.Folder, "read", read)

  def nbytes(self, name=None) -> int:
    return sum(stop - start for n, start, stop in self.ranges if name in (None, n))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_folder_on_an_object_store_converts_reading_each_tensor_once(
  tmp_path, monkeypatch, sharded
):
  url = f"memory://ucp_remote_{next(_ids)}/models/tiny"
  files = _folder(tmp_path, sharded)
  _upload(url, files)
  reads = _Reads(monkeypatch)
  ucp_jax.convert(url, tmp_path / "out")
  ckpt = ucp_jax.open(tmp_path / "out")
  for name, value in SD.items():
    np.testing.assert_array_equal(ckpt.read(f"params/{name}"), value)
  assert ckpt.manifest.source["config"] == CONFIG
  assert ckpt.manifest.schema["params"]["lm_head.weight"]["tied_to"] == "model.embed_tokens.weight"
  weights = sum(v.nbytes for v in SD.values())
  total = sum(len(v) for k, v in files.items() if k.endswith(".safetensors"))
  # each tensor's bytes once, plus headers, the index, the config and small probes
  assert weights <= reads.nbytes() <= total + 2048
  assert ckpt.verify() == {}


def _byte_range(data: bytes, name: str, rows: tuple[int, int]) -> tuple[int, int]:
  """Where rows [start, stop) of tensor `name` lie in the safetensors file `data`."""
  length = int.from_bytes(data[:8], "little")
  begin = 8 + length + json.loads(data[8 : 8 + length])[name]["data_offsets"][0]
  row = SD[name][0].nbytes
  return begin + rows[0] * row, begin + rows[1] * row


def test_a_restore_from_an_object_store_reads_only_its_rows(tmp_path, monkeypatch):
  url = f"memory://ucp_remote_{next(_ids)}/tiny"
  files = _folder(tmp_path, sharded=False)
  _upload(url, files)
  monkeypatch.setattr(hf_source, "_RANGE_BYTES", 1024)  # requests of 4 rows of 256 bytes
  view = ucp_jax.open(url)
  assert view.plan.format == "hf"
  reads = _Reads(monkeypatch)
  mesh = jax.make_mesh((8,), ("x",))
  name = "model.embed_tokens.weight"
  target = {"params": {name: NamedSharding(mesh, P("x"))}}
  out = ucp_jax.restore(view, target, partial=True)["params"][name]
  np.testing.assert_array_equal(np.asarray(out), SD[name])
  assert reads.nbytes() == SD[name].nbytes  # its rows once, nothing else
  reads.ranges.clear()
  view.read(f"params/{name}", np.s_[41:42])  # from the cells the restore read: no request
  assert reads.ranges == []
  view = ucp_jax.open(url)  # a view of its own: it reads the object again
  reads.ranges.clear()
  np.testing.assert_array_equal(view.read(f"params/{name}", np.s_[41:42]), SD[name][41:42])
  data = files["model.safetensors"]
  assert reads.ranges == [("model.safetensors", *_byte_range(data, name, (40, 44)))]


def test_the_cli_converts_a_file_url(tmp_path):
  url = f"file://{tmp_path}/bucket/tiny"
  _upload(url, _folder(tmp_path, sharded=True))
  assert cli.main(["convert", url, str(tmp_path / "out")]) == 0
  np.testing.assert_array_equal(
    ucp_jax.open(tmp_path / "out").read("params/model.norm.weight"), SD["model.norm.weight"]
  )
  assert cli.main(["inspect", url]) == 0


def test_damaged_or_missing_objects_are_named(tmp_path):
  files = _folder(tmp_path, sharded=True)
  url = f"memory://ucp_remote_{next(_ids)}/a"
  _upload(url, {k: v for k, v in files.items() if k != "model-00002-of-00002.safetensors"})
  with pytest.raises(ucp_jax.SourceFormatError, match=r"model-00002-of-00002\.safetensors, listed"):
    ucp_jax.convert(url, tmp_path / "a")
  url = f"memory://ucp_remote_{next(_ids)}/b"
  single = _folder(tmp_path, sharded=False)
  _upload(url, {**single, "model.safetensors": single["model.safetensors"][:-100]})
  with pytest.raises(ucp_jax.SourceFormatError, match=r"b/model.safetensors: .*truncated"):
    ucp_jax.convert(url, tmp_path / "b")
  url = f"memory://ucp_remote_{next(_ids)}/c"
  _upload(url, {**single, "model.safetensors": b"\xff" * 8 + b"{}"})
  with pytest.raises(ucp_jax.SourceFormatError, match=r"c/model\.safetensors: not a safetensors"):
    ucp_jax.convert(url, tmp_path / "c")
  url = f"memory://ucp_remote_{next(_ids)}/d"
  _upload(url, {"config.json": b"{}", "pytorch_model.bin": b"PK"})
  with pytest.raises(ucp_jax.SourceFormatError, match="read from a local disk only"):
    ucp_jax.convert(url, tmp_path / "d")
  for path in (tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "d"):
    assert not os.path.exists(path)


def test_an_object_replaced_during_the_read_is_refused(tmp_path):
  url = f"file://{tmp_path}/bucket/tiny"
  files = _folder(tmp_path, sharded=False)
  _upload(url, files)
  view = ucp_jax.open(url)
  other = {k: v + 1 for k, v in SD.items()}
  safetensors_numpy.save_file(other, str(tmp_path / "other.safetensors"))
  _upload(url, {"model.safetensors": (tmp_path / "other.safetensors").read_bytes()})
  with pytest.raises(ucp_jax.SourceFormatError, match="replaced while it was read"):
    view.read("params/model.norm.weight")
