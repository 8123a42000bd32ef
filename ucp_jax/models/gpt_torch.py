"""The PyTorch twin of `ucp_jax.models.gpt.FlaxGPT` (imports torch; tests and demos only)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ucp_jax.models.gpt import GPTConfig


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
  """`[batch, time, heads, head_dim]` in and out, as `ucp_jax.models._common.causal_attention`."""
  scores = torch.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(q.shape[-1])
  t = q.shape[1]
  mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=q.device))
  scores = scores.masked_fill(~mask, float("-inf"))
  return torch.einsum("bhqs,bshk->bqhk", scores.softmax(-1), v)


class Attention(nn.Module):
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


class MLP(nn.Module):
  def __init__(self, cfg: GPTConfig):
    super().__init__()
    self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
    self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
  def __init__(self, cfg: GPTConfig):
    super().__init__()
    self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
    self.attn = Attention(cfg)
    self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
    self.mlp = MLP(cfg)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
  """Token ids `[batch, time]` -> logits `[batch, time, vocab]`; `lm_head` is tied to `wte`."""

  def __init__(self, cfg: GPTConfig):
    super().__init__()
    self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
    self.wpe = nn.Embedding(cfg.max_len, cfg.d_model)
    self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
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
