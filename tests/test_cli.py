"""The `ucp` command line, run as a user runs it."""

import json
import subprocess
import sys

import numpy as np
import pytest

import ucp_jax
from ucp_jax import _cli


@pytest.fixture
def ckpt(tmp_path):
  path = tmp_path / "ckpt"
  ucp_jax.save(
    path,
    {"params": {"w": np.ones((4, 8), np.float32), "b": np.zeros(8, np.int32)}, "step": 3},
    step=3,
  )
  return path


def test_inspect_table(ckpt, capsys):
  assert _cli.main(["inspect", str(ckpt)]) == 0
  out = capsys.readouterr().out
  assert "params/w" in out and "(4, 8)" in out and "float32" in out and "128 B" in out
  assert "3 arrays" in out and "168 B" in out


def test_inspect_json(ckpt, capsys):
  assert _cli.main(["inspect", str(ckpt), "--json"]) == 0
  data = json.loads(capsys.readouterr().out)
  assert data["step"] == 3 and data["total_bytes"] == 168 and data["total_arrays"] == 3
  assert data["arrays"]["params/b"] == {"shape": [8], "dtype": "int32", "chunks": [8], "bytes": 32}
  assert data["arrays"]["step"]["kind"] == "scalar"


def test_verify_ok_and_bad(ckpt, capsys):
  assert _cli.main(["verify", str(ckpt)]) == 0
  assert "OK, 3 arrays" in capsys.readouterr().out
  chunk = next(p for p in (ckpt / "params" / "w" / "c").rglob("*") if p.is_file())
  raw = bytearray(chunk.read_bytes())
  raw[0] ^= 1
  chunk.write_bytes(bytes(raw))
  (ckpt / "step" / "c").unlink()  # the one chunk of a 0-d array
  assert _cli.main(["verify", str(ckpt)]) == 1
  out = capsys.readouterr().out
  assert (
    "2 bad array(s)" in out
    and "params/w: DATA_LOSS" in out
    and "step: 1 of 1 chunks missing" in out
  )


def test_missing_checkpoint_exits_2(tmp_path, capsys):
  assert _cli.main(["inspect", str(tmp_path / "nope")]) == 2
  assert "no checkpoint here" in capsys.readouterr().err


def test_console_script_runs(ckpt):
  proc = subprocess.run(
    [sys.executable, "-m", "ucp_jax._cli", "verify", str(ckpt)],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr
  assert "OK" in proc.stdout


@pytest.mark.slow
def test_demo_small(tmp_path, capsys):
  assert _cli.main(["demo", "--out", str(tmp_path / "demo"), "--steps", "2"]) == 0
  out = capsys.readouterr().out
  assert "bit-identical to the saved state: True" in out and "PASS" in out
  assert ucp_jax.open(tmp_path / "demo" / "ckpt_leg2").step == 4
