"""Forged values in genuine DeepSpeed files: one error listing each file and key, never a crash.

Each test splices hostile values into a copy of a real fixture (`hostile_corpus.inject` sets a
top-level key last, so it replaces DeepSpeed's own) and converts it: every value that a reader
would index into, count with or write out is checked first (`sources.deepspeed._contract`).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import struct
import time
from pathlib import Path

import hostile_corpus as corpus
import pytest

import ucp_jax
from ucp_jax.sources import _source_plan
from ucp_jax.sources.deepspeed import _source as _ds_source

TAG = "global_step3"


def _copy(tmp_path: Path, fixture: str = "z2_fp32_dp2", kind: str = "ckpt") -> Path:
  src = tmp_path / "src"
  shutil.copytree(corpus.FIXTURES / "deepspeed" / fixture / kind, src)
  return src


def _set(path: Path, key: str, fragment: bytes, storages=None) -> None:
  path.write_bytes(corpus.inject(path, key, fragment, storages))


def _fails(src: Path, *fragments: str) -> str:
  start = time.perf_counter()
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.convert(src, src.parent / "out")
  assert time.perf_counter() - start < 20
  for fragment in fragments:
    assert re.search(fragment, str(e.value)), str(e.value)
  assert not (src.parent / "out").exists()
  return str(e.value)


def _dict(**items: bytes) -> bytes:
  return b"}(" + b"".join(corpus.text(k) + v for k, v in items.items()) + b"u"


def test_rank_counts_are_bounded(tmp_path):
  src = _copy(tmp_path)
  model = src / TAG / "mp_rank_00_model_states.pt"
  _set(model, "dp_world_size", corpus.integer(10**12))
  _fails(src, re.escape(f"{model}: ['dp_world_size'] is 1000000000000, not an int >= 1 and <="))


def test_every_wrong_type_is_listed(tmp_path):
  src = _copy(tmp_path)
  model = src / TAG / "mp_rank_00_model_states.pt"
  _set(model, "buffer_names", corpus.integer(5))
  _set(model, "shared_params", _dict(**{"head.weight": b"]"}))
  _set(model, "ds_config", _dict(bf16=b"]", optimizer=_dict(params=_dict(adam_w_mode=b"]"))))
  _set(model, "global_steps", b"G" + struct.pack(">d", float("nan")))  # BINFLOAT
  message = _fails(src, "not a DeepSpeed ZeRO model-states file")
  for line in [
    "['buffer_names'] is 5, not a list of a string",
    "['shared_params']['head.weight'] is a list, not a string",
    "['ds_config']['bf16'] is a list, not a dict",
    "['ds_config']['optimizer']['params']['adam_w_mode'] is a list, not a flag",
    "['global_steps'] is nan, not a finite number",
  ]:
    assert f"{model}: {line}" in message, message


def test_step_tensors_must_be_numbers(tmp_path):
  src = _copy(tmp_path, "z3_fp32_dp2")
  optim = src / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
  step = _dict(step=corpus.tensor("x", 3, 0, (3,), (1,)))
  osd = _dict(
    zero_stage=corpus.integer(3),
    partition_count=corpus.integer(2),
    optimizer_state_dict=_dict(state=b"}K\x00" + step + b"s", param_groups=b"]"),
    fp32_flat_groups=b"]",
  )
  _set(optim, "optimizer_state_dict", osd, {"x": bytes(12)})
  _fails(
    src,
    re.escape(
      f"{optim}: ['optimizer_state_dict']['optimizer_state_dict']['state'][0]['step'] is an "
      "array of shape (3,) and float32, not a finite number"
    ),
  )


def test_universal_parameter_names_stay_in_zero(tmp_path):
  src = _copy(tmp_path, kind="universal")
  (tmp_path / "elsewhere").mkdir()
  model = src / "mp_rank_00_model_states.pt"
  groups = _dict(**{"../../elsewhere": corpus.ints(3)}) + b"}"  # DeepSpeed's two groups
  _set(model, "param_shapes", b"](" + groups + b"e")
  _fails(src, r"parameter name '\.\./\.\./elsewhere' is not a folder name in zero/")


def test_tensors_that_alias_each_other_are_not_written(tmp_path):
  src = _copy(tmp_path, "z1_fp32_dp2")
  model = src / TAG / "mp_rank_00_model_states.pt"
  one_mib = corpus.tensor("big", 1 << 18, 0, (1 << 18,), (1,)) + b"q\x00"  # memoized
  frozen = b"".join(corpus.text(f"frozen.{i}") + b"h\x00" for i in range(1500))
  module = corpus.call(corpus.glob("collections", "OrderedDict"))
  module += b"(" + corpus.text("scale") + one_mib + frozen + b"u"
  _set(model, "module", module, {"big": bytes(1 << 20)})
  _fails(src, r"its arrays would take \d+ bytes, more than 4 times .*MAX_GROWTH")


def test_patterns_that_backtrack_are_refused(tmp_path):
  src = tmp_path / "src"
  shutil.copytree(corpus.FIXTURES / "tp" / "autotp_tp2_dp1" / "ckpt", src)
  model = src / TAG / "mp_rank_01_model_states.pt"
  patterns = b"]" + b"(" + corpus.text("(a+)+$") + corpus.text("(") + b"e"
  _set(model, "universal_checkpoint_info", _dict(tp_replicated_parameter_patterns=patterns))
  _fails(
    src,
    r"\['tp_replicated_parameter_patterns'\]\[\d+\] = '\(a\+\)\+\$' has a repeat inside a",
    r"\['tp_replicated_parameter_patterns'\]\[\d+\] = '\(' is not a regex",
  )


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_overlapping_slices_are_refused(tmp_path):
  torch = pytest.importorskip("torch")
  src = _copy(tmp_path, "z2_fp32_dp2")
  optim = src / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
  state = torch.load(optim, weights_only=False)
  mappings = state["optimizer_state_dict"]["param_slice_mappings"][0]
  first, second = list(mappings)[:2]
  mappings[second].start = mappings[first].start
  torch.save(state, optim)
  message = _fails(src, r"\['param_slice_mappings'\]\[0\]: '[^']+' and '[^']+' share elements")
  assert f"'{first}'" in message and f"'{second}'" in message


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
@pytest.mark.parametrize("fixture", ["z1_bf16_dp2", "z3_bf16_dp3"])
def test_mutated_values_give_source_format_errors(fixture, tmp_path):
  """Every value two levels down in the model and optimizer states, replaced by values of the
  wrong type or range: convert either works or raises SourceFormatError (never TypeError...)."""
  torch = pytest.importorskip("torch")
  base = corpus.FIXTURES / "deepspeed" / fixture / "ckpt"
  files = sorted((base / TAG).glob("*.pt"))[:2]
  values = [None, "x", -1, 10**12, 1.5, [1, [2]], {"a": 1}, torch.zeros(2, 2), torch.zeros(())]
  tried = 0
  for file in files:
    tree = torch.load(file, weights_only=False)
    for path in _paths(tree):
      for value in values:
        src = tmp_path / f"m{tried}"
        shutil.copytree(base, src)
        mutated = torch.load(file, weights_only=False)
        _put(mutated, path, value)
        torch.save(mutated, src / TAG / file.name)
        tried += 1
        try:
          plan = _ds_source.describe(src)
          _source_plan.layout(plan)
        except ucp_jax.SourceFormatError:
          pass
        shutil.rmtree(src)
  assert tried > 100


def _paths(tree, prefix=(), depth=0):
  if depth == 2 or not isinstance(tree, dict):
    return
  for key, value in tree.items():
    yield (*prefix, key)
    yield from _paths(value, (*prefix, key), depth + 1)


def _put(tree, path, value):
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value


@pytest.mark.parametrize(
  ("make", "message"),
  [
    (lambda p: os.mkfifo(p), r"latest: a FIFO \(named pipe\), not a regular file"),
    (lambda p: p.symlink_to("/dev/zero"), r"latest: a character device, not a regular file"),
    (lambda p: p.write_bytes(b"global_step3" + b" " * 5000), r"latest: names 'global_step3"),
    (lambda p: p.write_bytes(b"\xff\xfe"), r"latest: not UTF-8 text"),
    (lambda p: p.write_text(".."), r"latest: names '\.\.', not a tag folder beside it"),
    (lambda p: p.write_text("a/../global_step3"), r"latest: names 'a/\.\./global_step3'"),
  ],
  ids=["fifo", "dev zero", "long", "not utf-8", "dot dot", "separator"],
)
def test_latest_names_one_folder_beside_it(make, message, tmp_path):
  src = _copy(tmp_path)
  (src / "latest").unlink()
  make(src / "latest")
  _fails(src, message)
  with pytest.raises(ucp_jax.SourceFormatError, match=message):  # `ucp inspect` reads it too
    ucp_jax.open(src)
