"""The tree layer's bookkeeping: pytrees <-> flat `{key: leaf}` maps.

Flax NNX `Variable`s are looked through (their value is the leaf, and the key
has no trailing `value`), so `nnx.state(model)` saves as `linear/kernel`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ucp_jax import _errors, _keypath


def _is_variable(x: Any) -> bool:
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def _variable_value(var: Any) -> Any:
  return var.get_value() if hasattr(var, "get_value") else var.value


def _with_value(var: Any, value: Any) -> Any:
  return var.replace(value)


def flatten(tree: Any, *, prefix: str = "") -> tuple[dict[str, Any], Callable[[dict], Any]]:
  """Flattens `tree` into `{key: leaf}` and returns the function that rebuilds it.

  Raises:
    TreeMismatchError: two leaves would share a key.
  """
  import jax

  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)
  flat: dict[str, Any] = {}
  variables: list[Any] = []
  duplicates: list[str] = []
  for path, leaf in pairs:
    key = _keypath.under(prefix, _keypath.from_path(path))
    if key in flat:
      duplicates.append(key)
    variables.append(leaf if _is_variable(leaf) else None)
    flat[key] = _variable_value(leaf) if _is_variable(leaf) else leaf
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


def structure(keys: list[str]) -> dict:
  """The nested-dict outline of a set of keys, leaves holding their full key."""
  root: dict = {}
  for key in keys:
    node = root
    parts = key.split("/")
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = key
  return root


def nest(values: dict[str, Any], outline: dict | None = None) -> Any:
  """Nested dicts (lists where every child name is 0..n-1) holding `values` by key."""
  outline = outline if outline is not None else structure(list(values))

  def build(node: Any) -> Any:
    if isinstance(node, str):
      return values[node]
    children = {_keypath.decode_part(k): build(v) for k, v in node.items()}
    if (
      children
      and all(k.isdigit() for k in children)
      and sorted(map(int, children)) == list(range(len(children)))
    ):
      return [children[str(i)] for i in range(len(children))]
    return children

  return build(outline)
