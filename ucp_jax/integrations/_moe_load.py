"""Native DeepSpeed MoE in a universal load: every expert-parallel rank its own experts.

DeepSpeed 0.19.8's universal `load_checkpoint` reads each parameter from
`zero/<its name>/` by the engine's own names, and a native `deepspeed.moe.layer.MoE` names
its experts by *local* number (`...deepspeed_experts.{j}...`): at ep > 1 every
expert-parallel rank gets experts 0..num_local-1, rank 0's, silently. `place_native_experts`
(called by `ucp_jax.deepspeed.finish_load`) loads each local expert's fp32 master and Adam
moments from the files of its *global* number (`e * num_local + j`), as the exports of
`ucp_jax.export` name them, and sets them into the engine's partitions. Needs torch and
deepspeed.
"""

from __future__ import annotations

import os
import re

_LOCAL = re.compile(r"^(.*\.deepspeed_experts\.)([0-9]+)(\..*)\Z")


def _moe_modules(engine):
  opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
  if not any(g.get("moe") for g in opt.param_groups):
    return  # no expert groups: nothing to place (and no deepspeed import needed)
  try:
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups
  except ImportError:  # no native MoE without deepspeed
    return

  for prefix, module in engine.module.named_modules():
    if isinstance(module, MoE):
      rank = groups._get_expert_parallel_rank(module.expert_group_name)
      yield prefix, module, rank * module.num_local_experts


def _renamed(name: str, offset: int) -> str:
  m = _LOCAL.match(name)
  return name if m is None else f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}"


def global_names(engine, groups: list[set[str]] | None) -> list[set[str]] | None:
  """The engine's param groups with each native expert by its global name."""
  if groups is None:
    return None
  offsets = {}
  for prefix, _, first in _moe_modules(engine):
    offsets[f"{prefix}."] = first
  if not any(offsets.values()):
    return groups
  out = []
  for names in groups:
    renamed = set()
    for name in names:
      offset = next((o for p, o in offsets.items() if name.startswith(p)), 0)
      renamed.add(_renamed(name, offset))
    out.append(renamed)
  return out


def place_native_experts(engine, zero: str) -> list[str]:
  """Loads each local native expert of an expert-parallel rank > 0 from its global files."""
  import torch
  from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

  moved = []
  optimizer = engine.optimizer
  if hasattr(optimizer, "_hp_optimizer_states_linked"):  # 0.19.8 links the moments of the
    optimizer._hp_optimizer_states_linked = False  # group stepped first only
    optimizer._lazy_init_hp_params_optimizer_state()
  for prefix, module, first in _moe_modules(engine):
    if first == 0:
      continue
    for local, param in module.named_parameters(prefix=prefix):
      name = _renamed(local, first)
      if name == local:
        continue
      folder = os.path.join(zero, name)
      if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: expert {name} is not in the checkpoint")

      def load(slot: str, folder: str = folder, shape=param.shape):
        data = torch.load(
          os.path.join(folder, f"{slot}.pt"), map_location="cpu", weights_only=False
        )
        return (data["param"] if isinstance(data, dict) else data).reshape(shape)

      value = load("fp32")
      with torch.no_grad():
        param.data.copy_(value.to(param.dtype))
      if hasattr(param, "_hp_mapping"):  # ZeRO-1/2: this rank's fragment of each (local)
        safe_set_full_fp32_param(param, value.float())
        for slot in ("exp_avg", "exp_avg_sq"):
          if os.path.exists(os.path.join(folder, f"{slot}.pt")):
            safe_set_full_optimizer_state(param, load(slot).float(), slot)
      else:  # no ZeRO: the torch optimizer holds the parameter itself
        state = engine.optimizer.state[param]
        for slot in ("exp_avg", "exp_avg_sq"):
          if slot in state:
            state[slot].copy_(load(slot))
      moved.append(f"{local} <- {name}")
  return moved
