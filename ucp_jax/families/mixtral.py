"""Mixtral (top-2 of 8 experts, a sliding window) on `models.moe.FlaxMoe`."""

from __future__ import annotations

from collections.abc import Callable

from ucp_jax.families._family import Family
from ucp_jax.mapping import _moe_rulesets as moe_rules
from ucp_jax.models import _configs
from ucp_jax.models import _hf as hf
from ucp_jax.models import _hf_moe as moe
from ucp_jax.models._hf_reader import Reader

MOE = {"hidden_act": "silu", "tie_word_embeddings": False, "num_experts_per_tok": 2}


def _mixtral(r: Reader, kind: str) -> Callable[[], _configs.MoeConfig]:
  sizes, common = moe.sizes(r), moe.common(r)
  extra = {"sliding_window": r.optional_size("sliding_window"), "norm_topk_prob": True}
  extra |= moe.experts(r, "num_local_experts", "num_experts") | {"expert_hidden": sizes["hidden"]}
  return moe.make(sizes, common, moe.rope(r, sizes["head_dim"]), extra)


FAMILIES = (
  Family(
    model_type="mixtral",
    defaults=hf.defaults((32000, 4096, 14336, 32, 32, 8))
    | MOE
    | {"head_dim": None, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072}
    | {"sliding_window": None, "num_local_experts": 8, "router_jitter_noise": 0.0},
    read=_mixtral,
    names=("model.", ("embed_tokens.", "layers.")),
    rules=moe_rules.make("mixtral"),
    model="moe.FlaxMoe",
    named_options=moe_rules.named_options,
  ),
)
