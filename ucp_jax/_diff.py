"""`diff`: two checkpoints of any formats, compared array by array in bounded memory.

Each side is anything `ucp_jax.open` reads (a ucp_jax checkpoint, a DeepSpeed folder, a
Hugging Face folder, ...). Arrays are compared a block of rows at a time, so memory stays
near two blocks whatever the model size; a rule set maps the second side's names and
layouts onto the first's keys (a Flax checkpoint against the PyTorch folder it came from).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ucp_jax import _rule_specs
from ucp_jax.store import _checkpoint, _reader

_BLOCK_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class ArrayDiff:
  """How one array differs between the two sides.

  Attributes:
    key: the array's key (the first side's).
    problem: a shape or dtype difference, or None.
    max_abs: the largest absolute difference of the values (0.0 when equal).
    max_rel: the largest relative difference, |a - b| / max(|a|, |b|) (0.0 when equal).
    mismatched: how many elements differ beyond the tolerance (NaN matches only NaN, an
      infinity only the same infinity; integers compare exactly).
    identical: the same dtype and the same bytes.
  """

  key: str
  problem: str | None
  max_abs: float
  max_rel: float
  mismatched: int
  identical: bool = False


@dataclasses.dataclass(frozen=True)
class DiffReport:
  """What `diff` found.

  Attributes:
    only_a / only_b: keys on one side only.
    arrays: one entry per common key, in key order.
    atol, rtol: the tolerance used (an element matches if |a - b| <= atol + rtol * |b|).
  """

  a: str
  b: str
  only_a: tuple[str, ...]
  only_b: tuple[str, ...]
  arrays: tuple[ArrayDiff, ...]
  atol: float
  rtol: float
  not_compared: tuple[str, ...] = ()
  """Keys a rule set left out (on either side: optimizer slots, the step, buffers)."""
  hint: str = ""

  @property
  def differing(self) -> tuple[ArrayDiff, ...]:
    return tuple(d for d in self.arrays if d.problem or d.mismatched)

  @property
  def identical(self) -> bool:
    """The same keys, shapes, dtypes and bytes."""
    return not (self.only_a or self.only_b) and all(d.identical for d in self.arrays)

  @property
  def same_within_tolerance(self) -> bool:
    return not (self.only_a or self.only_b or self.differing)

  def verdict(self) -> str:
    """One line: identical, equal within the tolerance, or what differs; and what was not
    compared, or a hint when nothing could be."""
    return self._outcome() + self._left_out()

  def _left_out(self) -> str:
    if self.hint:
      return f"; {self.hint}"
    if not self.not_compared:
      return ""
    return (
      f"; {len(self.not_compared)} arrays outside the parameters not compared (optimizer "
      "slots, step, buffers: compare those without rules)"
    )

  def _outcome(self) -> str:
    n = len(self.arrays)
    if self.identical:
      return f"identical: {n} arrays"
    if self.same_within_tolerance:
      worst = max(self.arrays, key=lambda d: d.max_abs)
      return (
        f"equal within atol={self.atol:g}, rtol={self.rtol:g}: {n} arrays (largest difference "
        f"{worst.max_abs:.3g} in {worst.key})"
      )
    parts = []
    if self.only_a:
      parts.append(f"{len(self.only_a)} only in {self.a}")
    if self.only_b:
      parts.append(f"{len(self.only_b)} only in {self.b}")
    if self.differing:
      parts.append(f"{len(self.differing)} of {n} common arrays differ")
    return "differ: " + ", ".join(parts)


def diff(
  a: Any,
  b: Any,
  *,
  rules: Any = None,
  subtree: str | None = None,
  atol: float = 0.0,
  rtol: float = 0.0,
  progress: Callable[[str, int, int], None] | None = None,
) -> DiffReport:
  """Compares two checkpoints of any formats array by array.

  Example:
    >>> import numpy as np, ucp_jax
    >>> _ = ucp_jax.save("/tmp/ucp_doc_da", {"w": np.ones(3)}, overwrite=True)
    >>> _ = ucp_jax.save("/tmp/ucp_doc_db", {"w": np.ones(3) + 1e-9}, overwrite=True)
    >>> ucp_jax.diff("/tmp/ucp_doc_da", "/tmp/ucp_doc_db", atol=1e-6).verdict()
    'equal within atol=1e-06, rtol=0: 1 arrays (largest difference 1e-09 in w)'

  Args:
    a, b: checkpoints (paths or open checkpoints) of any format `ucp_jax.open` reads.
    rules: a `ucp_jax.rules.RuleSet` that maps `b`'s names and layouts onto `a`'s keys, or
      its name as `--rules` takes it (`"hf"`: from `b`'s config.json; docs/mapping.md).
    subtree: with `rules`, the key prefix of `a`'s parameters (default: the prefix its
      schema gives them, `model` for an NNX training state; else `params` when `a` has keys
      there; else the whole checkpoint). `b`'s mapped parameters are found likewise.
    atol, rtol: an element matches when |a - b| <= atol + rtol * |b|; the defaults ask
      for equal values (NaN matches NaN).
    progress: called as `progress(key, nbytes, total)` after each array.

  Returns:
    A `DiffReport`: the arrays compared (largest absolute and relative differences,
    elements off), those only in `a` or only in `b`, `same_within_tolerance`, and
    `verdict()`, one line that says it.

  Raises:
    CheckpointNotFoundError, SourceFormatError: `a` or `b` is no checkpoint `open` reads.
    MappingError: `rules` cannot carry `b`'s names onto `a`'s keys.
    CorruptCheckpointError: a chunk of either fails its checksum.
  """
  ckpt_a, ckpt_b = _reader.open(a), _reader.open(b)
  rules = _rule_specs.parse(rules, ckpt_b, flax_side=ckpt_a)
  keys_a = ckpt_a.keys()
  of_b = {k: k for k in ckpt_b.keys()}  # a's key -> b's key for the same array
  left_out: list[str] = []
  if rules is not None:
    prefix_a = _params_prefix(ckpt_a) if subtree is None else subtree.strip("/")
    prefix_b = _params_prefix(ckpt_b)  # where b's parameters live (`params` when converted)
    left_out = [k for k in ckpt_b.keys() if prefix_b and not k.startswith(prefix_b + "/")]
    ckpt_b = rules.view(ckpt_b, subtree=prefix_b, partial=True)
    left_out += [k for k in keys_a if prefix_a and not k.startswith(prefix_a + "/")]
    keys_a = [k for k in keys_a if not prefix_a or k.startswith(prefix_a + "/")]
    of_b = {_under(prefix_a, _below(prefix_b, k)): k for k in ckpt_b.keys()}
  common = [k for k in keys_a if k in of_b]
  hint = ""
  if rules is None and not common and keys_a and of_b:
    hint = (
      "no key in common: if one side has torch names (`h.0.attn.c_attn.weight`) and the other "
      "Flax keys, compare through a rule set (--rules hf, --rules gpt2:num_heads=N; "
      "docs/mapping.md)"
    )
  total = sum(ckpt_a[k].nbytes for k in common)
  arrays = []
  for key in common:
    arrays.append(_compare(ckpt_a, ckpt_b, key, of_b[key], atol, rtol))
    if progress is not None:
      progress(key, ckpt_a[key].nbytes, total)
  only_b = sorted(of_b[k] for k in set(of_b) - set(keys_a))
  return DiffReport(
    a=str(ckpt_a.location),
    b=os.fspath(b) if isinstance(b, (str, os.PathLike)) else str(b),
    only_a=tuple(k for k in keys_a if k not in of_b),
    only_b=tuple(only_b),
    arrays=tuple(arrays),
    atol=atol,
    rtol=rtol,
    not_compared=tuple(left_out),
    hint=hint,
  )


def _under(prefix: str, key: str) -> str:
  return f"{prefix}/{key}" if prefix else key


def _below(prefix: str, key: str) -> str:
  return key[len(prefix) + 1 :] if prefix else key


def _compare(ckpt_a, ckpt_b, key: str, key_b: str, atol: float, rtol: float) -> ArrayDiff:
  info_a, info_b = ckpt_a[key], ckpt_b[key_b]
  if tuple(info_a.shape) != tuple(info_b.shape):
    shapes = f"shape {tuple(info_a.shape)} vs {tuple(info_b.shape)}"
    return ArrayDiff(key, shapes, math.inf, math.inf, 0)
  same_dtype = info_a.dtype == info_b.dtype
  problem = None if same_dtype else f"dtype {info_a.dtype} vs {info_b.dtype}"
  identical = same_dtype
  max_abs = max_rel = 0.0
  mismatched = 0
  for index in _blocks(info_a.shape, max(np.dtype(info_a.dtype).itemsize, 1)):
    x, y = np.asarray(ckpt_a.read(key, index)), np.asarray(ckpt_b.read(key_b, index))
    identical = identical and x.tobytes() == y.tobytes()
    delta, scale = _deltas(x, y)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
      tolerance = atol + rtol * np.abs(_as_number(y))
      within = (delta == 0) | (np.isfinite(delta) & (delta <= tolerance))
      rel = np.where(delta == 0, 0.0, delta / np.where(scale == 0, 1.0, scale))
    if delta.size:
      max_abs = max(max_abs, float(delta.max()))
      max_rel = max(max_rel, float(np.nan_to_num(rel, nan=math.inf).max()))
      mismatched += int(np.count_nonzero(~within))
  return ArrayDiff(key, problem, max_abs, max_rel, mismatched, identical)


def _deltas(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(|x - y| where the elements differ, else 0; max(|x|, |y|)) as float64.

  Integers compare exactly (a difference float64 cannot show counts as at least 1); NaN
  equals NaN (each part of a complex number on its own); anything else not equal, an
  infinity against anything but itself included, differs by infinity.
  """
  xf, yf = _as_number(x), _as_number(y)
  if x.dtype.kind in "biu" and y.dtype.kind in "biu":
    equal = x == y
    delta = np.where(equal, 0.0, np.maximum(np.abs(xf - yf), 1.0))
  else:
    equal = _same(xf.real, yf.real) & _same(np.imag(xf), np.imag(yf))
    with np.errstate(invalid="ignore", over="ignore"):
      delta = np.where(equal, 0.0, np.abs(xf - yf))
    delta = np.where(np.isnan(delta), np.inf, delta)
  return delta, np.maximum(np.abs(xf), np.abs(yf))


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  return (a == b) | (np.isnan(a) & np.isnan(b))


