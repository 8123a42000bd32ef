"""Target shardings for a converted tensor-parallel checkpoint, from the patterns it records.

A converted TP/PP/EP checkpoint stores logical arrays in the source's layout (a torch Linear
weight is `[out, in]`) and, per parameter, the pattern that split it (`schema.params[NAME]
["pattern"]`, see `_patterns`). That is enough to choose a `NamedSharding` for every array on
any mesh, so a TP=2 checkpoint restores onto a mesh with any model-axis size without
hand-written PartitionSpecs:

| pattern | PartitionSpec |
|---|---|
| `column`, `sub_params` (and vocabulary-padded) | `model_axis` on `cat_dim` 0: a Linear's outputs (the output dimension of the Flax kernel it maps to) |
| `row` | `model_axis` on dim 1: a Linear's inputs |
| `expert` | `expert_axis` on dim 0 (the experts) |
| `replicated`, `average`, no pattern | replicated |

A dimension the axis size does not divide, or an axis the mesh lacks, falls back to
replicated. A fused `sub_params` array is split in contiguous blocks of the logical
`[q; k; v]`; a model that computes with per-head shards should take the sub-parameters apart
through the mapping layer first.
"""

from __future__ import annotations

import os
from typing import Any

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ucp_jax.store import _checkpoint, _reader


def tp_shardings(
  ckpt: str | os.PathLike | _checkpoint.Checkpoint,
  mesh: Mesh,
  *,
  model_axis: str = "model",
  expert_axis: str = "expert",
) -> Any:
  """A restore target: a `NamedSharding` for every array of a converted TP checkpoint.

  Example:
    >>> import jax, ucp_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> _ = ucp_jax.convert("tests/fixtures/tp/autotp_tp2_dp1/ckpt",  # DeepSpeed AutoTP, TP=2
    ...                     "/tmp/ucp_doc_tp", overwrite=True)
    >>> mesh = jax.make_mesh((1, jax.device_count()), ("data", "model"))
    >>> target = ucp_jax.tp_shardings("/tmp/ucp_doc_tp", mesh)
    >>> target["params"]["layers.0.mlp.down_proj.weight"].spec == P(None, "model")  # row
    True
    >>> state = ucp_jax.restore("/tmp/ucp_doc_tp", target)

  Args:
    ckpt: a checkpoint path or an open `Checkpoint` (converted by `ucp_jax.convert`).
    mesh: the target mesh.
    model_axis: the mesh axis that splits tensor-parallel dimensions.
    expert_axis: the mesh axis that splits experts.

  Returns:
    The checkpoint's tree (`{"params": {NAME: ...}, "exp_avg": {...}, ...}`) with a
    `NamedSharding` at every leaf; pass it to `ucp_jax.restore`.
  """
  ckpt = ckpt if isinstance(ckpt, _checkpoint.Checkpoint) else _reader.open(ckpt)
  schema = ckpt.manifest.typed_schema
  specs: dict[str, P] = {}
  for entry in [] if schema is None else schema.params.values():
    pattern = None if entry.pattern is None else dict(entry.pattern)
    for key in [entry.value, *entry.slots.values()]:
      if key is not None and key in ckpt and key not in specs:
        specs[key] = spec_for(pattern, ckpt[key].shape, mesh, model_axis, expert_axis)
  return _map_tree(ckpt.manifest.tree, lambda key: NamedSharding(mesh, specs.get(key, P())))


def spec_for(
  pattern: dict | None, shape: tuple[int, ...], mesh: Mesh, model_axis: str, expert_axis: str
) -> P:
  """The PartitionSpec of one array of `shape` whose parameter has `pattern` (see the table)."""
  if not pattern or pattern.get("kind") in (None, "replicated", "average"):
    return P()
  axis = expert_axis if pattern["kind"] == "expert" else model_axis
  dim = pattern.get("cat_dim", 1 if pattern["kind"] == "row" else 0)
  if axis not in mesh.axis_names or dim >= len(shape) or shape[dim] % mesh.shape[axis]:
    return P()
  spec: list[str | None] = [None] * len(shape)
  spec[dim] = axis
  return P(*spec)


def _map_tree(tree: Any, fn) -> Any:
  if isinstance(tree, dict):
    return {k: _map_tree(v, fn) for k, v in tree.items()}
  if isinstance(tree, list):
    return [_map_tree(v, fn) for v in tree]
  return fn(tree)
