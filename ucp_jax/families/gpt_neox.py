"""GPT-NeoX / Pythia (parallel residual, partial rotary) on `models.neox.FlaxNeoX`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ucp_jax.base._errors import shown
from ucp_jax.families._family import Family
from ucp_jax.mapping import _hf_rulesets as rulesets
from ucp_jax.models import _configs, _hf_rope
from ucp_jax.models import _hf as hf
from ucp_jax.models._hf_reader import Reader


def _gpt_neox(r: Reader, kind: str) -> Callable[[], _configs.NeoXConfig]:
  heads, d = r.size("num_attention_heads"), r.size("hidden_size")
  head_dim = max(1, d // heads)
  r.refuse(d % heads != 0, f"`hidden_size` {d} is not a multiple of {heads} heads")
  given = r("head_dim")
  r.refuse(
    r.present("head_dim") and given is not None and given != head_dim,
    f"`head_dim` {shown(given)} differs from hidden_size // heads (transformers' rotary and "
    "attention widths would disagree)",
  )
  p = _hf_rope.params(r, theta_key="rotary_emb_base", partial_key=None)
  if "partial_rotary_factor" not in p:
    pct = r("rotary_pct")
    p["partial_rotary_factor"] = (
      _hf_rope.fraction(r, "rotary_pct", pct) if r.present("rotary_pct") else 0.25
    )
  theta, scaling, factor = _hf_rope.read(r, p, head_dim=head_dim, partial=True)
  fields: dict[str, Any] = {
    "vocab_size": r.size("vocab_size"),
    "num_layers": r.size("num_hidden_layers"),
    "num_heads": heads,
    "d_model": d,
    "hidden": r.size("intermediate_size"),
    "eps": r.number("layer_norm_eps"),
    "act": r.act("hidden_act"),
    "rope_theta": theta,
    "rope_scaling": scaling,
    "partial_rotary": factor,
    "parallel_residual": r.flag("use_parallel_residual"),
    "attention_bias": r.flag("attention_bias"),
    "tie_embeddings": r.flag("tie_word_embeddings"),
  }
  return lambda: _configs.NeoXConfig(**fields)


FAMILIES = (
  Family(
    model_type="gpt_neox",
    defaults=hf.defaults((50432, 6144, 24576, 44, 64), hidden_act="gelu")
    | {"max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "tie_word_embeddings": False}
    | {"attention_bias": True, "use_parallel_residual": True},
    read=_gpt_neox,
    names=("gpt_neox.", ("embed_in.", "layers.")),
    rules=rulesets.gpt_neox_for,
    model="neox.FlaxNeoX",
    named_options=rulesets.gpt_neox_head,
  ),
)
