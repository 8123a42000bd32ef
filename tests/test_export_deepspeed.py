"""`ucp_jax.export(..., format="deepspeed")`: DeepSpeed universal checkpoints.

Fast tests compare the exported files with DeepSpeed's own `ds_to_universal` output for every
fixture (read back with the safe reader) and pin every bad-input error. The live tests (slow,
deepspeed) load the exports with real DeepSpeed at other DP degrees and stages and compare the
restored engines with DeepSpeed loading its own output (`tests/support/deepspeed_live.py`).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

import ds_fixtures as F
import ml_dtypes
import numpy as np
import pytest

import ucp_jax
from ucp_jax import cli
from ucp_jax.sinks import _deepspeed

TAG = "global_step3"
needs_torch = pytest.mark.skipif(
  importlib.util.find_spec("torch") is None, reason="exporting writes .pt files with torch"
)


def _convert(src, dst):
  convert = getattr(ucp_jax, "convert", None)
  if convert is None:
    try:
      from ucp_jax.sources._convert import convert
    except ImportError:
      pytest.skip("ucp_jax.convert has not landed")
  return convert(src, dst)


def _source(kind: str, name: str, path) -> str:
  """A checkpoint of fixture `name`: from DeepSpeed's universal output, or `convert`ed."""
  if kind == "universal":
    return F.fixture_checkpoint(name, path)
  _convert(F.FIXTURES / name / "ckpt", path)
  return str(path)


def _bits(a) -> bytes:
  return np.ascontiguousarray(a).tobytes()


def _same(ours, theirs) -> None:
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape)
  assert _bits(ours) == _bits(theirs)


def _dirs(root) -> dict[str, set[str]]:
  return {os.path.basename(d[:-1]): set(os.listdir(d)) for d in glob.glob(f"{root}/zero/*/")}


