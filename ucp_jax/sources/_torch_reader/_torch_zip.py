"""The zip container of a `torch.save` file, opened so that a forged one cannot hurt.

Only a regular file is opened (never a FIFO or a device, followed symlinks included, and never
blocking); zip entries must be stored or deflated, unencrypted, and lie inside the file; a
deflated entry may not claim more than `MAX_DEFLATE_RATIO` times its compressed size, and one
read into memory no more than its caller's limit (`MAX_INFLATED_BYTES` for storages). Each
breach is a `SourceFormatError` naming the file and the entry. A torch file may also be a span
of a larger file (`Archive`'s `span`: DCP's `.distcp` files hold one per tensor chunk).

The bytes come from a `_byte_span.Blob` (a local file, bytes in memory, an object on a store).
An archive opened to `locate` reads no storage bytes: each storage is a `_byte_span.ByteSpan`,
where its elements lie.
"""

from __future__ import annotations

import io
import mmap as mmap_lib
import os
import struct
import zipfile
from typing import BinaryIO

import numpy as np

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources._byte_span import Blob, ByteSpan, EntryStart, FileBlob

MAX_INFLATED_BYTES = 1 << 30
"""Bytes a compressed storage may inflate to (torch never compresses; its entries are mapped)."""
MAX_DEFLATE_RATIO = 1032
"""The most a deflate stream can expand (1032:1); an entry that claims more is forged."""
_SMALL_ENTRY = 4096  # byteorder and other small entries
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_HEAD = 512  # bytes that tell a legacy file: its magic number, or a tar header's "ustar" at 257
_MAX_OFFSET = 1 << 62  # past any file: a zip64 record said to lie further is forged


def _refuse_legacy(path: str, head: bytes) -> None:
  """Raises for a torch file in the legacy (pre-zip) format, given its first `_HEAD` bytes."""
  if head.startswith(_LEGACY_MAGIC) or head[257:262] == b"ustar":
    raise SourceFormatError(
      f"{path}: legacy torch format (torch.save before 1.6, or with "
      "_use_new_zipfile_serialization=False), which the safe reader does not read. Re-save it "
      "with torch>=1.6: torch.save(torch.load(old, weights_only=True), new)."
    )


def open_zip(path: str, f: BinaryIO) -> zipfile.ZipFile:
  head = f.read(_HEAD)
  f.seek(0)
  _refuse_legacy(path, head)
  try:
    return zipfile.ZipFile(f)
  except Exception as e:  # zipfile's parser on a forged directory: BadZipFile, ValueError, ...
    if head.startswith(b"PK\x03\x04"):
      raise SourceFormatError(
        f"{path}: truncated or corrupt zip file ({type(e).__name__}: {e!s:.200})"
      ) from e
    raise SourceFormatError(
      f"{path}: not a torch file: neither a zip nor a legacy torch file"
    ) from e


def find_root(path: str, zf: zipfile.ZipFile) -> str:
  names = set(zf.namelist())
  roots = sorted(
    name[: -len("/data.pkl")]
    for name in names
    if name.count("/") == 1 and name.endswith("/data.pkl")
  )
  if len(roots) != 1:
    raise SourceFormatError(
      f"{path}: no single <root>/data.pkl entry (found {roots}): not a torch.save file"
    )
  if f"{roots[0]}/constants.pkl" in names:
    raise SourceFormatError(
      f"{path}: a TorchScript archive (torch.jit.save); save a state_dict instead"
    )
  return roots[0]


_EOCD = struct.Struct("<4s4H2LH")  # signature, disks, entries, directory size and offset, comment
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, zip64 end record offset, disks
_ZIP64_EOCD_HEAD = struct.Struct("<4sQ")  # signature, size of the rest of the record
_TAIL_BYTES = _EOCD.size + 0xFFFF + _ZIP64_LOCATOR.size  # the end record's furthest reach


