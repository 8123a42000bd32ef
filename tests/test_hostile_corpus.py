"""The hostile corpus (`hostile_corpus.py`) through `ucp convert`, `ucp inspect` and the reader.

Every case is run as a user runs it: in a subprocess, under a wall-clock limit and a 4 GiB
address-space limit. Each run must exit 2 (not 0, not a signal) with one line on stderr that
names the hostile file and has no traceback; a conversion must leave nothing at or beside its
destination; and no payload may run (its canary file must not appear). A standalone ``.pt``
goes through the safe reader directly too, besides `ucp convert` and `ucp inspect` (which read
it through the torch source). The other DeepSpeed sources (ZeRO-3, universal, TP, MoE experts) get the
pickle-level cases in process. Two controls show that the crashes are real under plain pickle.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import hostile_corpus as corpus
import pytest

import ucp_jax

TIMEOUT = 30
MEMORY = 4 << 30
_LIMITED = (
  "import os, resource, sys\n"
  f"resource.setrlimit(resource.RLIMIT_AS, ({MEMORY}, {MEMORY}))\n"
  "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
  "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
)
_READ = (  # what the CLI does with an error, around the safe reader
  "import sys\n"
  "from ucp_jax.base import _errors\nfrom ucp_jax.sources._torch_reader import _torch_file\n"
  "try:\n"
  "  _torch_file.load(sys.argv[1])\n"
  "except (_errors.UcpError, OSError) as e:\n"
  "  print('error:', e, file=sys.stderr)\n"
  "  sys.exit(2)\n"
)
_CASES = {case.name: case for case in corpus.CASES}


def _run(*args: str) -> subprocess.CompletedProcess:
  """`python ARGS` under the time and memory limits; a timeout is a failure."""
  try:
    return subprocess.run(
      [sys.executable, "-c", _LIMITED, *args], capture_output=True, text=True, timeout=TIMEOUT
    )
  except subprocess.TimeoutExpired:
    pytest.fail(f"no answer within {TIMEOUT} s: {args}")


def _ucp(*args: str) -> subprocess.CompletedProcess:
  return _run("-m", "ucp_jax.cli", *args)


def _refused(run: subprocess.CompletedProcess, names: Path, pattern: str | None = None) -> None:
  assert run.returncode == 2, f"exit {run.returncode} (negative: a signal)\n{run.stderr}"
  lines = run.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
  assert "Traceback" not in run.stderr
  assert str(names) in lines[0], lines[0]
  if pattern is not None:
    assert re.search(pattern, lines[0]), lines[0]


def _all(*calls):
  with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
    return [f.result() for f in [pool.submit(*call) for call in calls]]


@pytest.fixture
def canary(tmp_path):
  path = tmp_path / "canary"
  yield path
  assert not path.exists(), "a payload ran"


@pytest.mark.parametrize("name", [name for name, case in _CASES.items() if case.make_pt])
def test_standalone_file(name, tmp_path, canary):
  case = _CASES[name]
  pt = tmp_path / "evil.pt"
  case.make_pt(pt, canary)
  before = sorted(os.listdir(tmp_path))
  read, convert, inspect = _all(
    (_run, "-c", _READ, str(pt)),
    (_ucp, "convert", str(pt), str(tmp_path / "dst")),
    (_ucp, "inspect", str(pt)),
  )
  _refused(read, pt, case.pattern)
  _refused(convert, pt)
  _refused(inspect, pt)
  assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("name", list(_CASES))
def test_in_a_deepspeed_folder(name, tmp_path, canary):
  case = _CASES[name]
  src = corpus.make_ds(case, tmp_path / "ckpt", canary)
  before = sorted(os.listdir(tmp_path))
  convert, inspect = _all(
    (_ucp, "convert", str(src), str(tmp_path / "dst")),
    (_ucp, "inspect", str(src)),
  )
  hostile = src / ("latest" if case.make_pt is None else corpus.MODEL_STATES)
  _refused(convert, hostile, case.pattern)
  _refused(inspect, src)
  assert sorted(os.listdir(tmp_path)) == before


# The other DeepSpeed sources, in process: each file a reader of its own opens.

_SOURCES = {
  "zero3 model states": (
    "deepspeed/z3_fp32_dp2/ckpt",
    "global_step3/zero_pp_rank_1_mp_rank_00_model_states.pt",
  ),
  "zero3 optim states": (
    "deepspeed/z3_fp32_dp2/ckpt",
    "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt",
  ),
  "zero2 optim states": (
    "deepspeed/z2_bf16_dp3/ckpt",
    "global_step3/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
  ),
  "universal optimizer": ("deepspeed/z2_fp32_dp2/universal", "zero/optimizer_state.pt"),
  "universal parameter": ("deepspeed/z2_fp32_dp2/universal", "zero/fc1.bias/exp_avg.pt"),
  "universal zero3 models": (
    "deepspeed/z3_bf16_dp3/universal",
    "zero_pp_rank_2_mp_rank_00_model_states.pt",
  ),
  "tp rank 1": ("tp/autotp_tp2_dp2/ckpt", "global_step3/mp_rank_01_model_states.pt"),
  "tp experts": (
    "tp/megatron_tp2/ckpt",
    "global_step1/layer_0_expert_1_mp_rank_00_model_states.pt",
  ),
}
_INJECTED = [
  "code: posix.system",
  "numpy: object dtype with forged flags",
  "billion laughs (lists)",
  "hash bomb (a 2**40-node tuple as a key)",
  "deep tuple as a dict key (C stack)",
  "deep client state (RecursionError)",
  "a list that holds itself",
  "zero stride claiming terabytes",
]


@pytest.mark.parametrize("source", list(_SOURCES))
def test_every_source_reads_safely(source, tmp_path, canary):
  folder, file = _SOURCES[source]
  for name in _INJECTED:
    case = _CASES[name]
    src = tmp_path / name.replace(" ", "_").replace("/", "_")
    shutil.copytree(corpus.FIXTURES / folder, src)
    target = src / file
    target.write_bytes(corpus.inject(target, case.key, case.fragment(canary), case.storages))
    with pytest.raises(ucp_jax.SourceFormatError) as e:
      ucp_jax.convert(src, tmp_path / "dst")
    assert str(src / file) in str(e.value) and re.search(case.pattern, str(e.value)), str(e.value)
    assert not (tmp_path / "dst").exists()


# Controls: what the reader refuses does crash a process that trusts the pickle.


@pytest.mark.parametrize(
  "fragment",
  [corpus.forged_object_dtype, corpus.deep_tuple_key],
  ids=["forged object dtype", "deep tuple key"],
)
def test_control_plain_pickle_crashes(fragment, tmp_path):
  path = tmp_path / "payload.pkl"
  path.write_bytes(corpus.pickled(fragment()))
  code = f"import pickle\nx = pickle.loads(open({str(path)!r}, 'rb').read())\nprint(repr(x))\n"
  run = _run("-c", code)
  assert run.returncode < 0, f"exit {run.returncode}: the payload did not crash plain pickle"
