"""Pieces the Flax reference models share: einsum projections, attention, norms, TP specs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ucp_jax import _errors
from ucp_jax.store import _keypath

ACTIVATIONS = {
  "silu": jax.nn.silu,
  "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
  "gelu": functools.partial(jax.nn.gelu, approximate=False),
  "relu": jax.nn.relu,
}
"""The MLP activations a config may name (`gelu_tanh` is Hugging Face's `gelu_new` and
`gelu_pytorch_tanh`; `gelu` is the exact, erf one)."""


def check_activation(name: str) -> None:
  if name not in ACTIVATIONS:
    raise _errors.InvalidArgumentError(
      f"activation {name!r} is not one of {', '.join(ACTIVATIONS)}"
    )


class Projection(nnx.Module):
  """`einsum(equation, x, kernel) (+ bias)`: a Linear whose in/out axes may be several."""

  def __init__(self, equation: str, kernel_shape, bias_shape=None, *, rngs: nnx.Rngs):
    self.equation = equation
    self.kernel = nnx.Param(0.02 * jax.random.normal(rngs.params(), kernel_shape))
    self.bias = nnx.Param(jnp.zeros(bias_shape)) if bias_shape is not None else None

  def __call__(self, x: jax.Array) -> jax.Array:
    y = jnp.einsum(self.equation, x, self.kernel[...])
    return y if self.bias is None else y + self.bias[...]


class ScaledRMSNorm(nnx.Module):
  """RMSNorm whose gain is `offset + scale` (Gemma's `1 + weight`; `scale` starts at `1 - offset`).

  Example:
    >>> import jax.numpy as jnp
    >>> from ucp_jax.models._common import ScaledRMSNorm
    >>> norm = ScaledRMSNorm(4, eps=1e-6, offset=1.0)
    >>> norm.scale[...].tolist(), norm(jnp.full((1, 4), 3.0)).round(3).tolist()
    ([0.0, 0.0, 0.0, 0.0], [[1.0, 1.0, 1.0, 1.0]])
  """

  def __init__(self, dim: int, *, eps: float, offset: float):
    self.eps, self.offset = eps, offset
    self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    return y * (self.offset + self.scale[...])


def rms_norm(dim: int, eps: float, offset: float = 0.0, *, rngs: nnx.Rngs) -> nnx.Module:
  """`nnx.RMSNorm` (gain `scale`), or `ScaledRMSNorm` where the gain is `offset + scale`."""
  if offset:
    return ScaledRMSNorm(dim, eps=eps, offset=offset)
  return nnx.RMSNorm(dim, epsilon=eps, rngs=rngs)


def causal_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, window: int | None = None
) -> jax.Array:
  """Softmax attention, `[batch, time, heads, head_dim]` in and out, each step seeing its past
  (only its last `window` steps, itself included, when `window` is given)."""
  scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  t = q.shape[1]
  seen = jnp.tril(jnp.ones((t, t), bool))
  if window is not None:
    seen &= ~jnp.tril(jnp.ones((t, t), bool), -window)
  scores = jnp.where(seen, scores, -jnp.inf)
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