def zip_size(blob, path: str) -> int:
  """The size of a zip file whose size is not known (an object on a store: `blob` reads its
  `tail(n)` and says whether it `ends_at(size)`), from its end records, checked with two
  one-byte requests."""
  tail = blob.tail(_TAIL_BYTES)
  if len(tail) < _TAIL_BYTES:
    return len(tail)  # the whole object
  at = tail.rfind(b"PK\x05\x06", 0, len(tail) - _EOCD.size + 4)
  if at < 0:
    _refuse_legacy(path, blob.pread(0, _HEAD))
    raise SourceFormatError(f"{path}: no zip end record: not a torch file (or truncated)")
  _, _, _, _, _, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, at)
  end = cd_offset + cd_size  # where the end record starts, with no zip64 records between
  locator = tail[max(0, at - _ZIP64_LOCATOR.size) : at]
  if (
    len(locator) == _ZIP64_LOCATOR.size and locator[:4] == b"PK\x06\x07"
  ):  # zip64 records (torch always writes them) come first
    _, _, record_at, _ = _ZIP64_LOCATOR.unpack(locator)
    if record_at >= _MAX_OFFSET:
      raise SourceFormatError(f"{path}: a zip64 end record at byte {record_at}: corrupt")
    head = blob.pread(record_at, _ZIP64_EOCD_HEAD.size)
    if len(head) != _ZIP64_EOCD_HEAD.size or head[:4] != b"PK\x06\x06":
      raise SourceFormatError(f"{path}: a corrupt zip64 end record")
    end = record_at + 12 + _ZIP64_EOCD_HEAD.unpack(head)[1] + _ZIP64_LOCATOR.size
  size = end + _EOCD.size + comment
  if size < _TAIL_BYTES or not blob.ends_at(size):
    raise SourceFormatError(f"{path}: its zip end records do not say where it ends: corrupt")
  blob.keep(size - len(tail), tail)  # the directory is in it: parsing it costs no request
  return size


