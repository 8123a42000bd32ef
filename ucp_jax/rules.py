"""The mapping layer: rules that carry source names and layouts to JAX trees and back.

A `Rule` maps source names matching a regex (`h\\.(\\d+)\\.mlp\\.fc\\.weight`) to a
target key template (`blocks/{0}/mlp/fc/kernel`) through per-array transforms;
a `RuleSet` is an ordered list of rules (`+` unites, `then` chains). The same rules
run forward, lazily over a checkpoint (`ucp_jax.restore(path, target,
rules=rules)`: each device reads only its slice) or eagerly on arrays
(`RuleSet.import_arrays`), and backward for export (`RuleSet.export_arrays`).

Transforms:
  transpose(axes=None)      torch `Linear.weight` [out, in] <-> Flax `kernel` [in, out]
  split(axis, sizes)        one axis -> several (a reshape: `[d, h*k] -> [d, h, k]`)
  merge(axis, sizes)        several axes -> one (the inverse of split)
  cast(dtype, source=None)  dtype on import (and back to `source` on export)
  sub_param(axis, sizes, i) one sub-parameter of a fused array (fused again on export)
  stack(group=0, axis=0)    per-layer arrays `h.{i}.w` -> one array with a layer axis

Ready rule sets, for the reference models in `ucp_jax.models`: `gpt2(...)`, `llama(...)`
(their torch twins' names), `hf_gpt2(...)`, `hf_llama(...)`, `hf_gpt_neox(...)`
(`transformers` names: GPT-2; Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3, OLMo 2; GPT-NeoX),
and `from_hf(config)`, which picks the set and builds the Flax model config from a
`config.json`.

Using them: `ucp_jax.restore(..., rules=rs)` (lazy, sharded), `load_into(model, arrays or
checkpoint, rs)` (into a live model), `check_forward(torch_model, flax_model, rs, batch)`
(the proof by outputs that shapes cannot give).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ucp_jax import families
from ucp_jax.base import _errors
from ucp_jax.mapping._check import check_forward as check_forward
from ucp_jax.mapping._hf_rulesets import hf_gpt2 as hf_gpt2
from ucp_jax.mapping._hf_rulesets import hf_gpt_neox as hf_gpt_neox
from ucp_jax.mapping._hf_rulesets import hf_llama as hf_llama
from ucp_jax.mapping._load import load_into as load_into
from ucp_jax.mapping._mapped import MappedCheckpoint as MappedCheckpoint
from ucp_jax.mapping._mapping import RuleSet as RuleSet
from ucp_jax.mapping._moe_rulesets import hf_moe as hf_moe
from ucp_jax.mapping._rule import Rule as Rule
from ucp_jax.mapping._rulesets import gpt2 as gpt2
from ucp_jax.mapping._rulesets import llama as llama
from ucp_jax.mapping._transforms import Cast, Merge, Split, Stack, SubParam, Transpose
from ucp_jax.mapping._transforms import Transform as Transform
from ucp_jax.models import _configs
from ucp_jax.sources.hf import _source as hf_source
from ucp_jax.store import _checkpoint, _reader, _untrusted


def transpose(axes: Sequence[int] | None = None) -> Transform:
  """Permutes axes like `np.transpose` (default: reverses them).

  Args:
    axes: the new order of the axes; None reverses them (torch `[out, in]` <-> `[in, out]`).

  Returns:
    A `Transform` for a `Rule`; export applies the inverse permutation.

  Raises:
    MappingError: when a rule applies it to an array of another rank (raised then, with
      every other unmatched name of the rule set).

  Example:
    >>> from ucp_jax import rules
    >>> rules.transpose().shape((8, 4), "float32")[0]
    (4, 8)
  """
  return Transpose(None if axes is None else tuple(int(a) for a in axes))


def split(axis: int, sizes: Sequence[int]) -> Transform:
  """Splits axis `axis` into `len(sizes)` axes (one size may be -1); inverse: `merge`.

  Args:
    axis: the axis to split.
    sizes: the sizes of the new axes, in order; one may be -1 (the rest of the axis).

  Returns:
    A `Transform` for a `Rule`; export merges the axes again.

  Raises:
    MappingError: when a rule applies it to an axis the sizes do not divide.

  Example:
    >>> from ucp_jax import rules
    >>> rules.split(1, (12, -1)).shape((768, 768), "float32")[0]
    (768, 12, 64)
  """
  return Split(int(axis), tuple(int(s) for s in sizes))


def merge(axis: int, sizes: Sequence[int]) -> Transform:
  """Merges the `len(sizes)` axes from `axis` (sizes as `split`'s) into one; inverse: `split`.

  Args:
    axis: the first of the axes to merge.
    sizes: the sizes of the merged axes (one may be -1), which export splits back into.

  Returns:
    A `Transform` for a `Rule`.

  Raises:
    MappingError: when a rule applies it to axes of other sizes.

  Example:
    >>> from ucp_jax import rules
    >>> rules.merge(1, (12, -1)).shape((768, 12, 64), "float32")[0]
    (768, 768)
  """
  return Merge(int(axis), tuple(int(s) for s in sizes))


def cast(dtype: str | np.dtype, source: str | np.dtype | None = None) -> Transform:
  """Converts to `dtype` on import; export converts back to `source` when given.

  Args:
    dtype: the dtype on the JAX side (a name or a numpy dtype: `"float32"`, `"bfloat16"`).
    source: the dtype to write back on export; None keeps `dtype`.

  Returns:
    A `Transform` for a `Rule`.

  Raises:
    TypeError: `dtype` or `source` is no dtype numpy knows.

  Example:
    >>> from ucp_jax import rules
    >>> rules.cast("float32", "bfloat16").shape((2,), "bfloat16")[1]
    dtype('float32')
  """
  return Cast(np.dtype(dtype).name, None if source is None else np.dtype(source).name)


def sub_param(axis: int, sizes: Sequence[int], index: int) -> Transform:
  """Sub-parameter `index` of a fused array whose axis `axis` holds sub-parameters of
  relative `sizes`, in order; export fuses the sub-parameters of a name back together.

  Several rules may match one name when each takes a different sub-parameter of it; the
  `sub_param` must be a rule's first transform.

  Args:
    axis: the fused axis.
    sizes: the relative sizes of the sub-parameters along it, in order (heads, say).
    index: which sub-parameter this rule takes.

  Returns:
    A `Transform` for a `Rule`.

  Raises:
    MappingError: when a rule applies it to an axis `sizes` do not divide, or not as its
      first transform.

  Example (Phi-3's `qkv_proj`, 4 query heads and 2 key/value heads of width 8):
    >>> from ucp_jax import rules
    >>> rules.sub_param(0, (4, 2, 2), 1).shape((64, 32), "float32")[0]  # the keys' rows
    (16, 32)
  """
  return SubParam(int(axis), tuple(int(s) for s in sizes), int(index))


def stack(group: int = 0, *, axis: int = 0) -> Transform:
  """Stacks the layers numbered by capture group `group` along a new axis `axis`.

  Transforms listed before it apply to each layer, those after it to the stack;
  export unstacks. Layers must be numbered 0..n-1.

  Args:
    group: the regex capture group of the rule that numbers the layers.
    axis: where the new layer axis goes in the stacked array.

  Returns:
    A `Transform` for a `Rule`.

  Raises:
    MappingError: when the rule is applied to layers not numbered 0..n-1, or of
      different shapes or dtypes.

  Example:
    >>> from ucp_jax import rules
    >>> rule = rules.Rule(r"h\\.(\\d+)\\.w", "blocks/w", [rules.transpose(), rules.stack(0)])
    >>> rules.RuleSet([rule]).map_names(["h.0.w", "h.1.w"])
    {'blocks/w': ('h.0.w', 'h.1.w')}
  """
  return Stack(int(group), int(axis))


def from_hf(
  config: Any, *, stacked: bool = False, prefix: str | None = None
) -> tuple[RuleSet, _configs.Config]:
  """The rule set and the Flax model config for a Hugging Face model, from its `config.json`.

  GPT-2 runs on `ucp_jax.models.gpt.FlaxGPT`; Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2,
  Gemma 3 (text), Phi-3 and OLMo 2 on `ucp_jax.models.llama.FlaxLlama`; GPT-NeoX on
  `ucp_jax.models.neox.FlaxNeoX` (`ucp_jax.models.build(cfg, ...)` builds any). Every field
  that decides the computation is read as `transformers` 5 reads it for the `model_type`
  (docs/mapping.md lists them); a config the reference models would compute differently
  is refused, every reason listed.

  Example:
    >>> from ucp_jax import rules
    >>> rs, cfg = rules.from_hf({"model_type": "llama", "vocab_size": 96, "hidden_size": 32,
    ...   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...   "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    >>> cfg.head_dim, cfg.eps, cfg.tie_embeddings
    (8, 1e-05, True)
    >>> rs.map_names(["model.layers.1.mlp.up_proj.weight"])
    {'layers/1/mlp/up/kernel': ('model.layers.1.mlp.up_proj.weight',)}

  Args:
    config: the `config.json` as a dict, a `transformers` config or model, a path to a
      `config.json` or to the folder holding it, or a checkpoint (a path or an opened
      `ucp_jax.Checkpoint`) that recorded the config it was converted from.
    stacked: rules for a model built with `scan=True` (one array per parameter, layers
      stacked in front).
    prefix: what precedes the base model's names (`model.`, `transformer.`, `gpt_neox.`, or
      `""`). Default: read from the weight names when `config` brings them (a folder, a
      checkpoint, a model), else from `architectures` (`...ForCausalLM` and
      `GPT2LMHeadModel`: the prefix; a bare `LlamaModel` or `GPT2Model`: none).

  Returns:
    `(rules, cfg)`: the `RuleSet` between the model's `transformers` names and the Flax
    model's keys, and the Flax config (`GPTConfig`, `LlamaConfig`, `NeoXConfig` or
    `MoeConfig`) that `ucp_jax.models.build` takes.

  Raises:
    MappingError: a model type without a ready rule set, a feature the reference models do
      not compute, a field of the wrong type, a checkpoint that recorded no config.
  """
  hf, names, where = _hf_config(config)
  cfg = families.config_from_hf(hf, where=where)
  rs = families.rules_for(
    hf["model_type"],
    cfg,
    stacked=stacked,
    prefix=prefix,
    names=names,
    architectures=hf.get("architectures"),
  )
  return rs, cfg


def _hf_config(config: Any) -> tuple[dict, list[str] | None, str]:
  """The config as a dict, the weight names where `config` brings them, and where it is from
  (for messages)."""
  if isinstance(config, Mapping):
    return dict(config), None, "config.json"
  if isinstance(config, _checkpoint.Checkpoint):
    names = [k.split("/", 1)[1] for k in config.keys() if k.startswith("params/")]
    return _recorded(config), names, f"{config.location}: the manifest's `source.config`"
  if hasattr(config, "to_dict"):  # a transformers config
    return config.to_dict(), None, "config.json"
  if hasattr(getattr(config, "config", None), "to_dict") and hasattr(config, "state_dict"):
    return config.config.to_dict(), list(config.state_dict()), "config.json"
  if not isinstance(config, (str, os.PathLike)):
    raise _errors.MappingError(f"from_hf: {config!r} is not a config.json, dict or checkpoint")
  path = os.fspath(config)
  if os.path.isdir(path):
    file = os.path.join(path, "config.json")
    if os.path.lexists(file):  # the folder's own: a link may not leave it
      return _read_json(file, inside=path), _names_in(path), file
  elif os.path.lexists(path):  # a file named by the caller: a FIFO or a device is refused
    return _read_json(path), None, path
  return _hf_config(_reader.open(path))


def _recorded(ckpt: _checkpoint.Checkpoint) -> dict:
  config = ckpt.manifest.source.get("config")
  where = f"{ckpt.location}: the manifest's `source.config`"
  if isinstance(config, str):
    config = hf_source.parse_config(config, where, _errors.MappingError)
  if not isinstance(config, Mapping):
    raise _errors.MappingError(
      f"{ckpt.location}: the checkpoint recorded no Hugging Face config.json; pass the "
      "config.json (or its folder) to from_hf"
    )
  return dict(config)


def _read_json(path: str, inside: str | None = None) -> dict:
  """A `config.json` file, checked as every reader checks untrusted metadata."""
  try:
    with _untrusted.open_regular(path, _errors.MappingError, inside=inside) as f:
      raw = f.read(hf_source.MAX_CONFIG_BYTES + 1)
  except OSError as e:
    raise _errors.MappingError(f"{path}: not a readable config.json ({e.strerror or e})") from None
  if len(raw) > hf_source.MAX_CONFIG_BYTES:
    raise _errors.MappingError(f"{path}: larger than {hf_source.MAX_CONFIG_BYTES} bytes")
  return hf_source.parse_config(raw, path, _errors.MappingError)


def _names_in(folder: str) -> list[str] | None:
  """The weight names of a Hugging Face folder, where a source reads it (else None)."""
  try:
    ckpt = _reader.open(folder)
  except (_errors.UcpError, OSError):
    return None
  return [k.split("/", 1)[1] for k in ckpt.keys() if k.startswith("params/")]


__all__ = [
  "MappedCheckpoint",
  "Rule",
  "RuleSet",
  "Transform",
  "cast",
  "check_forward",
  "from_hf",
  "gpt2",
  "hf_gpt2",
  "hf_gpt_neox",
  "hf_llama",
  "hf_moe",
  "llama",
  "load_into",
  "merge",
  "split",
  "stack",
  "sub_param",
  "transpose",
]
