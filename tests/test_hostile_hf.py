"""Hugging Face folders and safetensors files, corrupted as a hostile user would.

Every case starts from real files: folders `transformers` wrote with `save_pretrained` (a tiny
random Llama, whole and sharded), `torch.save` state dicts, and `safetensors.numpy.save_file`
output; then a header, an index or a `config.json` is edited, a file is cut, replaced by a
FIFO or a link, or made to declare more than memory holds. Each goes through every entry
point (`hostile_run`: `ucp inspect`, `verify`, `convert`, `diff`, `open().read`, `restore` to
numpy and onto 8 devices) in one limited process per batch: one line naming the file, no
traceback, no signal, no hang. Object stores (`memory://`), `ucp_jax.rules.from_hf` and
`--rules hf:config=` run the same checks in process. Links: a Hugging Face cache folder
(`snapshots/<rev>/` files linking into `../../blobs/`) converts and restores; every other
link out of the folder is refused without reading its target.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import hostile_run as hr
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax import cli, rules
from ucp_jax.store import _location

save_file = pytest.importorskip("safetensors.numpy").save_file
DEEP = "[" * 100_000 + "]" * 100_000
SECRET = b"TOPSECRETKEY\x00\x00\x00\x00" * 64  # a file outside every checkpoint
SINGLE, SHARDED, BIN = "single", "sharded", "bin"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
  """A tiny random Llama as `transformers` saves it: whole, sharded, and as pytorch_model.bin."""
  os.environ["HF_HUB_OFFLINE"] = "1"
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
    tie_word_embeddings=False,
  )
  model = transformers.LlamaForCausalLM(config)
  root = tmp_path_factory.mktemp("saved")
  model.save_pretrained(root / SINGLE)
  model.save_pretrained(root / SHARDED, max_shard_size="4KB")
  (root / BIN).mkdir()
  shutil.copy(root / SINGLE / "config.json", root / BIN / "config.json")
  torch.save(model.state_dict(), root / BIN / "pytorch_model.bin")
  return root


def _copy(saved: Path, layout: str, folder: Path) -> Path:
  return Path(shutil.copytree(saved / layout, folder / "hf"))


def _split(path: Path) -> tuple[dict, bytes]:
  raw = path.read_bytes()
  n = int.from_bytes(raw[:8], "little")
  return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(path: Path, text: str | bytes, data: bytes) -> None:
  raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
  path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def _shards(hf: Path) -> list[Path]:
  return sorted(hf.glob("model-*.safetensors"))


# Case makers: each returns make(folder) -> the path a user gives.


def _header(saved: Path, edit, layout: str = SINGLE):
  """The folder with its (first) safetensors file's header text replaced by `edit(header)`."""

  def make(folder: Path) -> Path:
    hf = _copy(saved, layout, folder)
    path = hf / "model.safetensors" if layout == SINGLE else _shards(hf)[0]
    header, data = _split(path)
    _join(path, edit(header), data)
    return hf

  return make


def _entry(**fields):
  """An edit of the first tensor's entry (in file order)."""

  def edit(header: dict) -> str:
    first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    header[first].update(fields)
    return json.dumps(header)

  return edit


def _bytes_of(saved: Path, cut, layout: str = SINGLE, name: str = "model.safetensors"):
  """The folder with a file's bytes replaced by `cut(raw)`."""

  def make(folder: Path) -> Path:
    hf = _copy(saved, layout, folder)
    path = hf / name
    path.write_bytes(cut(path.read_bytes()))
    return hf

  return make


def _file(saved: Path, name: str, how: str, layout: str = SINGLE):
  """The folder with file `name` replaced by a FIFO, a directory, or a link out or in."""

  def make(folder: Path) -> Path:
    hf = _copy(saved, layout, folder)
    target = hf / (_shards(hf)[0].name if name == "shard" else name)
    original = target.read_bytes()
    target.unlink()
    if how == "fifo":
      os.mkfifo(target)
    elif how == "directory":
      target.mkdir()
    elif how == "link out":  # even the right bytes may not be read through it
      (folder / "outside").write_bytes(original)
      target.symlink_to(folder / "outside")
    elif how == "link to a secret":
      (folder / "id_rsa").write_bytes(SECRET)
      target.symlink_to(folder / "id_rsa")
    elif how == "link to /dev/zero":
      target.symlink_to("/dev/zero")
    elif how == "link in":
      (hf / "kept").mkdir()
      (hf / "kept" / name).write_bytes(original)
      target.symlink_to(Path("kept") / name)
    return hf

  return make


def _index(saved: Path, edit, text: str | None = None):
  """The sharded folder with its index's `weight_map` changed by `edit` (or the index's text
  replaced by `text`)."""

  def make(folder: Path) -> Path:
    hf = _copy(saved, SHARDED, folder)
    path = hf / "model.safetensors.index.json"
    if text is not None:
      path.write_text(text)
      return hf
    index = json.loads(path.read_text())
    index["weight_map"] = edit(index["weight_map"], hf)
    path.write_text(json.dumps(index))
    return hf

  return make


