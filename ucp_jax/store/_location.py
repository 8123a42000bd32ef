"""Where a checkpoint lives: locations, TensorStore contexts and kvstores, storage errors.

A location is a local directory or a kvstore (`file://`, `memory://`, `gs://`, `s3://`,
or a JSON spec); everything goes through TensorStore, so they are handled alike. Remote
requests are bounded in time, and storage failures become `StorageError`s that say what
failed and what to do.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import re
import weakref
from typing import TYPE_CHECKING

from ucp_jax.base import _errors
from ucp_jax.store import _lazy, _untrusted

if TYPE_CHECKING:
  import tensorstore as ts
else:
  ts = _lazy.tensorstore

_URL_SCHEMES = ("file://", "memory://", "gs://", "s3://", "gcs://")

MAX_RETRIES = 4
REQUEST_RETRIES = {"max_retries": MAX_RETRIES, "initial_delay": "0.25s", "max_delay": "2s"}
"""Retries of one request to an object store (TensorStore's default is 32, over minutes): on
429, 5xx, resets and stalls, with exponential backoff. A kvstore spec's own `context`
(`s3_request_retries`, `gcs_request_retries`) overrides them."""


def context(durable: bool = True) -> ts.Context:
  """The process's TensorStore context (`durable=False`: its child without fsyncs)."""
  return _contexts()[0 if durable else 1]


@functools.cache
def _contexts() -> tuple[ts.Context, ts.Context]:
  # One context for the whole process: `memory://` checkpoints live as long as it does,
  # and every open shares its cache and concurrency limits. Files written through it are
  # fsynced (`file_io_sync`); the second, a child that shares everything else, is for
  # saves that opt out.
  durable = ts.Context(
    {
      "file_io_sync": True,
      "file_io_concurrency": {"limit": max(8, 2 * (os.cpu_count() or 1))},
      "cache_pool": {"total_bytes_limit": 0},
      "gcs_request_retries": REQUEST_RETRIES,
      "s3_request_retries": REQUEST_RETRIES,
    }
  )
  return durable, ts.Context({"file_io_sync": False}, parent=durable)


@dataclasses.dataclass(frozen=True)
class Location:
  """A checkpoint root (or a prefix below one): a TensorStore kvstore URL ending in `/`.

  `local_dir` is set when the root is a local directory, which makes an atomic
  commit by rename possible. `spec` is the TensorStore kvstore JSON spec when the
  user gave one (an S3 endpoint, a region, retries in its `context`); `url` then
  only names it. `io_dir`, when set, is the path that reads go through instead:
  `/proc/self/fd/N` of a directory opened once (`pin`), so that a checkpoint
  replaced by a later save is still read from the generation that was opened,
  never from a mix of two.
  """

  url: str
  local_dir: str | None = None
  spec: str | None = None
  io_dir: str | None = dataclasses.field(default=None, compare=False)
  pin: object = dataclasses.field(default=None, compare=False, repr=False)

  def kvstore_spec(self, key: str = "") -> dict:
    """The JSON kvstore spec of `key` below the root (keys are never URL-decoded)."""
    if self.local_dir is not None:
      base = {"driver": "file", "path": (self.io_dir or self.local_dir).rstrip("/") + "/"}
    elif self.spec is not None:
      base = json.loads(self.spec)
    else:
      base = _url_spec(self.url)
    return {**base, "path": base.get("path", "") + (key.strip("/") + "/" if key else "")}

  def child(self, prefix: str) -> Location:
    """The location of `prefix` (relative, `/`-separated) below this one."""
    prefix = prefix.strip("/")
    if not prefix:
      return self
    if self.local_dir is None:
      spec = self.spec and json.dumps(self.kvstore_spec(prefix), sort_keys=True)
      return Location(self.url + prefix + "/", spec=spec)
    return dataclasses.replace(
      self,
      url=self.url + prefix + "/",
      local_dir=os.path.join(self.local_dir, prefix),
      io_dir=self.io_dir and os.path.join(self.io_dir, prefix),
    )

  def ancestor(self, levels: int) -> Location | None:
    """The location `levels` folders above this one on a kvstore (None above its root, and
    for local directories, which have no use for it)."""
    if self.local_dir is not None:
      return None
    spec = self.kvstore_spec()
    lead = "/" if spec.get("path", "").startswith("/") else ""
    parts = [p for p in spec.get("path", "").split("/") if p]
    if len(parts) < levels:
      return None
    path = lead + "/".join(parts[: len(parts) - levels])
    spec["path"] = path.rstrip("/") + "/" if path else ""
    if self.spec is not None:
      return _spec_location(spec)
    url = ts.KvStore.Spec({k: v for k, v in spec.items() if k != "context"}).url
    return Location(url if url.endswith("/") else url + "/")

  def io_path(self, key: str) -> str:
    """The local path that reads of `key` use (local roots only)."""
    root = self.io_dir or self.local_dir
    assert root is not None, "io_path of a location on an object store"
    return os.path.join(root, key)

  def __str__(self) -> str:
    if self.local_dir is not None:
      return self.local_dir
    return self.url if self.url.endswith("://") else self.url.rstrip("/")


class _Pin:
  """An open directory descriptor, closed when the last location holding it goes."""

  def __init__(self, fd: int):
    self.fd = fd
    weakref.finalize(self, os.close, fd)


def pin(location: Location, directory: str | None = None) -> Location:
  """`location` with reads going through an open descriptor of its directory.

  The descriptor keeps naming the directory that was there when it was opened:
  an overwrite renames another one into place, and the deletion of the old one
  makes reads fail rather than switch to the new files. Where `/proc/self/fd` is
  not available, or the directory does not exist, `location` is returned as is.
  `directory`, when given, is opened instead of `location.local_dir` (a
  checkpoint that waits under another name to be renamed into place).
  """
  if location.local_dir is None or location.io_dir is not None or not _PROC_FD:
    return location
  try:
    fd = os.open(directory or location.local_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  except OSError:
    return location
  handle = _Pin(fd)
  return dataclasses.replace(location, io_dir=f"/proc/self/fd/{fd}", pin=handle)


_PROC_FD = os.path.isdir("/proc/self/fd")


@functools.lru_cache(maxsize=64)
def _url_spec_cached(url: str) -> str:
  return json.dumps(ts.KvStore.Spec(url).to_json())


def _url_spec(url: str) -> dict:
  return json.loads(_url_spec_cached(url))


def resolve(path: str | os.PathLike | dict | Location) -> Location:
  """Parses a user-given path: a local directory, a kvstore URL, or a kvstore JSON spec.

  A spec (a dict, or its JSON text) reaches what a URL cannot: an S3 endpoint and
  region, a GCS user project, retries in its own `context`.
  """
  if isinstance(path, Location):
    return path
  if isinstance(path, dict) or (isinstance(path, str) and path.lstrip().startswith("{")):
    return _spec_location(path)
  text = os.fspath(path)
  if text.startswith("file://"):
    text = text[len("file://") :]
  elif text.startswith(_URL_SCHEMES):
    if text.startswith("gcs://"):
      text = "gs://" + text[len("gcs://") :]
    scheme, _, rest = text.partition("://")
    if not rest.strip("/") and scheme != "memory":
      raise ValueError(f"{text}: the URL names no bucket or path")
    known = _named_location(text) if _NAMED else None
    if known is not None:
      return known
    return Location(f"{scheme}://{rest.rstrip('/')}/" if rest.strip("/") else "memory://")
  elif "://" in text:
    raise ValueError(f"{text}: unsupported URL scheme; use a local path or one of {_URL_SCHEMES}")
  local = os.path.abspath(os.path.expanduser(text))
  return Location("file://" + local.rstrip("/") + "/", local)


def _spec_location(spec: dict | str) -> Location:
  try:
    spec = json.loads(spec) if isinstance(spec, str) else dict(spec)
    parsed = ts.KvStore.Spec(spec)
  except (TypeError, ValueError) as e:
    raise _errors.InvalidArgumentError(f"not a TensorStore kvstore spec: {spec!r}: {e}") from e
  path = str(spec.get("path", "")).rstrip("/")
  spec["path"] = path + "/" if path else ""
  try:
    name = ts.KvStore.Spec({k: v for k, v in spec.items() if k != "context"}).url
  except (NotImplementedError, ValueError):
    name = f"{spec['driver']}://{parsed.to_json().get('bucket', '')}/{spec['path']}"
  if not name.endswith("/"):
    name += "/"
  text = json.dumps(spec, sort_keys=True)
  if len(_NAMED) >= 256:
    _NAMED.pop(next(iter(_NAMED)))
  _NAMED.pop(name, None)
  _NAMED[name] = text
  return Location(name, spec=text)


_NAMED: dict[str, str] = {}
"""The URL that names each kvstore spec this process was given -> the spec: readers of other
formats pass URLs around (`s3://bucket/hf/config.json`), and one in the same bucket as a
spec's reaches the spec's endpoint, region and credentials."""


def named(path):
  """`path` as a string: the URL that names it when it is a kvstore spec (a dict or its JSON
  text), which `resolve` maps back to the spec (and the URLs below it); else as it is."""
  if isinstance(path, dict) or (isinstance(path, str) and path.lstrip().startswith("{")):
    return str(_spec_location(path))
  return os.fspath(path)


def _named_location(url: str) -> Location | None:
  """The location of `url` when it lies in the bucket of a spec this process was given (the
  newest such spec): that spec with `url`'s path."""
  scheme, _, rest = url.partition("://")
  bucket, _, path = rest.partition("/")
  for name in reversed(_NAMED):
    if name.startswith(f"{scheme}://{bucket}/"):
      spec = json.loads(_NAMED[name])
      path = path.strip("/")
      spec["path"] = path + "/" if path else ""
      return Location(f"{scheme}://{bucket}/{spec['path']}", spec=json.dumps(spec, sort_keys=True))
  return None


_STAGING = ".ucp-tmp-"  # a save to DIR/NAME stages in DIR/.NAME.ucp-tmp-TOKEN
_STAGING_RE = re.compile(r"^\.(.+)\.ucp-tmp-[0-9a-f]{16}(\.old)?$")


def staging_dir(target_dir: str, token: int) -> str:
  """The directory a save to the local `target_dir` writes in before it commits."""
  parent, name = os.path.split(target_dir)
  return os.path.join(parent, f".{name}{_STAGING}{token:016x}")


def staging_dirs(target_dir: str) -> list[str]:
  """Staging directories of saves to `target_dir` that have not committed (or died)."""
  import glob

  parent, name = os.path.split(target_dir)
  return glob.glob(os.path.join(parent, f".{glob.escape(name)}{_STAGING}*"))


def staged_for(path: str) -> str | None:
  """The target directory when `path` is a save's staging directory, else None."""
  match = _STAGING_RE.match(os.path.basename(path))
  return os.path.join(os.path.dirname(path), match.group(1)) if match else None


_ADVICE = {
  errno.ENOSPC: "no space left on the device: free some or save elsewhere",
  errno.EDQUOT: "disk quota exceeded: free some or save elsewhere",
  errno.EACCES: "permission denied: check who may write there",
  errno.EPERM: "operation not permitted: check who may write there",
  errno.EROFS: "the file system is read-only: save elsewhere",
  errno.ENAMETOOLONG: "a file name is too long for this file system: use shorter keys",
  errno.EIO: "the device reported an I/O error: check the disk",
}
_STATUS = re.compile(
  r"^(NOT_FOUND|PERMISSION_DENIED|RESOURCE_EXHAUSTED|UNAVAILABLE|DATA_LOSS|ABORTED|"
  r"INTERNAL|UNKNOWN|DEADLINE_EXCEEDED|UNAUTHENTICATED|FAILED_PRECONDITION|CANCELLED): "
)


def storage_error(error: BaseException, where: object, what: str, then: str = "") -> BaseException:
  """`error` as a `StorageError` that says what failed and what to do, when it is one.

  OS errors and TensorStore's storage failures (a `ValueError` led by a status code)
  are; anything else (ucp_jax's own errors, bugs) is returned as it is.
  """
  if isinstance(error, _errors.UcpError):
    return error
  if isinstance(error, OSError):
    advice = _ADVICE.get(error.errno or 0, error.strerror or str(error))
    file = f" ({error.filename})" if error.filename else ""
    out = _errors.StorageError(f"{where}: {what}: {advice}{file}.{then and ' ' + then}")
    out.errno = error.errno
    return out
  if isinstance(error, ValueError) and _STATUS.match(str(error)):
    return _errors.StorageError(f"{where}: {what}: {error_text(error)}.{then and ' ' + then}")
  return error


def error_text(error: BaseException) -> str:
  """A TensorStore error as one readable line: the spec and source locations it appends cut."""
  text = re.sub(r" \[(http_response_body|x-amzn?-[a-z-]+)='.*?'\]", "", str(error), flags=re.S)
  text = text.splitlines()[0] if text else type(error).__name__
  return re.sub(r" \[(tensorstore_spec|source locations)=.*$", "", text)


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
  """Every key that starts with `prefix` (which ends with `/`)."""
  return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def kvstore(location: Location, durable: bool = True) -> KvStore:
  """The kvstore at `location`, its operations bounded in time on remote stores."""
  opened = ts.KvStore.open(location.kvstore_spec(), context=context(durable))
  return KvStore(wait(opened, location, "opening the store"), location)


TIMEOUT_S = float(os.environ.get("UCP_STORE_TIMEOUT_S", "120"))
"""How long one request to a remote store may go unanswered, its retries included (env
`UCP_STORE_TIMEOUT_S`)."""

# TensorStore sets no deadline on its HTTP requests: a transfer that stalls would hang for
# the TCP timeout. Its curl low-speed watchdog fails an attempt that moves no byte for a
# share of the timeout, so that the attempts (and their backoff) fit in about TIMEOUT_S;
# read once, when TensorStore first makes a request. Set only where the user has not.
os.environ.setdefault(
  "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS",
  str(max(1, int(TIMEOUT_S // (MAX_RETRIES + 1)))),
)
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")


def wait(future: ts.Future, location: Location, what: str):
  """`future.result()` with storage failures as `StorageError`s naming `location`.

  On a remote store the wait is bounded by `TIMEOUT_S` (a missing network or
  credentials otherwise hang in retries); Ctrl-C interrupts it either way.
  """
  try:
    if location.local_dir is not None:
      return future.result()
    return future.result(timeout=TIMEOUT_S)
  except TimeoutError:
    future.cancel()
    raise _errors.StorageError(
      f"{location}: {what}: no answer within {TIMEOUT_S:g} s (no network, a wrong endpoint, "
      "or missing credentials?); set UCP_STORE_TIMEOUT_S to wait longer"
    ) from None
  except ValueError as e:
    raise _errors.StorageError(f"{location}: {what}: {error_text(e)}") from e


def read_small(
  location: Location, key: str, error: type[Exception], limit: int = _untrusted.MAX_JSON_BYTES
) -> bytes | None:
  """The bytes of the small file `key` (a manifest, a `zarr.json`), None when there is none.

  A local file is read only if it is a regular file (a FIFO put there would block a
  TensorStore read forever) and at most `limit` bytes long; a remote object likewise.

  Raises:
    error: not a regular file, or larger than `limit`.
    StorageError: it cannot be read.
  """
  if location.local_dir is not None:
    path, shown = location.io_path(key), os.path.join(location.local_dir, key)
    try:
      with _untrusted.open_regular(path, error) as f:
        # as much as the file holds (one byte more tells a file larger than the limit): a
        # read of `limit` bytes would map that much memory first
        data = f.read(min(os.fstat(f.fileno()).st_size, limit) + 1)
    except (FileNotFoundError, NotADirectoryError):
      return None
    except error as e:
      raise error(str(e).replace(path, shown)) from None
    except OSError as e:
      raise storage_error(e, shown, "reading") from e
  else:
    result = kvstore(location).read(key).result()
    if result.state != "value":
      return None
    data, shown = result.value, f"{location}/{key}"
  if len(data) > limit:
    raise error(f"{shown}: larger than {limit} bytes, more than a metadata file holds")
  return data


class KvStore:
  """A TensorStore kvstore whose operations say where they failed (see `wait`)."""

  def __init__(self, store: ts.KvStore, location: Location):
    self._store = store
    self._location = location

  def read(self, key: str, **options) -> _Pending:
    return _Pending(self._store.read(key, **options), self._location, f"reading {key}")

  def write(self, key: str, value: bytes | None, **options) -> _Pending:
    what = f"deleting {key}" if value is None else f"writing {key}"
    return _Pending(self._store.write(key, value, **options), self._location, what)

  def list(self, key_range: ts.KvStore.KeyRange | None = None) -> _Pending:
    listed = self._store.list() if key_range is None else self._store.list(key_range)
    return _Pending(listed, self._location, "listing keys")

  def delete_range(self, key_range: ts.KvStore.KeyRange) -> _Pending:
    deleted = self._store.delete_range(key_range)
    first = key_range.inclusive_min.decode(errors="replace")
    return _Pending(deleted, self._location, f"deleting {first}...")


@dataclasses.dataclass(frozen=True)
class _Pending:
  future: ts.Future
  location: Location
  what: str

  def result(self):
    return wait(self.future, self.location, self.what)
