"""DeepSpeed ranks training `transformers` models: what tests/test_hf_deepspeed_live.py runs.

One launch of N gloo ranks (`scripts/_ds_launch.py`) trains every model of a `Leg` in turn:
a tiny random `transformers` model built from `MODELS` with a fixed seed, the AdamW param
groups Hugging Face's `Trainer` makes (decay: what `Trainer.get_decay_parameter_names` names;
no decay: biases and norms), DeepSpeed ZeRO-2, fp32, torch AdamW, no clipping
(`cross_framework_demo.ds_config`), the global batch of each step split over the ranks
(`cross_framework_demo.batch`). A leg may first load a universal checkpoint (`load_universal`
and `ucp_jax.deepspeed.finish_load`) and may save a DeepSpeed checkpoint after some steps;
rank 0 records the mean loss of every step over all ranks.

Constants and the model builder are importable without torch or deepspeed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from _ds_launch import init_rank, launch_ranks  # scripts/: on the path in pytest and the ranks
from cross_framework_demo import GLOBAL_BATCH, HYPER, SEED, batch, ds_config

REPO = Path(__file__).resolve().parents[2]

VOCAB, SEQ = 64, 16  # `batch`'s defaults: [GLOBAL_BATCH, SEQ + 1] tokens below VOCAB
MODELS = {
  # name: (transformers model class, config class, config), 2 layers, d=32, vocab 64
  "llama": (
    "LlamaForCausalLM",
    "LlamaConfig",
    dict(
      vocab_size=VOCAB,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=8,
      num_key_value_heads=4,  # grouped-query; 4 key/value heads split over a 4-way model axis
      max_position_embeddings=SEQ,
      bos_token_id=0,
      eos_token_id=0,
    ),
  ),
  "gpt2": (
    "GPT2LMHeadModel",
    "GPT2Config",
    dict(
      vocab_size=VOCAB,
      n_positions=SEQ,
      n_embd=32,
      n_layer=2,
      n_head=4,
      resid_pdrop=0.0,
      embd_pdrop=0.0,
      attn_pdrop=0.0,
      bos_token_id=0,
      eos_token_id=0,
    ),
  ),
}


def hf_model(name: str):
  """The seeded random `transformers` model `name` of `MODELS`, fp32."""
  import torch
  import transformers

  model_class, config_class, kwargs = MODELS[name]
  torch.manual_seed(SEED)
  return getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs))


def decay_names(model) -> list[str]:
  """The trainable parameters Hugging Face's `Trainer` decays (the rest: no weight decay)."""
  from transformers import Trainer

  decay = set(Trainer.get_decay_parameter_names(None, model))  # it reads nothing of `self`
  return [n for n, p in model.named_parameters() if p.requires_grad and n in decay]


def param_groups(model) -> list[dict[str, Any]]:
  """`Trainer`'s two AdamW groups: decay (weight_decay `HYPER`'s) first, then no decay."""
  decay = set(decay_names(model))
  named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
  return [
    {"params": [p for n, p in named if n in decay], "weight_decay": HYPER["weight_decay"]},
    {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
  ]


@dataclasses.dataclass
class Leg:
  """What one DeepSpeed launch does for each model, on every rank.

  Attributes:
    models: names in `MODELS`, trained one after the other.
    first: the global step index of the first batch trained.
    steps: steps to train.
    out: folder; rank 0 writes `<out>/<model>.json` with the losses and `global_steps`.
    save_after: save a checkpoint to `<save_dir>/<model>` after this many steps (None: never).
    save_dir: where to save.
    load_dir: load the universal checkpoint `<load_dir>/<model>` (and `finish_load`) first.
  """

  models: list[str]
  first: int
  steps: int
  out: str
  save_after: int | None = None
  save_dir: str | None = None
  load_dir: str | None = None


def launch(world: int, leg: Leg, workdir: Path, timeout: float = 600) -> dict[str, dict]:
  """Runs `leg` on `world` DeepSpeed ranks; {model: {"losses": [...], "global_steps": n}}."""
  workdir.mkdir(parents=True, exist_ok=True)
  job = workdir / "leg.json"
  job.write_text(json.dumps(dataclasses.asdict(leg)))
  path = [str(REPO), str(REPO / "scripts"), os.environ.get("PYTHONPATH", "")]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
  env.pop("XLA_FLAGS", None)  # the test's 8 fake devices are no business of the ranks
  env.setdefault("HF_HUB_OFFLINE", "1")
  launch_ranks(
    world, [sys.executable, __file__, "--leg", str(job)], workdir, timeout=timeout, env=env
  )
  return {m: json.loads((Path(leg.out) / f"{m}.json").read_text()) for m in leg.models}


# --------------------------------------------------------------------------------------------
# Inside a rank
# --------------------------------------------------------------------------------------------


def _train(name: str, leg: Leg, rank: int, world: int) -> None:
  import deepspeed
  import deepspeed.comm as dist
  import torch

  from ucp_jax import deepspeed as ucp_deepspeed

  model = hf_model(name)
  load_dir = None if leg.load_dir is None else os.path.join(leg.load_dir, name)
  config = ds_config(world, load_universal=load_dir is not None)
  engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=param_groups(model), config=config
  )
  if load_dir is not None:
    engine.load_checkpoint(load_dir)
    ucp_deepspeed.finish_load(engine, load_dir)
  save_dir = None if leg.save_dir is None else os.path.join(leg.save_dir, name)
  per = GLOBAL_BATCH // world
  losses = []
  for i in range(leg.steps + 1):
    if i == leg.save_after:
      engine.save_checkpoint(save_dir, client_state={"universal_checkpoint_info": {}})
    if i == leg.steps:
      break
    tokens = torch.from_numpy(batch(leg.first + i)[rank * per : (rank + 1) * per])
    logits = engine(input_ids=tokens[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(
      logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
    engine.backward(loss)
    engine.step()
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, loss.detach().reshape(1))
    losses.append(sum(float(t) for t in gathered) / world)
  if rank == 0:
    record = {"losses": losses, "global_steps": engine.global_steps}
    (Path(leg.out) / f"{name}.json").write_text(json.dumps(record))
  dist.barrier()
  engine.destroy()


def rank_main(leg_path: str) -> None:
  # No NaN fill of uninitialized memory: DeepSpeed's ZeRO-2 buckets (5e8 elements) are
  # allocated each step, ~2 s a step on 2 cores. Nothing here reads them.
  torch, deepspeed = init_rank(deterministic=True)
  import deepspeed.comm as dist

  deepspeed.init_distributed(dist_backend="gloo")
  leg = Leg(**json.loads(Path(leg_path).read_text()))
  Path(leg.out).mkdir(parents=True, exist_ok=True)
  for name in leg.models:
    _train(name, leg, dist.get_rank(), dist.get_world_size())
  torch.distributed.destroy_process_group()  # gloo's threads stopped before exit, not killed


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--leg", required=True)
  rank_main(parser.parse_args().leg)