@needs_torch
@pytest.mark.parametrize("kind", ["universal", "convert"])
@pytest.mark.parametrize("name", F.NAMES)
def test_zero_files_equal_deepspeeds_own(tmp_path, name, kind):
  meta = F.info(name)
  report = ucp_jax.export(
    _source(kind, name, tmp_path / "ckpt"), tmp_path / "ds", format="deepspeed"
  )
  ours, theirs = tmp_path / "ds" / TAG, F.FIXTURES / name / "universal"
  assert report.tag == TAG and report.zero_stages == (1, 2, 3)
  extras = {*meta["frozen"], *meta["buffers"], *meta["tied"]}
  trainable = {n for g in meta["param_groups"] for n in g["names"]}
  assert _dirs(ours) == {
    **{n: {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"} for n in trainable},
    **{n: {"fp32.pt"} for n in extras},
  }
  zero3 = meta["zero_stage"] == 3
  for param, files in _dirs(theirs).items():
    for file in files:
      mine, ds = F.load_pt(ours / "zero" / param / file), F.load_pt(theirs / "zero" / param / file)
      if zero3:  # DeepSpeed writes bare flat tensors for ZeRO-3; ours is the dict form
        assert list(mine) == ["cat_dim", "param"] and mine["cat_dim"] == 0
        _same(np.asarray(mine["param"]).ravel(), ds)
      elif not isinstance(ds, dict):  # step.pt
        _same(mine, ds)
      else:
        assert list(mine) == list(ds) and mine.get("cat_dim") == ds.get("cat_dim")
        if param in meta["tied"] and meta["dtype"] == "bfloat16":
          # DeepSpeed saves the alias from the bf16 module copy; ours is the fp32 master.
          rounded = np.asarray(mine["param"]).astype(ml_dtypes.bfloat16).astype(np.float32)
          _same(rounded, ds["param"])
        else:
          _same(mine["param"], ds["param"])
  for param in trainable:
    _same(F.load_pt(ours / "zero" / param / "step.pt"), np.float32(3.0))
  if zero3:  # the extras DeepSpeed's ZeRO-3 output lacks
    for param in meta["frozen"]:
      expected = F.frozen_value(name, param).astype(np.float32)
      _same(F.load_pt(ours / "zero" / param / "fp32.pt")["param"], expected)
    for buffer in meta["buffers"]:
      expected = F.buffer_value(name, buffer).astype(np.float32)
      _same(F.load_pt(ours / "zero" / buffer / "fp32.pt")["param"], expected)


@needs_torch
@pytest.mark.parametrize("name", F.NAMES)
def test_optimizer_and_model_states(tmp_path, name):
  meta = F.info(name)
  ucp_jax.export(F.fixture_checkpoint(name, tmp_path / "ckpt"), tmp_path / "ds", format="deepspeed")
  ours, theirs = tmp_path / "ds" / TAG, F.FIXTURES / name / "universal"
  assert (tmp_path / "ds" / "latest_universal").read_text() == TAG
  opt, ds_opt = (
    F.load_pt(ours / "zero/optimizer_state.pt"),
    F.load_pt(theirs / "zero/optimizer_state.pt"),
  )
  assert opt["ds_version"] == "0.19.8"
  strip = lambda groups: [{k: v for k, v in g.items() if k != "params"} for g in groups]  # noqa: E731
  assert strip(opt["param_groups"]) == strip(ds_opt["param_groups"])  # every group, every key
  assert [g["params"] for g in opt["param_groups"]] == [[0], [1]]
  zero3 = opt["optimizer_state_dict"]
  _same(zero3["state"][0]["step"], np.float32(3.0))
  common = {
    k: v for k, v in strip(ds_opt["param_groups"])[0].items() if k not in ("lr", "weight_decay")
  }
  assert zero3["param_groups"] == [{**common, "params": []}]

  stage12, stage3 = (
    ours / "mp_rank_00_model_states.pt",
    ours / "zero_pp_rank_0_mp_rank_00_model_states.pt",
  )
  assert os.path.samefile(stage12, stage3)
  states = F.load_pt(stage12)
  assert list(states["module"]) == ["gate", "scale"]
  _same(states["module"]["gate"], F.frozen_value(name, "gate"))
  _same(states["module"]["scale"], F.buffer_value(name, "scale"))
  samples = meta["steps"] * meta["micro_batch"] * meta["dp"]
  assert {k: states[k] for k in ("global_steps", "global_samples", "skipped_steps")} == {
    "global_steps": 3,
    "global_samples": samples,
    "skipped_steps": 0,
  }
  assert (states["dp_world_size"], states["mp_world_size"]) == (meta["dp"], 1)
  assert states["buffer_names"] == ["scale"] and states["optimizer"] is None
  assert states["shared_params"] == {"head.weight": "embed.weight"}
  assert states["frozen_param_shapes"] == {"gate": (19,)}
  assert states["param_shapes"] == [
    {n: tuple(meta["params"][n]["shape"]) for n in g["names"]} for g in meta["param_groups"]
  ]


@needs_torch
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_stage_writes_one_model_states_file(tmp_path, stage):
  src = F.fixture_checkpoint("z2_bf16_dp3", tmp_path / "ckpt")
  report = ucp_jax.export(src, tmp_path / "ds", zero_stage=stage, tag="t", format="deepspeed")
  files = sorted(os.path.basename(p) for p in glob.glob(f"{tmp_path}/ds/t/*.pt"))
  if stage == 3:
    assert report.zero_stages == (3,) and files == ["zero_pp_rank_0_mp_rank_00_model_states.pt"]
  else:
    assert report.zero_stages == (1, 2) and files == ["mp_rank_00_model_states.pt"]
    assert "optimizer_state_dict" not in F.load_pt(tmp_path / "ds/t/zero/optimizer_state.pt")


@needs_torch
def test_files_load_with_torch_weights_only(tmp_path):
  import torch

  ucp_jax.export(
    F.fixture_checkpoint("z2_bf16_dp3", tmp_path / "ckpt"), tmp_path / "ds", format="deepspeed"
  )
  files = glob.glob(f"{tmp_path}/ds/{TAG}/**/*.pt", recursive=True)
  assert len(files) == 7 * 4 + 3 + 1 + 2  # params, extras, optimizer and model states
  for path in files:
    torch.load(path, weights_only=True)


@needs_torch
def test_report_and_progress(tmp_path):
  src = F.fixture_checkpoint("z2_fp32_dp2", tmp_path / "ckpt")
  calls = []
  report = ucp_jax.export(
    src, tmp_path / "ds", progress=lambda *a: calls.append(a), format="deepspeed"
  )
  total = sum(ucp_jax.open(src)[k].nbytes for k in ucp_jax.open(src).keys())
  assert [c[0] for c in calls][-2:] == ["gate", "scale"] and {c[2] for c in calls} == {total}
  assert sum(c[1] for c in calls) == total == report.nbytes
  assert (report.params, report.frozen, report.buffers) == (7, ("gate",), ("scale",))
  assert report.tied == {"head.weight": "embed.weight"} and report.step == 3
  assert [n.split(":")[0] for n in report.notes] == [
    "buffers and frozen parameters (gate, scale)",
    "ZeRO-3 targets",
  ]


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def test_no_schema(tmp_path):
  src = ucp_jax.save(tmp_path / "plain", {"w": np.ones(3)})
  with pytest.raises(ucp_jax.MappingError) as e:
    ucp_jax.export(src, tmp_path / "ds", format="deepspeed")
  assert str(e.value) == (
    f"{src}: this checkpoint has no parameter schema, so it does not say which array is which "
    "parameter, optimizer slot (exp_avg, exp_avg_sq) or buffer, nor the optimizer step and "
    "hyperparameters that an export needs. A plain `ucp_jax.save(tree)` records none, and its "
    "keys are not a training state's (`model/` and `optimizer/opt_state/`, or `params/` and "
    "`opt_state/`). Save the train state with `ucp_jax.save_train_state(path, model, optimizer)` "
    "(in an Orbax manager: `UcpSave.train_state(model, optimizer)`), pass `schema=` to "
    "`ucp_jax.save` yourself (docs/schema.md), or convert a DeepSpeed checkpoint with "
    "`ucp convert`."
  )
  assert not (tmp_path / "ds").exists()


@needs_torch
def test_weights_alone_get_one_line(tmp_path):
  """A converted state dict of weights alone: one cause, one line (not one per parameter)."""
  import torch

  torch.save({f"layer{i}.weight": torch.ones(2, 2) for i in range(20)}, tmp_path / "model.pt")
  ucp_jax.convert(tmp_path / "model.pt", tmp_path / "ckpt")
  with pytest.raises(ucp_jax.MappingError) as e:
    ucp_jax.export(tmp_path / "ckpt", tmp_path / "ds", format="deepspeed")
  assert str(e.value) == (
    f"{tmp_path / 'ckpt'}: holds weights alone (20 parameters, no optimizer state: no step, "
    "hyperparameters or Adam moments), and a DeepSpeed checkpoint is a training state; export "
    "the weights with --format hf or dcp, or train in JAX and save with ucp_jax.save_train_state"
  )
  assert not (tmp_path / "ds").exists()


def test_every_schema_problem_listed(tmp_path):
  tree, schema = F.fixture_state("z2_fp32_dp2")
  del tree["exp_avg"]["fc1.weight"], tree["buffers"]["scale"]
  schema["params"]["ln.bias"]["slots"].pop("exp_avg_sq")
  schema["params"]["fc2.bias"]["slots"] = {}
  schema["params"]["fc1.bias"]["group"] = 5
  schema["params"]["fc2.weight"]["slots"]["exp_avg"] = "exp_avg/fc1.bias"
  schema["params"]["lm.weight"] = {"tied_to": "nothing"}
  src = ucp_jax.save(tmp_path / "ckpt", tree, schema=schema)
  with pytest.raises(ucp_jax.MappingError) as e:
    ucp_jax.export(src, tmp_path / "ds", format="deepspeed")
  assert str(e.value) == (
    f"{src}: cannot export: 7 problem(s) in the parameter schema:\n"
    "  `fc1.weight` slot `exp_avg` -> `exp_avg/fc1.weight`: no such array in the checkpoint\n"
    "  `fc2.weight` slot `exp_avg`: shape (19,), the value's is (12, 19)\n"
    "  `fc1.bias`: group 5, but the optimizer has 2 group(s)\n"
    "  `lm.weight`: tied to `nothing`, which is not an untied parameter\n"
    "  `ln.bias`: trainable, but no `exp_avg_sq` slot\n"
    "  `fc2.bias`: trainable, but no `exp_avg`, `exp_avg_sq` slot\n"
    "  buffer `scale` -> `buffers/scale`: no such array in the checkpoint"
  )


def test_bad_schema_header(tmp_path):
  tree, schema = F.fixture_state("z1_fp32_dp2")
  schema.update(version=2, optimizer={"type": "adamw", "step": -1, "groups": []})
  src = ucp_jax.save(tmp_path / "ckpt", tree, schema=schema)
  with pytest.raises(ucp_jax.MappingError) as e:
    ucp_jax.export(src, tmp_path / "ds", format="deepspeed")
  problems = str(e.value).splitlines()[1:]
  assert problems[:3] == [
    "  schema version 2; this ucp_jax exports version 1",
    "  optimizer `groups`: expected a non-empty list of hyperparameter dicts",
    "  optimizer step -1: expected an integer >= 0",
  ]
  schema.update(version=1, naming="flax")  # every name wrong for one reason: said once
  src = ucp_jax.save(tmp_path / "flax", tree, schema=schema)
  for format in ("deepspeed", "hf", "dcp"):
    with pytest.raises(ucp_jax.MappingError) as e:
      ucp_jax.export(src, tmp_path / format, format=format)
    assert str(e.value) == (
      f"{src}: cannot export: the parameters have flax names; the export needs torch names and "
      "layouts ([out, in] Linear weights): pass rules=... (--rules; e.g. "
      "ucp_jax.rules.gpt2(num_heads=...), or hf with the model's config.json) to map them back"
    )


@pytest.mark.parametrize("stage", [0, 4, True, "3"])
def test_bad_zero_stage(tmp_path, stage):
  with pytest.raises(ValueError, match=r"zero_stage .*: expected 1, 2, 3 or None \(all stages\)"):
    ucp_jax.export(tmp_path / "missing", tmp_path / "ds", zero_stage=stage, format="deepspeed")


def test_bad_format_and_tag(tmp_path):
  with pytest.raises(ValueError, match="format 'tflite': ucp_jax exports to "):
    ucp_jax.export(tmp_path / "missing", tmp_path / "ds", format="tflite")
  with pytest.raises(ValueError, match="tag 'a/b': not usable as a directory name"):
    ucp_jax.export(tmp_path / "missing", tmp_path / "ds", tag="a/b", format="deepspeed")


@needs_torch
def test_destination_exists(tmp_path):
  src = F.fixture_checkpoint("z1_fp32_dp2", tmp_path / "ckpt")
  dst = tmp_path / "ds"
  ucp_jax.export(src, dst, tag="old", format="deepspeed")
  with pytest.raises(
    ucp_jax.CheckpointExistsError, match="an export exists already; pass overwrite"
  ):
    ucp_jax.export(src, dst, format="deepspeed")
  ucp_jax.export(src, dst, overwrite=True, format="deepspeed")
  assert sorted(os.listdir(dst)) == [TAG, "latest_universal", "ucp_export.json"]
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("mine")
  with pytest.raises(ucp_jax.CheckpointExistsError) as e:
    ucp_jax.export(src, tmp_path / "other", overwrite=True, format="deepspeed")
  assert str(e.value) == (
    f"{tmp_path / 'other'}: not an earlier ucp_jax export, so the export will not replace it "
    "(nothing was deleted); in the way:\n"
    "  no ucp_export.json (every export writes one)\n"
    "  notes.txt"
  )
  (tmp_path / "file").write_text("")
  with pytest.raises(ucp_jax.CheckpointExistsError, match="a file is in the way"):
    ucp_jax.export(src, tmp_path / "file", overwrite=True, format="deepspeed")


def _snapshot(root) -> dict[str, bytes]:
  return {
    str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>"
    for p in sorted(root.rglob("*"))
  }


@needs_torch
def test_overwrite_refuses_a_deepspeed_training_folder(tmp_path, capsys):
  """`latest_universal` beside DeepSpeed's own `latest` and tags: refused, nothing deleted."""
  import shutil

  src = F.fixture_checkpoint("z1_fp32_dp2", tmp_path / "ckpt")
  run = tmp_path / "run"
  shutil.copytree(F.FIXTURES / "z1_fp32_dp2" / "ckpt", run)  # `latest`, global_step3/
  shutil.copytree(F.FIXTURES / "z1_fp32_dp2" / "universal", run / "universal")
  (run / "latest_universal").write_text("universal")  # as ds_to_universal writes it
  before = _snapshot(run)
  with pytest.raises(ucp_jax.CheckpointExistsError) as e:
    ucp_jax.export(src, run, overwrite=True, format="deepspeed")
  assert str(e.value) == (
    f"{run}: not an earlier ucp_jax export, so the export will not replace it (nothing was "
    "deleted); in the way:\n"
    "  no ucp_export.json (every export writes one)\n"
    "  global_step3/\n"
    "  latest\n"
    "  latest_universal\n"
    "  universal/"
  )
  assert cli.main(["export", "--format", "deepspeed", src, str(run), "--overwrite"]) == 2
  assert "not an earlier ucp_jax export" in capsys.readouterr().err
  assert _snapshot(run) == before


@needs_torch
def test_overwrite_refuses_an_export_something_else_wrote_into(tmp_path):
  src = F.fixture_checkpoint("z1_fp32_dp2", tmp_path / "ckpt")
  dst = tmp_path / "ds"
  ucp_jax.export(src, dst, format="deepspeed")
  (dst / "latest").write_text("global_step4")  # a DeepSpeed run saved into the export
  (dst / "global_step4").mkdir()
  (dst / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
  before = _snapshot(dst)
  with pytest.raises(ucp_jax.CheckpointExistsError) as e:
    ucp_jax.export(src, dst, overwrite=True, format="deepspeed")
  assert str(e.value).endswith(
    "in the way:\n"
    "  global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt\n"
    "  global_step4/\n"
    "  latest"
  )
  assert _snapshot(dst) == before
  (dst / "latest").unlink()
  (dst / "global_step4").rmdir()
  (dst / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
  ucp_jax.export(
    src, dst, format="deepspeed", overwrite=True, tag="again"
  )  # an export again: replaced
  assert sorted(os.listdir(dst)) == ["again", "latest_universal", "ucp_export.json"]


@needs_torch
def test_failure_leaves_the_old_export_and_no_staging(tmp_path, monkeypatch):
  import torch

  src = F.fixture_checkpoint("z1_fp32_dp2", tmp_path / "ckpt")
  ucp_jax.export(src, tmp_path / "ds", tag="old", format="deepspeed")
  calls = []

  def failing_save(obj, path, *args, **kwargs):
    calls.append(path)
    if len(calls) == 9:
      raise OSError("disk full")
    return real_save(obj, path, *args, **kwargs)

  real_save = torch.save
  monkeypatch.setattr(torch, "save", failing_save)
  for dst, overwrite in ((tmp_path / "ds", True), (tmp_path / "new", False)):
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
      ucp_jax.export(src, dst, overwrite=overwrite, format="deepspeed")
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "ds"]  # no `new`, no staging left behind
  assert (tmp_path / "ds" / "latest_universal").read_text() == "old"


@needs_torch
def test_concurrent_export_is_turned_away_and_dead_staging_removed(tmp_path):
  from ucp_jax.store import _commit, _location

  src = F.fixture_checkpoint("z1_fp32_dp2", tmp_path / "ckpt")
  (tmp_path / ".ds.ucp-export-00000000deadbeef" / "x").mkdir(parents=True)  # a killed export's
  lock = _commit.Lock(_location.resolve(tmp_path / "ds"), token=7)
  lock.acquire()
  try:
    with pytest.raises(ucp_jax.ConcurrentWriteError, match="another save to this path"):
      ucp_jax.export(src, tmp_path / "ds", format="deepspeed")
  finally:
    lock.release()
  ucp_jax.export(src, tmp_path / "ds", format="deepspeed")
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "ds"]


def test_torch_missing(tmp_path, monkeypatch):
  src = F.fixture_checkpoint("z1_fp32_dp2", tmp_path / "ckpt")
  monkeypatch.setitem(sys.modules, "torch", None)
  with pytest.raises(_deepspeed.MissingDependencyError) as e:
    ucp_jax.export(src, tmp_path / "ds", format="deepspeed")
  assert isinstance(e.value, ImportError) and isinstance(e.value, ucp_jax.UcpError)
  assert "pip install 'ucp_jax[torch]'" in str(e.value)
  assert not (tmp_path / "ds").exists()


@needs_torch
def test_sgd_has_no_zero3_layout(tmp_path):
  tree, schema = F.fixture_state("z1_fp32_dp2")
  tree["momentum_buffer"] = tree.pop("exp_avg")
  del tree["exp_avg_sq"]
  for entry in schema["params"].values():
    if entry.get("slots"):
      entry["slots"] = {"momentum_buffer": entry["value"].replace("params/", "momentum_buffer/")}
  schema["optimizer"]["type"] = "sgd"
  src = ucp_jax.save(tmp_path / "ckpt", tree, schema=schema)
  report = ucp_jax.export(src, tmp_path / "ds", format="deepspeed")
  assert report.zero_stages == (1, 2)
  assert report.notes[-1] == "no ZeRO-3 files: its loader needs exp_avg and exp_avg_sq (sgd)"
  assert _dirs(tmp_path / "ds" / TAG)["fc1.weight"] == {"fp32.pt", "momentum_buffer.pt", "step.pt"}
  with pytest.raises(ucp_jax.MappingError, match="ZeRO-3 universal loader reads exactly fp32"):
    ucp_jax.export(src, tmp_path / "ds3", zero_stage=3, format="deepspeed")


@needs_torch
@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_adam_and_adamw_stay_what_they_are(tmp_path, kind):
  """The groups say torch's `decoupled_weight_decay` (DeepSpeed sets it on the loading group):
  an AdamW run comes back as AdamW, an Adam run (L2 decay) as Adam."""
  import torch

  tree, schema = F.fixture_state("z1_fp32_dp2")
  schema["optimizer"]["type"] = kind
  for group in schema["optimizer"]["groups"]:
    group.pop("decoupled_weight_decay", None)
  src = ucp_jax.save(tmp_path / "ckpt", tree, schema=schema)
  ucp_jax.export(src, tmp_path / "ds", format="deepspeed")
  state = torch.load(tmp_path / "ds" / TAG / "zero" / "optimizer_state.pt", weights_only=True)
  assert {g["decoupled_weight_decay"] for g in state["param_groups"]} == {kind == "adamw"}
  assert ucp_jax.open(tmp_path / "ds").manifest.schema["optimizer"]["type"] == kind


@needs_torch
def test_cli(tmp_path, capsys):
  src = F.fixture_checkpoint("z3_bf16_dp3", tmp_path / "ckpt")
  assert (
    cli.main(["export", "--format", "deepspeed", src, str(tmp_path / "ds"), "--zero-stage", "3"])
    == 0
  )
  out = capsys.readouterr().out
  assert out.startswith(
    f"{tmp_path / 'ds'}: DeepSpeed universal checkpoint global_step3 (step 3) for ZeRO-3 "
    "targets: 7 trainable params, 1 frozen, 1 buffers, 1 tied; 11.4 KiB in "
  )
  assert out.count("  note: ") == 2
  assert cli.main(["export", "--format", "deepspeed", src, str(tmp_path / "ds")]) == 2
  assert "an export exists already" in capsys.readouterr().err
  plain = ucp_jax.save(tmp_path / "plain", {"w": np.ones(2)})
  assert cli.main(["export", "--format", "deepspeed", plain, str(tmp_path / "ds2")]) == 2
  assert "has no parameter schema" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Live: real DeepSpeed loads the exports (slow)
# --------------------------------------------------------------------------------------------

Z3 = {"zero_optimization": {"sub_group_size": 100}}
BF16_OPT = {"data_types": {"grad_accum_dtype": "fp32"}}


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, str]:
  """Exports of three fixtures; the ZeRO-3 one through `convert` when it is there."""
  root = tmp_path_factory.mktemp("exports")
  converted = hasattr(ucp_jax, "convert")
  out = {}
  for name in ("z2_fp32_dp2", "z3_fp32_dp2", "bf16opt_dp2"):
    kind = "convert" if converted and name == "z3_fp32_dp2" else "universal"
    out[name] = ucp_jax.export(
      _source(kind, name, root / f"{name}.ucp"), root / name, format="deepspeed"
    ).path
  return out


def _torch_same(a, b) -> bool:
  import torch

  if isinstance(a, torch.Tensor):
    flat = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8)  # noqa: E731
    return (
      isinstance(b, torch.Tensor)
      and (a.dtype, a.shape) == (b.dtype, b.shape)
      and torch.equal(flat(a), flat(b))
    )
  return a == b


