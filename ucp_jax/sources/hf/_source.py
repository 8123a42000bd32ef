"""Hugging Face folders and safetensors files as a source, read in place.

What is read, in this order of preference (docs/sources.md):

* a folder (`save_pretrained`): `model.safetensors.index.json` with its shards, or
  `model.safetensors`, or the one other `*.safetensors` file or index, else
  `pytorch_model.bin.index.json` with its shards or `pytorch_model.bin` (the safe torch
  reader: no pickled code runs); `config.json`, when there, goes into the manifest's source;
* a `.safetensors` file, or a `*.index.json` (its folder's shards); the `config.json` beside
  it, if any, is read as the folder's.

Every tensor is a parameter value (`params/NAME`, the torch name kept) except buffers,
recognized by name (`_torch_reader._state_dict.BUFFER_NAMES`). A safetensors tensor is a read-only memory
map of exactly its bytes in its file, so a restore reads only each device's slice. Hugging Face
leaves out `lm_head.weight` when the config ties it to the input embedding
(`tie_word_embeddings`, true unless the config says otherwise): the schema then records the
tie (`tied_to`), and `tied=` names ties for other layouts.

Every file is read as untrusted: regular files only, links only inside the folder or into
a Hugging Face cache's `blobs/` (`store._untrusted.check_inside`), JSON checked for size and
depth before it is parsed, and each field read checked for its type (docs/sources.md).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _remote
from ucp_jax.sources._source_plan import Plan, SourceParam, Tensor, lazy_store
from ucp_jax.sources._torch_reader import _optimizer, _state_dict, _torch_file
from ucp_jax.sources.hf import _safetensors as st
from ucp_jax.sources.hf import _shard_index as shard_index
from ucp_jax.store import _untrusted

NAME = "hf"
DESCRIPTION = (
  "a Hugging Face folder (config.json with model.safetensors, model-0000N-of-0000M.safetensors "
  "and model.safetensors.index.json, or pytorch_model.bin[.index.json]), or a .safetensors file"
)
BIN_INDEX = "pytorch_model.bin.index.json"
MAX_CONFIG_BYTES = 16 << 20
MAX_CONFIG_VALUES = 1 << 20
"""The most `,` and `:` a `config.json` may hold (`st.check_values`); the largest real ones,
with label maps of thousands of classes, hold tens of thousands."""
MAX_CONFIG_DEPTH = 32
"""How deeply a `config.json` may nest (multimodal configs nest a few levels; the manifest
that records it must stay within its own limit)."""
OUTPUT_EMBEDDING = "lm_head.weight"
INPUT_EMBEDDINGS = (
  "model.embed_tokens.weight",
  "transformer.wte.weight",
  "model.shared.weight",
  "shared.weight",
  "model.decoder.embed_tokens.weight",
  "transformer.word_embeddings.weight",
  "embed_tokens.weight",
  "wte.weight",
)
"""Where the input embedding of the usual architectures lives, for a tied `lm_head.weight`."""
_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def sniff(path: str) -> bool:
  """A folder with *.safetensors, an index, or config.json with pytorch_model.bin; a
  .safetensors file or index.

  A `config.json` beside other weights (a `model.pt`) is not enough: that folder is torch's.
  """
  if os.path.isdir(path):
    return _holds_weights(set(os.listdir(path)))
  return path.endswith((".safetensors", shard_index.INDEX_SUFFIX, BIN_INDEX))


def sniff_remote(url: str) -> bool:
  """`sniff` for a URL (an object-store folder or file): one listing."""
  if url.endswith((".safetensors", shard_index.INDEX_SUFFIX)):
    return True
  try:
    return _holds_weights(set(_remote.Folder.at(url).names()))
  except SourceFormatError:
    return False


def _holds_weights(names: set[str]) -> bool:
  return {"config.json", "pytorch_model.bin"} <= names or any(
    n == BIN_INDEX or n.endswith((".safetensors", shard_index.INDEX_SUFFIX)) for n in names
  )


def sniff_weak(path: str) -> bool:
  """A folder with config.json and no weights another source reads: Hugging Face's, whose
  error lists the weights it looked for."""
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def describe(path: str, *, tied: dict[str, str] | None = None) -> Plan:
  """The tensors of a Hugging Face folder or file, from metadata only (the data stays mapped).

  Args:
    path: a folder, a `.safetensors` file or an index.
    tied: `{alias: holder}` for weights the files leave out because they share another's
      data; default: `lm_head.weight` -> the input embedding when `config.json` ties them.

  Raises:
    SourceFormatError: no weights, a damaged or forged header, an index that does not match
      its shards, a non-tensor in a `.bin` state dict (each naming file and tensor).
  """
  if _remote.is_remote(path):
    folder, weights, config, (tensors, files, metadata, aliases) = _remote_folder(path)
  else:
    if not os.path.exists(path):
      raise SourceFormatError(f"{path}: no such file or directory")
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    weights = _weights(path) if os.path.isdir(path) else path
    config = _config(folder)
    tensors, files, metadata, aliases = _tensors(weights, folder)
  ties = dict(aliases)
  ties.update(_ties(config, tensors) if tied is None else _checked_ties(tied, tensors, weights))
  buffers = {n: t for n, t in tensors.items() if _state_dict.is_buffer(n)}
  params = [SourceParam(name=n, value=t) for n, t in tensors.items() if n not in buffers]
  params += [SourceParam(name=alias, value=None, tied_to=holder) for alias, holder in ties.items()]
  extra: dict[str, Any] = {"tied": ties} if ties else {}
  if metadata:
    extra["safetensors_metadata"] = metadata
  return Plan(
    params=params,
    buffers=buffers,
    optimizer=None,
    extra=extra,
    source={
      "framework": "transformers",
      "format": NAME,
      "path": path if _remote.is_remote(path) else os.path.abspath(path),
      "files": [os.path.relpath(f, folder) for f in files],
      "architectures": config.get("architectures"),
      "config": config,
    },
    step=None,
    path=path if _remote.is_remote(path) else os.path.abspath(path),
    format=NAME,
  )


def _remote_folder(url: str):
  """(folder, weights, config, `_tensors`' answer) of a folder or file on an object store:
  safetensors only, read by byte ranges (a `.bin` would be a pickle to download whole)."""
  url = url.rstrip("/")
  if url.endswith((".safetensors", shard_index.INDEX_SUFFIX)):
    folder_url, name = url.rsplit("/", 1)
    folder = _remote.Folder.at(folder_url)
    names = folder.names()
  else:
    folder = _remote.Folder.at(url)
    names = folder.names()
    if not names:
      raise SourceFormatError(f"{url}: no such folder (nothing below it)")
    name = _choose_weights(url, names)
  if name.endswith((".bin", BIN_INDEX)):
    raise SourceFormatError(
      f"{folder.path(name)}: pytorch_model.bin files are read from a local disk only (a "
      "pickle is read whole): copy the folder, or convert it to safetensors"
    )
  config = {}
  if "config.json" in names:
    config = parse_config(
      folder.read_small("config.json", MAX_CONFIG_BYTES), folder.path("config.json")
    )
  if name.endswith(".json"):
    files = shard_index.read_remote_sharded(folder, name, names)
  else:
    files = [st.read_remote_header(folder, name)]
  tensors = {
    tensor: Tensor(info.shape, info.dtype, _mapped(f, tensor), info.where, store=_ranged(f, info))
    for f in files
    for tensor, info in f.tensors.items()
  }
  metadata = {f.path.rsplit("/", 1)[-1]: f.metadata for f in files if f.metadata}
  return folder.url, folder.path(name), config, (tensors, [f.path for f in files], metadata, {})


_RANGE_BYTES = 4 << 20
"""Rows per byte-range request of a restore in place, about this many bytes."""


def _ranged(file: st.SafetensorsFile, info: st.TensorInfo):
  """The tensor as a lazy TensorStore whose reads are byte-range requests of whole rows."""
  shape, dtype = info.shape, info.dtype
  row = math.prod(shape[1:]) * dtype.itemsize
  rows = max(1, _RANGE_BYTES // max(1, row))
  fetch = file.fetch
  assert fetch is not None  # a file on an object store: read by ranges

  def read(region: tuple[slice, ...], out) -> None:
    start, stop = (region[0].start, region[0].stop) if shape else (0, 1)
    if out.size:
      _untrusted.check_allocation((stop - start) * row, info.where)
    raw = fetch(info.begin + start * row, info.begin + stop * row) if out.size else b""
    out[...] = np.frombuffer(raw, dtype).reshape(out.shape)

  return lazy_store(shape, dtype, (rows, *shape[1:]), read)


def _weights(folder: str) -> str:
  """The weights file (or index) of a folder, by Hugging Face's order of preference."""
  return os.path.join(folder, _choose_weights(folder, sorted(os.listdir(folder))))


def _choose_weights(folder: str, names: list[str]) -> str:
  """The name of the weights file (or index) among a folder's `names`."""
  indexes = [n for n in names if n.endswith(shard_index.INDEX_SUFFIX)]
  singles = [n for n in names if n.endswith(".safetensors")]
  for choice in ("model" + shard_index.INDEX_SUFFIX, "model.safetensors"):
    if choice in names:
      return choice
  for found, what in ((indexes, "safetensors indexes"), (singles, "safetensors files")):
    if len(found) == 1:
      return found[0]
    if found:
      raise SourceFormatError(
        f"{folder}: {len(found)} {what} ({', '.join(found[:6])}) and no model.safetensors"
        "[.index.json]: pass the one to read"
      )
  for choice in (BIN_INDEX, "pytorch_model.bin"):
    if choice in names:
      return choice
  others = [n for n in names if n.endswith(_state_dict.SUFFIXES)]
  hint = f"; found {', '.join(others[:6])}: read it with source='torch' (--from torch)"
  raise SourceFormatError(
    f"{folder}: a Hugging Face folder without weights (looked for model.safetensors"
    f"[.index.json], *.safetensors, pytorch_model.bin[.index.json]){hint if others else ''}"
  )


def _tensors(
  weights: str, folder: str
) -> tuple[dict[str, Tensor], list[str], dict, dict[str, str]]:
  """(tensors by name, files read, safetensors metadata by file, aliases in .bin files)."""
  if weights.endswith(BIN_INDEX) or weights.endswith(".bin"):
    return _bin(weights, folder)
  if weights.endswith(".json"):
    files, _ = shard_index.read_sharded(weights, folder)
  else:
    files = [st.read_header(weights, folder)]
  tensors = {}
  for f in files:
    for name, info in f.tensors.items():
      tensors[name] = Tensor(
        info.shape, info.dtype, _mapped(f, name), info.where, file=(f.path, info.begin, f.identity)
      )
  metadata = {os.path.basename(f.path): f.metadata for f in files if f.metadata}
  return tensors, [f.path for f in files], metadata, {}


def _mapped(file: st.SafetensorsFile, name: str):
  return lambda: [file.array(name).reshape(-1)]


def _bin(weights: str, folder: str) -> tuple[dict[str, Tensor], list[str], dict, dict[str, str]]:
  """The tensors of `pytorch_model.bin` or of the shards its index names."""
  if weights.endswith(".json"):
    weight_map = shard_index.read_index(weights, folder)
    files = sorted(set(weight_map.values()))
  else:
    weight_map, files = None, [weights]
  arrays, found = {}, {}
  for file in files:
    _untrusted.check_inside(file, folder)  # then the safe reader opens regular files only
    data = _torch_file.load_named(file)
    if not isinstance(data, dict):
      raise SourceFormatError(f"{file}: holds a {type(data).__name__}, not a state dict")
    state = _state_dict.tensors(data, file)
    found[file] = list(state)
    arrays.update({name: (file, array) for name, array in state.items()})
  if weight_map is not None:
    shard_index.match_index(weights, weight_map, found)
  aliases = _state_dict.aliases({n: a for n, (_, a) in arrays.items()})
  tensors = {
    n: _optimizer.whole(a, f"{f}: tensor {n!r}") for n, (f, a) in arrays.items() if n not in aliases
  }
  return tensors, files, {}, aliases


def _config(folder: str) -> dict:
  path = os.path.join(folder, "config.json")
  if not os.path.lexists(path):
    return {}
  try:
    with _untrusted.open_regular(path, inside=folder) as f:
      raw = f.read(MAX_CONFIG_BYTES + 1)
  except OSError as e:
    raise SourceFormatError(f"{path}: cannot be read ({e.strerror or e})") from None
  if len(raw) > MAX_CONFIG_BYTES:
    raise SourceFormatError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
  return parse_config(raw, path)


def parse_config(raw: bytes | str, path: str, error: type[Exception] = SourceFormatError) -> dict:
  """A `config.json`'s bytes as a dict, checked: small and shallow enough to parse, no NaN
  or Infinity, no duplicate keys, and the fields this source reads of their types.

  Raises:
    error: one line naming `path` (and the field).
  """
  raw = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
  if len(raw) <= MAX_CONFIG_BYTES:
    try:
      st.check_values(raw, path, MAX_CONFIG_VALUES)
    except SourceFormatError as e:
      raise error(str(e)) from None
  config = _untrusted.loads_json(
    raw, path, error, max_bytes=MAX_CONFIG_BYTES, max_depth=MAX_CONFIG_DEPTH
  )
  if not isinstance(config, dict):
    raise error(f"{path}: not a JSON object")
  architectures = config.get("architectures")
  if architectures is not None and not (
    isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
  ):
    raise error(f"{path}: `architectures`: {_errors.shown(architectures)} is not a list of names")
  tie = config.get("tie_word_embeddings")
  if tie is not None and not isinstance(tie, bool):
    raise error(f"{path}: `tie_word_embeddings`: {_errors.shown(tie)} is not true or false")
  return config


def _ties(config: dict, tensors: dict[str, Tensor]) -> dict[str, str]:
  """`lm_head.weight` -> the input embedding, when the config ties them and the files leave
  the head out."""
  architectures = config.get("architectures") or []
  if not config or not config.get("tie_word_embeddings", True) or OUTPUT_EMBEDDING in tensors:
    return {}
  if not any(isinstance(a, str) and a.endswith(_HEADS) for a in architectures):
    return {}
  holder = next((name for name in INPUT_EMBEDDINGS if name in tensors), None)
  return {OUTPUT_EMBEDDING: holder} if holder is not None else {}


def _checked_ties(tied: dict[str, str], tensors: dict[str, Tensor], where: str) -> dict[str, str]:
  problems = [
    f"{alias!r} -> {holder!r}: "
    + (f"{alias!r} is in the files" if alias in tensors else f"no tensor {holder!r}")
    for alias, holder in tied.items()
    if alias in tensors or holder not in tensors
  ]
  if problems:
    raise SourceFormatError(f"{where}: tied= names ties that do not fit: {'; '.join(problems)}")
  return dict(tied)
