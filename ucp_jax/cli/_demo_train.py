"""The demo's training side: a small Flax NNX MLP, its data, its train step, and its state on a mesh.

Imported by `_demo.run` once it has asked for 8 devices (JAX reads `XLA_FLAGS` when it starts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax

BATCH = 64
FEATURES = 16
HIDDEN = 64
LEARNING_RATE = 3e-3
DATA_SEED = 1234


class MLP(nnx.Module):
  """Two hidden GELU layers and a scalar output."""

  def __init__(self, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.fc2 = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.gelu(self.fc2(nnx.gelu(self.fc1(x)))))[:, 0]


def batch(step: int):
  """Step `step`'s inputs and targets: the same on every run."""
  key = jax.random.fold_in(jax.random.key(DATA_SEED), step)
  x = jax.random.normal(key, (BATCH, FEATURES))
  y = jnp.sin(x.sum(axis=1)) + 0.1 * x[:, 0] ** 2
  return x, y


@nnx.jit
def train_step(model, optimizer, x, y):
  def loss_fn(m):
    return jnp.mean((m(x) - y) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def _optimizer(model):
  return nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)


def fresh(mesh):
  """A new model and optimizer, replicated over `mesh`."""
  model = MLP(nnx.Rngs(0))
  optimizer = _optimizer(model)
  replicated = NamedSharding(mesh, P())
  nnx.update(model, jax.device_put(nnx.state(model), replicated))
  nnx.update(optimizer, jax.device_put(nnx.state(optimizer), replicated))
  return model, optimizer


def state(model, optimizer) -> dict:
  """What the demo saves: the model's and the optimizer's state."""
  return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}


def abstract(mesh, tensor_parallel: bool):
  """A model and optimizer, abstract, and their state as `ShapeDtypeStruct`s sharded for
  `mesh` (kernels and biases split over its `model` axis where `tensor_parallel`)."""

  def spec(path, leaf):
    names = [str(getattr(p, "key", p)) for p in path]
    if tensor_parallel and leaf.ndim == 2 and leaf.shape[1] % mesh.shape["model"] == 0:
      return P(None, "model")  # kernels split over their output dimension
    if (
      tensor_parallel
      and leaf.ndim == 1
      and leaf.shape[0] % mesh.shape["model"] == 0
      and "bias" in names
    ):
      return P("model")
    return P()

  model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
  optimizer = nnx.eval_shape(lambda: _optimizer(MLP(nnx.Rngs(0))))

  def struct(path, leaf):
    return jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec(path, leaf))
    )

  return model, optimizer, jax.tree_util.tree_map_with_path(struct, state(model, optimizer))


def restored(mesh, tensor_parallel: bool, path: str):
  """A model and optimizer on `mesh`, restored from the checkpoint at `path`, and the state
  read (to compare with the one saved)."""
  model, optimizer, target = abstract(mesh, tensor_parallel)
  tree = ucp_jax.restore(path, target)
  nnx.update(model, tree["model"])
  nnx.update(optimizer, tree["optimizer"])
  return model, optimizer, tree


def run_steps(model, optimizer, mesh, first: int, count: int) -> list[float]:
  """Steps `first .. first + count - 1` on `mesh`, the batch split over its `data` axis."""
  losses = []
  for step in range(first, first + count):
    x, y = batch(step)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    y = jax.device_put(y, NamedSharding(mesh, P("data")))
    losses.append(float(train_step(model, optimizer, x, y)))
  return losses


def meshes():
  """The demo's three meshes: (8,) data-parallel, 2 x 4 data x model, a 4-device sub-mesh."""
  devices = jax.devices()
  return (
    jax.make_mesh((8,), ("data",), devices=devices),
    jax.make_mesh((2, 4), ("data", "model"), devices=devices),
    jax.make_mesh((4,), ("data",), devices=devices[:4]),
  )
