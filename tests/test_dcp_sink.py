"""torch DCP as a sink: folders that `torch.distributed.checkpoint.load` reads, exactly.

torch is the oracle: `dcp.load` (one process, `no_dist`) and `get_state_dict` /
`set_state_dict` into a torch model and optimizer. The slow test runs the real thing on gloo
ranks: FSDP2 on 2 ranks saves, DCP loads the export on 1 and 3, training continues.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from test_dcp_source import FSDP2, GRID, torch_state

import ucp_jax
from ucp_jax.base import _errors
from ucp_jax.sources.dcp import _source

torch = pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]


def _same(a, b, key) -> None:
  if isinstance(a, torch.Tensor):
    assert a.dtype == b.dtype and torch.equal(a, b), key
  else:
    assert a == b, key


@pytest.mark.parametrize("ranks", [1, 3])
def test_export_of_fsdp2_state_loads_in_torch_bit_for_bit(tmp_path, ranks):
  report = ucp_jax.export(FSDP2, tmp_path / "out", format="dcp", ranks=ranks)
  assert (
    report.format == "dcp" and report.step == 3 and report.tied == {"lm_head.weight": "wte.weight"}
  )
  names = sorted(n for n in os.listdir(tmp_path / "out") if n.endswith(".distcp"))
  assert names == [f"__{r}_0.distcp" for r in range(ranks)]
  want, got = torch_state(FSDP2), torch_state(tmp_path / "out")
  assert sorted(got) == sorted(want)  # model, optim.state and optim.param_groups, every key
  for key in want:
    _same(got[key], want[key], key)
  again = _source.describe(str(tmp_path / "out"))  # and it reads back as what it was
  first = _source.describe(str(FSDP2))
  assert again.optimizer == first.optimizer and again.step == 3
  assert [(p.name, p.group, p.tied_to) for p in again.params] == [
    (p.name, p.group, p.tied_to) for p in first.params
  ]


def test_a_jax_train_state_loads_into_torch_model_and_optimizer(tmp_path):
  from flax import nnx
  from jax import numpy as jnp
  from torch.distributed.checkpoint import load as dcp_load
  from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
  from torch_twins import TorchGPT

  from ucp_jax.models.gpt import FlaxGPT, GPTConfig

  cfg = GPTConfig(vocab_size=32, max_len=8, num_layers=1, num_heads=2, d_model=16)
  model = FlaxGPT(cfg, rngs=nnx.Rngs(0))
  import optax

  hyper = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
  opt = nnx.Optimizer(model, optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1), wrt=nnx.Param)
  tokens = jnp.arange(18).reshape(2, 9) % cfg.vocab_size
  for _ in range(2):
    grads = nnx.grad(lambda m: m(tokens[:, :-1]).mean())(model)
    opt.update(model, grads)
  ucp_jax.save_train_state(tmp_path / "jax", model, opt, hyperparams=hyper)
  rules = ucp_jax.rules.gpt2(num_heads=cfg.num_heads)
  ucp_jax.export(tmp_path / "jax", tmp_path / "out", format="dcp", rules=rules, ranks=2)

  torch_model = TorchGPT(cfg)
  torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=0.5)
  msd, osd = get_state_dict(torch_model, torch_opt)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp_load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "out"), no_dist=True)
  set_state_dict(torch_model, torch_opt, model_state_dict=msd, optim_state_dict=osd)
  expected = rules.export_arrays(nnx.state(model, nnx.Param))
  for name, value in torch_model.state_dict().items():
    assert np.array_equal(value.numpy(), expected[name]), name
  group = torch_opt.param_groups[0]
  assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-2, (0.9, 0.95), 0.1)
  state = torch_opt.state[torch_model.h[0].mlp.fc.weight]
  assert float(state["step"]) == 2.0 and float(state["exp_avg_sq"].abs().sum()) > 0


def test_a_checkpoint_without_optimizer_exports_the_model_alone(tmp_path):
  report = ucp_jax.export(GRID, tmp_path / "out", format="dcp", ranks=2)
  got, want = torch_state(tmp_path / "out"), torch_state(GRID)
  assert (
    sorted(got)
    == sorted(want)
    == [f"model.{n}" for n in ("grid.weight", "ids", "rows.bias", "transposed.weight")]
  )
  for key in want:
    _same(got[key], want[key], key)
  assert report.step is None and "params" in report.summary


def test_options_and_destinations(tmp_path):
  for bad in (0, -1, True, "2"):
    with pytest.raises(_errors.InvalidArgumentError, match="ranks="):
      ucp_jax.export(FSDP2, tmp_path / "out", format="dcp", ranks=bad)
  with pytest.raises(_errors.InvalidArgumentError, match="its options: ranks"):
    ucp_jax.export(FSDP2, tmp_path / "out", format="dcp", zero_stage=2)
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep me")
  with pytest.raises(_errors.CheckpointExistsError, match="not an earlier ucp_jax export"):
    ucp_jax.export(FSDP2, tmp_path / "mine", format="dcp")
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
  ucp_jax.export(FSDP2, tmp_path / "out", format="dcp", ranks=3)
  with pytest.raises(_errors.CheckpointExistsError, match="overwrite=True"):
    ucp_jax.export(FSDP2, tmp_path / "out", format="dcp")
  ucp_jax.export(FSDP2, tmp_path / "out", format="dcp", overwrite=True)  # 3 files -> 1
  assert sorted(os.listdir(tmp_path / "out")) == [".metadata", "__0_0.distcp", "ucp_export.json"]


@pytest.mark.slow
def test_fsdp2_round_trip_and_training_torch_jax_torch(tmp_path):
  """FSDP2 (2 gloo ranks) saves DCP; loaded back on 1 and 3 ranks through ucp_jax, bit for bit;
  training continues FSDP2 -> JAX (2 x 4 mesh) -> FSDP2 (1 and 3 ranks) within 1e-5."""
  if importlib_missing("torch.distributed.fsdp"):
    pytest.skip("needs torch with torch.distributed")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own
  script = REPO / "scripts" / "make_dcp_fixtures.py"
  proc = subprocess.run(
    [sys.executable, str(script), "--live", str(tmp_path / "live")],
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  results = json.loads((tmp_path / "live" / "results.json").read_text())
  assert results["pass"] and results["worst_rel"] <= 1e-5
  assert results["round_trip_max_abs"] == {"1": 0.0, "3": 0.0} and results["tensors"] > 100
  _, n, m = results["steps"]
  assert len(results["jax"]) == n and all(len(v) == m for v in results["resumed"].values())


def importlib_missing(name: str) -> bool:
  import importlib.util

  try:
    return importlib.util.find_spec(name) is None
  except ModuleNotFoundError:
    return True


def test_an_export_says_which_client_state_entries_it_did_not_write(tmp_path):
  state = {"fc.weight": np.ones((4, 2), np.float32)}
  schema = {
    "version": 1,
    "naming": "torch",
    "params": {"fc.weight": {"value": "params/fc.weight"}},
    "extra": {"client_state": {"epoch": 3, "name": "run-a", "lr": 0.1}},
  }
  ucp_jax.save(tmp_path / "ckpt", {"params": state}, schema=schema)
  report = ucp_jax.export(tmp_path / "ckpt", tmp_path / "out", format="dcp")
  assert (
    "not written: the source's other entries (epoch, lr, name); the checkpoint keeps them in "
    "its schema's extra.client_state, not as DCP state"
  ) in report.notes
