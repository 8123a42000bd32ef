"""What the tests of Hugging Face families share: tiny config sizes and weights off their init.

Importable without torch (it is imported where a model is touched).
"""

from __future__ import annotations

SIZES = dict(
  vocab_size=96,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  bos_token_id=0,
  eos_token_id=0,
)
"""A tiny decoder's `config.json` sizes (grouped-query: 2 key/value heads for 4 query heads)."""


def off_init(model):
  """`model` in eval mode, its matrices 5 times larger and its norms and biases moved off
  their 1 / 0 init (torch's global generator), so that a mix-up of layouts shows."""
  import torch

  with torch.no_grad():
    for p in model.parameters():
      if p.dim() == 1:
        p.add_(0.1 * torch.randn_like(p))
      else:
        p.mul_(5.0)
  return model.eval()
