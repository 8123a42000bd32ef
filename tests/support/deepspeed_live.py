"""Real DeepSpeed on CPU for tests: launch N gloo ranks, build the fixture model, load, dump.

`launch(n, jobs, out)` runs every `Job` in one DeepSpeed launch of `n` ranks (one process
per rank on 127.0.0.1, gloo, no shm op build): for each job, a fresh engine built like the
fixtures' (`scripts/make_deepspeed_fixtures.py`: model, param groups, AdamW), a universal
`load_checkpoint`, a dump of the state, optionally one training step. It returns, per job,
the list of per-rank dumps (`dump` documents them). Each launch costs ~10-20 s of imports on
2 cores; batch jobs into as few launches as possible.

Reusable from any test or demo that needs DeepSpeed as the oracle::

  results = launch(2, [Job("mine", stage=2, load_dir="out/ds")], tmp_path)
  results["mine"][0]["logical"]["fc1.weight"]["fp32"]   # rank 0's view, a torch tensor
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import make_deepspeed_fixtures as mk  # scripts/: on the path in pytest and in the ranks
from _ds_launch import init_rank, launch_ranks

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Job:
  """One engine in a launch.

  Attributes:
    name: key of the job's results (and its output folder).
    stage: ZeRO stage of the target engine.
    load_dir: directory given to `engine.load_checkpoint` (holds `latest_universal`).
    bf16: bf16 engine.
    config: merged into the DeepSpeed config (e.g. `zero_optimization.sub_group_size`,
      `data_types.grad_accum_dtype` for the BF16 optimizer).
    perturb: fill frozen parameters and buffers with zeros before `initialize`, so a restore
      of them shows.
    finish: call `ucp_jax.deepspeed.finish_load` after `load_checkpoint`.
    train: run one training step (batch `_batch(rank, STEPS)`) and record the losses.
  """

  name: str
  stage: int
  load_dir: str
  bf16: bool = False
  config: dict[str, Any] = dataclasses.field(default_factory=dict)
  perturb: bool = False
  finish: bool = False
  train: bool = True


def config(job: Job) -> dict[str, Any]:
  """The DeepSpeed config of `job`: the fixtures' config, another stage, `load_universal`."""
  base = mk._merge(mk.ds_config("z1_fp32_dp2"), {"bf16": {"enabled": job.bf16}})
  base["zero_optimization"] = {"stage": job.stage}
  base["checkpoint"] = {"load_universal": True}
  return mk._merge(base, job.config)


def launch(n: int, jobs: list[Job], out: str | os.PathLike, timeout: float = 600) -> dict:
  """Runs `jobs` on `n` ranks; returns {job name: [rank 0 dump, rank 1 dump, ...]}."""
  import torch

  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  plan = out / "jobs.json"
  plan.write_text(json.dumps([dataclasses.asdict(j) for j in jobs]))
  path = [str(REPO), str(REPO / "scripts"), os.environ.get("PYTHONPATH", "")]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
  cmd = [sys.executable, __file__, "--jobs", str(plan), "--out", str(out)]
  launch_ranks(n, cmd, out, what="DeepSpeed", timeout=timeout, env=env)
  return {
    j.name: [torch.load(out / j.name / f"rank{r}.pt", weights_only=False) for r in range(n)]
    for j in jobs
  }


# --------------------------------------------------------------------------------------------
# Inside a rank
# --------------------------------------------------------------------------------------------


def _groups(model) -> list[dict[str, Any]]:
  """The fixtures' param groups: >=2-D weights with decay, the rest without."""
  trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
  decay = [p for n, p in trainable if n.endswith("weight") and p.dim() >= 2]
  rest = [p for n, p in trainable if not (n.endswith("weight") and p.dim() >= 2)]
  return [
    {"params": decay, "lr": mk.LR[0], "weight_decay": mk.WEIGHT_DECAY[0]},
    {"params": rest, "lr": mk.LR[1], "weight_decay": mk.WEIGHT_DECAY[1]},
  ]


def _full(engine, param):
  """A parameter's full value on every rank (ZeRO-3: gathered)."""
  import deepspeed

  if hasattr(param, "ds_id"):
    with deepspeed.zero.GatheredParameters([param]):
      return param.detach().clone()
  return param.detach().clone()


def module_extras(engine) -> dict[str, Any]:
  """Frozen parameters and buffers of the engine's model, full values."""
  out = {n: b.detach().clone() for n, b in engine.module.named_buffers()}
  for n, p in engine.module.named_parameters():
    if not p.requires_grad:
      out[n] = _full(engine, p)
  return out


