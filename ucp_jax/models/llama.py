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

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from ucp_jax import _errors
from ucp_jax.models import _rope
from ucp_jax.models._common import (
  ACTIVATIONS,
  NO_WINDOW,
  SHARED_AXES,
  HeadsRMSNorm,
  Projection,
  causal_attention,
  check_activation,
  lm_head,
  make_layers,
  on_auto_axes,
  rms_norm,
  softcapped,
  tp_target,
)

ROPE_SCALING = _rope.SCALINGS
"""RoPE scalings `FlaxLlama` runs (as Hugging Face's `rope_type`) and the numbers each needs."""

LAYER_TYPES = ("full_attention", "sliding_attention")
NORMS = ("pre", "sandwich", "post")
QK_NORMS = ("none", "head", "all")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The sizes and options of a `FlaxLlama` (the defaults: the repo's plain reference Llama).

  Attributes:
    head_dim: per-head width; None means `d_model // num_heads` (filled in at construction,
      so `dataclasses.replace` keeps it: pass `head_dim=None` again with new sizes).
    hidden: the MLP's width.
    eps: the RMSNorms' epsilon.
    rope_scaling: None, or `{"rope_type": ..., ...}` with the numbers `ROPE_SCALING` names
      (held as a sorted tuple of pairs, so the config stays hashable).
    qkv_bias: biases on the query, key and value projections (Qwen2).
    o_bias: a bias on the output projection (Llama's `attention_bias` sets both).
    mlp_bias: biases on the MLP's projections.
    qk_norm: RMSNorms on the queries and keys before RoPE: `"head"` over each head (Qwen3,
      Gemma 3), `"all"` over the whole projection (OLMo 2), `"none"`; True means `"head"`.
    tie_embeddings: the output layer is `embed` (`embed.attend`), not an `lm_head`.
    act: the gate's activation, a key of `ucp_jax.models._common.ACTIVATIONS`.
    norm_offset: every RMSNorm's gain is `norm_offset + scale` (Gemma: 1.0).
    embed_scale: embeddings are multiplied by `sqrt(d_model)` (Gemma).
    sliding_window: each position of a sliding layer attends to its last `sliding_window`
      positions (Mistral: every layer).
    layer_types: `"sliding_attention"` or `"full_attention"` per layer; None: every layer
      slides when `sliding_window` is set.
    partial_rotary: the fraction of each head RoPE rotates (the first `rot_dim` features).
    local_rope_theta: RoPE's base on sliding layers (Gemma 3); None: `rope_theta`.
    local_rope_scaling: RoPE's scaling on sliding layers when `local_rope_theta` is set.
    norms: `"pre"` (a norm before attention and MLP), `"sandwich"` (and after each: Gemma 2
      and 3) or `"post"` (after each only: OLMo 2).
    query_scale: the attention scores are scaled by `query_scale ** -0.5` (Gemma 2's
      `query_pre_attn_scalar`); None: `head_dim ** -0.5`.
    attn_softcap: scores become `cap * tanh(scores / cap)` (Gemma 2).
    final_softcap: the logits likewise (Gemma 2 and 3).
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
  qk_norm: Literal["none", "head", "all"] | bool = "none"
  tie_embeddings: bool = False
  act: str = "silu"
  norm_offset: float = 0.0
  embed_scale: bool = False
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  partial_rotary: float = 1.0
  local_rope_theta: float | None = None
  local_rope_scaling: Any = None
  norms: Literal["pre", "sandwich", "post"] = "pre"
  query_scale: float | None = None
  attn_softcap: float | None = None
  final_softcap: float | None = None

  def __post_init__(self):
    check_activation(self.act)
    if self.head_dim is None:
      object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
    if isinstance(self.qk_norm, bool):
      object.__setattr__(self, "qk_norm", "head" if self.qk_norm else "none")
    for name in ("rope_scaling", "local_rope_scaling"):
      object.__setattr__(self, name, _rope.frozen(getattr(self, name)))
      _rope.check(getattr(self, name), self.rot_dim, name)
    if self.layer_types is not None:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    problems = [
      f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}"
      for name, allowed in (("norms", NORMS), ("qk_norm", QK_NORMS))
      if getattr(self, name) not in allowed
    ]
    if self.layer_types is not None and (
      len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES)
    ):
      problems.append(f"layer_types: {self.num_layers} of {', '.join(LAYER_TYPES)}")
    if problems:
      raise _errors.InvalidArgumentError("LlamaConfig: " + "; ".join(problems))

  @property
  def rot_dim(self) -> int:
    """The features of each head RoPE rotates."""
    return int(self.head_dim * self.partial_rotary)

  def sliding(self, layer: int) -> bool:
    """Whether layer `layer` attends through the sliding window."""
    if self.sliding_window is None:
      return False
    return self.layer_types is None or self.layer_types[layer] == "sliding_attention"


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


class FlaxLlama(nnx.Module):
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
