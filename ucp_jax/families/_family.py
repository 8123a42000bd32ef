"""A model family as one record, and the registry of them by `model_type`.

A `Family` says everything ucp_jax knows of a Hugging Face `model_type`: its `transformers`
config class's defaults, the reader that turns a `config.json` into the reference Flax
model's config (every field that decides the computation, problems collected), the names'
layout in a `...ForCausalLM` checkpoint, and the rule set between those names and the Flax
model's keys. The built-in families are listed here by module and imported on first use;
each module holds the records of one family (`FAMILIES`). Adding a family is one record.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from ucp_jax.base import _errors
from ucp_jax.base._errors import shown
from ucp_jax.models._hf_reader import Reader


@dataclasses.dataclass(frozen=True)
class Family:
  """One `model_type`: how its `config.json` reads, and how its weights map.

  Attributes:
    model_type: the `model_type` of its `config.json`.
    defaults: its `transformers` 5.24 config class's default of every field read (a field a
      class lacks is still read from the file when there).
    read: `read(reader, model_type)` reads every field (problems collected in the `Reader`)
      and returns a function making the Flax config.
    names: (the names' prefix in a `...ForCausalLM` checkpoint, the base model's first names
      without it): tells a bare base model's weights from a causal LM's.
    rules: `rules(flax_config, stacked=, prefix=, **options)`, the `RuleSet` between the
      `transformers` names and the Flax model's keys.
    model: the Flax model class that runs it, below `ucp_jax.models` (`models.build` picks
      it from the config's class).
    named_options: `named_options(weight_names)`: rule-set options the weight names decide
      (a MoE's expert layout, a head's name), or None.
  """

  model_type: str
  defaults: Mapping[str, Any]
  read: Callable[[Reader, str], Callable[[], Any]]
  names: tuple[str, tuple[str, ...]]
  rules: Callable[..., Any]
  model: str
  named_options: Callable[[list[str] | None], dict[str, Any]] | None = None


LLAMA_NAMES = ("model.", ("embed_tokens.", "layers."))
"""The names' layout of Llama-shaped checkpoints (`model.layers.{i}...`, `model.embed_tokens`)."""


def llama_shaped(model_type: str, defaults: Mapping[str, Any], read, **fields: Any) -> Family:
  """The record of a family with Llama's names on `models.llama.FlaxLlama` (its rule set
  `mapping._hf_rulesets.llama_like` unless `rules=` says otherwise)."""
  from ucp_jax.mapping import _hf_rulesets

  given: dict[str, Any] = {
    "names": LLAMA_NAMES,
    "rules": _hf_rulesets.llama_like,
    "model": "llama.FlaxLlama",
  }
  return Family(model_type, defaults, read, **(given | fields))


BUILTIN: dict[str, str] = {
  "gpt2": "ucp_jax.families.gpt2",
  "llama": "ucp_jax.families.llama",
  "mistral": "ucp_jax.families.mistral",
  "qwen2": "ucp_jax.families.qwen",
  "qwen3": "ucp_jax.families.qwen",
  "gemma": "ucp_jax.families.gemma",
  "gemma2": "ucp_jax.families.gemma",
  "gemma3_text": "ucp_jax.families.gemma",
  "phi3": "ucp_jax.families.phi3",
  "olmo2": "ucp_jax.families.olmo2",
  "gpt_neox": "ucp_jax.families.gpt_neox",
  "mixtral": "ucp_jax.families.mixtral",
  "qwen2_moe": "ucp_jax.families.qwen_moe",
  "qwen3_moe": "ucp_jax.families.qwen_moe",
}
"""`model_type` -> the module whose `FAMILIES` holds its record."""

REFUSED = {
  "gemma3": "multimodal Gemma 3 (a vision tower, the text model under `text_config`); "
  "gemma3_text runs",
  "phi": "Phi-1/2 (a parallel block with a dense head): no reference model",
}
"""`model_type`s refused with their own reason (any other is refused naming the ready ones)."""


def ready() -> list[str]:
  """The `model_type`s with a family record, in the registry's order."""
  return list(BUILTIN)


def get(model_type: str) -> Family:
  """The record of `model_type`.

  Raises:
    KeyError: no family has it.
  """
  module = importlib.import_module(BUILTIN[model_type])
  for family in module.FAMILIES:
    if family.model_type == model_type:
      return family
  raise KeyError(model_type)  # the registry names a module that lacks the record


def config_from_hf(config: Mapping[str, Any], *, where: str = "config.json") -> Any:
  """The Flax model config that computes what the `config.json` `config` describes.

  Example:
    >>> from ucp_jax.families import config_from_hf
    >>> config_from_hf({"model_type": "qwen2", "vocab_size": 96, "hidden_size": 32,
    ...   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...   "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1e6}).qkv_bias
    True

  Args:
    config: the `config.json` as a dict.
    where: the file it came from, for messages.

  Raises:
    MappingError: a model type without a family, a field of the wrong type, a feature the
      reference models do not compute (every one, on one line naming `where`).
  """
  if not isinstance(config, Mapping):
    raise _errors.MappingError(f"{where}: {shown(config)} is not a JSON object")
  kind = config.get("model_type")
  if isinstance(kind, str) and kind in BUILTIN:
    family = get(kind)
    r = Reader(config, where, family.defaults)
    return r.done(kind, family.read(r, kind))
  if isinstance(kind, str) and kind in REFUSED:
    raise _errors.MappingError(f"{where}: `model_type` {kind!r}: {REFUSED[kind]}")
  raise _errors.MappingError(
    f"{where}: `model_type` {shown(kind)} has no ready rule set; ready: {', '.join(BUILTIN)} "
    "(for another, write a RuleSet: docs/mapping.md)"
  )


def rules_for(
  kind: str,
  cfg: Any,
  *,
  stacked: bool,
  prefix: str | None,
  names: list[str] | None,
  architectures: Any,
) -> Any:
  """The rule set of `model_type` `kind` for the Flax config `cfg`; the prefix (when None)
  read from the weight `names` where given, else from `architectures`."""
  family = get(kind)
  if prefix is None:
    prefix = _prefix(*family.names, names, architectures)
  options: dict[str, Any] = {"stacked": stacked, "prefix": prefix}
  if family.named_options is not None:
    options |= family.named_options(names)
  return family.rules(cfg, **options)


def _prefix(full: str, bare: tuple[str, ...], names: list[str] | None, archs: Any) -> str:
  if names:
    if any(n.startswith(full) for n in names):
      return full
    if any(n.startswith(bare) for n in names):
      return ""
  archs = archs if isinstance(archs, list) else []
  if archs and all(a.endswith("Model") and "For" not in a and "Head" not in a for a in archs):
    return ""
  return full
