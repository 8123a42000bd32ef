"""One call to save, one to restore a Flax training state (NNX or Linen) with Optax slots.

The save fills the universal schema (docs/schema.md): every parameter with its Adam
moments or SGD momentum, the step and per-group hyperparameters, so that the same
checkpoint restores into JAX on any mesh and exports to DeepSpeed. The restore reads
either such a checkpoint or a converted PyTorch/DeepSpeed one, whose torch names and
layouts a rule set (`ucp_jax.rules`) carries onto the Flax model and its Optax state.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from ucp_jax import _errors, _optax, _reader, _restore, _save, _tree


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
  """
  tree, params_prefix, param_keys, buffer_keys = _layout(model, optimizer)
  flat, _ = _tree.flatten(tree)
  slots = _optax.find_slots(param_keys, list(flat))
  schema = _schema(flat, params_prefix, param_keys, buffer_keys, slots, hyperparams)
  if step is None:
    step = schema["optimizer"]["step"]
  return _save.save(path, tree, step=step, schema=schema, **save_options)


def restore_train_state(
  path: str | os.PathLike,
  model: Any,
  optimizer: Any = None,
  *,
  rules: Any = None,
  mesh: jax.sharding.Mesh | None = None,
  cast: bool = False,
  max_host_bytes: int = _save.DEFAULT_HOST_BYTES,
) -> Any:
  """Restores a training state saved by `save_train_state`, or converted from DeepSpeed.

  NNX state is updated in place (and `(model, optimizer)` returned); a Linen
  `TrainState` is returned anew. Shardings come from the live arrays of `model` and
  `optimizer`, or, with `mesh`, from the partition specs their variables carry
  (`nnx.with_partitioning`); each device reads only its slice.

  Args:
    path: the checkpoint.
    model, optimizer: as for `save_train_state`; they define the target layout.
    rules: a `ucp_jax.rules.RuleSet` from the checkpoint's parameter names to the
      model's keys; required for a converted (torch-named) checkpoint.
    mesh: build shardings from the variables' partition specs on this mesh.
    cast: allow dtype conversion (e.g. fp32 masters into a bf16 model).
    max_host_bytes: as for `ucp_jax.restore`.

  Every parameter's slots are restored by name. A converted checkpoint's parameter
  groups are matched to the Optax groups (e.g. `optax.multi_transform` labels) by the
  parameters they hold, in any order; one Optax state may hold them all (a masked
  `optax.adamw`). Buffers are restored where `rules` map them onto model variables.

  Raises:
    MappingError: unmapped names, missing optimizer slots, Optax groups that are not the
      checkpoint's (another number, or one holding parameters of two checkpoint groups):
      all listed at once, before any array is read.
  """
  ckpt = _reader.open(path)
  tree, params_prefix, param_keys, buffer_keys = _layout(model, optimizer)
  tree = _with_mesh(tree, mesh)
  flat, unflatten = _tree.flatten(tree)
  flat = _place_stragglers(flat, params_prefix, param_keys)
  tree = unflatten(flat)
  schema = ckpt.manifest.schema or {}
  options = dict(cast=cast, max_host_bytes=max_host_bytes)
  naming = schema.get("naming", "torch") if schema else "flax"  # no schema: a plain JAX save
  if naming == "flax" and rules is None:
    values = _restore.restore(ckpt, tree, **options)
  else:
    keys = (params_prefix, param_keys, buffer_keys)
    values = unflatten(_restore_converted(ckpt, flat, keys, rules, options))
  return _apply(model, optimizer, values)


