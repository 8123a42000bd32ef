"""A Flax-named checkpoint seen with torch names and layouts, for export.

`save_train_state` names parameters by their Flax keys (`blocks/0/mlp/fc/kernel`,
`[in, out]`). DeepSpeed needs the torch names and layouts (`h.0.mlp.fc.weight`,
`[out, in]`). A rule set run backwards (`RuleSet.export_arrays`) maps the values and
every optimizer slot; the result is a torch-named checkpoint in memory that the
exporter reads like a converted one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.mapping._load import ArraysCheckpoint
from ucp_jax.store import _checkpoint, _schema


def torch_named(ckpt: _checkpoint.Checkpoint, rules) -> _checkpoint.Checkpoint:
  """`ckpt` (naming "flax") as a torch-named checkpoint with the same schema otherwise.

  Holds every parameter, slot and buffer in host memory once.

  Raises:
    MappingError: keys the rules cannot map back (all listed).
  """
  schema = ckpt.manifest.typed_schema or _schema.Schema(params={})
  params = schema.params
  roles: dict[str, dict[str, np.ndarray]] = {"params": {}}
  for name, entry in params.items():
    if entry.value is not None:
      roles["params"][name] = ckpt.read(entry.value)
    for slot, key in entry.slots.items():
      roles.setdefault(slot, {})[name] = ckpt.read(key)
  mapped = {role: rules.export_arrays(arrays) for role, arrays in roles.items()}
  buffers = {}
  if schema.buffers:
    buffers = rules.export_arrays({n: ckpt.read(k) for n, k in schema.buffers.items()})

  names = list(mapped["params"])
  tied = _tied(mapped["params"])
  flax_key = {
    n: key for key, sources in rules.map_names(names, partial=True).items() for n in sources
  }
  entries = {n: params.get(flax_key.get(n, "")) or _schema.ParamEntry() for n in names}
  frozen = {n for n in names if entries[n].frozen}  # a value, no slots
  missing = [
    f"{role}: {n}"
    for role, arrays in mapped.items()
    for n in names
    if n not in arrays and n not in tied and (role == "params" or n not in frozen)
  ]
  if missing:
    raise _errors.MappingError(
      f"{ckpt.location}: slots missing after mapping back to torch names:\n"
      + _errors.bullet_list(missing)
    )
  arrays = {
    f"{role}/{n}": a for role, named in mapped.items() for n, a in named.items() if n not in tied
  }
  arrays |= {f"buffers/{n}": a for n, a in buffers.items()}
  new_params = {}
  for name in names:
    if name in tied:
      new_params[name] = _schema.ParamEntry(tied_to=tied[name])
      continue
    slots = {role: f"{role}/{name}" for role in mapped if role != "params" and name in mapped[role]}
    group = entries[name].group
    new_params[name] = _schema.ParamEntry(
      f"params/{name}", slots, 0 if group is None else group, frozen=not slots
    )
  torch_named = dataclasses.replace(
    schema, naming="torch", params=new_params, buffers={n: f"buffers/{n}" for n in buffers}
  )
  schema_json = _schema.written(torch_named, str(ckpt.location))
  source = ckpt.manifest.source
  return ArraysCheckpoint(arrays, ckpt.location, step=ckpt.step, schema=schema_json, source=source)


def _tied(arrays: dict[str, np.ndarray]) -> dict[str, str]:
  """Names whose array is another name's array (a tied rule writes the same object)."""
  first: dict[int, str] = {}
  tied = {}
  for name, array in arrays.items():
    owner = first.setdefault(id(array), name)
    if owner != name:
      tied[name] = owner
  return tied