def before_finish(engine) -> dict[str, Any]:
  """What `load_checkpoint` alone restored of the gaps: buffers and frozen parameters, param
  group hyperparameters, and (ZeRO-3) whether sub-groups share one step tensor."""
  opt = engine.optimizer
  steps = []
  if engine.zero_optimization_partition_weights():
    steps = [id(opt.optimizer.state[f]["step"]) for f in opt.fp32_partitioned_groups_flat]
  return {
    "extras": module_extras(engine),
    "param_groups": [
      {k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups
    ],
    "shared_step": len(steps) > len(set(steps)),
  }


def dump(engine) -> dict[str, Any]:
  """The engine's restored state, raw (this rank's partitions) and logical (full values).

  Keys: `raw` {`fp32`: this rank's flat fp32 partitions, `state`: the base optimizer's state
  of each}, `param_groups` (hyperparameters, no params), `logical` {name: {fp32, exp_avg,
  exp_avg_sq}}, `module` (model values incl. low-precision params, buffers, frozen),
  `counters` (global_steps, global_samples, skipped_steps), `optimizer_class`.
  """
  from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

  opt = engine.optimizer
  if engine.zero_optimization_partition_weights():
    flats = opt.fp32_partitioned_groups_flat
  elif hasattr(opt, "single_partition_of_fp32_groups"):
    flats = opt.single_partition_of_fp32_groups
  else:
    flats = opt.fp32_groups_flat_partition  # BF16_Optimizer
  base = opt.optimizer
  clone = lambda v: v.detach().clone() if hasattr(v, "detach") else v  # noqa: E731
  logical = {}
  for n, p in engine.module.named_parameters():
    if p.requires_grad:
      logical[n] = {"fp32": safe_get_full_fp32_param(p).detach().clone()}
      for key in ("exp_avg", "exp_avg_sq"):
        logical[n][key] = safe_get_full_optimizer_state(p, key).detach().clone()
  return {
    "optimizer_class": type(opt).__name__,
    "raw": {
      "fp32": [t.detach().clone() for t in flats],
      "state": [{k: clone(v) for k, v in base.state[t].items()} for t in flats],
    },
    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups],
    "logical": logical,
    "module": {n: _full(engine, p) for n, p in engine.module.named_parameters()}
    | {n: b.detach().clone() for n, b in engine.module.named_buffers()},
    "counters": {
      k: getattr(engine, k) for k in ("global_steps", "global_samples", "skipped_steps")
    },
  }


def train_step(engine, rank: int, world: int) -> dict[str, Any]:
  """One step on the batch that would have come next; losses before and after it (all ranks)."""
  import deepspeed.comm as dist
  import torch

  def mean_loss(loss) -> tuple[float, list[float]]:
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, loss.detach().float().reshape(1))
    per_rank = [float(t.item()) for t in gathered]
    return sum(per_rank) / world, per_rank

  ids, targets = mk._batch(rank, mk.STEPS)
  loss_of = lambda logits: torch.nn.functional.cross_entropy(  # noqa: E731
    logits.float().reshape(-1, mk.VOCAB), targets.reshape(-1)
  )
  loss = loss_of(engine(ids))
  engine.backward(loss)
  engine.step()
  with torch.no_grad():
    after = loss_of(engine(ids))
  return {"loss": mean_loss(loss), "loss_after": mean_loss(after)}


def run_job(job: Job, rank: int, world: int) -> dict[str, Any]:
  import deepspeed
  import torch

  from ucp_jax import deepspeed as ucp_deepspeed

  torch.manual_seed(mk.SEED)
  model = mk._build_model()
  if job.perturb:
    with torch.no_grad():
      for t in [*model.buffers(), *(p for p in model.parameters() if not p.requires_grad)]:
        t.zero_()
  engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=_groups(model), config=config(job)
  )
  engine.load_checkpoint(job.load_dir)
  result: dict[str, Any] = {"before_finish": before_finish(engine)}
  if job.finish:
    result["finished"] = ucp_deepspeed.finish_load(engine, job.load_dir)
  result.update(dump(engine))
  if job.train:
    result["train"] = train_step(engine, rank, world)
  engine.destroy()
  return result


def worker(jobs_path: str, out: str) -> None:
  torch, deepspeed = init_rank(deterministic=True, fill_uninitialized=True)
  import deepspeed.comm as dist

  deepspeed.init_distributed(dist_backend="gloo")
  rank, world = dist.get_rank(), dist.get_world_size()
  for spec in json.loads(Path(jobs_path).read_text()):
    job = Job(**spec)
    result = run_job(job, rank, world)
    folder = Path(out) / job.name
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(result, folder / f"rank{rank}.pt")
    dist.barrier()
  torch.distributed.destroy_process_group()  # gloo's threads stopped before exit, not killed


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--jobs", required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  worker(args.jobs, args.out)
