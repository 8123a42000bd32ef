"""Export folders: written beside the destination, swapped into place, never over foreign files.

Every sink that writes a local folder uses these: the destination check (an existing folder
is replaced only if it is an earlier export of the same format, and only with `overwrite`),
the lock that turns a second export to the same path away, and the staging folder that
becomes the destination in one rename once everything is written and synced. The swap is the
store's (`_swap.swap_into_place`), with the export's marker as the file that makes a
folder whole: an export cut short between the two renames of the fallback swap is put in
place by the next export to the same path (`recover`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
from collections.abc import Callable, Iterator

from ucp_jax.base import _errors
from ucp_jax.sinks._registry import Destination
from ucp_jax.store import _commit, _location, _swap

MARKER = "ucp_export.json"
"""Written into every export: `{"written_by": "ucp_jax", "format": ..., ...}`."""


def check_destination(
  destination: Destination, *, not_an_export: Callable[[str], list[str]], what: str
) -> str:
  """The absolute export path, or an error if writing there would lose something.

  Args:
    destination: the destination folder, and whether an earlier export there may be replaced.
    not_an_export: what in an existing folder an export of this format does not write
      (empty: it is an earlier export).
    what: the export's name for messages ("a DeepSpeed export").
  """
  path, overwrite = _location.named(destination.path), destination.overwrite
  if "://" in path:
    raise _errors.InvalidArgumentError(f"{path}: {what} is written to a local directory")
  path = os.path.abspath(path)
  if not os.path.lexists(path) and _swap.interrupted_swap(path, _staging_dirs(path), MARKER):
    with _locked(path):  # an export cut short: what it left aside is checked as the folder
      recover(path)
  if os.path.isfile(path) or os.path.islink(path):
    raise _errors.CheckpointExistsError(f"{path}: a file is in the way of the export")
  blocker = _commit.file_above(path)
  if blocker is not None:
    raise _errors.CheckpointExistsError(f"{path}: {blocker} is a file, not a directory")
  if os.path.isdir(path) and os.listdir(path):
    in_the_way = not_an_export(path)
    if in_the_way:
      raise _errors.CheckpointExistsError(
        f"{path}: not an earlier ucp_jax export, so the export will not replace it (nothing "
        "was deleted); in the way:\n" + _errors.bullet_list(in_the_way)
      )
    if not overwrite:
      raise _errors.CheckpointExistsError(
        f"{path}: an export exists already; pass overwrite=True (--overwrite) to replace it"
      )
  return path


def foreign_entries(
  path: str, format: str, what: str, ours: tuple[str, ...] = (), files_only: bool = True
) -> list[str]:
  """What folder `path` holds that an export of `format` did not write (empty: ours).

  Ours: the marker, the names in `ours`, and the files the marker lists; with
  `files_only`, only as plain files. `what` names the export in messages ("a DCP export").
  """
  marker = read_marker(path, format)
  names = sorted(os.listdir(path))
  if marker is None:
    return [f"no {MARKER} of {what}", *names]
  mine = {MARKER, *ours, *(marker.get("files") or [])}
  return [
    n for n in names if n not in mine or (files_only and not os.path.isfile(os.path.join(path, n)))
  ]


def read_marker(path: str, format: str | None = None) -> dict | None:
  """The export marker in folder `path`, or None if it is missing, not ours, or of another format.

  Exports written before markers named their format count as DeepSpeed exports.
  """
  try:
    with open(os.path.join(path, MARKER)) as f:
      marker = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(marker, dict) or marker.get("written_by") != "ucp_jax":
    return None
  if format is not None and marker.get("format", "deepspeed universal") != format:
    return None
  return marker


def write_marker(folder: str, format: str, **fields) -> None:
  """Writes the marker, last: a staging folder holding it is complete (`_swap.recover`)."""
  with open(os.path.join(folder, MARKER), "w") as f:
    json.dump({"written_by": "ucp_jax", "format": format, **fields}, f)
    f.flush()
    os.fsync(f.fileno())


@contextlib.contextmanager
def staged(dst: str, *, durable: bool = True) -> Iterator[str]:
  """A fresh staging folder beside `dst`; it becomes `dst` when the block ends without error.

  Holds `dst`'s lock throughout (a second export is turned away), first puts in place an
  export cut short (`recover`) and removes the staging folders of exports that died, and
  on any error (KeyboardInterrupt included) removes this one and leaves `dst` as it was.
  With `durable`, the folder's entries are fsynced before the swap (the files' data is
  the writer's to sync).
  """
  parent, name = os.path.split(dst)
  _commit.make_dirs(parent, durable=durable)  # a folder created here survives a power loss
  staging = os.path.join(parent, f".{name}{_STAGING}{secrets.randbits(64):016x}")
  with _locked(dst, durable):
    try:
      recover(dst)  # raises, deleting nothing, if it cannot
      for stale in _staging_dirs(dst):
        _swap.discard(stale, MARKER)
      os.makedirs(staging)
      yield staging
      if durable:
        for folder, _, _ in os.walk(staging):
          _swap.fsync_dir(folder)
      _swap.swap_into_place(staging, dst, durable=durable, marker=MARKER)
    except BaseException:
      _swap.drop_staging(staging, dst, MARKER)
      raise


def recover(dst: str) -> None:
  """Puts in place the export that a swap into `dst` cut short left aside (the new one if
  it is whole, else the old one: `_swap.recover`); the caller holds `dst`'s lock."""
  _swap.recover(dst, _staging_dirs(dst), MARKER)


_STAGING = ".ucp-export-"  # an export to DIR/NAME stages in DIR/.NAME.ucp-export-TOKEN


def _staging_dirs(dst: str) -> list[str]:
  """The staging folders of exports to `dst` (and the `.old` folders of their swaps)."""
  parent, name = os.path.split(dst)
  return glob.glob(os.path.join(parent, f".{glob.escape(name)}{_STAGING}*"))


@contextlib.contextmanager
def _locked(dst: str, durable: bool = True) -> Iterator[None]:
  lock = _commit.Lock(_location.resolve(dst), secrets.randbits(63), durable)
  lock.acquire()
  try:
    yield
  finally:
    lock.release()


def write_file(path: str, parts, *, durable: bool = True) -> int:
  """Writes the byte buffers `parts` to `path` in order (synced with `durable`); returns bytes."""
  written = 0
  with open(path, "wb") as f:
    for part in parts:
      view = memoryview(part).cast("B")
      f.write(view)
      written += view.nbytes
    if durable:
      f.flush()
      os.fsync(f.fileno())
  return written


def sync_file(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