def _assert_same_engine(own: list[dict], ours: list[dict]) -> None:
  """Ours restores what DeepSpeed's own path restores, bit for bit, on every rank."""
  for a, b in zip(own, ours, strict=True):
    assert a["optimizer_class"] == b["optimizer_class"]
    assert a["counters"] == b["counters"] and a["param_groups"] == b["param_groups"]
    assert len(a["raw"]["fp32"]) == len(b["raw"]["fp32"])
    for x, y in zip(a["raw"]["fp32"], b["raw"]["fp32"]):
      assert _torch_same(x, y)
    for x, y in zip(a["raw"]["state"], b["raw"]["state"], strict=True):
      assert x.keys() == y.keys() and all(_torch_same(x[k], y[k]) for k in x)
    for name, slots in a["logical"].items():
      assert all(_torch_same(v, b["logical"][name][k]) for k, v in slots.items()), name
    assert a["module"].keys() == b["module"].keys()
    assert all(_torch_same(v, b["module"][k]) for k, v in a["module"].items())
    assert a["train"] == b["train"]


def _assert_logical(dumps: list[dict], name: str) -> None:
  """The engine holds fixture `name`'s values (another stage: no DeepSpeed path to compare)."""
  tree, _ = F.fixture_state(name)
  for dump in dumps:
    for param, slots in dump["logical"].items():
      _same(slots["fp32"].numpy(), tree["params"][param])
      _same(slots["exp_avg"].numpy(), tree["exp_avg"][param])
      _same(slots["exp_avg_sq"].numpy(), tree["exp_avg_sq"][param])
    assert {float(s["step"]) for s in dump["raw"]["state"]} == {3.0}
    assert [(g["lr"], g["weight_decay"]) for g in dump["param_groups"]] == [
      (0.01, 0.1),
      (0.005, 0.0),
    ]
    _same(dump["module"]["gate"].numpy(), tree["params"]["gate"])
    _same(dump["module"]["scale"].numpy(), tree["buffers"]["scale"])


