"""Small reference models, the same in PyTorch and Flax NNX, for cross-framework checks.

`gpt` (pre-LN, tanh GELU, learned positions, tied embeddings) and `llama` (RMSNorm,
SwiGLU, rotate-half RoPE, grouped-query attention) hold a config, the Flax NNX model
and tensor-parallel partition specs. Their PyTorch twins live outside the package, in
scripts/torch_twins.py; `ucp_jax.rules.gpt2` / `ucp_jax.rules.llama` map one's parameters
onto the other's. With their options they also run Hugging Face GPT-2, Llama, Mistral,
Qwen2, Qwen3 and Gemma checkpoints (`ucp_jax.rules.from_hf`).
"""

from __future__ import annotations

from typing import Any

from ucp_jax.models import gpt, llama


def build(cfg: gpt.GPTConfig | llama.LlamaConfig, *, rngs: Any, scan: bool = False) -> Any:
  """The Flax NNX model for `cfg`: a `gpt.FlaxGPT` or a `llama.FlaxLlama`.

  Example:
    >>> from flax import nnx
    >>> from ucp_jax import models
    >>> type(models.build(models.llama.LlamaConfig(num_layers=1), rngs=nnx.Rngs(0))).__name__
    'FlaxLlama'

  Args:
    cfg: the model config (from `ucp_jax.rules.from_hf`, for instance).
    rngs: the `nnx.Rngs` that initialize the parameters.
    scan: stack the layers into one module run by `nnx.scan` (pair with `stacked=True`
      rules).
  """
  if isinstance(cfg, gpt.GPTConfig):
    return gpt.FlaxGPT(cfg, rngs=rngs, scan=scan)
  return llama.FlaxLlama(cfg, rngs=rngs, scan=scan)
