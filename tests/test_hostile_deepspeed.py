"""Hostile DeepSpeed folders and torch files through every entry point (`hostile_run`).

The pickles inside DeepSpeed's files have their own corpus (test_hostile_corpus.py); these
cases attack the folder around them, starting from the genuine fixtures made by DeepSpeed
(tests/fixtures): the `latest` pointer, the tag folder, the rank files and the universal
folder's files replaced by FIFOs or by links out of the checkpoint, and files whose tensors
declare gigabytes stored as holes of a sparse file. The policy (docs/sources.md): a link may
point anywhere inside the checkpoint folder; a link out of it is refused before anything of
its target is read; a FIFO or a device is refused as what it is.
"""

from __future__ import annotations

import os
import pickle
import shutil
import struct
import zlib
from pathlib import Path

import hostile_corpus as corpus
import pytest
from hostile_run import Case, run_batch

DS = corpus.FIXTURES / "deepspeed"
TAG = "global_step3"
MODEL = f"{TAG}/mp_rank_00_model_states.pt"
OPTIM = f"{TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt"
pytestmark = pytest.mark.slow


def sparse_torch_file(
  f, numel: int, shape: tuple[int, ...] | None = None, key: str = "", transposed: bool = False
) -> int:
  """Writes at `f`'s position a torch.save file of one float32 tensor of `numel` zeros whose
  storage is a hole (a sparse file: no disk used), shaped `shape` (default `(numel,)`;
  `transposed`: a 2-D transposed view, as `w.t()` saves), as `{key: tensor}` if `key` is
  given; returns its length. Its entries are stored, their bytes 64-aligned, as torch
  writes them."""
  shape = shape or (numel,)
  strides = tuple(int(s) for s in _strides(shape))
  if transposed:
    strides = (1, shape[0])
  start = f.tell()
  value = corpus.tensor("0", numel, 0, shape, strides)
  if key:
    value = pickle.EMPTY_DICT + corpus.text(key) + value + pickle.SETITEM
  pkl = corpus.pickled(value)
  entries = [("archive/data.pkl", pkl), ("archive/byteorder", b"little")]
  entries += [("archive/version", b"3\n"), ("archive/data/0", numel * 4)]
  central = []
  for name, data in entries:
    offset = f.tell() - start
    size = data if isinstance(data, int) else len(data)
    crc = 0 if isinstance(data, int) else zlib.crc32(data)  # a hole's bytes are never checked
    pad = -(offset + 30 + len(name)) % 64
    f.write(_LOCAL.pack(b"PK\x03\x04", 20, 0, 0, 0, 0, crc, size, size, len(name), pad))
    f.write(name.encode() + bytes(pad))
    if isinstance(data, int):
      f.seek(data, os.SEEK_CUR)
    else:
      f.write(data)
    central.append((name, crc, size, offset))
  directory = f.tell() - start
  for name, crc, size, offset in central:
    f.write(
      _CENTRAL.pack(
        b"PK\x01\x02", 20, 20, 0, 0, 0, 0, crc, size, size, len(name), 0, 0, 0, 0, 0, offset
      )
    )
    f.write(name.encode())
  size = f.tell() - start - directory
  f.write(_END.pack(b"PK\x05\x06", 0, 0, len(central), len(central), size, directory, 0))
  return f.tell() - start


_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_END = struct.Struct("<4sHHHHIIH")


def _strides(shape: tuple[int, ...]) -> list[int]:
  out, step = [], 1
  for n in reversed(shape):
    out.append(step)
    step *= n
  return out[::-1]


def _copy(fixture: Path, change=None):
  """A maker: a copy of `fixture`, then `change(folder)`."""

  def make(folder: Path) -> Path:
    dst = folder / "ckpt"
    shutil.copytree(fixture, dst, symlinks=True)
    if change is not None:
      change(dst)
    return dst

  return make


def _fifo(name: str):
  def change(folder: Path) -> None:
    (folder / name).unlink()
    os.mkfifo(folder / name)

  return change


