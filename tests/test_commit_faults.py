"""No lost checkpoint: a commit interrupted at any step leaves the old checkpoint or the new one.

Every path that commits a folder (save, save_async, convert, and export to each sink)
overwrites an old checkpoint with a new one, with the atomic exchange hidden (renameat2
fails with EINVAL, as on NFS, macOS and many FUSE mounts) or available, and is interrupted
at each file-system step of its commit, as found by recording a clean run:
- in process: KeyboardInterrupt, or OSError(EIO), raised in place of the step (an rmtree is
  cut half way, as an error or Ctrl-C inside it would);
- killed: the folder as a SIGKILL just before the step leaves it (a copy; for a deletion,
  also a copy half deleted), examined as a crash leaves it. The real SIGKILLs of
  test_commit.py (support/commit_fault_worker.py) at the decisive steps check that the copies
  tell the truth.
After each: the path reads as the old or the new checkpoint, whole (the old one when the
interruption came before the commit point, the fsync of the parent folder), and the next
save there works and leaves nothing beside it.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import ucp_jax
from ucp_jax.sinks import _folder
from ucp_jax.store import _swap

FIXTURE = Path(__file__).parent / "fixtures" / "deepspeed" / "z2_bf16_dp3" / "ckpt"
MARKERS = ("manifest.json", _folder.MARKER)
OLD, NEW, NEXT = 1, 2, 3  # the versions a path holds before, during and after the fault


# --- the steps of a commit, recorded and interrupted ---


@dataclasses.dataclass(frozen=True)
class Step:
  op: str  # rename, exchange, fsync, unlink, rmtree
  names: tuple[str, ...]  # relative to the parent folder ("." for the folder itself)

  def __str__(self) -> str:
    return f"{self.op}({', '.join(self.names)})"


class Steps:
  """The file-system steps that commits take in `parent`, recorded in order.

  Before each step: with `images`, the parent folder is copied (what a SIGKILL there
  leaves; a deletion also gets a copy half done); with `fault` (index, kind), that step
  raises KeyboardInterrupt or OSError(EIO) instead of running.
  """

  def __init__(self, monkeypatch, parent: Path, *, exchange: bool):
    self.parent = str(parent)
    self.steps: list[Step] = []
    self.fault: tuple[int, str] | None = None
    self.images: Path | None = None
    rename, unlink, rmtree = os.rename, os.unlink, shutil.rmtree
    fsync_dir, renameat2 = _swap.fsync_dir, _swap._renameat2

    def wrap(op, real, count):
      def call(*args, **kwargs):
        paths = args[:count]
        if not any(k.endswith("dir_fd") for k in kwargs) and any(map(self._mine, paths)):
          self._before(op, paths)
        return real(*args, **kwargs)

      return call

    def cut_rmtree(path, *args, **kwargs):
      if self._mine(path) and self._before("rmtree", (path,)) == "half":
        _delete_half(Path(path))
        if self.fault[1] == "interrupt":
          raise KeyboardInterrupt
        return None  # rmtree(ignore_errors=True) swallows its errors: the rest stays
      return rmtree(path, *args, **kwargs)

    def renameat2_or_not(a, b, flags):
      try:
        self._before("exchange", (a, b))
      except OSError as e:
        return e.errno
      return renameat2(a, b, flags) if exchange else errno.EINVAL

    monkeypatch.setattr(os, "rename", wrap("rename", rename, 2))
    monkeypatch.setattr(os, "unlink", wrap("unlink", unlink, 1))
    monkeypatch.setattr(shutil, "rmtree", cut_rmtree)
    monkeypatch.setattr(_swap, "fsync_dir", wrap("fsync", fsync_dir, 1))
    monkeypatch.setattr(_swap, "_renameat2", renameat2_or_not)

  def _mine(self, path) -> bool:
    if not isinstance(path, (str, os.PathLike)):
      return False
    path = os.path.abspath(path)
    if path.endswith(".ucp-lock"):
      return False
    up = os.path.dirname(path)
    return self.parent in (path, up) or (
      os.path.dirname(up) == self.parent and os.path.basename(path) in MARKERS
    )

  def _before(self, op: str, paths) -> str | None:
    names = (re.sub("[0-9a-f]{16}", "TOKEN", os.path.relpath(p, self.parent)) for p in paths)
    step = Step(op, tuple(names))
    index = len(self.steps)
    self.steps.append(step)
    if self.images is not None:
      _copy(self.parent, self.images / f"{index:02d}")
      if op == "rmtree":
        _delete_half(_copy(self.parent, self.images / f"{index:02d}-half") / step.names[0])
    if self.fault is None or self.fault[0] != index:
      return None
    if op == "rmtree":
      return "half"
    if self.fault[1] == "interrupt":
      raise KeyboardInterrupt
    raise OSError(errno.EIO, "Input/output error (injected)", paths[0])


def _copy(src: str, dst: Path) -> Path:
  shutil.copytree(src, dst, symlinks=True)
  return dst


def _delete_half(folder: Path) -> None:
  """Every second file of `folder`, as an rmtree cut short leaves it."""
  files = sorted(p for p in folder.rglob("*") if p.is_file())
  for path in files[::2]:
    path.unlink()


# --- the paths that commit, each writing versions of one checkpoint ---


@dataclasses.dataclass
class Committer:
  """A path that commits: `write` puts version v (OLD, NEW, NEXT) of a checkpoint at `dst`;
  `version` tells which one a folder holds (and fails if it holds none of them whole)."""

  name: str
  write: Callable[[Path, int], object]
  version: Callable[[Path], int]
  export: bool = False


def _state(v: int) -> dict:
  return {"a": np.full((64, 16), v, np.float32), "b": {"c": np.full((40,), v)}}


def _uniform(dst: Path) -> int:
  """The one value every array of the ucp_jax checkpoint at `dst` holds."""
  assert ucp_jax.open(dst).verify() == {}
  values = {float(x) for leaf in _leaves(ucp_jax.restore(dst)) for x in np.unique(leaf)}
  assert len(values) == 1, values
  return int(values.pop())


def _leaves(tree):
  if isinstance(tree, dict):
    for value in tree.values():
      yield from _leaves(value)
  else:
    yield tree


def _save(dst: Path, v: int) -> None:
  ucp_jax.save(dst, _state(v), overwrite=True, chunk_bytes=1024)


def _save_async(dst: Path, v: int) -> None:
  ucp_jax.save_async(dst, _state(v), overwrite=True, chunk_bytes=1024)
  ucp_jax.wait_until_finished()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[int, Path]:
  """Hugging Face folders (one safetensors file) whose every weight holds v."""
  import safetensors.numpy

  root = tmp_path_factory.mktemp("sources")
  folders = {}
  for v in (OLD, NEW, NEXT):
    folders[v] = root / f"hf{v}"
    folders[v].mkdir()
    weights = {"w": np.full((32, 8), v, np.float32), "b": np.full((8,), v, np.float32)}
    safetensors.numpy.save_file(weights, str(folders[v] / "model.safetensors"))
  return folders


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, Path]:
  """Checkpoints with a DeepSpeed parameter schema, every float array scaled by v."""
  root = tmp_path_factory.mktemp("checkpoints")
  base = ucp_jax.convert(FIXTURE, root / "base").dst
  manifest = ucp_jax.open(base).manifest
  tree = ucp_jax.restore(base)
  out = {}
  for v in (OLD, NEW, NEXT):
    scaled = _map(tree, lambda a, v=v: a * v if a.dtype.kind == "f" else a)
    out[v] = root / f"ckpt{v}"
    ucp_jax.save(out[v], scaled, step=manifest.step, schema=manifest.schema, source=manifest.source)
  return out


def _map(tree, fn):
  if isinstance(tree, dict):
    return {k: _map(v, fn) for k, v in tree.items()}
  return fn(np.asarray(tree))


def _fingerprint(fmt: str, dst: Path) -> dict[str, str]:
  """What the export at `dst` holds: the digest of every file (the exports of these formats
  are byte for byte the same each time), or for Orbax, whose files are not, of every array
  as Orbax's own `StandardCheckpointer` restores it."""
  if fmt == "orbax":
    import jax
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
      tree = checkpointer.restore(dst)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k): _digest(np.asarray(v).tobytes()) for k, v in leaves}
  return {str(p.relative_to(dst)): _digest(p.read_bytes()) for p in dst.rglob("*") if p.is_file()}


