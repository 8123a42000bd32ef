"""`ucp_jax.convert` on real DeepSpeed checkpoints, against DeepSpeed's own `ds_to_universal`.

The fixtures (tests/fixtures/deepspeed, docs/deepspeed_layouts.md) were written by DeepSpeed
0.19.8 and converted by its `ds_to_universal`; both are read here with the safe reader, so
these tests need neither torch nor DeepSpeed. Damaged sources are copies in tmp_path.
"""

import json
import math
import os
import re
import shutil
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ucp_jax
from ucp_jax import cli
from ucp_jax.sources import _convert, _source_plan
from ucp_jax.sources._source_plan import jsonable, release
from ucp_jax.sources._torch_reader import _torch_file
from ucp_jax.sources.deepspeed import _source as _ds_source

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "info.json").is_file())
TAG = "global_step3"


def _info(name: str) -> dict:
  return json.loads((FIXTURES / name / "info.json").read_text())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """convert(FIXTURES/name/which) once per module: name, which -> the opened checkpoint."""
  cache = {}

  def get(name: str, which: str = "ckpt") -> ucp_jax.Checkpoint:
    if (name, which) not in cache:
      dst = tmp_path_factory.mktemp(f"{name}_{which or 'root'}") / "ucp"
      report = ucp_jax.convert(FIXTURES / name / which, dst)
      cache[(name, which)] = ucp_jax.open(report.dst)
    return cache[(name, which)]

  return get


def _bits(array: np.ndarray) -> bytes:
  return np.ascontiguousarray(array).tobytes()


def _universal(name: str, param: str, slot: str, shape) -> np.ndarray:
  data = _torch_file.load(FIXTURES / name / "universal" / "zero" / param / f"{slot}.pt")
  data = data["param"] if isinstance(data, dict) else data  # ZeRO-3: a bare flat tensor
  assert data.size == math.prod(shape)
  return data.reshape(shape)


def test_all_fixtures_present():
  assert len(NAMES) == 9


@pytest.mark.parametrize("name", NAMES)
def test_equals_ds_to_universal_bit_for_bit(name, converted):
  ckpt, info = converted(name), _info(name)
  schema = ckpt.manifest.schema
  groups = schema["optimizer"]["groups"]
  opt = _torch_file.load(FIXTURES / name / "universal" / "zero" / "optimizer_state.pt")
  for group in info["param_groups"]:
    for param in group["names"]:
      entry, shape = schema["params"][param], tuple(info["params"][param]["shape"])
      keys = {"fp32": entry["value"], **entry["slots"]}
      assert sorted(keys) == ["exp_avg", "exp_avg_sq", "fp32"]
      for slot, key in keys.items():
        got, want = ckpt.read(key), _universal(name, param, slot, shape)
        assert got.dtype == np.float32 and got.shape == shape, key
        assert _bits(got) == _bits(want), key
      step = groups[entry["group"]]["step"]
      if info["zero_stage"] == 3:  # no step.pt: the sub-groups' steps
        steps = {float(s["step"]) for s in opt["optimizer_state_dict"]["state"].values()}
      else:
        path = FIXTURES / name / "universal" / "zero" / param / "step.pt"
        steps = {float(_torch_file.load(path))}
      assert steps == {step} == {info["steps"]}
  assert ckpt.verify() == {}


def _model_states(name: str, rank: int = 0) -> dict:
  stage3 = _info(name)["zero_stage"] == 3
  file = f"zero_pp_rank_{rank}_mp_rank_00" if stage3 else "mp_rank_00"
  return _torch_file.load(FIXTURES / name / "ckpt" / TAG / f"{file}_model_states.pt")


