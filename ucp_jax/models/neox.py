"""GPT-NeoX in Flax NNX (Pythia, GPT-NeoX-20B): LayerNorms, one fused query/key/value
projection per head, partial rotary embeddings, a parallel (or sequential) residual.

`ucp_jax.rules.from_hf` reads a Hugging Face `gpt_neox` config into a `NeoXConfig`;
`ucp_jax.rules.hf_gpt_neox` maps the `transformers` names: `query_key_value` holds each
head's query, key and value side by side (`[heads, 3, head_dim]` outputs), which is the
Flax kernel's `[d_model, heads, 3, head_dim]` layout after a transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ucp_jax.models import _common, _rope
from ucp_jax.models._common import (
  ACTIVATIONS,
  SHARED_AXES,
  Projection,
  causal_attention,
  lm_head,
  make_layers,
  on_auto_axes,
  run_layers,
  tp_target,
)
from ucp_jax.models._configs import NeoXConfig as NeoXConfig


class Attention(nnx.Module):
  def __init__(self, cfg: NeoXConfig, *, rngs: nnx.Rngs):
    d, h, k = cfg.d_model, cfg.num_heads, cfg.head_dim
    bias = cfg.attention_bias
    self.qkv = Projection("btd,dhsk->bthsk", (d, h, 3, k), (h, 3, k) if bias else None, rngs=rngs)
    self.o = Projection("bthk,hkd->btd", (h, k, d), (d,) if bias else None, rngs=rngs)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    qkv = self.qkv(x)
    q, k = _rope.apply(qkv[:, :, :, 0], cos, sin), _rope.apply(qkv[:, :, :, 1], cos, sin)
    return self.o(causal_attention(q, k, qkv[:, :, :, 2]))


class MLP(nnx.Module):
  def __init__(self, cfg: NeoXConfig, *, rngs: nnx.Rngs):
    self.act = cfg.act
    self.up = nnx.Linear(cfg.d_model, cfg.hidden, rngs=rngs)
    self.down = nnx.Linear(cfg.hidden, cfg.d_model, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(ACTIVATIONS[self.act](self.up(x)))


class Layer(nnx.Module):
  def __init__(self, cfg: NeoXConfig, *, rngs: nnx.Rngs):
    self.parallel = cfg.parallel_residual
    self.attn_norm = nnx.LayerNorm(cfg.d_model, epsilon=cfg.eps, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(cfg.d_model, epsilon=cfg.eps, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    h = self.attn(self.attn_norm(x), cos, sin)
    if self.parallel:
      return x + h + self.mlp(self.mlp_norm(x))
    x = x + h
    return x + self.mlp(self.mlp_norm(x))


class FlaxNeoX(_common.LanguageModel):
  """Token ids `[batch, time]` -> logits `[batch, time, vocab]`.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from ucp_jax.models.neox import FlaxNeoX, NeoXConfig
    >>> FlaxNeoX(NeoXConfig(num_layers=1), rngs=nnx.Rngs(0))(jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 256)
  """

  def __init__(self, cfg: NeoXConfig, *, rngs: nnx.Rngs, scan: bool = False):
    self.scan = scan
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    self.layers = make_layers(
      lambda i, rngs: Layer(cfg, rngs=rngs), cfg.num_layers, rngs, scan=scan
    )
    self.norm = nnx.LayerNorm(cfg.d_model, epsilon=cfg.eps, rngs=rngs)
    self.lm_head = lm_head(cfg, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return on_auto_axes(FlaxNeoX._forward, self, jnp.asarray(tokens), self.embed.embedding[...])

  def _forward(self, tokens: jax.Array) -> jax.Array:
    cfg = self.cfg
    cos, sin = _rope.tables(tokens.shape[1], cfg.rot_dim, cfg.rope_theta, cfg.rope_scaling)
    x = self.embed(tokens)
    x = run_layers(self.layers, x, cos, sin, scan=self.scan)
    x = self.norm(x)
    return self.embed.attend(x) if self.lm_head is None else self.lm_head(x)


LOGICAL_AXES = {
  **SHARED_AXES,
  "attn/qkv/kernel": ("embed", "heads", None, "head_dim"),
  "attn/qkv/bias": ("heads", None, "head_dim"),
}
"""The logical axes of `FlaxNeoX`'s parameters (`ucp_jax.models._sharding`)."""
FlaxNeoX.logical_axes = LOGICAL_AXES
FlaxNeoX.layers_key = "layers"


def tp_state(state, mesh: jax.sharding.Mesh, *, axis: str = "model"):
  """`state` as a restore target: heads, MLP units and the vocabulary over `axis`."""
  return tp_target(state, mesh, LOGICAL_AXES, axis)
