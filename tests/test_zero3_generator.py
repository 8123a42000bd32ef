"""scripts/make_zero3_checkpoint.py writes what DeepSpeed reads, and ucp_jax converts it exactly.

The generator stands in for a multi-GiB DeepSpeed ZeRO-3 run in the scale benchmarks,
so a small instance is read back by DeepSpeed's own `zero_to_fp32` and `ds_to_universal`
and compared, with ucp_jax's conversion by one and by two processes, against the values
the generator meant (uneven partitions: every bias ends in padding at dp 3).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ucp_jax

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

SCRIPTS = Path(__file__).parent.parent / "scripts"
import make_zero3_checkpoint as z3  # noqa: E402

DIM, LAYERS, DP = 24, 3, 3


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
  os.environ.setdefault("DS_ACCELERATOR", "cpu")
  folder = tmp_path_factory.mktemp("z3") / "ckpt"
  shapes = z3.model(DIM, LAYERS)
  z3.generate(str(folder), shapes, DP, log=lambda *_: None)
  return folder, shapes


def test_deepspeed_zero_to_fp32_reads_the_values_meant(generated):
  from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

  folder, shapes = generated
  state = get_fp32_state_dict_from_zero_checkpoint(str(folder))
  assert list(state) == list(shapes)
  for name in shapes:
    np.testing.assert_array_equal(state[name].numpy(), z3.expected(shapes, name, "fp32"), name)


def test_deepspeed_ds_to_universal_reads_values_and_moments(generated, tmp_path):
  folder, shapes = generated
  out = tmp_path / "universal"
  proc = subprocess.run(
    [
      *[sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"],
      *["--input_folder", str(folder / z3.TAG), "--output_folder", str(out)],
    ],
    env=dict(os.environ, DS_ACCELERATOR="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in shapes:
    for slot in z3.SLOTS:
      got = torch.load(out / "zero" / name / f"{slot}.pt", weights_only=False)
      got = got["param"] if isinstance(got, dict) else got  # ZeRO-3: the flat tensor itself
      want = z3.expected(shapes, name, slot)
      np.testing.assert_array_equal(got.numpy().reshape(want.shape), want, (name, slot))


@pytest.mark.parametrize("processes", [1, 2])
def test_ucp_convert_reads_values_and_moments(generated, tmp_path, processes):
  folder, shapes = generated
  out = tmp_path / "ucp"
  proc = subprocess.run(
    [
      *[sys.executable, "-m", "ucp_jax.cli", "convert", str(folder), str(out)],
      *["--processes", str(processes)],
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  ckpt = ucp_jax.open(out)
  assert ckpt.step == 3
  for name in shapes:
    for slot, prefix in zip(z3.SLOTS, ("params", "exp_avg", "exp_avg_sq")):
      want = z3.expected(shapes, name, slot)
      np.testing.assert_array_equal(ckpt.read(f"{prefix}/{name}"), want, (name, slot))
