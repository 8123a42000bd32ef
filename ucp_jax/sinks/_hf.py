"""Hugging Face as a sink: a model folder that `from_pretrained` loads (`format="hf"`).

```
dst/config.json                              the source's config.json, or the one passed in,
                                             its `dtype` that of the weights written
dst/model.safetensors                        every parameter and buffer, by its torch name
  (or dst/model-00001-of-0000N.safetensors + dst/model.safetensors.index.json past the limit)
dst/ucp_export.json                          {"written_by": "ucp_jax", "format": "hf"}
```
Tied parameters are written once, under the name that holds the data (as `save_pretrained`
does; the config's `tie_word_embeddings` ties them again). Optimizer state has no place in
a model folder and is left out, with a note. The safetensors files are written here, from
the checkpoint's arrays one at a time (host memory: the largest array), and synced.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.sinks import _folder, _resolved
from ucp_jax.sinks._registry import Destination, option
from ucp_jax.sinks._report import ExportReport
from ucp_jax.store import _checkpoint, _untrusted

NAME = "hf"
TORCH_NAMES = True  # writes torch names: a rule set maps a Flax-named checkpoint first
DESCRIPTION = "a Hugging Face model folder: config.json and (sharded) safetensors weights"
DEFAULT_MAX_SHARD = 5 * 10**9
"""`save_pretrained`'s default shard size (5 GB)."""
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _hf_source():
  """The Hugging Face source's names and limits, imported when used: the sink's `Options`
  load with the `ucp export` flags, which import no TensorStore."""
  from ucp_jax.sources import hf

  return hf


@dataclasses.dataclass(frozen=True)
class Options:
  """What goes into a Hugging Face model folder besides the weights, and how.

  Attributes:
    config: the model's `config.json` (a path or a dict); default: the one the checkpoint
      recorded from its source (`manifest.source["config"]`), if any.
    max_shard_size: bytes per safetensors file, an int or `save_pretrained`'s strings
      ("5GB", "500MB", "2GiB"); larger models are sharded with an index.
    dtype: cast every floating-point array to this dtype ("bfloat16", "float16",
      "float32"); default: as stored (fp32 masters stay fp32).
  """

  # `ucp export --config` is the command's own flag: it feeds `--rules hf` too
  config: str | os.PathLike | dict | None = option(None, "the model's config.json", flag=False)
  max_shard_size: int | str = option(
    DEFAULT_MAX_SHARD, "bytes per safetensors file (default: 5GB)", parse=str
  )
  dtype: str | None = option(None, "cast floating-point weights (bfloat16, float16, float32)")

  def __post_init__(self) -> None:
    shard_bytes(self.max_shard_size)
    _dtype(self.dtype)
    if self.config is not None and not isinstance(self.config, dict):
      read_config(self.config)


def export(
  ckpt: _checkpoint.Checkpoint, destination: Destination, options: Options | None = None
) -> ExportReport:
  """Writes `ckpt`'s parameters and buffers (torch names) as a Hugging Face model folder.

  Args:
    ckpt: the checkpoint, with torch names (`export` maps Flax names first).
    destination: the folder to create (or an earlier export to replace), and progress.
    options: the config, shard size and dtype (`Options`).
  """
  options = Options() if options is None else options
  start = time.perf_counter()
  config, max_shard_size, dtype = options.config, options.max_shard_size, options.dtype
  progress = destination.progress
  dst = check_options(destination)
  weights = _resolved.weights(ckpt)
  target = _dtype(dtype)
  tensors = [(p.name, p.value) for p in (*weights.params, *weights.buffers)]
  config_data = _config(ckpt, config)
  notes = _notes(ckpt, weights, config_data)
  if config_data is not None:
    config_data, note = _with_dtype(config_data, ckpt, [key for _, key in tensors], target)
    notes += [note] if note else []
  shards = _shards(ckpt, tensors, shard_bytes(max_shard_size), target)
  written = _write_folder(ckpt, dst, shards, target, config_data, progress)
  return ExportReport(
    path=dst,
    params=len(weights.params),
    frozen=weights.frozen,
    buffers=tuple(b.name for b in weights.buffers),
    tied=dict(weights.tied),
    step=ckpt.step,
    nbytes=written,
    seconds=time.perf_counter() - start,
    notes=tuple(notes),
    format=NAME,
    summary=(
      f"Hugging Face model folder, {len(shards)} safetensors file(s): {len(weights.params)} "
      f"params, {len(weights.buffers)} buffers, {len(weights.tied)} tied"
      + ("" if config_data is not None else "; no config.json")
    ),
  )


