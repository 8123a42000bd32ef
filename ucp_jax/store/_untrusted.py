"""Checks made on files ucp_jax did not just write, before anything parses or sizes them.

Every reader, of ucp_jax's own checkpoints and of every other format, goes through these:
- `open_regular`: only a regular file is opened (never a FIFO, a device or a socket, followed
  symlinks included), and opening never blocks;
- `loads_json`: a metadata document is refused when larger than its limit or nested deeper
  than `MAX_JSON_DEPTH`, before any parser sees it (TensorStore's C++ parser recurses on the
  C stack: a deep document is a SIGSEGV, not an exception); NaN, Infinity, lone surrogates
  and duplicate keys are refused too;
- `check_json_file`: the same for a document that a library (TensorStore) reads itself;
- `check_shape`: declared shapes are sizes an array can have;
- `check_allocation`: bytes about to be allocated for a read fit in the memory this process
  may still use (a 28 KB file can declare 4 TiB).

Each breach is one error of the caller's class, naming the file (and the key where there is
one), and never echoing bytes of the file that failed.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import resource
import stat
from typing import Any, BinaryIO

import numpy as np

from ucp_jax.base import _errors

MAX_JSON_DEPTH = 128
"""How deeply a metadata document may nest: pytrees nest a few levels per module, and
TensorStore's parser and Python's recursive readers need stack for each level."""
MAX_JSON_BYTES = 256 << 20
"""The most a metadata document (manifest, zarr.json, index, `_METADATA`) may hold."""
MAX_RANK = 32
"""The most dimensions an array may declare (TensorStore's limit; numpy's is 64)."""
MAX_ARRAY_BYTES = 1 << 62
"""The most bytes one declared array may hold, whatever its zero dimensions."""
MAX_EXTENT = (1 << 62) - 2
"""The largest size of one dimension (TensorStore's: `ts.array` refuses a larger one)."""
_ALWAYS_AFFORDABLE = 64 << 20  # allocations this small are not checked (reading memory costs)

_FILE_KINDS = {
  stat.S_IFIFO: "FIFO (named pipe)",
  stat.S_IFCHR: "character device",
  stat.S_IFBLK: "block device",
  stat.S_IFDIR: "directory",
  stat.S_IFSOCK: "socket",
}


def open_regular(
  path: str,
  error: type[Exception] = _errors.SourceFormatError,
  *,
  buffered: bool = True,
  inside: str | None = None,
) -> BinaryIO:
  """Opens `path` for binary reading if it is a regular file, once symlinks are followed.

  The check is made on the open file (no race with a swap of the path), and opening never
  blocks: a FIFO, a device (``/dev/zero``), a socket or a directory is refused. With
  `inside`, a file that is a symbolic link is opened only if it stays inside that folder
  (`check_inside`); a file that is not a link costs nothing more.

  Raises:
    error: `path` is not a regular file (`SourceFormatError` unless the caller says), or
      a link that leaves `inside`.
    OSError: it cannot be opened.
  """
  flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
  flags |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
  if inside is None:
    fd = os.open(path, flags)
  else:
    try:
      fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
      if e.errno != errno.ELOOP:
        raise
      check_inside(path, inside, error)
      fd = os.open(path, flags)
  try:
    check_regular(fd, path, error)
    return os.fdopen(fd, "rb", buffering=-1 if buffered else 0)
  except BaseException:
    os.close(fd)
    raise


def check_regular(fd: int, path: str, error: type[Exception] = _errors.SourceFormatError) -> None:
  """Raises `error` unless the open descriptor `fd` (of `path`) is a regular file."""
  mode = os.fstat(fd).st_mode
  if not stat.S_ISREG(mode):
    raise error(f"{path}: {not_regular(mode)}; refusing to read it")


def not_regular(mode: int) -> str:
  """'a FIFO (named pipe), not a regular file', and so on, for a file of mode `mode`."""
  return f"a {_FILE_KINDS.get(stat.S_IFMT(mode), 'special file')}, not a regular file"


def check_inside(
  path: str, folder: str, error: type[Exception] = _errors.SourceFormatError
) -> None:
  """Raises `error` unless `path`, once symlinks are followed, lies inside `folder`.

  The links policy of every reader: a link inside a checkpoint may point anywhere inside it;
  a Hugging Face cache snapshot (`<repo>/snapshots/<revision>/`, whose files link to
  `<repo>/blobs/`) may also point into its repository's `blobs/`; no other link may leave the
  folder (a link to `~/.ssh/id_rsa` is refused, and nothing of its target is read).
  """
  real = os.path.realpath(path)
  for allowed in _allowed_roots(folder):
    if real == allowed or real.startswith(allowed.rstrip(os.sep) + os.sep):
      return
  raise error(
    f"{path}: a symbolic link to a file outside {folder}; refusing to follow it (links may "
    "point inside the checkpoint, or into a Hugging Face cache's blobs/)"
  )


def _allowed_roots(folder: str) -> list[str]:
  root = os.path.realpath(folder)
  roots = [root]
  snapshots = os.path.dirname(root)
  if os.path.basename(snapshots) == "snapshots":
    roots.append(os.path.join(os.path.dirname(snapshots), "blobs"))
  return roots


def read_regular(
  path: str, limit: int, error: type[Exception] = _errors.SourceFormatError
) -> bytes:
  """All of the regular file `path`, refused when larger than `limit` bytes."""
  with open_regular(path, error) as f:
    data = f.read(limit + 1)
  if len(data) > limit:
    raise error(f"{path}: larger than {limit} bytes, more than a metadata file holds")
  return data


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKETS = np.zeros(256, np.int8)
_BRACKETS[[ord("["), ord("{")]] = 1
_BRACKETS[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
  """How deeply the JSON text `raw` nests (brackets outside strings), without parsing it.

  Linear in the text and not recursive; an unterminated string may count its brackets too
  (the document is broken then anyway).
  """
  outside = np.frombuffer(_STRING.sub(b"", raw), np.uint8)
  if not outside.size:
    return 0
  return int(np.cumsum(_BRACKETS[outside], dtype=np.int64).max(initial=0))


def check_json_text(
  raw: bytes | str,
  where: str,
  error: type[Exception] = _errors.SourceFormatError,
  *,
  max_bytes: int = MAX_JSON_BYTES,
  max_depth: int = MAX_JSON_DEPTH,
) -> bytes:
  """`raw` as bytes, once it is known to be small and shallow enough for any JSON parser."""
  if isinstance(raw, str):
    try:
      raw = raw.encode()
    except UnicodeEncodeError:
      raise error(f"{where}: not UTF-8 text") from None
  if len(raw) > max_bytes:
    raise error(f"{where}: {len(raw)} bytes, more than the {max_bytes} a metadata file may hold")
  depth = json_depth(raw)
  if depth > max_depth:
    raise error(f"{where}: JSON nested {depth} levels deep, more than the {max_depth} allowed")
  return raw


def loads_json(
  raw: bytes | str,
  where: str,
  error: type[Exception] = _errors.SourceFormatError,
  *,
  max_bytes: int = MAX_JSON_BYTES,
  max_depth: int = MAX_JSON_DEPTH,
  object_pairs_hook=None,
) -> Any:
  """Parses a metadata document, refusing what no writer of ours or of the formats we read
  produces: too large or too deep a document, NaN or Infinity, duplicate keys, lone
  surrogates (a name that cannot be written back as UTF-8). `object_pairs_hook` replaces
  the refusal of duplicate keys (it may raise `ValueError`, which becomes `error`).

  Raises:
    error: with `where` (the file, and the key inside it where there is one) and the cause.
  """
  raw = check_json_text(raw, where, error, max_bytes=max_bytes, max_depth=max_depth)
  try:
    data = json.loads(
      raw,
      parse_constant=_refuse_constant,
      parse_float=_finite_float,
      object_pairs_hook=object_pairs_hook or _unique,
    )
  except (_Refused, _errors.UcpError) as e:
    raise error(f"{where}: {e}") from None
  except RecursionError:
    raise error(f"{where}: JSON nested too deeply") from None
  except UnicodeDecodeError:
    raise error(f"{where}: not UTF-8 text") from None
  except json.JSONDecodeError as e:
    raise error(
      f"{where}: not valid JSON (truncated or overwritten?): {e.msg} at byte {e.pos}"
    ) from None
  except ValueError:  # an integer of more digits than Python converts (4300)
    raise error(f"{where}: a number too long to read; refusing the document") from None
  bad = _first_unencodable(data)
  if bad is not None:
    raise error(f"{where}: a name or string that is not valid Unicode (a lone surrogate) in {bad}")
  return data


class _Refused(ValueError):
  pass


def _refuse_constant(name: str) -> Any:
  raise _Refused(f"{name} is not a JSON number; refusing the document")


def _finite_float(text: str) -> float:
  value = float(text)
  if not math.isfinite(value):  # 1e999: Infinity by another name
    raise _Refused("a number out of the range of a float; refusing the document")
  return value


def _unique(pairs: list[tuple[str, Any]]) -> dict:
  out = dict(pairs)
  if len(out) != len(pairs):
    seen: set[str] = set()
    for key, _ in pairs:
      if key in seen:
        raise _Refused(f"key {key!a} appears twice in one object")
      seen.add(key)
  return out


def _first_unencodable(data: Any) -> str | None:
  """Where in `data` a string holds a lone surrogate (None if nowhere); not recursive, and
  only containers wait on the stack (a list of millions of numbers costs no more memory)."""
  if isinstance(data, str):
    return None if _encodable(data) else "the document"
  stack: list[tuple[Any, str]] = [(data, "the document")]
  while stack:
    node, where = stack.pop()
    items = node.items() if isinstance(node, dict) else ((None, v) for v in node)
    for key, value in items:
      if key is not None and not _encodable(key):
        return f"key {key!a}"
      at = where if key is None else f"`{key}`"
      if isinstance(value, str):
        if not _encodable(value):
          return at
      elif isinstance(value, (dict, list)):
        stack.append((value, at))
  return None


def _encodable(text: str) -> bool:
  try:
    text.encode()
  except UnicodeEncodeError:
    return False
  return True


def check_json_file(
  path: str, error: type[Exception] = _errors.SourceFormatError, *, max_bytes: int = MAX_JSON_BYTES
) -> None:
  """Checks a local JSON document that a library will read itself: a regular file, small
  and shallow enough to parse safely (its content is not otherwise judged here)."""
  check_json_text(read_regular(path, max_bytes, error), path, error, max_bytes=max_bytes)


def truncated(size: int | None, needed: int, detail: str = "") -> str:
  """The words for a file cut short, the same in every format: `truncated: SIZE of NEEDED
  bytes (DETAIL)` (`fewer than NEEDED` where the size is not known: an object store)."""
  held = f"{size} of {needed}" if size is not None else f"fewer than {needed}"
  return f"truncated: {held} bytes" + (f" ({detail})" if detail else "")


def shape_problem(shape: Any, itemsize: int = 1) -> str | None:
  """Why `shape` cannot be the shape of a stored array (None if it can)."""
  if not isinstance(shape, (list, tuple)):
    return f"shape {_errors.shown(shape)} is not a list of sizes"
  if len(shape) > MAX_RANK:
    return f"a shape of {len(shape)} dimensions (at most {MAX_RANK})"
  if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
    return f"shape {_errors.shown(shape)} is not a list of sizes"
  size = itemsize
  for d in shape:
    size *= max(d, 1)  # a zero dimension empties the array, but each one must still fit
    if size > MAX_ARRAY_BYTES or d > MAX_EXTENT:
      return f"shape {_errors.shown(shape)} declares more than 2**62 bytes"
  return None


def check_shape(shape: Any, where: str, error: type[Exception], itemsize: int = 1) -> None:
  """Raises `error` naming `where` if `shape` cannot be an array's shape (see `shape_problem`)."""
  problem = shape_problem(shape, itemsize)
  if problem:
    raise error(f"{where}: {problem}")


def available_memory() -> int:
  """Bytes this process may still allocate: what the machine has free, the container's
  cgroup allowance and the address-space limit (RLIMIT_AS), whichever is least."""
  limits = [_meminfo("MemAvailable"), _cgroup_free()]
  soft, _ = resource.getrlimit(resource.RLIMIT_AS)
  if soft != resource.RLIM_INFINITY:
    limits.append(soft - _vm_size())
  known = [n for n in limits if n is not None]
  return max(0, min(known)) if known else 1 << 62


def check_allocation(
  nbytes: int, what: str, error: type[Exception] = _errors.InsufficientMemoryError
) -> None:
  """Raises `error` naming `what` when `nbytes` cannot be allocated by this process now.

  Declared sizes come from files: this is the last check before memory is taken for them.
  """
  from ucp_jax.store import _hostmem  # its unused buffers are lent again before new memory

  if nbytes <= _ALWAYS_AFFORDABLE:
    return
  free = available_memory() + _hostmem.POOL.free_bytes()
  if nbytes > free:
    raise error(
      f"{what}: needs {_gib(nbytes)} of memory and this process can allocate "
      f"{_gib(free)} now; read a smaller region, or restore sharded over more devices"
    )


def _gib(n: int) -> str:
  return f"{n / (1 << 30):.3g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.3g} MiB"


def _meminfo(field: str) -> int | None:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def _vm_size() -> int:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmSize:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return 0


_CGROUPS = (  # (limit, statistics, the statistic of memory that cannot be reclaimed)
  ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.stat", "anon"),
  ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.stat", "total_rss"),
)


def _cgroup_free() -> int | None:
  """The container's memory limit less its memory in use (page cache, which the kernel
  reclaims, not counted); None outside a limited container."""
  for limit_file, stat_file, field in _CGROUPS:
    try:
      with open(limit_file) as f:
        limit = f.read().strip()
      with open(stat_file) as f:
        used = next(int(line.split()[1]) for line in f if line.split()[0] == field)
    except (OSError, ValueError, IndexError, StopIteration):
      continue
    if limit.isdigit() and int(limit) < 1 << 60:
      return int(limit) - used
  return None
