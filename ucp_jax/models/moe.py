"""Mixture-of-experts decoders in Flax NNX: Mixtral, Qwen2-MoE and Qwen3-MoE.

A `FlaxMoe` is a `llama.FlaxLlama` (its attention, norms, RoPE, windows and options) whose MLPs
are sparse mixture-of-experts blocks where `MoeConfig` says so. Routing computes what
`transformers` 5.24 computes: router logits `x @ router`, a softmax over all experts in
float32, the top `top_k` probabilities (`jax.lax.top_k`, as `torch.topk`), renormalized to
sum to 1 when `norm_topk_prob` (Mixtral always), cast back to the activations' dtype. Dispatch
is capacity-free: every expert runs on every token and the outputs are summed with the
combine weights (zero outside each token's top k), so no token is ever dropped; that costs
`num_experts / top_k` times the expert compute of a sparse dispatch, which is right for a
reference model and for checking checkpoints, not for training at scale. A shared expert
(Qwen2-MoE) adds `sigmoid(x @ shared_gate) * shared_mlp(x)`.

The experts of a layer are one stacked array per weight: `experts/gate` and `experts/up`
`[num_experts, d_model, expert_hidden]`, `experts/down` `[num_experts, expert_hidden, d_model]`
(`[layers, num_experts, ...]` with `scan=True`), whose logical axes put the experts on the
`expert` mesh axis, their hidden units on `model` (TP inside experts) and `d_model` on `data`
(FSDP): `ucp_jax.models.build(cfg, mesh=jax.make_mesh((2, 2, 2), ("data", "expert",
"model")))` shards them all three ways.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ucp_jax.base import _errors
from ucp_jax.models import llama
from ucp_jax.models._common import ACTIVATIONS, lm_head, make_layers, rms_norm
from ucp_jax.models._configs import MoeConfig as MoeConfig


class Experts(nnx.Module):
  """The stacked SwiGLU experts of one layer."""

  def __init__(self, cfg: MoeConfig, *, rngs: nnx.Rngs):
    e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_hidden
    self.act = cfg.act
    self.gate = nnx.Param(0.02 * jax.random.normal(rngs.params(), (e, d, f)))
    self.up = nnx.Param(0.02 * jax.random.normal(rngs.params(), (e, d, f)))
    self.down = nnx.Param(0.02 * jax.random.normal(rngs.params(), (e, f, d)))

  def __call__(self, x: jax.Array, combine: jax.Array) -> jax.Array:
    """`x` `[b, t, d]`, `combine` `[b, t, e]` -> the weighted sum of every expert's output."""
    h = ACTIVATIONS[self.act](jnp.einsum("btd,edf->btef", x, self.gate[...]))
    h = h * jnp.einsum("btd,edf->btef", x, self.up[...])
    y = jnp.einsum("btef,efd->bted", h, self.down[...])
    return jnp.einsum("bte,bted->btd", combine.astype(y.dtype), y)


def route(logits: jax.Array, top_k: int, norm: bool) -> jax.Array:
  """Combine weights `[..., num_experts]` from router logits, as transformers routes:
  softmax in float32, top k, renormalized when `norm`, cast to the logits' dtype."""
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top, index = jax.lax.top_k(probs, top_k)
  if norm:
    top = top / jnp.sum(top, axis=-1, keepdims=True)
  top = top.astype(logits.dtype)
  one_hot = jax.nn.one_hot(index, logits.shape[-1], dtype=top.dtype)
  return jnp.einsum("...k,...ke->...e", top, one_hot)


class SparseMoe(nnx.Module):
  """Router, experts, and an optional (gated) shared expert."""

  def __init__(self, cfg: MoeConfig, *, rngs: nnx.Rngs):
    self.top_k, self.norm = cfg.top_k, cfg.norm_topk_prob
    self.router = nnx.Linear(cfg.d_model, cfg.num_experts, use_bias=False, rngs=rngs)
    self.experts = Experts(cfg, rngs=rngs)
    shared = dataclasses.replace(cfg, hidden=cfg.shared_hidden, mlp_bias=False)
    self.shared = llama.MLP(shared, rngs=rngs) if cfg.shared_hidden else None
    gate = nnx.Linear(cfg.d_model, 1, use_bias=False, rngs=rngs) if cfg.shared_gate else None
    self.shared_gate = gate

  def __call__(self, x: jax.Array) -> jax.Array:
    out = self.experts(x, route(self.router(x), self.top_k, self.norm))
    if self.shared is not None:
      shared = self.shared(x)
      if self.shared_gate is not None:
        shared = jax.nn.sigmoid(self.shared_gate(x)) * shared
      out = out + shared
    return out


class Layer(llama.Layer):
  """A `llama.Layer` whose MLP is a `SparseMoe` where the config puts experts."""

  def __init__(self, cfg: MoeConfig, sparse: bool = True, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    if sparse:
      self.mlp = SparseMoe(cfg, rngs=rngs)


class FlaxMoe(llama.FlaxLlama):
  """Token ids `[batch, time]` -> logits `[batch, time, vocab]`, with expert MLPs.

  `scan=True` stacks the layers (every layer must then have experts).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from ucp_jax.models.moe import FlaxMoe, MoeConfig
    >>> model = FlaxMoe(MoeConfig(num_layers=2, num_experts=4), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 5), jnp.int32)).shape, model.layers[0].mlp.experts.gate.shape
    ((2, 5, 256), (4, 64, 64))
  """

  def __init__(self, cfg: MoeConfig, *, rngs: nnx.Rngs, scan: bool = False):
    nnx.Module.__init__(self)
    self.scan = scan
    self.cfg = cfg
    self.embed_scale = None
    if cfg.embed_scale:
      raise _errors.InvalidArgumentError("FlaxMoe: scaled embeddings are not supported")
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    if scan and cfg.dense_layers:
      raise _errors.InvalidArgumentError(
        f"FlaxMoe: scan=True needs experts in every layer; layers {list(cfg.dense_layers)} "
        "are dense"
      )
    self.layers = make_layers(
      lambda i, rngs: Layer(cfg, cfg.sparse(i), rngs=rngs), cfg.num_layers, rngs, scan=scan
    )
    self.norm = rms_norm(cfg.d_model, cfg.eps, cfg.norm_offset, rngs=rngs)
    self.lm_head = lm_head(cfg, rngs=rngs)


LOGICAL_AXES = {
  **llama.LOGICAL_AXES,
  "mlp/router/kernel": ("embed", None),
  "mlp/experts/gate": ("expert", "embed", "mlp"),
  "mlp/experts/up": ("expert", "embed", "mlp"),
  "mlp/experts/down": ("expert", "mlp", "embed"),
  "mlp/shared/gate/kernel": ("embed", "mlp"),
  "mlp/shared/up/kernel": ("embed", "mlp"),
  "mlp/shared/down/kernel": ("mlp", "embed"),
  "mlp/shared_gate/kernel": ("embed", None),
}
"""The logical axes of `FlaxMoe`'s parameters: `llama`'s, and the experts over `expert`."""
FlaxMoe.logical_axes = LOGICAL_AXES
FlaxMoe.layers_key = "layers"
