"""Mapped arrays into a live Flax NNX model: `load_into`, the public way in.

The arrays come from a checkpoint (any path `ucp_jax.open` reads: a ucp_jax checkpoint,
a DeepSpeed or Hugging Face folder) or from memory (a torch state dict, numpy or jax
arrays). Either way they go through `ucp_jax.restore`, so the checks are restore's
(every missing, unexpected, misshapen and mistyped key, at once, before any read) and
each device reads only its slice of each array, onto the sharding the model's
variable already has.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts

from ucp_jax.mapping._mapping import RuleSet
from ucp_jax.store import _checkpoint, _keypath, _location, _reader
from ucp_jax.store._checkpoint import Checkpoint
from ucp_jax.store._manifest import ArrayInfo, Manifest

_TORCH_DTYPES = {
  "torch.bfloat16": ml_dtypes.bfloat16,
  "torch.float8_e4m3fn": ml_dtypes.float8_e4m3fn,
  "torch.float8_e5m2": ml_dtypes.float8_e5m2,
}


def as_numpy(x: Any) -> np.ndarray:
  """A numpy array of `x`: numpy, jax, or a torch tensor (bfloat16 and float8 included)."""
  if hasattr(x, "detach") and hasattr(x, "numpy"):  # a torch tensor, without importing torch
    x = x.detach().cpu()
    dtype = _TORCH_DTYPES.get(str(x.dtype))
    return x.float().numpy().astype(dtype) if dtype is not None else x.numpy()
  return np.asarray(x)


class ArraysCheckpoint(Checkpoint):
  """In-memory arrays by name, as a read-only checkpoint (for `restore` and rule-set views)."""

  checksummed = False

  def __init__(
    self, arrays: Mapping[str, Any], where: str | _location.Location = "arrays", **manifest_fields
  ):
    """`where`: a name, or the location of the checkpoint the arrays come from (messages and
    reports name it); `manifest_fields`: what else the manifest records (`step`, `schema`,
    `source`)."""
    self._arrays = {str(name): as_numpy(a) for name, a in arrays.items()}
    infos = {
      name: ArrayInfo(a.shape, a.dtype.name, tuple(max(1, d) for d in a.shape))
      for name, a in self._arrays.items()
    }
    tree = _keypath.structure(sorted(infos))
    manifest = Manifest(arrays=infos, tree=tree, created="", **manifest_fields)
    if isinstance(where, str):
      where = _location.resolve(f"memory://{where}/")
    super().__init__(where, manifest)

  def open_future(self, key: str) -> ts.Future:
    self[key]
    promise: ts.Promise[ts.TensorStore]
    future: ts.Future[ts.TensorStore]
    promise, future = ts.Promise.new()
    promise.set_result(ts.array(self._arrays[key], copy=False))
    return future

  def verify(self, on_array=None) -> dict[str, str]:
    """Nothing to check: the arrays are in memory, not read from files."""
    for key in self.keys():
      if on_array is not None:
        on_array(key, self[key].nbytes)
    return {}

  def __repr__(self) -> str:
    return f"ArraysCheckpoint({len(self._arrays)} arrays)"


def mapped_state(
  model: Any,
  source: Any,
  rules: RuleSet | None = None,
  *,
  subtree: str | None = None,
  partial: bool = False,
  cast: bool = False,
  wrt: Any = None,
) -> tuple[Any, Any, Any]:
  """`(graphdef, state, rest)`: `model` split, `state` (its `wrt` variables) read from `source`.

  `nnx.merge(graphdef, state, rest)` is a model with the mapped values; `model` is untouched.
  """
  from flax import nnx

  graphdef, current, rest = nnx.split(model, nnx.Param if wrt is None else wrt, ...)  # type: ignore[misc]  # flax's stubs: one state per filter
  if _is_checkpoint_path(source):
    ckpt = _reader.open(source)
    if subtree is None:  # converted checkpoints and sources keep the weights under params/
      subtree = "params" if any(k.startswith("params/") for k in ckpt.keys()) else ""
  else:
    ckpt = ArraysCheckpoint(source)
  from ucp_jax.tree import _restore  # places arrays on devices: JAX, loaded here

  state = _restore.restore(ckpt, current, subtree=subtree, partial=partial, cast=cast, rules=rules)
  return graphdef, state, rest


def _is_checkpoint_path(source: Any) -> bool:
  return isinstance(source, (str, os.PathLike, _checkpoint.Checkpoint))


def load_into(
  model: Any,
  source: Any,
  rules: RuleSet | None = None,
  *,
  subtree: str | None = None,
  partial: bool = False,
  cast: bool = False,
  wrt: Any = None,
) -> Any:
  """Loads `source`'s arrays, mapped by `rules`, into the Flax NNX `model` in place; returns it.

  Each variable keeps its sharding (a model built under a mesh, or restored onto one,
  stays sharded; an abstract model from `nnx.eval_shape` gets arrays on one device, or
  on the shardings its variables carry), and each device reads only its slice.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from ucp_jax import rules
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> torch_sd = {"weight": np.ones((3, 2), np.float32), "bias": np.arange(3.0, dtype=np.float32)}
    >>> rs = rules.RuleSet([rules.Rule("weight", "kernel", [rules.transpose()]),
    ...                     rules.Rule("bias", "bias")])
    >>> rules.load_into(model, torch_sd, rs)(np.ones((1, 2), np.float32)).tolist()
    [[2.0, 3.0, 4.0]]

  Args:
    model: a Flax NNX model (sharded or not; abstract models too).
    source: `{name: array}` (a torch state dict as it is, numpy or jax arrays), or a
      checkpoint: a path `ucp_jax.open` reads, or an opened `ucp_jax.Checkpoint`.
    rules: maps the source's names and layouts onto the model's keys; None when the
      names are already the model's (`blocks/0/mlp/fc/kernel`).
    subtree: for a checkpoint, the key prefix the names live under; default `params` when
      the checkpoint has keys there (converted checkpoints, Hugging Face folders, ...).
    partial: leave out names no rule matches, and keys the model does not ask for.
    cast: convert dtypes to the model's (a bfloat16 checkpoint into a float32 model).
    wrt: the variables to load, an `nnx` filter (default: `nnx.Param`).

  Raises:
    MappingError: names or layouts `rules` cannot carry (all listed).
    TreeMismatchError, ShapeMismatchError, DtypeMismatchError: keys the model has and the
      mapped source does not (or the other way round), shapes and dtypes that differ, all
      listed, before anything is read or changed.
  """
  from flax import nnx

  _, state, _ = mapped_state(
    model, source, rules, subtree=subtree, partial=partial, cast=cast, wrt=wrt
  )
  nnx.update(model, state)
  return model
