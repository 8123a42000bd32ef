"""Small reference models, the same in PyTorch and Flax NNX, for cross-framework checks.

`gpt` (pre-LN, tanh GELU, learned positions, tied embeddings) and `llama` (RMSNorm,
SwiGLU, rotate-half RoPE, grouped-query attention) hold a config, the Flax NNX model
and tensor-parallel partition specs. Their PyTorch twins live outside the package, in
scripts/torch_twins.py; `ucp_jax.rules.gpt2` / `ucp_jax.rules.llama` map one's parameters
onto the other's.
"""