def _write_folder(ckpt, dst: str, shards, target, config: dict | None, progress) -> int:
  """Writes the safetensors files (with an index when several), `config.json` and the
  marker into a staging folder renamed to `dst`; returns the bytes of tensors written."""
  total = sum(_nbytes(ckpt[key], target) for shard in shards for _, key in shard)
  written = 0

  def report(item: str, nbytes: int) -> None:
    nonlocal written
    written += nbytes
    if progress is not None:
      progress(item, nbytes, total)

  files = (
    ["model.safetensors"]
    if len(shards) == 1
    else [
      f"model-{number:05d}-of-{len(shards):05d}.safetensors" for number in range(1, len(shards) + 1)
    ]
  )
  weight_map = {name: file for file, shard in zip(files, shards) for name, _ in shard}
  with _folder.staged(dst) as staging:
    for file, shard in zip(files, shards):
      _write_safetensors(ckpt, os.path.join(staging, file), shard, target, report)
    if len(shards) > 1:
      index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
      _folder.write_file(
        os.path.join(staging, "model" + _hf_source().INDEX_SUFFIX),
        [json.dumps(index, indent=2).encode()],
      )
    if config is not None:
      body = json.dumps(config, indent=2, sort_keys=True).encode()
      _folder.write_file(os.path.join(staging, "config.json"), [body])
    _folder.write_marker(staging, NAME, files=sorted(set(weight_map.values())))
  return written


def check_options(destination: Destination, options: Options | None = None) -> str:
  """The absolute export path, or an error: an existing folder must be an earlier HF export."""
  return _folder.check_destination(
    destination, not_an_export=_not_an_export, what="a Hugging Face export"
  )


def _not_an_export(path: str) -> list[str]:
  ours = ("config.json", "model" + _hf_source().INDEX_SUFFIX)
  return _folder.foreign_entries(path, NAME, "an HF export", ours=ours)


def shard_bytes(size: int | str) -> int:
  """`max_shard_size` in bytes (ints, or strings such as "5GB", "500MB", "2GiB")."""
  if isinstance(size, int) and not isinstance(size, bool) and size > 0:
    return size
  match = _SIZE.match(size) if isinstance(size, str) else None
  if match is None or float(match.group(1)) <= 0:
    raise _errors.InvalidArgumentError(
      f"max_shard_size={size!r}: a positive number of bytes, or a string such as '5GB'"
    )
  return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _dtype(dtype: str | None) -> np.dtype | None:
  if dtype is None:
    return None
  try:
    target = np.dtype(dtype)
  except TypeError:
    target = None
  if target is None or not _floating(target):
    raise _errors.InvalidArgumentError(
      f"dtype={dtype!r}: a floating-point dtype safetensors stores ('bfloat16', 'float16', "
      "'float32', ...)"
    )
  return target


def _floating(dtype: np.dtype) -> bool:
  """A floating-point dtype safetensors names (F16, BF16, F32, F64, the F8 types)."""
  return _hf_source().DTYPE_NAMES.get(np.dtype(dtype), "").startswith(("F", "BF"))


def _cast(dtype: str, target: np.dtype | None) -> np.dtype:
  stored = np.dtype(dtype)
  return target if target is not None and _floating(stored) else stored


def _nbytes(info, target: np.dtype | None) -> int:
  return int(np.prod(info.shape, dtype=np.int64)) * _cast(info.dtype, target).itemsize


def _shards(ckpt, tensors, limit: int, target) -> list[list[tuple[str, str]]]:
  """Tensors in order, cut into files of at most `limit` bytes (a larger tensor: its own file)."""
  shards: list[list[tuple[str, str]]] = [[]]
  size = 0
  for name, key in tensors:
    nbytes = _nbytes(ckpt[key], target)
    if shards[-1] and size + nbytes > limit:
      shards.append([])
      size = 0
    shards[-1].append((name, key))
    size += nbytes
  return shards


