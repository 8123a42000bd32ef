"""A small GPT-2 in Flax NNX: pre-LN blocks, tanh GELU, causal attention, learned positions.

Its twin in PyTorch is `TorchGPT` (scripts/torch_twins.py); `ucp_jax.rules.gpt2`
maps the torch state dict onto `nnx.state(FlaxGPT(...))` and back. The same model
runs Hugging Face GPT-2 checkpoints (`ucp_jax.rules.hf_gpt2`, `ucp_jax.rules.from_hf`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ucp_jax.models import _common
from ucp_jax.models._common import (
  ACTIVATIONS,
  Projection,
  causal_attention,
  lm_head,
  make_layers,
  on_auto_axes,
  run_layers,
  tp_target,
)
from ucp_jax.models._configs import GPTConfig as GPTConfig


class Attention(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    d, h, k = cfg.d_model, cfg.num_heads, cfg.head_dim
    self.qkv = Projection("btd,dshk->btshk", (d, 3, h, k), (3, h, k), rngs=rngs)
    self.proj = Projection("bthk,hkd->btd", (h, k, d), (d,), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    qkv = self.qkv(x)
    return self.proj(causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]))


class MLP(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.act = cfg.act
    self.fc = nnx.Linear(cfg.d_model, cfg.hidden, rngs=rngs)
    self.proj = nnx.Linear(cfg.hidden, cfg.d_model, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.proj(ACTIVATIONS[self.act](self.fc(x)))


class Block(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.ln_1 = nnx.LayerNorm(cfg.d_model, epsilon=cfg.eps, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.ln_2 = nnx.LayerNorm(cfg.d_model, epsilon=cfg.eps, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class FlaxGPT(_common.LanguageModel):
  """Token ids `[batch, time]` -> logits `[batch, time, vocab]`; the output layer is `wte`
  (or `lm_head`, when `cfg.tie_embeddings` is False).

  With `scan=True` the blocks are one stacked module (a leading layer axis on every
  parameter) run by `nnx.scan`; otherwise `blocks` is a list.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from ucp_jax.models.gpt import FlaxGPT, GPTConfig
    >>> model = FlaxGPT(GPTConfig(num_layers=1), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 256)
  """

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, scan: bool = False):
    self.scan = scan
    self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    self.wpe = nnx.Embed(cfg.max_len, cfg.d_model, rngs=rngs)
    self.blocks = make_layers(
      lambda i, rngs: Block(cfg, rngs=rngs), cfg.num_layers, rngs, scan=scan
    )
    self.ln_f = nnx.LayerNorm(cfg.d_model, epsilon=cfg.eps, rngs=rngs)
    self.lm_head = lm_head(cfg, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return on_auto_axes(FlaxGPT._forward, self, jnp.asarray(tokens), self.wte.embedding[...])

  def _forward(self, tokens: jax.Array) -> jax.Array:
    x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]
    x = run_layers(self.blocks, x, scan=self.scan)
    x = self.ln_f(x)
    return self.wte.attend(x) if self.lm_head is None else self.lm_head(x)


LOGICAL_AXES = {
  "wte/embedding": ("vocab", "embed"),
  "wpe/embedding": (None, "embed"),
  "attn/qkv/kernel": ("embed", None, "heads", "head_dim"),
  "attn/qkv/bias": (None, "heads", "head_dim"),
  "attn/proj/kernel": ("heads", "head_dim", "embed"),
  "mlp/fc/kernel": ("embed", "mlp"),
  "mlp/fc/bias": ("mlp",),
  "mlp/proj/kernel": ("mlp", "embed"),
  "lm_head/kernel": ("embed", "vocab"),
}
"""The logical axes of `FlaxGPT`'s parameters (`ucp_jax.models._sharding`)."""
FlaxGPT.logical_axes = LOGICAL_AXES
FlaxGPT.layers_key = "blocks"


def tp_state(state, mesh: jax.sharding.Mesh, *, axis: str = "model"):
  """`state` (e.g. `nnx.state(nnx.eval_shape(...))`) as a restore target, Megatron-style:
  attention heads, the MLP's hidden units and the vocabulary split over `axis` where it
  divides them, the rest replicated."""
  return tp_target(state, mesh, LOGICAL_AXES, axis, "blocks")
