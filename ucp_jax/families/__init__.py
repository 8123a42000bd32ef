"""Model families: one record per Hugging Face `model_type` (`Family`), in one registry.

`config_from_hf(config)` reads a `config.json` into the reference Flax model's config, as
`transformers` reads it for its `model_type`; `rules_for(model_type, cfg, ...)` gives the
rule set between its `transformers` names and the Flax model; `ucp_jax.rules.from_hf` does
both. A module per family holds its records (`gpt2`, `llama`, `mistral`, `qwen`, `gemma`,
`phi3`, `olmo2`, `gpt_neox`, `mixtral`, `qwen_moe`), loaded on first use. docs/mapping.md
shows how to add one.
"""

from ucp_jax.families._family import BUILTIN as BUILTIN
from ucp_jax.families._family import REFUSED as REFUSED
from ucp_jax.families._family import Family as Family
from ucp_jax.families._family import config_from_hf as config_from_hf
from ucp_jax.families._family import get as get
from ucp_jax.families._family import ready as ready
from ucp_jax.families._family import rules_for as rules_for

__all__ = ["BUILTIN", "REFUSED", "Family", "config_from_hf", "get", "ready", "rules_for"]
