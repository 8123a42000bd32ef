"""A small Llama in Flax NNX: RMSNorm, SwiGLU, rotate-half RoPE, grouped-query attention.

Its twin in PyTorch is `TorchLlama` (scripts/torch_twins.py); `ucp_jax.rules.llama`
maps the torch state dict onto `nnx.state(FlaxLlama(...))` and back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ucp_jax.models._common import Projection, causal_attention, tp_target


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab_size: int = 256
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  d_model: int = 64
  hidden: int = 128
  rope_theta: float = 10000.0
  eps: float = 1e-5

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def rope(x: jax.Array, theta: float) -> jax.Array:
  """Rotary positions on `[batch, time, heads, head_dim]`, rotate-half convention (as HF Llama)."""
  t, k = x.shape[1], x.shape[-1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k)
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None]
  angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
  x1, x2 = x[..., : k // 2], x[..., k // 2 :]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x * jnp.cos(angles) + rotated * jnp.sin(angles)


class Attention(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    d, h, kv, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.theta = cfg.rope_theta
    self.q = Projection("btd,dhk->bthk", (d, h, k), rngs=rngs)
    self.k = Projection("btd,dhk->bthk", (d, kv, k), rngs=rngs)
    self.v = Projection("btd,dhk->bthk", (d, kv, k), rngs=rngs)
    self.o = Projection("bthk,hkd->btd", (h, k, d), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    q, k, v = rope(self.q(x), self.theta), rope(self.k(x), self.theta), self.v(x)
    groups = q.shape[2] // k.shape[2]  # query head i reads key/value head i // groups
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return self.o(causal_attention(q, k, v))


class MLP(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.gate = nnx.Linear(cfg.d_model, cfg.hidden, use_bias=False, rngs=rngs)
    self.up = nnx.Linear(cfg.d_model, cfg.hidden, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(cfg.hidden, cfg.d_model, use_bias=False, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Layer(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.attn_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.eps, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.eps, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class FlaxLlama(nnx.Module):
  """Token ids `[batch, time]` -> logits `[batch, time, vocab]`; `lm_head` untied.

  With `scan=True` the layers are one stacked module run by `nnx.scan`.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from ucp_jax.models.llama import FlaxLlama, LlamaConfig
    >>> model = FlaxLlama(LlamaConfig(num_layers=1), rngs=nnx.Rngs(0), scan=True)
    >>> model(jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 256)
  """

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, scan: bool = False):
    self.scan = scan
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    if scan:

      @nnx.split_rngs(splits=cfg.num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return Layer(cfg, rngs=rngs)

      self.layers = make(rngs)
    else:
      self.layers = nnx.List([Layer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.eps, rngs=rngs)
    self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    if self.scan:

      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def run(x, layer):
        return layer(x)

      x = run(x, self.layers)
    else:
      for layer in self.layers:
        x = layer(x)
    return self.lm_head(self.norm(x))


TP_TABLE = {
  "attn/q/kernel": (None, "tp", None),
  "attn/k/kernel": (None, "tp", None),
  "attn/v/kernel": (None, "tp", None),
  "attn/o/kernel": ("tp", None, None),
  "mlp/gate/kernel": (None, "tp"),
  "mlp/up/kernel": (None, "tp"),
  "mlp/down/kernel": ("tp", None),
  "lm_head/kernel": (None, "tp"),
}


def tp_state(state, mesh: jax.sharding.Mesh, *, axis: str = "model"):
  """`state` as a restore target, Megatron-style: heads (query and key/value), the MLP's
  hidden units and the vocabulary of `lm_head` split over `axis`, the rest replicated."""
  return tp_target(state, mesh, TP_TABLE, axis)
