"""The manifest: one JSON file, written last, that makes a checkpoint a checkpoint."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any

from ucp_jax import _errors, _store

FORMAT = "ucp_jax"
FORMAT_VERSION = 1
MANIFEST_KEY = "manifest.json"


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
  """What the manifest says of one stored array.

  Attributes:
    shape: logical (unsharded) shape.
    dtype: zarr v3 / numpy dtype name (`float32`, `bfloat16`, ...).
    chunks: the zarr chunk shape.
    kind: `array`, `scalar` (a Python number) or `prng_key` (typed key data).
    python_type: for scalars, `int`, `float`, `bool` or `complex`.
    prng_impl: for PRNG keys, the implementation name (`threefry2x32`, ...).
    role: optional meaning in the universal schema (`value`, `exp_avg`, ...).
    compression: the chunk codec, None when chunks are stored raw.
  """

  shape: tuple[int, ...]
  dtype: str
  chunks: tuple[int, ...]
  kind: str = "array"
  python_type: str | None = None
  prng_impl: str | None = None
  role: str | None = None
  compression: str | None = None

  @property
  def nbytes(self) -> int:
    size = 1
    for d in self.shape:
      size *= d
    return size * _itemsize(self.dtype)

  def to_json(self) -> dict:
    out = {"shape": list(self.shape), "dtype": self.dtype, "chunks": list(self.chunks)}
    for name in ("kind", "python_type", "prng_impl", "role", "compression"):
      value = getattr(self, name)
      if value is not None and not (name == "kind" and value == "array"):
        out[name] = value
    return out

  @classmethod
  def from_json(cls, data: dict) -> ArrayInfo:
    return cls(
      shape=tuple(data["shape"]),
      dtype=data["dtype"],
      chunks=tuple(data["chunks"]),
      kind=data.get("kind", "array"),
      python_type=data.get("python_type"),
      prng_impl=data.get("prng_impl"),
      role=data.get("role"),
      compression=data.get("compression"),
    )


def _itemsize(dtype: str) -> int:
  import numpy as np

  return np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Manifest:
  """Everything a checkpoint says about itself besides the array data."""

  arrays: dict[str, ArrayInfo]
  tree: Any = None
  step: int | None = None
  metadata: dict = dataclasses.field(default_factory=dict)
  source: dict = dataclasses.field(default_factory=dict)
  schema: dict | None = None
  created: str = ""
  format_version: int = FORMAT_VERSION

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.arrays.values())

  def to_bytes(self) -> bytes:
    data = {
      "format": FORMAT,
      "format_version": self.format_version,
      "created": self.created or datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "step": self.step,
      "source": self.source,
      "metadata": self.metadata,
      "schema": self.schema,
      "tree": self.tree,
      "arrays": {k: v.to_json() for k, v in sorted(self.arrays.items())},
    }
    return json.dumps(data, indent=1, allow_nan=False).encode()

  @classmethod
  def from_bytes(cls, raw: bytes, where: str) -> Manifest:
    try:
      data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise _errors.ManifestError(
        f"{where}: the manifest is not valid JSON (truncated or overwritten?): {e}"
      ) from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
      raise _errors.ManifestError(
        f'{where}: not a ucp_jax manifest (no "format": "{FORMAT}" entry)'
      )
    version = data.get("format_version")
    if version != FORMAT_VERSION:
      raise _errors.ManifestError(
        f"{where}: format version {version!r}; this ucp_jax reads version {FORMAT_VERSION}. "
        "Upgrade ucp_jax to read it."
      )
    if not isinstance(data.get("arrays"), dict):
      raise _errors.ManifestError(f'{where}: malformed manifest: no "arrays" object')
    arrays = {k: _array_info(k, v, where) for k, v in data["arrays"].items()}
    try:
      return cls(
        arrays=arrays,
        tree=data.get("tree"),
        step=data.get("step"),
        metadata=data.get("metadata") or {},
        source=data.get("source") or {},
        schema=data.get("schema"),
        created=data.get("created", ""),
      )
    except (KeyError, TypeError, AttributeError, ValueError) as e:
      raise _errors.ManifestError(f"{where}: malformed manifest entry: {e!r}") from e


def _array_info(key: str, data: Any, where: str) -> ArrayInfo:
  """One `arrays` entry, checked enough that reading its size or dtype cannot fail later."""
  try:
    info = ArrayInfo.from_json(data)
  except (KeyError, TypeError, AttributeError, ValueError) as e:
    raise _errors.ManifestError(f"{where}: malformed manifest entry `{key}`: {e!r}") from e
  problem = None
  dims = (*info.shape, *info.chunks)
  if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
    problem = f"shape {list(info.shape)} / chunks {list(info.chunks)} are not sizes"
  elif len(info.chunks) != len(info.shape) or not all(info.chunks):
    problem = f"chunks {list(info.chunks)} do not fit shape {list(info.shape)}"
  else:
    try:
      _itemsize(info.dtype)
    except TypeError:
      problem = f"unknown dtype {info.dtype!r}"
  if problem:
    raise _errors.ManifestError(f"{where}: malformed manifest entry `{key}`: {problem}")
  return info


def read(location: _store.Location) -> Manifest:
  """Reads the manifest of a committed checkpoint, or says why there is none."""
  where = str(location)
  target = location.local_dir and _store.staged_for(location.local_dir)
  if target:  # it may hold a manifest: written just before the rename that commits
    raise _errors.CheckpointNotFoundError(
      f"{where}: not a checkpoint but the staging directory of a save to {target} "
      "(still running, or it died before committing; the next save there removes it)"
    )
  try:
    result = _store.kvstore(location).read(MANIFEST_KEY).result()
  except ValueError as e:  # a kvstore that cannot even be opened or listed
    raise _errors.CheckpointNotFoundError(
      f"{where}: cannot open checkpoint: {_store.error_text(e)}"
    ) from e
  if result.state != "value":
    raise _errors.CheckpointNotFoundError(_why_missing(location))
  return Manifest.from_bytes(result.value, f"{where}/{MANIFEST_KEY}")


def _why_missing(location: _store.Location) -> str:
  where = str(location)
  unfinished = (
    f"{where}: no committed checkpoint (a save to this path started and has not committed: "
    "still running, or it died)"
  )
  if location.local_dir is not None:
    if _store.staging_dirs(location.local_dir):
      return unfinished
    if not os.path.exists(location.local_dir):
      return f"{where}: no checkpoint here (the path does not exist)"
    if not os.path.isdir(location.local_dir):
      return f"{where}: a file, not a checkpoint directory"
  else:
    try:
      lock = _store.kvstore(location).read(".ucp-lock").result().state == "value"  # _commit's
    except ValueError:
      lock = False
    if lock:
      return unfinished
    if location.url.startswith("memory://"):
      return (
        f"{where}: no committed checkpoint ({MANIFEST_KEY} is missing; a memory:// checkpoint "
        "lives only in the process that saved it)"
      )
  return f"{where}: no committed checkpoint ({MANIFEST_KEY} is missing)"
