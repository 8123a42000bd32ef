"""`export(..., format="hf")`: folders that `safetensors` reads and `from_pretrained` loads."""

import json
import os

import numpy as np
import pytest

import ucp_jax
from ucp_jax import cli

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "deepspeed", "z2_fp32_dp2", "ckpt")


@pytest.fixture
def converted(tmp_path):
  return ucp_jax.convert(FIXTURE, tmp_path / "ckpt").dst


def _tensors(folder) -> dict:
  from safetensors.numpy import load_file

  out = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      out.update(load_file(os.path.join(folder, name)))
  return out


def _expected(ckpt) -> dict:
  schema = ckpt.manifest.schema
  out = {n: ckpt.read(e["value"]) for n, e in schema["params"].items() if not e.get("tied_to")}
  out.update({n: ckpt.read(k) for n, k in schema["buffers"].items()})
  return out


def test_every_weight_by_its_torch_name_sharded_with_an_index(converted, tmp_path):
  pytest.importorskip("safetensors")
  report = ucp_jax.export(converted, tmp_path / "hf", format="hf", max_shard_size="2KB")
  files = sorted(os.listdir(tmp_path / "hf"))
  shards = [f for f in files if f.endswith(".safetensors")]
  assert len(shards) > 1 and "model.safetensors.index.json" in files and "ucp_export.json" in files
  index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
  got = _tensors(tmp_path / "hf")
  want = _expected(ucp_jax.open(converted))
  assert set(got) == set(want) == set(index["weight_map"])
  for name, array in want.items():
    assert got[name].dtype == array.dtype and np.array_equal(got[name], array), name
  assert index["metadata"]["total_size"] == sum(a.nbytes for a in want.values())
  assert "head.weight" not in got  # tied to embed.weight: written once, as save_pretrained does
  assert report.tied == {"head.weight": "embed.weight"} and report.format == "hf"
  assert any("optimizer state" in n for n in report.notes)
  assert any("no config.json" in n for n in report.notes)


def test_one_file_below_the_limit_and_a_cast(converted, tmp_path):
  pytest.importorskip("safetensors")
  ucp_jax.export(converted, tmp_path / "hf", format="hf", dtype="bfloat16", config={"a": 1})
  assert sorted(os.listdir(tmp_path / "hf")) == [
    "config.json",
    "model.safetensors",
    "ucp_export.json",
  ]
  got = _tensors(tmp_path / "hf")
  for name, array in _expected(ucp_jax.open(converted)).items():
    assert str(got[name].dtype) == "bfloat16"
    np.testing.assert_array_equal(got[name], array.astype(got[name].dtype))
  # the config's dtype says what the weights are, so from_pretrained's default loads them so
  assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"a": 1, "dtype": "bfloat16"}


def test_config_dtype_is_the_dtype_of_the_weights_written(tmp_path):
  pytest.importorskip("safetensors")
  import ml_dtypes

  weights = {"w": np.ones((4, 4), ml_dtypes.bfloat16), "b": np.ones(4, ml_dtypes.bfloat16)}
  config = {"model_type": "x", "dtype": "bfloat16", "torch_dtype": "bfloat16"}
  ucp_jax.save(tmp_path / "bf16", {"params": weights}, schema=_torch_schema(weights))
  ucp_jax.save(
    tmp_path / "f32",
    {"params": {k: v.astype(np.float32) for k, v in weights.items()}},
    schema=_torch_schema(weights),
  )
  report = ucp_jax.export(tmp_path / "f32", tmp_path / "a", format="hf", config=config)
  written = json.loads((tmp_path / "a" / "config.json").read_text())
  assert (written["dtype"], written["torch_dtype"]) == ("float32", "float32")  # fp32 masters
  assert any(
    "config.json dtype float32 (the weights'; it said 'bfloat16')" in n for n in report.notes
  )
  ucp_jax.export(
    tmp_path / "f32",
    tmp_path / "b",
    format="hf",
    dtype="bfloat16",
    config={"model_type": "x", "dtype": "float32"},
  )
  assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"
  report = ucp_jax.export(tmp_path / "bf16", tmp_path / "c", format="hf", config=config)
  assert json.loads((tmp_path / "c" / "config.json").read_text())["dtype"] == "bfloat16"
  assert not any("dtype" in n for n in report.notes)


