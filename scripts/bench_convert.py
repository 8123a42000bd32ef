#!/usr/bin/env python
"""DeepSpeed checkpoint -> universal checkpoint: `ucp_jax.convert` against DeepSpeed's converter.

Generates once (cached under `--dir`) a DeepSpeed ZeRO-2 bf16 checkpoint at dp 2 of a
transformer-ish model (tied embedding, `--layers` MLP blocks of width `--dim`, about 67M
parameters by default), trained 1 step with real DeepSpeed on CPU (2 ranks, gloo). Then, in one
run, each contender converts it in its own subprocess:

  ucp        ucp_jax.convert(ckpt, out)
  deepspeed  DeepSpeed's `python -m deepspeed.checkpoint.ds_to_universal --input_folder
             ckpt/TAG --output_folder out` with its default workers (4 extract, 2 merge), run
             as `main(parse_arguments())`, which is what its `__main__` does

Both run as `python -c` snippets that time their imports (torch + deepspeed, or jax +
ucp_jax) apart from the conversion. Both end with their output on disk (equal durability):
ucp_jax fsyncs as it writes (`durable=True`, its default), and every file and directory of
DeepSpeed's output is fsynced after `ds_to_universal` returns, inside the timed command
(`--no-durable`: neither syncs). Reported per contender: wall time of the whole command
(the best of `--repeat`), import and conversion seconds as the process measured them, and peak
memory of the whole process tree, sampled every 10 ms from /proc: the sum of RSS and the sum of
PSS (shared pages split between the processes that map them; DeepSpeed forks workers); for
ucp's single process the RSS peak is also the kernel's exact `ru_maxrss`. Before every try the
output is removed, the checkpoint's files are read once (page cache warm for both) and dirty
pages are synced. Targets: >= 10x faster (on the whole command, and on the conversion after
imports) and peak memory <= half (on the PSS sum, which counts DeepSpeed's shared pages once).
Afterwards every fp32/exp_avg/exp_avg_sq array of ucp's output is compared bit for bit with
DeepSpeed's (`--no-check` skips).

Usage:
  python scripts/bench_convert.py                        # generate if needed, then compare
  python scripts/bench_convert.py --dir /mnt/nvme/b --repeat 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as bu
from _ds_launch import generate_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 8192
SEQ = 16


# ------------------------------------------------------------------------------------------
# Generating the DeepSpeed checkpoint (torch and deepspeed are imported in the rank workers only)


def _rank_worker(ckpt: str, dim: int, layers: int) -> None:
  os.environ.setdefault("DS_ACCELERATOR", "cpu")
  import torch
  from torch import nn

  torch.set_num_threads(1)
  import deepspeed

  deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.ln = nn.LayerNorm(dim)
      self.fc1 = nn.Linear(dim, 4 * dim)
      self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, h):
      return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(h))))

  class Model(nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(VOCAB, dim)
      self.blocks = nn.ModuleList(Block() for _ in range(layers))
      self.ln_f = nn.LayerNorm(dim)
      self.head = nn.Linear(dim, VOCAB, bias=False)
      self.head.weight = self.embed.weight

    def forward(self, ids):
      h = self.embed(ids)
      for block in self.blocks:
        h = block(h)
      return self.head(self.ln_f(h))

  torch.manual_seed(0)
  model = Model()
  named = list(model.named_parameters())
  decay = [p for n, p in named if p.dim() >= 2]
  other = [p for n, p in named if p.dim() < 2]
  config = {
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 1_000_000,
    "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "lr": 1e-3}},
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": True},
  }
  groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
  engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
  gen = torch.Generator().manual_seed(engine.global_rank)
  tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
  logits = engine(tokens[:, :-1])
  loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].ravel())
  engine.backward(loss)
  engine.step()
  engine.save_checkpoint(ckpt, client_state={"universal_checkpoint_info": {}})


def generate(ckpt: str, dim: int, layers: int) -> None:
  args = ["--dim", str(dim), "--layers", str(layers)]
  generate_checkpoint(
    ckpt, 2, lambda tmp: [sys.executable, __file__, "--rank-worker", "--dir", tmp, *args],
    what="ZeRO-2 checkpoint",
  )  # fmt: skip


# ------------------------------------------------------------------------------------------
# Running a contender: wall time and the process tree's peak memory


def _tree(pid: int) -> list[int]:
  out, todo = [], [pid]
  while todo:
    p = todo.pop()
    out.append(p)
    try:
      for task in os.listdir(f"/proc/{p}/task"):
        with open(f"/proc/{p}/task/{task}/children") as f:
          todo += [int(c) for c in f.read().split()]
    except OSError:
      pass
  return out


def _memory(pid: int) -> tuple[int, int, int]:
  """(RSS sum, PSS sum, largest RSS of one process) over the process tree of `pid`."""
  rss = pss = largest = 0
  for p in _tree(pid):
    one = 0
    try:
      with open(f"/proc/{p}/smaps_rollup") as f:
        for line in f:
          if line.startswith("Rss:"):
            one = int(line.split()[1]) * 1024
          elif line.startswith("Pss:"):
            pss += int(line.split()[1]) * 1024
    except OSError:
      pass
    rss += one
    largest = max(largest, one)
  return rss, pss, largest


def run(cmd: list[str], env: dict | None = None) -> dict:
  """Runs `cmd`; wall time, peak tree RSS/PSS (sampled), the child's own ru_maxrss, stdout."""
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  peak = [0, 0, 0]
  done = threading.Event()

  def sample():
    while not done.is_set():
      peak[:] = map(max, peak, _memory(proc.pid))
      time.sleep(0.01)

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  output = proc.stdout.read().decode(errors="replace")
  _, status, usage = os.wait4(proc.pid, 0)
  seconds = time.perf_counter() - t0
  done.set()
  thread.join()
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-4000:]}")
  return {
    "seconds": seconds,
    "tree_rss": peak[0],
    "tree_pss": peak[1],
    "process_rss": peak[2],
    "ru_maxrss": usage.ru_maxrss * 1024,
    "output": output,
  }


