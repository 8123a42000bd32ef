"""Hugging Face folders and safetensors files as a source: read in place, lazily, exactly.

Inputs are written by the real libraries (`safetensors.numpy`, `safetensors.torch`,
`transformers`' `save_pretrained`, `torch.save`); forged files start from their output.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax import cli
from ucp_jax.rules import Rule, RuleSet, transpose
from ucp_jax.sources import _registry
from ucp_jax.sources.hf import _safetensors as st

save_file = pytest.importorskip("safetensors.numpy").save_file
RNG = np.random.default_rng(0)

NUMPY_DTYPES = {
  "BOOL": np.bool_,
  "U8": np.uint8,
  "U16": np.uint16,
  "U32": np.uint32,
  "U64": np.uint64,
  "I8": np.int8,
  "I16": np.int16,
  "I32": np.int32,
  "I64": np.int64,
  "F16": np.float16,
  "F32": np.float32,
  "F64": np.float64,
  "C64": np.complex64,
}


def _random(dtype, shape=(3, 5)) -> np.ndarray:
  """Every bit pattern a dtype may hold (random bytes; bools as 0/1)."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return RNG.integers(0, 2, shape).astype(np.bool_)
  raw = RNG.integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8)
  return raw.view(dtype).reshape(shape)


def _same_bits(got: np.ndarray, want: np.ndarray) -> None:
  assert got.dtype == want.dtype and got.shape == want.shape
  assert np.asarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def _header(path) -> tuple[dict, bytes]:
  raw = Path(path).read_bytes()
  n = int.from_bytes(raw[:8], "little")
  return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(path, text: str, data: bytes) -> None:
  encoded = text.encode()
  with open(path, "wb") as f:
    f.write(len(encoded).to_bytes(8, "little") + encoded + data)


# Every dtype, bit-exactly, through open and convert.


def test_every_numpy_dtype_round_trips_bit_exactly(tmp_path):
  want = {name: _random(dtype) for name, dtype in NUMPY_DTYPES.items()}
  want["empty"] = np.zeros((0, 4), np.float32)
  want["scalar"] = np.array(2.5, np.float64)
  save_file(want, tmp_path / "all.safetensors")
  ckpt = ucp_jax.open(tmp_path / "all.safetensors")
  assert ckpt.keys() == sorted(f"params/{n}" for n in want)
  report = ucp_jax.convert(tmp_path / "all.safetensors", tmp_path / "out")
  assert (report.format, report.params, report.step) == ("hf", len(want), None)
  converted = ucp_jax.open(tmp_path / "out")
  for name, array in want.items():
    _same_bits(ckpt.read(f"params/{name}"), array)
    _same_bits(converted.read(f"params/{name}"), array)
  assert converted.manifest.source["framework"] == "transformers"


def test_bfloat16_and_every_float8_round_trip_bit_exactly(tmp_path):
  torch = pytest.importorskip("torch")
  from safetensors.torch import save_file as torch_save_file

  kinds = {
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
  }
  tensors = {}
  for name, dtype in kinds.items():
    raw = torch.randint(0, 256, (4, 6 * dtype.itemsize), dtype=torch.uint8)
    tensors[name] = raw.view(dtype)
  torch_save_file(tensors, tmp_path / "f8.safetensors")
  header, _ = _header(tmp_path / "f8.safetensors")
  assert {n: e["dtype"] for n, e in header.items() if n != "__metadata__"} == {n: n for n in kinds}
  ucp_jax.convert(tmp_path / "f8.safetensors", tmp_path / "out")
  for where in (tmp_path / "f8.safetensors", tmp_path / "out"):
    ckpt = ucp_jax.open(where)
    for name, tensor in tensors.items():
      got = ckpt.read(f"params/{name}")
      assert got.dtype == st.DTYPES[name] and got.shape == (4, 6)
      assert got.tobytes() == tensor.view(torch.uint8).numpy().tobytes(), name


