"""What the cross-framework continuity runs share (scripts/cross_framework_demo.py and
scripts/moe_continuity_demo.py): their data, DeepSpeed's jobs and training loop, and the JAX
trainer that continues it (optax.adamw with torch AdamW's hyperparameters, next-token
cross-entropy).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _ds_launch import launch_ranks

REPO = Path(__file__).resolve().parents[1]


def arithmetic_batch(seed: int, step: int, rows: int, seq: int, vocab: int):
  """The global batch of `step`: int64 `[rows, seq + 1]` arithmetic sequences mod `vocab`.

  Each row starts anywhere and advances by a stride of 1-4, so a model can learn it.
  """
  import numpy as np

  rng = np.random.default_rng([seed, step])
  start = rng.integers(0, vocab, (rows, 1))
  stride = rng.integers(1, 5, (rows, 1))
  return (start + stride * np.arange(seq + 1)[None]) % vocab


def ds_config(global_batch: int, dp: int, hyper: dict, stage: int) -> dict[str, Any]:
  """DeepSpeed ZeRO-`stage`, fp32, torch AdamW with `hyper`, no clipping; the global batch
  split `dp` ways."""
  return {
    "train_micro_batch_size_per_gpu": global_batch // dp,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "steps_per_print": 1_000_000,  # never: the losses are gathered and printed by the run
    "optimizer": {"type": "AdamW", "params": {"torch_adam": True, **hyper}},
    "zero_optimization": {"stage": stage},
  }


@dataclasses.dataclass
class DsJob:
  """What one DeepSpeed launch does on each rank.

  Attributes:
    first: the global step index of the first batch trained.
    steps: steps to train.
    out: rank 0 writes `{"losses": [...], ...}` here.
    save_after: save a checkpoint to `save_dir` after this many steps (None: never).
    save_dir: where to save.
    load_dir: load this universal checkpoint (and `finish_load`) before training.
    ep: the expert-parallel degree (DeepSpeed AutoEP's `autoep_size`; the MoE run's).
  """

  first: int
  steps: int
  out: str
  save_after: int | None = None
  save_dir: str | None = None
  load_dir: str | None = None
  ep: int = 1


def launch(
  script: str, world: int, job: DsJob, workdir: Path, *, what: str, timeout: float = 600
) -> list[float]:
  """Runs `job` on `world` DeepSpeed ranks, each `script --rank-job <workdir>/job.json`
  (plain processes on 127.0.0.1, without the caller's XLA_FLAGS); the losses it wrote."""
  workdir.mkdir(parents=True, exist_ok=True)
  job_path = workdir / "job.json"
  job_path.write_text(json.dumps(dataclasses.asdict(job)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, script, "--rank-job", str(job_path)]
  launch_ranks(world, cmd, workdir, what=what, timeout=timeout, env=env)
  return json.loads(Path(job.out).read_text())["losses"]


def run_job(engine, job: DsJob, batch, *, logits, save) -> list[float]:
  """`job` on this rank: loads the universal checkpoint `job.load_dir` into `engine` (then
  `ucp_jax.deepspeed.finish_load`) where it names one, and `ds_train`s `job`'s steps; the
  global mean losses."""
  from ucp_jax import deepspeed as ucp_deepspeed

  if job.load_dir is not None:
    engine.load_checkpoint(job.load_dir)
    ucp_deepspeed.finish_load(engine, job.load_dir)
  return ds_train(
    engine, batch, job.first, job.steps, logits=logits, save=save, save_after=job.save_after
  )


def ds_train(engine, batch, first: int, steps: int, *, logits, save=None, save_after=None):
  """Trains a DeepSpeed `engine` on this rank's rows of `batch(step)` for steps `first ..
  first + steps - 1`, calling `save()` after `save_after` of them; the global mean losses.

  `logits(engine, tokens)` runs the model (its forward's signature is the model's own).
  """
  import deepspeed.comm as dist
  import torch

  rank, world = dist.get_rank(), dist.get_world_size()
  losses = []
  for i in range(steps):
    if i == save_after:
      save()
    rows = batch(first + i)
    per = len(rows) // world
    tokens = torch.from_numpy(rows[rank * per : (rank + 1) * per])
    out = logits(engine, tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(
      out.reshape(-1, out.shape[-1]), tokens[:, 1:].reshape(-1)
    )
    engine.backward(loss)
    engine.step()
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, loss.detach().reshape(1))
    losses.append(sum(float(t) for t in gathered) / world)
  if save_after == steps:
    save()
  return losses


def next_token_step():
  """A jitted training step `step(model, optimizer, tokens) -> loss`: the next-token
  cross-entropy of `model(tokens[:, :-1])` against `tokens[:, 1:]` (before the update), and
  one `optimizer.update` with its gradients."""
  import optax
  from flax import nnx

  @nnx.jit
  def step(model, optimizer, tokens):
    def loss_fn(m):
      logits = m(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return step


class MeshTrainer:
  """`model` (its parameters already on `mesh`) and an `nnx.Optimizer` of torch AdamW's
  `hyper` (`lr`, `betas`, `eps`, `weight_decay`; or of the Optax transformation `tx`), its
  moments sharded as the parameters and its step counts replicated; `train(first, steps)`
  runs on `batch(step)`'s tokens (rows over the mesh's `data` axis)."""

  def __init__(
    self, model: Any, mesh: Any, hyper: dict, batch: Callable[[int], Any], tx: Any = None
  ):
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    self.model, self.mesh, self._batch = model, mesh, batch
    if tx is None:
      tx = optax.adamw(
        hyper["lr"],
        b1=hyper["betas"][0],
        b2=hyper["betas"][1],
        eps=hyper["eps"],
        weight_decay=hyper["weight_decay"],
      )
    self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)  # moments sharded as params
    replicated = NamedSharding(mesh, P())
    on_mesh = lambda x: x if len(x.devices()) > 1 else jax.device_put(x, replicated)  # noqa: E731
    nnx.update(self.optimizer, jax.tree.map(on_mesh, nnx.state(self.optimizer)))  # step counts
    self._data = NamedSharding(mesh, P("data"))
    self._step = next_token_step()

  def train(self, first: int, steps: int) -> list[float]:
    """Steps `first .. first + steps - 1`; their losses."""
    import jax
    import numpy as np

    losses = []
    for i in range(steps):
      tokens = jax.device_put(self._batch(first + i).astype(np.int32), self._data)
      losses.append(float(self._step(self.model, self.optimizer, tokens)))
    return losses