def _link(name: str, target):
  """`name` (a file or a folder) replaced by a link to `target(folder)`."""

  def change(folder: Path) -> None:
    to = target(folder)
    if (folder / name).is_dir():
      shutil.rmtree(folder / name)
    else:
      (folder / name).unlink()
    (folder / name).symlink_to(to)

  return change


def _outside(name: str):
  """A genuine copy of `name` beside the folder (outside it)."""

  def target(folder: Path) -> Path:
    out = folder.parent / ("outside-" + name.replace("/", "-"))
    copy = shutil.copytree if (folder / name).is_dir() else shutil.copy
    copy(folder / name, out)
    return out

  return target


def _inside(name: str):
  """A genuine copy of `name` in a hidden folder inside the checkpoint (a relative link)."""

  def target(folder: Path) -> Path:
    hidden = folder / ".moved"
    hidden.mkdir(exist_ok=True)
    copy = shutil.copytree if (folder / name).is_dir() else shutil.copy
    copy(folder / name, hidden / Path(name).name)
    return Path(os.path.relpath(hidden / Path(name).name, (folder / name).parent))

  return target


def _latest_to_outside(folder: Path) -> None:
  outside = folder.parent / "latest-outside"
  outside.write_text(TAG)
  (folder / "latest").unlink()
  (folder / "latest").symlink_to(outside)


def _stray_link(folder: Path) -> None:
  """A file the readers never open, linked out of the folder: nothing to refuse."""
  (folder / TAG / "notes.txt").symlink_to("/etc/hostname")


def _sparse_transposed(folder: Path) -> Path:
  """A torch file whose one tensor, a transposed view, declares 4 GiB stored as a hole: a
  strided tensor is copied to be read, so reading it needs the memory."""
  with open(folder / "big.pt", "wb") as f:
    sparse_torch_file(f, 2**30 - 2**15, (2**15 - 1, 2**15), key="w", transposed=True)
  return folder / "big.pt"


def _huge_rank(folder: Path) -> None:
  """A ZeRO-3 model-states file of dp rank 10**11 (an empty file): the ranks counted from
  the listing, never `range(10**11)`."""
  (folder / TAG / "zero_pp_rank_99999999999_mp_rank_00_model_states.pt").write_bytes(b"")


def _newline_name(folder: Path) -> None:
  """No optimizer-states files, and a file whose name holds a newline, which the error that
  lists the folder shows escaped, on one line."""
  for path in (folder / TAG).glob("*optim_states.pt"):
    path.unlink()
  (folder / TAG / "a\nb.pt").write_bytes(b"")


def _sparse_state_dict(folder: Path) -> Path:
  """A torch file whose one tensor declares 4 GiB, stored as a hole."""
  with open(folder / "big.pt", "wb") as f:
    sparse_torch_file(f, 2**30 - 1024, key="w")
  return folder / "big.pt"


