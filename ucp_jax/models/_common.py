"""Pieces the Flax reference models share: einsum projections, attention, TP specs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ucp_jax.store import _keypath


class Projection(nnx.Module):
  """`einsum(equation, x, kernel) (+ bias)`: a Linear whose in/out axes may be several."""

  def __init__(self, equation: str, kernel_shape, bias_shape=None, *, rngs: nnx.Rngs):
    self.equation = equation
    self.kernel = nnx.Param(0.02 * jax.random.normal(rngs.params(), kernel_shape))
    self.bias = nnx.Param(jnp.zeros(bias_shape)) if bias_shape is not None else None

  def __call__(self, x: jax.Array) -> jax.Array:
    y = jnp.einsum(self.equation, x, self.kernel[...])
    return y if self.bias is None else y + self.bias[...]


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Softmax attention, `[batch, time, heads, head_dim]` in and out, each step seeing its past."""
  scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  t = q.shape[1]
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
  return jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, axis=-1), v)


def tp_target(state, mesh: jax.sharding.Mesh, table: dict[str, tuple], axis: str):
  """`state` as `jax.ShapeDtypeStruct`s with tensor-parallel shardings: a restore target.

  A key ending in a suffix of `table` is split over mesh axis `axis` where `table`
  says `"tp"` (a stacked layer axis in front stays whole); every other array is
  replicated.
  """

  def spec(key: str, ndim: int) -> P:
    for suffix, parts in table.items():
      if key.endswith(suffix):
        parts = tuple(axis if p == "tp" else None for p in parts)
        return P(*((None,) * (ndim - len(parts)) + parts))
    return P()

  def leaf(path, x):
    names = [_keypath.entry_name(e) for e in path]
    key = "/".join(names[:-1] if names[-1:] == ["value"] else names)
    sharding = jax.sharding.NamedSharding(mesh, spec(key, len(x.shape)))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree_util.tree_map_with_path(leaf, state)
