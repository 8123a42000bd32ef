"""How one logical array is laid out: a zarr v3 array with checksummed, shard-aligned chunks.

Each logical array is a zarr v3 array at its key path below the checkpoint root, with
crc32c-checked chunks and optional zstd compression.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.store import _lazy, _untrusted
from ucp_jax.store._location import Location, context, error_text, read_small

if TYPE_CHECKING:
  import tensorstore as ts
else:
  ts = _lazy.tensorstore

CHUNK_BYTES = 4 << 20
"""Largest chunk written: small enough that a restore onto another mesh reads little extra."""


def zarr_dtype(dtype: np.dtype) -> str:
  """The zarr v3 data type name of a numpy dtype (bfloat16, float8_e4m3fn, ... included)."""
  name = np.dtype(dtype).name
  ts.dtype(name)  # raises for dtypes TensorStore cannot store
  return name


def choose_chunks(
  shape: Sequence[int], shard_shape: Sequence[int], itemsize: int, limit: int = CHUNK_BYTES
) -> tuple[int, ...]:
  """Chunk shape aligned to the save-time shards, split further while larger than `limit`.

  A sharded dimension is only ever split by a divisor of its shard extent, so no chunk
  straddles two shards and writers on different hosts never share a chunk. An
  unsharded dimension may be split anywhere. Leading dimensions are split first, so
  a chunk is a contiguous block of its shard: written with one `writev` and read with
  one `readinto` straight into a device buffer. A restore sharded another way reads
  each chunk once per host and scatters it.
  """
  chunk = [max(1, s) for s in shard_shape]
  sharded = [s < full for s, full in zip(shard_shape, shape)]
  while math.prod(chunk) * itemsize > limit and split_once(chunk, sharded):
    pass
  return tuple(chunk)


def split_once(chunk: list[int], sharded: list[bool]) -> bool:
  """Splits the leading splittable dimension in place; a prime shard only as a last resort."""
  for allow_prime in (False, True):
    for i in range(len(chunk)):
      if chunk[i] <= 1:
        continue
      if not sharded[i]:
        chunk[i] = -(-chunk[i] // 2)
        return True
      factor = _smallest_factor(chunk[i])
      if factor < chunk[i] or allow_prime:
        chunk[i] //= factor
        return True
  return False


def _smallest_factor(n: int) -> int:
  for f in range(2, math.isqrt(n) + 1):
    if n % f == 0:
      return f
  return n


def array_spec(
  location: Location,
  key: str,
  *,
  shape: Sequence[int],
  dtype: np.dtype,
  chunks: Sequence[int],
  compression: str | None = None,
  bundle: Sequence[int] | None = None,
) -> dict:
  """A TensorStore spec that creates the zarr v3 array for `key` (`bundle`: see `_bundle`)."""
  check_compression(compression)
  codecs: list[dict] = [_LITTLE_ENDIAN]
  if compression == "zstd":
    codecs.append({"name": "zstd", "configuration": {"level": 3}})
  codecs.append({"name": "crc32c"})
  if bundle is not None:
    sharding = {
      "chunk_shape": list(chunks),
      "codecs": codecs,
      "index_codecs": [_LITTLE_ENDIAN, {"name": "crc32c"}],
      "index_location": "end",
    }
    codecs = [{"name": "sharding_indexed", "configuration": sharding}]
  return {
    "driver": "zarr3",
    "kvstore": location.kvstore_spec(key),
    "metadata": {
      "shape": list(shape),
      "data_type": zarr_dtype(dtype),
      "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(bundle or chunks)}},
      "chunk_key_encoding": {"name": "default"},
      "codecs": codecs,
      "fill_value": _fill_value(dtype),
    },
    "create": True,
    "delete_existing": True,
    "store_data_equal_to_fill_value": True,  # every chunk exists, so `verify` can count them
  }


_WRITTEN: dict[str, bytes] = {}  # canonical spec metadata -> the zarr.json TensorStore wrote


def known_metadata(spec: dict) -> bytes | None:
  """The `zarr.json` TensorStore wrote for an array of this spec's metadata, once one was
  created in this process (`learn_metadata`): a save writes it again without TensorStore."""
  return _WRITTEN.get(_canonical(spec["metadata"]))


def learn_metadata(spec: dict, raw: bytes) -> None:
  if len(_WRITTEN) >= 4096:
    _WRITTEN.clear()
  _WRITTEN[_canonical(spec["metadata"])] = raw


def _canonical(metadata: dict) -> str:
  import json

  return json.dumps(metadata, sort_keys=True, separators=(",", ":"))


_LITTLE_ENDIAN = {"name": "bytes", "configuration": {"endian": "little"}}

COMPRESSIONS = (None, "zstd")


def check_compression(compression: str | None) -> None:
  if compression not in COMPRESSIONS:
    raise _errors.InvalidArgumentError(
      f"compression={compression!r}: use None (raw chunks, the default) or 'zstd'"
    )


def check_chunk_bytes(chunk_bytes: int) -> None:
  if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
    raise _errors.InvalidArgumentError(
      f"chunk_bytes={chunk_bytes!r}: the largest chunk must be a positive number of bytes "
      f"(default {CHUNK_BYTES})"
    )


def _fill_value(dtype: np.dtype):
  kind = np.dtype(dtype).kind
  if kind == "b":
    return False
  if kind == "c":
    return [0.0, 0.0]
  return 0 if kind in "iu" else 0.0


def create_array(spec: dict, durable: bool = True) -> ts.Future:
  return ts.open(spec, context=context(durable))


def metadata_json(spec: dict) -> bytes:
  """The `zarr.json` of the array that `spec` (from `array_spec`) creates."""
  import json

  return json.dumps({"zarr_format": 3, "node_type": "array", **spec["metadata"]}).encode()


def open_assumed(spec: dict, durable: bool = True) -> ts.Future:
  """Opens the array of `spec` (from `array_spec`) for writing, on the metadata the spec
  says, without reading or writing its `zarr.json` (which the save writes itself)."""
  spec = {k: v for k, v in spec.items() if k not in ("create", "delete_existing")}
  return ts.open({**spec, "open": True, "assume_metadata": True}, context=context(durable))


def open_array(location: Location, key: str, durable: bool = True) -> ts.Future:
  """Opens the stored array `key` for reading (and writing into, by a save in progress).

  A missing chunk is an error, never the fill value: every chunk of a committed
  checkpoint exists, so one that does not was lost, moved or deleted. Its `zarr.json`
  is checked first (`check_metadata`): TensorStore's parser must never see a hostile one.
  """
  spec = {
    "driver": "zarr3",
    "kvstore": location.kvstore_spec(key),
    "recheck_cached_data": False,
    "store_data_equal_to_fill_value": True,
    "fill_missing_data_reads": False,
  }
  promise: ts.Promise[ts.TensorStore]
  opened: ts.Future[ts.TensorStore]
  promise, opened = ts.Promise.new()
  if location.local_dir is not None:  # a local read is cheap: check it here
    try:
      raw = read_small(location, f"{key}/zarr.json", _errors.CorruptCheckpointError)
      check_metadata(location, key, raw)
    except _errors.UcpError as e:
      promise.set_exception(e)
      return opened
    return ts.open(spec, context=context(durable))

  def checked(read: ts.Future) -> None:
    try:
      result = read.result()
      raw = result.value if result.state == "value" else None
      check_metadata(location, key, raw)
      opening = ts.open(_on_metadata(spec, raw), context=context(durable))
      opening.add_done_callback(lambda f: _settle(promise, f))
    except BaseException as e:
      promise.set_exception(e)

  store = ts.KvStore.open(location.kvstore_spec(key), context=context(durable)).result()
  store.read("zarr.json").add_done_callback(checked)
  return opened


def _on_metadata(spec: dict, raw: bytes | None) -> dict:
  """`spec` opening on `raw`, the `zarr.json` just read and checked, so that TensorStore does
  not read it a second time (one request less per array on an object store); `spec` as it is
  where there is none or it is no zarr v3 array's (TensorStore's open then says what is wrong)."""
  import json

  try:
    metadata = json.loads(raw) if raw is not None else None
  except ValueError:
    return spec
  if not isinstance(metadata, dict) or metadata.get("node_type") != "array":
    return spec
  if metadata.get("zarr_format") != 3:
    return spec
  fields = {k: v for k, v in metadata.items() if k not in ("zarr_format", "node_type")}
  return {**spec, "metadata": fields, "open": True, "assume_metadata": True}


def check_metadata(location: Location, key: str, raw: bytes | None) -> None:
  """Raises `CorruptCheckpointError` if the `zarr.json` of `key` (`raw`; None when missing,
  which the open reports) is too large or too deep for TensorStore's parser to be safe."""
  if raw is not None:
    where = f"{location}/{key}/zarr.json"
    _untrusted.check_json_text(raw, where, _errors.CorruptCheckpointError)