def _warm(folder: str) -> None:
  for root, _, files in os.walk(folder):
    for name in files:
      with open(os.path.join(root, name), "rb") as f:
        while f.read(64 << 20):
          pass


_TIMED = (
  "import json, os, sys, time\n"
  "def _sync(top):  # every file and directory of the output on disk, as a durable save\n"
  "  for d, _, names in os.walk(top):\n"
  "    for n in [*names, '.']:\n"
  "      fd = os.open(os.path.join(d, n), os.O_RDONLY); os.fsync(fd); os.close(fd)\n"
  "t0 = time.perf_counter(); {imports}; t1 = time.perf_counter(); "
  "{call}; print('RESULT', json.dumps({{'import_s': t1 - t0, 'convert_s': "
  "time.perf_counter() - t1}}), flush=True)"
)
DURABLE = [True]  # --no-durable: neither contender syncs its output


def _ucp_cmd(ckpt: str, out: str) -> list[str]:
  call = f"ucp_jax.convert({ckpt!r}, {out!r}, durable={DURABLE[0]})"  # fsyncs as it writes
  code = _TIMED.format(imports="import ucp_jax", call=call)
  return [sys.executable, "-c", code]


def _ds_cmd(tag_dir: str, out: str) -> list[str]:
  # What `python -m deepspeed.checkpoint.ds_to_universal --input_folder ... --output_folder ...`
  # runs (its __main__ is `main(parse_arguments())`), with the import timed apart; then the
  # output synced, since ds_to_universal does not, so both end with their output on disk.
  argv = ["ds_to_universal", "--input_folder", tag_dir, "--output_folder", out]
  call = f"sys.argv = {argv!r}; m.main(m.parse_arguments())"
  if DURABLE[0]:
    call += f"; _sync({out!r})"
  code = _TIMED.format(imports="from deepspeed.checkpoint import ds_to_universal as m", call=call)
  return [sys.executable, "-c", code]


def check(ucp_out: str, ds_out: str) -> int:
  """Compares every optimized parameter's fp32 and moments, bit for bit; returns the count."""
  import numpy as np

  import ucp_jax
  from ucp_jax.sources._torch_reader import _torch_file

  ckpt = ucp_jax.open(ucp_out)
  count = 0
  for name, entry in ckpt.manifest.schema["params"].items():
    if entry["frozen"] or entry["tied_to"]:
      continue
    for file, key in {"fp32": entry["value"], **entry["slots"]}.items():
      want = _torch_file.load(os.path.join(ds_out, "zero", name, f"{file}.pt"))["param"]
      got = ckpt.read(key)
      if got.shape != want.shape or got.tobytes() != np.ascontiguousarray(want).tobytes():
        raise SystemExit(f"MISMATCH: {key} differs from DeepSpeed's {name}/{file}.pt")
      count += 1
  return count


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--dir", default="/tmp/ucp_bench_convert", help="cache and output folder")
  parser.add_argument("--dim", type=int, default=1024, help="model width (default 1024)")
  parser.add_argument("--layers", type=int, default=7, help="MLP blocks (default 7: 67M params)")
  parser.add_argument("--repeat", type=int, default=1, help="tries per contender; best is shown")
  parser.add_argument("--json", help="also write the results here")
  parser.add_argument("--no-check", action="store_true", help="skip the bit-for-bit comparison")
  parser.add_argument(
    "--no-durable", action="store_true", help="neither contender syncs its output to disk"
  )
  parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  DURABLE[0] = not args.no_durable
  if args.rank_worker:
    _rank_worker(args.dir, args.dim, args.layers)
    return 0

  ckpt = os.path.join(args.dir, f"ds_z2_bf16_dp2_d{args.dim}_l{args.layers}")
  if not os.path.isfile(os.path.join(ckpt, "latest")):
    print(f"generating {ckpt} with DeepSpeed (2 ranks, CPU) ...", flush=True)
    t0 = time.perf_counter()
    generate(ckpt, args.dim, args.layers)
    print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
  with open(os.path.join(ckpt, "latest")) as f:
    tag_dir = os.path.join(ckpt, f.read().strip())
  what = "ZeRO-2 bf16 dp 2"
  return compare(
    tag_dir, args.dir, what=what, repeat=args.repeat, json_path=args.json, verify=not args.no_check
  )