def _restore_converted(ckpt, flat, keys, rules, options) -> dict[str, Any]:
  """Parameters, slots and buffers from a torch-named checkpoint, through `rules`.

  Every parameter needs its value and slots; a buffer is restored where the rules map a
  checkpoint buffer onto a model variable, other variables (RNG state) are kept.
  """
  params_prefix, param_keys, buffer_keys = keys
  schema = ckpt.manifest.schema or {}
  if rules is None:
    raise _errors.MappingError(
      f"{ckpt.location}: parameters are named the {schema.get('naming')} way; pass "
      "rules=... (e.g. ucp_jax.rules.gpt2(num_heads=...)) to map them onto the model"
    )
  slots = _optax.find_slots(param_keys, list(flat))
  wanted = {"params": {k: f"{params_prefix}/{k}" for k in param_keys}}
  for param, by_slot in slots.slots.items():
    for slot, key in by_slot.items():
      wanted.setdefault(slot, {})[param] = key
  buffers = rules.map_names(list(schema.get("buffers") or {}), partial=True)
  if any(k in buffers for k in buffer_keys):
    wanted["buffers"] = {k: f"{params_prefix}/{k}" for k in buffer_keys if k in buffers}
  problems, views = [], {}
  for subtree in wanted:
    try:
      views[subtree] = rules.view(ckpt, subtree=subtree, partial=True)
    except _errors.MappingError as e:
      problems.append(str(e))
  for subtree, keys in wanted.items():
    found = {k[len(subtree) + 1 :] for k in views[subtree].keys()} if subtree in views else set()
    missing = sorted(set(keys) - found) if subtree in views else []
    problems += [f"{k}: no `{subtree}` for it in the checkpoint" for k in missing]
  problems += _group_problems(schema, rules, slots)
  if problems:
    raise _errors.MappingError(
      f"{ckpt.location}: cannot restore this training state:\n" + _errors.bullet_list(problems)
    )
  values = dict(flat)
  for subtree, keys in wanted.items():
    target = _tree.nest({rel: flat[key] for rel, key in keys.items()})
    restored = _restore.restore(views[subtree], target, subtree=subtree, partial=True, **options)
    restored, _ = _tree.flatten(restored)
    values.update({keys[rel]: value for rel, value in restored.items()})
  step = (schema.get("optimizer") or {}).get("step")
  if step is not None:
    counters = [g.count_key for g in slots.groups if g.count_key is not None]
    for key in [*counters, "optimizer/step", "step"]:
      if key in flat:
        values[key] = _like(flat[key], step)
  return values


def _group_problems(schema: dict, rules: Any, slots: _optax.SlotMap) -> list[str]:
  """Several Optax groups must hold the checkpoint's groups one each, matched by membership.

  The moments are restored per parameter whatever the groups; this catches an Optax
  partition (e.g. `optax.multi_transform` labels) that differs from the source's, which
  would train some parameters with another group's hyperparameters. One Optax state for
  every parameter (a masked `optax.adamw`) may hold several checkpoint groups.
  """
  groups = (schema.get("optimizer") or {}).get("groups") or []
  if len(slots.groups) < 2:
    return []
  if len(slots.groups) != len(groups):
    return [f"the optimizer has {len(slots.groups)} parameter groups, the checkpoint {len(groups)}"]
  entries = schema.get("params") or {}
  named = [n for n, e in entries.items() if isinstance(e, dict) and e.get("group") is not None]
  source_groups = {  # model key -> checkpoint groups of the names mapped onto it
    key: {entries[n]["group"] for n in names}
    for key, names in rules.map_names(named, partial=True).items()
  }
  members: list[dict[int, list[str]]] = [{} for _ in slots.groups]  # optax -> ckpt groups
  for param, index in slots.group_of.items():
    for group in sorted(source_groups.get(param, ())):
      members[index].setdefault(group, []).append(param)
  problems = [
    f"optimizer group {i} (`{slots.groups[i].prefix}`) holds parameters of several checkpoint "
    "groups (each Optax group must hold exactly one checkpoint group's, in any order): "
    + "; ".join(f"{_group_name(groups, g)}: {', '.join(ps)}" for g, ps in sorted(found.items()))
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


def _group_name(groups: list[dict], group: int) -> str:
  """`checkpoint group 1 (lr 0.005, weight_decay 0.0)`."""
  hyper = groups[group] if isinstance(group, int) and 0 <= group < len(groups) else {}
  shown = ", ".join(f"{k} {hyper[k]}" for k in ("lr", "weight_decay") if k in hyper)
  return f"checkpoint group {group}" + (f" ({shown})" if shown else "")


def _place_stragglers(flat: dict[str, Any], params_prefix: str, param_keys: list[str]) -> dict:
  """Leaves left on one device while the parameters live on a mesh follow the parameters.

  Optax creates its state where `init` ran (often one device): an optimizer slot takes
  its parameter's sharding, any other such leaf (step counters) is replicated.
  """
  named = jax.sharding.NamedSharding
  mesh = next(
    (x.sharding.mesh for x in flat.values() if isinstance(getattr(x, "sharding", None), named)),
    None,
  )
  if mesh is None or mesh.devices.size == 1:
    return flat
  slots = _optax.find_slots(param_keys, list(flat))
  owner = {key: f"{params_prefix}/{p}" for p, by in slots.slots.items() for key in by.values()}
  out = {}
  for key, leaf in flat.items():
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
      param = flat.get(owner.get(key, ""))
      like = getattr(param, "sharding", None)
      if not isinstance(like, named) or np.shape(param) != np.shape(leaf):
        like = named(mesh, jax.sharding.PartitionSpec())
      leaf = jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=like)
    out[key] = leaf
  return out


