"""scripts/device_check.py, run as on a lent GPU machine, but small and on CPU devices.

8 fake devices take the multi-device meshes; 1 device takes the path a single GPU takes.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("devices", [8, 1])
def test_device_check_passes_on_cpu(tmp_path, devices):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  args = ["--size-mb", "16", "--repeat", "1", "--out", str(tmp_path), "--dir", str(tmp_path)]
  proc = subprocess.run(
    [sys.executable, "scripts/device_check.py", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=180,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  res = json.loads((tmp_path / "device_check.json").read_text())
  assert res["ok"] and res["devices"] == devices and res["platform"] == "cpu"
  assert len(res["checks"]) == 9 and all(c["ok"] for c in res["checks"]), res["checks"]
  assert res["reshard_auto_picks"] == "device_put"  # 1 MiB arrays: below HOST_COPY_MIN_BYTES
  assert "below 16 MiB" in res["reshard_auto_reason"]
  assert res["state_bytes"] == 16 << 20
  for name in (
    "ucp save",
    "orbax save",
    "ucp reshard, auto",
    "jax.device_put",
    "ucp save_async stall",
  ):
    assert res["timings"][name]["seconds"] > 0
  table = (tmp_path / "device_check.txt").read_text()
  assert "correctness: 9/9 checks passed" in table and "reshard, auto" in table
  assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ucp_device_check_")] == []
