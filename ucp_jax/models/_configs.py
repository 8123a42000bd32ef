"""The reference models' configs: plain frozen dataclasses that import neither JAX nor Flax.

`ucp_jax.rules.from_hf` reads Hugging Face configs into them and the rule sets take their
sizes, so converting, exporting and diffing checkpoints never imports JAX; the Flax models
(`gpt`, `llama`, `neox`, `moe`) take them, and re-export them under their usual names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from ucp_jax.base import _errors

ACTIVATION_NAMES = (
  "silu",
  "gelu_tanh",
  "gelu",
  "quick_gelu",
  "relu",
  "relu2",
  "relu6",
  "tanh",
  "sigmoid",
)
"""The MLP activations a config may name (`ucp_jax.models._common.ACTIVATIONS` runs them:
`gelu_tanh` is Hugging Face's `gelu_new`, `gelu_pytorch_tanh`, `gelu_fast` and
`gelu_accurate`; `gelu` is the exact, erf one)."""


def check_activation(name: str) -> None:
  if name not in ACTIVATION_NAMES:
    raise _errors.InvalidArgumentError(
      f"activation {name!r} is not one of {', '.join(ACTIVATION_NAMES)}"
    )


SCALINGS = {
  "linear": ("factor",),
  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
  "dynamic": ("factor", "max_position_embeddings"),
  "yarn": (
    "factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "original_max_position_embeddings",
    "truncate",
  ),
  "longrope": (
    "short_factor",
    "long_factor",
    "attention_factor",
    "original_max_position_embeddings",
  ),
}
"""The RoPE scalings the reference models run (Hugging Face's `rope_type`) and their numbers."""


def frozen(scaling: Any) -> tuple | None:
  """`scaling` as a sorted tuple of pairs (lists as tuples), so a config holding it hashes."""
  if scaling is None:
    return None
  items = dict(scaling).items()
  return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in items))


def check(scaling: Any, rot_dim: int, where: str = "rope_scaling") -> None:
  """Raises `InvalidArgumentError` for a scaling `tables` cannot compute."""
  if scaling is None:
    return
  scaling = dict(scaling)
  needs = SCALINGS.get(scaling.get("rope_type"))
  missing = [k for k in needs or () if k not in scaling]
  if needs is None or missing:
    raise _errors.InvalidArgumentError(
      f"{where} {scaling}: runs rope_type {', '.join(SCALINGS)}"
      + (f"; missing {', '.join(missing)}" if missing else "")
    )
  if scaling["rope_type"] == "longrope":
    for key in ("short_factor", "long_factor"):
      if len(scaling[key]) != rot_dim // 2:
        raise _errors.InvalidArgumentError(
          f"{where}: longrope's {key} has {len(scaling[key])} numbers; the rotary dimension "
          f"{rot_dim} needs {rot_dim // 2}"
        )


ROPE_SCALING = SCALINGS
"""RoPE scalings `FlaxLlama` runs (as Hugging Face's `rope_type`) and the numbers each needs."""

