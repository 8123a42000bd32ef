"""Phi-3 (fused qkv and gate_up, longrope, partial rotary) on `models.llama.FlaxLlama`."""

from __future__ import annotations

from collections.abc import Callable

from ucp_jax.base._errors import shown
from ucp_jax.families._family import llama_shaped
from ucp_jax.mapping import _hf_rulesets as rulesets
from ucp_jax.models import _configs, _hf_rope
from ucp_jax.models import _hf as hf
from ucp_jax.models._hf_reader import Reader


def _phi3(r: Reader, kind: str) -> Callable[[], _configs.LlamaConfig]:
  sizes, common = hf.sizes(r), hf.common(r)
  p = _hf_rope.params(r, partial_key=None)
  key = "partial_rotary_factor"
  p.setdefault(key, _hf_rope.fraction(r, key, r(key)) if r.present(key) else 1.0)
  kind_given = p.get("rope_type", p.get("type", "default"))
  if kind_given in ("su", "yarn"):  # transformers' Phi3Config: their old names of longrope
    p["rope_type"] = "longrope"
  elif kind_given not in ("default", "longrope"):
    r.problem(f"rope_type {shown(kind_given)}: Phi-3 runs default and longrope only")
  theta, scaling, factor = _hf_rope.read(r, p, head_dim=sizes["head_dim"], partial=True)
  rope = {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary": factor}
  extra = {"sliding_window": r.optional_size("sliding_window")}
  return hf.make(sizes, common, rope, extra)


FAMILIES = (
  llama_shaped(
    "phi3",
    hf.defaults((32064, 3072, 8192, 32, 32, None), hidden_act="silu")
    | {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096}
    | {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None},
    _phi3,
    rules=rulesets.fused_llama_like,
  ),
)