def _as_number(array: np.ndarray) -> np.ndarray:
  """Values as float64 (complex as complex128), so every dtype compares alike."""
  array = np.asarray(array)
  if array.dtype.kind == "c":
    return array.astype(np.complex128)
  return array.astype(np.float64)


def _params_prefix(ckpt: _checkpoint.Checkpoint) -> str:
  """Where a checkpoint's parameters live: the prefix its schema's values share (`model` for
  an NNX training state, `params` for Linen's and converted ones), else `params` if there
  is such a subtree, else the root."""
  schema = ckpt.manifest.typed_schema
  values = [p.value for p in schema.params.values()] if schema is not None else []
  heads = {v.split("/", 1)[0] for v in values if v is not None and "/" in v}
  if len(heads) == 1:
    return heads.pop()
  return "params" if any(k.startswith("params/") for k in ckpt.keys()) else ""


def _blocks(shape: tuple[int, ...], itemsize: int):
  """Indices of blocks of about `_BLOCK_BYTES` in C order (the whole array when 0-d): row
  blocks, or parts of rows where a row alone is larger (a (1, 2**30) array is no one block)."""
  if not shape:
    yield ()
    return
  k = 0  # the dimension cut into steps: the dimensions after it fit in a block whole
  while k < len(shape) - 1 and math.prod(shape[k + 1 :]) * itemsize > _BLOCK_BYTES:
    k += 1
  row = max(1, math.prod(shape[k + 1 :]) * itemsize)
  step = max(1, _BLOCK_BYTES // row)
  for lead in itertools.product(*(range(n) for n in shape[:k])):
    for start in range(0, shape[k], step):
      yield (*lead, slice(start, min(start + step, shape[k])))
