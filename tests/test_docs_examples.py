"""The code a user copies from README.md and docs/*.md runs, and the docstring examples pass.

Each example is read from the document at test time and run as written, in a fresh
directory; only its obvious placeholders (`MyModel`, `mesh`, `path`, `train_step`, ...) are
given small real stand-ins. So the documents cannot drift from the API unnoticed.
"""

from __future__ import annotations

import doctest
import importlib
import json
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax import _cli
from ucp_jax.models import gpt

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FIXTURES = ROOT / "tests" / "fixtures"
GPT_FIXTURE = FIXTURES / "cross_framework"  # a DeepSpeed ZeRO-2 checkpoint of gpt.FlaxGPT's twin
GPT_INFO = json.loads((GPT_FIXTURE / "info.json").read_text())


def _section(text: str, heading: str) -> str:
  """`heading`'s section: up to the next heading of the same or a higher level."""
  level = len(heading) - len(heading.lstrip("#"))
  lines = text.splitlines()
  start = lines.index(heading)
  end = next(
    (
      i
      for i in range(start + 1, len(lines))
      if re.match(rf"#{{1,{level}}} ", lines[i]) and not _in_code(lines[:i])
    ),
    len(lines),
  )
  return "\n".join(lines[start:end])


def _in_code(lines: list[str]) -> bool:
  return sum(line.startswith("```") for line in lines) % 2 == 1


def _blocks(text: str, lang: str = "python") -> list[str]:
  return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def _block(doc: str, heading: str, lang: str = "python") -> str:
  blocks = _blocks(_section(doc, heading), lang)
  assert blocks, f"no {lang} block under {heading!r}"
  return blocks[0]


def _run(code: str, where: str, **names):
  """Runs `code` as a script would, with `names` defined; returns its namespace."""
  namespace = {"__name__": "__docs_example__", **names}
  exec(compile(code, where, "exec"), namespace)
  return namespace


def _shell(block: str) -> None:
  """Runs each `ucp ...` line of a shell block through the CLI's entry point."""
  for line in block.splitlines():
    command = line.split("#")[0].split()
    if command:
      assert command[0] == "ucp", line
      assert _cli.main(command[1:]) == 0, line


def _gpt_model(**config):
  return gpt.FlaxGPT(gpt.GPTConfig(**{**GPT_INFO["model"], **config}), rngs=nnx.Rngs(0))


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  return tmp_path


@pytest.fixture
def needs_torch():
  pytest.importorskip("torch", reason="the export writes .pt files (pip install 'ucp_jax[torch]')")


# README: "The API in a screenful" and its subsections


def test_readme_the_api_in_a_screenful(in_tmp, devices):
  code = _block(README, "## The API in a screenful")
  assert 'ucp_jax.save("ckpt", state' in code  # the opening example, not a subsection's
  ns = _run(code, "README.md: The API in a screenful")
  restored, ckpt = ns["restored"], ns["ckpt"]
  w = restored["params"]["w"]
  assert w.sharding.spec == P("data", "model") and w.shape == (1024, 512)
  np.testing.assert_array_equal(np.asarray(w), 1.0)
  assert restored["step"] == 100
  np.testing.assert_array_equal(
    jax.random.key_data(restored["rng"]), jax.random.key_data(ns["state"]["rng"])
  )
  assert ns["params"]["w"].sharding.spec == P("data", "model")
  assert set(ns["only_w"]) == {"params"}
  assert isinstance(ns["as_numpy"]["params"]["w"], np.ndarray)
  moved = ns["moved"]
  assert moved["params"]["w"].sharding == NamedSharding(ns["mesh8"], P())
  assert moved["step"] == 100  # Python numbers ride along
  assert ckpt.keys() == ["params/w", "rng", "step"]
  assert (ckpt.step, ckpt.metadata) == (100, {"run": "a"})
  assert ckpt.read("params/w", np.s_[:8, 100:]).shape == (8, 412)
  assert ckpt.verify() == {}


def test_readme_the_api_in_a_screenful_runs_on_a_default_host(tmp_path):
  """Without the test suite's 8 devices: the example's first line provides them."""
  import os
  import subprocess
  import sys

  code = _block(README, "## The API in a screenful")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
    [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
  )
  assert proc.returncode == 0, proc.stderr[-3000:]


class MyModel(nnx.Module):
  """The README's `MyModel`: a kernel split over "model" by `nnx.with_partitioning`, a BatchNorm."""

  def __init__(self, *, rngs: nnx.Rngs):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    self.fc = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)
    self.norm = nnx.BatchNorm(16, rngs=rngs)
    self.out = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(self.norm(self.fc(x)))


def _linen_state():
  from flax import linen as nn
  from flax.training import train_state

  model = nn.Dense(4)
  params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))


