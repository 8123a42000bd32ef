#!/usr/bin/env python
"""Train across frameworks: DeepSpeed ZeRO-2 -> JAX on a 2 x 4 mesh -> DeepSpeed at DP=1 and DP=3.

One GPT-style model (`ucp_jax.models.gpt` and its torch twin in `torch_twins`), fp32, one AdamW
group, the same global token batch at every step on both sides (DeepSpeed's data-parallel ranks
take equal slices of it):

1. DeepSpeed ZeRO-2 at DP=2 (gloo, CPU) trains K steps from a seeded torch init, saves a
   checkpoint, and trains N more steps itself: DeepSpeed's own continuation.
2. `ucp_jax.convert` turns the checkpoint into a universal one.
3. JAX restores it (`ucp_jax.restore_train_state`, rules `gpt2`) onto a 2 x 4 (data x model)
   mesh of 8 CPU devices, attention heads and MLP units split over `model`, with an
   `optax.adamw` equal to torch's AdamW, and trains the same N steps: its losses must equal
   DeepSpeed's continuation (relative 1e-5).
4. JAX saves (`ucp_jax.save_train_state`), `ucp_jax.export`s to a DeepSpeed universal checkpoint
   and trains M more steps; DeepSpeed loads the export at DP=1 and at DP=3 (`load_universal`,
   then `ucp_jax.deepspeed.finish_load`) and trains the same M steps: its losses must equal
   JAX's.
5. A table, a PNG of the loss curve across both switches, PASS or FAIL (exit status 1).

Usage::

  python scripts/cross_framework_demo.py --out /tmp/xf            # 1.5-3 min on 2 cores
  python scripts/cross_framework_demo.py --out /tmp/xf --small    # fewer steps (the test, about 55 s)
  python scripts/cross_framework_demo.py --out /tmp/xf --save-fixture tests/fixtures/cross_framework

`--save-fixture DIR` also copies DeepSpeed's ZeRO-2 checkpoint (step K) and writes `info.json`
(configs, the data recipe, DeepSpeed's losses): what `notebooks/cross_framework.ipynb` replays
without DeepSpeed. The DeepSpeed side sets `gradient_clipping: 0` (DeepSpeed clips at 1.0 by
default; optax.adamw does not clip). Needs torch 2.13 and deepspeed 0.19.8
(docs/deepspeed_on_cpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _continuity as continuity
from _continuity import REPO, DsJob, MeshTrainer, arithmetic_batch
from _ds_launch import init_rank

TOLERANCE = 1e-5
SEED = 1234
GLOBAL_BATCH = 6  # divisible by every DP degree used (1, 2, 3) and by the mesh's data axis (2)
HYPER = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
MODEL = {"vocab_size": 64, "max_len": 16, "num_layers": 2, "num_heads": 4, "d_model": 32}
STEPS = {"full": (10, 10, 10), "small": (3, 3, 3)}  # K (DeepSpeed), N (JAX), M (DeepSpeed again)


# --------------------------------------------------------------------------------------------
# Shared by both frameworks: data, configs
# --------------------------------------------------------------------------------------------


def batch(step: int, *, vocab: int = MODEL["vocab_size"], seq: int = MODEL["max_len"]):
  """The global batch of `step`: int64 `[GLOBAL_BATCH, seq + 1]` arithmetic sequences mod vocab."""
  return arithmetic_batch(SEED, step, GLOBAL_BATCH, seq, vocab)


def ds_config(dp: int, *, load_universal: bool = False) -> dict[str, Any]:
  """DeepSpeed ZeRO-2, fp32, torch AdamW with `HYPER`, no clipping; the global batch split dp ways."""
  config = continuity.ds_config(GLOBAL_BATCH, dp, HYPER, stage=2)
  if load_universal:
    config["checkpoint"] = {"load_universal": True}
  return config


# --------------------------------------------------------------------------------------------
# DeepSpeed ranks
# --------------------------------------------------------------------------------------------


def rank_main(job_path: str) -> None:
  """One DeepSpeed rank: build the seeded torch GPT, (load,) train, (save,) record losses."""
  # No NaN fill of uninitialized memory: ZeRO-2 allocates its buffers every step, about 2 s a
  # step here instead of 0.02 s. The algorithms stay deterministic without the fill.
  torch, deepspeed = init_rank(deterministic=True)
  import deepspeed.comm as dist
  from torch_twins import TorchGPT

  from ucp_jax.models.gpt import GPTConfig

  deepspeed.init_distributed(dist_backend="gloo")
  rank, world = dist.get_rank(), dist.get_world_size()
  job = DsJob(**json.loads(Path(job_path).read_text()))

  torch.manual_seed(SEED)
  model = TorchGPT(GPTConfig(**MODEL))
  config = ds_config(world, load_universal=job.load_dir is not None)
  engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=config
  )
  losses = continuity.run_job(
    engine,
    job,
    batch,
    logits=lambda engine, tokens: engine(tokens),
    save=lambda: engine.save_checkpoint(
      job.save_dir, client_state={"universal_checkpoint_info": {}}
    ),
  )
  if rank == 0:
    Path(job.out).write_text(json.dumps({"losses": losses, "global_steps": engine.global_steps}))
  dist.barrier()
  engine.destroy()
  torch.distributed.destroy_process_group()  # gloo's threads stopped before exit, not killed


def launch(dp: int, job: DsJob, workdir: Path, timeout: float = 600) -> list[float]:
  """Runs `job` on `dp` DeepSpeed ranks (plain processes on 127.0.0.1); its losses."""
  return continuity.launch(__file__, dp, job, workdir, what="DeepSpeed", timeout=timeout)


# --------------------------------------------------------------------------------------------
# JAX
# --------------------------------------------------------------------------------------------


class JaxTrainer(MeshTrainer):
  """FlaxGPT + optax.adamw (= torch AdamW with `HYPER`) on a 2 x 4 (data x model) mesh."""

  def __init__(self):
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import AxisType

    from ucp_jax.models import gpt

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    model = gpt.FlaxGPT(gpt.GPTConfig(**MODEL), rngs=nnx.Rngs(0))
    target = gpt.tp_state(nnx.state(model), mesh)  # heads / MLP units over "model"
    zeros = jax.tree.map(lambda t: jax.device_put(np.zeros(t.shape, t.dtype), t.sharding), target)
    nnx.update(model, zeros)
    super().__init__(model, mesh, HYPER, batch)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def rel(a: float, b: float) -> float:
  return abs(a - b) / abs(b)


def report(rows: list[dict], png: Path, k: int) -> bool:
  """Prints the table, draws the curve; True when every compared row is within TOLERANCE."""
  print(
    f"\n{'step':>4}  {'framework':<9}  {'mesh/DP':<12}  {'loss':>10}  {'reference':>10}  rel diff"
  )
  worst = 0.0
  for r in rows:
    ref = r.get("ref")
    diff = "" if ref is None else f"{rel(r['loss'], ref):.1e}"
    worst = max(worst, 0.0 if ref is None else rel(r["loss"], ref))
    ref_s = "" if ref is None else f"{ref:10.6f}"
    print(f"{r['step']:>4}  {r['fw']:<9}  {r['mesh']:<12}  {r['loss']:10.6f}  {ref_s:>10}  {diff}")
  ok = worst <= TOLERANCE
  print(
    f"\nworst relative difference {worst:.2e} (tolerance {TOLERANCE:g}): {'PASS' if ok else 'FAIL'}"
  )

  try:
    import matplotlib
  except ImportError:  # the check above is the demo; the picture is a bonus
    print("plot skipped: matplotlib is not installed (pip install matplotlib)")
    return ok
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4.5))
  styles = {
    "DeepSpeed ZeRO-2 DP=2": ("C0", "o"),
    "JAX 2x4 (data x model)": ("C1", "s"),
    "DeepSpeed ZeRO-2 DP=1": ("C2", "^"),
    "DeepSpeed ZeRO-2 DP=3": ("C3", "v"),
  }
  for label, (color, marker) in styles.items():
    pts = [r for r in rows if r["label"] == label]
    hollow = label.endswith("DP=1")  # under DP=3's points when they agree
    ax.plot(
      [r["step"] for r in pts],
      [r["loss"] for r in pts],
      color=color,
      marker=marker,
      ms=9 if hollow else 5,
      mfc="none" if hollow else color,
      lw=1.5,
      label=label,
    )
  refs = {
    "JAX 2x4 (data x model)": "DeepSpeed DP=2, continuing (reference)",
    "DeepSpeed ZeRO-2 DP=1": "JAX, continuing (reference)",
  }
  for label, ref_label in refs.items():
    pts = [r for r in rows if r["label"] == label]
    ax.plot(
      [r["step"] for r in pts],
      [r["ref"] for r in pts],
      color="k",
      ls=":",
      marker="x",
      ms=7,
      lw=1,
      label=ref_label,
    )
  n_jax = sum(r["fw"] == "JAX" for r in rows)
  for x, text in ((k - 0.5, "DeepSpeed -> JAX"), (k + n_jax - 0.5, "JAX -> DeepSpeed")):
    ax.axvline(x, color="gray", lw=0.8, ls="--")
    ax.text(x, ax.get_ylim()[1], f" {text}", va="top", fontsize=8, color="gray")
  ax.set_xlabel("training step")
  ax.set_ylabel("loss (cross-entropy)")
  ax.set_title(f"One run, two frameworks: worst rel. diff {worst:.1e} ({'PASS' if ok else 'FAIL'})")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png, dpi=120)
  print(f"plot: {png}")
  return ok


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", help="working directory (replaced)")
  parser.add_argument("--small", action="store_true", help="fewer steps (for the test)")
  parser.add_argument("--save-fixture", help="copy DeepSpeed's checkpoint + losses here")
  parser.add_argument("--rank-job", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.rank_job:
    rank_main(args.rank_job)
    return 0
  if not args.out:
    parser.error("--out is required")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, str(REPO))
  import ucp_jax

  t0 = time.perf_counter()
  k, n, m = STEPS["small" if args.small else "full"]
  out = Path(args.out).resolve()
  shutil.rmtree(out, ignore_errors=True)
  out.mkdir(parents=True)
  timings = {}

  def lap(name):
    timings[name] = time.perf_counter() - t0 - sum(timings.values())

  # 1. DeepSpeed ZeRO-2 DP=2: K steps, save, N more (its own continuation).
  ds_ckpt = out / "ds_zero2_dp2"
  ds = launch(2, DsJob(0, k + n, str(out / "ds_dp2.json"), k, str(ds_ckpt)), out / "ds_dp2")
  tag = (ds_ckpt / "latest").read_text().strip()
  lap("DeepSpeed DP=2")
  # 2. Convert.
  ucp_jax.convert(ds_ckpt, out / "universal")
  lap("convert")
  # 3. JAX on 2 x 4: restore through the gpt2 rules, train N steps.
  rules = ucp_jax.rules.gpt2(num_heads=MODEL["num_heads"])
  jt = JaxTrainer()
  ucp_jax.restore_train_state(out / "universal", jt.model, jt.optimizer, rules=rules)
  qkv = jt.model.blocks[0].attn.qkv.kernel[...]
  print(
    f"restored onto {dict(jt.mesh.shape)}; blocks/0/attn/qkv/kernel {qkv.shape} "
    f"sharded {qkv.sharding.spec}"
  )
  jax_losses = jt.train(k, n)
  # 4. JAX saves, exports, and continues M steps (the reference for DeepSpeed's resumes).
  ucp_jax.save_train_state(out / "jax_ckpt", jt.model, jt.optimizer, hyperparams=HYPER)
  export = ucp_jax.export(out / "jax_ckpt", out / "ds_export", rules=rules, format="deepspeed")
  jax_more = jt.train(k + n, m)
  lap("JAX")
  resumed = {}
  for dp in (1, 3):
    job = DsJob(k + n, m, str(out / f"ds_resume_dp{dp}.json"), load_dir=str(out / "ds_export"))
    resumed[dp] = launch(dp, job, out / f"ds_resume_dp{dp}")
    lap(f"DeepSpeed DP={dp}")

  rows = [
    dict(step=s, fw="DeepSpeed", mesh="ZeRO-2 DP=2", loss=ds[s], label="DeepSpeed ZeRO-2 DP=2")
    for s in range(k)
  ]
  rows += [
    dict(
      step=k + i,
      fw="JAX",
      mesh="2x4 (dp x tp)",
      loss=v,
      ref=ds[k + i],
      label="JAX 2x4 (data x model)",
    )
    for i, v in enumerate(jax_losses)
  ]
  for dp in (1, 3):
    rows += [
      dict(
        step=k + n + i,
        fw="DeepSpeed",
        mesh=f"ZeRO-2 DP={dp}",
        loss=v,
        ref=jax_more[i],
        label=f"DeepSpeed ZeRO-2 DP={dp}",
      )
      for i, v in enumerate(resumed[dp])
    ]
  ok = report(rows, out / "loss_curve.png", k)
  results = {"rows": rows, "pass": ok, "export_tag": export.tag, "timings_s": timings}
  (out / "results.json").write_text(json.dumps(results, indent=2))

  if args.save_fixture:
    save_fixture(Path(args.save_fixture), ds_ckpt, tag, k, n, ds)
  print("timings (s): " + ", ".join(f"{name} {t:.1f}" for name, t in timings.items()))
  print(f"total {time.perf_counter() - t0:.1f} s")
  return 0 if ok else 1


def save_fixture(dst: Path, ds_ckpt: Path, tag: str, k: int, n: int, ds: list[float]) -> None:
  """DeepSpeed's checkpoint at step K (no recovery scripts) and `info.json` for the notebook."""
  shutil.rmtree(dst, ignore_errors=True)
  shutil.copytree(ds_ckpt / tag, dst / "ckpt" / tag)
  (dst / "ckpt" / "latest").write_text(tag)
  for script in ("zero_to_fp32.py", "zero_to_torch.py"):
    (dst / "ckpt" / script).unlink(missing_ok=True)
    (dst / "ckpt" / tag / script).unlink(missing_ok=True)
  info = {
    "made_by": "python scripts/cross_framework_demo.py --save-fixture ...",
    "model": MODEL,
    "hyperparams": HYPER,
    "deepspeed_config": ds_config(2),
    "data": {"seed": SEED, "global_batch": GLOBAL_BATCH, "recipe": batch.__doc__.strip()},
    "steps_before_save": k,
    "tag": tag,
    "deepspeed_losses": ds[:k],
    "deepspeed_continuation": {"first_step": k, "losses": ds[k : k + n]},
  }
  (dst / "info.json").write_text(json.dumps(info, indent=2) + "\n")
  size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
  print(f"fixture: {dst} ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
  sys.exit(main())
