"""Parameters sharded by logical axes: FSDP over `data`, TP over `model`, EP over `expert`.

Each reference model names the axes of its parameters logically (`LOGICAL_AXES`: the
attention's query kernel is `("embed", "heads", "head_dim")`); `AXIS_RULES` maps those
names onto mesh axes. A dimension is split over its mesh axes only where they exist in the
mesh, are not already used by an earlier dimension of the same array, and divide it: a
dimension they do not divide (one key/value head on a 4-way `model` axis) is replicated
over them, so any model fits any mesh.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ucp_jax.tree import _tree

AxisRules = Mapping[str, "str | tuple[str, ...] | None"]

AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
  "embed": "data",  # FSDP: the model width of every matrix, over the data axis
  "vocab": "model",  # TP (Megatron): vocabulary, heads and MLP units over the model axis
  "heads": "model",
  "kv_heads": "model",  # replicated where the axis does not divide them (fewer kv heads)
  "mlp": "model",
  "expert": "expert",  # EP: a layer's stacked experts over the expert axis
  "head_dim": None,
  "layers": None,  # the stacked layer axis of `scan=True` models
}
"""The default logical-axis rules; `models.build(..., axis_rules={...})` overrides any of them
(`{"embed": None}`: no FSDP; `{"mlp": ("model", "data")}`: a name over two mesh axes)."""

TP_RULES: dict[str, str | None] = {"vocab": "model", "heads": "model", "kv_heads": "model"}
TP_RULES |= {"mlp": "model"}
"""Megatron-style tensor parallelism alone (what `tp_state` uses): heads, MLP units and the
vocabulary over `model`, everything else replicated."""


def logical_names(key: str, ndim: int, table: Mapping[str, tuple], layers: str) -> tuple:
  """The logical name of each of the `ndim` axes of the parameter `key` (None: no name).

  A key ending in a suffix of `table` takes its names. Below `layers` (the key of the
  model's layers) without a layer number, the layers are stacked (`scan=True`): the first
  axis is `layers`. A parameter with fewer axes than its entry (a per-head norm's scale,
  where OLMo 2's is per projection) takes the trailing names.
  """
  parts = key.split("/")
  stacked = parts[0] == layers and len(parts) > 1 and not parts[1].isdigit()
  rank = ndim - stacked
  for suffix, names in table.items():
    if key == suffix or key.endswith("/" + suffix):
      names = tuple(names[max(0, len(names) - rank) :])
      names = (None,) * (rank - len(names)) + names
      return ("layers",) * stacked + names
  return (None,) * ndim


def spec_for(names: tuple, shape: tuple[int, ...], mesh: jax.sharding.Mesh, rules: AxisRules) -> P:
  """The PartitionSpec of an array of `shape` whose axes have logical `names`."""
  used: set[str] = set()
  parts: list[Any] = []
  for name, size in zip(names, shape):
    axes = rules.get(name) if name is not None else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    kept: list[str] = []
    for axis in axes:
      if axis in mesh.shape and axis not in used:
        n = mesh.shape[axis] * _prod(mesh.shape[a] for a in kept)
        if size % n == 0:
          kept.append(axis)
    used.update(kept)
    parts.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  while parts and parts[-1] is None:
    parts.pop()
  return P(*parts)


def _prod(values) -> int:
  out = 1
  for v in values:
    out *= v
  return out


def merged_rules(axis_rules: AxisRules | None) -> dict:
  return {**AXIS_RULES, **dict(axis_rules or {})}


def target(
  state: Any,
  mesh: jax.sharding.Mesh,
  table: Mapping[str, tuple],
  rules: AxisRules,
  layers: str = "layers",
) -> Any:
  """`state` as `jax.ShapeDtypeStruct`s with `NamedSharding`s by `table` and `rules`."""

  def leaf(path, x):
    names = [_tree.entry_name(e) for e in path]
    key = "/".join(names[:-1] if names[-1:] == ["value"] else names)
    names = logical_names(key, len(x.shape), table, layers)
    spec = spec_for(names, tuple(x.shape), mesh, rules)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(leaf, state)
