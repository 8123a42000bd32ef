"""A Megatron GPT under Hugging Face Llama's names and layouts, read in place.

megatron-core's Llama-style GPT (RMSNorm, SwiGLU, RoPE, GQA, no biases) is a Hugging Face
`LlamaForCausalLM` in another layout. Per layer `i` of the stacked `decoder.layers.*`:

| Megatron (layer `i` of the stack) | Hugging Face |
|---|---|
| `self_attention.linear_qkv.layer_norm_weight` (or `input_layernorm.weight`) | `model.layers.{i}.input_layernorm.weight` |
| `self_attention.linear_qkv.weight`: for each query group `[q_g; k_g; v_g]` | `self_attn.{q,k,v}_proj.weight` |
| `self_attention.linear_proj.weight` | `self_attn.o_proj.weight` |
| `mlp.linear_fc1.layer_norm_weight` (or `pre_mlp_layernorm.weight`) | `post_attention_layernorm.weight` |
| `mlp.linear_fc1.weight`: `[gate; up]` | `mlp.gate_proj.weight`, `mlp.up_proj.weight` |
| `mlp.linear_fc2.weight` | `mlp.down_proj.weight` |

and `embedding.word_embeddings.weight` / `output_layer.weight` (their padded rows dropped:
`args.vocab_size` of `args.padded_vocab_size`) and `decoder.final_layernorm.weight` become
`model.embed_tokens.weight`, `lm_head.weight` and `model.norm.weight`. Megatron's rotary
embedding (not interleaved) is Llama's rotate-half, so no row is permuted. The optimizer's
moments map as their parameters do. Every array is a view: a region reads only the rows of
the Megatron tensor under it.
"""

from __future__ import annotations

import math

import numpy as np

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources._source_plan import SourceParam
from ucp_jax.sources.megatron._readable import Readable

LAYER = "decoder.layers."
ALIASES = {  # per-layer Megatron names (TransformerEngine's, then the local spec's) -> role
  "self_attention.linear_qkv.layer_norm_weight": "input_norm",
  "input_layernorm.weight": "input_norm",
  "self_attention.linear_qkv.weight": "qkv",
  "self_attention.linear_proj.weight": "o_proj",
  "mlp.linear_fc1.layer_norm_weight": "post_norm",
  "pre_mlp_layernorm.weight": "post_norm",
  "mlp.linear_fc1.weight": "fc1",
  "mlp.linear_fc2.weight": "down_proj",
}
TOP = {
  "embedding.word_embeddings.weight": "model.embed_tokens.weight",
  "decoder.final_layernorm.weight": "model.norm.weight",
  "output_layer.weight": "lm_head.weight",
}
Segments = list[tuple[int, int, int]]  # (source row, rows, target row)


def params(
  arrays: dict[str, dict[str, Readable]],
  groups: dict[str, int | None],
  args: dict,
  where: str,
  padded_vocab: bool = False,
) -> tuple[list[SourceParam], dict]:
  """The parameters (value and slots per name) under Hugging Face names, and `config.json`.

  With `padded_vocab`, the vocabulary keeps Megatron's padded rows (and the config says so):
  what training on needs to compute Megatron's loss exactly, whose softmax spans them.

  Raises:
    SourceFormatError: a model that is not a Llama-style GPT (what differs is listed).
  """
  config = llama_config(args, where)
  if padded_vocab:
    rows = arrays.get("embedding.word_embeddings.weight", {}).get("value")
    config["vocab_size"] = rows.shape[0] if rows is not None else config["vocab_size"]
  heads, groups_kv = config["num_attention_heads"], config["num_key_value_heads"]
  head_dim, ffn, vocab = config["head_dim"], config["intermediate_size"], config["vocab_size"]
  per_group = heads // groups_kv
  roles: dict[str, str] = {}
  unknown = []
  for name in arrays:
    if name.startswith(LAYER) and name[len(LAYER) :] in ALIASES:
      roles[ALIASES[name[len(LAYER) :]]] = name
    elif name not in TOP:
      unknown.append(name)
  missing = {"input_norm", "qkv", "o_proj", "post_norm", "fc1", "down_proj"} - set(roles)
  if unknown or missing:
    what = [f"names with no Llama counterpart: {', '.join(sorted(unknown))}"] if unknown else []
    what += [f"no {', '.join(sorted(missing))} in its layers"] if missing else []
    raise SourceFormatError(f"{where}: not a Llama-style Megatron GPT ({'; '.join(what)})")

  def qkv(part: int) -> Segments:  # q, k or v rows of each query group
    block = (per_group + 2) * head_dim
    start = [0, per_group * head_dim, (per_group + 1) * head_dim][part]
    rows = per_group * head_dim if part == 0 else head_dim
    return [(g * block + start, rows, g * rows) for g in range(groups_kv)]

  per_layer = [  # (role, HF name under model.layers.{i}., rows of the Megatron layer)
    ("input_norm", "input_layernorm.weight", None),
    ("qkv", "self_attn.q_proj.weight", qkv(0)),
    ("qkv", "self_attn.k_proj.weight", qkv(1)),
    ("qkv", "self_attn.v_proj.weight", qkv(2)),
    ("o_proj", "self_attn.o_proj.weight", None),
    ("post_norm", "post_attention_layernorm.weight", None),
    ("fc1", "mlp.gate_proj.weight", [(0, ffn, 0)]),
    ("fc1", "mlp.up_proj.weight", [(ffn, ffn, 0)]),
    ("down_proj", "mlp.down_proj.weight", None),
  ]
  layers = arrays[roles["qkv"]]["value"].shape[0]
  out = [_param("model.embed_tokens.weight", arrays, groups, "embedding.word_embeddings.weight",
                None, [(0, vocab, 0)])]  # fmt: skip
  for i in range(layers):
    for role, hf_name, segments in per_layer:
      out.append(_param(f"model.layers.{i}.{hf_name}", arrays, groups, roles[role], i, segments))
  out.append(_param("model.norm.weight", arrays, groups, "decoder.final_layernorm.weight"))
  if "output_layer.weight" in arrays:
    out.append(_param("lm_head.weight", arrays, groups, "output_layer.weight", None,
                      [(0, vocab, 0)]))  # fmt: skip
  return out, config


