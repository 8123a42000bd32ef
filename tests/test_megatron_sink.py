"""`ucp export --format megatron`: a Megatron-LM root that megatron-core loads and trains on.

The sources are the megatron-core fixtures (tests/fixtures/megatron_core, TP 2 x DP 2). The
oracle is megatron-core itself, where it is installed (`pip install --no-deps
--ignore-requires-python megatron-core==0.19.2 psutil triton`): it loads the export at TP 1,
on one rank and on two DP ranks, with its distributed optimizer, and trains on
(tests/support/megatron_load_worker.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ucp_jax
from ucp_jax.base._errors import CheckpointExistsError, InvalidArgumentError, MappingError
from ucp_jax.sources import _registry

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_core"
SUPPORT = Path(__file__).parent / "support"
SCRIPTS = Path(__file__).parents[1] / "scripts"
pytest.importorskip("torch")  # the sink writes torch files


def expected(variant: str) -> dict[str, np.ndarray]:
  with np.load(FIXTURES / variant / "expected.npz") as data:
    return dict(data)


def whole(tensor) -> np.ndarray:
  return np.concatenate([np.asarray(p).reshape(-1) for p in tensor.pieces()]).reshape(tensor.shape)


@pytest.mark.parametrize("variant", ["distopt_dp_reshardable", "adam_bf16"])
def test_an_export_reads_back_as_the_state_it_was(tmp_path, variant):
  report = ucp_jax.export(FIXTURES / variant, tmp_path / "run", format="megatron")
  assert report.tag == "iter_0000002" and report.step == 2
  assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "2"
  source = {p.name: p for p in _registry.describe(FIXTURES / variant).params}
  back = _registry.describe(tmp_path / "run")
  assert back.extra["megatron"]["optimizer_format"] == "fully_reshardable"
  assert back.step == 2 and back.optimizer.step == 2
  assert [g.values["weight_decay"] for g in back.optimizer.groups] == [0.1, 0.0]
  for p in back.params:
    assert np.array_equal(whole(p.value), whole(source[p.name].value)), p.name
    for slot, tensor in p.slots.items():
      assert np.array_equal(whole(tensor), whole(source[p.name].slots[slot])), (p.name, slot)
    assert p.group == source[p.name].group and p.pattern == source[p.name].pattern
  assert back.extra["megatron"]["args"]["hidden_size"] == 16


def test_the_model_tensors_are_the_masters_in_the_runs_dtype(tmp_path):
  import ml_dtypes

  ucp_jax.export(FIXTURES / "adam_bf16", tmp_path / "run", format="megatron")
  layout_dtype = _weight_dtype(tmp_path / "run" / "iter_0000002", "output_layer.weight")
  assert layout_dtype == np.dtype(ml_dtypes.bfloat16)
  ucp_jax.export(FIXTURES / "adam_bf16", tmp_path / "f32", format="megatron", dtype="float32")
  assert _weight_dtype(tmp_path / "f32" / "iter_0000002", "output_layer.weight") == np.float32


def _weight_dtype(folder: Path, key: str) -> np.dtype:
  from ucp_jax.sources.dcp import _metadata

  return _metadata.read(str(folder)).entries[key].dtype


def test_ucp_export_flags_choose_the_iteration_and_dtype(tmp_path):
  done = subprocess.run(
    [sys.executable, "-m", "ucp_jax.cli", "export", str(FIXTURES / "adam"), str(tmp_path / "run"),
     "--format", "megatron", "--iteration", "7", "--dtype", "bfloat16"],
    capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert done.returncode == 0, done.stderr
  assert "Megatron-LM root, iter_0000007: 9 params in bfloat16" in done.stdout
  assert ucp_jax.open(tmp_path / "run").manifest.source["iteration_folder"] == "iter_0000007"


def test_a_second_export_replaces_the_first_and_nothing_else(tmp_path):
  ucp_jax.export(FIXTURES / "adam", tmp_path / "run", format="megatron")
  ucp_jax.export(FIXTURES / "adam", tmp_path / "run", format="megatron", overwrite=True)
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("mine")
  with pytest.raises(CheckpointExistsError, match="not an earlier ucp_jax export"):
    ucp_jax.export(FIXTURES / "adam", tmp_path / "other", format="megatron", overwrite=True)
  assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_a_checkpoint_without_megatron_names_is_refused(tmp_path):
  fsdp2 = Path(__file__).parent / "fixtures" / "dcp" / "fsdp2_adamw"  # torch names (h.0.mlp...)
  with pytest.raises(MappingError, match=r"no Megatron names, and no Hugging Face config\.json"):
    ucp_jax.export(fsdp2, tmp_path / "out", format="megatron")
  gpt2 = {"model_type": "gpt2", "n_layer": 2}
  with pytest.raises(MappingError, match="the config is not a Llama's: model_type 'gpt2'"):
    ucp_jax.export(fsdp2, tmp_path / "out", format="megatron", config=gpt2)
  llama = {"model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
           "vocab_size": 60, "hidden_size": 16, "intermediate_size": 24}  # fmt: skip
  refusal = r"not a Llama that Megatron's GPT holds: `wte\.weight` has no Megatron counterpart;"
  with pytest.raises(MappingError, match=refusal + r".* and \d+ more"):
    ucp_jax.export(fsdp2, tmp_path / "out", format="megatron", config=llama)
  assert not (tmp_path / "out").exists()
  with pytest.raises(InvalidArgumentError, match="dtype='int8': one of float32"):
    ucp_jax.export(FIXTURES / "adam", tmp_path / "out", format="megatron", dtype="int8")


needs_megatron = pytest.mark.skipif(
  importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)


def _megatron_loads(root: Path, out: Path, tp: int, world: int, bf16: bool) -> dict:
  out.mkdir()
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(SUPPORT)])}
  done = subprocess.run(
    [sys.executable, str(SUPPORT / "megatron_load_worker.py"), str(root), str(out), str(tp),
     str(world), "1" if bf16 else "0"],
    capture_output=True, text=True, timeout=900, env=env,
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-4000:]
  with np.load(out / "loaded.npz") as data:
    loaded = dict(data)
  return {"state": loaded, **json.loads((out / "losses.json").read_text())}


@needs_megatron
@pytest.mark.slow
def test_megatron_loads_a_dp_reshardable_run_at_another_tp_and_dp_and_trains_on(tmp_path):
  """TP 2 x DP 2 (dp_reshardable buckets) -> ucp -> TP 1 x DP 2: the same state, bit for bit,
  and the next two losses of the uninterrupted run."""
  variant = "distopt_dp_reshardable"
  ucp_jax.export(FIXTURES / variant, tmp_path / "run", format="megatron")
  got = _megatron_loads(tmp_path / "run", tmp_path / "out", tp=1, world=2, bf16=False)
  want = expected(variant)
  assert sorted(got["state"]) == sorted(want)
  for key, value in want.items():
    assert np.array_equal(got["state"][key], value), key
  info = json.loads((FIXTURES / variant / "info.json").read_text())
  np.testing.assert_allclose(got["losses"], info["continued_losses"], rtol=1e-5)


@needs_megatron
@pytest.mark.slow
def test_megatron_loads_a_bf16_run_on_one_rank(tmp_path):
  variant = "distopt_fully_reshardable_bf16"
  ucp_jax.export(FIXTURES / variant, tmp_path / "run", format="megatron")
  got = _megatron_loads(tmp_path / "run", tmp_path / "out", tp=1, world=1, bf16=True)
  want = expected(variant)
  for key, value in want.items():
    assert np.array_equal(got["state"][key], value), key
  assert all(np.isfinite(got["losses"]))


@pytest.mark.parametrize("interruption", [OSError("disk full"), KeyboardInterrupt()])
def test_an_export_cut_short_leaves_the_previous_one(tmp_path, monkeypatch, interruption):
  """A failing write or Ctrl-C in the middle: the earlier export is untouched, nothing staged."""
  from ucp_jax.sinks import _dcp

  ucp_jax.export(FIXTURES / "adam", tmp_path / "run", format="megatron")
  before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
  real = _dcp.RankFileWriter.tensor
  calls = []

  def tensor(self, flat, array, path):
    calls.append(flat)
    if len(calls) == 5:
      raise interruption
    return real(self, flat, array, path)

  monkeypatch.setattr(_dcp.RankFileWriter, "tensor", tensor)
  with pytest.raises(type(interruption)):
    ucp_jax.export(FIXTURES / "adam", tmp_path / "run", format="megatron", overwrite=True)
  assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
  assert _registry.describe(tmp_path / "run").step == 2
