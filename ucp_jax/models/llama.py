"""A small Llama in Flax NNX: RMSNorm, SwiGLU, rotate-half RoPE, grouped-query attention.

Its twin in PyTorch is `TorchLlama` (scripts/torch_twins.py); `ucp_jax.rules.llama`
maps the torch state dict onto `nnx.state(FlaxLlama(...))` and back. Its options also
make it Hugging Face's Llama, Mistral, Qwen2, Qwen3 and Gemma (`ucp_jax.rules.hf_llama`,
`ucp_jax.rules.from_hf`): biases, query/key norms, tied embeddings, Gemma's `1 + weight`
norms and scaled embeddings, a sliding window, Llama 3 RoPE scaling.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ucp_jax import _errors
from ucp_jax.models._common import (
  ACTIVATIONS,
  Projection,
  causal_attention,
  check_activation,
  rms_norm,
  tp_target,
)

ROPE_SCALING = {
  "linear": ("factor",),
  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
"""RoPE scalings `FlaxLlama` runs (as Hugging Face's `rope_type`) and the numbers each needs."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The sizes and options of a `FlaxLlama` (the defaults: the repo's plain reference Llama).

  Attributes:
    head_dim: per-head width; None means `d_model // num_heads` (filled in at construction,
      so `dataclasses.replace` keeps it: pass `head_dim=None` again with new sizes).
    hidden: the MLP's width.
    eps: the RMSNorms' epsilon.
    rope_scaling: None, or `{"rope_type": "linear" | "llama3", ...}` with the numbers of
      `ROPE_SCALING` (held as a sorted tuple of pairs, so the config stays hashable).
    qkv_bias: biases on the query, key and value projections (Qwen2).
    o_bias: a bias on the output projection (Llama's `attention_bias` sets both).
    mlp_bias: biases on the MLP's projections.
    qk_norm: RMSNorms over each query and key head before RoPE (Qwen3).
    tie_embeddings: the output layer is `embed` (`embed.attend`), not an `lm_head`.
    act: the gate's activation, a key of `ucp_jax.models._common.ACTIVATIONS`.
    norm_offset: every RMSNorm's gain is `norm_offset + scale` (Gemma: 1.0).
    embed_scale: embeddings are multiplied by `sqrt(d_model)` (Gemma).
    sliding_window: each position attends to its last `sliding_window` positions (Mistral).
  """

  vocab_size: int = 256
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  d_model: int = 64
  hidden: int = 128
  rope_theta: float = 10000.0
  eps: float = 1e-5
  head_dim: int | None = None
  rope_scaling: Any = None
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  tie_embeddings: bool = False
  act: str = "silu"
  norm_offset: float = 0.0
  embed_scale: bool = False
  sliding_window: int | None = None

  def __post_init__(self):
    check_activation(self.act)
    if self.head_dim is None:
      object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
    if self.rope_scaling is not None:
      scaling = dict(self.rope_scaling)
      needs = ROPE_SCALING.get(scaling.get("rope_type"))
      missing = [k for k in needs or () if k not in scaling]
      if needs is None or missing:
        raise _errors.InvalidArgumentError(
          f"rope_scaling {scaling}: runs rope_type {' or '.join(ROPE_SCALING)}"
          + (f"; missing {', '.join(missing)}" if missing else "")
        )


def inv_freq(head_dim: int, theta: float, scaling: Any = None) -> jax.Array:
  """RoPE's inverse frequencies, `[head_dim // 2]`, scaled as Hugging Face does."""
  freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  scaling = dict(scaling or ())
  kind = scaling.get("rope_type")
  if kind == "linear":
    return freq / scaling["factor"]
  if kind == "llama3":
    factor, low, high = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freq
    scaled = jnp.where(wavelen > context / low, freq / factor, freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) & ~(wavelen > context / low)
    return jnp.where(medium, smoothed, scaled)
  return freq


def rope(x: jax.Array, theta: float, scaling: Any = None) -> jax.Array:
  """Rotary positions on `[batch, time, heads, head_dim]`, rotate-half convention (as HF Llama)."""
  t, k = x.shape[1], x.shape[-1]
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq(k, theta, scaling)[None]
  angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
  x1, x2 = x[..., : k // 2], x[..., k // 2 :]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x * jnp.cos(angles) + rotated * jnp.sin(angles)


class Attention(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    d, h, kv, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.rope = (cfg.rope_theta, cfg.rope_scaling)
    self.window = cfg.sliding_window
    self.q = Projection("btd,dhk->bthk", (d, h, k), (h, k) if cfg.qkv_bias else None, rngs=rngs)
    self.k = Projection("btd,dhk->bthk", (d, kv, k), (kv, k) if cfg.qkv_bias else None, rngs=rngs)
    self.v = Projection("btd,dhk->bthk", (d, kv, k), (kv, k) if cfg.qkv_bias else None, rngs=rngs)
    self.o = Projection("bthk,hkd->btd", (h, k, d), (d,) if cfg.o_bias else None, rngs=rngs)
    self.q_norm = rms_norm(k, cfg.eps, cfg.norm_offset, rngs=rngs) if cfg.qk_norm else None
    self.k_norm = rms_norm(k, cfg.eps, cfg.norm_offset, rngs=rngs) if cfg.qk_norm else None

  def __call__(self, x: jax.Array) -> jax.Array:
    q, k, v = self.q(x), self.k(x), self.v(x)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rope(q, *self.rope), rope(k, *self.rope)
    groups = q.shape[2] // k.shape[2]  # query head i reads key/value head i // groups
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return self.o(causal_attention(q, k, v, self.window))


class MLP(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.act = cfg.act
    self.gate = nnx.Linear(cfg.d_model, cfg.hidden, use_bias=cfg.mlp_bias, rngs=rngs)
    self.up = nnx.Linear(cfg.d_model, cfg.hidden, use_bias=cfg.mlp_bias, rngs=rngs)
    self.down = nnx.Linear(cfg.hidden, cfg.d_model, use_bias=cfg.mlp_bias, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(ACTIVATIONS[self.act](self.gate(x)) * self.up(x))


class Layer(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.attn_norm = rms_norm(cfg.d_model, cfg.eps, cfg.norm_offset, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = rms_norm(cfg.d_model, cfg.eps, cfg.norm_offset, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class FlaxLlama(nnx.Module):
  """Token ids `[batch, time]` -> logits `[batch, time, vocab]`; `lm_head` untied (or none,
  the output layer being `embed`, with `cfg.tie_embeddings`).

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
    self.embed_scale = math.sqrt(cfg.d_model) if cfg.embed_scale else None
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    if scan:

      @nnx.split_rngs(splits=cfg.num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return Layer(cfg, rngs=rngs)

      self.layers = make(rngs)
    else:
      self.layers = nnx.List([Layer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = rms_norm(cfg.d_model, cfg.eps, cfg.norm_offset, rngs=rngs)
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)
    )

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    if self.embed_scale is not None:
      x = x * jnp.asarray(self.embed_scale, x.dtype)
    if self.scan:

      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def run(x, layer):
        return layer(x)

      x = run(x, self.layers)
    else:
      for layer in self.layers:
        x = layer(x)
    x = self.norm(x)
    return self.embed.attend(x) if self.lm_head is None else self.lm_head(x)


TP_TABLE = {
  "attn/q/bias": ("tp", None),
  "attn/k/bias": ("tp", None),
  "attn/v/bias": ("tp", None),
  "mlp/gate/bias": ("tp",),
  "mlp/up/bias": ("tp",),
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
