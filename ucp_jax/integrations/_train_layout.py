"""What a Flax training state is made of: its tree, parameters, buffers and Optax state.

`layout(model, optimizer)` reads an NNX model with its `nnx.Optimizer`, or a Linen
`TrainState`, into a `Layout`; `schema` describes a save of it in the universal schema
(docs/schema.md); `with_mesh` and `concrete_meshes` give a target its shardings.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ucp_jax.base import _errors
from ucp_jax.integrations import _optax
from ucp_jax.store import _schema
from ucp_jax.tree import _tree


@dataclasses.dataclass
class Layout:
  """A training state's tree and where its parts sit in it (keys as the tree layer's)."""

  tree: Any  # what is saved: {"model": ..., "optimizer": ...} (NNX) or the TrainState
  params_prefix: str  # "model" (NNX) or "params" (Linen)
  param_keys: list[str]  # relative to params_prefix
  buffer_keys: list[str]  # relative to params_prefix: non-Param model variables (NNX)
  opt_state: Any  # the live Optax state (None: no optimizer)
  opt_prefix: str  # its key
  step_keys: list[str]  # the training loop's step counters
  trained: set[str] | None  # the parameters `nnx.Optimizer(wrt=...)` selects; None: all
  tx: Any = None  # the Optax transformation
  init_params: Callable[[], Any] | None = None  # the tree `tx.init` was given

  @functools.cached_property
  def live(self) -> dict[str, Any]:
    return _tree.flatten(self.tree)[0]

  def slots(self) -> _optax.SlotMap:
    return _optax.find_slots(self.opt_state, self.opt_prefix, self.param_keys)

  def fresh_optimizer(self, keys: list[str]) -> dict[str, Any]:
    """The values a fresh `tx.init` gives the optimizer keys among `keys` (one jit call;
    the parameter-sized zeros it needs are never materialized unless asked for)."""
    wanted = [k for k in keys if k.startswith(self.opt_prefix + "/")]
    if not wanted or self.tx is None or self.init_params is None:
      return {}
    import jax.numpy as jnp

    params, tx, prefix = self.init_params(), self.tx, self.opt_prefix

    def init():
      zeros = jax.tree.map(lambda x: jnp.zeros(np.shape(x), x.dtype), params)
      flat, _ = _tree.flatten(tx.init(zeros), prefix=prefix)
      return {k: flat[k] for k in wanted if k in flat}

    return jax.jit(init)()


def layout(model: Any, optimizer: Any) -> Layout:
  from flax import nnx

  if isinstance(model, nnx.Module):
    params, _ = _tree.flatten(nnx.state(model, nnx.Param))
    everything, _ = _tree.flatten(nnx.state(model))
    tree = {"model": nnx.state(model)}
    trained, opt_state, tx, init_params = None, None, None, None
    if optimizer is not None:
      tree["optimizer"] = nnx.state(optimizer)
      opt_state, tx = getattr(optimizer, "opt_state", None), getattr(optimizer, "tx", None)
      wrt = getattr(optimizer, "wrt", None)
      if wrt is not None:
        trained = set(_tree.flatten(nnx.state(model, wrt))[0]) & set(params)
        init_params = functools.partial(nnx.state, model, wrt)
    return Layout(
      tree=tree,
      params_prefix="model",
      param_keys=list(params),
      buffer_keys=[k for k in everything if k not in params],
      opt_state=opt_state,
      opt_prefix="optimizer/opt_state",
      step_keys=["optimizer/step"],
      trained=trained,
      tx=tx,
      init_params=init_params,
    )
  if hasattr(model, "params") and hasattr(model, "opt_state"):  # Linen TrainState
    if optimizer is not None:
      raise TypeError("a Linen TrainState holds its optimizer state; pass no `optimizer`")
    params, _ = _tree.flatten(model.params)
    return Layout(
      tree=model,
      params_prefix="params",
      param_keys=list(params),
      buffer_keys=[],
      opt_state=model.opt_state,
      opt_prefix="opt_state",
      step_keys=["step"],
      trained=None,
      tx=getattr(model, "tx", None),
      init_params=lambda: model.params,
    )
  raise TypeError(
    f"expected an nnx.Module (+ nnx.Optimizer) or a Linen TrainState, got {type(model).__name__}"
  )


def schema(flat: dict[str, Any], layout: Layout, hyperparams: Any) -> _schema.Schema:
  """The universal schema of a save of `flat` (the layout's leaves, placeholders left out)."""
  slots = layout.slots()
  groups = [_optax.group_hyperparams(g, flat) for g in slots.groups] or [{}]
  if len(groups) == 1 and layout.tx is not None:  # a plain optax.adamw(...): its own numbers
    groups = [{**_optax.transformation_hyperparams(layout.tx), **groups[0]}]
  given = hyperparams if isinstance(hyperparams, list) else [hyperparams or {}] * len(groups)
  if len(given) != len(groups):
    raise _errors.MappingError(
      f"hyperparams for {len(given)} groups, the optimizer has {len(groups)} parameter groups"
    )
  groups = [{**found, **extra} for found, extra in zip(groups, given)]
  frozen = _frozen(layout, slots)
  prefix = layout.params_prefix
  params = {
    key: _schema.ParamEntry(
      value=f"{prefix}/{key}",
      slots=slots.slots.get(key, {}),
      group=None if key in frozen else slots.group_of.get(key, 0),
      frozen=key in frozen,
    )
    for key in layout.param_keys
  }
  step = _optax.step_of(slots, flat)
  if step is None:  # no state counts steps (sgd): the training loop's counter
    step = next((int(np.asarray(flat[k])) for k in layout.step_keys if k in flat), None)
  optimizer = _schema.Optimizer(
    type=_kind(layout, slots, groups),
    step=step,
    groups=tuple(map(_schema.GroupEntry, groups)),
    states=slots.states,
    jax_only=tuple(_jax_only(flat, layout, slots)),
  )
  buffers = {b: f"{prefix}/{b}" for b in layout.buffer_keys}
  return _schema.Schema(params, buffers, optimizer, naming="flax")


def _frozen(layout: Layout, slots: _optax.SlotMap) -> set[str]:
  """Parameters the optimizer does not train: outside `wrt`; no optimizer; or no state
  holding them while some state holds others (an `optax.set_to_zero` label, `optax.masked`).
  An optimizer holding no parameter at all (plain SGD) trains every one."""
  if layout.opt_state is None:
    return set(layout.param_keys)
  held = slots.held()
  out = {k for k in layout.param_keys if held and k not in held}
  if layout.trained is not None:
    out |= {k for k in layout.param_keys if k not in layout.trained}
  return out


def _kind(layout: Layout, slots: _optax.SlotMap, groups: list[dict]) -> str:
  """`adam`, `adamw`, `sgd`, or `optax:<states>` for states with no torch names."""
  kinds = {g.kind for g in slots.groups}
  other = sorted(k for k in kinds if k not in ("adam", "sgd"))
  if other:
    return "optax:" + "+".join(other)
  if kinds == {"sgd"} or (not kinds and layout.opt_state is not None):
    return "sgd"
  return "adamw" if any(g.get("weight_decay") for g in groups) else "adam"


def _jax_only(flat: dict[str, Any], layout: Layout, slots: _optax.SlotMap) -> list[dict]:
  """State a DeepSpeed export cannot carry: refused (optimizer slots) or dropped (noted)."""
  out: list[dict[str, Any]] = [
    {
      "state": j.prefix,
      "form": j.form,
      "slots": list(j.fields),
      "params": j.params,
      "export": "refuse",
    }
    for j in slots.jax_only
  ]
  for acc in slots.accumulators:
    mini = flat.get(acc.mini_step_key) if acc.mini_step_key else None
    mini_step = int(np.asarray(mini)) if mini is not None else 0
    entry: dict[str, Any] = {"state": acc.prefix, "form": "MultiStepsState"}
    entry.update(slots=["acc_grads"], mini_step=mini_step, export="drop")
    out.append(entry)
  for where in _outside(flat, layout):
    out.append({"state": where, "form": "not optimizer state", "slots": [], "export": "drop"})
  return out


def _outside(flat: dict[str, Any], layout: Layout) -> list[str]:
  """Subtrees that are neither model, optimizer state nor step (an EMA tree, ...)."""
  if layout.params_prefix == "model":  # NNX: the optimizer's own attributes
    inside, top = ("model/", layout.opt_prefix + "/", *layout.step_keys), 2
  else:
    inside, top = ("params/", layout.opt_prefix + "/", *layout.step_keys), 1
  found = [k for k in flat if not (k in inside or k.startswith(inside))]
  return list(dict.fromkeys("/".join(k.split("/")[:top]) for k in found))


def with_mesh(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
  """The tree's leaves as abstract arrays sharded by their variables' partition specs."""
  if mesh is None:
    return tree
  from flax import nnx

  specs = nnx.get_partition_spec(tree)

  def abstract(leaf, spec):
    spec = spec if isinstance(spec, jax.sharding.PartitionSpec) else jax.sharding.PartitionSpec()
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)

  return jax.tree.map(abstract, tree, specs)


def concrete_meshes(flat: dict[str, Any], mesh: jax.sharding.Mesh | None) -> dict[str, Any]:
  """Leaves sharded on an `AbstractMesh` (`nnx.eval_shape`) placed on `mesh`, else on the
  mesh of `jax.set_mesh`, with the same axis names and sizes.

  Raises:
    ShardingError: no such mesh, or one of other axes (every abstract mesh listed).
  """
  abstract = {
    k: leaf
    for k, leaf in flat.items()
    if isinstance(getattr(getattr(leaf, "sharding", None), "mesh", None), jax.sharding.AbstractMesh)
  }
  if not abstract:
    return flat
  concrete = mesh if mesh is not None else jax.sharding.get_mesh()
  meshes = list(dict.fromkeys(leaf.sharding.mesh for leaf in abstract.values()))
  if concrete is None or concrete.empty:
    raise _errors.ShardingError(
      f"the target is sharded on {_axes(meshes)}, an AbstractMesh (nnx.eval_shape builds "
      "one), which no device holds; pass mesh=... or restore inside `with jax.set_mesh(mesh):`"
    )
  differ = [m for m in meshes if _sizes(m) != _sizes(concrete)]
  if differ:
    raise _errors.ShardingError(
      f"the target is sharded on {_axes(differ)}, the mesh to place it on is "
      f"{_axes([concrete])}: axis names and sizes must match"
    )
  out = dict(flat)
  for key, leaf in abstract.items():
    sharding = jax.sharding.NamedSharding(concrete, leaf.sharding.spec)
    out[key] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
  return out


def _sizes(mesh: Any) -> tuple[tuple[str, int], ...]:
  return tuple(zip(mesh.axis_names, mesh.axis_sizes))


def _axes(meshes: list[Any]) -> str:
  return " and ".join("(" + ", ".join(f"{n}={s}" for n, s in _sizes(m)) + ")" for m in meshes)
