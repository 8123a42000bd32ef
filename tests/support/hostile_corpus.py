"""A corpus of hostile torch files and DeepSpeed folders, built on the fly (no binaries).

Each case makes one hostile file two ways: as a standalone ``.pt`` (`Case.make_pt`) and inside a
copy of a real DeepSpeed fixture (`Case.make_ds`), either in place of the model-states file or
spliced into it as one more top-level key, so that the rest of the folder is genuine and only
the hostile part can fail. `pattern` is a regex the one-line error must match. Payloads that
would run code try to create `canary`; none may.

Pickles are written opcode by opcode (the `pickle` module names the opcodes), so each case says
exactly what it asks of the reader.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

FIXTURES = Path(__file__).parents[1] / "fixtures"
DS_FIXTURE = FIXTURES / "deepspeed" / "z2_fp32_dp2" / "ckpt"
MODEL_STATES = "global_step3/mp_rank_00_model_states.pt"

# Pickle fragments: each pushes one value.


def text(value: str) -> bytes:
  data = value.encode()
  return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def raw(value: bytes) -> bytes:
  return pickle.BINBYTES + struct.pack("<I", len(value)) + value


def integer(value: int) -> bytes:
  if -(2**31) <= value < 2**31:
    return pickle.BININT + struct.pack("<i", value)
  data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
  return pickle.LONG1 + bytes([len(data)]) + data


def glob(module: str, name: str) -> bytes:
  return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def tup(*items: bytes) -> bytes:
  return pickle.MARK + b"".join(items) + pickle.TUPLE


def call(func: bytes, *args: bytes) -> bytes:
  return func + tup(*args) + pickle.REDUCE


def ints(*values: int) -> bytes:
  return tup(*(integer(v) for v in values))


def tensor(key: str, numel: int, offset: int, size: tuple, stride: tuple) -> bytes:
  """A float32 tensor on storage `key` of `numel` elements (what torch.save writes, v2)."""
  storage = tup(text("storage"), glob("torch", "FloatStorage"), text(key), text("cpu"))
  storage = storage[:-1] + integer(numel) + pickle.TUPLE + pickle.BINPERSID
  return call(
    glob("torch._utils", "_rebuild_tensor_v2"),
    storage,
    integer(offset),
    ints(*size),
    ints(*stride),
    pickle.NEWFALSE,
    pickle.NONE,
  )


def system(canary: Path) -> bytes:
  return call(glob("posix", "system"), text(f"touch {canary}"))


def getattr_system(canary: Path) -> bytes:  # getattr(__import__('os'), 'system')(cmd)
  imported = call(glob("builtins", "__import__"), text("os"))
  return call(call(glob("builtins", "getattr"), imported, text("system")), text(f"touch {canary}"))


def forged_object_dtype() -> bytes:
  """An object dtype whose BUILD clears its flags, then an array of it from raw bytes: numpy
  reads a pointer from the bytes (SIGSEGV under plain pickle)."""
  dtype = call(glob("numpy", "dtype"), text("O8"), pickle.NEWFALSE, pickle.NEWTRUE)
  dtype += tup(integer(3), text("|"), *[pickle.NONE] * 3, *[integer(-1)] * 2, integer(0))
  dtype += pickle.BUILD
  return call(glob("numpy._core.numeric", "_frombuffer"), raw(b"A" * 8), dtype, ints(1), text("C"))


def forged_dtype_flags() -> bytes:
  """A float64 dtype whose BUILD sets the object flags (63)."""
  dtype = call(glob("numpy", "dtype"), text("f8"), pickle.NEWFALSE, pickle.NEWTRUE)
  state = tup(integer(3), text("<"), *[pickle.NONE] * 3, *[integer(-1)] * 2, integer(63))
  return call(glob("numpy._core.multiarray", "scalar"), dtype + state + pickle.BUILD, raw(b"A" * 8))


def forged_array_state() -> bytes:
  """An array BUILD state that promises 2 float64 and holds 8 bytes."""
  array = call(
    glob("numpy._core.multiarray", "_reconstruct"), glob("numpy", "ndarray"), ints(0), raw(b"b")
  )
  dtype = call(glob("numpy", "dtype"), text("f8"), pickle.NEWFALSE, pickle.NEWTRUE)
  state = tup(integer(1), ints(2), dtype, pickle.NEWFALSE, raw(b"A" * 8))
  return array + state + pickle.BUILD


def billion_laughs() -> bytes:
  """Ten lists of ten references to the one before: 10**9 leaves from 200 bytes."""
  out = pickle.EMPTY_LIST + pickle.MARK + text("lol") * 10 + pickle.APPENDS
  for level in range(9):
    out += pickle.BINPUT + bytes([level]) + pickle.POP
    out += pickle.EMPTY_LIST + pickle.MARK + (pickle.BINGET + bytes([level])) * 10 + pickle.APPENDS
  return out


def hash_bomb() -> bytes:
  """A tuple of two references to the one before, 40 deep (2**40 nodes), as a dict key."""
  out = pickle.NONE
  for level in range(40):
    out += pickle.BINPUT + bytes([level]) + pickle.BINGET + bytes([level]) + pickle.TUPLE2
  return pickle.EMPTY_DICT + out + pickle.NONE + pickle.SETITEM


def deep_tuple_key() -> bytes:
  """A tuple nested 200000 deep as a dict key: hashing it overflows the C stack (SIGSEGV)."""
  return pickle.EMPTY_DICT + pickle.NONE + pickle.TUPLE1 * 200_000 + pickle.NONE + pickle.SETITEM


def deep_lists() -> bytes:
  """Lists nested 100000 deep (RecursionError in any recursive walk); a constant stack."""
  step = pickle.EMPTY_LIST + pickle.BINGET + b"\x00" + pickle.APPEND + pickle.BINPUT + b"\x00"
  start = pickle.EMPTY_LIST + pickle.BINPUT + b"\x00" + pickle.POP
  return start + (step + pickle.POP) * 100_000 + pickle.BINGET + b"\x00"


def cycle() -> bytes:
  """A list that holds itself."""
  return pickle.EMPTY_LIST + pickle.BINPUT + b"\x00" + pickle.BINGET + b"\x00" + pickle.APPEND


def shadowing_ordered_dict() -> bytes:
  """An OrderedDict whose BUILD state sets `get`, `items` and `keys`: its methods then fail."""
  state = pickle.EMPTY_DICT + pickle.MARK
  state += b"".join(text(name) + integer(5) for name in ("get", "items", "keys"))
  state += pickle.SETITEMS
  return call(glob("collections", "OrderedDict")) + state + pickle.BUILD


def set_of_range() -> bytes:
  """set(range(10**12)): a 10-byte request for terabytes."""
  return call(glob("builtins", "set"), call(glob("builtins", "range"), integer(10**12)))


# Torch zip files.


def torch_zip(data: bytes, storages: dict[str, bytes] | None = None, root: str = "archive"):
  """The bytes of a torch zip file with `data` as its data.pkl."""
  return _zip(
    {f"{root}/data.pkl": data, f"{root}/byteorder": b"little", f"{root}/version": b"3\n"}
    | {f"{root}/data/{key}": value for key, value in (storages or {}).items()}
  )


def _zip(entries: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
  buffer = io.BytesIO()
  with zipfile.ZipFile(buffer, "w", compression) as z:
    for name, value in entries.items():
      z.writestr(name, value)
  return buffer.getvalue()


def _entries(data: bytes) -> dict[str, bytes]:
  with zipfile.ZipFile(io.BytesIO(data)) as z:
    return {info.filename: z.read(info) for info in z.infolist()}


def pickled(fragment: bytes) -> bytes:
  return pickle.PROTO + b"\x02" + fragment + pickle.STOP


def inject(pt: Path, key: str, fragment: bytes, storages: dict[str, bytes] | None = None) -> bytes:
  """Torch file `pt` with `key: fragment` set last on its top-level dict, and more storages."""
  entries = _entries(pt.read_bytes())
  root = next(name for name in entries if name.endswith("/data.pkl")).split("/")[0]
  data = entries[f"{root}/data.pkl"]
  assert data.endswith(pickle.STOP)
  entries[f"{root}/data.pkl"] = data[:-1] + text(key) + fragment + pickle.SETITEM + pickle.STOP
  entries |= {f"{root}/data/{k}": v for k, v in (storages or {}).items()}
  return _zip(entries)


# (offset of the flags, of the compressed size, of the name length, of the name) per header
_HEADERS = {b"PK\x03\x04": (6, 18, 26, 30), b"PK\x01\x02": (8, 20, 28, 46)}


def _patch(data: bytes, name: str, *, compressed=None, uncompressed=None, flags=None) -> bytes:
  """Rewrites what the local and central headers of entry `name` declare."""
  out = bytearray(data)
  for signature, (at_flags, at_sizes, at_length, at_name) in _HEADERS.items():
    pos = 0
    while (pos := out.find(signature, pos)) >= 0:
      length = struct.unpack_from("<H", out, pos + at_length)[0]
      if bytes(out[pos + at_name : pos + at_name + length]) == name.encode():
        if flags is not None:
          struct.pack_into("<H", out, pos + at_flags, flags)
        if compressed is not None:
          struct.pack_into("<I", out, pos + at_sizes, compressed)
        if uncompressed is not None:
          struct.pack_into("<I", out, pos + at_sizes + 4, uncompressed)
      pos += 4
  return bytes(out)


def encrypted(data: bytes, name: str) -> bytes:
  """Entry `name` flagged as encrypted (bit 0), its bytes unchanged."""
  with zipfile.ZipFile(io.BytesIO(data)) as z:
    flags = z.getinfo(name).flag_bits
  return _patch(data, name, flags=flags | 1)


def stored_past_end(data: bytes, name: str) -> bytes:
  """Stored entry `name` claiming 2 GiB, in a file of a few KiB."""
  return _patch(data, name, compressed=0x7FFF0000, uncompressed=0x7FFF0000)


def deflate_bomb_claimed() -> bytes:
  """A deflated storage that claims to inflate to 2 GiB from a few bytes."""
  data = _zip(_entries(torch_zip(pickled(tensor("0", 4, 0, (4,), (1,))), {"0": bytes(16)})))
  data = _zip(_entries(data), zipfile.ZIP_DEFLATED)
  return _patch(data, "archive/data/0", uncompressed=0x7FFF0000)


def deflate_bomb_hidden() -> bytes:
  """data.pkl declared 4 bytes long whose deflate stream inflates to 64 MiB."""
  good = pickled(pickle.NONE)
  data = _zip(
    {"archive/data.pkl": good + bytes(64 << 20), "archive/byteorder": b"little"},
    zipfile.ZIP_DEFLATED,
  )
  return _patch(data, "archive/data.pkl", uncompressed=len(good))


def bzip2_member() -> bytes:
  return _zip(_entries(torch_zip(pickled(pickle.NONE))), zipfile.ZIP_BZIP2)


def legacy_with_payload(canary: Path) -> bytes:
  magic = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little") + b"."
  return magic + pickled(system(canary))


# The cases.

Maker = Callable[[Path, Path], None]


@dataclasses.dataclass(frozen=True)
class Case:
  """One hostile input.

  Attributes:
    name: what it is.
    pattern: a regex the one-line error matches.
    make_pt: writes the standalone hostile file at a path (canary given); None: no such file.
    make_ds: alters a copy of `DS_FIXTURE` (folder, canary); None: replace the model states by
      `make_pt`'s file.
    fragment: for a pickle-level case, the hostile value (given the canary), which `inject`
      sets as `key` on a file's top-level dict, next to the extra `storages`.
  """

  name: str
  pattern: str
  make_pt: Maker | None
  make_ds: Maker | None = None
  fragment: Callable[[Path], bytes] | None = None  # a pickle-level case: the value, its key
  key: str = "client_state"
  storages: dict[str, bytes] | None = None


def _write(data: Callable[[Path], bytes]) -> Maker:
  return lambda path, canary: path.write_bytes(data(canary))


def _pickle_pt(fragment: Callable[[Path], bytes], storages=None) -> Maker:
  return _write(lambda canary: torch_zip(pickled(fragment(canary)), storages))


def _inject_ds(key: str, fragment: Callable[[Path], bytes], storages=None) -> Maker:
  def make(folder: Path, canary: Path) -> None:
    target = folder / MODEL_STATES
    target.write_bytes(inject(target, key, fragment(canary), storages))

  return make


def _both(name, pattern, fragment, key="client_state", storages=None) -> Case:
  """A pickle-level case: the standalone file, and the same value spliced into model states."""
  make_pt, make_ds = _pickle_pt(fragment, storages), _inject_ds(key, fragment, storages)
  return Case(name, pattern, make_pt, make_ds, fragment, key, storages)


def _replace_model_states(make: Callable[[Path], None]) -> Maker:
  def replace(folder: Path, canary: Path) -> None:
    target = folder / MODEL_STATES
    target.unlink()
    make(target)

  return replace


def _fifo(path: Path, canary: Path) -> None:
  os.mkfifo(path)


def _dev_zero(path: Path, canary: Path) -> None:
  path.symlink_to("/dev/zero")


def _truncated(path: Path, canary: Path) -> None:
  data = (DS_FIXTURE / MODEL_STATES).read_bytes()
  path.write_bytes(data[: len(data) // 2])


def _latest(tag: Callable[[Path], str]) -> Maker:
  def make(folder: Path, canary: Path) -> None:
    outside = folder.parent / "x"  # a genuine tag folder outside the checkpoint folder
    if not outside.exists():
      shutil.copytree(folder / "global_step3", outside)
    (folder / "latest").write_text(tag(outside))

  return make


_STORAGE = "hostile"

CASES = [
  _both("code: posix.system", r"refusing to unpickle: global `posix\.system`", system),
  _both(
    "code: getattr(__import__('os'), 'system')",
    r"refusing to unpickle: global `builtins\.getattr`",
    getattr_system,
  ),
  Case(
    "code: legacy torch file with a payload",
    r"legacy torch format",
    _write(legacy_with_payload),
  ),
  _both(
    "numpy: object dtype with forged flags", r"numpy\.dtype\('O8'", lambda c: forged_object_dtype()
  ),
  _both(
    "numpy: dtype BUILD setting flags", r"numpy dtype BUILD state", lambda c: forged_dtype_flags()
  ),
  _both(
    "numpy: array BUILD short of bytes",
    r"numpy array of shape \(2,\)",
    lambda c: forged_array_state(),
  ),
  _both("billion laughs (lists)", r"MAX_TREE_NODES", lambda c: billion_laughs()),
  _both("hash bomb (a 2**40-node tuple as a key)", r"MAX_TREE_NODES", lambda c: hash_bomb()),
  _both(
    "deep tuple as a dict key (C stack)", r"nesting depth .*MAX_DEPTH", lambda c: deep_tuple_key()
  ),
  _both("deep client state (RecursionError)", r"nesting depth .*MAX_DEPTH", lambda c: deep_lists()),
  _both("a list that holds itself", r"a container holds itself", lambda c: cycle()),
  _both(
    "BUILD onto an OrderedDict hiding its methods",
    r"OrderedDict state .* is not a dict of new attribute names",
    lambda c: shadowing_ordered_dict(),
    key="module",
  ),
  _both("set(range(10**12))", r"set of a range", lambda c: set_of_range()),
  _both(
    "tensor beyond its storage",
    r"holds 4 elements of float32, but a tensor on it",
    lambda c: tensor(_STORAGE, 4, 2, (10,), (1,)),
    storages={_STORAGE: bytes(16)},
  ),
  _both(
    "zero stride claiming terabytes",
    r"MAX_BROADCAST_BYTES",
    lambda c: tensor(_STORAGE, 1, 0, (2**40,), (0,)),
    storages={_STORAGE: bytes(4)},
  ),
  _both(
    "storage larger than its entry",
    r"holds 16 bytes, but the pickle needs 4398046511104",
    lambda c: tensor(_STORAGE, 2**40, 0, (2**40,), (1,)),
    storages={_STORAGE: bytes(16)},
  ),
  Case(
    "stored entry claiming bytes past the end of the file",
    r"entry '[^']*data\.pkl' claims 2147418112 bytes .* past the end",
    _write(lambda c: stored_past_end(torch_zip(pickled(pickle.NONE)), "archive/data.pkl")),
    _replace_model_states(
      lambda p: p.write_bytes(
        stored_past_end(
          (DS_FIXTURE / MODEL_STATES).read_bytes(), "mp_rank_00_model_states/data.pkl"
        )
      )
    ),
  ),
  Case(
    "zip bomb: a deflated storage claiming 2 GiB",
    r"claims to inflate .* a zip bomb",
    _write(lambda c: deflate_bomb_claimed()),
  ),
  Case(
    "zip bomb: deflate stream far beyond the declared size",
    r"data\.pkl' is corrupt \(BadZipFile: Bad CRC-32",
    _write(lambda c: deflate_bomb_hidden()),
  ),
  Case("bzip2 member", r"uses compression method 12", _write(lambda c: bzip2_member())),
  Case(
    "encrypted member",
    r"data\.pkl' is encrypted",
    _write(lambda c: encrypted(torch_zip(pickled(pickle.NONE)), "archive/data.pkl")),
    _replace_model_states(
      lambda p: p.write_bytes(
        encrypted((DS_FIXTURE / MODEL_STATES).read_bytes(), "mp_rank_00_model_states/data.pkl")
      )
    ),
  ),
  Case("truncated zip", r"truncated or corrupt zip file", _truncated),
  Case("FIFO", r"a FIFO \(named pipe\), not a regular file", _fifo),
  Case("symlink to /dev/zero", r"a character device, not a regular file", _dev_zero),
  Case(
    "latest naming ../x",
    r"latest: names '\.\./x', not a tag folder beside it",
    None,
    _latest(lambda outside: "../x"),
  ),
  Case(
    "latest naming an absolute path",
    r"latest: names '/.*', not a tag folder beside it",
    None,
    _latest(lambda outside: str(outside)),
  ),
]
"""Every hostile case; `make_ds` None means the standalone file replaces the model states."""


def make_ds(case: Case, folder: Path, canary: Path) -> Path:
  """A copy of `DS_FIXTURE` at `folder` made hostile by `case`; returns the folder."""
  shutil.copytree(DS_FIXTURE, folder)
  if case.make_ds is not None:
    case.make_ds(folder, canary)
  else:
    target = folder / MODEL_STATES
    target.unlink()
    case.make_pt(target, canary)
  return folder
