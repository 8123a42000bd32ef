"""Bytes read by offset (`Blob`s) and elements located in them, not yet read (`ByteSpan`).

A `Blob` is an open local file (`FileBlob`), bytes in memory (`BytesBlob`) or an object on an
object store (`sources._remote.ObjectBlob`), each read by `pread`. A torch zip archive opened to
locate its storages (`_torch_zip.Archive(locate=True)`) makes each a `ByteSpan`: where its
elements lie, behind a stored zip entry whose start (`EntryStart`) is read on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import struct
import threading
from typing import BinaryIO, Protocol

import numpy as np

from ucp_jax.base._errors import SourceFormatError

READ_BLOCK = 8 << 20
"""Bytes of one request when a tensor is fetched (several in flight at once)."""
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip entry's local header: signature ... lengths


class Blob(Protocol):
  """Bytes read by offset: `size` is None where it is not known (an object on a store)."""

  size: int | None
  readahead: int  # 0 where a read costs no request (a local file, memory)

  def pread(self, at: int, n: int, within: tuple[int, int] | None = None) -> bytes:
    """Up to `n` bytes from byte `at` (fewer only at the end); `within`: bytes known to
    exist around them, which a blob may fetch ahead."""


class FileBlob:
  """An open local file."""

  readahead = 0

  def __init__(self, f: BinaryIO) -> None:
    self._file = f
    self.fileno = f.fileno()
    self.size = os.fstat(self.fileno).st_size

  def pread(self, at: int, n: int, within=None) -> bytes:
    if self._file.closed:  # its descriptor may be another file's by now
      raise SourceFormatError(f"{self._file.name}: read after it was closed")
    return os.pread(self.fileno, n, at)


class BytesBlob:
  """Bytes in memory (a span already read)."""

  readahead = 0

  def __init__(self, data: bytes) -> None:
    self._data = memoryview(data)
    self.size = len(data)

  def pread(self, at: int, n: int, within=None) -> bytes:
    return bytes(self._data[at : at + n])


@dataclasses.dataclass(frozen=True)
class ByteSpan:
  """Elements that lie in a blob, not yet read: a storage, or a tensor on one, of a located
  archive.

  It answers what readers ask of a tensor (`shape`, `dtype`, `size`, `ndim`,
  `flags.c_contiguous`) and does what the torch reader does to a storage's array (1-D
  slices, `view` as another dtype, `reshape`, `byteswap`, strided views); `read()` (or
  `np.asarray`) fetches the elements, at least one request per call.
  """

  entry: EntryStart  # where the storage's zip entry puts its first byte
  offset: int  # bytes from there to the first element
  size: int  # elements
  dtype: np.dtype
  dims: tuple[int, ...] | None = None  # None: 1-D
  strides: tuple[int, ...] | None = None  # in elements; None: C order, one run of bytes
  swapped: bool = False  # the bytes are big-endian: swapped once read

  @property
  def where(self) -> str:
    return self.entry.where

  def file_offset(self) -> int:
    """The byte of the blob where the first element lies (reads the entry's local header
    once, if not read yet)."""
    return self.entry.start() + self.offset

  @property
  def shape(self) -> tuple[int, ...]:
    return (self.size,) if self.dims is None else self.dims

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def itemsize(self) -> int:
    return self.dtype.itemsize

  @property
  def nbytes(self) -> int:
    return self.size * self.itemsize

  @property
  def contiguous(self) -> bool:
    return self.strides is None

  @property
  def flags(self):
    return _Flags(self.contiguous)

  def __getitem__(self, key: slice) -> ByteSpan:
    if not isinstance(key, slice) or self.ndim != 1:
      raise TypeError("a ByteSpan takes 1-D slices only")
    start, stop, step = key.indices(self.size)
    if step != 1:
      raise TypeError("a ByteSpan takes slices of step 1 only")
    n = max(start, stop) - start
    if self.contiguous:
      return dataclasses.replace(self, offset=self.offset + start * self.itemsize, size=n)
    (stride,) = self.strides
    return dataclasses.replace(
      self, offset=self.offset + start * stride * self.itemsize, size=n, dims=(n,)
    )

  def view(self, dtype) -> ByteSpan:
    dtype = np.dtype(dtype)
    if self.nbytes % dtype.itemsize or self.dims is not None:
      raise ValueError(f"{self.nbytes} bytes are not a whole number of {dtype} elements")
    return dataclasses.replace(self, size=self.nbytes // dtype.itemsize, dtype=dtype)

  def reshape(self, *shape) -> ByteSpan:
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
    if -1 in shape:
      known = math.prod(d for d in shape if d != -1)
      shape = tuple(self.size // max(known, 1) if d == -1 else d for d in shape)
    if math.prod(shape) != self.size or not (self.contiguous or self.size <= 1):
      raise ValueError(f"cannot reshape {self.size} elements to {shape}")
    dims = None if len(shape) == 1 else tuple(shape)
    return dataclasses.replace(self, dims=dims, strides=None)

  def strided(self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> ByteSpan:
    base = self[offset:]
    return dataclasses.replace(base, size=math.prod(shape), dims=tuple(shape), strides=strides)

  def byteswap(self) -> ByteSpan:
    return dataclasses.replace(self, swapped=not self.swapped)

  def read_into(self, out: np.ndarray, submit=None) -> list:
    """Starts fetching the elements of a contiguous span into the C-contiguous `out` (of
    `nbytes`), in blocks of `READ_BLOCK` bytes, each by `submit(fn)` (a thread pool's: blocks
    in flight together) or at once; returns what to wait on (futures, or nothing)."""
    flat = out.reshape(-1).view(np.uint8)
    at, tasks = self.file_offset(), []
    for start in range(0, self.nbytes, READ_BLOCK):
      stop = min(self.nbytes, start + READ_BLOCK)
      job = functools.partial(self._fetch, at + start, flat[start:stop])
      tasks.append(submit(job) if submit else job())
    return [t for t in tasks if t is not None]

  def _fetch(self, at: int, dest: np.ndarray) -> None:
    data = self.entry.blob.pread(at, dest.nbytes)
    if len(data) != dest.nbytes:
      raise SourceFormatError(f"{self.where}: ends inside a tensor (byte {at + len(data)})")
    dest[...] = np.frombuffer(data, np.uint8)
    if self.swapped and self.itemsize > 1:
      view = dest.view(self.dtype)
      view[...] = view.byteswap()

  def read(self) -> np.ndarray:
    """The elements, fetched from the blob (a read-only array of `shape`)."""
    if self.contiguous:
      out = np.empty(self.shape, self.dtype)
      self.read_into(out)
      out.flags.writeable = False
      return out
    extent = self.size
    if not self.contiguous:
      extent = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides)) if self.size else 0
    nbytes = extent * self.itemsize
    at = self.file_offset()
    data = self.entry.blob.pread(at, nbytes) if nbytes else b""
    if len(data) != nbytes:
      raise SourceFormatError(f"{self.where}: ends inside a tensor (byte {at + len(data)})")
    flat = np.frombuffer(data, self.dtype, extent)
    if self.contiguous:
      out = flat.reshape(self.shape)
    else:
      strides = tuple(s * self.itemsize for s in self.strides)
      out = np.lib.stride_tricks.as_strided(flat, self.shape, strides, writeable=False)
    if self.swapped:
      out = out.byteswap()
      out.flags.writeable = False
    return out

  def item(self):
    return self.read().item()

  def tolist(self):
    return self.read().tolist()

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    out = self.read()
    if dtype is not None:
      return out.astype(dtype)
    return out.copy() if copy else out


@dataclasses.dataclass(frozen=True)
class _Flags:
  c_contiguous: bool


class EntryStart:
  """Where a stored zip entry's bytes start: after its local header, whose length (a name and
  an extra field, which torch pads to align storages) only that header says. Read on first
  use, so that locating a file with many storages costs no request per storage."""

  def __init__(self, blob: Blob, header_at: int, end: int, where: str, name: str) -> None:
    self.blob, self.where = blob, where
    self._header_at, self._end, self._name = header_at, end, name
    self._start: int | None = None
    self._lock = threading.Lock()

  def start(self) -> int:
    with self._lock:
      if self._start is None:
        self._start = self._read()
      return self._start

  def _read(self) -> int:
    header = self.blob.pread(self._header_at, _LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(header)[0] != b"PK\x03\x04":
      raise SourceFormatError(f"{self.where}: entry {self._name!r} has a corrupt zip header")
    _, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    start = self._header_at + _LOCAL_HEADER.size + name_len + extra_len
    if start > self._end:
      raise SourceFormatError(f"{self.where}: storage {self._name!r} runs past the end of the file")
    return start