def test_packed_four_bit_floats_are_refused_by_name(tmp_path):
  torch = pytest.importorskip("torch")
  from safetensors.torch import save_file as torch_save_file

  packed = torch.zeros(2, 3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
  torch_save_file({"w": packed}, tmp_path / "f4.safetensors")
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(tmp_path / "f4.safetensors")
  assert str(e.value) == (
    f"{tmp_path / 'f4.safetensors'}: a damaged or forged safetensors header: tensor 'w': dtype "
    "'F4' (packed 4-bit floats, two per byte) is not one ucp_jax reads"
  )


# Lazy: a device reads its slice, straight from the file.

_LIBC = ctypes.CDLL(None, use_errno=True)


def _cached_bytes(path) -> int:
  """Bytes of the file in the page cache (mincore over a fresh, untouched mapping)."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  view = np.frombuffer(mapped, np.uint8)
  pages = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
  address = ctypes.c_void_p(view.__array_interface__["data"][0])
  assert _LIBC.mincore(address, ctypes.c_size_t(size), pages) == 0, ctypes.get_errno()
  del view
  mapped.close()
  return sum(p & 1 for p in pages) * mmap.PAGESIZE


def _drop_from_cache(path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def _record_preads(monkeypatch) -> list[tuple[int, int]]:
  """Every (file offset, bytes) the checkpoint view reads, as it reads them."""
  from ucp_jax.sources import _file_reads

  reads, pread, scatter = [], _file_reads._pread, _file_reads._scatter_rows

  def recorded(path, start, out, identity=()):
    reads.append((start, out.nbytes))
    return pread(path, start, out, identity)

  def recorded_scatter(path, start, outs, identity=()):  # whole rows split over the buffers
    reads.append((start, sum(out.nbytes for out in outs)))
    return scatter(path, start, outs, identity)

  monkeypatch.setattr(_file_reads, "_pread", recorded)
  monkeypatch.setattr(_file_reads, "_scatter_rows", recorded_scatter)
  return reads


@pytest.mark.parametrize(
  ("spec", "expected"),
  [
    (P("x", None), "each device its own rows, one read each"),
    (P("x", "y"), "each row block once, shared by the devices that split its columns"),
  ],
)
def test_restore_onto_a_mesh_reads_each_byte_once(tmp_path, monkeypatch, devices, spec, expected):
  data = RNG.standard_normal((16, 4096)).astype(np.float32)
  path = tmp_path / "w.safetensors"
  save_file({"w": data}, path)
  begin = st.read_header(str(path)).tensors["w"].begin
  reads = _record_preads(monkeypatch)
  mesh = (
    jax.make_mesh((8,), ("x",), devices=devices)
    if spec == P("x", None)
    else jax.make_mesh((2, 4), ("x", "y"), devices=devices)
  )
  sharding = NamedSharding(mesh, spec)
  target = {"w": jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)}
  restored = ucp_jax.restore(path, target, subtree="params")
  np.testing.assert_array_equal(np.asarray(restored["w"]), data)
  assert sum(n for _, n in reads) == data.nbytes, expected  # nothing twice, nothing extra
  row = data.shape[1] * 4
  if spec == P("x", None):  # 8 reads, each exactly a device's 2 rows
    assert sorted(reads) == [(begin + 2 * i * row, 2 * row) for i in range(8)]
  else:  # 2 reads: the 8 rows each half of the mesh needs
    assert sorted(reads) == [(begin, 8 * row), (begin + 8 * row, 8 * row)]


def test_a_process_that_needs_some_columns_reads_those_only(tmp_path, monkeypatch):
  from ucp_jax.sources import _file_reads
  from ucp_jax.store import _byte_runs

  data = RNG.standard_normal((16, 4096)).astype(np.float32)
  path = tmp_path / "w.safetensors"
  save_file({"w": data}, path)
  begin = st.read_header(str(path)).tensors["w"].begin
  reads = _record_preads(monkeypatch)
  regions = [(slice(0, 16), slice(1024, 1536)), (slice(0, 16), slice(1536, 2048))]
  tasks = _file_reads.tensor_reads(str(path), begin, data.shape, data.dtype, regions)
  outs, wait = _byte_runs.start_read(regions, data.dtype, tasks)
  wait()
  for region, out in zip(regions, outs):
    np.testing.assert_array_equal(out, data[region])
  assert reads == [(begin + r * 4096 * 4 + 1024 * 4, 1024 * 4) for r in range(16)]


def test_a_tensor_is_a_memory_map_of_exactly_its_bytes(tmp_path):
  data = {"a": _random(np.float32, (64, 33)), "b": _random(np.int16, (7,))}
  save_file(data, tmp_path / "m.safetensors")
  ckpt = ucp_jax.open(tmp_path / "m.safetensors")
  header, _ = _header(tmp_path / "m.safetensors")
  start = 8 + int.from_bytes((tmp_path / "m.safetensors").read_bytes()[:8], "little")
  for name in data:
    array = ckpt.array(f"params/{name}")
    base = array
    while not isinstance(base, mmap.mmap):
      base = base.base if isinstance(base, np.ndarray) else base.obj
    origin = np.frombuffer(base, np.uint8, 1).__array_interface__["data"][0]
    begin, end = header[name]["data_offsets"]
    assert array.__array_interface__["data"][0] - origin == start + begin
    assert array.nbytes == end - begin and not array.flags.writeable


# The CLI and the registry, without converting.


def test_ucp_inspect_reads_a_folder_in_place(tmp_path, capsys):
  save_file({"model.norm.weight": np.ones(4, np.float32)}, tmp_path / "model.safetensors")
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
  before = sorted(os.listdir(tmp_path))
  assert cli.main(["inspect", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "params/model.norm.weight" in out and "format: hf, read in place" in out
  assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
  data = json.loads(capsys.readouterr().out)
  assert data["source"]["architectures"] == ["LlamaForCausalLM"]
  assert data["source"]["files"] == ["model.safetensors"] and data["total_bytes"] == 16
  assert sorted(os.listdir(tmp_path)) == before


def test_sniffing_finds_hf_for_folders_and_files(tmp_path):
  save_file({"x": np.ones(2, np.float32)}, tmp_path / "a.safetensors")
  assert _registry.sniff(tmp_path).NAME == "hf"
  assert _registry.sniff(tmp_path / "a.safetensors").NAME == "hf"
  config_only = tmp_path / "cfg"
  config_only.mkdir()
  (config_only / "config.json").write_text("{}")
  assert _registry.sniff(config_only).NAME == "hf"  # weakly: its error lists the weights
  with pytest.raises(ucp_jax.SourceFormatError, match=r"a Hugging Face folder without weights"):
    ucp_jax.open(config_only)
  (config_only / "model.pt").write_bytes(b"")
  assert _registry.sniff(config_only).NAME == "torch"  # config.json beside one torch file
  with pytest.raises(ucp_jax.SourceFormatError, match=r"found model.pt: read it with source='to"):
    ucp_jax.open(config_only, source="hf")


def test_the_tie_comes_from_the_config(tmp_path):
  save_file(
    {"model.embed_tokens.weight": np.ones((4, 2), np.float32), "model.norm.weight": np.ones(2)},
    tmp_path / "model.safetensors",
  )
  config = {"architectures": ["LlamaForCausalLM"]}  # tie_word_embeddings defaults to true
  (tmp_path / "config.json").write_text(json.dumps(config))
  schema = ucp_jax.open(tmp_path).manifest.schema
  assert schema["params"]["lm_head.weight"] == {
    "value": "params/model.embed_tokens.weight",
    "slots": {},
    "group": None,
    "frozen": False,
    "tied_to": "model.embed_tokens.weight",
  }
  (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
  assert "lm_head.weight" not in ucp_jax.open(tmp_path).manifest.schema["params"]
  plan = _registry.describe(tmp_path, tied={"out.weight": "model.norm.weight"})
  assert [(p.name, p.tied_to) for p in plan.params if p.tied_to] == [
    ("out.weight", "model.norm.weight")
  ]
  with pytest.raises(ucp_jax.SourceFormatError, match=r"'a' -> 'b': no tensor 'b'"):
    _registry.describe(tmp_path, tied={"a": "b"})


# Bad input: one clear error naming file and tensor, through open, convert and inspect.


def _two_shards(folder, drop_from_index: str | None = None):
  folder.mkdir()
  save_file({"a": np.ones(3, np.float32)}, folder / "model-00001-of-00002.safetensors")
  save_file(
    {"b": np.ones(3, np.float32), "c": np.ones(2)}, folder / "model-00002-of-00002.safetensors"
  )
  weight_map = {"a": "model-00001-of-00002.safetensors"}
  weight_map |= {n: "model-00002-of-00002.safetensors" for n in ("b", "c")}
  weight_map.pop(drop_from_index, None)
  index = {"metadata": {}, "weight_map": weight_map}
  (folder / "model.safetensors.index.json").write_text(json.dumps(index))
  return folder


def _missing_shard(tmp_path):
  folder = _two_shards(tmp_path / "hf")
  os.remove(folder / "model-00002-of-00002.safetensors")
  return folder, folder / "model.safetensors.index.json", "shard model-00002-of-00002.safetensors"


def _unlisted(tmp_path):
  folder = _two_shards(tmp_path / "hf", drop_from_index="c")
  index = folder / "model.safetensors.index.json"
  return folder, index, "model-00002-of-00002.safetensors holds tensor 'c', which the index does"


def _forged(tmp_path, edit):
  path = tmp_path / "w.safetensors"
  save_file({"a": np.ones(4, np.float32), "b": np.zeros(4, np.float32)}, path)
  header, data = _header(path)
  _write_header(path, edit(header, data), data)
  return path


def _past_the_end(tmp_path):
  def edit(header, data):
    header["b"]["data_offsets"] = [len(data), len(data) + 16]
    return json.dumps(header)

  return _forged(tmp_path, edit), None, "truncated: "


def _overlapping(tmp_path):
  def edit(header, data):
    header["b"]["data_offsets"] = [8, 24]
    return json.dumps(header)

  return _forged(tmp_path, edit), None, "tensors 'a' and 'b' overlap"


def _duplicated(tmp_path):
  def edit(header, data):
    return '{"b": ' + json.dumps(header["b"]) + ", " + json.dumps(header)[1:]

  return _forged(tmp_path, edit), None, "tensor 'b' appears twice"


def _bin_with_a_number(tmp_path):
  torch = pytest.importorskip("torch")
  folder = tmp_path / "hf"
  folder.mkdir()
  (folder / "config.json").write_text("{}")
  torch.save({"w": torch.ones(3), "n": 3}, folder / "pytorch_model.bin")
  return folder, folder / "pytorch_model.bin", "['n'] holds int 3, not a tensor"


BAD = {
  "index names a missing shard": _missing_shard,
  "shard holds a tensor the index does not list": _unlisted,
  "header offsets past the end of the file": _past_the_end,
  "overlapping tensors": _overlapping,
  "a name twice": _duplicated,
  "a .bin state dict with a number": _bin_with_a_number,
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_clear_error(case, tmp_path, capsys):
  path, named, says = BAD[case](tmp_path)
  named = named or path
  before = sorted(os.listdir(tmp_path))
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(path)
  message = str(e.value)
  assert message.startswith(f"{named}: ") and says in message and "\n" not in message
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.convert(path, tmp_path / "dst")
  assert str(e.value) == message
  assert sorted(os.listdir(tmp_path)) == before  # nothing committed, nothing staged
  assert cli.main(["inspect", str(path)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"error: {message}"]


def test_every_problem_of_a_header_at_once(tmp_path):
  def edit(header, data):
    header["a"]["dtype"] = "F3"
    header["b"]["shape"] = [5]
    return json.dumps(header)

  path = _forged(tmp_path, edit)
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(path)
  assert str(e.value) == (
    f"{path}: a damaged or forged safetensors header: "
    "tensor 'a': dtype 'F3' (not a safetensors dtype) is not one ucp_jax reads; "
    "tensor 'b': 16 bytes for shape [5] of F32 (20)"
  )


def _edit_index(folder, edit):
  path = folder / "model.safetensors.index.json"
  index = json.loads(path.read_text())
  edit(index["weight_map"])
  path.write_text(json.dumps(index))
  return path


def test_every_way_an_index_and_its_shards_disagree(tmp_path):
  folder = _two_shards(tmp_path / "a")
  (tmp_path / "x.safetensors").write_bytes(
    (folder / "model-00001-of-00002.safetensors").read_bytes()
  )
  index = _edit_index(folder, lambda m: m.update(a="../x.safetensors"))
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(folder)
  assert str(e.value) == (
    f"{index}: the index names shards that cannot be read: shard '../x.safetensors', listed for "
    "tensor 'a', lies outside the folder"
  )
  folder = _two_shards(tmp_path / "b")
  save_file(
    {"a": np.ones(3, np.float32), "d": np.ones(1)}, folder / "model-00002-of-00002.safetensors"
  )
  index = _edit_index(folder, lambda m: m.update(d="model-00001-of-00002.safetensors"))
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(folder)
  assert str(e.value) == (  # found as soon as the second shard is read
    f"{index}: the shards do not match the index: "
    "model-00002-of-00002.safetensors holds tensor 'd', which the index puts in "
    "model-00001-of-00002.safetensors; "
    "model-00002-of-00002.safetensors holds tensor 'a', which the index puts in "
    "model-00001-of-00002.safetensors"
  )
  folder = _two_shards(tmp_path / "c")
  index = _edit_index(folder, lambda m: m.update(e="model-00002-of-00002.safetensors"))
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(folder)
  assert str(e.value) == (
    f"{index}: the shards do not match the index: "
    "tensor 'e': listed in the index for model-00002-of-00002.safetensors, which does not hold it"
  )


def test_a_header_longer_than_its_file_and_a_symlinked_file(tmp_path):
  save_file({"w": np.arange(4, dtype=np.float32)}, tmp_path / "blob")
  os.symlink(tmp_path / "blob", tmp_path / "model.safetensors")  # a link inside the folder
  np.testing.assert_array_equal(ucp_jax.open(tmp_path).read("params/w"), np.arange(4))
  raw = (tmp_path / "blob").read_bytes()
  (tmp_path / "blob").write_bytes((10**6).to_bytes(8, "little") + raw[8:])
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(tmp_path / "model.safetensors")
  assert str(e.value) == (  # the length is the file's bytes: not shown
    f"{tmp_path / 'model.safetensors'}: not a safetensors file (its header length runs past "
    f"the end of the file, {len(raw)} bytes): truncated, or another kind of file"
  )


# transformers' own folders: a tiny Llama, sharded, tied, and as pytorch_model.bin.


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  os.environ["HF_HUB_OFFLINE"] = "1"
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  folders = {}
  for tie in (False, True):
    config = transformers.LlamaConfig(
      vocab_size=64,
      hidden_size=16,
      intermediate_size=32,
      num_hidden_layers=2,
      num_attention_heads=2,
      num_key_value_heads=1,
      max_position_embeddings=32,
      tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(config)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    root = tmp_path_factory.mktemp(f"llama_tie{tie}")
    model.save_pretrained(root / "sharded", max_shard_size="4KB")
    model.save_pretrained(root / "single")
    (root / "bin").mkdir()
    (root / "bin" / "config.json").write_text((root / "single" / "config.json").read_text())
    torch.save(model.state_dict(), root / "bin" / "pytorch_model.bin")
    folders[tie] = root, state
  return folders


def _replicated(state: dict, devices) -> dict:
  mesh = jax.make_mesh((2, 4), ("x", "y"), devices=devices)
  return {
    name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P()))
    for name, a in state.items()
  }


@pytest.mark.parametrize("layout", ["sharded", "single", "bin"])
def test_a_llama_folder_restores_to_the_torch_state_dict_exactly(llama, layout, devices):
  root, state = llama[False]
  folder = root / layout
  if layout == "sharded":
    assert len([n for n in os.listdir(folder) if n.endswith(".safetensors")]) > 2
  ckpt = ucp_jax.open(folder)
  assert ckpt.manifest.source["architectures"] == ["LlamaForCausalLM"]
  restored = ucp_jax.restore(folder, _replicated(state, devices), subtree="params")
  assert sorted(restored) == sorted(state)
  for name, array in state.items():
    _same_bits(np.asarray(restored[name]), array)


def test_a_tied_llama_records_the_tie(llama, tmp_path):
  root, state = llama[True]
  for layout in ("single", "sharded", "bin"):
    schema = ucp_jax.open(root / layout).manifest.schema
    assert schema["params"]["lm_head.weight"]["tied_to"] == "model.embed_tokens.weight", layout
    assert "params/lm_head.weight" not in ucp_jax.open(root / layout)
  report = ucp_jax.convert(root / "sharded", tmp_path / "c")
  converted = ucp_jax.open(tmp_path / "c")
  entry = converted.manifest.schema["params"]["lm_head.weight"]
  assert entry["value"] == "params/model.embed_tokens.weight" and report.params == len(state)
  _same_bits(converted.read("params/model.embed_tokens.weight"), state["lm_head.weight"])


def test_rules_map_a_hf_folder_while_restoring(llama, devices):
  root, state = llama[False]
  rules = RuleSet(
    [
      Rule(
        r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers/{0}/down/kernel", [transpose()]
      ),
      Rule(r"model\.norm\.weight", "norm/scale"),
    ]
  )
  mesh = jax.make_mesh((2, 4), ("x", "y"), devices=devices)
  down = state["model.layers.1.mlp.down_proj.weight"].T
  target = {
    "layers": {
      "1": {
        "down": {
          "kernel": jax.ShapeDtypeStruct(
            down.shape, down.dtype, sharding=NamedSharding(mesh, P("x", "y"))
          )
        }
      }
    },
    "norm": {
      "scale": jax.ShapeDtypeStruct((16,), np.float32, sharding=NamedSharding(mesh, P("y")))
    },
  }
  out = ucp_jax.restore(root / "sharded", target, subtree="params", rules=rules, partial=True)
  _same_bits(np.asarray(out["layers"]["1"]["down"]["kernel"]), down)
  _same_bits(np.asarray(out["norm"]["scale"]), state["model.norm.weight"])


def test_a_sharded_pytorch_model_bin_is_checked_against_its_index(llama, tmp_path):
  torch = pytest.importorskip("torch")
  _, state = llama[False]
  names = sorted(state)
  half = len(names) // 2
  weight_map = {}
  for i, part in enumerate((names[:half], names[half:])):
    file = f"pytorch_model-0000{i + 1}-of-00002.bin"
    torch.save({n: torch.from_numpy(state[n]) for n in part}, tmp_path / file)
    weight_map |= dict.fromkeys(part, file)
  index = tmp_path / "pytorch_model.bin.index.json"
  index.write_text(json.dumps({"weight_map": weight_map}))
  ckpt = ucp_jax.open(tmp_path)
  for name, array in state.items():
    _same_bits(ckpt.read(f"params/{name}"), array)
  weight_map[names[0]] = "pytorch_model-00002-of-00002.bin"
  index.write_text(json.dumps({"weight_map": weight_map}))
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(tmp_path)
  assert str(e.value) == (
    f"{index}: the shards do not match the index: pytorch_model-00001-of-00002.bin holds tensor "
    f"{names[0]!r}, which the index puts in pytorch_model-00002-of-00002.bin"
  )


def test_a_single_file_converts_whatever_its_size(tmp_path, monkeypatch):
  from ucp_jax.sources import _convert

  monkeypatch.setattr(_convert, "GROWTH_SLACK", 0)  # as for a file larger than the slack
  save_file({"w": np.ones(1000, np.float32)}, tmp_path / "w.safetensors")
  assert ucp_jax.convert(tmp_path / "w.safetensors", tmp_path / "out").bytes == 4000


def test_a_file_replaced_after_it_was_opened_is_refused(tmp_path, devices):
  save_file({"a": np.ones(4, np.float32)}, tmp_path / "model.safetensors")
  view = ucp_jax.open(tmp_path)
  save_file({"b": np.ones(2, np.float32), "a": np.full(4, 7, np.float32)}, tmp_path / "x")
  os.replace(tmp_path / "x", tmp_path / "model.safetensors")  # other bytes at other offsets
  target = {
    "a": jax.ShapeDtypeStruct(
      (4,), np.float32, sharding=jax.sharding.SingleDeviceSharding(devices[0])
    )
  }
  with pytest.raises(ucp_jax.SourceFormatError, match="changed since it was opened"):
    ucp_jax.restore(view, target, subtree="params")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_transposed_and_head_split_slices_are_laid_out_exactly(tmp_path, monkeypatch, dtype):
  """Kernels as the Llama rules read them (transpose; transpose then a head split, on either
  axis), large enough for the tiled copy through a CPU device, cut into several pieces per
  device, onto a 2 x 4 mesh: every element where numpy's transpose and reshape put it. float64
  (which JAX narrows where x64 is off) takes TensorStore's copy instead, as exact."""
  from ucp_jax.mapping import _mapped
  from ucp_jax.tree import _devices

  monkeypatch.setattr(_mapped, "PIECE_BYTES", 64 << 10)  # several pieces per device slice
  dense, copies = _devices.dense_copy, []

  def counted(view, out):
    copies.append(view.strides[-1] != view.itemsize)
    return dense(view, out)

  monkeypatch.setattr(_devices, "dense_copy", counted)
  heads, k, d = 8, 32, 256
  sd = {
    "fc.weight": _random(dtype, (384, d)),  # [out, in] -> [in, out]
    "q.weight": _random(dtype, (heads * k, d)),  # [h*k, d] -> [d, h, k]
    "o.weight": _random(dtype, (d, heads * k)),  # [d, h*k] -> [h, k, d]
  }
  save_file(sd, tmp_path / "model.safetensors")
  split = ucp_jax.rules.split
  rs = RuleSet(
    [
      Rule(r"fc\.weight", "fc/kernel", [transpose()]),
      Rule(r"q\.weight", "q/kernel", [transpose(), split(1, (heads, k))]),
      Rule(r"o\.weight", "o/kernel", [transpose(), split(0, (heads, k))]),
    ]
  )
  want = {
    "fc": {"kernel": sd["fc.weight"].T},
    "q": {"kernel": sd["q.weight"].T.reshape(d, heads, k)},
    "o": {"kernel": sd["o.weight"].T.reshape(heads, k, d)},
  }
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  specs = {"fc": P("data", "model"), "q": P("data", "model"), "o": P("model", None, "data")}
  target = {
    name: {
      "kernel": jax.ShapeDtypeStruct(
        want[name]["kernel"].shape, dtype, sharding=NamedSharding(mesh, specs[name])
      )
    }
    for name in want
  }
  as_numpy = ucp_jax.restore(tmp_path, subtree="params", rules=rs)  # one region each, whole
  for name in want:
    _same_bits(as_numpy[name]["kernel"], want[name]["kernel"])
  if dtype != "float64":  # (a float64 jax.Array needs x64)
    restored = ucp_jax.restore(tmp_path, target, subtree="params", rules=rs)
    for name in want:
      got = restored[name]["kernel"]
      assert got.sharding == target[name]["kernel"].sharding
      _same_bits(np.asarray(got), want[name]["kernel"])
  if dtype == "float64" and not jax.config.jax_enable_x64:
    assert not copies  # TensorStore's copy: JAX would have narrowed the values
  else:
    assert any(copies)  # the strided pieces went through the tiled copy


def test_rows_split_over_column_slices_are_read_in_place(tmp_path, monkeypatch):
  """Whole rows read once, each row's bytes split over the devices' buffers by `preadv` (more
  rows than one call takes, and reads that come back short): exact, nothing read twice."""
  from ucp_jax.sources import _file_reads

  monkeypatch.setattr(_file_reads, "_IOV_MAX", 64)  # 16 rows per call for 4 buffers
  data = RNG.standard_normal((100, 64)).astype(np.float32)
  save_file({"w": data}, tmp_path / "w.safetensors")
  preadv, calls = os.preadv, []

  def short(fd, buffers, at):  # the first buffer of a call half filled, then the call ends
    calls.append(len(buffers))
    if len(calls) % 3 == 0:
      half = memoryview(buffers[0]).cast("B")[: len(memoryview(buffers[0]).cast("B")) // 2]
      return preadv(fd, [half], at)
    return preadv(fd, buffers, at)

  monkeypatch.setattr(_file_reads.os, "preadv", short)
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  sharding = NamedSharding(mesh, P("x", "y"))
  target = {"w": jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)}
  restored = ucp_jax.restore(tmp_path / "w.safetensors", target, subtree="params")
  np.testing.assert_array_equal(np.asarray(restored["w"]), data)
  assert max(calls) == 64 and len(calls) > 4  # several calls per row block, some redone


@pytest.mark.parametrize("spec", [P("data", None, "model"), P(None, "model", "data")])
def test_stacked_layers_are_read_directly_and_laid_out_exactly(tmp_path, monkeypatch, spec):
  """Per-layer torch weights stacked into one `[layers, in, out]` kernel (a scanned model, the
  experts of a layer): each device reads its layers' slices straight from the files, laid
  out as numpy's stack of transposes; the same through a ucp_jax checkpoint's chunk files."""
  from ucp_jax.mapping import _mapped

  monkeypatch.setattr(_mapped, "PIECE_BYTES", 64 << 10)
  direct, layers = [], 4
  start_read = _mapped.MappedCheckpoint.start_read

  def recorded(self, key, regions):
    direct.append(key)
    return start_read(self, key, regions)

  monkeypatch.setattr(_mapped.MappedCheckpoint, "start_read", recorded)
  sd = {f"layers.{i}.fc.weight": _random("bfloat16", (384, 256)) for i in range(layers)}
  save_file(sd, tmp_path / "model.safetensors")
  rs = RuleSet(
    [Rule(r"layers\.(\d+)\.fc\.weight", "layers/fc/kernel", [transpose(), ucp_jax.rules.stack(0)])]
  )
  want = np.stack([sd[f"layers.{i}.fc.weight"].T for i in range(layers)])
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  target = {
    "layers": {
      "fc": {
        "kernel": jax.ShapeDtypeStruct(want.shape, "bfloat16", sharding=NamedSharding(mesh, spec))
      }
    }
  }
  got = ucp_jax.restore(tmp_path, target, subtree="params", rules=rs)
  _same_bits(np.asarray(got["layers"]["fc"]["kernel"]), want)
  assert direct == ["params/layers/fc/kernel"]
  # the same from a ucp_jax checkpoint of the torch names (chunk files read directly)
  ucp_jax.save(tmp_path / "c", {"params": {k: np.asarray(v) for k, v in sd.items()}})
  again = ucp_jax.restore(tmp_path / "c", target, subtree="params", rules=rs)
  _same_bits(np.asarray(again["layers"]["fc"]["kernel"]), want)
  assert direct == ["params/layers/fc/kernel"] * 2