@pytest.mark.parametrize("name", NAMES)
def test_frozen_params_and_buffers_equal_the_model_states(name, converted):
  ckpt, info = converted(name), _info(name)
  dtype = np.dtype(ml_dtypes.bfloat16) if info["dtype"] == "bfloat16" else np.dtype(np.float32)
  if info["zero_stage"] == 3:
    pieces = [_model_states(name, r)["frozen_param_fragments"]["gate"] for r in range(info["dp"])]
    gate = np.concatenate(pieces)[:19]
  else:
    gate = _model_states(name)["module"]["gate"]
    if info["zero_stage"] == 2:
      assert _bits(_model_states(name)["frozen_param_fragments"]["gate"]) == _bits(gate)
  got = ckpt.read("params/gate")
  assert got.dtype == dtype and _bits(got) == _bits(gate)
  scale = ckpt.read("buffers/scale")
  assert scale.dtype == np.float32 and _bits(scale) == _bits(_model_states(name)["module"]["scale"])


@pytest.mark.parametrize("name", NAMES)
def test_schema_is_complete(name, converted):
  ckpt, info = converted(name), _info(name)
  m = ckpt.manifest
  schema = m.schema
  assert schema["version"] == 1 and schema["naming"] == "torch"
  params = schema["params"]
  assert sorted(params) == info["all_param_names"]
  for g, group in enumerate(info["param_groups"]):
    assert [n for n, e in params.items() if e["group"] == g] == group["names"]
    got = schema["optimizer"]["groups"][g]
    assert (got["lr"], got["weight_decay"]) == (group["lr"], group["weight_decay"])
    assert (got["betas"], got["eps"]) == (info["adam"]["betas"], info["adam"]["eps"])
    assert got["step"] == info["steps"] and "params" not in got
    for n in group["names"]:
      assert params[n] == {
        "value": f"params/{n}",
        "slots": {"exp_avg": f"exp_avg/{n}", "exp_avg_sq": f"exp_avg_sq/{n}"},
        "group": g,
        "frozen": False,
        "tied_to": None,
      }
  assert schema["optimizer"]["type"] == "adamw" and schema["optimizer"]["step"] == info["steps"]
  for n in info["frozen"]:
    assert params[n] == {
      "value": f"params/{n}",
      "slots": {},
      "group": None,
      "frozen": True,
      "tied_to": None,
    }
  for alias, holder in info["tied"].items():
    assert params[alias]["tied_to"] == holder and params[alias]["slots"] == {}
    assert params[alias]["value"] == f"params/{holder}" and f"params/{alias}" not in ckpt
  assert schema["buffers"] == {b: f"buffers/{b}" for b in info["buffers"]}
  trained = [n for g in info["param_groups"] for n in g["names"]]
  want = {f"params/{n}" for n in [*trained, *info["frozen"]]} | {"buffers/scale"}
  want |= {f"{slot}/{n}" for n in trained for slot in ("exp_avg", "exp_avg_sq")}
  assert set(ckpt.keys()) == want
  assert {ckpt[k].role for k in ckpt.keys()} == {"value", "exp_avg", "exp_avg_sq", "buffer"}
  extra = schema["extra"]
  assert extra["global_steps"] == info["steps"] == m.step
  assert extra["global_samples"] == info["steps"] * info["micro_batch"] * info["dp"]
  assert extra["lr_scheduler"] is None and extra["ds_config"] == info["config"]
  assert extra["client_state"] == {"universal_checkpoint_info": {}}
  assert extra["source_layout"] == {
    "zero_stage": info["zero_stage"],
    "dp": info["dp"],
    "tp": 1,
    "pp": 1,
    "ds_version": info["deepspeed_version"],
    "dtype": info["dtype"],
    "optimizer_class": info["optimizer_class"],
  }
  assert m.source["framework"] == "deepspeed" and m.source["format"] == "zero"
  assert m.source["tag"] == TAG and m.source["zero_stage"] == info["zero_stage"]


@pytest.mark.parametrize("name", NAMES)
def test_deepspeed_universal_source_equals_direct(name, converted):
  direct, universal = converted(name), converted(name, "")  # "": via latest_universal
  assert universal.manifest.source["format"] == "universal"
  assert universal.manifest.schema == direct.manifest.schema
  assert universal.manifest.arrays == direct.manifest.arrays
  assert universal.step == direct.step
  for key in direct.keys():
    assert _bits(universal.read(key)) == _bits(direct.read(key)), key