def _assert_extras_restored_by_finish_only(dumps: list[dict]) -> None:
  for dump in dumps:  # perturbed to zeros: DeepSpeed's load leaves them, finish_load restores
    assert all(not v.any() for v in dump["before_finish"]["extras"].values())
    assert dump["finished"] == ["gate", "scale"]
    assert dump["module"]["gate"].any() and dump["module"]["scale"].any()


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_live_dp1(exports, tmp_path):
  """DP=2 sources at DP=1: the BF16 optimizer as DeepSpeed's own path; ZeRO-3 -> ZeRO-2."""
  import deepspeed_live as L

  fixture = lambda name: str(F.FIXTURES / name)  # noqa: E731
  jobs = [
    L.Job("own_bf16", 1, fixture("bf16opt_dp2"), bf16=True, config=BF16_OPT),
    L.Job(
      "ours_bf16", 1, exports["bf16opt_dp2"], bf16=True, config=BF16_OPT, perturb=True, finish=True
    ),
    L.Job("z2_from_z3", 2, exports["z3_fp32_dp2"], perturb=True, finish=True),
  ]
  results = L.launch(1, jobs, tmp_path)
  _assert_same_engine(results["own_bf16"], results["ours_bf16"])
  assert results["ours_bf16"][0]["optimizer_class"] == "BF16_Optimizer"
  _assert_logical(results["z2_from_z3"], "z3_fp32_dp2")
  for job in ("ours_bf16", "z2_from_z3"):
    _assert_extras_restored_by_finish_only(results[job])


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_live_dp3(exports, tmp_path):
  """DP=2 sources at DP=3: ZeRO-2 and ZeRO-3 as DeepSpeed's own path; ZeRO-2 -> ZeRO-3."""
  import deepspeed_live as L

  fixture = lambda name: str(F.FIXTURES / name)  # noqa: E731
  jobs = [
    L.Job("own_z2", 2, fixture("z2_fp32_dp2")),
    L.Job("ours_z2", 2, exports["z2_fp32_dp2"], perturb=True, finish=True),
    L.Job("own_z3", 3, fixture("z3_fp32_dp2"), config=Z3, finish=True),
    L.Job("ours_z3", 3, exports["z3_fp32_dp2"], config=Z3, perturb=True, finish=True),
    L.Job("z3_from_z2", 3, exports["z2_fp32_dp2"], perturb=True, finish=True),
  ]
  results = L.launch(3, jobs, tmp_path)
  _assert_same_engine(results["own_z2"], results["ours_z2"])
  _assert_same_engine(results["own_z3"], results["ours_z3"])
  _assert_logical(results["ours_z2"], "z2_fp32_dp2")
  _assert_logical(results["ours_z3"], "z3_fp32_dp2")
  _assert_logical(results["z3_from_z2"], "z2_fp32_dp2")
  for job in ("ours_z2", "ours_z3", "z3_from_z2"):
    _assert_extras_restored_by_finish_only(results[job])
  # The ZeRO-3 gaps, measured before finish_load: DeepSpeed's own file gives group 1 group 0's
  # lr/wd; ours leaves them as configured; both share one step tensor between sub-groups.
  lr_wd = lambda dump: [(g["lr"], g["weight_decay"]) for g in dump["before_finish"]["param_groups"]]  # noqa: E731
  assert lr_wd(results["own_z3"][0]) == [(0.01, 0.1), (0.01, 0.1)]
  assert lr_wd(results["ours_z3"][0]) == [(0.01, 0.1), (0.005, 0.0)]
  assert results["own_z3"][0]["before_finish"]["shared_step"]
  assert results["ours_z3"][0]["before_finish"]["shared_step"]
  # One step after a ZeRO-2 -> ZeRO-3 load trains like the ZeRO-2 engine on the same state.
  for key in ("loss", "loss_after"):
    z3, z2 = results["z3_from_z2"][0]["train"][key], results["ours_z2"][0]["train"][key]
    assert z3[0] == pytest.approx(z2[0], rel=1e-6)
