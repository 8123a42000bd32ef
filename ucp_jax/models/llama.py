"""A small Llama in Flax NNX: RMSNorm, SwiGLU, rotate-half RoPE, grouped-query attention.

Its twin in PyTorch is `TorchLlama` (scripts/torch_twins.py); `ucp_jax.rules.llama`
maps the torch state dict onto `nnx.state(FlaxLlama(...))` and back. Its options also
make it Hugging Face's Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 (text), Phi-3
and OLMo 2 (`ucp_jax.rules.from_hf`): biases, query/key norms (per head or per projection),
tied embeddings, Gemma's `1 + weight` norms and scaled embeddings, sandwich norms (Gemma 2/3)
or post-norms (OLMo 2), sliding windows on some layers or all, local and global RoPE, the
RoPE scalings of `ucp_jax.models._rope`, partial rotary, attention and logit soft-capping.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ucp_jax.models import _common, _rope
from ucp_jax.models._common import (
  ACTIVATIONS,
  NO_WINDOW,
  SHARED_AXES,
  HeadsRMSNorm,
  Projection,
  causal_attention,
  lm_head,
  make_layers,
  on_auto_axes,
  rms_norm,
  softcapped,
  tp_target,
)
from ucp_jax.models._configs import LAYER_TYPES as LAYER_TYPES
from ucp_jax.models._configs import ROPE_SCALING as ROPE_SCALING
from ucp_jax.models._configs import LlamaConfig as LlamaConfig


class Attention(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    d, h, kv, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.scale = None if cfg.query_scale is None else cfg.query_scale**-0.5
    self.softcap = cfg.attn_softcap
    self.q = Projection("btd,dhk->bthk", (d, h, k), (h, k) if cfg.qkv_bias else None, rngs=rngs)
    self.k = Projection("btd,dhk->bthk", (d, kv, k), (kv, k) if cfg.qkv_bias else None, rngs=rngs)
    self.v = Projection("btd,dhk->bthk", (d, kv, k), (kv, k) if cfg.qkv_bias else None, rngs=rngs)
    self.o = Projection("bthk,hkd->btd", (h, k, d), (d,) if cfg.o_bias else None, rngs=rngs)
    if cfg.qk_norm == "all":
      self.q_norm = HeadsRMSNorm(h, k, eps=cfg.eps)
      self.k_norm = HeadsRMSNorm(kv, k, eps=cfg.eps)
    elif cfg.qk_norm == "head":
      self.q_norm = rms_norm(k, cfg.eps, cfg.norm_offset, rngs=rngs)
      self.k_norm = rms_norm(k, cfg.eps, cfg.norm_offset, rngs=rngs)
    else:
      self.q_norm = self.k_norm = None

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, window) -> jax.Array:
    q, k, v = self.q(x), self.k(x), self.v(x)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = _rope.apply(q, cos, sin), _rope.apply(k, cos, sin)
    groups = q.shape[2] // k.shape[2]  # query head i reads key/value head i // groups
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    out = causal_attention(q, k, v, window, scale=self.scale, softcap=self.softcap)
    return self.o(out)


class MLP(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.act = cfg.act
    self.gate = nnx.Linear(cfg.d_model, cfg.hidden, use_bias=cfg.mlp_bias, rngs=rngs)
    self.up = nnx.Linear(cfg.d_model, cfg.hidden, use_bias=cfg.mlp_bias, rngs=rngs)
    self.down = nnx.Linear(cfg.hidden, cfg.d_model, use_bias=cfg.mlp_bias, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(ACTIVATIONS[self.act](self.gate(x)) * self.up(x))


class Layer(nnx.Module):
  """Attention and MLP, each with its residual; norms before (`pre`), before and after
  (`sandwich`) or after (`post`) each."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    def norm(on: bool):
      return rms_norm(cfg.d_model, cfg.eps, cfg.norm_offset, rngs=rngs) if on else None

    self.attn_norm = norm(cfg.norms != "post")
    self.attn = Attention(cfg, rngs=rngs)
    self.attn_post_norm = norm(cfg.norms != "pre")
    self.mlp_norm = norm(cfg.norms != "post")
    self.mlp = MLP(cfg, rngs=rngs)
    self.mlp_post_norm = norm(cfg.norms != "pre")

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, window) -> jax.Array:
    h = self.attn(_maybe(self.attn_norm, x), cos, sin, window)
    x = x + _maybe(self.attn_post_norm, h)
    h = self.mlp(_maybe(self.mlp_norm, x))
    return x + _maybe(self.mlp_post_norm, h)


