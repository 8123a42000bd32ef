"""Hostile Megatron-LM roots through every entry point: refused in one line naming the file.

Each case starts from a fixture that megatron-core wrote (tests/fixtures/megatron_core) and
forges one thing a Megatron checkpoint adds to a DCP folder: the tracker file, `metadata.json`,
the pickled common state, the distributed optimizer's recorded bucket sizes. The DCP layer
underneath has its own corpus (tests/test_hostile_dcp.py).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
from hostile_run import Case, run_batch

torch = pytest.importorskip("torch")  # the forgeries are written with torch's own classes

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_core"
ROOT = FIXTURES / "distopt_dp_reshardable"
ITER = "iter_0000002"
RANK = "__0_0.distcp"
COMMON = "common_state/shard_0_1"
UNPADDED = "optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded/shard_0_1"


def _copy(folder: Path) -> Path:
  dst = folder / "run"
  shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns("*.npz", "info.json"))
  return dst


def _changed(change):
  def make(folder: Path) -> Path:
    dst = _copy(folder)
    change(dst)
    return dst

  return make


def _entry(key: str, value) -> callable:
  """A change: `key`'s object replaced by `value`'s torch.save blob, appended to a rank file."""

  def change(root: Path) -> None:
    folder = root / ITER
    buffer = io.BytesIO()
    torch.save(value, buffer)
    with open(folder / RANK, "ab") as f:
      offset = f.seek(0, os.SEEK_END)
      f.write(buffer.getvalue())
    meta = pickle.loads((folder / ".metadata").read_bytes())  # megatron-core's own: trusted
    (index,) = [i for i in meta.storage_data if i.fqn == key]
    info = meta.storage_data[index]
    meta.storage_data[index] = dataclasses.replace(
      info, relative_path=RANK, offset=offset, length=len(buffer.getvalue())
    )
    (folder / ".metadata").write_bytes(pickle.dumps(meta))

  return change


class _Runs:
  """Pickles as a call of `os.system`: what a malicious common state would do on load."""

  def __init__(self, canary: str):
    self.canary = canary

  def __reduce__(self):
    return (os.system, (f"touch {self.canary}",))


def _write(name: str, data: bytes):
  return lambda root: (root / name).write_bytes(data)


def _fifo(name: str):
  def change(root: Path) -> None:
    (root / name).unlink()
    os.mkfifo(root / name)

  return change


def _cases(canary: Path) -> list[Case]:
  tracker = "latest_checkpointed_iteration.txt"
  S = Case
  return [
    S("control: a genuine root", _changed(lambda root: None), default="ok"),
    S(
      "a tracker that names no iteration",
      _changed(_write(tracker, b"\x00\xffiter")),
      names=f"run/{tracker}",
      pattern="is not an iteration number or 'release'",
    ),
    S(
      "a tracker larger than any iteration number",
      _changed(_write(tracker, b"2" * 10_000)),
      names=f"run/{tracker}",
      pattern="larger than 64 bytes",
    ),
    S(
      "a tracker that is a FIFO",
      _changed(_fifo(tracker)),
      names=f"run/{tracker}",
    ),
    S(
      "a tracker naming an iteration that is not there",
      _changed(_write(tracker, b"9")),
      names="run/iter_0000009",
      pattern="holds iter_0000002",
    ),
    S(
      "metadata.json that is not JSON",
      _changed(_write(f"{ITER}/metadata.json", b"{" * 100)),
      names=f"run/{ITER}/metadata.json",
      pattern="not JSON",
    ),
    S(
      "a common state whose pickle runs a command",
      _changed(_entry(COMMON, [_Runs(str(canary))])),
      names=f"run/{ITER}",
      pattern="posix.system|os.system",
    ),
    S(
      "a common state that is not a dict",
      _changed(_entry(COMMON, ["args"])),
      names=f"run/{ITER}",
      pattern="the common state is str, not a dict",
    ),
    S(
      "bucket sizes that are not numbers",
      _changed(_entry(UNPADDED, [[{"float32": ["many"]}]])),
      names=f"run/{ITER}",
      pattern="not one buffer's bucket sizes",
    ),
    S(
      "a bucket recorded one element longer than its parameters",
      _changed(_entry(UNPADDED, [[{("float32", "float32"): [3265]}]])),
      names=f"run/{ITER}",
      pattern="--dist-ckpt-optim-fully-reshardable",
    ),
  ]


def test_forged_megatron_roots_through_every_entry_point(tmp_path):
  canary = tmp_path / "canary"
  problems = run_batch(_cases(canary), tmp_path / "cases")
  assert not problems, "\n".join(p.splitlines()[0][:400] for p in problems)
  assert not canary.exists()