def _unlisted(weight_map: dict, hf: Path) -> dict:
  """Leaves out of the index a tensor of a shard that holds others (still read)."""
  files = list(weight_map.values())
  name = next(k for k, v in sorted(weight_map.items()) if files.count(v) > 1)
  return {k: v for k, v in weight_map.items() if k != name}


def _outside_shard(weight_map: dict, hf: Path) -> dict:
  first = sorted(weight_map)[0]
  shutil.copy(hf / weight_map[first], hf.parent / "x.safetensors")  # a real file, outside
  return {**weight_map, first: "../x.safetensors"}


def _duplicated_across_shards(weight_map: dict, hf: Path) -> dict:
  a, b = _shards(hf)[:2]
  header_a, _ = _split(a)
  header_b, data_b = _split(b)
  name = next(k for k in header_a if k != "__metadata__")
  entry = header_a[name]
  size = entry["data_offsets"][1] - entry["data_offsets"][0]
  header_b[name] = {**entry, "data_offsets": [len(data_b), len(data_b) + size]}
  _join(b, json.dumps(header_b), data_b + bytes(size))  # a real tensor, in two shards
  return weight_map


def _bin_index(saved: Path, shard: str, link: bool = False):
  """The .bin folder with an index naming every tensor in `shard`; with `link`, that shard a
  link to a copy of pytorch_model.bin outside the folder."""

  def make(folder: Path) -> Path:
    hf = _copy(saved, BIN, folder)
    names = ucp_jax.open(hf).keys()
    weight_map = {k.split("/", 1)[1]: shard for k in names if k.startswith("params/")}
    (hf / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(hf / "pytorch_model.bin", folder / "outside.bin")
    if link:
      (hf / shard).symlink_to(folder / "outside.bin")
    return hf

  return make


def _config(saved: Path, text_of):
  """The folder with its config.json replaced by `text_of(config)` (text or bytes)."""

  def make(folder: Path) -> Path:
    hf = _copy(saved, SINGLE, folder)
    path = hf / "config.json"
    text = text_of(json.loads(path.read_text()))
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return hf

  return make


def _nested(depth: int) -> list:
  value: list = []
  for _ in range(depth - 1):
    value = [value]
  return value


def _set_config(**fields):
  return lambda config: json.dumps({**config, **fields})


def _hf_cache(saved: Path, escape: bool = False):
  """The folder as huggingface_hub's cache lays it out: `models--org--name/blobs/<hash>`, and
  `snapshots/<revision>/<file>` a relative link to `../../blobs/<hash>`; with `escape`, the
  weights link out of the repository."""

  def make(folder: Path) -> Path:
    repo = folder / "models--tiny--llama"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    snapshot.mkdir(parents=True)
    for path in sorted((saved / SHARDED).iterdir()):
      blob = repo / "blobs" / f"{abs(hash(path.name)):x}"
      shutil.copy(path, blob)
      (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    if escape:
      shard = _shards(snapshot)[0]
      (folder / "outside.safetensors").write_bytes(shard.read_bytes())
      shard.unlink()
      shard.symlink_to(Path("..") / ".." / ".." / "outside.safetensors")
    return snapshot

  return make


def _sparse(saved: Path, nbytes: int):
  """A real file whose header is edited to declare one tensor of `nbytes`, and which is
  extended to hold them: a sparse file, a few KiB on disk."""

  def make(folder: Path) -> Path:
    hf = _copy(saved, SINGLE, folder)
    path = hf / "model.safetensors"
    header, _ = _split(path)
    header = {"__metadata__": header["__metadata__"]}
    header["model.embed_tokens.weight"] = {
      "dtype": "F32",
      "shape": [nbytes // 4],
      "data_offsets": [0, nbytes],
    }
    _join(path, json.dumps(header), b"")
    with open(path, "r+b") as f:
      f.truncate(path.stat().st_size + nbytes)
    return hf

  return make


def _empty_tensors(count: int):
  def edit(header: dict) -> str:
    entries = {
      f"e{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)
    }
    return json.dumps({"__metadata__": header["__metadata__"], **entries})

  return edit


def _numpy_file(edit=None, link: bool = False):
  """A file `safetensors.numpy.save_file` wrote, given by its path; its header text replaced
  by `edit(header)`; with `link`, the path is a link to it from another folder."""

  def make(folder: Path) -> Path:
    (folder / "w").mkdir()
    path = folder / "w" / "w.safetensors"
    arrays = {"a": np.arange(16, dtype=np.float32).reshape(4, 4), "b": np.ones(3, np.int8)}
    save_file({**arrays, "c": np.zeros((0, 5), np.float16)}, str(path))
    if edit is not None:
      header, data = _split(path)
      _join(path, edit(header), data)
    if link:
      (folder / "given").mkdir()
      (folder / "given" / "w.safetensors").symlink_to(path)
      return folder / "given" / "w.safetensors"
    return path

  return make


FILE = "hf/model.safetensors"
SHARD = "hf/model-00001-of-"  # every refusal names a shard; the first, in these cases
INDEX = "hf/model.safetensors.index.json"
CONFIG = "hf/config.json"


def _file_cases(saved: Path) -> list[hr.Case]:
  """Headers, files and sizes."""
  h = lambda edit, **kw: _header(saved, edit, **kw)  # noqa: E731
  return [
    hr.Case("a save_pretrained folder", lambda f: _copy(saved, SINGLE, f), default="ok"),
    hr.Case("a sharded save_pretrained folder", lambda f: _copy(saved, SHARDED, f), default="ok"),
    hr.Case("a pytorch_model.bin folder", lambda f: _copy(saved, BIN, f), default="ok"),
    hr.Case("a Hugging Face cache snapshot", _hf_cache(saved), default="ok"),
    hr.Case("weights linked inside", _file(saved, "model.safetensors", "link in"), default="ok"),
    hr.Case("a save_file file", _numpy_file(), default="ok"),
    hr.Case(
      "a save_file file with a dtype list", _numpy_file(_entry(dtype=["F32"])), "w/w.safetensors"
    ),
    hr.Case(
      "a save_file file, zero times huge",
      _numpy_file(_entry(shape=[0, 2**64], data_offsets=[0, 0])),
      "w/w.safetensors",
      pattern=r"2\*\*62",
    ),
    hr.Case("a save_file file overlapping", _numpy_file(_overlap), "w/w.safetensors"),
    hr.Case(
      "a save_file file given through a link out",
      _numpy_file(link=True),
      "given/w.safetensors",
      pattern="outside",
    ),
    # the JSON of a header
    hr.Case("deep header", h(lambda _: DEEP), FILE, pattern="nested 100000 levels deep"),
    hr.Case(
      "header nested 4 deep",
      h(_entry(shape=[[4]])),
      FILE,
      pattern="nested 4 levels deep, more than the 3",
    ),
    hr.Case("NaN in a header", h(lambda _: '{"__metadata__": {"a": NaN}}'), FILE, pattern="NaN"),
    hr.Case(
      "1e999 in a header",
      h(lambda t: json.dumps(t)[:-1] + ', "x": 1e999}'),
      FILE,
      pattern="range of a float",
    ),
    hr.Case(
      "a 5000-digit number",
      h(lambda t: json.dumps(t)[:-1] + ', "x": 1' + "0" * 5000 + "}"),
      FILE,
      pattern="too long",
    ),
    hr.Case(
      "a lone surrogate name",
      h(lambda t: json.dumps(t)[:-1] + ', "\\ud800": {}}'),
      FILE,
      pattern="lone surrogate",
    ),
    hr.Case("a header not UTF-8", h(lambda _: b'{"\xff": 1}'), FILE, pattern="UTF-8"),
    hr.Case("a header not an object", h(lambda _: "[1, 2]"), FILE, pattern="not a JSON object"),
    hr.Case("a header truncated", h(lambda t: json.dumps(t)[:-20]), FILE, pattern="not valid JSON"),
    hr.Case(
      "a name twice",
      h(lambda t: '{"lm_head.weight": {}, ' + json.dumps(t)[1:]),
      FILE,
      pattern="appears twice",
    ),
    hr.Case("metadata a list", h(lambda t: json.dumps({**t, "__metadata__": [1]})), FILE),
    hr.Case(
      "metadata not strings",
      h(lambda t: json.dumps({**t, "__metadata__": {"format": 1}})),
      FILE,
      pattern="not a string",
    ),
    # the entries of a header
    hr.Case("dtype a list", h(_entry(dtype=["F32"])), FILE, pattern=r"dtype \['F32'\]"),
    hr.Case("dtype a number", h(_entry(dtype=3)), FILE, pattern="dtype 3"),
    hr.Case("dtype packed", h(_entry(dtype="F4")), FILE, pattern="packed 4-bit"),
    hr.Case("an entry not an object", h(lambda t: json.dumps({**t, "x": 5})), FILE),
    hr.Case("100 dimensions", h(_entry(shape=[1] * 100)), FILE, pattern="100 dimensions"),
    hr.Case("zero times huge", h(_entry(shape=[0, 2**70])), FILE, pattern=r"2\*\*62"),
    hr.Case(
      "zero times 2**62",
      h(_entry(shape=[0, 2**62], dtype="U8", data_offsets=[0, 0])),
      FILE,
      pattern=r"2\*\*62",
    ),
    hr.Case("a negative size", h(_entry(shape=[-1, 4])), FILE, pattern="not a list of sizes"),
    hr.Case("offsets not two", h(_entry(data_offsets=[0, 4, 8])), FILE, pattern="not two offsets"),
    hr.Case(
      "offsets backwards", h(_entry(data_offsets=[64, 0])), FILE, pattern="not a range of the data"
    ),
    hr.Case("offsets past the end", h(_entry(data_offsets=[0, 2**40])), FILE),
    hr.Case(
      "overlapping tensors",
      h(lambda t: _overlap(t)),
      FILE,
      pattern="overlap",
    ),
    hr.Case(
      "200,000 empty tensors",
      h(_empty_tensors(200_000)),
      FILE,
      pattern="200000 tensors, more than the 65536",
    ),
    hr.Case(
      "a 90 MiB list of zeros",
      h(_entry(shape=[0] * 30_000_000)),
      FILE,
      pattern="more than 4194304 values",
    ),
    hr.Case(
      "200,000 metadata entries",
      h(lambda t: json.dumps({**t, "__metadata__": {f"{i:x}": "" for i in range(200_000)}})),
      FILE,
      pattern="200000 entries, more than the 1024",
    ),
    # the bytes of a file
    hr.Case("7 bytes", _bytes_of(saved, lambda raw: raw[:7]), FILE, pattern="no header"),
    hr.Case(
      "header length past the end",
      _bytes_of(saved, lambda raw: (2**63 + 12345).to_bytes(8, "little") + raw[8:]),
      FILE,
      pattern=f"^(?!.*{2**63 + 12345}).*header length runs past the end",
    ),
    hr.Case(
      "cut inside the header",
      _bytes_of(saved, lambda raw: raw[:100]),
      FILE,
      pattern="header length runs past the end",
    ),
    hr.Case(
      "cut inside the data",
      _bytes_of(saved, lambda raw: raw[: len(raw) - 100]),
      FILE,
      pattern=r": truncated: \d+ of \d+ bytes \(\d+ of \d+ tensors lie past its end\)$",
    ),
    hr.Case(
      "a shard cut", _bytes_of(saved, lambda raw: raw[:-4], SHARDED, _first_shard(saved)), SHARD
    ),
    # files that are not what they seem
    hr.Case("weights a FIFO", _file(saved, "model.safetensors", "fifo"), FILE, pattern="FIFO"),
    hr.Case("weights a directory", _file(saved, "model.safetensors", "directory"), FILE),
    hr.Case("a shard a FIFO", _file(saved, "shard", "fifo", SHARDED), SHARD, pattern="FIFO"),
    hr.Case(
      "weights linked to a secret",
      _file(saved, "model.safetensors", "link to a secret"),
      FILE,
      pattern=r"^(?!.*TOPSECRET).*symbolic link to a file outside",
    ),
    hr.Case("weights linked out", _file(saved, "model.safetensors", "link out"), FILE),
    hr.Case(
      "weights linked to /dev/zero", _file(saved, "model.safetensors", "link to /dev/zero"), FILE
    ),
    hr.Case("a shard linked out", _file(saved, "shard", "link out", SHARDED), SHARD),
    hr.Case(
      "a cache snapshot linking out of its repository",
      _hf_cache(saved, escape=True),
      "models--tiny--llama/snapshots/0123abcd/model-00001-of-",
      pattern="outside",
    ),
    hr.Case(
      "pytorch_model.bin a FIFO",
      _file(saved, "pytorch_model.bin", "fifo", BIN),
      "hf/pytorch_model.bin",
    ),
    hr.Case(
      "pytorch_model.bin linked out",
      _file(saved, "pytorch_model.bin", "link out", BIN),
      "hf/pytorch_model.bin",
      pattern="outside",
    ),
    # sizes declared beyond memory: the file holds them (sparse), memory does not
    hr.Case(
      "64 GiB declared, and held sparsely",
      _sparse(saved, 64 << 30),
      "hf",
      expect={"inspect": "either"},
      pattern="memory",  # the map (under the batch's 6 GiB of address space) or the read
    ),
    hr.Case(
      "3 GiB declared, and held sparsely",
      _sparse(saved, 3 << 30),
      "hf",
      expect={"inspect": "either", "verify": "either", "diff": "either", "convert": None},
      pattern="memory",
    ),
  ]


def _first_shard(saved: Path) -> str:
  return _shards(saved / SHARDED)[0].name


def _overlap(header: dict) -> str:
  """The second tensor (in file order, of those with bytes) moved onto the first's bytes."""
  spans = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
  names = sorted((k for k, (b, e) in spans.items() if e > b), key=spans.get)
  a, b = header[names[0]], header[names[1]]
  size = b["data_offsets"][1] - b["data_offsets"][0]
  b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + size]
  return json.dumps(header)


def _metadata_cases(saved: Path) -> list[hr.Case]:
  """Indexes and config.json files."""
  i = lambda edit: _index(saved, edit)  # noqa: E731
  c = lambda text_of: _config(saved, text_of)  # noqa: E731
  return [
    # the index
    hr.Case("deep index", _index(saved, None, DEEP), INDEX, pattern="nested 100000 levels deep"),
    hr.Case("index with NaN", _index(saved, None, '{"weight_map": {}, "x": NaN}'), INDEX),
    hr.Case("index not JSON", _index(saved, None, '{"weight_map": '), INDEX),
    hr.Case("no weight_map", _index(saved, None, '{"metadata": {}}'), INDEX, pattern="weight_map"),
    hr.Case("weight_map a list", i(lambda m, hf: sorted(m)), INDEX, pattern="weight_map"),
    hr.Case(
      "weight_map of numbers",
      i(lambda m, hf: dict.fromkeys(m, 3)),
      INDEX,
      pattern="3 is not a file name",
    ),
    hr.Case(
      "a name listed twice",
      _index(saved, None, '{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}'),
      INDEX,
      pattern="listed twice",
    ),
    hr.Case("a shard outside", i(_outside_shard), INDEX, pattern="lies outside the folder"),
    hr.Case(
      "an absolute shard",
      i(lambda m, hf: {**m, sorted(m)[0]: "/etc/passwd"}),
      INDEX,
      pattern="'/etc/passwd', listed for tensor .*, lies outside",
    ),
    hr.Case(
      "a shard in a subfolder",
      i(lambda m, hf: {**m, sorted(m)[0]: "sub/model.safetensors"}),
      INDEX,
      pattern="outside",
    ),
    hr.Case(
      "a shard named with a NUL and a newline",
      i(lambda m, hf: {**m, sorted(m)[0]: "a\x00\nb\u2028.safetensors"}),
      INDEX,
      pattern="outside",
    ),
    hr.Case(
      "a missing shard",
      i(lambda m, hf: {**m, sorted(m)[0]: "model-00099-of-00099.safetensors"}),
      INDEX,
      pattern="is missing",
    ),
    hr.Case(
      "a tensor the shards do not hold",
      i(lambda m, hf: {**m, "ghost": sorted(m.values())[0]}),
      INDEX,
      pattern="'ghost': listed in the index",
    ),
    hr.Case(
      "a tensor the index does not list",
      i(_unlisted),
      INDEX,
      pattern="which the index does not list",
    ),
    hr.Case(
      "a tensor in two shards",
      i(_duplicated_across_shards),
      INDEX,
      pattern="which the index puts in",
    ),
    hr.Case(
      "300,000 tensors listed",
      i(lambda m, hf: {**m, **{f"t{n}": "x.safetensors" for n in range(300_000)}}),
      INDEX,
      pattern=r"lists 3000\d\d tensors, more than the 262144",
    ),
    hr.Case(
      "5,000 shards named",
      i(lambda m, hf: {**m, **{f"t{n}": f"{n}.safetensors" for n in range(5000)}}),
      INDEX,
      pattern=r"names 50\d\d shard files, more than the 4096",
    ),
    hr.Case(
      "a .bin index naming a shard outside",
      _bin_index(saved, "../outside.bin"),
      "hf/pytorch_model.bin.index.json",
      pattern="lies outside the folder",
    ),
    hr.Case(
      "a .bin shard linked out",
      _bin_index(saved, "pytorch_model-00001-of-00001.bin", link=True),
      "hf/pytorch_model-00001-of-00001.bin",
      pattern="symbolic link to a file outside",
    ),
    hr.Case("index a FIFO", _file(saved, "model.safetensors.index.json", "fifo", SHARDED), INDEX),
    hr.Case(
      "index linked out",
      _file(saved, "model.safetensors.index.json", "link out", SHARDED),
      INDEX,
      pattern="outside",
    ),
    # config.json
    hr.Case("deep config", c(lambda _: DEEP), CONFIG, pattern="nested 100000 levels deep"),
    hr.Case(
      "config 40 deep",
      c(lambda t: json.dumps({**t, "x": _nested(39)})),
      CONFIG,
      pattern="nested 40 levels deep, more than the 32",
    ),
    hr.Case("config with NaN", c(lambda t: json.dumps(t)[:-1] + ', "x": NaN}'), CONFIG),
    hr.Case("config with Infinity", c(lambda t: json.dumps(t)[:-1] + ', "x": -Infinity}'), CONFIG),
    hr.Case(
      "config with 1e999", c(lambda t: json.dumps(t)[:-1] + ', "rope_theta": 1e999}'), CONFIG
    ),
    hr.Case("config not an object", c(lambda _: "[]"), CONFIG),
    hr.Case("config not UTF-8", c(lambda _: b'{"a": "\xff"}'), CONFIG, pattern="UTF-8"),
    hr.Case(
      "architectures a string",
      c(_set_config(architectures="LlamaForCausalLM")),
      CONFIG,
      pattern="`architectures`: 'LlamaForCausalLM' is not a list",
    ),
    hr.Case(
      "architectures a number", c(_set_config(architectures=5)), CONFIG, pattern="architectures"
    ),
    hr.Case(
      "architectures of numbers",
      c(_set_config(architectures=[1, 2])),
      CONFIG,
      pattern="architectures",
    ),
    hr.Case(
      "tie_word_embeddings a string",
      c(_set_config(tie_word_embeddings="false")),
      CONFIG,
      pattern="tie_word_embeddings",
    ),
    hr.Case("config a FIFO", _file(saved, "config.json", "fifo"), CONFIG, pattern="FIFO"),
    hr.Case(
      "config linked out", _file(saved, "config.json", "link out"), CONFIG, pattern="outside"
    ),
    hr.Case("config linked inside", _file(saved, "config.json", "link in"), default="ok"),
  ]


@pytest.mark.slow
def test_every_entry_point_refuses_hostile_headers_and_files(saved, tmp_path):
  problems = hr.run_batch(_file_cases(saved), tmp_path)
  assert not problems, "\n\n".join(problems)


@pytest.mark.slow
def test_every_entry_point_refuses_hostile_indexes_and_configs(saved, tmp_path):
  problems = hr.run_batch(_metadata_cases(saved), tmp_path)
  assert not problems, "\n\n".join(problems)


# Links: the Hugging Face cache works, nothing else leaves the folder.


def test_a_hugging_face_cache_folder_converts_and_restores(saved, tmp_path, devices):
  snapshot = _hf_cache(saved)(tmp_path)
  assert all(p.is_symlink() for p in snapshot.iterdir())
  want = ucp_jax.open(saved / SHARDED)
  ucp_jax.convert(snapshot, tmp_path / "out")
  converted = ucp_jax.open(tmp_path / "out")
  mesh = jax.make_mesh((8,), ("x",), devices=devices)
  expected = {key.split("/", 1)[1]: want.read(key) for key in want.keys()}
  target = {
    name: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=NamedSharding(mesh, P("x") if a.shape[0] % 8 == 0 else P())
    )
    for name, a in expected.items()
  }
  restored = ucp_jax.restore(snapshot, target, subtree="params")
  for name, array in expected.items():
    np.testing.assert_array_equal(converted.read(f"params/{name}"), array)
    np.testing.assert_array_equal(np.asarray(restored[name]), array)
  assert converted.manifest.source["architectures"] == ["LlamaForCausalLM"]
  _, cfg = rules.from_hf(snapshot)  # its config.json is a link into blobs/ too
  assert cfg.num_layers == 2


def test_a_link_out_is_refused_without_a_byte_of_its_target(saved, tmp_path, capsys):
  hf = _file(saved, "model.safetensors", "link to a secret")(tmp_path)
  for call in (
    lambda: ucp_jax.open(hf),
    lambda: ucp_jax.open(hf / "model.safetensors"),
    lambda: ucp_jax.convert(hf, tmp_path / "out"),
  ):
    with pytest.raises(ucp_jax.SourceFormatError) as e:
      call()
    assert str(e.value) == (
      f"{hf / 'model.safetensors'}: a symbolic link to a file outside {hf}; refusing to follow "
      "it (links may point inside the checkpoint, or into a Hugging Face cache's blobs/)"
    )
  assert cli.main(["inspect", str(hf)]) == 2
  assert "TOPSECRET" not in capsys.readouterr().err
  assert not (tmp_path / "out").exists()
  # a file that fails its checks shows none of its bytes either: not its header length
  (hf / "model.safetensors").unlink()
  (hf / "model.safetensors").write_bytes(SECRET)
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(hf)
  assert "TOPSECRET" not in str(e.value)
  assert str(int.from_bytes(SECRET[:8], "little")) not in str(e.value)


# Object stores: the same checks on what is read by byte ranges.


def _upload(url: str, files: dict[str, bytes]) -> None:
  store = _location.kvstore(_location.resolve(url + "/"))
  for name, data in files.items():
    store.write(name, data).result()


def _remote_case(saved: Path, layout: str, edit) -> dict[str, bytes]:
  """The files of a saved folder, edited by `edit(files)` (name -> bytes)."""
  files = {p.name: p.read_bytes() for p in (saved / layout).iterdir()}
  edit(files)
  return files


def _remote_header(text_of):
  def edit(files):
    raw = files["model.safetensors"]
    n = int.from_bytes(raw[:8], "little")
    text = text_of(json.loads(raw[8 : 8 + n]))
    text = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    files["model.safetensors"] = len(text).to_bytes(8, "little") + text + raw[8 + n :]

  return SINGLE, edit, "model.safetensors"


def _remote_file(name: str, data, layout: str = SINGLE):
  return layout, lambda files: files.update({name: data(files)}), name


def _remote_index(edit):
  def change(files):
    index = json.loads(files["model.safetensors.index.json"])
    index["weight_map"] = edit(index["weight_map"])
    files["model.safetensors.index.json"] = json.dumps(index).encode()

  return SHARDED, change, "model.safetensors.index.json"


REMOTE = {
  "deep header": (_remote_header(lambda _: DEEP), "nested 100000 levels deep"),
  "dtype a list": (_remote_header(_entry(dtype=["F32"])), r"dtype \['F32'\]"),
  "a lone surrogate name": (
    _remote_header(lambda t: json.dumps(t)[:-1] + ', "\\ud800": {}}'),
    "lone surrogate",
  ),
  "100 dimensions": (_remote_header(_entry(shape=[1] * 100)), "100 dimensions"),
  "zero times huge": (_remote_header(_entry(shape=[0, 2**70])), r"2\*\*62"),
  "70,000 empty tensors": (_remote_header(_empty_tensors(70_000)), "more than the 65536"),
  "header length past the end": (
    _remote_file(
      "model.safetensors", lambda f: (2**40 + 7).to_bytes(8, "little") + f["model.safetensors"][8:]
    ),
    rf"^(?!.*{2**40 + 7}).*not a safetensors file",
  ),
  "cut inside the data": (
    _remote_file("model.safetensors", lambda f: f["model.safetensors"][:-100]),
    r"truncated: fewer than \d+ bytes \(the header puts tensor data up to there\)",
  ),
  "deep index": (
    _remote_file("model.safetensors.index.json", lambda _: DEEP.encode(), SHARDED),
    "nested 100000 levels deep",
  ),
  "a shard outside": (
    _remote_index(lambda m: {**m, sorted(m)[0]: "../x.safetensors"}),
    "lies outside the folder",
  ),
  "weight_map of numbers": (_remote_index(lambda m: dict.fromkeys(m, 1)), "1 is not a file name"),
  "deep config": (_remote_file("config.json", lambda _: DEEP.encode()), "nested 100000"),
  "config with NaN": (_remote_file("config.json", lambda _: b'{"a": NaN}'), "NaN"),
  "architectures a string": (
    _remote_file("config.json", lambda _: b'{"architectures": "LlamaForCausalLM"}'),
    "`architectures`: 'LlamaForCausalLM' is not a list of names",
  ),
}


@pytest.mark.parametrize("case", list(REMOTE))
def test_a_hostile_folder_on_an_object_store_is_one_line(saved, case):
  (layout, edit, named), pattern = REMOTE[case]
  url = f"memory://hostile_hf_{abs(hash(case)):x}/hf"
  _upload(url, _remote_case(saved, layout, edit))
  for call in (lambda: ucp_jax.open(url), lambda: ucp_jax.open(f"{url}/{named}")):
    with pytest.raises(ucp_jax.SourceFormatError) as e:
      call()
    message = str(e.value)
    assert message.startswith(f"{url}/{named}: ") and "\n" not in message, message
    assert re.search(pattern, message), message
    if named == "config.json":
      break  # a config.json alone is not weights: its folder is the checkpoint


# config.json read by `rules.from_hf` and `--rules hf:config=`.


LLAMA = {
  "model_type": "llama",
  "architectures": ["LlamaForCausalLM"],
  "vocab_size": 96,
  "hidden_size": 32,
  "intermediate_size": 64,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-5,
  "max_position_embeddings": 64,
}
GPT2 = {"model_type": "gpt2", "vocab_size": 96, "n_positions": 16, "n_embd": 32, "n_layer": 2}
GPT2 |= {"n_head": 4}
QWEN2 = {**LLAMA, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4}
WRONG = [  # (config, field, value): every field from_hf reads, of a wrong type
  (LLAMA, "model_type", ["llama"]),
  (LLAMA, "architectures", "LlamaForCausalLM"),
  (LLAMA, "architectures", [7]),
  (LLAMA, "vocab_size", "96"),
  (LLAMA, "hidden_size", 0),
  (LLAMA, "intermediate_size", 2**40),
  (LLAMA, "num_hidden_layers", -1),
  (LLAMA, "num_attention_heads", True),
  (LLAMA, "num_key_value_heads", 2.5),
  (LLAMA, "head_dim", "8"),
  (LLAMA, "rms_norm_eps", "1e-5"),
  (LLAMA, "rms_norm_eps", -1.0),
  (LLAMA, "rope_theta", [1e4]),
  (LLAMA, "rope_scaling", ["linear"]),
  (LLAMA, "rope_parameters", "default"),
  (LLAMA, "hidden_act", ["silu"]),
  (LLAMA, "tie_word_embeddings", "yes"),
  (LLAMA, "attention_bias", 1),
  (LLAMA, "mlp_bias", "no"),
  (LLAMA, "use_bidirectional_attention", "no"),
  (QWEN2, "use_sliding_window", "true"),
  (QWEN2, "sliding_window", "4"),
  (QWEN2, "layer_types", "full_attention"),
  (QWEN2, "max_window_layers", "28"),
  (GPT2, "n_head", "4"),
  (GPT2, "n_embd", 0),
  (GPT2, "n_inner", -5),
  (GPT2, "layer_norm_epsilon", "x"),
  (GPT2, "activation_function", 3),
  (GPT2, "scale_attn_weights", "yes"),
  (GPT2, "add_cross_attention", []),
]


@pytest.mark.parametrize(
  ("base", "field", "value"), WRONG, ids=[f"{c['model_type']}-{f}" for c, f, _ in WRONG]
)
def test_a_config_field_of_the_wrong_type_is_one_line_naming_it(tmp_path, base, field, value):
  path = tmp_path / "config.json"
  path.write_text(json.dumps({**base, field: value}))
  with pytest.raises(ucp_jax.UcpError) as e:
    rules.from_hf(path)
  message = str(e.value)
  assert message.startswith(f"{path}") and f"`{field}`" in message and "\n" not in message


def test_rope_parameters_of_the_wrong_type_are_named(tmp_path):
  for params, says in (
    ({"rope_type": 5}, "`rope_type`: 5 is not a name"),
    ({"rope_type": "linear", "factor": "2"}, "`factor`: '2' is not a positive number"),
    (
      {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": [4]},
      "`high_freq_factor`",
    ),
  ):
    with pytest.raises(ucp_jax.MappingError, match=re.escape(says)):
      rules.from_hf({**LLAMA, "rope_parameters": params})


def test_a_sliding_window_over_two_billion_layers_builds_no_list():
  huge = {**QWEN2, "num_hidden_layers": 2**31 - 1, "max_window_layers": 28}
  with pytest.raises(ucp_jax.MappingError, match="sliding and full layers mixed"):
    rules.from_hf(huge)  # a list of 2**31 layer types would be 17 GiB


def test_a_hostile_config_json_is_one_line_on_every_path(saved, tmp_path, capsys):
  hf = _copy(saved, SINGLE, tmp_path)
  config = hf / "config.json"
  good = json.loads(config.read_text())
  for text, says in (
    (DEEP, "JSON nested 100000 levels deep, more than the 32 allowed"),
    ('{"a": NaN}', "NaN is not a JSON number"),
    ('{"a": Infinity}', "Infinity is not a JSON number"),
    ('{"a": 1e999}', "a number out of the range of a float"),
    ('{"a": 1' + "0" * 5000 + "}", "a number too long to read"),
    (json.dumps({**good, "architectures": "LlamaForCausalLM"}), "`architectures`"),
    ('{"\\udc80": 1}', "lone surrogate"),
    ("[]", "not a JSON object"),
  ):
    config.write_text(text)
    for call in (lambda: rules.from_hf(hf), lambda: rules.from_hf(config)):
      with pytest.raises(ucp_jax.UcpError) as e:
        call()
      assert str(e.value).startswith(f"{config}: ") and says in str(e.value), str(e.value)
      assert "\n" not in str(e.value)
    code = cli.main(
      ["diff", str(saved / SINGLE), str(saved / SINGLE), "--rules", f"hf:config={config}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {config}: "), err
    code = cli.main(
      [
        "export",
        str(saved / SINGLE),
        str(tmp_path / "x"),
        "--format",
        "hf",
        "--config",
        str(config),
      ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"{config}" in err[0] and says in err[0], err
  config.unlink()
  os.mkfifo(config)
  for call in (lambda: rules.from_hf(hf), lambda: rules.from_hf(config)):
    with pytest.raises(ucp_jax.UcpError, match="FIFO"):
      call()
  config.unlink()
  (tmp_path / "elsewhere.json").write_text(json.dumps(good))
  config.symlink_to(tmp_path / "elsewhere.json")
  with pytest.raises(ucp_jax.UcpError, match="a symbolic link to a file outside"):
    rules.from_hf(hf)  # the folder's own config.json may not leave it
  assert rules.from_hf(config)[1].num_layers == 2  # a file the caller names is followed


def test_a_recorded_config_is_checked_too(saved, tmp_path):
  from ucp_jax.store._manifest import seal

  ucp_jax.convert(saved / SINGLE, tmp_path / "ckpt")
  manifest = tmp_path / "ckpt" / "manifest.json"
  data = json.loads(manifest.read_text())
  data["source"]["config"] = DEEP  # a string, as older conversions recorded it
  manifest.write_bytes(seal(data))
  with pytest.raises(ucp_jax.MappingError) as e:
    rules.from_hf(tmp_path / "ckpt")
  assert str(e.value) == (
    f"{tmp_path / 'ckpt'}: the manifest's `source.config`: JSON nested 100000 levels deep, "
    "more than the 32 allowed"
  )
  data["source"]["config"] = {
    **json.loads((saved / SINGLE / "config.json").read_text()),
    "num_attention_heads": "2",
  }
  manifest.write_bytes(seal(data))
  with pytest.raises(
    ucp_jax.MappingError,
    match=r"ckpt: the manifest's `source.config` \(llama\): .*`num_attention_heads`: '2'",
  ):
    rules.from_hf(tmp_path / "ckpt")
