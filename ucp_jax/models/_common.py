"""Pieces the Flax reference models share: projections, attention, norms, Auto-axes forward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ucp_jax.models import _sharding


class LanguageModel(nnx.Module):
  """A model of this package: token ids -> logits, with the logical axes of its parameters
  (`_sharding`) and the key of its layers' subtree, which each model sets below its class."""

  logical_axes: ClassVar[dict[str, tuple[str | None, ...]]]
  layers_key: ClassVar[str]


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
  "silu": jax.nn.silu,
  "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
  "gelu": functools.partial(jax.nn.gelu, approximate=False),
  "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
  "relu": jax.nn.relu,
  "relu2": lambda x: jnp.square(jax.nn.relu(x)),
  "relu6": jax.nn.relu6,
  "tanh": jnp.tanh,
  "sigmoid": jax.nn.sigmoid,
}
"""The MLP activations a config may name (`gelu_tanh` is Hugging Face's `gelu_new`,
`gelu_pytorch_tanh`, `gelu_fast` and `gelu_accurate`; `gelu` is the exact, erf one)."""


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


class HeadsRMSNorm(nnx.Module):
  """RMSNorm over the last two axes together (all heads of a projection, as OLMo 2 normalizes
  its queries and keys before splitting them into heads); the gain is `[heads, head_dim]`."""

  def __init__(self, heads: int, head_dim: int, *, eps: float):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((heads, head_dim), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=(-2, -1), keepdims=True) + self.eps)
    return y * self.scale[...]


NO_WINDOW = 1 << 30
"""A per-layer window as wide as no sequence: the layer attends to every earlier step."""


def causal_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  window: int | jax.Array | None = None,
  *,
  scale: float | None = None,
  softcap: float | None = None,
) -> jax.Array:
  """Softmax attention, `[batch, time, heads, head_dim]` in and out, each step seeing its past.

  Args:
    q: queries; `k` and `v` have as many heads (repeat grouped key/value heads first).
    k: keys.
    v: values.
    window: each step sees only its last `window` steps, itself included (an int, or a
      scalar array: a scanned layer's own window; `NO_WINDOW` for none).
    scale: the scores' factor (default `head_dim ** -0.5`).
    softcap: scores become `softcap * tanh(scores / softcap)` (Gemma 2).
  """
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  scores = jnp.einsum("bqhk,bshk->bhqs", q, k) * jnp.asarray(scale, q.dtype)
  if softcap is not None:
    scores = jnp.tanh(scores / softcap) * softcap
  t = q.shape[1]
  steps = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]  # query - key
  seen = steps >= 0
  if window is not None:
    seen &= steps < window
  scores = jnp.where(seen, scores, -jnp.inf)
  return jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, axis=-1), v)


def softcapped(logits: jax.Array, cap: float | None) -> jax.Array:
  return logits if cap is None else jnp.tanh(logits / cap) * cap


def on_auto_axes(forward, module, tokens: jax.Array, probe: jax.Array) -> jax.Array:
  """`forward(module, tokens)`, with the Explicit axes of the parameters' mesh made Auto.

  On a mesh of Explicit axes (`jax.make_mesh`'s default) every contraction of two sharded
  operands needs an output sharding; the reference models leave that to XLA's propagation,
  as on Auto axes. The logits come out sharded as `tokens` are (replicated for host arrays).
  `probe` is any parameter: its type carries the mesh.
  """
  mesh = getattr(jax.typeof(probe).sharding, "mesh", None)
  types = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
  explicit = tuple(a for a, kind in types.items() if kind == jax.sharding.AxisType.Explicit)
  if mesh is None or not explicit:
    return forward(module, tokens)
  spec = getattr(jax.typeof(tokens).sharding, "spec", None) or P()
  out = P(*tuple(spec), *(None,) * (tokens.ndim + 1 - len(tuple(spec))))
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.sharding.auto_axes(forward, axes=explicit, out_sharding=out)(module, tokens)


SHARED_AXES = {
  "embed/embedding": ("vocab", "embed"),
  "attn/o/kernel": ("heads", "head_dim", "embed"),
  "mlp/up/kernel": ("embed", "mlp"),
  "mlp/up/bias": ("mlp",),
  "mlp/down/kernel": ("mlp", "embed"),
  "lm_head/kernel": ("embed", "vocab"),
}
"""The logical axes (`ucp_jax.models._sharding`) of the parameters the NeoX and Llama families
name alike: the token embedding, the attention's output, the MLP's up and down projections and
the untied output layer. Each family's `LOGICAL_AXES` adds its own."""


def tp_target(
  state, mesh: jax.sharding.Mesh, table: dict[str, tuple], axis: str, layers: str = "layers"
):
  """`state` as `jax.ShapeDtypeStruct`s with tensor-parallel shardings: a restore target.

  `table` gives each parameter's logical axes (`_sharding.logical_names`); heads, key/value
  heads, MLP units and the vocabulary are split over mesh axis `axis` where it divides them,
  everything else is replicated.
  """
  rules = {name: axis for name in _sharding.TP_RULES}
  return _sharding.target(state, mesh, table, rules, layers)


def make_layers(make_layer, num_layers: int, rngs: nnx.Rngs, *, scan: bool):
  """`num_layers` layers, `make_layer(i, rngs)` each: one module whose parameters have a
  leading layer axis (run by `nnx.scan`, every layer built as layer 0) where `scan`, else an
  `nnx.List`."""
  if scan:

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return make_layer(0, rngs)

    return make(rngs)
  return nnx.List([make_layer(i, rngs) for i in range(num_layers)])


def run_layers(layers, x: jax.Array, *args, scan: bool) -> jax.Array:
  """`x` through every layer of `make_layers`'s `layers`, each called `layer(x, *args)`."""
  if scan:

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, layer):
      return layer(x, *args)

    return run(x, layers)
  for layer in layers:
    x = layer(x, *args)
  return x


def lm_head(cfg, *, rngs: nnx.Rngs) -> nnx.Linear | None:
  """The output projection, or None where the logits reuse the token embedding."""
  if cfg.tie_embeddings:
    return None
  return nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)