def _write_safetensors(ckpt, path: str, shard, target, report) -> None:
  header: dict[str, Any] = {}
  offset = 0
  for name, key in shard:
    info = ckpt[key]
    dtype = _cast(info.dtype, target)
    nbytes = _nbytes(info, target)
    header[name] = {
      "dtype": _hf_source().DTYPE_NAMES[dtype],
      "shape": list(info.shape),
      "data_offsets": [offset, offset + nbytes],
    }
    offset += nbytes
  header["__metadata__"] = {"format": "pt"}
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned, as safetensors writes

  def parts():
    yield len(raw).to_bytes(8, "little")
    yield raw
    for name, key in shard:
      array = np.ascontiguousarray(ckpt.read(key).astype(_cast(ckpt[key].dtype, target)))
      data = array.astype(array.dtype.newbyteorder("<"), copy=False)
      yield data.reshape(-1).view(np.uint8) if data.size else b""
      report(name, data.nbytes)

  _folder.write_file(path, parts())


def _config(ckpt, config) -> dict | None:
  if isinstance(config, dict):
    return config
  if config is not None:
    return read_config(config)
  recorded = (ckpt.manifest.source or {}).get("config")
  return recorded if isinstance(recorded, dict) else None


def read_config(path: str | os.PathLike) -> dict:
  path = os.fspath(path)
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  try:
    with _untrusted.open_regular(path, _errors.InvalidArgumentError) as f:
      raw = f.read(_hf_source().MAX_CONFIG_BYTES + 1)
  except OSError as e:
    raise _errors.InvalidArgumentError(f"config={path!r}: not a readable config.json ({e})") from e
  if len(raw) > _hf_source().MAX_CONFIG_BYTES:
    raise _errors.InvalidArgumentError(f"{path}: larger than {_hf_source().MAX_CONFIG_BYTES} bytes")
  return _hf_source().parse_config(raw, path, _errors.InvalidArgumentError)


def _with_dtype(config: dict, ckpt, keys: list[str], target) -> tuple[dict, str | None]:
  """`config` with `dtype` (and a legacy `torch_dtype`) naming the weights' dtype, so that
  `from_pretrained`'s default (the config's dtype) loads them as written; a note when it
  changed, or when the floating-point weights have several dtypes (the one of most bytes)."""
  by_bytes: dict[str, int] = {}
  for key in keys:
    dtype = _cast(ckpt[key].dtype, target)
    if _floating(dtype):
      by_bytes[dtype.name] = by_bytes.get(dtype.name, 0) + _nbytes(ckpt[key], target)
  if not by_bytes:
    return config, None
  name = max(by_bytes, key=lambda n: (by_bytes[n], n))
  before = config.get("dtype", config.get("torch_dtype"))
  out = {**config, "dtype": name}
  if "torch_dtype" in config:
    out["torch_dtype"] = name
  notes = []
  if before != name:
    notes.append(f"config.json dtype {name} (the weights'; it said {before!r})")
  if len(by_bytes) > 1:
    notes.append(f"floating-point weights of several dtypes ({', '.join(sorted(by_bytes))})")
  return out, "; ".join(notes) or None


def _notes(ckpt, weights: _resolved.ResolvedWeights, config: dict | None) -> list[str]:
  notes = []
  schema = ckpt.manifest.typed_schema
  entries = [] if schema is None else list(schema.params.values())
  slots = sorted({s for entry in entries for s in entry.slots})
  if slots:
    notes.append(
      f"optimizer state ({', '.join(slots)}, step, groups) is not exported: a Hugging Face "
      "model folder holds weights only (export to DeepSpeed to keep it)"
    )
  if weights.tied:
    tied = ", ".join(f"{a} -> {b}" for a, b in weights.tied.items())
    notes.append(f"tied parameters written once ({tied}); the config's tie flag ties them again")
  if config is None:
    notes.append(
      "no config.json: the checkpoint recorded none from its source; pass config= (or "
      "--config) for from_pretrained to load the folder"
    )
  return notes
