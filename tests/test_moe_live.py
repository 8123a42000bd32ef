"""Live DeepSpeed: MoE exports load at another expert-parallel degree, every expert in place.

A fixture run is converted, exported, and loaded into real DeepSpeed 0.19.8 engines on gloo
ranks (scripts/make_moe_fixtures.py `load_into_deepspeed`); each engine's gathered fp32
masters and Adam moments must equal the source engine's bit for bit, and its loss on the
source run's next batches must equal the source's.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import ucp_jax

FIXTURES = Path(__file__).parent / "fixtures" / "moe"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
@pytest.mark.parametrize(
  "name, world, ep, stage",
  [
    ("native_z1_ep2_dp4", 2, 2, 2),  # native ep 2 -> ep 2 at dp 2: finish_load places experts
    ("autoep_mixtral_z1_ep2", 2, 1, 2),  # AutoEP ep 2 -> ep 1, ZeRO-1 -> ZeRO-2
  ],
)
def test_moe_export_loads_into_deepspeed_with_every_expert_in_place(
  tmp_path, name, world, ep, stage
):
  import make_moe_fixtures as mk

  ucp_jax.convert(FIXTURES / name / "ckpt", tmp_path / "u")
  ucp_jax.export(tmp_path / "u", tmp_path / "ds", format="deepspeed")
  (tmp_path / "out").mkdir()
  got = mk.load_into_deepspeed(
    name, tmp_path / "ds", tmp_path / "out", world=world, ep=ep, stage=stage
  )
  info = json.loads((FIXTURES / name / "info.json").read_text())
  assert got["step"] == info["steps"]
  assert abs(got["loss"] - info["loss_after"]) <= 1e-5 * abs(info["loss_after"])
  assert got["oracle"] == info["oracle"]  # the same parameters, experts by global number
  want, have = np.load(FIXTURES / name / "oracle.npz"), np.load(tmp_path / "out" / "oracle.npz")
  for slot in ("value", "exp_avg", "exp_avg_sq"):
    assert np.array_equal(want[slot].view(np.uint32), have[slot].view(np.uint32)), slot
