#!/usr/bin/env python
"""Generate small, real DeepSpeed mixture-of-experts checkpoints as test fixtures.

Each fixture trains a tiny MoE model for a few steps with real DeepSpeed 0.19.8 on CPU (gloo
ranks, ``DS_ACCELERATOR=cpu``), saves a checkpoint, records DeepSpeed's own full state (every
parameter's fp32 master and Adam moments, gathered by the engine with
``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), and runs
DeepSpeed's ``ds_to_universal`` on it (recording whether it succeeds). Output, per fixture::

  <out>/<name>/ckpt/          DeepSpeed's checkpoint folder (``latest`` + ``global_step<N>/``)
  <out>/<name>/universal/     ds_to_universal's output, kept for `autoep_mixtral_z1_ep2`
  <out>/<name>/oracle.npz     the engine's gathered state: ``value``, ``exp_avg``, ``exp_avg_sq``,
                              each one flat float32 array of every parameter in the order of
                              ``info.json["oracle"]`` ({name: shape}; native experts by global
                              expert number, AutoEP experts stacked ``[num_experts, ...]``)
  <out>/<name>/info.json      config, layout, groups, losses, what ds_to_universal did

Two kinds of model:
- ``native``: ``deepspeed.moe.layer.MoE`` (top-2 gating without token dropping, sampling or
  random token selection, so that routing is deterministic), two MoE blocks of 4 experts,
  the second with ``use_residual`` (a shared expert and its coefficient); the loss adds
  0.01 x the gates' auxiliary losses. Experts are initialized by their global number.
- ``autoep``: a tiny one-layer transformers 5.24 Mixtral or Qwen3-MoE (routers and experts
  drawn at random, as transformers leaves them at zero) made expert-parallel by DeepSpeed's
  AutoEP (``expert_parallel.enabled``), which needs a one-function shim for transformers 5.24
  (``autoep_shim`` below). Its loss is transformers' own over 6-token sequences.

Usage::

  python scripts/make_moe_fixtures.py --out tests/fixtures/moe            # all fixtures
  python scripts/make_moe_fixtures.py --out /tmp/moe --only native_z1_ep2_dp4
  python scripts/make_moe_fixtures.py --list

Needs torch==2.13.0, deepspeed==0.19.8 and transformers (docs/deepspeed_on_cpu.md).
docs/moe.md describes what the files contain.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ds_launch import dir_size, ds_to_universal, init_rank, launch_ranks, token_batch

SEED = 4321
VOCAB = 17
DIM = 8
HIDDEN = 12
EXPERTS = 4
SEQ = 5
MICRO_BATCH = 2
STEPS = 3
LR = (1e-2, 5e-3)
WEIGHT_DECAY = (0.1, 0.0)
BETAS = (0.9, 0.99)
EPS = 1e-8
AUX = 0.01
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")

FIXTURES: dict[str, dict[str, Any]] = {
  "native_z1_ep2_dp4": {"kind": "native", "stage": 1, "world": 4, "ep": 2},
  "native_z2_ep2_dp2": {"kind": "native", "stage": 2, "world": 2, "ep": 2},
  "native_z0_ep2_dp2": {"kind": "native", "stage": 0, "world": 2, "ep": 2},
  "native_z2_ep1_dp2": {"kind": "native", "stage": 2, "world": 2, "ep": 1},
  "autoep_mixtral_z1_ep2": {
    "kind": "autoep",
    "model": "mixtral",
    "stage": 1,
    "world": 2,
    "ep": 2,
    "universal": True,
  },
  "autoep_mixtral_z2_ep1": {"kind": "autoep", "model": "mixtral", "stage": 2, "world": 2, "ep": 1},
  "autoep_qwen3_z2_ep2": {"kind": "autoep", "model": "qwen3_moe", "stage": 2, "world": 2, "ep": 2},
}


def autoep_shim() -> None:
  """Lets DeepSpeed 0.19.8's AutoEP initialize with transformers 5.24.

  AutoEP calls `registry.get(key, default)` on transformers' `_CAN_RECORD_REGISTRY`, whose
  `get(model)` takes one argument in 5.24 (`_CanRecordRegistry.get() takes 2 positional
  arguments but 3 were given`); with a string key it is a plain dict lookup.
  """
  from transformers.utils import output_capturing

  registry = output_capturing._CanRecordRegistry
  if getattr(registry.get, "_ucp_shim", False):
    return
  original = registry.get

  def get(self, key, default=None):
    return dict.get(self, key, default) if isinstance(key, str) else original(self, key)

  get._ucp_shim = True
  registry.get = get


def ds_config(spec: dict[str, Any]) -> dict[str, Any]:
  config: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "steps_per_print": 1_000_000,
    "zero_optimization": {"stage": spec["stage"]},
    "bf16": {"enabled": False},
  }
  if spec["kind"] == "autoep":
    config["optimizer"] = {
      "type": "AdamW",
      "params": {
        "torch_adam": True,
        "lr": LR[0],
        "betas": list(BETAS),
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY[0],
      },
    }
    config["expert_parallel"] = {
      "enabled": True,
      "autoep_size": spec["ep"],
      "preset_model": spec["model"],
    }
  return config


# --------------------------------------------------------------------------------------------
# Models (torch imported lazily, so that --list needs none)
# --------------------------------------------------------------------------------------------


def native_model(ep: int, ep_rank: int):
  """Embedding, two MoE blocks (pre-LayerNorm, residual), untied head; experts by global id."""
  import torch
  from deepspeed.moe.layer import MoE
  from torch import nn

  class Expert(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.fc1 = nn.Linear(DIM, HIDDEN)
      self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
      return self.fc2(torch.nn.functional.silu(self.fc1(x)))

  class Block(nn.Module):
    def __init__(self, residual: bool) -> None:
      super().__init__()
      self.ln = nn.LayerNorm(DIM)
      self.moe = MoE(
        DIM,
        Expert(),
        num_experts=EXPERTS,
        ep_size=ep,
        k=2,
        drop_tokens=False,
        use_rts=False,
        use_residual=residual,
        top2_2nd_expert_sampling=False,
        min_capacity=0,
      )

    def forward(self, x):
      h, aux, _ = self.moe(self.ln(x))
      return x + h, aux

  class Net(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.embed = nn.Embedding(VOCAB, DIM)
      self.blocks = nn.ModuleList([Block(False), Block(True)])
      self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids, targets):
      x, aux = self.embed(ids), 0.0
      for block in self.blocks:
        x, a = block(x)
        aux = aux + a
      logits = self.head(x)
      ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
      return ce + AUX * aux

  torch.manual_seed(SEED)
  net = Net()
  local = EXPERTS // ep
  for block in net.blocks:  # Experts deep-copies one module: give each expert its own values
    for j, expert in enumerate(block.moe.deepspeed_moe.experts.deepspeed_experts):
      gen = torch.Generator().manual_seed(SEED + 100 * (ep_rank * local + j) + 7)
      for p in expert.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)
  net.universal_checkpoint_info = {}  # ds_to_universal wants it; MoE saves refuse client state
  return net


def hf_model(model: str):
  import torch
  import transformers

  torch.manual_seed(SEED)
  common = dict(
    vocab_size=VOCAB,
    hidden_size=DIM,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
    num_experts_per_tok=2,
  )
  if model == "mixtral":
    cfg = transformers.MixtralConfig(**common, intermediate_size=HIDDEN, num_local_experts=EXPERTS)
    net = transformers.MixtralForCausalLM(cfg)
  else:
    cfg = transformers.Qwen3MoeConfig(
      **common,
      intermediate_size=16,
      moe_intermediate_size=HIDDEN,
      num_experts=EXPERTS,
      head_dim=4,
      norm_topk_prob=True,
    )
    net = transformers.Qwen3MoeForCausalLM(cfg)
  with torch.no_grad():  # transformers leaves routers at zero: random ones route differently
    for name, p in net.named_parameters():
      if name.endswith("mlp.gate.weight") or "experts" in name:
        p.copy_(torch.randn(p.shape) * 0.3)
  return net, cfg


def _batch(rank: int, step: int):
  return token_batch(SEED + 1000 * step + rank, VOCAB, MICRO_BATCH, SEQ)


def _groups(model):
  trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
  decay = [p for n, p in trainable if p.dim() >= 2]
  no_decay = [p for n, p in trainable if p.dim() < 2]
  return [
    {"params": decay, "name": "decay", "lr": LR[0], "weight_decay": WEIGHT_DECAY[0]},
    {"params": no_decay, "name": "no_decay", "lr": LR[1], "weight_decay": WEIGHT_DECAY[1]},
  ]


# --------------------------------------------------------------------------------------------
# Worker (one per rank)
# --------------------------------------------------------------------------------------------


def _engine(spec: dict, rank: int, config: dict):
  """A DeepSpeed engine of fixture `spec` on this rank: native MoE, or AutoEP."""
  import deepspeed
  import torch

  if spec["kind"] == "native":
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = native_model(spec["ep"], rank % spec["ep"])
    param_groups = split_params_into_different_moe_groups_for_optimizer(_groups(model))
    optimizer = torch.optim.AdamW(
      param_groups, lr=LR[0], betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY[0]
    )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
  else:
    autoep_shim()
    model, _ = hf_model(spec["model"])
    engine, _, _, _ = deepspeed.initialize(
      model=model, model_parameters=_groups(model), config=config
    )
  return engine


def worker(name: str, ckpt_dir: str, out_dir: str) -> None:
  torch, deepspeed = init_rank(deterministic=True, fill_uninitialized=True)
  import deepspeed.comm as dist
  import numpy as np
  from deepspeed.utils import groups as ds_groups

  spec = FIXTURES[name]
  rank = int(os.environ["RANK"])
  config = ds_config(spec)
  engine = _engine(spec, rank, config)
  world = dist.get_world_size()

  losses = []
  for step in range(STEPS + 1):  # the last step's loss is the one after the checkpoint
    ids, targets = _batch(rank, step)
    if spec["kind"] == "native":
      loss = engine(ids, targets)
    else:
      full = torch.cat([ids, targets[:, -1:]], 1)  # transformers shifts the labels itself
      loss = engine(input_ids=full, labels=full).loss
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, loss.detach().float().reshape(1))
    losses.append(sum(float(t.item()) for t in gathered) / world)
    if step == STEPS:
      break
    engine.backward(loss)
    engine.step()
    if step == STEPS - 1:
      engine.save_checkpoint(ckpt_dir)
      state = _full_state(engine, spec, ds_groups)
      np.savez(os.path.join(out_dir, f"oracle_rank{rank}.npz"), **state)
  if rank == 0:
    info = {
      "name": name,
      **spec,
      "deepspeed_version": deepspeed.__version__,
      "torch_version": torch.__version__.split("+")[0],
      "config": config,
      "tag": f"global_step{STEPS}",
      "steps": STEPS,
      "seed": SEED,
      "sizes": {
        "vocab": VOCAB,
        "dim": DIM,
        "hidden": HIDDEN,
        "experts": EXPERTS,
        "seq": SEQ,
        "micro_batch": MICRO_BATCH,
        "aux": AUX,
      },
      "optimizer_class": type(engine.optimizer).__name__,
      "param_groups": [
        {k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups
      ],
      "losses": losses[:STEPS],
      "loss_after": losses[STEPS],
    }
    with open(os.path.join(out_dir, "info.json"), "w") as f:
      json.dump(info, f, indent=2, default=str)
  dist.barrier()
  dist.destroy_process_group()


def _full_state(engine, spec, ds_groups) -> dict[str, Any]:
  """This rank's share of the engine's full state: `{slot/NAME: array}` (collective calls)."""
  import re

  from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

  rank = int(os.environ["RANK"])
  zero = engine.optimizer
  if hasattr(zero, "_hp_optimizer_states_linked"):  # 0.19.8 links the moments of the group
    zero._hp_optimizer_states_linked = False  # stepped first only (the others had none yet)
    zero._lazy_init_hp_params_optimizer_state()
  out = {}
  local = EXPERTS // spec["ep"]
  for name, p in engine.module.named_parameters():
    value = safe_get_full_fp32_param(p)
    if value is None:  # no ZeRO: the torch optimizer holds the parameter itself
      state = engine.optimizer.state[p]
      value, avg, avg_sq = p.detach(), state["exp_avg"], state["exp_avg_sq"]
    else:
      try:
        avg = safe_get_full_optimizer_state(p, "exp_avg")
      except ValueError as e:
        raise ValueError(f"{name}: {e}; keys {p._hp_mapping.optim_fragment}") from e
      avg_sq = safe_get_full_optimizer_state(p, "exp_avg_sq")
    group = getattr(p, "group_name", None)
    expert = bool(group) or ".experts.w" in name
    if expert:
      group = group or next(iter(ds_groups._get_expert_parallel_group_dict()))
      if ds_groups._get_expert_data_parallel_rank(group) != 0:
        continue
      ep_rank = ds_groups._get_expert_parallel_rank(group)
      m = re.match(r"(.*\.deepspeed_experts\.)(\d+)(\..*)", name)
      if m:
        name = f"{m.group(1)}{ep_rank * local + int(m.group(2))}{m.group(3)}"
      else:
        name = f"{name}@{ep_rank * local}"
    elif rank != 0:
      continue
    for slot, t in (("value", value), ("exp_avg", avg), ("exp_avg_sq", avg_sq)):
      out[f"{slot}/{name}"] = t.detach().float().numpy().copy()
  return out


def load_worker(name: str, src: str, out_dir: str, ep: int, stage: int) -> None:
  """Loads the universal checkpoint `src` (an export of fixture `name`'s run) into an engine
  of this world size at expert-parallel degree `ep` and ZeRO `stage`, calls
  `ucp_jax.deepspeed.finish_load`, and writes the losses at the loaded state on the source
  run's next batches (every source rank's) and this engine's gathered state (`oracle_rank*`)."""
  torch, _ = init_rank()
  import deepspeed.comm as dist
  import numpy as np
  from deepspeed.utils import groups as ds_groups

  import ucp_jax.deepspeed

  spec = dict(FIXTURES[name], ep=ep, stage=stage)
  rank = int(os.environ["RANK"])
  config = ds_config(spec) | {"checkpoint": {"load_universal": True}}
  engine = _engine(spec, rank, config)
  engine.load_checkpoint(src)
  # MOE_DEEPSPEED_ONLY=1: DeepSpeed's loader alone (to measure what it does without ucp_jax)
  moved = [] if os.environ.get("MOE_DEEPSPEED_ONLY") else ucp_jax.deepspeed.finish_load(engine, src)
  losses = []
  with torch.no_grad():
    for r in range(FIXTURES[name]["world"]):
      ids, targets = _batch(r, STEPS)
      if spec["kind"] == "native":
        loss = engine(ids, targets)
      else:
        full = torch.cat([ids, targets[:, -1:]], 1)
        loss = engine(input_ids=full, labels=full).loss
      losses.append(float(loss))
  state = _full_state(engine, spec, ds_groups)
  np.savez(os.path.join(out_dir, f"oracle_rank{rank}.npz"), **state)
  if rank == 0:
    with open(os.path.join(out_dir, "loaded.json"), "w") as f:
      json.dump({"loss": sum(losses) / len(losses), "moved": moved, "step": engine.global_steps}, f)
  dist.barrier()
  dist.destroy_process_group()


