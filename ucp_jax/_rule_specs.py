"""Rule sets named by text: `gpt2:num_heads=4`, `hf:config=PATH`, `module:function:k=v`.

The command line's `--rules` and the API's `rules=` (`ucp_jax.export`, `ucp_jax.diff`) take
the same texts (docs/mapping.md).
"""

from __future__ import annotations

import sys
from typing import Any

from ucp_jax.base import _errors
from ucp_jax.store import _reader


def parse(
  spec: Any, checkpoint: Any = None, config: str | None = None, *, flax_side: Any = None
) -> Any:
  """The rule set a text names (`--rules` on the command line, `rules=` in the API): a
  `RuleSet` is returned as it is, None stays None.

  - a ready set and its options: `gpt2:num_heads=4`, `llama:...`, `hf_gpt2:...`, `hf_llama:...`;
  - `hf[:stacked=true,prefix=...,config=PATH]`: `ucp_jax.rules.from_hf` on `config=`, else
    `config` (`--config`), else the config.json `checkpoint` recorded (or holds: a Hugging
    Face folder); `stacked` defaults to what the Flax keys show (of `flax_side`, default
    `checkpoint`);
  - `module:function[:options]`: what `module.function(**options)` returns (the current
    directory is searched for `module` too).
  Options are `key=value` separated by commas; values are integers, floats, true/false, or
  text.
  """
  from ucp_jax import rules

  if spec is None or isinstance(spec, rules.RuleSet):
    return spec
  if not isinstance(spec, str) or not spec:
    raise _errors.MappingError(f"rules={spec!r}: a RuleSet, or a text such as 'gpt2:num_heads=4'")

  ready: dict[str, Any] = {"gpt2": rules.gpt2, "llama": rules.llama, "hf_gpt2": rules.hf_gpt2}
  ready |= {"hf_llama": rules.hf_llama, "hf": None}
  name, _, options = spec.partition(":")
  if name in ready:
    factory = ready[name]
  elif options:
    function, _, options = options.partition(":")
    factory = _import(spec, name, function)
  else:
    raise _errors.MappingError(
      f"--rules {spec!r}: not a ready rule set ({', '.join(ready)}) nor module:function"
    )
  kwargs = _rule_options(spec, options, text_ok=name not in ready)
  if name == "hf":
    return _hf_rule_set(spec, kwargs, checkpoint, config, flax_side or checkpoint)
  try:
    made = factory(**kwargs)
  except TypeError as e:
    raise _errors.MappingError(f"--rules {spec!r}: {e}") from None
  made = made[0] if isinstance(made, tuple) and made else made  # (rules, config), as from_hf
  if not isinstance(made, rules.RuleSet):
    raise _errors.MappingError(f"--rules {spec!r} made a {type(made).__name__}, not a RuleSet")
  return made


def _rule_options(spec: str, options: str, *, text_ok: bool) -> dict:
  kwargs: dict[str, Any] = {}
  for item in filter(None, options.split(",")):
    key, _, value = item.partition("=")
    if value.lower() in ("true", "false"):
      kwargs[key] = value.lower() == "true"
      continue
    for kind in (int, float):
      try:
        kwargs[key] = kind(value)
        break
      except ValueError:
        pass
    else:
      if not text_ok and key not in ("prefix", "config"):
        raise _errors.MappingError(f"--rules {spec!r}: {key}={value!r} is not an integer")
      kwargs[key] = value
  return kwargs


def _import(spec: str, module: str, function: str):
  import importlib
  import os

  if os.getcwd() not in sys.path:  # `ucp` is a script: its own folder is searched, not ours
    sys.path.append(os.getcwd())
  try:
    return getattr(importlib.import_module(module), function)
  except ModuleNotFoundError as e:
    raise _errors.MappingError(f"--rules {spec!r}: no module {e.name!r} to import") from None
  except AttributeError:
    raise _errors.MappingError(f"--rules {spec!r}: module {module} has no {function!r}") from None


def reads_config(spec: Any) -> bool:
  """Whether the rule set `spec` names reads a Hugging Face config.json (`hf[:...]`)."""
  return isinstance(spec, str) and spec.partition(":")[0] == "hf"


def _hf_rule_set(spec: str, kwargs: dict, checkpoint: Any, config: str | None, flax_side: Any):
  import re

  from ucp_jax import rules

  source = kwargs.pop("config", None) or config or checkpoint
  unknown = [k for k in kwargs if k not in ("stacked", "prefix")]
  problems = [f"{k} is not an option of hf (stacked, prefix, config)" for k in unknown]
  if source is None:
    problems.append("no config.json to read: pass hf:config=PATH")
  if problems:
    raise _errors.MappingError(f"--rules {spec!r}: " + "; ".join(problems))
  if "stacked" not in kwargs and flax_side is not None:
    keys = _reader.open(flax_side).keys()
    layered = any(re.search(r"(^|/)(layers|blocks)/\d+/", k) for k in keys)
    kwargs["stacked"] = not layered and any(re.search(r"(^|/)(layers|blocks)/", k) for k in keys)
  try:
    return rules.from_hf(source, **kwargs)[0]
  except _errors.MappingError as e:
    if "recorded no Hugging Face config.json" in str(e):
      raise _errors.MappingError(f"--rules {spec!r}: {e} (hf:config=PATH or --config)") from None
    raise
