"""Source folders on object stores (`gs://`, `s3://`, `memory://`, `file://` URLs), listed and
read by byte ranges through TensorStore kvstores: a conversion or a restore reads the headers
it parses and the tensor bytes it needs, never whole files it does not.

Every read of an object after the first checks the object's generation: an object replaced
while it is read is refused, not mixed with the old one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.store import _location, _threads


def submit(fn) -> concurrent.futures.Future:
  """Runs `fn()` on the pool of range requests (`_threads.fetch`)."""
  return _threads.fetch(fn)


def is_remote(path) -> bool:
  return isinstance(path, str) and "://" in path


@dataclasses.dataclass(frozen=True)
class Folder:
  """The objects directly below a URL prefix."""

  url: str
  store: _location.KvStore = dataclasses.field(compare=False, repr=False)

  @classmethod
  def at(cls, url: str) -> Folder:
    url = url.rstrip("/")
    try:
      store = _location.kvstore(_location.resolve(url + "/"), durable=False)
    except Exception as e:  # an unknown scheme, a malformed URL
      raise SourceFormatError(f"{url}: cannot be opened ({_location.error_text(e)})") from None
    return cls(url, store)

  def all_names(self) -> list[str]:
    """The names of every object below the folder, deeper ones too (`d/x`), sorted."""
    try:
      keys = self.store.list().result()
    except Exception as e:
      raise SourceFormatError(f"{self.url}: cannot be listed ({_location.error_text(e)})") from None
    return sorted({k.decode("utf-8", "replace") for k in keys} - {""})

  def names(self) -> list[str]:
    """The object names directly below the folder (no deeper ones), sorted."""
    return [n for n in self.all_names() if "/" not in n]

  def path(self, name: str) -> str:
    return f"{self.url}/{name}"

  def read(self, name: str, start: int = 0, stop: int | None = None, generation=None) -> tuple:
    """(bytes [start, stop) of object `name`, its generation); refuses another generation.

    Raises:
      SourceFormatError: the object is missing, shorter than `stop`, or was replaced since
        `generation` was read.
    """
    where = self.path(name)
    try:
      result = self.store.read(name, byte_range=slice(start, stop)).result()
    except Exception as e:
      text = _location.error_text(e)
      if "OUT_OF_RANGE" in text:
        raise SourceFormatError(f"{where}: bytes [{start}, {stop}) are past its end") from None
      raise SourceFormatError(f"{where}: cannot be read ({text})") from None
    if result.state != "value":
      raise SourceFormatError(f"{where}: no such object")
    if generation is not None and result.stamp.generation != generation:
      raise SourceFormatError(f"{where}: replaced while it was read; read it again")
    return result.value, result.stamp.generation

  def read_small(self, name: str, limit: int) -> bytes:
    """All of a small object (a config, an index), refused when larger than `limit`."""
    try:
      self.read(name, limit, limit + 1)
    except SourceFormatError as e:
      if "past its end" not in str(e):
        raise
    else:
      raise SourceFormatError(f"{self.path(name)}: larger than {limit} bytes")
    data = self.read(name)[0]
    if len(data) > limit:  # it grew between the two requests
      raise SourceFormatError(f"{self.path(name)}: replaced while it was read")
    return data


class ObjectBlob:
  """One object of a `Folder`, read by byte ranges (a `torch._byte_span.Blob`).

  Its first read fixes the generation every later read must find (`Folder.read`). A small
  read inside bytes known to exist (the object's size, once known, or a span the caller
  checked: `within`) fetches a whole block of `readahead` bytes and keeps the last few blocks:
  parsing a zip's directory and pickle, a few hundred small reads, costs a few requests.
  """

  size: int | None = None  # object stores say a size only in a listing or a metadata request
  readahead = 64 << 10
  _KEEP = 8  # blocks kept

  def __init__(self, folder: Folder, name: str, generation=None) -> None:
    self.folder, self.name, self.generation = folder, name, generation
    self._blocks: list[tuple[int, bytes]] = []
    self._lock = threading.Lock()

  def pread(self, at: int, n: int, within: tuple[int, int] | None = None) -> bytes:
    with self._lock:
      for start, data in self._blocks:
        if start <= at and at + n <= start + len(data):
          return data[at - start : at - start + n]
    if n >= self.readahead or within is None:
      return self._read(slice(at, at + n))
    lo, hi = within
    stop = min(hi, at + self.readahead)
    start = max(lo, min(at, stop - self.readahead))
    data = self._read(slice(start, stop))
    self.keep(start, data)
    return data[at - start : at - start + n]

  def keep(self, start: int, data: bytes) -> None:
    """Remembers that the object holds `data` at `start` (bytes already read)."""
    with self._lock:
      self._blocks = [(start, data), *self._blocks[: self._KEEP - 1]]

  def tail(self, n: int) -> bytes:
    """The last `n` bytes, or all of a shorter object."""
    try:
      return self._read(slice(-n, None))
    except SourceFormatError as e:
      if "past its end" not in str(e):
        raise
    data = self._read(slice(0, None))
    if len(data) >= n:  # it grew between the two requests
      raise SourceFormatError(f"{self.folder.path(self.name)}: replaced while it was read")
    return data

  def ends_at(self, size: int) -> bool:
    """Whether the object is exactly `size` bytes long (two one-byte requests)."""
    if size < 1 or len(self._read(slice(size - 1, size))) != 1:
      return False
    try:
      self._read(slice(size, size + 1))
    except SourceFormatError as e:
      if "past its end" in str(e):
        return True
      raise
    return False

  def _read(self, byte_range: slice) -> bytes:
    data, generation = self.folder.read(
      self.name, byte_range.start, byte_range.stop, self.generation
    )
    with self._lock:  # reads in flight at once, before any pinned it, must agree too
      if self.generation is None:
        self.generation = generation
      elif generation != self.generation:
        raise SourceFormatError(f"{self.folder.path(self.name)}: replaced while it was read")
    return data
