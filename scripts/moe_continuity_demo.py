#!/usr/bin/env python
"""A mixture-of-experts run across frameworks: DeepSpeed AutoEP -> JAX on an expert mesh -> back.

One tiny transformers 5.24 Mixtral (4 experts, top 2), fp32, torch AdamW (one group; DeepSpeed
puts the experts in a group of their own with the same hyperparameters), no gradient
clipping, the same global token batch at every step on both sides:

1. DeepSpeed AutoEP at ep 2 x dp 2 (ZeRO-1, gloo, CPU) trains K steps from a seeded init,
   saves, and trains N more steps itself: DeepSpeed's own continuation.
2. `ucp_jax.convert` turns the checkpoint into a universal one (experts stacked `[4, ...]`,
   with their Adam moments).
3. JAX restores it (`ucp_jax.restore_train_state`, rules `hf_moe(experts="autoep")`) into
   `ucp_jax.models.moe.FlaxMoe` on a 2 x 2 x 2 (data x expert x model) mesh and trains the
   same N steps: its losses must equal DeepSpeed's continuation (relative 1e-5).
4. JAX saves, `ucp_jax.export`s to a DeepSpeed universal checkpoint and trains M more steps;
   DeepSpeed AutoEP loads the export at ep 1 and at ep 2 (`load_universal`, then
   `ucp_jax.deepspeed.finish_load`) and trains the same M steps: its losses must equal JAX's.

Usage::

  python scripts/moe_continuity_demo.py --out /tmp/moe_xf     # 3-5 minutes on 2 cores

Prints a table and PASS or FAIL (exit status 1). Needs torch 2.13, deepspeed 0.19.8 and
transformers 5.24 (docs/deepspeed_on_cpu.md); AutoEP needs `make_moe_fixtures.autoep_shim`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _continuity as continuity
from _continuity import DsJob, MeshTrainer, arithmetic_batch
from _ds_launch import init_rank

TOLERANCE = 1e-5
SEED = 2024
GLOBAL_BATCH = 4
SEQ = 8
HYPER = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
CONFIG = {
  "vocab_size": 32,
  "hidden_size": 16,
  "intermediate_size": 24,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "num_local_experts": 4,
  "num_experts_per_tok": 2,
  "max_position_embeddings": 64,
}
STEPS = (3, 3, 3)  # K (DeepSpeed), N (JAX), M (DeepSpeed again)


def batch(step: int):
  """The global batch of `step`: int64 `[GLOBAL_BATCH, SEQ + 1]` arithmetic sequences."""
  return arithmetic_batch(SEED, step, GLOBAL_BATCH, SEQ, CONFIG["vocab_size"])


def hf_model():
  import torch
  import transformers

  torch.manual_seed(SEED)
  model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG))
  with torch.no_grad():  # transformers leaves routers at zero: every token would route alike
    for name, p in model.named_parameters():
      if "mlp" in name:
        p.copy_(torch.randn(p.shape) * 0.2)
  return model


def rank_main(job_path: str) -> None:
  """One DeepSpeed AutoEP rank: (load,) train, (save,) record the global losses."""
  _, deepspeed = init_rank()
  import deepspeed.comm as dist
  from make_moe_fixtures import autoep_shim

  autoep_shim()
  job = DsJob(**json.loads(Path(job_path).read_text()))
  world = int(os.environ["WORLD_SIZE"])
  config = continuity.ds_config(GLOBAL_BATCH, world, HYPER, stage=1)
  config["expert_parallel"] = {"enabled": True, "autoep_size": job.ep, "preset_model": "mixtral"}
  if job.load_dir:
    config["checkpoint"] = {"load_universal": True}
  model = hf_model()
  engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=config
  )
  rank = dist.get_rank()
  losses = continuity.run_job(
    engine,
    job,
    batch,
    logits=lambda engine, tokens: engine(input_ids=tokens).logits,
    save=lambda: engine.save_checkpoint(job.save_dir),
  )
  if rank == 0:
    Path(job.out).write_text(json.dumps({"losses": losses}))
  dist.barrier()
  dist.destroy_process_group()


def launch(world: int, job: DsJob, workdir: Path) -> list[float]:
  return continuity.launch(__file__, world, job, workdir, what="DeepSpeed AutoEP")


class JaxTrainer(MeshTrainer):
  """FlaxMoe + optax.adamw (= torch AdamW) on a 2 x 2 x 2 (data, expert, model) mesh."""

  def __init__(self):
    import jax
    from flax import nnx
    from jax.sharding import AxisType

    from ucp_jax import models, rules

    mesh = jax.make_mesh((2, 2, 2), ("data", "expert", "model"), axis_types=(AxisType.Auto,) * 3)
    _, cfg = rules.from_hf(hf_model())
    self.rules = rules.hf_moe(
      family="mixtral", num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, experts="autoep"
    )
    super().__init__(models.build(cfg, rngs=nnx.Rngs(0), mesh=mesh), mesh, HYPER, batch)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--out", type=Path)
  parser.add_argument("--rank-job", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.rank_job:
    rank_main(args.rank_job)
    return 0
  if args.out is None:
    parser.error("--out is required")
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import ucp_jax

  out, (k, n, m) = args.out, STEPS
  out.mkdir(parents=True, exist_ok=True)
  ds = launch(
    2,
    DsJob(0, k + n, str(out / "ds1.json"), ep=2, save_after=k, save_dir=str(out / "ds_ckpt")),
    out / "ds1",
  )
  ucp_jax.convert(out / "ds_ckpt", out / "universal", overwrite=True)
  jt = JaxTrainer()
  ucp_jax.restore_train_state(out / "universal", jt.model, jt.optimizer, rules=jt.rules)
  jax_losses = jt.train(k, n)
  ucp_jax.save_train_state(
    out / "jax_ckpt", jt.model, jt.optimizer, hyperparams=HYPER, overwrite=True
  )
  ucp_jax.export(
    out / "jax_ckpt", out / "ds_export", rules=jt.rules, format="deepspeed", overwrite=True
  )
  jax_more = jt.train(k + n, m)
  rows = [("DeepSpeed ep2 dp2", k + i, ds[k + i], None) for i in range(n)]
  rows += [("JAX 2x2x2", k + i, jax_losses[i], ds[k + i]) for i in range(n)]
  rows += [("JAX 2x2x2", k + n + i, jax_more[i], None) for i in range(m)]
  for ep in (1, 2):
    back = launch(
      2,
      DsJob(k + n, m, str(out / f"ds_ep{ep}.json"), ep=ep, load_dir=str(out / "ds_export")),
      out / f"ds_ep{ep}",
    )
    rows += [(f"DeepSpeed ep{ep} dp2", k + n + i, back[i], jax_more[i]) for i in range(m)]
  worst = 0.0
  print(f"{'framework':<20} {'step':>4} {'loss':>10} {'reference':>10} rel diff")
  for name, step, loss, ref in rows:
    diff = None if ref is None else abs(loss - ref) / abs(ref)
    worst = max(worst, diff or 0.0)
    shown = "" if ref is None else f"{ref:10.6f} {diff:.1e}"
    print(f"{name:<20} {step:>4} {loss:10.6f} {shown}")
  ok = worst <= TOLERANCE
  (out / "result.json").write_text(json.dumps({"rows": rows, "worst": worst, "ok": ok}))
  print(
    f"worst relative difference {worst:.2e} (tolerance {TOLERANCE:g}): "
    + ("PASS" if ok else "FAIL")
  )
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
