"""What a Megatron export writes, tensor by tensor: from Megatron's names, or from Llama's.

A checkpoint with Megatron's own names (a Megatron source) is written as it is. One with
Hugging Face Llama names (a Hugging Face folder, or a DeepSpeed, DCP or torch checkpoint of a
Llama) is laid out as megatron-core's Llama-style GPT holds it, the inverse of
`sources.megatron._hf_names`: the layers stacked, `q_proj`, `k_proj` and `v_proj` fused per
query group into `linear_qkv`, `gate_proj` and `up_proj` into `linear_fc1` (`[gate; up]`), the
vocabulary padded with zero rows to a multiple of `vocab_multiple` (Megatron-LM's
`make_vocab_size_divisible_by` times the TP size the run loads it with), Adam's moments alike.
Its `args` come from the Llama `config.json`; its param groups are Megatron-LM's default split
(biases and 1-D parameters without weight decay), with the source's first group's
hyperparameters.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.sinks import _resolved
from ucp_jax.store import _checkpoint

LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
MEGATRON_MARKERS = ("decoder.layers.", "embedding.word_embeddings.weight")
IDENTIFIERS = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}


@dataclasses.dataclass(frozen=True)
class MegatronTensor:
  """One model tensor as Megatron saves it, and how to read it and its moments.

  `read(kind)` gives the array: `value` (the fp32 master where the checkpoint has one) or a
  slot's name (`exp_avg`, `exp_avg_sq`).
  """

  name: str
  shape: tuple[int, ...]
  read: Callable[[str], np.ndarray]
  slots: tuple[str, ...]
  group: int | None
  nbytes: int


def as_saved(
  ckpt: _checkpoint.Checkpoint,
  weights: _resolved.ResolvedWeights,
  state: _resolved.ResolvedState | None,
) -> list[MegatronTensor]:
  """A checkpoint with Megatron's names: each parameter as it is."""
  trainable = {p.name: p for p in state.trainable} if state is not None else {}
  out = []
  for p in weights.params:
    keys = {"value": p.value, **(trainable[p.name].slots if p.name in trainable else {})}
    nbytes = sum(ckpt[k].nbytes for k in keys.values())
    out.append(MegatronTensor(p.name, tuple(p.shape), _reader(ckpt, keys), tuple(keys)[1:],
                              p.group, nbytes))  # fmt: skip
  return out


def is_megatron(names: list[str]) -> bool:
  return any(n.startswith(MEGATRON_MARKERS) for n in names)


