"""Which pattern each parameter has: DeepSpeed's `universal_checkpoint_info` and user rules.

Names follow `deepspeed/checkpoint/constants.py`; matching is `re.match`, as in
`ds_to_universal.merge_tp_slices`. Every parameter gets exactly one pattern, or `classify`
raises one error that lists every name matched by no rule or by two, and every user rule that
claims nothing.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ucp_jax.base._errors import MappingError, bullet_list
from ucp_jax.parallel._patterns import Pattern, average, expert, replicated, row, sub_params


@dataclasses.dataclass(frozen=True)
class PatternRule:
  """A user rule: parameter names matching `regex` (`re.match`) have `pattern`."""

  regex: str
  pattern: Pattern


# universal_checkpoint_info keys (deepspeed/checkpoint/constants.py)
UC_REPLICATED = "tp_replicated_parameter_patterns"
UC_AVERAGE = "parameter_to_average_patterns"
UC_ROW = "parameter_with_row_parallelism_patterns"
UC_VOCAB = "vocabulary_parameter_patterns"
UC_TWO_SUB = "parameter_with_2_sub_params_cat_dim_0"
UC_SUB = "parameter_with_sub_params"
UC_SUB_WIDTHS = "sub_param_shard_widths"
UC_PIPELINE_REPLICATED = "pipeline_replicated_parameter_patterns"
UC_EXPERT = "expert_parameter_patterns"
UC_ORIGINAL_VOCAB = "original_vocab_size"
UC_VERSION = "universal_checkpoint_version"


def rules_from_universal_info(info: Mapping[str, Any] | None) -> list[PatternRule]:
  """DeepSpeed's `universal_checkpoint_info` as rules (vocabulary patterns excluded: they
  modify another pattern, see `classify`)."""
  info = info or {}
  rules = [PatternRule(p, replicated()) for p in info.get(UC_REPLICATED, [])]
  rules += [PatternRule(p, average()) for p in info.get(UC_AVERAGE, [])]
  rules += [PatternRule(p, row()) for p in info.get(UC_ROW, [])]
  rules += [PatternRule(p, sub_params(2, 0)) for p in info.get(UC_TWO_SUB, [])]
  widths = info.get(UC_SUB_WIDTHS, {})
  for spec in info.get(UC_SUB, []):
    spec = dict(spec) if isinstance(spec, Mapping) else dataclasses.asdict(spec)
    dim = int(spec.get("partition_dim", 0))
    sizes = spec["shape"][dim]
    sizes = tuple(int(s) for s in sizes) if isinstance(sizes, list | tuple) else int(sizes)
    for p in spec["patterns"]:
      w = widths.get(p)
      rules.append(PatternRule(p, sub_params(sizes, dim, shard_widths=w)))
  rules += [PatternRule(p, expert()) for p in info.get(UC_EXPERT, [])]
  return rules


_COLUMN = Pattern("column")


def classify(
  names: Iterable[str],
  *,
  info: Mapping[str, Any] | None = None,
  rules: Sequence[PatternRule | tuple[str, Pattern | str]] = (),
  default: Pattern | None = _COLUMN,
  where: str = "checkpoint",
) -> dict[str, Pattern]:
  """One pattern per parameter name.

  A name takes the pattern of the one rule that matches it (`re.match`, DeepSpeed's
  semantics): user `rules` first, then those of `info` (`universal_checkpoint_info`); when no
  rule matches, `default` (DeepSpeed's own default is `column`). A vocabulary pattern of `info`
  adds `vocab_size` (its `original_vocab_size`) to the name's pattern.

  Args:
    names: the parameter names.
    info: the checkpoint's `universal_checkpoint_info`, if any.
    rules: `PatternRule`s or `(regex, pattern)` pairs (a pattern may be a kind name); they
      override `info` for the names they match.
    default: the pattern of names no rule matches; None makes them an error.
    where: what the names belong to, for messages.

  Raises:
    MappingError: names matched by no rule (with `default=None`) or by two rules of the same
      source, listing every one; a vocabulary pattern without `original_vocab_size`.
  """
  names = list(names)
  user = [_as_rule(r) for r in rules]
  from_info = rules_from_universal_info(info)
  vocab = list((info or {}).get(UC_VOCAB, []))
  vocab_size = (info or {}).get(UC_ORIGINAL_VOCAB)
  out: dict[str, Pattern] = {}
  ambiguous, unmatched, unused = [], [], []
  for name in names:
    pattern = None
    for source in (user, from_info):
      hits = [r for r in source if re.match(r.regex, name)]
      if len(hits) > 1:
        ambiguous.append(f"{name}: matched by {', '.join(repr(r.regex) for r in hits)}")
      if hits:
        pattern = hits[0].pattern
        break
    if pattern is None:
      if default is None:
        unmatched.append(name)
        continue
      pattern = default
    if any(re.match(p, name) for p in vocab) and pattern.vocab_size is None:
      if vocab_size is None:
        unmatched.append(f"{name}: a vocabulary parameter, but no {UC_ORIGINAL_VOCAB} is given")
        continue
      pattern = dataclasses.replace(pattern, vocab_size=int(vocab_size))
    out[name] = pattern
  for rule in user:
    if not any(re.match(rule.regex, n) for n in names):
      unused.append(f"{rule.regex!r} (user rule) matches no parameter")
  problems = []
  if ambiguous:
    problems.append(f"parameters matched by two rules:\n{bullet_list(ambiguous)}")
  if unmatched:
    problems.append(f"parameters no rule claims:\n{bullet_list(unmatched)}")
  if unused:
    problems.append(f"rules that claim nothing:\n{bullet_list(unused)}")
  if problems:
    raise MappingError(
      f"{where}: cannot assign a parallel layout pattern to every parameter.\n"
      + "\n".join(problems)
      + "\nPass rules=[(regex, pattern), ...] to say how these parameters are split."
    )
  return out


def _as_rule(rule: PatternRule | tuple[str, Pattern | str]) -> PatternRule:
  if isinstance(rule, PatternRule):
    return rule
  regex, pattern = rule
  return PatternRule(regex, Pattern(pattern) if isinstance(pattern, str) else pattern)
