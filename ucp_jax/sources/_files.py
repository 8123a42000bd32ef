"""Folders and small files of a source, on a local disk or an object store, behind one API.

A source that finds its way by file names (which folder is the step, is there a commit
marker) and reads a few small metadata files asks `for_path(path)` for its `Files`: the local
one calls `os`; the remote one (`gs://`, `s3://`, `memory://`, `file://` URLs) lists each
prefix once through a TensorStore kvstore and answers every later question below it from that
listing, so finding a checkpoint costs one or two listings, not one request per question. A
remote "folder" is a prefix with objects below it, as object stores have no folders.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import posixpath
from collections.abc import Iterator

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _remote
from ucp_jax.store import _location
from ucp_jax.store._untrusted import open_regular

MAX_SMALL_FILE_BYTES = 256 << 20
"""The most a metadata file (a tree's `_METADATA`, a JSON or pickle index) may hold."""


class LocalFiles:
  """`Files` on the local file system."""

  remote = False

  def absolute(self, path: str) -> str:
    return os.path.abspath(path)

  def isdir(self, path: str) -> bool:
    return os.path.isdir(path)

  def isfile(self, path: str) -> bool:
    return os.path.isfile(path)

  def listdir(self, path: str) -> list[str]:
    return sorted(os.listdir(path))

  def read(self, path: str, limit: int = MAX_SMALL_FILE_BYTES) -> bytes:
    """All of a small regular file, refused when larger than `limit`."""
    with open_regular(path) as f:
      data = f.read(limit + 1)
    if len(data) > limit:
      raise SourceFormatError(f"{path}: larger than {limit} bytes")
    return data

  def head(self, path: str, n: int) -> bytes:
    """The first `n` bytes of a regular file (all of a shorter one)."""
    with open_regular(path) as f:
      return f.read(n)

  def kvstore_spec(self, folder: str) -> dict:
    return {"driver": "file", "path": folder.rstrip("/") + "/"}


class RemoteFiles:
  """`Files` on an object store: each prefix listed at most once (per `RemoteFiles`)."""

  remote = True

  def __init__(self) -> None:
    self._listed: dict[str, frozenset[str]] = {}  # URL prefix -> object names below it
    self.seen: dict[str, int] = {}  # object URL -> bytes its reader saw it hold (at least)

  def absolute(self, path: str) -> str:
    return path.rstrip("/")

  def _below(self, path: str) -> frozenset[str]:
    """The names of the objects below `path` (relative to it), from a listing of it or above."""
    path = path.rstrip("/")
    for prefix, names in self._listed.items():
      if path == prefix:
        return names
      if path.startswith(prefix + "/"):
        rel = path[len(prefix) + 1 :] + "/"
        return frozenset(n[len(rel) :] for n in names if n.startswith(rel))
    try:
      names = frozenset(_remote.Folder.at(path).all_names())
    except SourceFormatError as e:
      if "NOT_FOUND" not in str(e) and "cannot be opened" not in str(e):
        raise
      names = frozenset()  # a file (file://), no such bucket or scheme: nothing below
    self._listed[path] = names
    return names

  def isdir(self, path: str) -> bool:
    return bool(self._below(path))

  def isfile(self, path: str) -> bool:
    parent, name = posixpath.split(path.rstrip("/"))
    return name in self._below(parent)

  def listdir(self, path: str) -> list[str]:
    """The names of the objects and of the prefixes directly below `path`."""
    return sorted({n.split("/", 1)[0] for n in self._below(path) if n})

  def read(self, path: str, limit: int = MAX_SMALL_FILE_BYTES) -> bytes:
    parent, name = posixpath.split(path.rstrip("/"))
    return _remote.Folder.at(parent).read_small(name, limit)

  def head(self, path: str, n: int) -> bytes:
    parent, name = posixpath.split(path.rstrip("/"))
    folder = _remote.Folder.at(parent)
    try:
      return folder.read(name, 0, n)[0]
    except SourceFormatError as e:
      if "past its end" not in str(e):
        raise
      return folder.read(name)[0]  # shorter than n

  def kvstore_spec(self, folder: str) -> dict:
    return _location.resolve(folder.rstrip("/") + "/").kvstore_spec()


Files = LocalFiles | RemoteFiles
_SESSION: contextvars.ContextVar[RemoteFiles | None] = contextvars.ContextVar(
  "ucp_jax_remote_files", default=None
)


@contextlib.contextmanager
def session() -> Iterator[None]:
  """Within it, remote listings are shared (a source sniffed, then described, lists once)."""
  if _SESSION.get() is not None:
    yield
    return
  token = _SESSION.set(RemoteFiles())
  try:
    yield
  finally:
    _SESSION.reset(token)


def for_path(path: str) -> Files:
  """The `Files` that reach `path`: remote for a URL (the session's, if one is open)."""
  if not _remote.is_remote(path):
    return LocalFiles()
  return _SESSION.get() or RemoteFiles()


def note_size(url: str, nbytes: int) -> None:
  """Records that the object `url` holds at least `nbytes` (listings give no sizes; the
  growth check of a conversion counts these)."""
  files = _SESSION.get()
  if files is not None:
    files.seen[url] = max(nbytes, files.seen.get(url, 0))


def seen_bytes(folder: str) -> int | None:
  """The bytes noted of the objects at or below the URL `folder` in this session; None when
  none were (a source TensorStore reads itself)."""
  files = _SESSION.get()
  folder = folder.rstrip("/")
  sizes = [
    n for url, n in (files.seen if files else {}).items()
    if url == folder or url.startswith(folder + "/")
  ]  # fmt: skip
  return sum(sizes) if sizes else None


def isdir(path: str) -> bool:
  return for_path(path).isdir(path)


def isfile(path: str) -> bool:
  return for_path(path).isfile(path)


def exists(path: str) -> bool:
  fs = for_path(path)
  return fs.isfile(path) or fs.isdir(path) if fs.remote else os.path.exists(path)


def lexists(path: str) -> bool:
  """`os.path.lexists` (a broken symlink exists) locally; `isfile` on an object store."""
  fs = for_path(path)
  return fs.isfile(path) if fs.remote else os.path.lexists(path)


def listdir(path: str) -> list[str]:
  return for_path(path).listdir(path)


def absolute(path: str) -> str:
  return for_path(path).absolute(path)


def read(path: str, limit: int = MAX_SMALL_FILE_BYTES) -> bytes:
  return for_path(path).read(path, limit)


def head(path: str, n: int) -> bytes:
  return for_path(path).head(path, n)
