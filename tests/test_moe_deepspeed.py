"""DeepSpeed mixture-of-experts checkpoints: native MoE and AutoEP, ZeRO-1/2, with Adam state.

The fixtures (tests/fixtures/moe, scripts/make_moe_fixtures.py) are real DeepSpeed 0.19.8 runs;
each holds `oracle.npz`, the engine's own gathered fp32 masters and Adam moments, which every
converted value and moment must equal bit for bit. No torch is needed but for the export.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import ucp_jax
from ucp_jax.sources.deepspeed import _experts, _moe

FIXTURES = Path(__file__).parent / "fixtures" / "moe"
ZERO = ["native_z1_ep2_dp4", "native_z2_ep2_dp2", "native_z2_ep1_dp2", "native_z0_ep2_dp2"]
ZERO += ["autoep_mixtral_z1_ep2", "autoep_mixtral_z2_ep1", "autoep_qwen3_z2_ep2"]


def _oracle(name: str) -> dict[str, dict[str, np.ndarray]]:
  """{param name: {slot: array}} from the fixture's engine state."""
  info = json.loads((FIXTURES / name / "info.json").read_text())
  flat = np.load(FIXTURES / name / "oracle.npz")
  out, offset = {}, 0
  for param, shape in info["oracle"].items():
    n = int(np.prod(shape))
    out[param] = {s: flat[s][offset : offset + n].reshape(shape) for s in flat.files}
    offset += n
  return out


def _stacked_name(name: str) -> tuple[str, int | None]:
  m = _experts.NATIVE_RE.match(name)
  return (m.group(1)[:-1] + m.group(3), int(m.group(2))) if m else (name, None)


@pytest.mark.parametrize("name", ZERO)
def test_every_value_and_moment_equals_the_engines_own(name):
  ckpt = ucp_jax.open(FIXTURES / name / "ckpt")
  params = ckpt.manifest.schema["params"]
  checked = set()
  for param, slots in _oracle(name).items():
    stacked, expert = _stacked_name(param)
    entry = params[stacked]
    keys = {"value": entry["value"], **entry["slots"]}
    assert set(keys) == {"value", "exp_avg", "exp_avg_sq"}, param
    for slot, want in slots.items():
      got = ckpt.read(keys[slot])
      got = got if expert is None else got[expert]
      assert got.dtype == np.float32 and got.shape == want.shape, (param, slot)
      assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (param, slot)
    checked.add(stacked)
  trainable = {k for k, e in params.items() if e["slots"]}
  assert trainable == checked  # every optimized parameter, nothing else with moments


@pytest.mark.parametrize("name", ZERO)
def test_each_expert_appears_once_stacked_with_its_group(name):
  ckpt = ucp_jax.open(FIXTURES / name / "ckpt")
  schema = ckpt.manifest.schema
  experts = {k: e for k, e in schema["params"].items() if (e.get("pattern") or {}).get("kind")}
  assert experts and not any(re.search(r"experts\.\d", k) for k in schema["params"])
  groups = schema["optimizer"]["groups"]
  for key, entry in experts.items():
    assert entry["pattern"]["num_experts"] == 4 and ckpt[entry["value"]].shape[0] == 4
    assert groups[entry["group"]]["moe"] is True, key
    assert set(entry["slots"]) == {"exp_avg", "exp_avg_sq"}
  assert ckpt.manifest.source["format"] == "deepspeed"
  assert schema["extra"]["source_layout"]["ep"] == int(re.search(r"ep(\d)", name).group(1))


def test_autoep_router_alias_is_tied_not_frozen():
  params = ucp_jax.open(FIXTURES / "autoep_mixtral_z1_ep2" / "ckpt").manifest.schema["params"]
  alias = params["model.layers.0.mlp.gate.gate.weight"]
  assert alias["tied_to"] == "model.layers.0.mlp.router.gate.weight" and not alias["frozen"]


def test_deepspeeds_own_universal_folder_of_autoep_equals_the_direct_conversion():
  direct = ucp_jax.open(FIXTURES / "autoep_mixtral_z1_ep2" / "ckpt")
  universal = ucp_jax.open(FIXTURES / "autoep_mixtral_z1_ep2")  # latest_universal -> universal/
  assert set(direct.keys()) == set(universal.keys())
  for key in direct.keys():
    assert np.array_equal(direct.read(key), universal.read(key)), key
  entry = universal.manifest.schema["params"]["model.layers.0.mlp.experts.w1"]
  assert entry["pattern"]["num_experts"] == 4 and entry["group"] is not None


def test_convert_writes_the_stacked_experts(tmp_path):
  ucp_jax.convert(FIXTURES / "native_z1_ep2_dp4" / "ckpt", tmp_path / "u")
  out = ucp_jax.open(tmp_path / "u")
  want = _oracle("native_z1_ep2_dp4")
  name = "blocks.1.moe.deepspeed_moe.experts.deepspeed_experts.fc1.weight"
  got = out.read(f"exp_avg/{name}")
  for e in range(4):
    np.testing.assert_array_equal(
      got[e], want[name.replace("experts.fc1", f"experts.{e}.fc1")]["exp_avg"]
    )
  assert out[f"params/{name}"].chunks[0] == 1  # one expert per chunk: EP reads its own


