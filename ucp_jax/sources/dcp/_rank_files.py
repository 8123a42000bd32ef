"""The rank files of a DCP folder, checked against the spans its `.metadata` stores in them.

Each rank file must be a regular file inside the folder (a link may point inside it only:
`store._untrusted.check_inside`) and hold every span stored in it. Every blob is a whole
`torch.save` file of its own, so two spans are either the same bytes (an alias: ucp_jax's
DCP export stores a tied weight once for both names) or share none; each chunk's elements fit
in its span (`_metadata`), so the tensors declare no more bytes than the files hold, aliases
aside (which `convert`'s growth check counts). A file's first chunk must start with a
`torch.save` (zip) file: a folder saved with `serialization_format=SAFETENSORS` is named as
such, in one line.
"""

from __future__ import annotations

import os
import struct

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources import _files, _remote
from ucp_jax.store import _untrusted

_ZIP = b"PK\x03\x04"  # where every torch.save blob starts
MAX_LISTED = 8
"""Problems of one rank file listed before the rest are summed up."""

Spans = dict[str, list]
"""Rank file -> `(key, what, blob)` of each blob stored in it (a `_metadata.Chunk` or
`BytesEntry`, with `stored`), in key order; `what` names a chunk (" chunk at (0, 4)")."""


def check(folder: str, spans: Spans, fs: _files.Files) -> list[str]:
  """Each rank file exists, is a regular file inside the folder, holds the spans stored in
  it, no two of them overlapping, and is of torch.save blobs (not safetensors)."""
  if fs.remote:
    return _check_objects(folder, spans, fs)
  problems = []
  for name in sorted(spans):
    full = os.path.join(folder, name)
    users = spans[name]
    keys = list(dict.fromkeys(key for key, _, _ in users))
    shown = _some(keys)
    try:
      if os.path.isfile(full):  # (a special file: refused below by what it is)
        _untrusted.check_inside(full, folder)
      first = _first_chunk(users)
      with _untrusted.open_regular(full) as f:
        size = os.fstat(f.fileno()).st_size
        head = os.pread(f.fileno(), 16, first[2].stored.offset) if first else b""
    except FileNotFoundError:
      problems.append(
        f"{full}: missing (a rank file; {len(keys)} entries are stored in it: {shown})"
      )
      continue
    except SourceFormatError as e:
      problems.append(str(e))
      continue
    except OSError as e:
      problems.append(f"{full}: unreadable ({e.strerror or e}); it holds {shown}")
      continue
    if first and not head.startswith(_ZIP):  # first: safetensors shares spans between chunks
      problems.append(_not_torch_save(full, folder, first, head, size))
    else:
      problems += _check_spans(full, users, size)
  return problems


def _check_spans(full: str, users: list, size: int | None) -> list[str]:
  """Spans past the end of the file (`size`, if known) and spans that overlap: each blob is
  a whole file of its own, so two spans are the same bytes (an alias) or share none."""
  problems: list[str] = []
  end, last, previous = 0, None, None
  past_end: list[int] = []  # where the entries that lie past the end of the file end
  for key, at, blob in sorted(users, key=lambda u: (u[2].stored.offset, u[2].stored.length)):
    stored = blob.stored
    stop = stored.offset + stored.length
    alias, previous = (stored.offset, stored.length) == previous, (stored.offset, stored.length)
    if alias:  # the very bytes of the entry before: a tied weight, as ucp_jax's export writes
      continue
    if size is not None and stop > size:
      past_end.append(stop)
    elif last is not None and stored.length and stored.offset < end:
      problems.append(
        f"{full}: `{key}`{at} is stored at bytes {stored.offset}..{stop}, which overlap those "
        f"of `{last[0]}`{last[1]}: no two entries share bytes in dcp.save's files"
      )
    elif stored.length and stop > end:
      end, last = stop, (key, at)
    if len(problems) >= MAX_LISTED:
      problems.append(f"{full}: ... (more overlapping spans)")
      break
  if past_end:  # one cause, said once: the file was cut short
    detail = f"{len(past_end)} of {len(users)} entries lie past its end"
    problems.append(f"{full}: {_untrusted.truncated(size, max(past_end), detail)}")
  return problems


def _first_chunk(users: list) -> tuple | None:
  """The (key, what, blob) of the first tensor chunk of a rank file (else its first blob)."""
  chunks = [u for u in users if u[1]] or users
  return min(chunks, key=lambda u: u[2].stored.offset) if chunks else None


def _not_torch_save(full: str, folder: str, first: tuple, head: bytes, size: int) -> str:
  """The problem of a rank file whose first chunk (`first`, whose first bytes are `head`) is
  not a torch.save (zip) file: a folder saved as safetensors is refused at once, in one line."""
  key, at, blob = first
  header = struct.unpack("<Q", head[:8])[0] if len(head) >= 9 else 0
  if head[8:9] == b"{" and 0 < header <= size - blob.stored.offset - 8:
    raise SourceFormatError(
      f"{folder}: saved with serialization_format=SAFETENSORS ({os.path.basename(full)} holds "
      "safetensors), which this reader does not read: save with dcp.save's default "
      "FileSystemWriter (torch_save), or load it with torch's dcp.load"
    )
  return (
    f"{full}: `{key}`{at} is stored at byte {blob.stored.offset}, where no torch.save file "
    "starts: not a rank file of dcp.save's torch_save format"
  )


def _some(keys: list[str]) -> str:
  return ", ".join(f"`{k}`" for k in keys[:3]) + (" ..." if len(keys) > 3 else "")


def _check_objects(folder: str, spans: Spans, fs: _files.Files) -> list[str]:
  """`check` on an object store, where sizes are not listed: each rank file's last stored
  byte is read (one small request per file), and the first file's first blob."""
  problems = []
  objects = _remote.Folder.at(folder)
  for i, (name, users) in enumerate(sorted(spans.items())):
    full = os.path.join(folder, name)
    keys = list(dict.fromkeys(key for key, _, _ in users))
    end = max(u[2].stored.offset + u[2].stored.length for u in users)
    if not fs.isfile(full):
      problems.append(
        f"{full}: missing (a rank file; {len(keys)} entries are stored in it: {_some(keys)})"
      )
      continue
    try:
      if end:
        objects.read(name, end - 1, end)
        _files.note_size(full, end)
    except SourceFormatError:
      problems.append(
        f"{full}: shorter than the {end} bytes its entries are stored in ({_some(keys)}): "
        "truncated?"
      )
      continue
    first = _first_chunk(users)
    if i == 0 and first:
      at = first[2].stored.offset
      head = objects.read(name, at, min(at + 16, end))[0]
      if not head.startswith(_ZIP):
        problems.append(_not_torch_save(full, folder, first, head, end))
        continue
    problems += _check_spans(full, users, None)
  return problems
