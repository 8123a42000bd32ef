"""The tree layer's bookkeeping: pytrees <-> flat `{key: leaf}` maps.

Flax NNX `Variable`s are looked through (their value is the leaf, and the key
has no trailing `value`), so `nnx.state(model)` saves as `linear/kernel`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ucp_jax.base import _errors
from ucp_jax.store import _keypath


def is_variable(x: Any) -> bool:
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def variable_value(var: Any) -> Any:
  return var.get_value() if hasattr(var, "get_value") else var.value


def _with_value(var: Any, value: Any) -> Any:
  return var.replace(value)


def entry_name(entry: Any) -> str:
  """The plain name of one `jax.tree_util` path entry."""
  import jax

  if isinstance(entry, jax.tree_util.DictKey):
    return str(entry.key)
  if isinstance(entry, jax.tree_util.SequenceKey):
    return str(entry.idx)
  if isinstance(entry, jax.tree_util.GetAttrKey):
    return entry.name
  if isinstance(entry, jax.tree_util.FlattenedIndexKey):
    return str(entry.key)
  key = getattr(entry, "key", None)  # flax NNX and other custom path entries
  return str(key) if key is not None else str(entry)


def from_path(path: tuple[Any, ...]) -> str:
  """The checkpoint key (`store._keypath`) of a `jax.tree_util` key path."""
  return _keypath.join(entry_name(e) for e in path)


def flatten(tree: Any, *, prefix: str = "") -> tuple[dict[str, Any], Callable[[dict], Any]]:
  """Flattens `tree` into `{key: leaf}` and returns the function that rebuilds it.

  Raises:
    TreeMismatchError: two leaves would share a key.
  """
  import jax

  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)
  flat: dict[str, Any] = {}
  variables: list[Any] = []
  duplicates: list[str] = []
  for path, leaf in pairs:
    key = _keypath.under(prefix, from_path(path))
    if key in flat:
      duplicates.append(key)
    variables.append(leaf if is_variable(leaf) else None)
    flat[key] = variable_value(leaf) if is_variable(leaf) else leaf
  if duplicates:
    raise _errors.TreeMismatchError(
      "these keys name two leaves each (rename the dict entries):\n"
      + _errors.bullet_list(duplicates)
    )
  keys = list(flat)

  def unflatten(values: dict[str, Any]) -> Any:
    leaves = [
      _with_value(var, values[k]) if var is not None else values[k]
      for k, var in zip(keys, variables)
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)

  return flat, unflatten