def _torch_schema(weights) -> dict:
  params = {name: {"value": f"params/{name}"} for name in weights}
  return {"version": 1, "naming": "torch", "params": params, "buffers": {}}


def test_destinations_that_are_not_earlier_hf_exports_are_refused(converted, tmp_path):
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep me")
  with pytest.raises(ucp_jax.CheckpointExistsError, match=r"notes\.txt"):
    ucp_jax.export(converted, tmp_path / "mine", format="hf")
  assert os.listdir(tmp_path / "mine") == ["notes.txt"]
  ucp_jax.export(converted, tmp_path / "hf", format="hf")
  with pytest.raises(ucp_jax.CheckpointExistsError, match="overwrite=True"):
    ucp_jax.export(converted, tmp_path / "hf", format="hf")
  ucp_jax.export(converted, tmp_path / "hf", format="hf", overwrite=True, max_shard_size=2000)
  (tmp_path / "hf" / "extra.bin").write_bytes(b"x")  # something an export does not write
  with pytest.raises(ucp_jax.CheckpointExistsError, match=r"extra\.bin"):
    ucp_jax.export(converted, tmp_path / "hf", format="hf", overwrite=True)
  for bad, match in (
    ({"max_shard_size": "lots"}, "max_shard_size='lots'"),
    ({"dtype": "int8"}, "dtype='int8'"),
    ({"zero_stage": 3}, "format 'hf' takes no zero_stage"),
  ):
    with pytest.raises(ucp_jax.InvalidArgumentError, match=match):
      ucp_jax.export(converted, tmp_path / "other", format="hf", **bad)
  assert not (tmp_path / "other").exists()


def test_the_command_line(converted, tmp_path, capsys):
  pytest.importorskip("safetensors")
  argv = ["export", converted, str(tmp_path / "hf"), "--format", "hf", "--max-shard-size", "3KB"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "Hugging Face model folder, 2 safetensors file(s): 8 params, 1 buffers, 1 tied" in out
  assert cli.main([*argv, "--zero-stage", "3"]) == 2
  assert "takes no zero_stage" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_from_pretrained_loads_the_export(tmp_path, family):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  if family == "llama":
    config = transformers.LlamaConfig(
      vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
  else:
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)  # lm_head tied to transformer.wte
  model.eval()
  state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  tied = {"lm_head.weight": "transformer.wte.weight"} if family == "gpt2" else {}
  schema = {
    "version": 1,
    "naming": "torch",
    "params": {
      name: {"tied_to": tied[name]} if name in tied else {"value": f"params/{name}"}
      for name in state
    },
    "buffers": {},
  }
  arrays = {name: array for name, array in state.items() if name not in tied}
  ucp_jax.save(tmp_path / "ckpt", {"params": arrays}, schema=schema)
  ucp_jax.export(tmp_path / "ckpt", tmp_path / "hf", format="hf", config=config.to_dict())
  loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  ids = torch.arange(12).reshape(2, 6) % 64
  with torch.no_grad():
    np.testing.assert_array_equal(loaded(ids).logits.numpy(), model(ids).logits.numpy())


def test_any_option_of_a_format_from_the_command_line(converted, tmp_path, capsys):
  pytest.importorskip("safetensors")
  argv = ["export", converted, str(tmp_path / "hf"), "--format", "hf"]
  assert cli.main([*argv, "--option", "max_shard_size=1000", "--option", 'dtype="float16"']) == 0
  capsys.readouterr()
  assert sum(n.endswith(".safetensors") for n in os.listdir(tmp_path / "hf")) > 1
  assert str(_tensors(tmp_path / "hf")["embed.weight"].dtype) == "float16"
  assert cli.main([*argv, "--option", "shards=2"]) == 2
  assert "format 'hf' takes no shards" in capsys.readouterr().err
  assert cli.main([*argv, "--option", "nonsense"]) == 2
  assert "expected KEY=VALUE" in capsys.readouterr().err
  orbax = [
    "export",
    converted,
    str(tmp_path / "o"),
    "--format",
    "orbax",
    "--rules",
    "gpt2:num_heads=2",
  ]
  assert cli.main(orbax) == 2
  assert "writes the checkpoint's own keys" in capsys.readouterr().err
