"""One call to save, one to restore a Flax training state (NNX or Linen) with Optax slots.

The save fills the universal schema (docs/schema.md): every parameter with its Adam
moments or SGD momentum, the step and per-group hyperparameters, so that the same
checkpoint restores into JAX on any mesh and exports to DeepSpeed. The restore reads
either such a checkpoint or a converted PyTorch/DeepSpeed one, whose torch names and
layouts a rule set (`ucp_jax.rules`) carries onto the Flax model and its Optax state.
The optimizer state is read by its structure (`_optax`): `optax.MaskedNode` placeholders
are neither saved nor restored, they stay where optax put them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ucp_jax.base import _errors
from ucp_jax.integrations import _optax, _train_layout
from ucp_jax.store import _keypath, _reader, _schema
from ucp_jax.tree import _restore, _save, _tree


def save_train_state(
  path: str | os.PathLike,
  model: Any,
  optimizer: Any = None,
  *,
  step: int | None = None,
  hyperparams: dict | list[dict] | None = None,
  **save_options: Any,
) -> str:
  """Saves a Flax training state with its universal schema.

  Example:
    >>> import optax, ucp_jax
    >>> from flax import nnx
    >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    >>> _ = ucp_jax.save_train_state("/tmp/ucp_doc_ts", model, opt, step=0, overwrite=True,
    ...                              hyperparams={"lr": 1e-3, "weight_decay": 1e-4})
    >>> ucp_jax.open("/tmp/ucp_doc_ts").manifest.schema["params"]["kernel"]["slots"]
    {'exp_avg': 'optimizer/opt_state/0/mu/kernel', 'exp_avg_sq': 'optimizer/opt_state/0/nu/kernel'}

  Args:
    path: where to save (as `ucp_jax.save`).
    model: an `nnx.Module` (with `optimizer` an `nnx.Optimizer`), or a Linen
      `flax.training.train_state.TrainState` (and no `optimizer`).
    optimizer: the `nnx.Optimizer`, for NNX.
    step: the training step (default: the optimizer's step).
    hyperparams: per-group hyperparameters in torch's names (`lr`, `betas`, `eps`,
      `weight_decay`, `momentum`): one dict for all groups or one per group, in the
      optimizer's group order (each Optax state with slots is a group, numbered as they
      appear in the optimizer state: `optax.multi_transform` by label, sorted). Needed for a
      DeepSpeed export unless the optimizer uses `optax.inject_hyperparams`.
    **save_options: passed to `ucp_jax.save` (`overwrite`, `metadata`, ...).

  Returns:
    The checkpoint's location, as `ucp_jax.save` returns it.

  Raises:
    MappingError: `hyperparams` for another number of groups than the optimizer has.
    UcpError: whatever `ucp_jax.save` raises (a checkpoint in the way, a leaf it cannot
      store, an earlier `save_async`'s error).
  """
  tree, schema = with_schema(model, optimizer, hyperparams)
  if step is None and schema.optimizer is not None:
    step = schema.optimizer.step
  return _save.save(path, tree, step=step, schema=schema, **save_options)


def with_schema(model: Any, optimizer: Any, hyperparams: Any) -> tuple[dict, _schema.Schema]:
  """The tree `save_train_state` saves (Optax's placeholders left out) and its schema."""
  layout = _train_layout.layout(model, optimizer)
  flat, _ = _tree.flatten(layout.tree)
  flat = {k: v for k, v in flat.items() if not _optax.is_placeholder(v)}
  return _keypath.nest(flat), _train_layout.schema(flat, layout, hyperparams)


def restore_train_state(
  path: str | os.PathLike,
  model: Any,
  optimizer: Any = None,
  *,
  rules: Any = None,
  mesh: jax.sharding.Mesh | None = None,
  cast: bool = False,
  params_only: bool = False,
  max_host_bytes: int = _save.DEFAULT_HOST_BYTES,
) -> Any:
  """Restores a training state saved by `save_train_state`, or converted from DeepSpeed.

  NNX state is updated in place (and `(model, optimizer)` returned); a Linen
  `TrainState` is returned anew. Shardings come from the live arrays of `model` and
  `optimizer`, or, with `mesh`, from the partition specs their variables carry
  (`nnx.with_partitioning`); each device reads only its slice. An abstract target
  (`nnx.eval_shape`, sharded on an `AbstractMesh`) is placed on `mesh` or on the mesh
  of `jax.set_mesh`.

  Args:
    path: the checkpoint.
    model, optimizer: as for `save_train_state`; they define the target layout.
    rules: a `ucp_jax.rules.RuleSet` from the checkpoint's parameter names to the
      model's keys; required for a converted (torch-named) checkpoint.
    mesh: build shardings from the variables' partition specs on this mesh.
    cast: allow dtype conversion (e.g. fp32 masters into a bf16 model).
    params_only: restore the model's parameters and buffers only (fine-tuning with a new
      optimizer): the optimizer, and a Linen state's `opt_state` and `step`, keep their
      values, whatever optimizer the checkpoint was saved with. An NNX `model` given
      without `optimizer` restores this way too.
    max_host_bytes: as for `ucp_jax.restore`.

  Every parameter's slots are restored by name. A converted checkpoint's parameter
  groups are matched to the Optax groups (e.g. `optax.multi_transform` labels) by the
  parameters they hold, in any order; one Optax state may hold them all (a masked
  `optax.adamw`). From a converted checkpoint, every Optax step counter takes its step,
  `inject_hyperparams` states take its groups' hyperparameters, `optax.MultiSteps` starts
  an empty accumulation; buffers are restored where `rules` map them onto model variables.

  Returns:
    For NNX, `(model, optimizer)`, updated in place; for Linen, a new `TrainState`.

  Raises:
    MappingError: unmapped names, missing optimizer slots, Optax state that a converted
      checkpoint cannot hold (Lion, Adafactor, `optax.ema`, ...), Optax groups that are
      not the checkpoint's (another number, or one holding parameters of two checkpoint
      groups), an optimizer whose Optax states are not the checkpoint's (`optax.adabelief`
      into a checkpoint of `optax.adamw`; states that several optimizers share, such as
      adam's and adamw's, restore into each other): all listed at once, before any array
      is read.
    ShardingError: an abstract target on an `AbstractMesh` and no mesh to place it on.

  Example:
    >>> import jax.numpy as jnp, optax, ucp_jax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    >>> _ = ucp_jax.save_train_state("/tmp/ucp_doc_rts", model, opt, overwrite=True)
    >>> model.kernel[...] = jnp.zeros((2, 3))
    >>> _ = ucp_jax.restore_train_state("/tmp/ucp_doc_rts", model, opt)
    >>> bool(model.kernel[...].any())
    True
  """
  ckpt = _reader.open(path)
  layout = _train_layout.layout(model, optimizer)
  params_only = params_only or layout.opt_state is None
  flat, unflatten = _tree.flatten(_train_layout.with_mesh(layout.tree, mesh))
  holes = {k: v for k, v in flat.items() if _optax.is_placeholder(v)}
  target = {k: v for k, v in flat.items() if k not in holes}
  target = _train_layout.concrete_meshes(target, mesh)
  slots = layout.slots()
  schema = ckpt.manifest.typed_schema
  options = dict(cast=cast, max_host_bytes=max_host_bytes)
  naming = schema.naming if schema is not None else "flax"  # no schema: a plain JAX save
  target = _place_stragglers(target, layout, slots)
  kept = {}
  if params_only:
    model_keys = {f"{layout.params_prefix}/{k}" for k in layout.param_keys + layout.buffer_keys}
    kept = {k: layout.live[k] for k in target if k not in model_keys}
    target = {k: v for k, v in target.items() if k in model_keys}
    slots = _optax.find_slots(None, layout.opt_prefix, layout.param_keys)
  else:
    _check_states(ckpt, schema, slots)
  if naming == "flax" and rules is None:
    _check_layouts(ckpt, layout, target)
    asked, back = _scalars_as_stored(target, ckpt)
    asked = _place_stragglers(asked, layout, slots)  # numbers asked as arrays join the mesh
    try:
      restored = _restore.restore(ckpt, _keypath.nest(asked), partial=params_only, **options)
    except _errors.TreeMismatchError as e:  # in this function's words
      hint = "leave them out: params_only=True restores the model's parameters alone"
      raise _errors.TreeMismatchError(str(e).replace("pass partial=True to skip", hint)) from None
    values, _ = _tree.flatten(restored)
    values.update((k, _like(target[k], values[k])) for k in back)
  else:
    values = _Converted(ckpt, target, layout, slots, rules).restore(options)
  return _apply(model, optimizer, unflatten({**kept, **values, **holes}))


_LAYOUTS = {"model": "an NNX model and optimizer", "params": "a Linen TrainState"}


def _check_layouts(ckpt, layout, target: dict[str, Any]) -> None:
  """Refuses, in one line, a checkpoint of the other Flax API's training state (a Linen
  TrainState into an NNX model, or back): their keys share nothing, and a list of every key
  on both sides would hide why."""
  saved = {k.split("/", 1)[0] for k in ckpt.keys()}
  if layout.params_prefix in saved or not target:
    return
  other = next((p for p in _LAYOUTS if p in saved and p != layout.params_prefix), None)
  if other is None:
    return
  recipe = (
    "ucp_jax.restore(path, nnx.state(model, nnx.Param), subtree='params/params') reads its "
    "parameters into an NNX model whose modules are named like the Linen ones"
    if other == "params"
    else "ucp_jax.restore(path, {'params': params}, subtree='model') reads its parameters "
    "into a Linen params tree named like the NNX modules"
  )
  raise _errors.TreeMismatchError(
    f"{ckpt.location}: this checkpoint holds {_LAYOUTS[other]} (keys under {other}/), the "
    f"target is {_LAYOUTS[layout.params_prefix]} (keys under {layout.params_prefix}/): their "
    f"keys share nothing; {recipe}"
  )


def _check_states(ckpt, schema: _schema.Schema | None, slots: _optax.SlotMap) -> None:
  """Refuses an optimizer whose Optax states are not those the checkpoint recorded."""
  optimizer = None if schema is None else schema.optimizer
  problems = [] if optimizer is None else _optax.state_problems(dict(optimizer.states), slots)
  if problems:
    raise _errors.MappingError(
      f"{ckpt.location}: the optimizer is not the one this checkpoint was saved with; build "
      "that one, or restore the parameters only (params_only=True):\n"
      + _errors.bullet_list(problems)
    )


class _Converted:
  """A torch-named checkpoint restored into a Flax training state through `rules`.

  Parameters, their slots and mapped buffers are read; the step counters, `inject_hyperparams`
  hyperparameters and `optax.MultiSteps` accumulation are set from the schema; every other
  leaf (RNG state, ...) keeps the target's value.
  """

  def __init__(self, ckpt, target: dict[str, Any], layout, slots: _optax.SlotMap, rules: Any):
    self.ckpt, self.target, self.layout, self.slots, self.rules = ckpt, target, layout, slots, rules
    self.schema = ckpt.manifest.typed_schema or _schema.Schema(params={})
    self.optimizer = self.schema.optimizer or _schema.Optimizer()
    if rules is None:
      raise _errors.MappingError(
        f"{ckpt.location}: parameters are named the {self.schema.naming} way; pass "
        "rules=... (e.g. ucp_jax.rules.gpt2(num_heads=...)) to map them onto the model"
      )
    self.problems: list[str] = []

  def restore(self, options: dict) -> dict[str, Any]:
    wanted, views = self._wanted()
    members = self._members()
    self.problems += self._jax_only_problems()
    self.problems += _group_problems(self.optimizer, self.slots, members)
    values = self._set(members)
    rest = self._rest(wanted, values)
    if self.problems:
      raise _errors.MappingError(
        f"{self.ckpt.location}: cannot restore this training state:\n"
        + _errors.bullet_list(self.problems)
      )
    values.update(self._kept(rest))
    for subtree, keys in wanted.items():
      target = _keypath.nest({rel: self.target[key] for rel, key in keys.items()})
      restored = _restore.restore(views[subtree], target, subtree=subtree, partial=True, **options)
      restored, _ = _tree.flatten(restored)
      values.update({keys[rel]: value for rel, value in restored.items()})
    return values

  def _wanted(self) -> tuple[dict[str, dict[str, str]], dict[str, Any]]:
    """{subtree: {relative key: target key}} to read, and the mapped views; notes problems."""
    layout, rules = self.layout, self.rules
    prefix = layout.params_prefix
    wanted = {"params": {k: f"{prefix}/{k}" for k in layout.param_keys}}
    for param, by_slot in self.slots.slots.items():
      for slot, key in by_slot.items():
        wanted.setdefault(slot, {})[param] = key
    buffers = rules.map_names(list(self.schema.buffers), partial=True)
    mapped = [k for k in layout.buffer_keys if k in buffers]
    if mapped:
      wanted["buffers"] = {k: f"{prefix}/{k}" for k in mapped}
    views = {}
    for subtree in wanted:
      try:
        views[subtree] = rules.view(self.ckpt, subtree=subtree, partial=True)
      except _errors.MappingError as e:
        self.problems.append(str(e))
    frozen = self._frozen_in_checkpoint()
    said = set()
    for subtree, keys in wanted.items():
      if subtree not in views:
        continue
      found = {k[len(subtree) + 1 :] for k in views[subtree].keys()}
      for k in sorted(set(keys) - found):
        if subtree != "params" and k in frozen:
          if k not in said:
            said.add(k)
            slots = ", ".join(self.slots.slots[k])
            self.problems.append(
              f"{k}: frozen in the checkpoint (a value, no optimizer state), but the optimizer "
              f"holds it ({slots}); leave it out (nnx.Optimizer(wrt=...), an "
              "optax.set_to_zero label or optax.masked)"
            )
        else:
          self.problems.append(f"{k}: no `{subtree}` for it in the checkpoint")
    return wanted, views

  def _frozen_in_checkpoint(self) -> set[str]:
    names = [n for n, e in self.schema.params.items() if e.frozen]
    return set(self.rules.map_names(names, partial=True))

  def _members(self) -> list[dict[int, list[str]]]:
    """Per Optax group: the checkpoint groups of its parameters, with those parameters."""
    entries = self.schema.params
    named = [n for n, e in entries.items() if e.group is not None]
    source = {  # model key -> checkpoint groups of the names mapped onto it
      key: {entries[n].group for n in names}
      for key, names in self.rules.map_names(named, partial=True).items()
    }
    members: list[dict[int, list[str]]] = [{} for _ in self.slots.groups]
    for param, index in self.slots.group_of.items():
      for group in sorted(source.get(param, ()), key=str):
        members[index].setdefault(group, []).append(param)
    return members

  def _jax_only_problems(self) -> list[str]:
    kind = self.optimizer.type
    return [
      f"`{j.prefix}` (optax {j.form}: {', '.join(j.fields) or 'its state'} of {j.params} "
      f"parameter(s)): a converted checkpoint holds no such state (DeepSpeed has no names for "
      f"it; this checkpoint's optimizer is {kind}); it restores only from a JAX save"
      for j in self.slots.jax_only
    ]

  def _set(self, members: list[dict[int, list[str]]]) -> dict[str, Any]:
    """Leaves set from the schema: step counters, hyperparameters, MultiSteps accumulation."""
    target, values = self.target, {}
    step = self.optimizer.step
    if step is not None:
      for key in [*self.slots.counters, *self.layout.step_keys]:
        if key in target:
          values[key] = _like(target[key], step)
    for acc in self.slots.accumulators:
      for key in [acc.mini_step_key, *acc.acc.values()]:
        if key in target:
          values[key] = _like(target[key], 0)
    groups = [g.values for g in self.optimizer.groups]
    for group, held in zip(self.slots.groups, members):
      hypers = [groups[g] for g in sorted(held) if 0 <= g < len(groups)]
      common = {k: v for k, v in (hypers or [{}])[0].items() if all(h.get(k) == v for h in hypers)}
      for key, value in _optax.hyperparam_keys(group, common, set(target)).items():
        values[key] = _like(target[key], value)
    return values

  def _rest(self, wanted: dict[str, dict[str, str]], values: dict[str, Any]) -> list[str]:
    """The keys neither read nor set; notes the abstract ones nothing can give a value."""
    read = {key for keys in wanted.values() for key in keys.values()}
    rest = [k for k in self.target if k not in read and k not in values]
    optimizer = self.layout.opt_prefix + "/"
    can_init = self.layout.tx is not None and self.layout.init_params is not None
    self.problems += [
      f"{k}: abstract in the target (jax.ShapeDtypeStruct) and not in the checkpoint; restore "
      "into a model that holds a value for it"
      for k in rest
      if _is_abstract(self.layout.live.get(k)) and not (can_init and k.startswith(optimizer))
    ]
    return rest

  def _kept(self, rest: list[str]) -> dict[str, Any]:
    """The target's values of `rest`, or a fresh `tx.init`'s where the target is abstract."""
    live = self.layout.live
    fresh = self.layout.fresh_optimizer([k for k in rest if _is_abstract(live.get(k))])
    return {k: _placed(fresh[k] if k in fresh else live[k], self.target[k]) for k in rest}


def _group_problems(
  optimizer: _schema.Optimizer, slots: _optax.SlotMap, members: list[dict[int, list[str]]]
) -> list[str]:
  """Several Optax groups must hold the checkpoint's groups one each, matched by membership.

  The moments are restored per parameter whatever the groups; this catches an Optax
  partition (e.g. `optax.multi_transform` labels) that differs from the source's, which
  would train some parameters with another group's hyperparameters. One Optax state for
  every parameter (a masked `optax.adamw`) may hold several checkpoint groups.
  """
  groups = [g.values for g in optimizer.groups]
  if len(slots.groups) < 2:
    return []
  if len(slots.groups) != len(groups):
    return [f"the optimizer has {len(slots.groups)} parameter groups, the checkpoint {len(groups)}"]
  problems = [
    f"optimizer group {i} (`{slots.groups[i].prefix}`) holds parameters of several checkpoint "
    "groups (each Optax group must hold exactly one checkpoint group's, in any order): "
    + "; ".join(f"{_group_name(groups, g)}: {', '.join(ps)}" for g, ps in found.items())
    for i, found in enumerate(members)
    if len(found) > 1
  ]
  if problems:
    return problems
  holder: dict[int, int] = {}
  for i, found in enumerate(members):
    for group in found:
      if group in holder:
        j = holder[group]
        problems.append(
          f"optimizer groups {j} (`{slots.groups[j].prefix}`) and {i} (`{slots.groups[i].prefix}`)"
          f" both hold {_group_name(groups, group)}"
        )
      holder[group] = i
  return problems


def _group_name(groups: list[Mapping[str, Any]], group: int) -> str:
  """`checkpoint group 1 (lr 0.005, weight_decay 0.0)`."""
  hyper = groups[group] if 0 <= group < len(groups) else {}
  shown = ", ".join(f"{k} {hyper[k]}" for k in ("lr", "weight_decay") if k in hyper)
  return f"checkpoint group {group}" + (f" ({shown})" if shown else "")


def _place_stragglers(target: dict[str, Any], layout, slots: _optax.SlotMap) -> dict[str, Any]:
  """Leaves left on one device while the parameters live on a mesh follow the parameters.

  Optax creates its state where `init` ran (often one device): an optimizer slot takes
  its parameter's sharding, any other such leaf (step counters) is replicated.
  """
  named = jax.sharding.NamedSharding
  mesh = next(
    (x.sharding.mesh for x in target.values() if isinstance(getattr(x, "sharding", None), named)),
    None,
  )
  if mesh is None or mesh.size == 1:
    return target
  owner = {key: f"{layout.params_prefix}/{p}" for key, p in slots.slot_keys().items()}
  out = {}
  for key, leaf in target.items():
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
      param = target.get(owner.get(key, ""))
      like = getattr(param, "sharding", None)
      if not isinstance(like, named) or np.shape(param) != np.shape(leaf):
        like = named(mesh, jax.sharding.PartitionSpec())
      leaf = jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=like)
    out[key] = leaf
  return out


def _scalars_as_stored(target: dict[str, Any], ckpt) -> tuple[dict[str, Any], list[str]]:
  """A 0-d leaf asked for as the checkpoint holds it: a step saved as an array (a jitted
  Linen `apply_gradients`) into a Python number (`TrainState.create`), and a Python number
  into an array (then given back as the target's array: the keys returned)."""
  asked, back = dict(target), []
  for key, leaf in target.items():
    info = ckpt.manifest.arrays.get(key)
    if info is None or info.shape != () or isinstance(leaf, bool):
      continue
    if isinstance(leaf, (int, float)) and info.kind == "array":
      device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # a mesh's, if any, later
      asked[key] = jax.ShapeDtypeStruct((), np.dtype(info.dtype), sharding=device)
    elif info.kind == "scalar" and np.shape(leaf) == () and hasattr(leaf, "dtype"):
      asked[key] = {"int": 0, "float": 0.0, "bool": False}.get(info.python_type, leaf)
      back.append(key)
  return asked, back


def _is_abstract(leaf: Any) -> bool:
  return isinstance(leaf, jax.ShapeDtypeStruct)


def _like(leaf: Any, value: Any) -> Any:
  """`value` as an array shaped, typed and sharded like `leaf`."""
  if isinstance(leaf, (int, float)):
    return type(leaf)(value)
  host = np.full(np.shape(leaf), value, dtype=leaf.dtype)
  if isinstance(leaf, (np.ndarray, np.generic)):
    return host
  sharding = getattr(leaf, "sharding", None)
  return jax.device_put(host, sharding) if sharding is not None else jax.numpy.asarray(host)


def _placed(value: Any, like: Any) -> Any:
  """`value` on `like`'s sharding (moved only where it differs)."""
  sharding = getattr(like, "sharding", None)
  if sharding is None or not isinstance(value, jax.Array) or value.sharding == sharding:
    return value
  return jax.device_put(value, sharding)


def _apply(model: Any, optimizer: Any, values: Any) -> Any:
  from flax import nnx

  if isinstance(model, nnx.Module):
    nnx.update(model, values["model"])
    if optimizer is not None:
      nnx.update(optimizer, values["optimizer"])
    return model, optimizer
  return values