def llama_config(args: dict, where: str) -> dict:
  """The Hugging Face `LlamaConfig` of the GPT that Megatron-LM's `args` describe.

  Raises:
    SourceFormatError: the args describe another model (each difference named).
  """
  problems = []
  wanted = {
    "swiglu": True,
    "normalization": "RMSNorm",
    "position_embedding_type": "rope",
    "add_bias_linear": False,
    "add_qkv_bias": False,
  }
  for key, value in wanted.items():
    if args.get(key, value) != value:
      problems.append(f"{key} {args.get(key)!r} (Llama: {value!r})")
  if args.get("rotary_percent", 1.0) != 1.0 or args.get("qk_layernorm"):
    problems.append("partial rotary or qk layernorm")
  if args.get("num_experts"):
    problems.append(f"{args['num_experts']} experts")
  needed = ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size")
  absent = [k for k in needed if not isinstance(args.get(k), int)]
  if absent:
    problems.append(f"no args.{', args.'.join(absent)}")
  if problems:
    raise SourceFormatError(
      f"{where}: not read under Hugging Face Llama names: {'; '.join(problems)}"
    )
  heads = args["num_attention_heads"]
  groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
  hidden = args["hidden_size"]
  vocab = args.get("vocab_size") or args.get("padded_vocab_size")
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": hidden,
    "intermediate_size": args["ffn_hidden_size"],
    "num_hidden_layers": args["num_layers"],
    "num_attention_heads": heads,
    "num_key_value_heads": groups or heads,
    "head_dim": args.get("kv_channels") or hidden // heads,
    "hidden_act": "silu",
    "rms_norm_eps": args.get("norm_epsilon", 1e-5),
    "rope_theta": float(args.get("rotary_base", 10000)),
    "max_position_embeddings": args.get("max_position_embeddings") or args.get("seq_length"),
    "vocab_size": vocab,
    "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
    "attention_bias": False,
    "mlp_bias": False,
  }


def _param(
  hf_name: str,
  arrays: dict[str, dict[str, Readable]],
  groups: dict[str, int | None],
  name: str,
  layer: int | None = None,
  segments: Segments | None = None,
) -> SourceParam:
  views = {
    kind: _rows(a, layer, segments, f"{hf_name} from {name}") for kind, a in arrays[name].items()
  }
  value = views.pop("value")
  return SourceParam(hf_name, value.tensor(), {k: v.tensor() for k, v in views.items()},
                     group=groups.get(name))  # fmt: skip


def _rows(array: Readable, layer: int | None, segments: Segments | None, where: str) -> Readable:
  """Layer `layer` of `array` (None: the whole), keeping the rows `segments` name, in order."""
  inner = array.shape[1:] if layer is not None else array.shape
  if segments is None:
    segments = [(0, inner[0], 0)]
  shape = (sum(n for _, n, _ in segments), *inner[1:])
  head = (slice(layer, layer + 1),) if layer is not None else ()

  def read(region: tuple[slice, ...], out: np.ndarray) -> None:
    rows, rest = region[0], region[1:]
    for source, count, target in segments:
      lo, hi = max(rows.start, target), min(rows.stop, target + count)
      if lo >= hi:
        continue
      part = out[lo - rows.start : hi - rows.start]
      at = source + lo - target
      array.read(
        (*head, slice(at, at + hi - lo), *rest), part.reshape((1,) * len(head) + part.shape)
      )

  if math.prod(shape) and shape[0] > inner[0]:
    raise SourceFormatError(f"{array.where}: {where}: rows {shape[0]} of {inner[0]}")
  return Readable(shape, array.dtype, read, f"{array.where} ({where})")
