"""Conversion by several processes: disjoint shares, one commit, the same checkpoint as one process."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ucp_jax
from ucp_jax import cli
from ucp_jax.sources._convert import share
from ucp_jax.store._manifest import ArrayInfo

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"


def _info(n: int) -> ArrayInfo:
  return ArrayInfo(shape=(n,), dtype="float32", chunks=(n,))


def test_shares_are_disjoint_complete_and_balanced():
  sizes = [1000, 10, 500, 490, 7, 3, 250, 250, 1, 0]
  arrays = {f"a{i}": _info(n) for i, n in enumerate(sizes)}
  shares = share(arrays, 3)
  assert set().union(*shares) == set(arrays)
  assert sum(len(s) for s in shares) == len(arrays)
  loads = sorted(sum(arrays[k].nbytes for k in s) for s in shares)
  # Largest first to the least loaded: 1000 | 500+250+7 | 490+250+10+3+1 (+0).
  assert loads == [4 * 754, 4 * 757, 4 * 1000]
  assert share(arrays, 3) == shares  # every process computes the same
  assert share(arrays, 1) == [set(arrays)]
  assert share({}, 4) == [set()] * 4


def test_bad_process_options_are_refused(tmp_path, capsys):
  src = str(FIXTURES / "z2_bf16_dp3" / "ckpt")
  assert cli.main(["convert", src, str(tmp_path / "a"), "--processes", "0"]) == 2
  assert "--processes N (N >= 1)" in capsys.readouterr().err
  assert cli.main(["convert", src, str(tmp_path / "b"), "--coordinator", "127.0.0.1:1"]) == 2
  assert "--coordinator needs --num-processes and --process-id" in capsys.readouterr().err
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["z3_bf16_dp3", "z2_bf16_dp3"])
def test_two_processes_write_what_one_writes(tmp_path, fixture):
  src = FIXTURES / fixture / "ckpt"
  one = ucp_jax.convert(src, tmp_path / "one")
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "ucp_jax.cli",
      "convert",
      str(src),
      str(tmp_path / "two"),
      *["--processes", "2"],
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr
  assert f"{one.arrays} arrays" in proc.stdout and "by 2 processes" in proc.stdout, proc.stdout
  a, b = ucp_jax.open(tmp_path / "one"), ucp_jax.open(tmp_path / "two")
  assert b.verify() == {}
  assert a.keys() == b.keys() and a.step == b.step
  assert a.manifest.schema == b.manifest.schema
  for key in a.keys():
    np.testing.assert_array_equal(a[key].checksums, b[key].checksums, err_msg=key)
    np.testing.assert_array_equal(a.read(key), b.read(key), err_msg=key)
  # Process 1's share was not empty, and the commit refuses an array nobody wrote whole.
  assert share(dict(b.manifest.arrays), 2)[1]
