"""Flax NNX training states saved by Orbax itself, the targets that restore them, comparisons.

Shared by tests/test_orbax_source.py and tests/test_orbax_sink.py. The model has what a
trainer's state holds: kernels and biases (Adam slots), BatchNorm statistics (buffers, no
slots), an `nnx.Rngs` (a counter and a typed PRNG key); the optimizer adds Adam's `count`
and the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class Model(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(4, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.l2 = nnx.Linear(8, 4, rngs=rngs)
    self.rngs = rngs

  def __call__(self, x):
    return self.l2(nnx.relu(self.bn(self.l1(x))))


def make() -> tuple[Model, nnx.Optimizer]:
  model = Model(nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)


def trained(steps: int = 2) -> tuple[Model, nnx.Optimizer, dict]:
  """A model and optimizer after `steps` steps, and their state as Orbax saves it."""
  model, optimizer = make()
  x = jnp.linspace(-1.0, 1.0, 24).reshape(6, 4)

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - 0.5) ** 2))(model)
    optimizer.update(model, grads)
    model.rngs()  # the counter moves, as dropout would move it

  for _ in range(steps):
    step(model, optimizer)
  return model, optimizer, {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}


def abstract() -> dict:
  """The abstract state `trained` gives: what Orbax's restore (and ucp_jax's) is handed."""
  return jax.eval_shape(lambda: {"model": nnx.state(make()[0]), "optimizer": nnx.state(make()[1])})


def on_mesh(tree, mesh) -> dict:
  """`tree`'s abstract arrays sharded over `mesh`: each dimension on the first free axis
  that divides it (kernels split both ways on a 2x4 mesh, scalars replicated)."""

  def place(leaf):
    if not isinstance(leaf, jax.ShapeDtypeStruct):
      return leaf
    spec, free = [], list(mesh.axis_names)
    for dim in leaf.shape:
      axis = next((a for a in free if dim % mesh.shape[a] == 0), None)
      spec.append(axis)
      if axis is not None:
        free.remove(axis)
    sharding = NamedSharding(mesh, P(*spec))
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

  return jax.tree.map(place, tree)


def save(path, tree, *, ocdbt: bool = True, zarr3: bool = False, compression: bool = True):
  """Saves `tree` with Orbax's `PyTreeCheckpointHandler` and these storage options."""
  handler = ocp.PyTreeCheckpointHandler(
    use_ocdbt=ocdbt, use_zarr3=zarr3, use_compression=compression
  )
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(path, args=ocp.args.PyTreeSave(tree))


def leaves(tree) -> dict:
  """`{path: numpy array or Python value}`, PRNG keys as their key data and implementation."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      out[path] = (str(jax.random.key_impl(leaf)), np.asarray(jax.random.key_data(leaf)))
    elif isinstance(leaf, (jax.Array, np.ndarray)):
      out[path] = np.asarray(leaf)
    else:
      out[path] = leaf
  return out


def assert_same(got, expected) -> None:
  """The same paths, and each leaf bit for bit: dtype, shape, values, Python type."""
  got, expected = leaves(got), leaves(expected)
  assert sorted(map(str, got)) == sorted(map(str, expected))
  for path, want in expected.items():
    have = got[path]
    if isinstance(want, tuple):  # a PRNG key
      assert have[0] == want[0], path
      np.testing.assert_array_equal(have[1], want[1], err_msg=str(path))
    elif isinstance(want, np.ndarray):
      assert have.dtype == want.dtype and have.shape == want.shape, path
      assert have.tobytes() == want.tobytes(), path
    else:
      assert type(have) is type(want) and have == want, path


def shardings(tree) -> dict:
  return {
    path: leaf.sharding
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    if isinstance(leaf, jax.Array)
  }
