"""The PyTorch twin of `ucp_jax.models.llama.FlaxLlama` (imports torch; tests and demos only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ucp_jax.models.gpt_torch import causal_attention
from ucp_jax.models.llama import LlamaConfig


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
  """As `ucp_jax.models.llama.rope`: `[batch, time, heads, head_dim]`, rotate-half."""
  t, k = x.shape[1], x.shape[-1]
  inv_freq = 1.0 / theta ** (torch.arange(0, k, 2, dtype=torch.float32) / k)
  angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq[None]
  angles = torch.cat([angles, angles], dim=-1)[None, :, None, :]
  x1, x2 = x[..., : k // 2], x[..., k // 2 :]
  return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()


class Attention(nn.Module):
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


class MLP(nn.Module):
  def __init__(self, cfg: LlamaConfig):
    super().__init__()
    self.gate_proj = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
    self.up_proj = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
    self.down_proj = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
  def __init__(self, cfg: LlamaConfig):
    super().__init__()
    self.input_layernorm = nn.RMSNorm(cfg.d_model, eps=cfg.eps)
    self.self_attn = Attention(cfg)
    self.post_attention_layernorm = nn.RMSNorm(cfg.d_model, eps=cfg.eps)
    self.mlp = MLP(cfg)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.self_attn(self.input_layernorm(x))
    return x + self.mlp(self.post_attention_layernorm(x))


class TorchLlama(nn.Module):
  """Token ids `[batch, time]` -> logits `[batch, time, vocab]` (HF Llama names, no `model.`)."""

  def __init__(self, cfg: LlamaConfig):
    super().__init__()
    self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
    self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_layers)])
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