def _digest(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _export_path(fmt: str, checkpoints: dict[int, Path], tmp_path: Path) -> Committer:
  def write(dst: Path, v: int) -> None:
    ucp_jax.export(checkpoints[v], dst, format=fmt, overwrite=True)

  references = {}
  for v in (OLD, NEW, NEXT):
    write(tmp_path / "references" / str(v), v)
    references[v] = _fingerprint(fmt, tmp_path / "references" / str(v))
  assert len({tuple(sorted(r.items())) for r in references.values()}) == 3, "versions alike"

  def version(dst: Path) -> int:
    got = _fingerprint(fmt, dst)
    matches = [v for v, reference in references.items() if reference == got]
    assert matches, f"{dst} holds none of the versions whole"
    return matches[0]

  return Committer(f"export-{fmt}", write, version, export=True)


PATHS = ["save", "save_async", "convert"] + [
  f"export-{f}" for f in ("deepspeed", "hf", "dcp", "orbax")
]


@pytest.fixture
def path_of(sources, checkpoints, tmp_path):
  def make(name: str) -> Committer:
    if name == "save":
      return Committer(name, _save, _uniform)
    if name == "save_async":
      return Committer(name, _save_async, _uniform)
    if name == "convert":
      return Committer(
        name, lambda dst, v: ucp_jax.convert(sources[v], dst, overwrite=True), _uniform
      )
    return _export_path(name.removeprefix("export-"), checkpoints, tmp_path)

  return make


# --- the matrix ---


def _commit_point(steps: list[Step]) -> int:
  """The index of the commit: the fsync of the parent after the swap."""
  swap = max(i for i, s in enumerate(steps) if s.op in ("rename", "exchange") and "ckpt" in s.names)
  return next(i for i, s in enumerate(steps) if i > swap and s == Step("fsync", (".",)))


def _next_save_works(path: Committer, dst: Path) -> None:
  path.write(dst, NEXT)
  assert path.version(dst) == NEXT
  assert sorted(os.listdir(dst.parent)) == [dst.name]  # no staging, no .old, no lock


def _run_matrix(path: Committer, tmp_path: Path, monkeypatch, exchange: bool) -> list[str]:
  """Interrupts the overwrite at every step, each way; returns one line per case run."""
  steps = Steps(monkeypatch, tmp_path / "record", exchange=exchange)
  dst = tmp_path / "record" / "ckpt"
  path.write(dst, OLD)
  steps.steps.clear()
  steps.images = tmp_path / "killed"
  path.write(dst, NEW)
  steps.images = None
  recorded = list(steps.steps)
  commit = _commit_point(recorded)
  swaps = [
    i for i, s in enumerate(recorded) if s.op in ("rename", "exchange") and "ckpt" in s.names
  ]
  assert [recorded[i].op for i in swaps] == (
    ["exchange"] if exchange else ["exchange"] + ["rename"] * 2
  )
  moved = swaps[0 if exchange else 1]  # the first step that moves a checkpoint
  done = []

  for image in sorted((tmp_path / "killed").iterdir()):
    index = int(image.name[:2])
    target = image / "ckpt"
    if path.export and not target.exists():  # put in place by the next export's first step
      _folder.recover(str(target))
    got = path.version(target)  # before the first rename the old one, after it the new one
    assert got == (OLD if index <= moved else NEW), f"killed before {recorded[index]}: {got}"
    _next_save_works(path, target)
    done.append(f"{path.name} killed before {recorded[index]}{image.name[2:]}: version {got}")

  for index, step in enumerate(recorded):
    for kind in ("interrupt", "eio"):
      parent = tmp_path / f"{kind}-{index:02d}"
      steps.parent, steps.fault = str(parent), None
      dst = parent / "ckpt"
      path.write(dst, OLD)
      steps.steps.clear()
      steps.fault = (index, kind)
      try:
        path.write(dst, NEW)
        raised = None
      except (KeyboardInterrupt, OSError) as e:
        raised = e
      steps.fault = None
      assert steps.steps[: index + 1] == recorded[: index + 1]  # the same steps, up to the fault
      assert dst.is_dir(), f"{kind} at {step}: nothing at {dst}"
      got = path.version(dst)
      # An error raised before the commit keeps the old one; after it, or when nothing is
      # raised (an rmtree that ignores errors goes on), the new one is in place.
      expected = OLD if raised is not None and index <= commit else NEW
      assert got == expected, f"{kind} at {step}: {raised!r}, version {got}"
      quiet = kind == "eio" and step.op == "rmtree"
      assert raised is not None or quiet or index > commit, f"{kind} at {step}: not raised"
      _next_save_works(path, dst)
      done.append(f"{path.name} {kind} at {step}: {type(raised).__name__}, version {got}")
  return done


@pytest.mark.slow
@pytest.mark.parametrize("name", PATHS)
def test_an_overwrite_without_exchange_interrupted_at_any_step_loses_nothing(
  name, path_of, tmp_path, monkeypatch
):
  done = _run_matrix(path_of(name), tmp_path, monkeypatch, exchange=False)
  print("\n".join(done))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["save", "export-hf"])