def _maybe(norm, x: jax.Array) -> jax.Array:
  return x if norm is None else norm(x)


class FlaxLlama(_common.LanguageModel):
  """Token ids `[batch, time]` -> logits `[batch, time, vocab]`; `lm_head` untied (or none,
  the output layer being `embed`, with `cfg.tie_embeddings`).

  With `scan=True` the layers are one stacked module run by `nnx.scan` (each layer's window
  and RoPE are scanned with it). On a mesh of Explicit axes the forward pass runs on Auto
  axes (`_common.on_auto_axes`), so a model built by `ucp_jax.models.build(..., mesh=...)`
  runs on any mesh.

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
    self.cfg = cfg
    self.embed_scale = math.sqrt(cfg.d_model) if cfg.embed_scale else None
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    self.layers = make_layers(
      lambda i, rngs: Layer(cfg, rngs=rngs), cfg.num_layers, rngs, scan=scan
    )
    self.norm = rms_norm(cfg.d_model, cfg.eps, cfg.norm_offset, rngs=rngs)
    self.lm_head = lm_head(cfg, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return on_auto_axes(FlaxLlama._forward, self, jnp.asarray(tokens), self.embed.embedding[...])

  def _forward(self, tokens: jax.Array) -> jax.Array:
    cfg, t = self.cfg, tokens.shape[1]
    x = self.embed(tokens)
    if self.embed_scale is not None:
      x = x * jnp.asarray(self.embed_scale, x.dtype)
    ropes = [_rope.tables(t, cfg.rot_dim, cfg.rope_theta, cfg.rope_scaling)]
    if cfg.local_rope_theta is not None:
      ropes.append(_rope.tables(t, cfg.rot_dim, cfg.local_rope_theta, cfg.local_rope_scaling))
    local = [int(cfg.sliding(i) and len(ropes) > 1) for i in range(cfg.num_layers)]
    windows = [cfg.sliding_window if cfg.sliding(i) else None for i in range(cfg.num_layers)]
    if self.scan:
      cos, sin = jnp.stack([c for c, _ in ropes]), jnp.stack([s for _, s in ropes])
      steps = jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32)

      @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0), out_axes=nnx.Carry)
      def run(x, layer, which, window):
        return layer(x, cos[which], sin[which], window)

      x = run(x, self.layers, jnp.asarray(local, jnp.int32), steps)
    else:
      for layer, which, window in zip(self.layers, local, windows):
        x = layer(x, *ropes[which], window)
    x = self.norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    return softcapped(logits, cfg.final_softcap)


LOGICAL_AXES = {
  **SHARED_AXES,
  "attn/q/kernel": ("embed", "heads", "head_dim"),
  "attn/k/kernel": ("embed", "kv_heads", "head_dim"),
  "attn/v/kernel": ("embed", "kv_heads", "head_dim"),
  "attn/q/bias": ("heads", "head_dim"),
  "attn/k/bias": ("kv_heads", "head_dim"),
  "attn/v/bias": ("kv_heads", "head_dim"),
  "attn/q_norm/scale": ("heads", "head_dim"),  # per projection (OLMo 2); per head: head_dim
  "attn/k_norm/scale": ("kv_heads", "head_dim"),
  "mlp/gate/kernel": ("embed", "mlp"),
  "mlp/gate/bias": ("mlp",),
}
"""The logical axes of `FlaxLlama`'s parameters (`ucp_jax.models._sharding`); the rest
(norms, output biases) are replicated."""
FlaxLlama.logical_axes = LOGICAL_AXES
FlaxLlama.layers_key = "layers"


def tp_state(state, mesh: jax.sharding.Mesh, *, axis: str = "model"):
  """`state` as a restore target, Megatron-style: query heads, key/value heads (replicated
  where `axis` does not divide them), the MLP's hidden units and the vocabulary split over
  `axis`, the rest replicated."""
  return tp_target(state, mesh, LOGICAL_AXES, axis)
