"""What each DeepSpeed file must hold, checked before a reader indexes into it.

docs/deepspeed_layouts.md (§4, §5, §11) says what DeepSpeed 0.19.8 writes. The readers
(`_zero`, `_zero3`, `_universal`, `_tp`) then index
into those trees freely, so each file's tree is first checked against a spec here: every key a
reader touches has the type, and every count the range, that the reader relies on. A forged or
damaged file gets one `SourceFormatError` listing every offending key with its file
(``path: ['optimizer_state_dict']['group_paddings'][0] is None, not an int >= 0``), never a
TypeError from inside a reader. Keys no reader uses are not checked (client state, schedulers).

A spec is a `Spec`: `Is(types)`, `Int(lo, hi)`, `ListOf(spec)`, `DictOf(key, value)`,
`Keys(required, optional)`, or `Maybe(spec)` (None allowed as well).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ucp_jax.parallel import _pattern_rules
from ucp_jax.sources._byte_span import ByteSpan
from ucp_jax.sources._torch_reader._torch_file import InertObject, is_tensor

try:  # the parser behind `re.compile`: Python >= 3.11, then 3.10
  from re import _parser as _sre_parse  # type: ignore[attr-defined]  # private: no stubs
except ImportError:  # pragma: no cover
  import sre_parse as _sre_parse

MAX_RANKS = 1 << 20
"""The most ranks a degree (dp, tp, pp) may claim: reading lists every missing rank file."""


class Spec:
  """What a value must be; `problems` yields one line per offending key."""

  what = "?"

  def problems(self, value: Any, where: str) -> Iterator[str]:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Is(Spec):
  """An instance of one of `types` (`bool` is no int here)."""

  types: tuple[type, ...]
  what: str

  def problems(self, value: Any, where: str) -> Iterator[str]:
    if not isinstance(value, self.types) or (type(value) is bool and bool not in self.types):
      yield f"{where} is {_show(value)}, not {self.what}"


@dataclasses.dataclass(frozen=True)
class Int(Spec):
  """A Python int in [lo, hi]."""

  lo: int = 0
  hi: int | None = None

  @property
  def what(self) -> str:  # type: ignore[override]
    return f"an int >= {self.lo}" + (f" and <= {self.hi}" if self.hi is not None else "")

  def problems(self, value: Any, where: str) -> Iterator[str]:
    if type(value) is not int or value < self.lo or (self.hi is not None and value > self.hi):
      yield f"{where} is {_show(value)}, not {self.what}"


@dataclasses.dataclass(frozen=True)
class Maybe(Spec):
  """None, or what `spec` allows."""

  spec: Spec

  @property
  def what(self) -> str:  # type: ignore[override]
    return f"None or {self.spec.what}"

  def problems(self, value: Any, where: str) -> Iterator[str]:
    if value is not None:
      yield from self.spec.problems(value, where)


@dataclasses.dataclass(frozen=True)
class ListOf(Spec):
  """A list (or tuple) of items that `item` allows."""

  item: Spec

  @property
  def what(self) -> str:  # type: ignore[override]
    return f"a list of {self.item.what}"

  def problems(self, value: Any, where: str) -> Iterator[str]:
    if not isinstance(value, list | tuple):
      yield f"{where} is {_show(value)}, not {self.what}"
      return
    for i, item in enumerate(value):
      yield from self.item.problems(item, f"{where}[{i}]")


@dataclasses.dataclass(frozen=True)
class DictOf(Spec):
  """A dict whose keys `key` allows and whose values `value` allows."""

  key: Spec
  value: Spec

  @property
  def what(self) -> str:  # type: ignore[override]
    return f"a dict of {self.key.what} -> {self.value.what}"

  def problems(self, value: Any, where: str) -> Iterator[str]:
    if not isinstance(value, dict):
      yield f"{where} is {_show(value)}, not {self.what}"
      return
    for k, v in value.items():
      if any(True for _ in self.key.problems(k, "")):
        yield f"{where} has the key {_show(k)}, not {self.key.what}"
      else:
        yield from self.value.problems(v, f"{where}[{k!r}]")


@dataclasses.dataclass(frozen=True)
class Keys(Spec):
  """A dict with the `required` keys, and the `optional` ones where present, as specified."""

  required: Mapping[str, Spec]
  optional: Mapping[str, Spec] = dataclasses.field(default_factory=dict)
  key: Spec | None = None  # what every key must be, if anything

  @property
  def what(self) -> str:  # type: ignore[override]
    return "a dict" + (f" with keys {tuple(self.required)}" if self.required else "")

  def problems(self, value: Any, where: str) -> Iterator[str]:
    if not isinstance(value, dict):
      yield f"{where or 'the top level'} is {_show(value)}, not {self.what}"
      return
    for key, spec in self.required.items():
      if key not in value:
        yield f"missing key {where}[{key!r}]"
      else:
        yield from spec.problems(value[key], f"{where}[{key!r}]")
    for key, spec in self.optional.items():
      if key in value:
        yield from spec.problems(value[key], f"{where}[{key!r}]")
    if self.key is not None:
      yield from DictOf(self.key, ANY).problems(value, where)


def check(value: Any, spec: Spec, path: str) -> list[str]:
  """Every problem of `value` (the tree of file `path`) against `spec`, each naming `path`."""
  return [f"{path}: {problem}" for problem in spec.problems(value, "")]


def _show(value: Any) -> str:
  if is_tensor(value):
    return f"an array of shape {value.shape} and {value.dtype}"
  if isinstance(value, InertObject):
    return f"a {value.qualname} record"
  if value is None or isinstance(value, bool | int | float | str):
    return repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
  return f"a {type(value).__name__}"


class Number(Spec):
  """A finite real number: an int or float, or a numpy scalar or one-element array of one."""

  what = "a finite number"

  def problems(self, value: Any, where: str) -> Iterator[str]:
    ok = (isinstance(value, int | float | np.generic) or is_tensor(value)) and type(
      value
    ) is not bool
    if ok and (isinstance(value, np.generic) or is_tensor(value)):
      ok = value.size == 1 and value.dtype.kind in "biuf"
    if not ok or not math.isfinite(np.asarray(value).reshape(()).item()):
      yield f"{where} is {_show(value)}, not {self.what}"


ANY = Is((object,), "anything")
STR = Is((str,), "a string")
ARRAY = Is((np.ndarray, ByteSpan), "a tensor")
FLAG = Is((bool, int, str, type(None)), "a flag (bool, int, string or None)")
NUMBER = Number()
SHAPE = ListOf(Int(0))
STAGE = Is((int, InertObject), "a ZeRO stage (an int or a ZeroStageEnum)")
RANKS = Int(1, MAX_RANKS)

_CONFIG = Keys(
  {},
  {
    "bf16": Maybe(Keys({}, {"enabled": FLAG})),
    "fp16": Maybe(Keys({}, {"enabled": FLAG})),
    "optimizer": Maybe(
      Keys({}, {"type": Maybe(STR), "params": Maybe(Keys({}, {"adam_w_mode": FLAG}))})
    ),
  },
)
MODEL_STATES = Keys(
  {
    "module": Maybe(DictOf(STR, ANY)),
    "buffer_names": Maybe(ListOf(STR)),
    "param_shapes": Is((list, dict), "a list of {name: shape} dicts"),
    "shared_params": Maybe(DictOf(STR, STR)),
    "global_steps": NUMBER,
    "dp_world_size": RANKS,
    "ds_version": Maybe(STR),
  },
  {
    "frozen_param_shapes": Maybe(DictOf(STR, SHAPE)),
    "frozen_param_fragments": Maybe(DictOf(STR, ARRAY)),
    "ds_config": Maybe(_CONFIG),
    "checkpoint_parallel_dimensions": Maybe(Keys({}, {"tp_degree": RANKS, "pp_degree": RANKS})),
    "mp_world_size": Maybe(RANKS),
    "universal_checkpoint_info": Maybe(DictOf(STR, ANY)),
  },
)
"""A `*model_states.pt` (§4); `shapes_of` reads `param_shapes` further."""

ZERO3_MODEL_STATES = Keys(
  {
    **MODEL_STATES.required,
    "frozen_param_shapes": Maybe(DictOf(STR, SHAPE)),
    "frozen_param_fragments": Maybe(DictOf(STR, ARRAY)),
  },
  MODEL_STATES.optional,
)
"""A ZeRO-3 `zero_pp_rank_K_mp_rank_00_model_states.pt` (§4)."""

PARAM_GROUPS = ListOf(Keys({}, {"params": ListOf(ANY), "decoupled_weight_decay": FLAG}))
_SLOTS = Keys({}, {"step": NUMBER}, key=STR)  # and slot tensors, which `flat` checks where used
_STATE = DictOf(Int(0), _SLOTS)
_FRAGMENT = Is((InertObject, dict), "a fragment_address")

ZERO12_OSD = Keys(
  {
    "base_optimizer_state": Keys({"state": _STATE, "param_groups": PARAM_GROUPS}),
    "single_partition_of_fp32_groups": ListOf(ARRAY),
    "group_paddings": ListOf(Int(0)),
    "partition_count": ListOf(RANKS),
    "param_slice_mappings": ListOf(DictOf(STR, _FRAGMENT)),
    "ds_version": Maybe(STR),
  },
  {"zero_stage": STAGE},
)
"""The `optimizer_state_dict` of a ZeRO-1/2 or BF16-optimizer `*optim_states.pt` (§5)."""

ZERO3_OSD = Keys(
  {
    "zero_stage": STAGE,
    "partition_count": RANKS,
    "optimizer_state_dict": Keys({"state": _STATE, "param_groups": PARAM_GROUPS}),
    "fp32_flat_groups": ListOf(ARRAY),
  }
)
"""The `optimizer_state_dict` of a ZeRO-3 `*optim_states.pt` (§5)."""

UNIVERSAL_OPTIM = Keys(
  {"param_groups": PARAM_GROUPS},
  {
    "zero_stage": STAGE,
    "optimizer_state_dict": Keys({"state": _STATE}),
  },
)
"""`zero/optimizer_state.pt` of a universal folder (§11)."""


def optim_file(osd: Spec) -> Spec:
  """A `*optim_states.pt` whose `optimizer_state_dict` is as `osd` says."""
  return Keys({"optimizer_state_dict": osd, "ds_version": Maybe(STR)})


EXPERTS = DictOf(STR, ARRAY)
"""A native MoE `layer_L_expert_E_mp_rank_TT_model_states.pt`: parameter name -> tensor."""


# `universal_checkpoint_info`: the regexes and sub-parameter shapes `_pattern_rules` reads.

MAX_PATTERNS = 4096
"""Patterns one `universal_checkpoint_info` list may hold."""
MAX_REGEX = 512
"""Characters of one pattern."""
MAX_REPEATS = 4
"""Repeats (``*``, ``+``, ``{m,n}``) in one pattern; none may hold another repeat, an alternation
or a back-reference, so matching a name cannot backtrack exponentially."""
_REGEX_KEYS = (
  _pattern_rules.UC_REPLICATED,
  _pattern_rules.UC_AVERAGE,
  _pattern_rules.UC_ROW,
  _pattern_rules.UC_VOCAB,
  _pattern_rules.UC_TWO_SUB,
  _pattern_rules.UC_PIPELINE_REPLICATED,
  _pattern_rules.UC_EXPERT,
)
_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")


def universal_info(info: dict, path: str) -> tuple[dict, list[str]]:
  """`universal_checkpoint_info` as `_pattern_rules.classify` can use it, and its problems.

  Every pattern list holds at most `MAX_PATTERNS` regexes that `regex_problem` passes;
  DeepSpeed's `SubparamShape` records become plain dicts of checked `patterns`, `shape` and
  `partition_dim`; `original_vocab_size` is an int >= 1.
  """
  where = f"{path}: ['universal_checkpoint_info']"
  out, problems = dict(info), []
  for key in _REGEX_KEYS:
    value = info.get(key, [])
    if not isinstance(value, list | tuple) or len(value) > MAX_PATTERNS:
      problems.append(f"{where}[{key!r}] is {_show(value)}, not a list of <= {MAX_PATTERNS}")
      continue
    problems += [
      f"{where}[{key!r}][{i}] {p}" for i, r in enumerate(value) if (p := regex_problem(r))
    ]
  subs = info.get(_pattern_rules.UC_SUB)
  if subs is not None:
    out[_pattern_rules.UC_SUB] = []
    for i, spec in enumerate(subs if isinstance(subs, list | tuple) else [subs]):
      spec = spec.state if isinstance(spec, InertObject) else spec
      problem = _sub_params_problem(spec)
      if problem:
        problems.append(f"{where}[{_pattern_rules.UC_SUB!r}][{i}] {problem}")
      else:
        out[_pattern_rules.UC_SUB].append(dict(spec))
  rest = Keys(
    {},
    {
      _pattern_rules.UC_SUB_WIDTHS: Maybe(DictOf(STR, ListOf(ListOf(Int(0))))),
      _pattern_rules.UC_ORIGINAL_VOCAB: Maybe(Int(1)),
    },
  )
  problems += [f"{where}{problem}" for problem in rest.problems(info, "")]
  return out, problems


def regex_problem(regex: Any) -> str | None:
  """Why `regex` is no pattern to match names with (None if it is one)."""
  if not isinstance(regex, str) or len(regex) > MAX_REGEX:
    return f"is {_show(regex)}, not a regex of at most {MAX_REGEX} characters"
  try:
    parsed = _sre_parse.parse(regex)
  except re.error as e:
    return f"= {regex!r} is not a regex ({e})"
  repeats = [0]

  def walk(items: Any, in_repeat: bool) -> str | None:
    for op, arg in items:
      name = getattr(op, "name", str(op))
      inner: list = []
      if name in _REPEATS and arg[1] != 1:
        if in_repeat:
          return "has a repeat inside a repeat"
        repeats[0] += 1
        inner = [(arg[2], True)]
      elif name in _REPEATS:
        inner = [(arg[2], in_repeat)]
      elif name == "BRANCH":
        if in_repeat:
          return "has an alternation inside a repeat"
        inner = [(branch, in_repeat) for branch in arg[1]]
      elif name in ("SUBPATTERN", "ASSERT", "ASSERT_NOT"):
        inner = [(arg[-1], in_repeat)]
      elif name == "ATOMIC_GROUP":
        inner = [(arg, in_repeat)]
      elif name in ("GROUPREF", "GROUPREF_EXISTS"):
        return "has a back-reference"
      for sub, flag in inner:
        if problem := walk(sub, flag):
          return problem
    return None

  problem = walk(parsed, False)
  if problem is None and repeats[0] > MAX_REPEATS:
    problem = f"has {repeats[0]} repeats, more than {MAX_REPEATS}"
  return None if problem is None else f"= {regex!r:.80} {problem}: it could take exponential time"


def _sub_params_problem(spec: Any) -> str | None:
  if not isinstance(spec, dict) or not {"patterns", "shape"} <= spec.keys():
    return f"is {_show(spec)}, not a SubparamShape (patterns, shape, partition_dim)"
  patterns, shape, dim = spec["patterns"], spec["shape"], spec.get("partition_dim", 0)
  if not isinstance(patterns, list | tuple) or len(patterns) > MAX_PATTERNS:
    return f"['patterns'] is {_show(patterns)}, not a list of <= {MAX_PATTERNS}"
  for i, regex in enumerate(patterns):
    if problem := regex_problem(regex):
      return f"['patterns'][{i}] {problem}"
  if not isinstance(shape, list | tuple) or type(dim) is not int or not 0 <= dim < len(shape):
    return f"['shape'] {_show(shape)} has no partition_dim {dim!r:.20}"
  sizes = shape[dim]
  sizes = sizes if isinstance(sizes, list | tuple) else [sizes]
  if not sizes or not all(type(s) is int and s >= 1 for s in sizes):
    return f"['shape'][{dim}] is {_show(shape[dim])}, not sizes >= 1"
  return None