LAYER_TYPES = ("full_attention", "sliding_attention")
NORMS = ("pre", "sandwich", "post")
QK_NORMS = ("none", "head", "all")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The sizes and options of a `FlaxLlama` (the defaults: the repo's plain reference Llama).

  Attributes:
    head_dim: per-head width; None means `d_model // num_heads` (filled in at construction,
      so `dataclasses.replace` keeps it: pass `head_dim=None` again with new sizes).
    hidden: the MLP's width.
    eps: the RMSNorms' epsilon.
    rope_scaling: None, or `{"rope_type": ..., ...}` with the numbers `ROPE_SCALING` names
      (held as a sorted tuple of pairs, so the config stays hashable).
    qkv_bias: biases on the query, key and value projections (Qwen2).
    o_bias: a bias on the output projection (Llama's `attention_bias` sets both).
    mlp_bias: biases on the MLP's projections.
    qk_norm: RMSNorms on the queries and keys before RoPE: `"head"` over each head (Qwen3,
      Gemma 3), `"all"` over the whole projection (OLMo 2), `"none"`; True means `"head"`.
    tie_embeddings: the output layer is `embed` (`embed.attend`), not an `lm_head`.
    act: the gate's activation, a key of `ucp_jax.models._common.ACTIVATIONS`.
    norm_offset: every RMSNorm's gain is `norm_offset + scale` (Gemma: 1.0).
    embed_scale: embeddings are multiplied by `sqrt(d_model)` (Gemma).
    sliding_window: each position of a sliding layer attends to its last `sliding_window`
      positions (Mistral: every layer).
    layer_types: `"sliding_attention"` or `"full_attention"` per layer; None: every layer
      slides when `sliding_window` is set.
    partial_rotary: the fraction of each head RoPE rotates (the first `rot_dim` features).
    local_rope_theta: RoPE's base on sliding layers (Gemma 3); None: `rope_theta`.
    local_rope_scaling: RoPE's scaling on sliding layers when `local_rope_theta` is set.
    norms: `"pre"` (a norm before attention and MLP), `"sandwich"` (and after each: Gemma 2
      and 3) or `"post"` (after each only: OLMo 2).
    query_scale: the attention scores are scaled by `query_scale ** -0.5` (Gemma 2's
      `query_pre_attn_scalar`); None: `head_dim ** -0.5`.
    attn_softcap: scores become `cap * tanh(scores / cap)` (Gemma 2).
    final_softcap: the logits likewise (Gemma 2 and 3).
  """

  vocab_size: int = 256
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  d_model: int = 64
  hidden: int = 128
  rope_theta: float = 10000.0
  eps: float = 1e-5
  head_dim: int | None = None
  rope_scaling: Any = None
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: Literal["none", "head", "all"] | bool = "none"
  tie_embeddings: bool = False
  act: str = "silu"
  norm_offset: float = 0.0
  embed_scale: bool = False
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  partial_rotary: float = 1.0
  local_rope_theta: float | None = None
  local_rope_scaling: Any = None
  norms: Literal["pre", "sandwich", "post"] = "pre"
  query_scale: float | None = None
  attn_softcap: float | None = None
  final_softcap: float | None = None

  def __post_init__(self):
    check_activation(self.act)
    if self.head_dim is None:
      object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
    if isinstance(self.qk_norm, bool):
      object.__setattr__(self, "qk_norm", "head" if self.qk_norm else "none")
    for name in ("rope_scaling", "local_rope_scaling"):
      object.__setattr__(self, name, frozen(getattr(self, name)))
      check(getattr(self, name), self.rot_dim, name)
    if self.layer_types is not None:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    problems = [
      f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}"
      for name, allowed in (("norms", NORMS), ("qk_norm", QK_NORMS))
      if getattr(self, name) not in allowed
    ]
    if self.layer_types is not None and (
      len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES)
    ):
      problems.append(f"layer_types: {self.num_layers} of {', '.join(LAYER_TYPES)}")
    if problems:
      raise _errors.InvalidArgumentError("LlamaConfig: " + "; ".join(problems))

  @property
  def rot_dim(self) -> int:
    """The features of each head RoPE rotates."""
    assert self.head_dim is not None  # filled in at construction
    return int(self.head_dim * self.partial_rotary)

  def sliding(self, layer: int) -> bool:
    """Whether layer `layer` attends through the sliding window."""
    if self.sliding_window is None:
      return False
    return self.layer_types is None or self.layer_types[layer] == "sliding_attention"


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """The sizes of a `FlaxGPT`.

  Attributes:
    hidden: the MLP's width; None means `4 * d_model` (filled in at construction, so
      `dataclasses.replace` keeps it: pass `hidden=None` again with a new `d_model`).
    act: the MLP's activation, a key of `ucp_jax.models._common.ACTIVATIONS`.
    tie_embeddings: the output layer is `wte` (GPT-2), or its own `lm_head` without bias.
  """

  vocab_size: int = 256
  max_len: int = 64
  num_layers: int = 2
  num_heads: int = 4
  d_model: int = 64
  eps: float = 1e-5
  hidden: int | None = None
  act: str = "gelu_tanh"
  tie_embeddings: bool = True

  def __post_init__(self):
    check_activation(self.act)
    if self.hidden is None:
      object.__setattr__(self, "hidden", 4 * self.d_model)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


@dataclasses.dataclass(frozen=True)
class NeoXConfig:
  """The sizes and options of a `FlaxNeoX`.

  Attributes:
    hidden: the MLP's width.
    eps: the LayerNorms' epsilon.
    act: the MLP's activation, a key of `ucp_jax.models._common.ACTIVATIONS`.
    rope_scaling: as `LlamaConfig.rope_scaling` (`ucp_jax.models._rope`).
    partial_rotary: the fraction of each head RoPE rotates (`rotary_pct`).
    parallel_residual: `x + attn(ln1(x)) + mlp(ln2(x))`; else the two in sequence.
    attention_bias: biases on the fused query/key/value and output projections.
    tie_embeddings: the output layer is `embed`, not an `lm_head`.
  """

  vocab_size: int = 256
  num_layers: int = 2
  num_heads: int = 4
  d_model: int = 64
  hidden: int = 256
  eps: float = 1e-5
  act: str = "gelu"
  rope_theta: float = 10000.0
  rope_scaling: Any = None
  partial_rotary: float = 0.25
  parallel_residual: bool = True
  attention_bias: bool = True
  tie_embeddings: bool = False

  def __post_init__(self):
    check_activation(self.act)
    object.__setattr__(self, "rope_scaling", frozen(self.rope_scaling))
    check(self.rope_scaling, self.rot_dim)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def rot_dim(self) -> int:
    return int(self.head_dim * self.partial_rotary)


@dataclasses.dataclass(frozen=True)
class MoeConfig(LlamaConfig):
  """A `LlamaConfig` with sparse mixture-of-experts MLPs.

  Attributes:
    num_experts: experts per sparse layer.
    top_k: experts each token is routed to.
    expert_hidden: each expert's hidden width (`hidden` is the dense layers' width).
    norm_topk_prob: the top-k probabilities are renormalized to sum to 1.
    shared_hidden: width of a shared expert every token goes through (0: none).
    shared_gate: the shared expert's output is scaled by `sigmoid(x @ shared_gate)`.
    dense_layers: layers with a dense MLP of width `hidden` instead of experts.
  """

  num_experts: int = 4
  top_k: int = 2
  expert_hidden: int = 64
  norm_topk_prob: bool = True
  shared_hidden: int = 0
  shared_gate: bool = False
  dense_layers: tuple[int, ...] = ()

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))
    problems = []
    if not 0 < self.top_k <= self.num_experts:
      problems.append(f"top_k {self.top_k} of {self.num_experts} experts")
    if any(not 0 <= i < self.num_layers for i in self.dense_layers):
      problems.append(f"dense_layers {list(self.dense_layers)} of {self.num_layers} layers")
    if self.shared_gate and not self.shared_hidden:
      problems.append("a shared_gate without a shared expert")
    if problems:
      raise _errors.InvalidArgumentError("MoeConfig: " + "; ".join(problems))

  def sparse(self, layer: int) -> bool:
    """Whether layer `layer` has experts (else a dense MLP)."""
    return layer not in self.dense_layers


Config = GPTConfig | LlamaConfig | NeoXConfig | MoeConfig
"""A config of any reference model (`ucp_jax.models.build` takes each)."""
