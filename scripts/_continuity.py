"""What the cross-framework continuity runs share (scripts/cross_framework_demo.py and
scripts/moe_continuity_demo.py): their data, DeepSpeed's training loop, and the JAX trainer
that continues it (optax.adamw with torch AdamW's hyperparameters, next-token cross-entropy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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


class MeshTrainer:
  """`model` (its parameters already on `mesh`) and an `nnx.Optimizer` of torch AdamW's
  `hyper` (`lr`, `betas`, `eps`, `weight_decay`), its moments sharded as the parameters and
  its step counts replicated; `train(first, steps)` runs on `batch(step)`'s tokens."""

  def __init__(self, model: Any, mesh: Any, hyper: dict, batch: Callable[[int], Any]):
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    self.model, self.mesh, self._batch = model, mesh, batch
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

    @nnx.jit
    def step(model, optimizer, tokens):
      def loss_fn(m):
        logits = m(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return loss

    self._step = step

  def train(self, first: int, steps: int) -> list[float]:
    """Steps `first .. first + steps - 1`; their losses."""
    import jax
    import numpy as np

    losses = []
    for i in range(steps):
      tokens = jax.device_put(self._batch(first + i).astype(np.int32), self._data)
      losses.append(float(self._step(self.model, self.optimizer, tokens)))
    return losses
