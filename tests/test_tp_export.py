"""Back to DeepSpeed: exports carry the pattern keys, and a TP=2 AutoTP run loads at TP=1 and 2."""

import importlib.util
import json
import os

import numpy as np
import pytest

import ucp_jax
from ucp_jax.sources._torch_reader import _torch_file
from ucp_jax.sources.deepspeed import _tp

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "tp")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _meta(data):
  out = {k: v for k, v in data.items() if k != "param"}
  if "sub_param_shape" in out:  # an inert record here: compare what DeepSpeed reads from it
    state = out["sub_param_shape"].state
    out["sub_param_shape"] = (list(state["shape"][state["partition_dim"]]), state["partition_dim"])
  return out


@pytest.mark.parametrize("name", ["megatron_tp2", "autotp_tp2_dp1"])
def test_pattern_keys_match_ds_to_universal(tmp_path, name):
  pytest.importorskip("deepspeed")  # SubparamShape is written as DeepSpeed's own class
  ckpt = ucp_jax.convert(os.path.join(FIXTURES, name, "ckpt"), tmp_path / "c")
  params = ucp_jax.open(ckpt.dst).manifest.schema["params"]
  zero = os.path.join(FIXTURES, name, "universal", "zero")
  import torch

  checked = 0
  for param in os.listdir(zero):
    if param.endswith(".pt"):
      continue
    theirs = _meta(_torch_file.load(os.path.join(zero, param, "fp32.pt")))
    if name.startswith("autotp"):  # AutoTP's affine maps replace these keys; keep vocab_tensor
      theirs = {k: v for k, v in theirs.items() if k == "vocab_tensor"}
    meta = _tp.universal_meta(params[param]["pattern"], param)
    torch.save(meta, tmp_path / "m.pt")
    ours = _meta(_torch_file.load(tmp_path / "m.pt"))
    if name.startswith("autotp"):
      ours = {k: v for k, v in ours.items() if k == "vocab_tensor"}
    assert ours == theirs, param
    checked += 1
  assert checked >= 20


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
def test_tp2_autotp_checkpoint_loads_at_tp1_and_tp2_with_the_same_forward(tmp_path):
  import make_tp_fixtures as mk
  import torch

  name = "autotp_tp2_dp2"
  with open(os.path.join(FIXTURES, name, "info.json")) as f:
    reference = np.array(json.load(f)["reference_logits"], np.float32)
  converted = tmp_path / "converted"
  ucp_jax.convert(os.path.join(FIXTURES, name, "ckpt"), converted)
  ucp_jax.export(converted, tmp_path / "ds", format="deepspeed")
  ckpt = ucp_jax.open(converted)
  for tp in (1, 2):
    out = tmp_path / f"tp{tp}.pt"
    mk.run_load(str(tmp_path / "ds"), str(out), tp)
    loaded = torch.load(out, weights_only=False)
    # TP=2 sums its row-parallel outputs across ranks: equal up to float reassociation
    np.testing.assert_allclose(loaded["logits"].numpy(), reference, rtol=0, atol=1e-6)
    if tp == 1:  # every master weight and moment, exactly
      for param, states in loaded["state"].items():
        for state, value in states.items():
          key = f"{'params' if state == 'fp32' else state}/{param}"
          np.testing.assert_array_equal(value.numpy(), ckpt.read(key), err_msg=key)