def test_detects_every_kind_of_folder():
  root = FIXTURES / "z2_bf16_dp3"
  assert _ds_source.detect(root / "ckpt") == ("deepspeed", str(root / "ckpt" / TAG))
  assert _ds_source.detect(root / "ckpt" / TAG) == ("deepspeed", str(root / "ckpt" / TAG))
  assert _ds_source.detect(root / "universal") == ("deepspeed_universal", str(root / "universal"))
  assert _ds_source.detect(root) == ("deepspeed_universal", str(root / "universal"))


def test_report_and_progress(tmp_path, monkeypatch):
  monkeypatch.setattr(_convert, "_MIN_IN_FLIGHT", 1)  # every write waits for the one before
  calls = []
  report = ucp_jax.convert(
    FIXTURES / "z3_fp32_dp2" / "ckpt", tmp_path / "out", progress=lambda *a: calls.append(a)
  )
  ckpt = ucp_jax.open(tmp_path / "out")
  assert report == _convert.ConvertReport(
    src=str(FIXTURES / "z3_fp32_dp2" / "ckpt" / TAG),
    dst=str(tmp_path / "out"),
    format="deepspeed",
    step=3,
    params=9,
    arrays=23,
    bytes=ckpt.nbytes,
    seconds=report.seconds,
  )
  assert calls[0] == ("", 0, ckpt.nbytes)
  assert sorted(c[0] for c in calls[1:]) == ckpt.keys()
  assert sum(c[1] for c in calls) == ckpt.nbytes and {c[2] for c in calls} == {ckpt.nbytes}


def test_cli_convert(tmp_path, capsys):
  src, dst = str(FIXTURES / "bf16opt_dp2" / "ckpt"), str(tmp_path / "out")
  assert cli.main(["convert", src, dst]) == 0
  out = capsys.readouterr().out
  assert re.search(r"9 params, 23 arrays, 11\.4 KiB, step 3, in [0-9.]+ s", out), out
  assert dst in out and "deepspeed" in out
  assert cli.main(["convert", src, dst]) == 2
  assert "overwrite" in capsys.readouterr().err
  assert cli.main(["convert", src, dst, "--overwrite"]) == 0


def test_release_keeps_data_readable():
  path = FIXTURES / "z1_fp32_dp2" / "ckpt" / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
  osd = _torch_file.load(path)["optimizer_state_dict"]
  part = osd["single_partition_of_fp32_groups"][0]
  before = part.copy()
  release([part[10:300], part, np.zeros(3)])
  assert np.array_equal(part, before)


def test_jsonable():
  record = _torch_file.InertObject("a.B", args=(1,), state={"x": (1, 2)})
  assert jsonable({1: (np.float32(0.5), float("nan"), record, np.arange(2))}) == {
    "1": [0.5, "nan", {"__class__": "a.B", "args": [1], "state": {"x": [1, 2]}}, [0, 1]]
  }


# ------------------------------------------------------------------------------------------
# Bad input: every problem listed with file and key, nothing committed


def _copy(tmp_path: Path, name: str) -> Path:
  dst = tmp_path / name
  shutil.copytree(FIXTURES / name / "ckpt", dst)
  return dst


def _rewrite(path: Path, edit) -> None:
  """Rewrites the zip at `path` with `edit(entry_name, bytes) -> bytes` applied to entries."""
  with zipfile.ZipFile(path) as zin:
    entries = [(i.filename, edit(i.filename, zin.read(i))) for i in zin.infolist()]
  with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
    for entry, data in entries:
      zout.writestr(entry, data)


def _patch_pickle(path: Path, pattern: bytes, repl) -> None:
  def edit(entry, data):
    if not entry.endswith("/data.pkl"):
      return data
    new, count = re.subn(pattern, repl, data, flags=re.DOTALL)
    assert count, f"{pattern!r} not in {path}"
    return new

  _rewrite(path, edit)


