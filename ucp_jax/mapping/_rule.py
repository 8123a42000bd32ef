"""One rename rule: a regex on source names -> a target key template, plus transforms.

A rule runs both ways. Import: a source name that the regex fully matches becomes
the key `target.format(*groups)`, its array carried through `transforms`. Export:
a target key that the template matches becomes the source name that the regex
spells with those groups (the regex must then be a literal with capture groups),
its array carried back through the inverse transforms.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import string
from collections.abc import Sequence

from ucp_jax.base import _errors
from ucp_jax.mapping._transforms import Stack, SubParam, Transform

_META = set(".^$*+?{}[]|")


@dataclasses.dataclass(frozen=True)
class Rule:
  """Maps source names matching `source` to target keys spelled by `target`.

  Attributes:
    source: a regex, matched against the whole source name (`re.fullmatch`).
    target: the target key, with `{0}`, `{1}`, ... standing for the regex's capture
      groups; None drops the matched names on import (buffers a target has no use for).
    transforms: applied in order on import, inverted in reverse order on export. A
      `stack(...)` marker among them stacks the layers numbered by one capture group.
    tied: the source name holds a copy of the target (a tied `lm_head.weight`): it is
      not read on import, and export writes the target's array under this name too.
  """

  source: str
  target: str | None
  transforms: Sequence[Transform] = ()
  tied: bool = False

  def __post_init__(self):
    object.__setattr__(self, "transforms", tuple(self.transforms))
    problems = self._problems()
    if problems:
      raise _errors.MappingError(
        f"rule {self.source!r} -> {self.target!r} is malformed:\n" + _errors.bullet_list(problems)
      )

  def _problems(self) -> list[str]:
    try:
      regex = re.compile(self.source)
    except re.error as e:
      return [f"the source is not a valid regex: {e}"]
    problems = [
      f"{t!r} is not a transform" for t in self.transforms if not isinstance(t, Transform)
    ]
    stacks = [t for t in self.transforms if isinstance(t, Stack)]
    if len(stacks) > 1:
      problems.append("more than one stack(...) marker")
    subs = [i for i, t in enumerate(self.transforms) if isinstance(t, SubParam)]
    if subs and subs != [0]:
      problems.append("a sub_param(...) must be the first transform, and the only one")
    fields = _fields(self.target) if self.target is not None else []
    if fields is None:
      return [*problems, "target placeholders must be capture group numbers: {0}, {1}, ..."]
    for i in sorted(set(fields)):
      if i >= regex.groups:
        problems.append(f"target uses {{{i}}}; the regex has {regex.groups} capture groups")
    for s in stacks:
      if s.group >= regex.groups:
        problems.append(f"{s} numbers layers by a group the regex does not have")
      elif s.group in fields:
        problems.append(f"{s}: the layer group {{{s.group}}} cannot also appear in the target")
    if self.tied and (self.target is None or stacks):
      problems.append("a tied rule needs a target and cannot stack")
    return problems

  @functools.cached_property
  def regex(self) -> re.Pattern:
    return re.compile(self.source)

  @property
  def stack(self) -> Stack | None:
    return next((t for t in self.transforms if isinstance(t, Stack)), None)

  @property
  def sub_param(self) -> SubParam | None:
    """The sub-parameter this rule takes of a fused source array, if it takes one."""
    first = self.transforms[0] if self.transforms else None
    return first if isinstance(first, SubParam) else None

  @property
  def before_stack(self) -> tuple[Transform, ...]:
    """The transforms applied to each layer (all of them when the rule does not stack)."""
    marks = [i for i, t in enumerate(self.transforms) if isinstance(t, Stack)]
    return tuple(self.transforms[: marks[0]] if marks else self.transforms)

  @property
  def after_stack(self) -> tuple[Transform, ...]:
    marks = [i for i, t in enumerate(self.transforms) if isinstance(t, Stack)]
    return tuple(self.transforms[marks[0] + 1 :]) if marks else ()

  def target_key(self, match: re.Match) -> str:
    assert self.target is not None
    return self.target.format(*match.groups())

  @functools.cached_property
  def target_regex(self) -> re.Pattern | None:
    """Matches the keys this rule produces, one named group per placeholder."""
    if self.target is None:
      return None
    out, seen = [], set()
    for literal, field, _, _ in string.Formatter().parse(self.target):
      out.append(re.escape(literal))
      if field is not None:
        out.append(f"(?P=g{field})" if field in seen else f"(?P<g{field}>[^/]+?)")
        seen.add(field)
    return re.compile("".join(out))

  @functools.cached_property
  def source_template(self) -> str | None:
    """The source name as a format string over the capture groups; None if not a literal."""
    return _template(self.source)

  @functools.cached_property
  def invertible(self) -> bool:
    """Whether export can spell source names: a literal regex, every group in the target."""
    if self.source_template is None or self.target is None:
      return False
    layer = {self.stack.group} if self.stack is not None else set()
    return set(_fields(self.target) or []) | layer == set(range(self.regex.groups))

  def source_name(self, key_match: re.Match, layer: int | None = None) -> str | None:
    """The source name for a target key this rule matched (and a layer, for stacks).

    None when the name so spelled is not one the regex matches with the same groups
    (the key is not one this rule makes). Only for `invertible` rules.
    """
    assert self.invertible and self.source_template is not None
    groups: list[str] = [""] * self.regex.groups
    for name, value in key_match.groupdict().items():
      groups[int(name[1:])] = value
    if self.stack is not None:
      groups[self.stack.group] = str(layer)
    name = self.source_template.format(*groups)
    match = self.regex.fullmatch(name)
    return name if match is not None and list(match.groups()) == groups else None

  def __str__(self) -> str:
    transforms = ", ".join(map(str, self.transforms))
    tied = " (tied)" if self.tied else ""
    return f"{self.source} -> {self.target}{tied}" + (f" [{transforms}]" if transforms else "")

  def under(self, source_prefix: str, target_prefix: str) -> Rule:
    """This rule for names below `source_prefix`, giving keys below `target_prefix`."""
    source = f"{re.escape(source_prefix + '/')}(?:{self.source})" if source_prefix else self.source
    target = self.target
    if target is not None and target_prefix:
      target = target_prefix.replace("{", "{{").replace("}", "}}") + "/" + target
    return dataclasses.replace(self, source=source, target=target)


def _fields(template: str) -> list[int] | None:
  fields = []
  try:
    parsed = list(string.Formatter().parse(template))
  except ValueError:
    return None
  for _, field, spec, conversion in parsed:
    if field is None:
      continue
    if not field.isdigit() or spec or conversion:
      return None
    fields.append(int(field))
  return fields


def _template(pattern: str) -> str | None:
  """`h\\.(\\d+)\\.w` -> `h.{0}.w`: a regex that is a literal with capture groups, as a template."""
  return _parse(pattern, 0, [0], top=True)[0]


def _parse(pattern: str, i: int, counter: list[int], top: bool = False):
  """Parses from `i` to the end (or a closing paren); returns (template or None, end)."""
  out: list[str] = []
  ok = True
  while i < len(pattern):
    c = pattern[i]
    if c == ")" and not top:
      return ("".join(out) if ok else None), i
    if c == "\\":
      nxt = pattern[i + 1 : i + 2]
      if not nxt or nxt.isalnum():
        ok = False
      out.append({"{": "{{", "}": "}}"}.get(nxt, nxt))
      i += 2
      continue
    if c == "(":
      if pattern.startswith("(?:", i):
        inner, i = _parse(pattern, i + 3, counter)
        ok = ok and inner is not None
        out.append(inner or "")
      elif pattern.startswith("(?", i) and not pattern.startswith("(?P<", i):
        ok = False
        i = _skip_group(pattern, i)
      else:
        out.append(f"{{{counter[0]}}}")
        counter[0] += 1
        start = pattern.index(">", i) + 1 if pattern[i + 1] == "?" else i + 1
        _, i = _parse(pattern, start, counter)
      i += 1  # the closing paren
      continue
    if c in _META:
      ok = False
      if c == "[":
        i = _skip_class(pattern, i)
    out.append(c)
    i += 1
  return ("".join(out) if ok else None), i


def _skip_class(pattern: str, i: int) -> int:
  """The index of the `]` closing the character class opened at `i`."""
  j = i + 1
  if pattern[j : j + 1] == "^":
    j += 1
  if pattern[j : j + 1] == "]":
    j += 1
  while j < len(pattern) and pattern[j] != "]":
    j += 2 if pattern[j] == "\\" else 1
  return j


def _skip_group(pattern: str, i: int) -> int:
  depth, j = 0, i
  while j < len(pattern):
    c = pattern[j]
    if c == "\\":
      j += 2
      continue
    if c == "[":
      j = _skip_class(pattern, j)
    elif c == "(":
      depth += 1
    elif c == ")":
      depth -= 1
      if depth == 0:
        return j
    j += 1
  return j