def _settle(promise: ts.Promise, future: ts.Future) -> None:
  try:
    promise.set_result(future.result())
  except BaseException as e:
    promise.set_exception(e)


def metadata_problem(stored: ts.TensorStore, info) -> str | None:
  """How a stored array's zarr metadata disagrees with its manifest entry (None: it agrees).

  The manifest is sealed and `zarr.json` is not: TensorStore decodes by `zarr.json`, so a
  read through it must first check that it describes what the manifest says.
  """
  layout = stored.chunk_layout
  chunks = tuple(layout.read_chunk.shape or ())
  files = tuple(layout.write_chunk.shape or ())
  found = (tuple(stored.shape), stored.dtype.numpy_dtype, chunks, files)
  wanted = (tuple(info.shape), np.dtype(info.dtype), tuple(info.chunks))
  if found == (*wanted, tuple(info.bundle or info.chunks)):
    return None
  return (
    f"zarr metadata says {found[0]} {found[1]} in chunks {chunks} (files of {files}), the "
    f"manifest {info.shape} {info.dtype} in chunks {info.chunks} (files of "
    f"{tuple(info.bundle or info.chunks)})"
  )


def read_region(location: Location, key: str, view: ts.TensorStore) -> np.ndarray:
  return wait_read(location, key, view.read())


