"""scripts/cross_framework_demo.py end to end, small: DeepSpeed -> JAX (2 x 4) -> DeepSpeed."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.deepspeed
def test_demo_small_passes_and_plots(tmp_path):
  if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("needs torch and deepspeed (pip install 'ucp_jax[deepspeed]')")
  out = tmp_path / "xf"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own
  proc = subprocess.run(
    [
      sys.executable,
      str(REPO / "scripts" / "cross_framework_demo.py"),
      "--out",
      str(out),
      "--small",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  assert "PASS" in proc.stdout
  assert (out / "loss_curve.png").stat().st_size > 0
  results = json.loads((out / "results.json").read_text())
  assert results["pass"]
  meshes = {r["mesh"] for r in results["rows"]}
  assert meshes == {"ZeRO-2 DP=2", "2x4 (dp x tp)", "ZeRO-2 DP=1", "ZeRO-2 DP=3"}
  compared = [r for r in results["rows"] if "ref" in r]
  assert compared and all(abs(r["loss"] - r["ref"]) <= 1e-5 * abs(r["ref"]) for r in compared)