def test_readme_flax_and_optax_training_states(in_tmp, devices):
  code = _block(README, "### Flax and Optax training states")
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  linen_state = _linen_state()
  with jax.set_mesh(mesh):  # variables made with nnx.with_partitioning need a mesh
    ns = _run(
      code,
      "README.md: Flax and Optax training states",
      ucp_jax=ucp_jax,
      nnx=nnx,
      optax=optax,
      MyModel=MyModel,
      mesh=mesh,
      linen_state=linen_state,
    )
  kernel = ns["model"].fc.kernel[...]
  assert kernel.sharding.spec == P(None, "model")
  np.testing.assert_array_equal(np.asarray(kernel), ucp_jax.open("ckpt").read("model/fc/kernel"))
  schema = ucp_jax.open("ckpt").manifest.schema
  assert set(schema["params"]["fc/kernel"]["slots"]) == {"exp_avg", "exp_avg_sq"}
  assert "norm/mean" in "".join(schema["buffers"].values())
  restored = ns["linen_state"]
  assert type(restored) is type(linen_state) and restored is not linen_state
  np.testing.assert_array_equal(
    np.asarray(restored.params["kernel"]), np.asarray(linen_state.params["kernel"])
  )


def _converted_gpt(dst: str | Path) -> Path:
  ucp_jax.convert(GPT_FIXTURE / "ckpt", dst)
  return Path(dst)


def test_readme_rule_sets(in_tmp, devices):
  code = _block(README, "### Between PyTorch names and Flax models: rule sets")
  heads = GPT_INFO["model"]["num_heads"]
  assert "num_heads=12" in code
  code = code.replace("num_heads=12", f"num_heads={heads}")  # the fixture's model
  path = _converted_gpt("universal")
  model = _gpt_model()
  ns = _run(
    code,
    "README.md: rule sets",
    ucp_jax=ucp_jax,
    nnx=nnx,
    path=path,
    target=nnx.state(model),
    model=model,
  )
  ckpt = ucp_jax.open(path)
  fc = ns["params"]["blocks"][0]["mlp"]["fc"]["kernel"]
  np.testing.assert_array_equal(np.asarray(fc[...]).T, ckpt.read("params/h.0.mlp.fc.weight"))
  torch_named = ns["torch_named"]
  assert set(torch_named) == set(ckpt.manifest.schema["params"])  # tied lm_head.weight too
  assert torch_named["h.0.attn.qkv.weight"].shape == ckpt["params/h.0.attn.qkv.weight"].shape


def test_readme_training_loop_async_and_orbax(in_tmp, devices):
  code = _block(README, "### In a training loop: async saves and Orbax's CheckpointManager")
  mesh = jax.make_mesh((8,), ("data",))
  state = {"params": {"w": jax.device_put(jnp.ones((64, 8)), NamedSharding(mesh, P("data")))}}
  state["step"] = 100

  @jax.jit
  def update(params):
    return jax.tree.map(lambda w: w * 2, params)

  def train_step(state):
    return {"params": update(state["params"]), "step": state["step"] + 1}

  target = jax.tree.map(lambda x: x, state)
  ns = _run(
    code,
    "README.md: In a training loop",
    ucp_jax=ucp_jax,
    state=state,
    train_step=train_step,
    step=100,
    target=target,
  )
  try:
    assert ns["manager"].latest_step() == 100
  finally:
    ns["manager"].close()
  resumed = ns["state"]
  assert resumed["step"] == 101
  np.testing.assert_array_equal(np.asarray(resumed["params"]["w"]), 2.0)
  assert ucp_jax.open("ckpt/100").step == 100
  assert ucp_jax.open("ckpts/100/default").keys() == ["params/w", "step"]


# README: "From DeepSpeed to JAX and back"


def test_readme_from_deepspeed_to_jax_and_back(in_tmp, devices, needs_torch):
  section = _section(README, "## From DeepSpeed to JAX and back")
  shutil.copytree(GPT_FIXTURE / "ckpt", "ds_ckpt")
  _shell(_blocks(section, "bash")[0])
  model = _gpt_model()
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  _run(
    _blocks(section)[0],
    "README.md: From DeepSpeed to JAX and back",
    ucp_jax=ucp_jax,
    model=model,
    optimizer=optimizer,
  )
  assert int(optimizer.step[...]) == GPT_INFO["steps_before_save"]
  assert (Path("ds_export") / "latest_universal").read_text().strip() == "global_step10"
  assert (Path("ds_universal") / "latest_universal").read_text().strip() == "global_step10"


# README: "From Hugging Face to JAX and back"


def test_readme_from_hugging_face_to_jax_and_back(in_tmp, devices, needs_torch):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  section = _section(README, "## From Hugging Face to JAX and back")
  config = transformers.LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
  )  # fmt: skip
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(config).eval()
  hf.save_pretrained("hf_model", max_shard_size="20KB")  # sharded, with an index
  code = _blocks(section)[0]
  ns = _run(
    code, "README.md: From Hugging Face to JAX and back",
    ucp_jax=ucp_jax, nnx=nnx, optax=optax, transformers=transformers,
  )  # fmt: skip
  ids = np.arange(12).reshape(2, 6) % 64
  with torch.no_grad():
    want = hf(torch.tensor(ids)).logits.numpy()
    again = ns["reloaded"].eval()(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(ns["model"](jnp.asarray(ids))), want, atol=1e-5)
  np.testing.assert_allclose(again, want, atol=1e-5)
  os.rename("hf_out", "hf_out_python")
  _shell(_blocks(section, "bash")[0])  # inspect, convert, export through --rules hf
  assert ucp_jax.diff("hf_out", "hf_out_python").identical  # the CLI wrote what Python did
  assert ucp_jax.diff("universal", "hf_model").identical