def compare(
  tag_dir: str, root: str, *, what: str, repeat: int, json_path: str | None, verify: bool
) -> int:
  """Times `ucp_jax.convert` and `ds_to_universal` on `tag_dir` (outputs under `root`), prints
  the table, the verdicts against the targets and the bit-for-bit check."""
  src_bytes = sum(os.path.getsize(os.path.join(tag_dir, n)) for n in os.listdir(tag_dir))
  env = dict(os.environ, DS_ACCELERATOR="cpu", JAX_PLATFORMS="cpu")
  outs = {"ucp": os.path.join(root, "out_ucp"), "deepspeed": os.path.join(root, "out_ds")}
  cmds = {"ucp": _ucp_cmd(tag_dir, outs["ucp"]), "deepspeed": _ds_cmd(tag_dir, outs["deepspeed"])}
  results: dict[str, dict] = {}
  for _ in range(max(1, repeat)):  # contenders interleaved: the page cache drifts over a run
    for name, cmd in cmds.items():
      shutil.rmtree(outs[name], ignore_errors=True)
      _warm(tag_dir)
      os.sync()
      time.sleep(2)  # deleted files' discards and the journal settle before the clock starts
      result = run(cmd, env)
      if name not in results or result["seconds"] < results[name]["seconds"]:
        results[name] = result
  for name in cmds:
    print(f"{name}: {results[name]['seconds']:.2f} s", flush=True)
  with open(os.path.join(outs["ucp"], "manifest.json")) as f:
    manifest = json.load(f)
  params = sum(
    math.prod(manifest["arrays"][e["value"]]["shape"])
    for e in manifest["schema"]["params"].values()
    if e["tied_to"] is None
  )
  for r in results.values():
    r.update(json.loads(r["output"].split("RESULT ", 1)[1].splitlines()[0]))
  ucp, ds = results["ucp"], results["deepspeed"]
  ucp["tree_rss"] = max(ucp["tree_rss"], ucp["ru_maxrss"])  # one process: the exact peak
  speedup = ds["seconds"] / ucp["seconds"]
  speedup_alone = ds["convert_s"] / ucp["convert_s"]
  memory = ucp["tree_pss"] / ds["tree_pss"]
  rows = [
    [
      name,
      f"{r['seconds']:.2f}",
      f"{r['import_s']:.2f}",
      f"{r['convert_s']:.2f}",
      bu.mib(r["tree_rss"]),
      bu.mib(r["tree_pss"]),
      bu.mib(r["ru_maxrss"]),
    ]
    for name, r in results.items()
  ]
  converted = sum(
    os.path.getsize(os.path.join(root, n)) for root, _, ns in os.walk(outs["ucp"]) for n in ns
  )
  print()
  print(
    f"source: {tag_dir} ({src_bytes / bu.MiB:.0f} MiB, {what}, {params / 1e6:.1f}M "
    f"params); ucp output {converted / bu.MiB:.0f} MiB; best of {max(1, repeat)}"
  )
  headers = ["converter", "wall s", "import s", "convert s", "peak RSS MiB", "peak PSS MiB"]
  print(bu.table([*headers, "max 1 proc MiB"], rows))
  print()
  print(
    f"speed, whole command: ucp is {speedup:.1f}x faster (target >= 10x): {bu.verdict(speedup, 10)}"
  )
  print(
    f"speed, conversion after imports: ucp is {speedup_alone:.1f}x faster (target >= 10x): "
    f"{bu.verdict(speedup_alone, 10)}"
  )
  print(
    f"memory: ucp peak PSS is {memory:.2f} of DeepSpeed's (target <= 0.5): "
    f"{bu.verdict(memory, 0.5, higher_is_better=False)}"
  )
  if verify:
    print(f"check: {check(outs['ucp'], outs['deepspeed'])} arrays equal DeepSpeed's bit for bit")
  if json_path:
    for r in results.values():
      r.pop("output", None)
    summary = {"speedup": speedup, "speedup_convert": speedup_alone, "memory_ratio": memory}
    bu.write_result(json_path, {"results": results, "params": params, **summary})
  return 0


if __name__ == "__main__":
  sys.exit(main())
