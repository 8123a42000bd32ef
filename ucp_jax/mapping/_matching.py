"""Matching one stage of a mapping: which source names make which target key, checked whole.

Both directions check every name before any array is touched and raise one
`MappingError` that lists every problem: names no rule matches, names two rules
match, keys (or names) produced twice, stacks with missing or mismatched layers,
transforms that do not fit an array's shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.mapping._rule import Rule
from ucp_jax.mapping._transforms import stack_shape
from ucp_jax.store._manifest import ArrayInfo


@dataclasses.dataclass(frozen=True)
class Entry:
  """One target key on import: the source names it is made of, and how.

  `sources` holds one name, or one per layer (in layer order) when the rule stacks.
  """

  key: str
  sources: tuple[str, ...]
  rule: Rule
  info: ArrayInfo | None = None


@dataclasses.dataclass(frozen=True)
class ExportEntry:
  """One target key on export: the source names it gives, one per layer when stacked."""

  key: str
  names: tuple[str, ...]
  rule: Rule


def match_import(
  rules: tuple[Rule, ...],
  names: Iterable[str],
  infos: Mapping[str, ArrayInfo] | None = None,
  *,
  partial: bool = False,
  where: str = "",
) -> dict[str, Entry]:
  """Target key -> Entry for every source name; with `infos`, target shapes and dtypes too.

  Raises:
    MappingError: every unmatched name (unless `partial`), doubly matched name, duplicate
      target key, broken stack and misfitting transform, at once.
  """
  problems: list[str] = []
  made: dict[str, tuple[Rule, dict[int | None, list[str]]]] = {}
  for name in names:
    hits = [(r, m) for r in rules if (m := r.regex.fullmatch(name)) is not None]
    if not hits:
      if not partial:
        problems.append(f"{name}: no rule matches")
      continue
    if len(hits) > 1 and not _sub_params([r for r, _ in hits]):
      problems.append(
        f"{name}: matched by {len(hits)} rules: " + "; ".join(str(r) for r, _ in hits)
      )
      continue
    for rule, match in hits:  # one rule, or one per sub-parameter of a fused array
      if rule.target is None or rule.tied:
        continue
      key = rule.target_key(match)
      layer = None
      if rule.stack is not None:
        text = match.group(rule.stack.group + 1)
        if not text.isdigit():
          problems.append(f"{name}: layer number {text!r} is not a number ({rule.stack})")
          continue
        layer = int(text)
      other, layers = made.setdefault(key, (rule, {}))
      if other is not rule:
        problems.append(f"{key}: made by two rules: {other} and {rule} (from {name})")
        continue
      layers.setdefault(layer, []).append(name)
  entries = {}
  for key, (rule, layers) in made.items():
    entry, problem = _entry(key, rule, layers)
    if problem:
      problems.append(problem)
    elif infos is not None:
      info, problem = _target_info(entry, infos)
      if problem:
        problems.append(problem)
      entries[key] = dataclasses.replace(entry, info=info)
    else:
      entries[key] = entry
  _raise(problems, where, "cannot map these source names onto target keys")
  return entries


def _sub_params(rules: list[Rule]) -> bool:
  """Whether `rules` take distinct sub-parameters of one fused layout (so may share a name)."""
  subs = [r.sub_param for r in rules]
  if any(s is None for s in subs):
    return False
  layouts = {(s.axis, s.sizes) for s in subs}
  return len(layouts) == 1 and len({s.index for s in subs}) == len(subs)


def _entry(key: str, rule: Rule, layers: dict[int | None, list[str]]) -> tuple[Entry, str | None]:
  twice = {n: names for n, names in layers.items() if len(names) > 1}
  if twice:
    names = [name for names in twice.values() for name in names]
    return Entry(key, (), rule), f"{key}: made twice, from {', '.join(names)}"
  if rule.stack is None:
    return Entry(key, (layers[None][0],), rule), None
  found = sorted(layers)
  missing = sorted(set(range(max(found) + 1)) - set(found))
  if missing:
    return Entry(key, (), rule), (
      f"{key}: layers {_ranges(missing)} missing from the stack of layers "
      f"{_ranges(found)} ({rule.source})"
    )
  return Entry(key, tuple(layers[i][0] for i in found), rule), None


def _target_info(
  entry: Entry, infos: Mapping[str, ArrayInfo]
) -> tuple[ArrayInfo | None, str | None]:
  rule = entry.rule
  firsts = [infos[s] for s in entry.sources]
  first = firsts[0]
  if rule.transforms and first.kind != "array":
    return None, f"{entry.key}: {entry.sources[0]} is a {first.kind}; transforms apply to arrays"
  if rule.stack is not None:
    odd = [
      f"{s} {i.shape} {i.dtype}"
      for s, i in zip(entry.sources, firsts)
      if (i.shape, i.dtype, i.kind) != (first.shape, first.dtype, first.kind)
    ]
    if odd:
      return None, (
        f"{entry.key}: cannot stack layers of different shapes or dtypes: "
        f"{entry.sources[0]} {first.shape} {first.dtype}; " + "; ".join(odd)
      )
  try:
    info = _forward_info(rule, first, len(entry.sources))
  except ValueError as e:
    return None, f"{entry.key}: from {entry.sources[0]} {first.shape} {first.dtype}: {e}"
  return (info if rule.transforms else first), None


def _forward_info(rule: Rule, first: ArrayInfo, layers: int) -> ArrayInfo:
  """The target's shape, dtype and (presented) chunks; `ValueError` if a transform misfits."""
  shape, dtype, chunks = first.shape, np.dtype(first.dtype), first.chunks
  for t in rule.before_stack:
    shape, dtype, chunks = (*t.shape(shape, dtype), t.chunks(chunks, shape))
  if rule.stack is not None:
    a = rule.stack.axis
    shape, dtype = stack_shape(shape, dtype, layers, a)
    chunks = (*chunks[:a], 1, *chunks[a:])
  for t in rule.after_stack:
    shape, dtype, chunks = (*t.shape(shape, dtype), t.chunks(chunks, shape))
  return ArrayInfo(shape, dtype.name, chunks)


