"""Reads `torch.save` files without importing torch and without running pickled code.

A torch file (torch>=1.6) is an uncompressed zip whose entries sit under one root folder, named
after the file (``foo/`` for ``foo.pt``) or ``archive/``:

* ``<root>/data.pkl``: the object tree, pickled; tensors refer to storages by persistent id.
* ``<root>/data/<key>``: the bytes of storage ``<key>``, 64-byte aligned.
* ``<root>/byteorder``: ``little`` or ``big`` (missing: little, as torch assumes).

`data.pkl` is read by `_torch_pickle`'s restricted unpickler (its docstring gives the policy:
what is allowed, what is refused, what becomes an inert record), with these torch globals added:
dtypes become `TorchDtype`, storage classes name storages, `torch.Size` gives a tuple,
`torch.device` a string such as ``"cuda:0"``, and `torch._utils._rebuild_tensor_v2`, `_v3`,
`_rebuild_parameter`, `_rebuild_parameter_with_state`, `_rebuild_device_tensor_from_numpy` and
`torch._tensor._rebuild_from_type_v2` give read-only numpy arrays (bfloat16 and float8 through
ml_dtypes); requires_grad, hooks, subclasses and Python attributes of tensors are dropped. Other
rebuilds (quantized, sparse, meta tensors) stay `InertObject` records.

A tensor's array is a view of its storage, itself a view of a read-only `mmap` of the file:
nothing is copied, tensors that share a storage share memory, and the map lives as long as any
array does. Compressed entries and ``mmap=False`` read bytes instead, and a big-endian file is
swapped into copies. Mapped bytes are not CRC-checked.

A forged file gets a `SourceFormatError` naming it, within bounded time and memory: the zip
container is opened by `_torch_zip` (regular files only, checked entries), every storage must
hold the bytes its persistent id declares, every tensor must lie inside its storage, and the
tensors of a file whose strides repeat elements (``expand``) may add at most
`MAX_BROADCAST_BYTES` of logical size beyond their storages. The pickle's limits are in
`_pickle_limits`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import ml_dtypes
import numpy as np

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _byte_span
from ucp_jax.sources._torch_reader import _pickle_limits, _torch_pickle, _torch_zip
from ucp_jax.sources._torch_reader._torch_pickle import Allowed
from ucp_jax.sources._torch_reader._torch_pickle import InertGlobal as InertGlobal
from ucp_jax.sources._torch_reader._torch_pickle import InertObject as InertObject
from ucp_jax.store import _untrusted

_NUMPY_NAMED = ["float64", "float32", "float16", "complex128", "complex64", "bool"]
_NUMPY_NAMED += [f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64)]
_ML_DTYPES_NAMED = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"]
_ML_DTYPES_NAMED += ["float8_e5m2fnuz", "float8_e8m0fnu"]
_RAW_INTEGERS = {"qint8": "int8", "quint8": "uint8", "qint32": "int32", "bits16": "uint16"}
_RAW_INTEGERS |= dict.fromkeys(["quint4x2", "quint2x4", "bits8", "bits1x8", "bits2x4"], "uint8")
_RAW_INTEGERS |= {"bits4x2": "uint8"}
_NUMPY_DTYPES: dict[str, np.dtype] = {
  **{name: np.dtype(name) for name in _NUMPY_NAMED},
  **{name: np.dtype(getattr(ml_dtypes, name)) for name in _ML_DTYPES_NAMED},
  **{name: np.dtype(raw) for name, raw in _RAW_INTEGERS.items()},
}
_DTYPE_NAMES = [*_NUMPY_DTYPES, "complex32", "float4_e2m1fn_x2"]
_DTYPE_NAMES += [f"{sign}int{bits}" for sign in ("", "u") for bits in range(1, 8)]
_STORAGE_TYPES = {
  "DoubleStorage": "float64",
  "FloatStorage": "float32",
  "HalfStorage": "float16",
  "BFloat16Storage": "bfloat16",
  "ComplexDoubleStorage": "complex128",
  "ComplexFloatStorage": "complex64",
  "LongStorage": "int64",
  "IntStorage": "int32",
  "ShortStorage": "int16",
  "CharStorage": "int8",
  "ByteStorage": "uint8",
  "BoolStorage": "bool",
  "QInt8Storage": "qint8",
  "QInt32Storage": "qint32",
  "QUInt8Storage": "quint8",
  "QUInt4x2Storage": "quint4x2",
  "QUInt2x4Storage": "quint2x4",
  "UntypedStorage": None,
  "TypedStorage": None,
}
MAX_BROADCAST_BYTES = 256 << 20
"""Logical bytes that the tensors of one file may add beyond their storages by repeating
elements (zero or overlapping strides, as ``expand`` makes): a few bytes may not claim terabytes."""


@dataclasses.dataclass(frozen=True)
class TorchDtype:
  """A torch dtype by its torch name: ``TorchDtype("bfloat16")`` stands for `torch.bfloat16`.

  A record rather than a numpy dtype, so nothing is lost: quantized and packed dtypes, and those
  numpy lacks (complex32), keep their names.
  """

  name: str

  @property
  def numpy_dtype(self) -> np.dtype | None:
    """The numpy dtype of the same bytes (ml_dtypes for bfloat16 and float8), or None."""
    return _NUMPY_DTYPES.get(self.name)

  def __str__(self) -> str:
    return f"torch.{self.name}"


@dataclasses.dataclass(frozen=True, eq=False)
class TorchStorage:
  """A storage that the pickle holds directly (not through a tensor).

  Attributes:
    name: the zip entry of its bytes (``archive/data/0``), for messages.
    dtype: its element type; None for an untyped storage.
    data: the elements as a read-only 1-D array (uint8 when untyped), native byte order if typed.
    big_endian: True for the untyped bytes of a big-endian file; swapped once a tensor types them.
  """

  name: str
  dtype: TorchDtype | None
  data: np.ndarray
  big_endian: bool = False


@dataclasses.dataclass(frozen=True)
class _StorageType:
  dtype: TorchDtype | None


def is_tensor(value: Any) -> bool:
  """Whether `value` is a tensor of a loaded file: an array, or a located `ByteSpan`."""
  return isinstance(value, (np.ndarray, _byte_span.ByteSpan))


def load_named(path: str) -> Any:
  """`load(path)`, every error naming the file (a sources' reader's entry point).

  A file on an object store (a URL) is located, not read: its zip directory and pickle are
  fetched by byte ranges, and its tensors are `ByteSpan`s that fetch their elements when read.
  """
  try:
    if "://" in path:
      return _load_object(path)
    return load(path)
  except SourceFormatError as e:
    if path in str(e):
      raise
    raise SourceFormatError(f"{path}: {e}") from e
  except OSError as e:
    raise SourceFormatError(f"{path}: cannot read this torch file ({e.strerror or e})") from e


def load(path: str | os.PathLike, *, mmap: bool = True, span: tuple[int, int] | None = None) -> Any:
  """Reads the object tree of a `torch.save` file, safely; see the module docstring.

  Args:
    path: the file.
    mmap: map tensor bytes from the file (no copy) rather than read them into memory.
    span: `(offset, length)`: the torch file is these bytes of `path` (a DCP `.distcp` file
      holds one per tensor chunk); messages name `path[offset:offset+length]`.

  Returns:
    The unpickled tree: dicts, lists, ..., read-only numpy arrays for tensors, `TorchDtype`,
    `InertObject` records for other classes.

  Raises:
    SourceFormatError: not a regular file, not a torch zip file (legacy, truncated, missing
      entries, ...), or past a limit of this module or of `_pickle_limits`.
    UnsafePickleError: the pickle asks for something that can run code.
    OSError: the file cannot be opened or read.
  """
  path = os.fspath(path)
  with _untrusted.open_regular(path) as f:
    return load_from(_byte_span.FileBlob(f), path, mmap=mmap, span=span)


def load_from(
  blob: _byte_span.Blob,
  path: str,
  *,
  mmap: bool = False,
  span: tuple[int, int] | None = None,
  locate: bool = False,
) -> Any:
  """`load` of a torch file held by `blob` (named `path` in messages).

  With `locate`, no tensor bytes are read: each tensor is a `_byte_span.ByteSpan`, where its
  elements lie in the blob (after every check `load` makes of shapes, strides and storages).
  """
  shown = path if span is None else f"{path}[{span[0]}:{span[0] + span[1]}]"
  archive = _torch_zip.Archive(shown, blob, mmap, span, locate=locate)
  data = archive.read(archive.entry("data.pkl"), _pickle_limits.MAX_PICKLE_BYTES)
  tensors = _Tensors(shown, functools.partial(_storage, archive))
  return _torch_pickle.loads(
    data, source=shown, extra_globals=tensors.globals(), persistent_load=tensors.persistent_load
  )


def _load_object(url: str) -> Any:
  from ucp_jax.sources import _remote

  folder, name = url.rstrip("/").rsplit("/", 1)
  blob = _remote.ObjectBlob(_remote.Folder.at(folder), name)
  from ucp_jax.sources import _files

  blob.size = _torch_zip.zip_size(blob, url)
  _files.note_size(url, blob.size)
  return load_from(blob, url, locate=True)


def _storage(
  archive: _torch_zip.Archive, key: str, dtype: TorchDtype | None, numel: int
) -> TorchStorage:
  """Maps storage `key` (`numel` elements of `dtype`, untyped bytes if None) as an array."""
  info = archive.entry(f"data/{key}")
  np_dtype = np.dtype(np.uint8) if dtype is None else dtype.numpy_dtype
  nbytes = numel * np_dtype.itemsize
  if info.file_size < nbytes:
    raise SourceFormatError(
      f"{archive.path}: storage {info.filename!r} holds {info.file_size} bytes, but the pickle "
      f"needs {nbytes} ({numel} x {dtype or 'byte'}): the file is truncated or corrupt"
    )
  data = archive.payload(info, nbytes)[:nbytes].view(np_dtype)
  if archive.big_endian and dtype is not None and np_dtype.itemsize > 1:
    data = _readonly(data.byteswap())
  return TorchStorage(info.filename, dtype, data, archive.big_endian and dtype is None)


def _readonly(array: np.ndarray) -> np.ndarray:
  if isinstance(array, np.ndarray):  # (a located ByteSpan holds no bytes to protect)
    array.flags.writeable = False
  return array


def _int_tuple(path: str, value: Any, what: str) -> tuple[int, ...]:
  if isinstance(value, list):
    value = tuple(value)
  if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
    raise SourceFormatError(f"{path}: tensor {what} {value!r:.80} is not a tuple of ints >= 0")
  return value


class _Tensors:
  """The torch globals of one file: storages by persistent id, tensors as views of them."""

  def __init__(self, path: str, load_storage: Any) -> None:
    self._path = path
    self._load_storage = load_storage
    self._storages: dict[str, TorchStorage] = {}
    self._views: dict[tuple[str, str], np.ndarray] = {}
    self._broadcast = 0  # logical bytes of repeated elements so far (MAX_BROADCAST_BYTES)

  def globals(self) -> dict[tuple[str, str], Any]:
    names = {
      (module, name): _StorageType(TorchDtype(d) if d else None)
      for module in ("torch", "torch.storage", "torch.cuda")
      for name, d in _STORAGE_TYPES.items()
    }
    names |= {("torch", name): TorchDtype(name) for name in _DTYPE_NAMES}
    functions = {
      ("torch", "Size"): self._size,
      ("torch", "device"): self._device,
      ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_tensor_v2,
      ("torch._utils", "_rebuild_tensor_v3"): self._rebuild_tensor_v3,
      ("torch._utils", "_rebuild_parameter"): self._rebuild_parameter,
      ("torch._utils", "_rebuild_parameter_with_state"): self._rebuild_parameter,
      ("torch._utils", "_rebuild_device_tensor_from_numpy"): self._rebuild_from_numpy,
      ("torch._tensor", "_rebuild_from_type_v2"): self._rebuild_from_type_v2,
    }
    return names | {key: Allowed(".".join(key), fn) for key, fn in functions.items()}

  def _bad(self, what: str) -> SourceFormatError:
    return SourceFormatError(f"{self._path}: {what}")

  def persistent_load(self, pid: Any) -> TorchStorage:
    if not (isinstance(pid, tuple) and len(pid) == 5 and isinstance(pid[1], _StorageType)):
      raise self._bad(f"persistent id {pid!r:.80} is not ('storage', type, key, location, numel)")
    tag, kind, key, _, numel = (v.decode("ascii") if isinstance(v, bytes) else v for v in pid)
    if tag != "storage" or not isinstance(key, str) or type(numel) is not int or numel < 0:
      raise self._bad(f"persistent id {pid!r:.80} is not ('storage', type, key, location, numel)")
    if key not in self._storages:
      self._storages[key] = self._load_storage(key, kind.dtype, numel)
    storage = self._storages[key]
    if storage.dtype != kind.dtype:
      raise self._bad(f"storage {storage.name!r} is read both as {storage.dtype} and {kind.dtype}")
    return storage

  def _typed(self, storage: Any, dtype: Any) -> np.ndarray:
    if not isinstance(storage, TorchStorage):
      raise self._bad(f"a tensor is rebuilt from a {type(storage).__name__}, not a storage")
    if dtype is None or dtype == storage.dtype:
      return storage.data
    if not isinstance(dtype, TorchDtype) or storage.dtype is not None:
      raise self._bad(f"storage {storage.name!r} of {storage.dtype} is read as {dtype!r:.60}")
    np_dtype = dtype.numpy_dtype
    if np_dtype is None:
      raise self._bad(f"a tensor on storage {storage.name!r} has dtype {dtype}, which numpy lacks")
    if (storage.name, dtype.name) not in self._views:
      if storage.data.size % np_dtype.itemsize:
        raise self._bad(f"storage {storage.name!r} is not a whole number of {dtype} elements")
      view = storage.data.view(np_dtype)
      if storage.big_endian and np_dtype.itemsize > 1:
        view = _readonly(view.byteswap())
      self._views[(storage.name, dtype.name)] = view
    return self._views[(storage.name, dtype.name)]

  def _tensor(self, storage: Any, dtype: Any, offset: Any, size: Any, stride: Any) -> np.ndarray:
    data = self._typed(storage, dtype)
    size = _int_tuple(self._path, size, "size")
    stride = _int_tuple(self._path, stride, "stride")
    if type(offset) is not int or offset < 0 or len(size) != len(stride) or len(size) > 64:
      raise self._bad(f"tensor offset {offset!r:.40}, size {size} and stride {stride} disagree")
    numel = math.prod(size)
    end = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if numel and end > data.size:
      raise self._bad(
        f"storage {storage.name!r} holds {data.size} elements of {data.dtype}, but a tensor on it "
        f"(offset {offset}, size {size}, stride {stride}) reads up to element {end}: truncated?"
      )
    if numel > end - offset:  # zero or overlapping strides repeat elements
      self._broadcast += (numel - (end - offset)) * data.itemsize
      if self._broadcast > MAX_BROADCAST_BYTES:
        raise self._bad(
          f"a tensor on storage {storage.name!r} (size {size}, stride {stride}) repeats its "
          f"{end - offset} elements to {numel}: the file's tensors claim more than "
          f"MAX_BROADCAST_BYTES ({MAX_BROADCAST_BYTES}) beyond their storages"
        )
    contiguous = tuple(math.prod(size[i + 1 :]) for i in range(len(size)))
    if not numel or all(n == 1 or s == c for n, s, c in zip(size, stride, contiguous)):
      return data[offset : offset + numel].reshape(size)
    if isinstance(data, _byte_span.ByteSpan):
      return data.strided(offset, size, stride)
    strides = tuple(s * data.itemsize for s in stride)
    return np.lib.stride_tricks.as_strided(data[offset:], size, strides, writeable=False)

  def _rebuild_tensor_v2(self, storage, offset, size, stride, grad, hooks, metadata=None):
    return self._tensor(storage, None, offset, size, stride)

  def _rebuild_tensor_v3(self, storage, offset, size, stride, grad, hooks, dtype, metadata=None):
    if not isinstance(dtype, TorchDtype):
      raise self._bad(f"tensor dtype {dtype!r:.60} is not a torch dtype")
    return self._tensor(storage, dtype, offset, size, stride)

  def _rebuild_parameter(self, data, requires_grad, hooks, state=None):
    return data

  def _rebuild_from_numpy(self, data, dtype, device, requires_grad):
    if not isinstance(data, np.ndarray):
      raise self._bad(f"a tensor from numpy is rebuilt from a {type(data).__name__}")
    return data

  def _rebuild_from_type_v2(self, func, new_type, args, state):
    return _torch_pickle.call(func, args, source=self._path)

  def _size(self, sizes=()):
    return _int_tuple(self._path, sizes, "size")

  def _device(self, kind, index=None):
    if not isinstance(kind, str) or not (index is None or type(index) is int):
      raise self._bad(f"torch.device({kind!r:.40}, {index!r:.40})")
    return kind if index is None else f"{kind}:{index}"