def _cases() -> list[Case]:
  z2 = DS / "z2_fp32_dp2" / "ckpt"
  z3 = DS / "z3_fp32_dp2" / "ckpt"
  universal = DS / "z2_fp32_dp2"  # `latest_universal` names universal/
  tp = corpus.FIXTURES / "tp" / "autotp_tp2_dp2" / "ckpt"
  slot = "universal/zero/fc1.bias/exp_avg.pt"
  S = Case
  return [
    S("control: ZeRO-2", _copy(z2), default="ok"),
    S("latest: a link out", _copy(z2, lambda d: _latest_to_outside(d)), pattern="outside"),
    S("latest: a FIFO", _copy(z2, _fifo("latest")), pattern="FIFO"),
    S(
      "latest: a link to /dev/zero",
      _copy(z2, _link("latest", lambda _: "/dev/zero")),
      pattern="character device",
    ),
    S("tag folder: a link out", _copy(z2, _link(TAG, _outside(TAG))), pattern="outside"),
    S("tag folder: a link inside", _copy(z2, _link(TAG, _inside(TAG))), default="ok"),
    S("model states: a link out", _copy(z2, _link(MODEL, _outside(MODEL))), pattern="outside"),
    S(
      "model states: a link to /dev/zero",
      _copy(z2, _link(MODEL, lambda _: "/dev/zero")),
      pattern="character device",
    ),
    S("optim states: a link inside", _copy(z2, _link(OPTIM, _inside(OPTIM))), default="ok"),
    S("optim states: a FIFO", _copy(z2, _fifo(OPTIM)), pattern="FIFO"),
    S("a stray link out that no reader opens", _copy(z2, _stray_link), default="ok"),
    S(
      "ZeRO-3 model states of rank 1: a link out",
      _copy(
        z3,
        _link(
          f"{TAG}/zero_pp_rank_1_mp_rank_00_model_states.pt",
          _outside(f"{TAG}/zero_pp_rank_1_mp_rank_00_model_states.pt"),
        ),
      ),
      pattern="outside",
    ),
    S(
      "TP rank 1 model states: a link out",
      _copy(
        tp,
        _link(f"{TAG}/mp_rank_01_model_states.pt", _outside(f"{TAG}/mp_rank_01_model_states.pt")),
      ),
      pattern="outside",
    ),
    S(
      "ZeRO-3: a rank file numbered 10**11",
      _copy(z3, _huge_rank),
      pattern=r"missing for dp ranks \[2\]",
    ),
    S(
      "a listing with a name holding a newline",
      _copy(z2, _newline_name),
      pattern=r"found: 'a\\nb\.pt', mp_rank_00",
    ),
    S("universal: control", _copy(universal), default="ok"),
    S(
      "universal: a slot file, a link out",
      _copy(universal, _link(slot, _outside(slot))),
      pattern="outside",
    ),
    S(
      "universal: a parameter folder, a link out",
      _copy(universal, _link("universal/zero/fc1.bias", _outside("universal/zero/fc1.bias"))),
      pattern="outside",
    ),
    S(
      "universal: latest_universal, a link out",
      _copy(universal, _link("latest_universal", _outside("latest_universal"))),
      pattern="outside",
    ),
    S("universal: a slot file, a FIFO", _copy(universal, _fifo(slot)), pattern="FIFO"),
    S(
      "universal: optimizer_state.pt, a FIFO",
      _copy(universal, _fifo("universal/zero/optimizer_state.pt")),
    ),
    S(
      "torch file: a folder's one file, a link out",
      _torch_folder(lambda d: _outside_file(d)),
      pattern="outside",
    ),
    S(
      "torch file: a folder's one file, a link inside",
      _torch_folder(lambda d: Path("sub/model.pt")),
      default="ok",
    ),
    S(
      "torch file: 4 GiB declared, stored as a hole",
      _sparse_state_dict,
      # verify, convert and diff work, a block at a time: minutes of zeros (test_host_memory)
      expect={"inspect": "ok", "verify": None, "convert": None, "diff": None},
      pattern="memory",
    ),
    S(
      "torch file: a transposed 4 GiB tensor, stored as a hole",
      _sparse_transposed,
      expect={"inspect": "ok"},
      pattern="memory",
    ),
  ]


def _outside_file(folder: Path) -> Path:
  out = folder.parent / "outside.pt"
  shutil.copy(folder / "sub" / "model.pt", out)
  return out


def _torch_folder(target):
  """A folder holding one torch file, `model.pt`, a link to `target(folder)`."""

  def make(folder: Path) -> Path:
    dst = folder / "ckpt"
    (dst / "sub").mkdir(parents=True)
    shutil.copy(corpus.DS_FIXTURE / MODEL, dst / "sub" / "model.pt")
    (dst / "model.pt").symlink_to(target(dst))
    return dst

  return make


def test_hostile_folders_through_every_entry_point(tmp_path):
  problems = run_batch(_cases(), tmp_path)
  assert not problems, "\n".join(p.splitlines()[0][:400] for p in problems)