def _fails(src, dst, *fragments):
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.convert(src, dst)
  for fragment in fragments:
    assert fragment in str(e.value), str(e.value)
  assert not os.path.exists(dst)
  return str(e.value)


def test_missing_rank_file(tmp_path):
  src = _copy(tmp_path, "z2_fp32_dp2")
  (src / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
  message = _fails(src, tmp_path / "out", "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing")
  assert "dp_world_size 2 (from mp_rank_00_model_states.pt['dp_world_size'])" in message


def test_missing_zero3_model_states(tmp_path):
  src = _copy(tmp_path, "z3_bf16_dp3")
  (src / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
  _fails(src, tmp_path / "out", "missing for dp ranks [1]", "zero_pp_rank_1_mp_rank_00_model")


def test_rank_file_of_another_run(tmp_path):
  src = _copy(tmp_path, "z2_fp32_dp2")
  other = FIXTURES / "z2_fp32_dp3" / "ckpt" / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
  shutil.copy(other, src / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
  _fails(
    src,
    tmp_path / "out",
    "rank files from different runs or steps",
    f"{src / TAG / 'zero_pp_rank_1_mp_rank_00_optim_states.pt'}: ['optimizer_state_dict']"
    "['partition_count'] is [3, 3], but mp_rank_00_model_states.pt has dp_world_size 2",
  )


def test_rank_files_of_other_steps_and_versions(tmp_path):
  src = _copy(tmp_path, "z3_bf16_dp3")
  model = src / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt"
  _patch_pickle(model, rb"(global_steps(?:q.|r....))K\x03", lambda m: m[1] + b"K\x04")
  _patch_pickle(model, rb"K%K\x0c\x86", b"K\x0cK%\x86")  # embed.weight (37, 12) -> (12, 37)
  optim = src / TAG / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
  _patch_pickle(optim, rb"0\.19\.8", b"0.19.9")
  _fails(
    src,
    tmp_path / "out",
    "model-states files from different runs or steps",
    f"{model}: ['global_steps'] is 4, but 3 in zero_pp_rank_0_mp_rank_00_model_states.pt",
    f"{model}: ['param_shapes'] is ",
  )
  model.unlink()
  shutil.copy(FIXTURES / "z3_bf16_dp3" / "ckpt" / TAG / model.name, model)
  _fails(src, tmp_path / "out", f"{optim}: ['ds_version'] is '0.19.9', but '0.19.8' in")


def test_zero12_version_mismatch(tmp_path):
  src = _copy(tmp_path, "z1_fp32_dp2")
  optim = src / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
  _patch_pickle(optim, rb"0\.19\.8", b"0.19.7")
  _fails(
    src,
    tmp_path / "out",
    f"{optim}: ['ds_version'] is '0.19.7', but '0.19.8' in mp_rank_00_model_states.pt",
    f"{optim}: ['optimizer_state_dict']['ds_version'] is '0.19.7'",
  )


def test_truncated_zip(tmp_path):
  src = _copy(tmp_path, "z2_bf16_dp3")
  optim = src / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
  optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
  _fails(src, tmp_path / "out", f"{optim}: truncated or corrupt zip file")


def test_truncated_storage(tmp_path):
  src = _copy(tmp_path, "z2_bf16_dp3")
  optim = src / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
  _rewrite(optim, lambda entry, data: data[:10] if entry.endswith("/data/1") else data)
  _fails(src, tmp_path / "out", f"{optim}: storage ", "data/1' holds 10 bytes", "truncated")


def test_unknown_zero_layout_lists_what_was_expected(tmp_path):
  src = _copy(tmp_path, "z2_fp32_dp3")
  optims = sorted((src / TAG).glob("*optim_states.pt"))
  for optim in optims:
    _patch_pickle(optim, rb"param_slice_mappings", b"param_slice_mappingz")
  message = _fails(
    src,
    tmp_path / "out",
    "not a DeepSpeed ZeRO-1/2 or BF16-optimizer checkpoint of a known layout",
    "'param_slice_mappings', 'ds_version')",
  )
  for optim in optims:
    assert f"{optim}: missing key ['optimizer_state_dict']['param_slice_mappings']" in message


def test_unknown_zero3_layout(tmp_path):
  src = _copy(tmp_path, "z3_fp32_dp2")
  optim = src / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
  _patch_pickle(optim, rb"fp32_flat_groups", b"fp32_flat_groupz")
  _patch_pickle(optim, rb"optimizer_state_dict", b"optimizer_state_dicz")
  _fails(
    src,
    tmp_path / "out",
    "not a DeepSpeed ZeRO-3 checkpoint of a known layout",
    f"{optim}: missing key ['optimizer_state_dict']",
  )


def test_unknown_formats(tmp_path):
  _fails(tmp_path / "nope", tmp_path / "out", "nope: no such file or directory")
  (tmp_path / "empty").mkdir()
  _fails(tmp_path / "empty", tmp_path / "out", "Looked for: a DeepSpeed checkpoint folder")
  (tmp_path / "empty" / "weights.dat").write_bytes(b"x")
  _fails(tmp_path / "empty", tmp_path / "out", "universal folder", "Found: weights.dat")
  _fails(
    tmp_path / "empty" / "weights.dat",
    tmp_path / "out",
    "weights.dat: a file that is no checkpoint ucp_jax reads",
  )
  (tmp_path / "empty" / "latest").write_text("global_step9")
  _fails(tmp_path / "empty", tmp_path / "out", "names the tag 'global_step9'")


def test_failed_conversion_commits_nothing(tmp_path, monkeypatch):
  src = FIXTURES / "z1_bf16_dp2" / "ckpt"
  old = ucp_jax.convert(src, tmp_path / "out")
  calls = []
  assemble = _source_plan.assemble

  def flaky(tensor):
    calls.append(tensor)
    if len(calls) == 5:
      raise ucp_jax.SourceFormatError("boom")
    return assemble(tensor)

  monkeypatch.setattr(_source_plan, "assemble", flaky)
  with pytest.raises(ucp_jax.SourceFormatError, match="boom"):
    ucp_jax.convert(src, tmp_path / "out", overwrite=True)
  assert ucp_jax.open(old.dst).verify() == {}
  assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging left behind
  calls.clear()
  with pytest.raises(ucp_jax.SourceFormatError, match="boom"):
    ucp_jax.convert(src, tmp_path / "new")
  with pytest.raises(ucp_jax.CheckpointNotFoundError):
    ucp_jax.open(tmp_path / "new")


def test_damaged_deepspeed_universal_source(tmp_path):
  src = tmp_path / "universal"
  shutil.copytree(FIXTURES / "z2_fp32_dp2" / "universal", src)
  (src / "zero" / "fc1.bias" / "exp_avg.pt").unlink()
  (src / "zero" / "ln.weight" / "fp32.pt").unlink()
  bad = src / "zero" / "fc2.weight" / "exp_avg_sq.pt"
  bad.write_bytes(bad.read_bytes()[:100])
  message = _fails(src, tmp_path / "out", f"{src / 'zero' / 'ln.weight' / 'fp32.pt'} is missing")
  assert f"{bad}: truncated or corrupt zip file" in message
  shutil.copy(FIXTURES / "z2_fp32_dp2" / "universal" / "zero" / "fc2.weight" / "exp_avg_sq.pt", bad)
  shutil.copy(src / "zero" / "ln.bias" / "fp32.pt", src / "zero" / "ln.weight" / "fp32.pt")
  shutil.copy(src / "zero" / "fc1.weight" / "exp_avg.pt", src / "zero" / "fc1.bias" / "exp_avg.pt")
  _fails(
    src,
    tmp_path / "out",
    f"{src / 'zero' / 'fc1.bias' / 'exp_avg.pt'}: tensor of shape (19, 12), param_shapes says "
    "(19,)",
  )