def match_export(
  rules: tuple[Rule, ...],
  shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]],
  *,
  where: str = "",
) -> dict[str, list[ExportEntry]]:
  """Target key -> the entries (a primary rule, then tied copies) that give source names.

  Raises:
    MappingError: every unmatched key, key matched by two rules, source name produced
      twice, rule that cannot be run backwards and misfitting transform, at once.
  """
  problems: list[str] = []
  out: dict[str, list[ExportEntry]] = {}
  given: dict[str, list[tuple[str, Rule]]] = {}
  for key, (shape, dtype) in shapes.items():
    hits = [(r, m) for r in rules if (m := _makes(r, key)) is not None]
    primary = [(r, m) for r, m in hits if not r.tied]
    if not primary:
      problems.append(f"{key}: no rule makes this key")
      continue
    if len(primary) > 1:
      problems.append(
        f"{key}: made by {len(primary)} rules: " + "; ".join(str(r) for r, _ in primary)
      )
      continue
    entries = []
    for rule, match in primary + [(r, m) for r, m in hits if r.tied]:
      entry, problem = _export_entry(key, shape, dtype, rule, match)
      if problem:
        problems.append(problem)
        continue
      for name in entry.names:
        earlier = given.setdefault(name, [])
        if earlier and not _sub_params([r for _, r in earlier] + [rule]):
          problems.append(f"{name}: given twice, by {earlier[0][0]} and {key}")
        earlier.append((key, rule))
      entries.append(entry)
    out[key] = entries
  for name, makers in given.items():
    sub = makers[0][1].sub_param
    if sub is not None and _sub_params([r for _, r in makers]):
      missing = sorted(set(range(len(sub.sizes))) - {r.sub_param.index for _, r in makers})
      if missing:
        problems.append(
          f"{name}: sub-parameters {_ranges(missing)} of {sub.sizes} missing to fuse it "
          f"(made from {', '.join(k for k, _ in makers)})"
        )
  _raise(problems, where, "cannot map these target keys back onto source names")
  return out


def _export_entry(key, shape, dtype, rule: Rule, match) -> tuple[ExportEntry, str | None]:
  dtype = np.dtype(dtype)
  try:
    for t in reversed(rule.after_stack):
      shape, dtype = t.inverse_shape(shape, dtype)
    layers = [None]
    if rule.stack is not None:
      axis = rule.stack.axis
      if not 0 <= axis < len(shape):
        raise ValueError(f"{rule.stack} does not fit shape {shape}")
      layers = list(range(shape[axis]))
      shape = shape[:axis] + shape[axis + 1 :]
    for t in reversed(rule.before_stack):
      shape, dtype = t.inverse_shape(shape, dtype)
  except ValueError as e:
    return ExportEntry(key, (), rule), f"{key}: {e} ({rule})"
  if not rule.invertible:
    return ExportEntry(key, (), rule), (
      f"{key}: rule {rule} cannot be run backwards (its regex must be a literal with "
      "capture groups, and the target must use every group but the layer's)"
    )
  names = [rule.source_name(match, layer) for layer in layers]
  bad = [str(layer) for layer, name in zip(layers, names) if name is None]
  if bad:
    return ExportEntry(key, (), rule), f"{key}: {rule} cannot name layers {', '.join(bad)}"
  return ExportEntry(key, tuple(n for n in names if n is not None), rule), None


def _makes(rule: Rule, key: str):
  """The target-template match if `rule` makes `key` (its source name spells back), else None."""
  if rule.target is None:
    return None
  match = rule.target_regex.fullmatch(key)
  if match is None or not rule.invertible:
    return match
  return match if rule.source_name(match, 0 if rule.stack else None) is not None else None


def _ranges(numbers: list[int]) -> str:
  spans, start = [], None
  for i, n in enumerate(numbers):
    if start is None:
      start = n
    if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
      spans.append(str(start) if start == n else f"{start}-{n}")
      start = None
  return ", ".join(spans)


def _raise(problems: list[str], where: str, what: str) -> None:
  if problems:
    prefix = f"{where}: " if where else ""
    raise _errors.MappingError(f"{prefix}{what}:\n" + _errors.bullet_list(problems))