def test_a_wrong_expert_layout_is_an_error_not_swapped_experts(tmp_path, monkeypatch):
  """If the expert-parallel ranks were read in the other order, each expert's own file
  disagrees with the master that would be given to it: refused, naming the expert."""
  original = _moe._ep_ranks

  def swapped(model, dp):
    topology = original(model, dp)
    return lambda ep: topology(ep)[::-1]

  monkeypatch.setattr(_moe, "_ep_ranks", swapped)
  with pytest.raises(ucp_jax.SourceFormatError, match=r"expert 0: its fp32 master differs from"):
    ucp_jax.open(FIXTURES / "native_z1_ep2_dp4" / "ckpt")


def test_a_missing_expert_file_and_unsupported_layouts_are_refused(tmp_path):
  src = FIXTURES / "native_z2_ep2_dp2" / "ckpt" / "global_step3"
  folder = tmp_path / "tag"
  shutil.copytree(src, folder)
  os.remove(folder / "layer_1_expert_3_mp_rank_00_model_states.pt")
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(folder)
  lines = str(e.value).splitlines()[1:]  # every weight of the missing expert, one per line
  assert len(lines) == 4 and all("expert 3: no expert file holds 'blocks.1." in x for x in lines)
  (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
  with pytest.raises(ucp_jax.SourceFormatError, match="experts with ZeRO-3") as e:
    ucp_jax.open(folder)
  assert "\n" not in str(e.value)


def test_export_splits_native_experts_and_keeps_autoep_stacked(tmp_path):
  pytest.importorskip("torch")
  for name in ("native_z2_ep2_dp2", "autoep_mixtral_z1_ep2"):
    ucp_jax.convert(FIXTURES / name / "ckpt", tmp_path / name / "u")
    report = ucp_jax.export(tmp_path / name / "u", tmp_path / name / "ds", format="deepspeed")
    zero = tmp_path / name / "ds" / report.tag / "zero"
    back, out = ucp_jax.open(tmp_path / name / "ds"), ucp_jax.open(tmp_path / name / "u")
    assert set(back.keys()) == set(out.keys())
    for key in out.keys():
      assert np.array_equal(back.read(key), out.read(key)), key
    if name.startswith("native"):
      assert (zero / "blocks.0.moe.deepspeed_moe.experts.deepspeed_experts.3.fc1.weight").is_dir()
      assert not (zero / "blocks.0.moe.deepspeed_moe.experts.deepspeed_experts.fc1.weight").exists()
    else:
      import torch

      w1 = torch.load(zero / "model.layers.0.mlp.experts.w1" / "fp32.pt", weights_only=True)
      assert w1["is_expert_param"] and w1["ep_num_experts"] == 4 and w1["param"].shape[0] == 4


def test_finish_load_gives_deepspeeds_expert_groups_their_group_hyperparameters():
  """DeepSpeed splits a group's experts into a group of their own: an engine group that is
  part of one checkpoint group takes its hyperparameters (and keeps its own `moe`/`name`)."""
  import types

  from ucp_jax import deepspeed as ucp_deepspeed

  a, b, e = object(), object(), object()
  live = [{"lr": 0.1}, {"lr": 0.1, "moe": True, "name": "ep_size_2"}]
  engine = types.SimpleNamespace(
    param_names={a: "w", b: "b", e: "experts.w1"},
    module=types.SimpleNamespace(named_modules=lambda: []),
    zero_optimization_partition_weights=lambda: False,
    optimizer=types.SimpleNamespace(
      bit16_groups=[[a, b], [e]], optimizer=types.SimpleNamespace(param_groups=live)
    ),
  )
  saved = [{"lr": 0.01, "params": [0]}]  # one JAX group held everything
  shapes = [{"w": (2,), "b": (2,), "experts.w1": (4, 2)}]
  assert ucp_deepspeed._matching_groups(engine, saved, shapes) == [saved[0], saved[0]]


def test_experts_sharing_a_group_get_the_group_deepspeed_will_make_for_them():
  """DeepSpeed's loader reads `param_groups` by position, only as many as the file lists: a
  JAX export whose experts share one Optax group must list the expert group DeepSpeed makes."""
  import types

  from ucp_jax.sinks import _moe_sink

  p = lambda name, group, shape: types.SimpleNamespace(name=name, group=group, shape=shape)  # noqa: E731
  plan = types.SimpleNamespace(
    groups=({"lr": 0.1}, {"lr": 0.2}),
    trainable=(
      p("model.layers.0.mlp.experts.w1", 0, (4, 3, 2)),  # AutoEP, by name
      p("model.norm.weight", 0, (2,)),
      p("blocks.0.moe.deepspeed_moe.experts.deepspeed_experts.fc1.bias", 1, (4, 3)),  # native
      p("blocks.0.ln.bias", 1, (2,)),
    ),
  )
  groups, group_of = _moe_sink.deepspeed_groups(plan, {})
  assert groups == [{"lr": 0.1}, {"lr": 0.2}, {"lr": 0.1, "moe": True}, {"lr": 0.2, "moe": True}]
  assert [group_of[x.name] for x in plan.trainable] == [2, 0, 3, 1]
