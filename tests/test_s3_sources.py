"""Every source format read in place from a real S3 server (moto's), named by a kvstore spec
(its endpoint is no URL's), and `ucp convert` from S3 to S3: the same arrays as from disk."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import s3_faults

import ucp_jax

pytest.importorskip("moto.server", reason="moto[server] is in the test extras")

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def s3():
  with s3_faults.running(seed=3) as server:
    yield server


def _hf(tmp: Path) -> Path:
  from safetensors.numpy import save_file

  folder = tmp / "hf"
  folder.mkdir()
  rng = np.random.default_rng(0)
  tensors = {
    "model.embed_tokens.weight": rng.standard_normal((16, 8), dtype=np.float32),
    "lm_head.weight": rng.standard_normal((16, 8), dtype=np.float32),
  }
  save_file(tensors, str(folder / "model.safetensors"))
  (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
  return folder


def _orbax(tmp: Path) -> Path:
  import orbax.checkpoint as ocp

  tree = {"params": {"w": np.arange(24, dtype=np.float32).reshape(4, 6)}, "step": np.int64(7)}
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp / "orbax", tree)
  return tmp / "orbax"


def _torch_file(tmp: Path) -> Path:
  pytest.importorskip("torch")
  import torch

  folder = tmp / "pt"
  folder.mkdir()
  torch.save(
    {"fc.weight": torch.arange(6.0).reshape(2, 3), "fc.bias": torch.ones(2)}, folder / "model.pt"
  )
  return folder


def _copy(src: Path):
  return lambda tmp: Path(shutil.copytree(src, tmp / src.name))


SOURCES = {
  "deepspeed": _copy(FIXTURES / "deepspeed" / "z2_fp32_dp2" / "ckpt"),
  "dcp": _copy(FIXTURES / "dcp" / "fsdp2_adamw"),
  "hf": _hf,
  "orbax": _orbax,
  "torch": _torch_file,
}


def _upload(s3, local: Path) -> dict:
  import tensorstore as ts

  bucket = s3.bucket()
  store = ts.KvStore.open({**s3.spec(bucket, "src/", direct=True)}).result()
  for path in sorted(p for p in local.rglob("*") if p.is_file()):
    store.write(path.relative_to(local).as_posix(), path.read_bytes()).result()
  return s3.spec(bucket, "src")


def _same_arrays(a, b) -> None:
  assert a.keys() == b.keys()
  for key in a.keys():
    np.testing.assert_array_equal(np.asarray(a.read(key)), np.asarray(b.read(key)), err_msg=key)


@pytest.mark.parametrize("fmt", sorted(SOURCES))
def test_every_source_reads_in_place_and_converts_from_s3_to_s3(s3, tmp_path, fmt):
  local = SOURCES[fmt](tmp_path)
  spec = _upload(s3, local)
  on_disk = ucp_jax.open(local)
  remote = ucp_jax.open(spec)
  _same_arrays(on_disk, remote)
  assert ucp_jax.open(json.dumps(spec), source=fmt).keys() == on_disk.keys()
  dst = {**spec, "path": "universal"}
  report = ucp_jax.convert(spec, dst)
  assert report.arrays == len(on_disk.keys())
  _same_arrays(on_disk, ucp_jax.open(dst))
  assert ucp_jax.open(dst).verify() == {}


def test_ucp_inspect_convert_and_verify_take_a_spec(s3, tmp_path):
  spec = _upload(s3, _hf(tmp_path))
  env = {**os.environ, **s3_faults.ENV}
  ucp = [sys.executable, "-m", "ucp_jax.cli"]

  def run(*args):
    return subprocess.run([*ucp, *args], env=env, capture_output=True, text=True, timeout=300)

  shown = run("inspect", json.dumps(spec))
  assert shown.returncode == 0 and "format: hf, read in place" in shown.stdout, shown.stderr
  dst = json.dumps({**spec, "path": "universal"})
  converted = run("convert", json.dumps(spec), dst)
  assert converted.returncode == 0, converted.stderr
  assert run("verify", dst).returncode == 0
  refused = run("export", dst, json.dumps({**spec, "path": "out"}), "--format", "hf")
  assert refused.returncode == 2
  assert (
    f"s3://{spec['bucket']}/out: a Hugging Face export is written to a local directory"
    in refused.stderr
  )
