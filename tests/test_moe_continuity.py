"""The mixture-of-experts cross-framework run (scripts/moe_continuity_demo.py), live.

DeepSpeed AutoEP (ep 2 x dp 2) -> JAX on a (data, expert, model) mesh -> DeepSpeed at ep 1 and
ep 2, Adam moments carried: every leg's losses equal the other framework's within 1e-5.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
def test_moe_run_continues_in_jax_and_back_with_the_same_losses(tmp_path):
  import moe_continuity_demo

  assert moe_continuity_demo.main(["--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "result.json").read_text())
  assert result["ok"] and result["worst"] <= 1e-5
  compared = [row for row in result["rows"] if row[3] is not None]
  assert len(compared) == 9  # JAX against DeepSpeed, then DeepSpeed at ep 1 and 2 against JAX