def load_into_deepspeed(name: str, src: str, out: str, *, world: int, ep: int, stage: int) -> dict:
  """Runs `load_worker` on `world` ranks; returns {loss, step, oracle: {name: shape}} and
  writes `out/oracle.npz` (the loaded engine's gathered state, as a fixture's)."""
  cmd = [
    sys.executable,
    __file__,
    "--load-worker",
    name,
    "--ckpt",
    str(src),
    "--tmp",
    str(out),
    "--ep",
    str(ep),
    "--stage",
    str(stage),
  ]
  launch_ranks(world, cmd, Path(out) / "logs", what=f"load {name} at ep {ep}")
  loaded = json.loads((Path(out) / "loaded.json").read_text())
  loaded["oracle"] = _merge_oracle(Path(out), world, Path(out) / "oracle.npz")
  return loaded


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def _merge_oracle(tmp: Path, world: int, dest: Path) -> dict[str, list[int]]:
  """One flat float32 array per slot in `dest` (names sorted); returns {name: shape}."""
  import numpy as np

  merged: dict[str, Any] = {}
  pieces: dict[str, dict[int, Any]] = {}
  for r in range(world):
    with np.load(tmp / f"oracle_rank{r}.npz") as data:
      for key in data.files:
        if "@" in key:
          base, start = key.rsplit("@", 1)
          pieces.setdefault(base, {})[int(start)] = data[key]
        else:
          merged[key] = data[key]
  for key, parts in pieces.items():
    merged[key] = np.concatenate([parts[s] for s in sorted(parts)])
  names = sorted({k.split("/", 1)[1] for k in merged})
  index = {n: list(merged[f"value/{n}"].shape) for n in names}
  flat = {
    slot: np.concatenate([merged[f"{slot}/{n}"].reshape(-1) for n in names]).astype(np.float32)
    for slot in ("value", "exp_avg", "exp_avg_sq")
  }
  np.savez_compressed(dest, **flat)
  return index


