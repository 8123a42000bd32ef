"""Qwen2-MoE (a gated shared expert, q/k/v biases) and Qwen3-MoE (q/k norms), dense layers
mixed in, on `models.moe.FlaxMoe`."""

from __future__ import annotations

from collections.abc import Callable

from ucp_jax.base._errors import shown
from ucp_jax.families._family import Family
from ucp_jax.mapping import _moe_rulesets as moe_rules
from ucp_jax.models import _configs
from ucp_jax.models import _hf as hf
from ucp_jax.models import _hf_moe as moe
from ucp_jax.models._hf_reader import MAX_SIZE, Reader, is_int

MOE = {"hidden_act": "silu", "tie_word_embeddings": False, "num_experts_per_tok": 2}


def _qwen_moe(r: Reader, kind: str) -> Callable[[], _configs.MoeConfig]:
  sizes, common = moe.sizes(r), moe.common(r)
  if kind == "qwen2_moe":
    extra = {"qkv_bias": r.flag("qkv_bias")}
    shared = r.size("shared_expert_intermediate_size")
    extra |= {"shared_hidden": shared, "shared_gate": True}
  else:
    bias = r.flag("attention_bias")
    extra = {"qkv_bias": bias, "o_bias": bias, "qk_norm": "head"}
  extra |= moe.experts(r, "num_experts", "num_local_experts")
  extra |= {"expert_hidden": r.size("moe_intermediate_size")}
  extra["norm_topk_prob"] = r.flag("norm_topk_prob")
  extra["dense_layers"] = moe.sparse_layers(r, sizes["num_layers"])
  use = r.flag("use_sliding_window")
  window = r.optional_size("sliding_window") if use else None
  if kind == "qwen3_moe":  # every layer slides when the window is on
    extra |= {"sliding_window": window}
  else:
    threshold = r("max_window_layers")
    if not is_int(threshold, -MAX_SIZE, MAX_SIZE):
      r.problem(f"`max_window_layers`: {shown(threshold)} is not an integer")
      threshold = 0
    extra |= moe.windows(
      r, sizes["num_layers"], window, lambda i: use and bool((i + 1) % 2) and i < threshold
    )
  return moe.make(sizes, common, moe.rope(r, sizes["head_dim"]), extra)


FAMILIES = (
  Family(
    model_type="qwen2_moe",
    defaults=hf.defaults((151936, 2048, 5632, 24, 16, 16))
    | MOE
    | {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "moe_intermediate_size": 1408}
    | {"shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4}
    | {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
    | {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
    | {"layer_types": None, "qkv_bias": True},
    read=_qwen_moe,
    names=("model.", ("embed_tokens.", "layers.")),
    rules=moe_rules.make("qwen2_moe"),
    model="moe.FlaxMoe",
    named_options=moe_rules.named_options,
  ),
  Family(
    model_type="qwen3_moe",
    defaults=hf.defaults((151936, 2048, 6144, 24, 32, 4))
    | MOE
    | {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "moe_intermediate_size": 768}
    | {"num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": False}
    | {"decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False}
    | {"sliding_window": 4096, "attention_bias": False, "head_dim": None},
    read=_qwen_moe,
    names=("model.", ("embed_tokens.", "layers.")),
    rules=moe_rules.make("qwen3_moe"),
    model="moe.FlaxMoe",
    named_options=moe_rules.named_options,
  ),
)
