"""Folders and small files of a source, on a local disk or an object store, behind one API.

A source that finds its way by file names (which folder is the step, is there a commit
marker) and reads a few small metadata files asks `for_path(path)` for its `Files`: the local
one calls `os`; the remote one (`gs://`, `s3://`, `memory://`, `file://` URLs) lists each
prefix once through a TensorStore kvstore and answers every later question below it from that
listing, so finding a checkpoint costs one or two listings, not one request per question. A
remote "folder" is a prefix with objects below it, as object stores have no folders.
"""

from __future__ import annotations

import os
import posixpath

from ucp_jax._errors import SourceFormatError
from ucp_jax.sources import _remote
from ucp_jax.sources.torch._torch_zip import open_regular
from ucp_jax.store import _location

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

  def kvstore_spec(self, folder: str) -> dict:
    return {"driver": "file", "path": folder.rstrip("/") + "/"}


class RemoteFiles:
  """`Files` on an object store: each prefix listed at most once (per `RemoteFiles`)."""

  remote = True

  def __init__(self) -> None:
    self._listed: dict[str, frozenset[str]] = {}  # URL prefix -> object names below it

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
      folder = _remote.Folder.at(path)
    except SourceFormatError:
      return frozenset()  # no bucket or scheme there: nothing below
    names = frozenset(folder.all_names())
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

  def kvstore_spec(self, folder: str) -> dict:
    return _location.resolve(folder.rstrip("/") + "/").kvstore_spec()


def for_path(path: str) -> LocalFiles | RemoteFiles:
  """The `Files` that reach `path`: remote for a URL, else local."""
  return RemoteFiles() if _remote.is_remote(path) else LocalFiles()


Files = LocalFiles | RemoteFiles