def make_fixture(name: str, out: Path, timeout: float = 900.0) -> dict[str, Any]:
  spec = FIXTURES[name]
  dest = out / name
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix=f"moefix_{name}_") as tmp:
    tmp_path = Path(tmp)
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, __file__, "--worker", name, "--ckpt", str(ckpt), "--tmp", str(tmp_path)]
    launch_ranks(spec["world"], cmd, tmp_path / "logs", what=name, timeout=timeout)
    info = json.loads((tmp_path / "info.json").read_text())
    for script in RECOVERY_SCRIPTS:
      (ckpt / script).unlink(missing_ok=True)
    universal = tmp_path / "universal"
    try:
      ds_to_universal(ckpt / info["tag"], universal)
      info["ds_to_universal"] = "ok"
    except RuntimeError as e:
      lines = [x for x in str(e).splitlines() if x.strip()]
      info["ds_to_universal"] = "failed: " + (lines[-1] if lines else "?")
      shutil.rmtree(universal, ignore_errors=True)
    info["files"] = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    if dest.exists():
      shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.copytree(ckpt, dest / "ckpt")
    if universal.exists() and spec.get("universal"):  # kept where the tests read it
      shutil.copytree(universal, dest / "universal")
      shutil.copy(tmp_path / "latest_universal", dest / "latest_universal")
    info["oracle"] = _merge_oracle(tmp_path, spec["world"], dest / "oracle.npz")
    (dest / "info.json").write_text(json.dumps(info, indent=2) + "\n")
  return {
    "name": name,
    "bytes": dir_size(dest),
    "s": round(time.perf_counter() - t0, 1),
    "ds_to_universal": info["ds_to_universal"],
    "losses": info["losses"],
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--out", type=Path, help="output folder (committed: tests/fixtures/moe)")
  parser.add_argument("--only", action="append", choices=sorted(FIXTURES))
  parser.add_argument("--list", action="store_true", help="list fixture names and exit")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--ckpt", help=argparse.SUPPRESS)
  parser.add_argument("--tmp", help=argparse.SUPPRESS)
  parser.add_argument("--load-worker", help=argparse.SUPPRESS)
  parser.add_argument("--ep", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    worker(args.worker, args.ckpt, args.tmp)
    return 0
  if args.load_worker:
    load_worker(args.load_worker, args.ckpt, args.tmp, args.ep, args.stage)
    return 0
  if args.list:
    for name, spec in FIXTURES.items():
      print(name, spec)
    return 0
  if args.out is None:
    parser.error("--out is required (tests/fixtures/moe: the committed fixtures)")
  failed = []
  for name in args.only or list(FIXTURES):
    try:
      s = make_fixture(name, args.out)
    except Exception as e:  # report it and go on with the next fixture
      failed.append(name)
      print(f"FAILED {name}: {e}", flush=True)
      continue
    print(
      f"{s['name']:<24} {s['bytes'] / 1024:6.1f} KiB {s['s']:5.1f}s "
      f"ds_to_universal {s['ds_to_universal']}; losses "
      + ", ".join(f"{x:.4f}" for x in s["losses"]),
      flush=True,
    )
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