def wait_read(location: Location, key: str, future: ts.Future) -> np.ndarray:
  """The result of a read, with storage errors named by checkpoint and key."""
  return _wait(location, key, future, "cannot read stored data")


def wait_open(location: Location, key: str, future: ts.Future) -> ts.TensorStore:
  """The result of opening a stored array, with storage errors named by checkpoint and key."""
  return _wait(location, key, future, "cannot open stored array")


def _wait(location: Location, key: str, future: ts.Future, what: str) -> Any:
  try:
    return future.result()
  except _errors.UcpError:
    raise
  except ValueError as e:
    text = error_text(e)
    if location.io_dir and location.local_dir:  # paths as named, not through /proc/self/fd
      text = text.replace(location.io_dir, location.local_dir)
    if text.startswith(f"{location}"):  # one of ours, raised in a chunk read
      raise _errors.CorruptCheckpointError(text) from e
    if _UNREACHABLE.match(text):  # the store did not answer, or refused: nothing is damaged
      raise _errors.StorageError(f"{location}: `{key}`: {what}: {text}") from e
    raise _errors.CorruptCheckpointError(f"{location}: `{key}`: {what}: {text}") from e


_UNREACHABLE = re.compile(
  r"^(ABORTED|UNAVAILABLE|DEADLINE_EXCEEDED|CANCELLED|PERMISSION_DENIED|UNAUTHENTICATED|"
  r"RESOURCE_EXHAUSTED): "
)