def test_an_overwrite_by_exchange_interrupted_at_any_step_loses_nothing(
  name, path_of, tmp_path, monkeypatch
):
  done = _run_matrix(path_of(name), tmp_path, monkeypatch, exchange=True)
  print("\n".join(done))


# --- real kills: the copies above tell the truth ---

WORKER = Path(__file__).parent / "support" / "commit_fault_worker.py"


def _worker(dst: Path, stage: str, how: str, given: Path | None = None, value: int = NEW):
  args = [sys.executable, str(WORKER), str(dst), str(value), stage, how]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    args + ([str(given)] if given else []),
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    start_new_session=True,  # its own process group: a kill takes its helpers along
  )


KILLS = [
  ("save_async", "fallback-between-renames", NEW),
  ("convert", "fallback-between-renames", NEW),
  ("export-deepspeed", "fallback-between-renames", NEW),
  ("export-hf", "fallback-between-renames", NEW),
  ("export-dcp", "fallback-between-renames", NEW),
  ("export-orbax", "fallback-between-renames", NEW),
  ("export-hf", "fallback-abort-cut", OLD),  # the old export alone in STAGING.old
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "stage", "expected"), KILLS)
def test_a_killed_commit_leaves_what_the_copies_say(
  name, stage, expected, path_of, sources, checkpoints, tmp_path
):
  path = path_of(name)
  dst = tmp_path / "work" / "ckpt"
  path.write(dst, OLD)
  given = sources[NEW] if name == "convert" else checkpoints[NEW] if path.export else None
  proc = _worker(dst, stage, name, given)
  assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
  if path.export:  # nothing at `dst` until the next export puts back what waits beside it
    assert not dst.exists()
    _folder.recover(str(dst))
  assert path.version(dst) == expected
  _next_save_works(path, dst)


@pytest.mark.slow
@pytest.mark.parametrize(
  ("stage", "code", "expected"),
  [
    ("fallback-between-renames", -signal.SIGKILL, NEW),  # both processes killed
    ("fallback-eio", 2, OLD),  # an error: every process fails, the old one stays
    ("fallback-interrupt", 130, OLD),  # Ctrl-C on process 0: its helper is stopped too
  ],
)
def test_a_commit_of_a_convert_by_two_processes_loses_nothing(
  stage, code, expected, sources, tmp_path
):
  dst = tmp_path / "work" / "ckpt"
  ucp_jax.convert(sources[OLD], dst)
  proc = _worker(dst, stage, "convert-2proc", sources[NEW])
  assert proc.returncode == code, proc.stdout + proc.stderr
  if code == 2:
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {dst}: the commit"), proc.stderr
  assert _uniform(dst) == expected
  ucp_jax.convert(sources[NEXT], dst, overwrite=True)
  assert _uniform(dst) == NEXT
  assert sorted(os.listdir(dst.parent)) == [dst.name]