# docs/*.md


def test_docs_export(in_tmp, needs_torch):
  code = _block((ROOT / "docs" / "export.md").read_text(), "## DeepSpeed")
  ucp_jax.convert(FIXTURES / "deepspeed" / "z2_bf16_dp3" / "ckpt", "ckpt")
  ns = _run(code, "docs/export.md", ucp_jax=ucp_jax)
  report = ns["report"]
  assert (report.tag, report.zero_stages) == ("global_step3", (3,))  # as its comment says
  assert report.notes


def test_docs_export_hugging_face(in_tmp, needs_torch):
  transformers = pytest.importorskip("transformers")
  code = _block((ROOT / "docs" / "export.md").read_text(), "## Hugging Face")
  config = transformers.LlamaConfig(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1,
  )  # fmt: skip
  model = transformers.LlamaForCausalLM(config)
  state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  schema = {"version": 1, "naming": "torch", "params": {n: {"value": f"params/{n}"} for n in state}}
  ucp_jax.save("ckpt", {"params": state}, schema=schema)
  config.save_pretrained("path/to")
  ns = _run(code, "docs/export.md: Hugging Face", ucp_jax=ucp_jax, transformers=transformers)
  assert type(ns["model"]).__name__ == "LlamaForCausalLM"


def test_docs_mapping(in_tmp):
  code = _blocks((ROOT / "docs" / "mapping.md").read_text())[0]
  layers, d, heads, head_dim = 2, 8, 12, 2
  rng = np.random.default_rng(0)
  torch_sd = {"wte.weight": rng.normal(size=(10, d)).astype(np.float32)}
  for i in range(layers):
    torch_sd[f"h.{i}.mlp.fc.weight"] = rng.normal(size=(4 * d, d)).astype(np.float32)
    torch_sd[f"h.{i}.attn.qkv.weight"] = rng.normal(size=(3 * heads * head_dim, d)).astype(
      np.float32
    )
  torch_sd["lm_head.weight"] = torch_sd["wte.weight"]
  ucp_jax.save("converted", {"params": torch_sd})

  class Model(nnx.Module):  # the Flax side of docs/mapping.md's rule set
    def __init__(self):
      def param(*shape):
        return nnx.Param(jnp.zeros(shape))

      self.wte = nnx.Dict(embedding=param(10, d))
      blocks = {
        str(i): nnx.Dict(mlp=nnx.Dict(fc=nnx.Dict(kernel=param(d, 4 * d)))) for i in range(layers)
      }
      blocks["attn"] = nnx.Dict(qkv=nnx.Dict(kernel=param(layers, d, 3, heads, head_dim)))
      self.blocks = nnx.Dict(blocks)

  model = Model()
  ns = _run(
    code,
    "docs/mapping.md",
    nnx=nnx,
    path="converted",
    target=nnx.state(model),
    model=model,
  )
  state = ns["state"]
  qkv = np.stack([torch_sd[f"h.{i}.attn.qkv.weight"].T for i in range(layers)])
  np.testing.assert_array_equal(
    np.asarray(state["blocks"]["attn"]["qkv"]["kernel"][...]),
    qkv.reshape(layers, d, 3, heads, head_dim),
  )
  np.testing.assert_array_equal(
    np.asarray(state["blocks"]["1"]["mlp"]["fc"]["kernel"][...]), torch_sd["h.1.mlp.fc.weight"].T
  )
  assert set(ns["torch_named"]) == set(torch_sd)  # the tied lm_head.weight written back too


# docstring examples (`>>>`) of the package


def _modules_with_examples() -> list:
  params = []
  for file in sorted((ROOT / "ucp_jax").rglob("*.py")):
    if ">>>" in file.read_text():
      parts = file.relative_to(ROOT).with_suffix("").parts
      name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
      slow = name.startswith("ucp_jax.models.")  # they compile a model: seconds each
      params.append(pytest.param(name, marks=[pytest.mark.slow] if slow else [], id=name))
  return params


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples(name, monkeypatch, devices):
  monkeypatch.chdir(ROOT)  # some examples read the fixtures under tests/
  module = importlib.import_module(name)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  tests = doctest.DocTestFinder().find(module, name)
  assert tests
  for test in tests:
    runner.run(test)
  results = runner.summarize(verbose=False)
  assert results.failed == 0, f"{results.failed} docstring examples of {name} failed (see stdout)"
