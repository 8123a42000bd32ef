"""megatron-core loads a Megatron-LM root and trains on: the oracle of `ucp export --format megatron`.

`python megatron_load_worker.py ROOT OUT TP WORLD BF16 [--weights-only]` starts WORLD gloo
ranks split TP ways,
builds the fixtures' GPT with the distributed optimizer and loads ROOT's latest iteration as
Megatron-LM does (scripts/make_megatron_core_fixtures.py: `build`, `load`), and writes to OUT
(rank 0): `loaded.npz`, the logical state right after the load (Megatron's own gather), `logits.npz`, Megatron's forward on the
fixtures' fixed tokens, and `losses.json`, the losses of the next two training steps on the
fixtures' batches (none with `--weights-only`: a checkpoint without optimizer state).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import make_megatron_core_fixtures as fixtures
import numpy as np


def run_rank(
  rank: int, root: str, out: str, tp: int, world: int, bf16: bool, port: int, weights_only: bool
) -> None:
  import torch.distributed as dist

  fixtures.cpu_stand_ins()
  dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
  )
  from megatron.core import parallel_state as ps

  ddp, optimizer, scheduler = fixtures.build(True, bf16, tp)
  iteration = fixtures.load(ddp, optimizer, scheduler, root)
  tokens, logits = fixtures.forward(ddp)
  metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
  if weights_only:
    loaded = fixtures.assemble(ddp.module.sharded_state_dict(metadata=metadata))
    losses = []
  else:
    loaded = fixtures.oracle(ddp, optimizer, True, metadata)
    batches = fixtures.batches(ps.get_data_parallel_rank(), fixtures.ITERATION + 2)
    losses = [
      fixtures.train_step(ddp, optimizer, scheduler, tokens)
      for tokens in batches[fixtures.ITERATION :]
    ]
  if rank == 0:
    np.savez(Path(out) / "loaded.npz", **loaded)
    np.savez(Path(out) / "logits.npz", tokens=tokens, logits=logits)
    (Path(out) / "losses.json").write_text(json.dumps({"losses": losses, "iteration": iteration}))
  dist.barrier()
  dist.destroy_process_group()


def main() -> None:
  import socket

  import torch.multiprocessing as mp

  root, out, tp, world, bf16 = sys.argv[1:6]
  weights_only = "--weights-only" in sys.argv[6:]
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  mp.spawn(
    run_rank,
    args=(root, out, int(tp), int(world), bf16 == "1", port, weights_only),
    nprocs=int(world),
  )


if __name__ == "__main__":
  os.environ.setdefault("PYTHONWARNINGS", "ignore")
  main()
