"""`ucp demo`: train, checkpoint, move to other meshes, continue; losses match an uninterrupted run.

A small Flax NNX MLP (`_demo_train`) trains with Optax AdamW on 8 (fake CPU) devices:
  1. an uninterrupted reference run of 3 x STEPS steps on a data-parallel mesh (8,);
  2. the same run in three legs: STEPS steps on the (8,) mesh -> save ->
     restore onto a 2 x 4 (data x model) mesh with the kernels tensor-parallel ->
     STEPS steps -> save -> restore onto a 4-device sub-mesh -> STEPS steps.
The per-step losses of both runs are compared.
"""

from __future__ import annotations

import os
import time

from ucp_jax.base import _errors

STEPS = 20
TOLERANCE = 1e-5
"""The most the two runs' losses may differ, relatively: the meshes sum gradients in different
orders, so float32 rounding differs; the checkpoints themselves are exact."""
DEVICES = 8


def _ensure_devices(n: int = DEVICES) -> None:
  flag = f"--xla_force_host_platform_device_count={n}"
  if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def run(out_dir: str = "demo_out", steps: int = STEPS, log=print) -> dict:
  """Runs the demo; returns the losses of both runs and the checkpoint paths."""
  _ensure_devices()
  import jax

  _check_arguments(out_dir, steps)
  if len(jax.devices()) < DEVICES:
    raise RuntimeError(
      f"the demo needs {DEVICES} devices, found {len(jax.devices())}: run it in a fresh process "
      "(XLA_FLAGS must be set before JAX starts)"
    )
  from ucp_jax.cli import _demo_train as train

  dp_mesh, _, _ = train.meshes()
  log(
    f"ucp demo: 2 runs of {3 * steps} steps, one with 2 saves and restores onto other meshes "
    "(about 5 s on 2 CPU cores, most of it compiling)"
  )
  start = time.perf_counter()
  model, optimizer = train.fresh(dp_mesh)
  reference = train.run_steps(model, optimizer, dp_mesh, 0, 3 * steps)
  log(
    f"reference: {3 * steps} uninterrupted steps on mesh (8,) data-parallel, final loss {reference[-1]:.6f}"
  )
  legs, exact, checkpoints = _legs(out_dir, steps, log)
  rel = _compare(reference, legs, steps, log)
  plot = _plot(reference, legs, steps, os.path.join(out_dir, "losses.png"))
  log(plot if plot.startswith("plot skipped") else f"loss curves: {os.path.abspath(plot)}")
  log(f"done in {time.perf_counter() - start:.1f} s; checkpoints in {os.path.abspath(out_dir)}")
  return {
    "reference": reference,
    "legs": legs,
    "max_rel_diff": rel,
    "exact_restore": exact,
    "checkpoints": checkpoints,
  }


def _check_arguments(out_dir: str, steps: int) -> None:
  if steps < 1:
    raise _errors.InvalidArgumentError(f"steps={steps}: the demo needs at least 1 step per leg")
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise _errors.CheckpointExistsError(
      f"{out_dir}: a file is in the way of the demo's checkpoint folder"
    )
  os.makedirs(out_dir, exist_ok=True)  # before training: a bad path fails at once


def _legs(out_dir: str, steps: int, log) -> tuple[list[float], bool, list[str]]:
  """The run in three legs, saved and restored onto another mesh between them: (losses,
  whether the first restore was bit-identical to its save, the checkpoints)."""
  import jax
  import numpy as np

  import ucp_jax
  from ucp_jax.cli import _demo_train as train

  dp_mesh, tp_mesh, sub_mesh = train.meshes()
  first, second = os.path.join(out_dir, "ckpt_leg1"), os.path.join(out_dir, "ckpt_leg2")
  model, optimizer = train.fresh(dp_mesh)
  legs = train.run_steps(model, optimizer, dp_mesh, 0, steps)
  saved = train.state(model, optimizer)
  ucp_jax.save(first, saved, step=steps, overwrite=True)
  log(f"leg 1: {steps} steps on mesh (8,) data-parallel, saved to {first}")

  model, optimizer, restored = train.restored(tp_mesh, True, first)
  exact = all(
    np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored))
  )
  kernel = model.fc1.kernel[...]
  legs += train.run_steps(model, optimizer, tp_mesh, steps, steps)
  ucp_jax.save(second, train.state(model, optimizer), step=2 * steps, overwrite=True)
  log(
    f"leg 2: restored onto mesh 2 x 4 (data x model), fc1.kernel {kernel.sharding.spec}; "
    f"{steps} steps; saved to {second}"
  )
  log(f"        restored state bit-identical to the saved state: {exact}")

  model, optimizer, _ = train.restored(sub_mesh, False, second)
  legs += train.run_steps(model, optimizer, sub_mesh, 2 * steps, steps)
  log(f"leg 3: restored onto a 4-device sub-mesh (4,) data-parallel; {steps} steps")
  return legs, exact, [first, second]


def _compare(reference: list[float], legs: list[float], steps: int, log) -> float:
  """Logs a table of both runs' losses; returns their largest relative difference."""
  import numpy as np

  ref, got = np.asarray(reference), np.asarray(legs)
  rel = float(np.max(np.abs(ref - got) / np.maximum(np.abs(ref), 1e-12)))
  log("")
  log(" step   uninterrupted   save/restore/reshard")
  for i in sorted({*range(0, 3 * steps, max(1, steps // 2)), 3 * steps - 1}):
    marker = "  <- restored" if i in (steps, 2 * steps) else ""
    log(f" {i:4d}   {ref[i]:.8f}      {got[i]:.8f}{marker}")
  log(
    f"max relative loss difference over {3 * steps} steps: {rel:.2e} "
    "(the meshes sum gradients in different orders; the checkpoints themselves are exact)"
  )
  return rel


def _plot(reference: list[float], legs: list[float], steps: int, path: str) -> str:
  """Draws both runs' losses into `path` (a PNG) and returns it; without matplotlib, says so."""
  try:
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt
  except ImportError:
    return "plot skipped: matplotlib is not installed (pip install matplotlib)"
  fig, ax = plt.subplots(figsize=(8, 4))
  ax.plot(reference, label="uninterrupted, mesh (8,)", linewidth=3, alpha=0.4)
  ax.plot(legs, "--", label="saved, restored onto (2, 4), then (4,)")
  for at, mesh in ((steps, "(2, 4)"), (2 * steps, "(4,)")):
    ax.axvline(at, color="gray", linestyle=":")
    ax.annotate(f"restored onto {mesh}", (at, min(reference)), rotation=90, va="bottom", ha="right")
  ax.set(xlabel="step", ylabel="loss", title="ucp demo: the same losses across two reshards")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


if __name__ == "__main__":
  run()
