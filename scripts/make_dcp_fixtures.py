#!/usr/bin/env python
"""torch DCP checkpoints written by the real libraries: FSDP2 and DTensor on gloo ranks.

Fixtures (`--out`, default tests/fixtures/dcp/, about 430 KiB):

  fsdp2_adamw/  2 gloo ranks, FSDP2 (`fully_shard` on each block and the root) of a 1-layer
                TorchGPT (d_model 16, `lm_head` tied to `wte`), torch AdamW with two param
                groups (weight decay 0.1 on matrices, 0 on vectors), 3 steps, then
                `dcp.save({"model": msd, "optim": osd})` of `get_state_dict(model, optim)`.
  fsdp2_flat/   the same without blocks (`num_layers` 0), 2 steps, saved as torchtitan does:
                the model's keys and `get_state_dict(..., flatten_optimizer_state_dict=True)`
                at the top level (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`).
  dtensor_2d/   4 gloo ranks on a 2 x 2 DeviceMesh: `dtensor_values()` distributed as
                [Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Replicate()] and
                replicated (uneven sizes: chunks of 3 and 2 rows, ...), model only.
  info.json     how they were made, and the losses of the FSDP2 run.

`--live OUT` runs the round trips the slow tests check (about 2 minutes on 2 cores):

1. FSDP2 at 2 ranks trains K steps from a seeded TorchGPT (`cross_framework_demo`'s model,
   data and AdamW), saves DCP, and trains N + M more: the uninterrupted run.
2. The DCP folder, converted (`ucp_jax.convert`) and exported back (`format="dcp"`), is loaded
   by DCP into FSDP2 on 1 and on 3 ranks (`get_state_dict`, `dcp.load`, `set_state_dict`);
   the full state after the load must equal the saved one bit for bit.
3. JAX restores the DCP folder in place (`ucp_jax.restore_train_state`, rules `gpt2`, a 2 x 4
   mesh), trains N steps, saves, exports to DCP and trains M more; FSDP2 on 1 and on 3 ranks
   loads the export and trains the same M steps. Every loss must be within relative 1e-5 of
   the uninterrupted run's and JAX's.
Results: OUT/results.json and a table; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ds_launch import launch_ranks

REPO = Path(__file__).resolve().parents[1]
SMALL = {"vocab_size": 32, "max_len": 8, "num_layers": 1, "num_heads": 2, "d_model": 16}
SMALL_HYPER = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
TOLERANCE = 1e-5


@dataclasses.dataclass
class Job:
  """One FSDP2 run on every rank: build, (load,) (dump,) train, (save,) record losses.

  Attributes:
    model: `GPTConfig` fields.
    hyper: AdamW's lr, betas, eps, weight_decay.
    groups: 1 (every parameter) or 2 (no weight decay on vectors and norms).
    first: the index of the first batch; steps: steps to train.
    out: rank 0 writes `{"losses": [...]}` here.
    load: a DCP folder to load first; dump: rank 0 saves the full state here after loading.
    save_after: save DCP to `save_dir` after this many steps.
    flat: save as torchtitan does (model and flattened optimizer keys at the top level).
  """

  model: dict
  hyper: dict
  groups: int
  first: int
  steps: int
  out: str
  load: str | None = None
  dump: str | None = None
  save_after: int | None = None
  save_dir: str | None = None
  flat: bool = False


def dtensor_values() -> dict:
  """The logical arrays of `dtensor_2d` (numpy only, so tests recompute them)."""
  import numpy as np

  rng = np.random.default_rng(7)
  return {
    "grid.weight": rng.standard_normal((5, 7)).astype(np.float32),
    "transposed.weight": rng.standard_normal((6, 4)).astype(np.float32),
    "rows.bias": rng.standard_normal((9,)).astype(np.float32),
    "ids": np.arange(12, dtype=np.int64).reshape(3, 4),
  }


def _fsdp_job(job: Job, rank: int, world: int) -> None:
  import torch
  import torch.distributed as dist
  import torch.distributed.checkpoint as dcp
  from cross_framework_demo import GLOBAL_BATCH, SEED, batch
  from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
  )
  from torch.distributed.fsdp import fully_shard
  from torch_twins import TorchGPT

  from ucp_jax.models.gpt import GPTConfig

  torch.manual_seed(SEED)
  cfg = GPTConfig(**job.model)
  model = TorchGPT(cfg)
  for block in model.h:
    fully_shard(block)
  fully_shard(model)
  hyper = {**job.hyper, "betas": tuple(job.hyper["betas"])}
  if job.groups == 2:
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    optim = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], **hyper)
  else:
    optim = torch.optim.AdamW(model.parameters(), **hyper)
  if job.load is not None:
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=job.load)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
  if job.dump is not None:
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optim, options=full)
    if rank == 0:
      torch.save({"model": msd, "optim": osd}, job.dump)
  per = GLOBAL_BATCH // world
  losses = []
  for i in range(job.steps + 1):
    if i == job.save_after and job.flat:
      flat = StateDictOptions(flatten_optimizer_state_dict=True)
      msd, osd = get_state_dict(model, optim, options=flat)
      dcp.save({**msd, **osd}, checkpoint_id=job.save_dir)
    elif i == job.save_after:
      msd, osd = get_state_dict(model, optim)
      dcp.save({"model": msd, "optim": osd}, checkpoint_id=job.save_dir)
    if i == job.steps:
      break
    rows = batch(job.first + i, vocab=cfg.vocab_size, seq=cfg.max_len)[
      rank * per : (rank + 1) * per
    ]
    tokens = torch.from_numpy(rows)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(
      logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    optim.step()
    optim.zero_grad()
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, loss.detach().reshape(1))
    losses.append(sum(float(t) for t in gathered) / world)
  if rank == 0:
    Path(job.out).write_text(json.dumps({"losses": losses}))
  dist.barrier()


def _dtensor_job(save_dir: str) -> None:
  import torch
  import torch.distributed.checkpoint as dcp
  from torch.distributed.device_mesh import init_device_mesh
  from torch.distributed.tensor import Replicate, Shard, distribute_tensor

  mesh = init_device_mesh("cpu", (2, 2))
  placements = {
    "grid.weight": [Shard(0), Shard(1)],
    "transposed.weight": [Shard(1), Shard(0)],
    "rows.bias": [Shard(0), Replicate()],
    "ids": [Replicate(), Replicate()],
  }
  state = {
    name: distribute_tensor(torch.from_numpy(value), mesh, placements[name])
    for name, value in dtensor_values().items()
  }
  dcp.save({"model": state}, checkpoint_id=save_dir)


def rank_main(spec_path: str) -> None:
  """One rank: every job of the spec in turn (`{"jobs": [...]}` or `{"dtensor": dir}`)."""
  import torch
  import torch.distributed as dist

  torch.set_num_threads(1)
  torch.use_deterministic_algorithms(True, warn_only=True)
  dist.init_process_group("gloo")
  spec = json.loads(Path(spec_path).read_text())
  if "dtensor" in spec:
    _dtensor_job(spec["dtensor"])
  for job in spec.get("jobs", []):
    _fsdp_job(Job(**job), dist.get_rank(), dist.get_world_size())
  dist.barrier()
  dist.destroy_process_group()


def launch(world: int, spec: dict, workdir: Path, timeout: float = 600) -> None:
  """Runs `spec` on `world` gloo ranks (plain processes on 127.0.0.1)."""
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "spec.json").write_text(json.dumps(spec))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, __file__, "--rank-job", str(workdir / "spec.json")]
  launch_ranks(world, cmd, workdir, what="FSDP2/DCP", timeout=timeout, env=env)


def make_fixtures(out: Path) -> None:
  """Writes the fixtures (module docstring) into `out`, replacing it."""
  with tempfile.TemporaryDirectory() as tmp:
    work = Path(tmp)
    job = Job(SMALL, SMALL_HYPER, 2, 0, 3, str(work / "losses.json"))
    job.save_after, job.save_dir = 3, str(work / "fsdp2_adamw")
    flat = Job({**SMALL, "num_layers": 0}, SMALL_HYPER, 2, 0, 2, str(work / "flat.json"))
    flat.save_after, flat.save_dir, flat.flat = 2, str(work / "fsdp2_flat"), True
    launch(2, {"jobs": [dataclasses.asdict(j) for j in (job, flat)]}, work / "fsdp2")
    launch(4, {"dtensor": str(work / "dtensor_2d")}, work / "dtensor")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name in ("fsdp2_adamw", "fsdp2_flat", "dtensor_2d"):
      shutil.copytree(work / name, out / name)
    losses = json.loads((work / "losses.json").read_text())["losses"]
  info = {
    "made_by": "python scripts/make_dcp_fixtures.py",
    "fsdp2_adamw": {
      "model": SMALL,
      "hyper": SMALL_HYPER,
      "groups": 2,
      "steps": 3,
      "ranks": 2,
      "losses": losses,
    },
    "fsdp2_flat": {
      "model": {**SMALL, "num_layers": 0},
      "hyper": SMALL_HYPER,
      "groups": 2,
      "steps": 2,
      "ranks": 2,
      "layout": "torchtitan (flattened, top level)",
    },
    "dtensor_2d": {"ranks": 4, "mesh": [2, 2], "values": "dtensor_values()"},
  }
  (out / "info.json").write_text(json.dumps(info, indent=2) + "\n")
  size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
  print(f"fixtures: {out} ({size / 1024:.0f} KiB)")


def live(out: Path, steps: tuple[int, int, int] = (3, 3, 3)) -> int:
  """The live round trips (module docstring); 0 when all pass."""
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, str(REPO))
  import torch
  from cross_framework_demo import HYPER, MODEL, JaxTrainer

  import ucp_jax

  k, n, m = steps
  out = out.resolve()
  shutil.rmtree(out, ignore_errors=True)
  out.mkdir(parents=True)
  # 1. FSDP2 at 2 ranks: K steps, DCP save, N + M more (the uninterrupted run).
  ckpt = out / "fsdp2_dp2"
  run = Job(
    MODEL, HYPER, 1, 0, k + n + m, str(out / "torch.json"), save_after=k, save_dir=str(ckpt)
  )
  launch(2, {"jobs": [dataclasses.asdict(run)]}, out / "torch_dp2")
  torch_losses = json.loads((out / "torch.json").read_text())["losses"]
  # 2. DCP -> universal -> DCP (as 2 rank files).
  ucp_jax.convert(ckpt, out / "universal")
  ucp_jax.export(out / "universal", out / "dcp_again", format="dcp", ranks=2)
  # 3. JAX restores the DCP folder in place, trains, saves, exports, trains on.
  rules = ucp_jax.rules.gpt2(num_heads=MODEL["num_heads"])
  jt = JaxTrainer()
  ucp_jax.restore_train_state(ckpt, jt.model, jt.optimizer, rules=rules)
  jax_losses = jt.train(k, n)
  ucp_jax.save_train_state(out / "jax_ckpt", jt.model, jt.optimizer, hyperparams=HYPER)
  ucp_jax.export(out / "jax_ckpt", out / "jax_dcp", format="dcp", rules=rules)
  jax_more = jt.train(k + n, m)
  # 4. FSDP2 on 1 and 3 ranks: load the round trip (dump it), load JAX's export and train.
  resumed = {}
  for world in (1, 3):
    jobs = [
      Job(
        MODEL,
        HYPER,
        1,
        0,
        0,
        str(out / "unused.json"),
        load=str(out / "dcp_again"),
        dump=str(out / f"loaded_dp{world}.pt"),
      ),
      Job(
        MODEL, HYPER, 1, k + n, m, str(out / f"resumed_dp{world}.json"), load=str(out / "jax_dcp")
      ),
    ]
    launch(world, {"jobs": [dataclasses.asdict(j) for j in jobs]}, out / f"torch_dp{world}")
    resumed[world] = json.loads((out / f"resumed_dp{world}.json").read_text())["losses"]
  saved = _full_state(ckpt)
  exact = {}
  for world in (1, 3):
    loaded = torch.load(out / f"loaded_dp{world}.pt", weights_only=True)
    flat = {f"model.{k}": v for k, v in loaded["model"].items()}
    flat |= {
      f"optim.state.{p}.{s}": v for p, st in loaded["optim"]["state"].items() for s, v in st.items()
    }
    diffs = [
      float((flat[key].double() - value.double()).abs().max())
      if value.dim()
      else abs(float(flat[key]) - float(value))
      for key, value in saved.items()
    ]
    exact[world] = max(diffs)
  rows = [("JAX 2x4 (vs FSDP2 DP=2)", jax_losses, torch_losses[k : k + n])]
  for world in (1, 3):
    rows.append((f"FSDP2 DP={world} (vs JAX)", resumed[world], jax_more))
    rows.append((f"FSDP2 DP={world} (vs uninterrupted)", resumed[world], torch_losses[k + n :]))
  worst = 0.0
  print(f"\n{'leg':<34} {'losses':<40} worst rel diff")
  for label, got, ref in rows:
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True))
    worst = max(worst, rel)
    print(f"{label:<34} {' '.join(f'{v:.5f}' for v in got):<40} {rel:.1e}")
  ok = worst <= TOLERANCE and all(v == 0.0 for v in exact.values()) and len(saved) > 0
  print(
    f"round trip DCP -> ucp_jax -> DCP, loaded by FSDP2: max |diff| {exact} over "
    f"{len(saved)} tensors"
  )
  print(
    f"worst relative loss difference {worst:.2e} (tolerance {TOLERANCE:g}): "
    f"{'PASS' if ok else 'FAIL'}"
  )
  results = {
    "pass": ok,
    "worst_rel": worst,
    "round_trip_max_abs": exact,
    "tensors": len(saved),
    "torch": torch_losses,
    "jax": jax_losses,
    "jax_more": jax_more,
    "resumed": {str(w): v for w, v in resumed.items()},
    "steps": [k, n, m],
  }
  (out / "results.json").write_text(json.dumps(results, indent=2))
  return 0 if ok else 1


def _full_state(folder: Path) -> dict:
  """Every tensor of a DCP folder, whole, as torch's own loader reads it (one process)."""
  import warnings

  import torch
  import torch.distributed.checkpoint as dcp
  from torch.distributed.checkpoint.metadata import TensorStorageMetadata

  meta = dcp.FileSystemReader(str(folder)).read_metadata()
  state = {
    key: torch.empty(md.size, dtype=md.properties.dtype)
    for key, md in meta.state_dict_metadata.items()
    if isinstance(md, TensorStorageMetadata)
  }
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
  return state


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--out",
    type=Path,
    help="output folder (the committed fixtures: tests/fixtures/dcp)",
  )
  parser.add_argument("--live", type=Path, help="run the live round trips in this folder")
  parser.add_argument("--rank-job", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.rank_job:
    rank_main(args.rank_job)
    return 0
  if args.live:
    return live(args.live)
  if args.out is None:
    parser.error(
      "--out is required to make the fixtures (tests/fixtures/dcp for the committed ones)"
    )
  make_fixtures(args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
