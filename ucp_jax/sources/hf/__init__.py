"""Hugging Face checkpoints: safetensors files, sharded folders, `config.json`.

What the Hugging Face sink shares with this source (the safetensors format's names, and
reading a `config.json` within its limits) is public here; the rest is private.
"""

from ucp_jax.sources.hf._safetensors import NAMES as DTYPE_NAMES
from ucp_jax.sources.hf._shard_index import INDEX_SUFFIX as INDEX_SUFFIX
from ucp_jax.sources.hf._source import MAX_CONFIG_BYTES as MAX_CONFIG_BYTES
from ucp_jax.sources.hf._source import parse_config as parse_config

__all__ = ["DTYPE_NAMES", "INDEX_SUFFIX", "MAX_CONFIG_BYTES", "parse_config"]
