"""PyTorch twins of the reference Flax NNX models in `ucp_jax.models` (imports torch).

`TorchGPT` is `ucp_jax.models.gpt.FlaxGPT`'s twin and `TorchLlama` is
`ucp_jax.models.llama.FlaxLlama`'s, parameter for parameter: `ucp_jax.rules.gpt2` and
`ucp_jax.rules.llama` map one's state dict onto the other's. Used by the rule-set tests, the
DeepSpeed fixture generators and the cross-framework demo; not part of the package.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ucp_jax.models.gpt import GPTConfig
from ucp_jax.models.llama import LlamaConfig


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
  """`[batch, time, heads, head_dim]` in and out, as `ucp_jax.models._common.causal_attention`."""
  scores = torch.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(q.shape[-1])
  t = q.shape[1]
  mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=q.device))
  scores = scores.masked_fill(~mask, float("-inf"))
  return torch.einsum("bhqs,bshk->bqhk", scores.softmax(-1), v)


class GPTAttention(nn.Module):
  def __init__(self, cfg: GPTConfig):
    super().__init__()
    self.cfg = cfg
    self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
    self.proj = nn.Linear(cfg.d_model, cfg.d_model)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, t, _ = x.shape
    qkv = self.qkv(x).view(b, t, 3, self.cfg.num_heads, self.cfg.head_dim)
    y = causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
    return self.proj(y.reshape(b, t, -1))


class GPTMLP(nn.Module):
  def __init__(self, cfg: GPTConfig):
    super().__init__()
    self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
    self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class GPTBlock(nn.Module):
  def __init__(self, cfg: GPTConfig):
    super().__init__()
    self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
    self.attn = GPTAttention(cfg)
    self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
    self.mlp = GPTMLP(cfg)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
  """Token ids `[batch, time]` -> logits `[batch, time, vocab]`; `lm_head` is tied to `wte`."""

  def __init__(self, cfg: GPTConfig):
    super().__init__()
    self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
    self.wpe = nn.Embedding(cfg.max_len, cfg.d_model)
    self.h = nn.ModuleList([GPTBlock(cfg) for _ in range(cfg.num_layers)])
    self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
    self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    self.lm_head.weight = self.wte.weight
    for p in self.parameters():  # small weights, as in GPT-2 (and FlaxGPT)
      if p.dim() > 1:
        nn.init.normal_(p, std=0.02)

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    x = self.wte(tokens) + self.wpe(pos)[None]
    for block in self.h:
      x = block(x)
    return self.lm_head(self.ln_f(x))


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
  """As `ucp_jax.models.llama.rope`: `[batch, time, heads, head_dim]`, rotate-half."""
  t, k = x.shape[1], x.shape[-1]
  inv_freq = 1.0 / theta ** (torch.arange(0, k, 2, dtype=torch.float32) / k)
  angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq[None]
  angles = torch.cat([angles, angles], dim=-1)[None, :, None, :]
  x1, x2 = x[..., : k // 2], x[..., k // 2 :]
  return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()


class LlamaAttention(nn.Module):
  def __init__(self, cfg: LlamaConfig):
    super().__init__()
    self.cfg = cfg
    d, k = cfg.d_model, cfg.head_dim
    self.q_proj = nn.Linear(d, cfg.num_heads * k, bias=False)
    self.k_proj = nn.Linear(d, cfg.num_kv_heads * k, bias=False)
    self.v_proj = nn.Linear(d, cfg.num_kv_heads * k, bias=False)
    self.o_proj = nn.Linear(cfg.num_heads * k, d, bias=False)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, t, _ = x.shape
    cfg = self.cfg
    q = rope(self.q_proj(x).view(b, t, cfg.num_heads, cfg.head_dim), cfg.rope_theta)
    k = rope(self.k_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim), cfg.rope_theta)
    v = self.v_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim)
    groups = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    return self.o_proj(causal_attention(q, k, v).reshape(b, t, -1))


class LlamaMLP(nn.Module):
  def __init__(self, cfg: LlamaConfig):
    super().__init__()
    self.gate_proj = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
    self.up_proj = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
    self.down_proj = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
  def __init__(self, cfg: LlamaConfig):
    super().__init__()
    self.input_layernorm = nn.RMSNorm(cfg.d_model, eps=cfg.eps)
    self.self_attn = LlamaAttention(cfg)
    self.post_attention_layernorm = nn.RMSNorm(cfg.d_model, eps=cfg.eps)
    self.mlp = LlamaMLP(cfg)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.self_attn(self.input_layernorm(x))
    return x + self.mlp(self.post_attention_layernorm(x))


class TorchLlama(nn.Module):
  """Token ids `[batch, time]` -> logits `[batch, time, vocab]` (HF Llama names, no `model.`)."""

  def __init__(self, cfg: LlamaConfig):
    super().__init__()
    self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
    self.layers = nn.ModuleList([LlamaLayer(cfg) for _ in range(cfg.num_layers)])
    self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.eps)
    self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    for p in self.parameters():
      if p.dim() > 1:
        nn.init.normal_(p, std=0.02)

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    x = self.embed_tokens(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.lm_head(self.norm(x))
