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
  stack(group=0, axis=0)    per-layer arrays `h.{i}.w` -> one array with a layer axis

Ready rule sets: `gpt2(...)`, `llama(...)`, for the reference models in `ucp_jax.models`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ucp_jax.mapping._mapped import MappedCheckpoint as MappedCheckpoint
from ucp_jax.mapping._mapping import RuleSet as RuleSet
from ucp_jax.mapping._rule import Rule as Rule
from ucp_jax.mapping._rulesets import gpt2 as gpt2
from ucp_jax.mapping._rulesets import llama as llama
from ucp_jax.mapping._transforms import Cast, Merge, Split, Stack, Transpose
from ucp_jax.mapping._transforms import Transform as Transform


def transpose(axes: Sequence[int] | None = None) -> Transform:
  """Permutes axes like `np.transpose` (default: reverses them).

  Example:
    >>> from ucp_jax import rules
    >>> rules.transpose().shape((8, 4), "float32")[0]
    (4, 8)
  """
  return Transpose(None if axes is None else tuple(int(a) for a in axes))


def split(axis: int, sizes: Sequence[int]) -> Transform:
  """Splits axis `axis` into `len(sizes)` axes (one size may be -1); inverse: `merge`.

  Example:
    >>> from ucp_jax import rules
    >>> rules.split(1, (12, -1)).shape((768, 768), "float32")[0]
    (768, 12, 64)
  """
  return Split(int(axis), tuple(int(s) for s in sizes))


def merge(axis: int, sizes: Sequence[int]) -> Transform:
  """Merges the `len(sizes)` axes from `axis` (sizes as `split`'s) into one; inverse: `split`.

  Example:
    >>> from ucp_jax import rules
    >>> rules.merge(1, (12, -1)).shape((768, 12, 64), "float32")[0]
    (768, 768)
  """
  return Merge(int(axis), tuple(int(s) for s in sizes))


def cast(dtype: str | np.dtype, source: str | np.dtype | None = None) -> Transform:
  """Converts to `dtype` on import; export converts back to `source` when given.

  Example:
    >>> from ucp_jax import rules
    >>> rules.cast("float32", "bfloat16").shape((2,), "bfloat16")[1]
    dtype('float32')
  """
  return Cast(np.dtype(dtype).name, None if source is None else np.dtype(source).name)


def stack(group: int = 0, *, axis: int = 0) -> Transform:
  """Stacks the layers numbered by capture group `group` along a new axis `axis`.

  Transforms listed before it apply to each layer, those after it to the stack;
  export unstacks. Layers must be numbered 0..n-1.

  Example:
    >>> from ucp_jax import rules
    >>> rule = rules.Rule(r"h\\.(\\d+)\\.w", "blocks/w", [rules.transpose(), rules.stack(0)])
    >>> rules.RuleSet([rule]).map_names(["h.0.w", "h.1.w"])
    {'blocks/w': ('h.0.w', 'h.1.w')}
  """
  return Stack(int(group), int(axis))


__all__ = [
  "MappedCheckpoint",
  "Rule",
  "RuleSet",
  "Transform",
  "cast",
  "gpt2",
  "llama",
  "merge",
  "split",
  "stack",
  "transpose",
]
