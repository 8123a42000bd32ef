"""Small reference models, the same in PyTorch and Flax NNX, for cross-framework checks.

`gpt` (pre-LN, tanh GELU, learned positions, tied embeddings), `llama` (RMSNorm, SwiGLU,
rotate-half RoPE, grouped-query attention, and the options that make it Mistral, Qwen2/3,
Gemma 1/2/3, Phi-3 and OLMo 2) and `neox` (GPT-NeoX) hold a config, the Flax NNX model and
the logical axes of its parameters. The PyTorch twins of `gpt` and `llama` live outside the
package, in scripts/torch_twins.py; `ucp_jax.rules.from_hf` reads Hugging Face configs.

`build(cfg, rngs=..., mesh=mesh)` builds a model whose parameters are already sharded: FSDP
over `data`, TP over `model`, EP over `expert`, by logical-axis rules (`AXIS_RULES`) the
caller may override; `ucp_jax.rules.load_into` then fills it, each device reading its slice.
"""

from ucp_jax.store import _lazy

# The Flax models load on first use (PEP 562): the configs (`_configs`) and the Hugging Face
# config reader (`_hf`) import no JAX, so converting and exporting checkpoints never does.
_LAZY = {
  "AXIS_RULES": ("ucp_jax.models._sharding", "AXIS_RULES"),
  "Config": ("ucp_jax.models._configs", "Config"),
  "MODELS": ("ucp_jax.models._build", "MODELS"),
  "build": ("ucp_jax.models._build", "build"),
  "shardings": ("ucp_jax.models._build", "shardings"),
  "gpt": ("ucp_jax.models.gpt", None),
  "llama": ("ucp_jax.models.llama", None),
  "moe": ("ucp_jax.models.moe", None),
  "neox": ("ucp_jax.models.neox", None),
}


__getattr__, __dir__ = _lazy.attributes("ucp_jax.models", globals(), _LAZY)


__all__ = ["AXIS_RULES", "MODELS", "build", "gpt", "llama", "moe", "neox", "shardings"]