def _like(leaf: Any, value: Any) -> Any:
  """`value` as an array shaped, typed and sharded like `leaf`."""
  if isinstance(leaf, (int, float)):
    return type(leaf)(value)
  host = np.full(np.shape(leaf), value, dtype=leaf.dtype)
  sharding = getattr(leaf, "sharding", None)
  return jax.device_put(host, sharding) if sharding is not None else host


def _layout(model: Any, optimizer: Any) -> tuple[Any, str, list[str], list[str]]:
  """(tree to save, key prefix of the parameters, parameter keys, buffer keys)."""
  from flax import nnx

  if isinstance(model, nnx.Module):
    params, _ = _tree.flatten(nnx.state(model, nnx.Param))
    everything, _ = _tree.flatten(nnx.state(model))
    tree = {"model": nnx.state(model)}
    if optimizer is not None:
      tree["optimizer"] = nnx.state(optimizer)
    return tree, "model", list(params), [k for k in everything if k not in params]
  if hasattr(model, "params") and hasattr(model, "opt_state"):  # Linen TrainState
    if optimizer is not None:
      raise TypeError("a Linen TrainState holds its optimizer state; pass no `optimizer`")
    params, _ = _tree.flatten(model.params)
    return model, "params", list(params), []
  raise TypeError(
    f"expected an nnx.Module (+ nnx.Optimizer) or a Linen TrainState, got {type(model).__name__}"
  )


def _schema(flat, params_prefix, param_keys, buffer_keys, slots, hyperparams) -> dict:
  groups = [_optax.group_hyperparams(g, flat) for g in slots.groups] or [{}]
  given = hyperparams if isinstance(hyperparams, list) else [hyperparams or {}] * len(groups)
  if len(given) != len(groups):
    raise _errors.MappingError(
      f"hyperparams for {len(given)} groups, the optimizer has {len(groups)} parameter groups"
    )
  groups = [{**found, **extra} for found, extra in zip(groups, given)]
  kinds = {g.kind for g in slots.groups}
  kind = (
    "sgd" if kinds == {"sgd"} else "adamw" if any(g.get("weight_decay") for g in groups) else "adam"
  )
  params = {}
  for key in param_keys:
    entry = {"value": f"{params_prefix}/{key}", "slots": slots.slots.get(key, {})}
    entry["frozen"] = key not in slots.slots
    if key in slots.group_of:
      entry["group"] = slots.group_of[key]
    params[key] = entry
  buffer_prefix = "model" if params_prefix == "model" else params_prefix
  return {
    "version": 1,
    "naming": "flax",
    "params": params,
    "buffers": {
      k[len(buffer_prefix) + 1 :]: k for k in (f"{buffer_prefix}/{b}" for b in buffer_keys)
    },
    "optimizer": {"type": kind, "step": _optax.step_of(slots, flat), "groups": groups},
    "extra": {},
  }


def _with_mesh(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
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


def _apply(model: Any, optimizer: Any, values: Any) -> Any:
  from flax import nnx

  if isinstance(model, nnx.Module):
    nnx.update(model, values["model"])
    if optimizer is not None:
      nnx.update(optimizer, values["optimizer"])
    return model, optimizer
  return values
