"""Real DeepSpeed on this CPU machine: gloo ranks as local processes, and its own converter.

Shared by the fixture generators, the benchmarks, the cross-framework demo and the live
tests (see docs/deepspeed_on_cpu.md for why it is done this way).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def init_rank(*, deterministic: bool = False, fill_uninitialized: bool = False):
  """Readies this process to be one DeepSpeed rank on the CPU; returns `(torch, deepspeed)`.

  The CPU accelerator (unless `DS_ACCELERATOR` says otherwise), one torch thread, and
  DeepSpeed's shared-memory comm op left unbuilt (a 60-80 s build gloo does not need).
  `deterministic`: torch's deterministic algorithms (warning where there is none), and where
  `fill_uninitialized` every uninitialized tensor filled with NaN, so that files regenerate
  byte-identical and stale padding shows; without it the algorithms stay deterministic and
  ZeRO-2, which allocates its buffers every step, runs about 100 times faster.
  """
  os.environ.setdefault("DS_ACCELERATOR", "cpu")
  import torch

  torch.set_num_threads(1)
  if deterministic:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized
  import deepspeed

  deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
  return torch, deepspeed


def token_batch(seed: int, vocab: int, rows: int, seq: int):
  """Random int64 tokens below `vocab` from a torch generator seeded `seed`:
  `(inputs, next-token targets)`, each `[rows, seq]`."""
  import torch

  gen = torch.Generator().manual_seed(seed)
  tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
  return tokens[:, :-1], tokens[:, 1:]


def dir_size(path: Path) -> int:
  """The bytes of every file below `path`."""
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def launch_ranks(
  world: int,
  cmd: Sequence[str],
  log_dir: str | os.PathLike,
  *,
  what: str = "DeepSpeed",
  timeout: float = 600.0,
  env: dict[str, str] | None = None,
) -> None:
  """Runs `cmd` as `world` gloo ranks on 127.0.0.1 and waits for all of them.

  Each rank gets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, the CPU accelerator
  and one OpenMP thread; its output goes to `log_dir/rank<r>.log`.

  Raises:
    RuntimeError: a rank failed or timed out, with the tail of its log.
  """
  log_dir = Path(log_dir)
  log_dir.mkdir(parents=True, exist_ok=True)
  port = free_port()
  procs, logs = [], []
  for rank in range(world):
    rank_env = dict(os.environ if env is None else env)
    rank_env.update(
      DS_ACCELERATOR="cpu",
      RANK=str(rank),
      LOCAL_RANK=str(rank),
      WORLD_SIZE=str(world),
      LOCAL_SIZE=str(world),
      MASTER_ADDR="127.0.0.1",
      MASTER_PORT=str(port),
      OMP_NUM_THREADS="1",
      PYTHONHASHSEED="0",
    )
    logs.append(open(log_dir / f"rank{rank}.log", "w"))  # noqa: SIM115
    procs.append(
      subprocess.Popen(list(cmd), env=rank_env, stdout=logs[-1], stderr=subprocess.STDOUT)
    )
  deadline = time.monotonic() + timeout
  codes = []
  for p in procs:
    try:
      codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      codes.append(p.wait())
  for log in logs:
    log.close()
  if any(codes):
    bad = next(r for r, c in enumerate(codes) if c)
    tail = (log_dir / f"rank{bad}.log").read_text()[-6000:]
    raise RuntimeError(f"{what}: ranks exited with {codes}; rank {bad}'s log:\n{tail}")


def generate_checkpoint(
  ckpt: str, world: int, worker_cmd: Callable[[str], list[str]], *, what: str
) -> None:
  """Makes the DeepSpeed checkpoint `ckpt` once: `world` ranks of `worker_cmd(folder)` write it.

  They write into `ckpt.partial`, which becomes `ckpt` only when every rank succeeded; the
  scripts DeepSpeed copies next to a checkpoint are dropped. Rank logs go to `ckpt.logs/`.
  """
  tmp = ckpt + ".partial"
  shutil.rmtree(tmp, ignore_errors=True)
  launch_ranks(world, worker_cmd(tmp), ckpt + ".logs", what=what)
  for name in ("zero_to_fp32.py", "zero_to_torch.py"):
    if os.path.exists(os.path.join(tmp, name)):
      os.remove(os.path.join(tmp, name))
  os.rename(tmp, ckpt)


def install_fixture(dest: Path, ckpt: Path, universal: Path) -> None:
  """Replaces `dest` with `ckpt/`, `universal/` and the `latest_universal` beside `universal`.

  ds_to_universal writes `latest_universal` (holding "universal") next to its output folder,
  so `engine.load_checkpoint(dest)` with `checkpoint.load_universal` finds `dest/universal`.
  """
  if dest.exists():
    shutil.rmtree(dest)
  dest.mkdir(parents=True)
  shutil.copytree(ckpt, dest / "ckpt")
  shutil.copytree(universal, dest / "universal")
  shutil.copy(universal.parent / "latest_universal", dest / "latest_universal")


def ds_to_universal(input_folder: str | os.PathLike, output_folder: str | os.PathLike) -> list[str]:
  """DeepSpeed's own converter, one worker of each kind (deterministic, light on 2 cores).

  Returns the command it ran. Raises RuntimeError with its output if it fails.
  """
  cmd = [
    sys.executable,
    "-m",
    "deepspeed.checkpoint.ds_to_universal",
    "--input_folder",
    str(input_folder),
    "--output_folder",
    str(output_folder),
    "--num_extract_workers",
    "1",
    "--num_merge_workers",
    "1",
  ]
  env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
  res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  if res.returncode:
    raise RuntimeError(
      f"ds_to_universal {input_folder} failed:\n{(res.stdout + res.stderr)[-4000:]}"
    )
  return cmd
