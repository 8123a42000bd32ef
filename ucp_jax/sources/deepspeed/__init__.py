"""DeepSpeed training checkpoints (ZeRO-1/2/3, BF16 optimizer, TP/PP/EP, universal).

`universal_meta` is public: the DeepSpeed sink writes the same universal files.
"""

from __future__ import annotations

from typing import Any


def universal_meta(pattern: dict | None, name: str) -> dict[str, Any]:
  """The keys DeepSpeed's universal files carry beside `param` for a parameter's TP/PP/EP
  pattern (`_tp.universal_meta`: what `ds_to_universal` writes and DeepSpeed reads)."""
  from ucp_jax.sources.deepspeed import _tp  # on first use: the converters start without it

  return _tp.universal_meta(pattern, name)