class Archive:
  """An open torch zip file: its entries, byte order and storage bytes."""

  def __init__(
    self,
    path: str,
    blob: Blob,
    use_mmap: bool,
    span: tuple[int, int] | None = None,
    locate: bool = False,
  ) -> None:
    """Opens the torch file `blob` (named `path` in messages), or the bytes `span` =
    `(offset, length)` of it; entries and storages must lie inside those bytes. Located
    (`locate`), its storages are `ByteSpan`s, none of their bytes read."""
    self._path = path
    self._blob, self._locate = blob, locate
    file_size = blob.size
    if span is None and file_size is None:
      raise SourceFormatError(f"{path}: a torch file of unknown size is read by spans only")
    self._start, self._size = (0, file_size) if span is None else span
    if (
      self._start < 0
      or self._size < 0
      or (file_size is not None and self._start + self._size > file_size)
    ):
      raise SourceFormatError(
        f"{path}: bytes {self._start}..{self._start + self._size} lie outside the file "
        f"({file_size} bytes)"
      )
    self._zip = open_zip(path, _Window(blob, self._start, self._size))
    self._root = find_root(path, self._zip)
    mapped = use_mmap and isinstance(blob, FileBlob) and not locate
    self._map = mmap_lib.mmap(blob.fileno, 0, access=mmap_lib.ACCESS_READ) if mapped else None
    order = self.read(self.entry("byteorder"), _SMALL_ENTRY) if self.has("byteorder") else b"little"
    if order not in (b"little", b"big"):
      raise SourceFormatError(f"{path}: byteorder entry is {order[:20]!r}, not little or big")
    self._big_endian = order == b"big"

  def has(self, name: str) -> bool:
    return f"{self._root}/{name}" in self._zip.NameToInfo

  def entry(self, name: str) -> zipfile.ZipInfo:
    """The zip entry `<root>/name`, checked: stored or deflated, unencrypted, inside the file."""
    full = f"{self._root}/{name}"
    try:
      info = self._zip.getinfo(full)
    except KeyError:
      raise SourceFormatError(
        f"{self._path}: entry {full!r} is missing: truncated or not written by torch.save"
      ) from None
    problem = None
    if info.flag_bits & 0x41:  # bit 0: encrypted; bit 6: strong encryption
      problem = "is encrypted (torch never encrypts)"
    elif info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
      problem = f"uses compression method {info.compress_type} (only stored or deflated are read)"
    elif info.header_offset + info.compress_size > self._size:
      problem = f"claims {info.compress_size} bytes at offset {info.header_offset}, past the end"
    elif info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
      problem = f"is stored, but claims {info.file_size} bytes in {info.compress_size}"
    elif info.file_size > MAX_DEFLATE_RATIO * info.compress_size + _SMALL_ENTRY:
      problem = (
        f"claims to inflate {info.compress_size} bytes to {info.file_size}, more than deflate "
        f"can (MAX_DEFLATE_RATIO {MAX_DEFLATE_RATIO}): a zip bomb"
      )
    if problem:
      raise SourceFormatError(f"{self._path}: entry {full!r} {problem}")
    return info

  def read(self, info: zipfile.ZipInfo, limit: int) -> bytes:
    """The bytes of a checked entry, if it holds at most `limit` bytes (CRC-checked)."""
    if info.file_size > limit:
      raise SourceFormatError(
        f"{self._path}: entry {info.filename!r} holds {info.file_size} bytes, more than the "
        f"{limit} the safe reader reads into memory"
      )
    try:
      with self._zip.open(info) as entry:
        data = entry.read(limit + 1)
    except Exception as e:  # zipfile and zlib on forged bytes: BadZipFile, zlib.error, EOFError
      raise SourceFormatError(
        f"{self._path}: entry {info.filename!r} is corrupt ({type(e).__name__}: {e!s:.200})"
      ) from e
    if len(data) != info.file_size:
      raise SourceFormatError(
        f"{self._path}: entry {info.filename!r} holds {len(data)} bytes, its zip header says "
        f"{info.file_size}"
      )
    return data

  @property
  def path(self) -> str:
    return self._path

  @property
  def big_endian(self) -> bool:
    """Whether the file's `byteorder` entry says big-endian."""
    return self._big_endian

  def payload(self, info: zipfile.ZipInfo, nbytes: int) -> np.ndarray | ByteSpan:
    """The first `nbytes` of checked entry `info`: mapped if stored and mapping, located if
    the archive locates, else read."""
    stored = info.compress_type == zipfile.ZIP_STORED
    if self._locate and not stored:
      raise SourceFormatError(
        f"{self._path}: storage {info.filename!r} is compressed, so its elements lie in no "
        "one place of the file (torch never compresses storages)"
      )
    if not self._locate and (self._map is None or not stored):
      return np.frombuffer(self.read(info, MAX_INFLATED_BYTES), np.uint8)
    last = self._start + self._size - nbytes  # the last byte its elements may start at
    entry = EntryStart(
      self._blob, self._start + info.header_offset, last, self._path, info.filename
    )
    if self._locate:
      if self._blob.readahead == 0:  # a local file (which may be closed by the time it is read)
        entry.start()
      return ByteSpan(entry, 0, nbytes, np.dtype(np.uint8))
    start = entry.start()
    if nbytes == 0:
      empty = np.empty(0, np.uint8)
      empty.flags.writeable = False
      return empty
    return np.frombuffer(self._map, np.uint8, nbytes, start)


class _Window(io.RawIOBase):
  """Bytes `[start, start + size)` of a blob, read as a file of their own (for zipfile)."""

  def __init__(self, blob: Blob, start: int, size: int) -> None:
    super().__init__()
    self._blob, self._start, self._size, self._pos = blob, start, size, 0

  def readable(self) -> bool:
    return True

  def seekable(self) -> bool:
    return True

  def tell(self) -> int:
    return self._pos

  def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
    base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
    if base + offset < 0:
      raise OSError(f"seek to {base + offset}, before the start")
    self._pos = base + offset
    return self._pos

  def readinto(self, buffer) -> int:
    n = max(0, min(len(buffer), self._size - self._pos))
    within = (self._start, self._start + self._size)
    data = self._blob.pread(self._start + self._pos, n, within) if n else b""
    buffer[: len(data)] = data
    self._pos += len(data)
    return len(data)
