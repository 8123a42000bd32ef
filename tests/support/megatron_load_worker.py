"""megatron-core loads a Megatron-LM root and trains on: the oracle of `ucp export --format megatron`.

`python megatron_load_worker.py ROOT OUT TP WORLD BF16` starts WORLD gloo ranks split TP ways,
builds the fixtures' GPT with the distributed optimizer (scripts/make_megatron_core_fixtures.py),
loads ROOT's latest iteration as Megatron-LM's `load_checkpoint` does (the content metadata
read from the checkpoint, `dist_checkpointing.load` of the model's and the optimizer's sharded
state dicts, then `load_state_dict`), and writes to OUT (rank 0): `loaded.npz`, the logical
state right after the load (Megatron's own gather), and `losses.json`, the losses of the next
two training steps on the fixtures' batches for iterations 3 and 4.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import make_megatron_core_fixtures as fixtures
import numpy as np


def run_rank(rank: int, root: str, out: str, tp: int, world: int, bf16: bool, port: int) -> None:
  import torch.distributed as dist

  fixtures.cpu_stand_ins()
  dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                          world_size=world)  # fmt: skip
  from megatron.core import dist_checkpointing
  from megatron.core import parallel_state as ps

  ddp, optimizer, scheduler = fixtures.build(True, bf16, tp)
  # Without Apex or TransformerEngine, the distributed optimizer's state_dict() reads the step
  # of a state that a fresh optimizer does not have yet; megatron-core's own zero-gradient
  # step (its Megatron-FSDP load path) makes it. The load overwrites every value it sets.
  for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
    inner._init_optimizer_states_with_dummy_values()
  _skip_step_when_setting_states(type(optimizer.chained_optimizers[0]))
  iteration = int(Path(root, "latest_checkpointed_iteration.txt").read_text())
  folder = str(Path(root) / f"iter_{iteration:07d}")
  metadata = dict(dist_checkpointing.load_content_metadata(folder) or {})
  metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
  wanted = {"model": ddp.module.sharded_state_dict(metadata=metadata)}
  wanted["optimizer"] = optimizer.sharded_state_dict(
    wanted["model"], is_loading=True, metadata=metadata
  )
  state = dist_checkpointing.load(wanted, folder)
  ddp.module.load_state_dict(state["model"])
  optimizer.load_state_dict(state["optimizer"])
  # The same fallback sets one `step` tensor for all parameters, which torch's Adam then
  # increments once per parameter: each parameter gets its own, as after a torch Adam step.
  for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
    for param_state in inner.optimizer.state.values():
      if "step" in param_state:
        param_state["step"] = param_state["step"].clone()
  if "opt_param_scheduler" in state:
    scheduler.load_state_dict(state["opt_param_scheduler"])
  loaded = fixtures.oracle(ddp, optimizer, True, metadata)
  batches = fixtures.batches(ps.get_data_parallel_rank(), fixtures.ITERATION + 2)
  losses = [
    fixtures.train_step(ddp, optimizer, scheduler, tokens)
    for tokens in batches[fixtures.ITERATION :]
  ]
  if rank == 0:
    np.savez(Path(out) / "loaded.npz", **loaded)
    (Path(out) / "losses.json").write_text(json.dumps({"losses": losses, "iteration": iteration}))
  dist.barrier()
  dist.destroy_process_group()


def _skip_step_when_setting_states(cls) -> None:
  """megatron-core 0.19.2 without Apex or TE falls back to torch's Adam, whose per-parameter
  `step` tensor its fully_reshardable load then looks up among the loaded tensors (which never
  hold one: the step comes from the param groups, set just before). Skip that key, as the
  Apex/TE path never meets it."""
  real = cls._set_main_param_and_optimizer_states

  def set_states(self, model_param, tensors):
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    step = self.optimizer.state[main_param].pop("step", None)
    try:
      real(self, model_param, tensors)
    finally:
      if step is not None:
        self.optimizer.state[main_param]["step"] = step

  cls._set_main_param_and_optimizer_states = set_states


def main() -> None:
  import socket

  import torch.multiprocessing as mp

  root, out, tp, world, bf16 = sys.argv[1:6]
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  mp.spawn(run_rank, args=(root, out, int(tp), int(world), bf16 == "1", port), nprocs=int(world))


if __name__ == "__main__":
  os.environ.setdefault("PYTHONWARNINGS", "ignore")
  main()