def from_llama(
  ckpt: _checkpoint.Checkpoint,
  weights: _resolved.ResolvedWeights,
  state: _resolved.ResolvedState | None,
  config: dict,
  vocab_multiple: int,
) -> tuple[list[MegatronTensor], dict, list[dict] | None]:
  """A Llama under Hugging Face names, laid out as Megatron's GPT: (tensors, args, groups).

  Raises:
    MappingError: names or a config that are not a Llama's (every problem listed).
  """
  where = str(ckpt.location)
  groups_kv, layers, vocab = _llama_sizes(config, where)
  trainable = {p.name: p for p in state.trainable} if state is not None else {}
  params = {p.name: p for p in weights.params}
  problems: list[str] = []

  def keys(name: str) -> dict[str, str]:
    p = params.get(name)
    if p is None:
      problems.append(f"no `{name}`")
      return {}
    return {"value": p.value, **(trainable[name].slots if name in trainable else {})}

  per_layer: dict[str, list[str]] = {}
  for name in params:
    found = LAYER.match(name)
    if found is None and name not in ("model.embed_tokens.weight", "model.norm.weight",
                                      "lm_head.weight"):  # fmt: skip
      problems.append(f"`{name}` has no Megatron counterpart")
    elif found is not None:
      per_layer.setdefault(found.group(2), []).append(name)

  def fused_qkv(parts: list[np.ndarray]) -> np.ndarray:
    q, k, v = (a.reshape(groups_kv, -1, a.shape[-1]) for a in parts)
    return np.concatenate([q, k, v], axis=1).reshape(-1, q.shape[-1])

  layout = [  # Megatron name, Hugging Face names per layer (in order), how they combine
    ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", ["input_layernorm.weight"], None),
    ("decoder.layers.self_attention.linear_qkv.weight",
     ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"], fused_qkv),
    ("decoder.layers.self_attention.linear_proj.weight", ["self_attn.o_proj.weight"], None),
    ("decoder.layers.mlp.linear_fc1.layer_norm_weight", ["post_attention_layernorm.weight"], None),
    ("decoder.layers.mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
     lambda parts: np.concatenate(parts, axis=0)),
    ("decoder.layers.mlp.linear_fc2.weight", ["mlp.down_proj.weight"], None),
  ]  # fmt: skip
  padded = -(-vocab // vocab_multiple) * vocab_multiple
  out: list[MegatronTensor] = []
  embed = keys("model.embed_tokens.weight")
  if embed:
    out.append(_padded("embedding.word_embeddings.weight", ckpt, embed, padded, params))
  for megatron, suffixes, combine in layout:
    names = [[f"model.layers.{i}.{s}" for s in suffixes] for i in range(layers)]
    parts = [[keys(n) for n in row] for row in names]
    if all(all(row) for row in parts):
      out.append(_stacked(megatron, ckpt, parts, combine, params[names[0][0]].group))
  norm = keys("model.norm.weight")
  if norm:
    out.append(MegatronTensor("decoder.final_layernorm.weight", tuple(ckpt[norm["value"]].shape),
                              _reader(ckpt, norm), tuple(norm)[1:],
                              params["model.norm.weight"].group, _nbytes(ckpt, [norm])))  # fmt: skip
  head = keys("lm_head.weight") if "lm_head.weight" in params else embed
  if head:
    out.append(_padded("output_layer.weight", ckpt, head, padded, params, "lm_head.weight"))
  expected = {s for _, row, _ in layout for s in row}
  extra = sorted(set(per_layer) - expected)
  if extra:
    problems.append(f"layer parameters with no Megatron counterpart: {', '.join(extra)}")
  if problems:
    more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
    raise _errors.MappingError(
      f"{where}: not a Llama that Megatron's GPT holds: " + "; ".join(problems[:8]) + more
    )
  if state is not None:  # Megatron-LM's own grouping, which its optimizer loads by
    out = [dataclasses.replace(t, group=group_of(t.name, t.shape)) for t in out]
  return out, megatron_args(config, padded, vocab_multiple), _groups(state)


def _llama_sizes(config: dict, where: str) -> tuple[int, int, int]:
  """(key/value heads, layers, vocabulary) of a Llama config, or what makes it no Llama."""
  problems = []
  if config.get("model_type") != "llama":
    problems.append(f"model_type {config.get('model_type')!r}, not llama")
  for key in ("attention_bias", "mlp_bias"):
    if config.get(key):
      problems.append(f"{key} true (Megatron's GPT here has no biases)")
  if config.get("hidden_act", "silu") != "silu":
    problems.append(f"hidden_act {config.get('hidden_act')!r} (SwiGLU needs silu)")
  fields = ("num_attention_heads", "num_hidden_layers", "vocab_size", "hidden_size",
            "intermediate_size")  # fmt: skip
  sizes = [v for v in (config.get(k) for k in fields) if isinstance(v, int) and v > 0]
  if len(sizes) != len(fields):
    problems.append("no head, layer, vocabulary, hidden or MLP size")
  if problems:
    raise _errors.MappingError(f"{where}: the config is not a Llama's: " + "; ".join(problems))
  heads, layers, vocab = sizes[:3]
  groups = config.get("num_key_value_heads") or heads
  if not isinstance(groups, int) or heads % groups:
    raise _errors.MappingError(f"{where}: {heads} heads in {groups!r} key/value groups")
  return groups, layers, vocab


def megatron_args(config: dict, padded: int, vocab_multiple: int) -> dict:
  """Megatron-LM's `args` fields for the Llama `config`."""
  heads = config["num_attention_heads"]
  groups = config.get("num_key_value_heads") or heads
  return {
    "num_layers": config["num_hidden_layers"],
    "hidden_size": config["hidden_size"],
    "ffn_hidden_size": config["intermediate_size"],
    "num_attention_heads": heads,
    "group_query_attention": groups != heads,
    "num_query_groups": groups,
    "kv_channels": config.get("head_dim") or config["hidden_size"] // heads,
    "max_position_embeddings": config.get("max_position_embeddings"),
    "vocab_size": config["vocab_size"],
    "padded_vocab_size": padded,
    "make_vocab_size_divisible_by": vocab_multiple,
    "normalization": "RMSNorm",
    "norm_epsilon": config.get("rms_norm_eps", 1e-6),
    "swiglu": True,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "position_embedding_type": "rope",
    "rotary_base": config.get("rope_theta", 10000.0),
    "rotary_percent": 1.0,
    "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
    "transformer_impl": "local",
  }


def _groups(state: _resolved.ResolvedState | None) -> list[dict] | None:
  """Megatron-LM's two default groups, with the source's first group's hyperparameters."""
  if state is None:
    return None
  first = dict(state.groups[0]) if state.groups else {}
  decay = {**first, **IDENTIFIERS, "wd_mult": 1.0, "default_config": True}
  plain = {**decay, "wd_mult": 0.0, "weight_decay": 0.0}
  return [decay, plain]


def group_of(name: str, shape: tuple[int, ...]) -> int:
  """Megatron-LM's default rule: biases and 1-D parameters (per layer) go without decay."""
  ndim = len(shape) - (1 if name.startswith("decoder.layers.") else 0)
  return 1 if name.endswith(".bias") or ndim == 1 else 0


def _reader(ckpt, keys: dict[str, str]) -> Callable[[str], np.ndarray]:
  return lambda kind: np.asarray(ckpt.read(keys[kind]))


def _nbytes(ckpt, found: list[dict[str, str]]) -> int:
  return sum(ckpt[k].nbytes for row in found for k in row.values())


def _stacked(name, ckpt, found: list[list[dict[str, str]]], combine, group) -> MegatronTensor:
  """Layer by layer, the Hugging Face parts combined, stacked on a leading axis."""
  kinds = tuple(set.intersection(*(set(keys) for row in found for keys in row)))

  def read(kind: str) -> np.ndarray:
    layers = []
    for row in found:
      parts = [np.asarray(ckpt.read(keys[kind])) for keys in row]
      layers.append(parts[0] if combine is None else combine(parts))
    return np.stack(layers)

  first = [ckpt[keys["value"]].shape for keys in found[0]]
  rows = sum(s[0] for s in first)
  shape = (len(found), rows, *first[0][1:])
  slots = tuple(k for k in ("exp_avg", "exp_avg_sq") if k in kinds)
  return MegatronTensor(
    name, shape, read, slots, group, _nbytes(ckpt, [k for r in found for k in r])
  )


def _padded(name, ckpt, keys: dict[str, str], padded: int, params, hf_name=None) -> MegatronTensor:
  """The vocabulary's rows, zeros below to `padded` rows (Megatron-LM's padding)."""
  vocab, hidden = ckpt[keys["value"]].shape

  def read(kind: str) -> np.ndarray:
    array = np.asarray(ckpt.read(keys[kind]))
    out = np.zeros((padded, hidden), array.dtype)
    out[:vocab] = array
    return out

  group = params[hf_name or "model.embed_tokens.weight"].group
  slots = tuple(k for k in keys if k != "value")
  return MegatronTensor(name, (padded, hidden), read, slots, group, _nbytes(ckpt, [keys]))
