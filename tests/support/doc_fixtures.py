"""Setups and checks for the code blocks of README.md and docs/*.md (see tests/support/doc_blocks.py).

A setup prepares what a block assumes a reader already has, and nothing the block shows:
files in the block's empty directory (the current one) and names in its namespace. Every
setup also provides the imports the README's subsections take from its first example (`jax`,
`jnp`, `np`, `nnx`, `optax`, `ucp_jax`). A check runs after its block, in the same namespace
and directory, and asserts what the block's comments promise.

    <!-- doctest: setup=gpt_converted check=rule_sets -->

Register a new one with `@setup(requires=..., slow=...)` or `@check`; the function's name is
the name a document uses. `requires` names the modules it needs installed (the block is skipped
without them); `slow` marks blocks that take more than a few seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax.models import gpt

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GPT_FIXTURE = FIXTURES / "cross_framework"  # a DeepSpeed ZeRO-2 checkpoint of gpt.FlaxGPT's twin
GPT12 = gpt.GPTConfig(vocab_size=32, max_len=8, num_layers=2, num_heads=12, d_model=24)


@dataclasses.dataclass(frozen=True)
class Setup:
  make: Callable[[Path], dict[str, Any]]
  requires: tuple[str, ...] = ()
  slow: bool = False


SETUPS: dict[str, Setup] = {}
CHECKS: dict[str, Callable[[dict[str, Any], Path], None]] = {}


def setup(*, requires: tuple[str, ...] = (), slow: bool = False):
  def register(make):
    SETUPS[make.__name__] = Setup(make, requires, slow)
    return make

  return register


def check(fn):
  CHECKS[fn.__name__] = fn
  return fn


def _imports() -> dict[str, Any]:
  return dict(jax=jax, jnp=jnp, np=np, nnx=nnx, optax=optax, ucp_jax=ucp_jax)


def _gpt_info() -> dict[str, Any]:
  return json.loads((GPT_FIXTURE / "info.json").read_text())


# README.md


@check
def api_screenful(ns, here):
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
  assert ns["moved"]["params"]["w"].sharding == NamedSharding(ns["mesh8"], P())
  assert ns["moved"]["step"] == 100  # Python numbers ride along
  assert ckpt.keys() == ["params/w", "rng", "step"]
  assert (ckpt.step, ckpt.metadata) == (100, {"run": "a"})
  assert ckpt.read("params/w", np.s_[:8, 100:]).shape == (8, 412)
  assert ckpt.verify() == {}


class MyModel(nnx.Module):
  """A kernel split over "model" by `nnx.with_partitioning`, and a BatchNorm."""

  def __init__(self, *, rngs: nnx.Rngs):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    self.fc = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)
    self.norm = nnx.BatchNorm(16, rngs=rngs)
    self.out = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(self.norm(self.fc(x)))


@setup()
def nnx_model(here):
  """`MyModel`, an NNX module (above); `linen_state`, a Linen `TrainState` with AdamW."""
  from flax import linen as nn
  from flax.training import train_state

  dense = nn.Dense(4)
  params = dense.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
  state = train_state.TrainState.create(apply_fn=dense.apply, params=params, tx=optax.adamw(1e-3))
  return {**_imports(), "MyModel": MyModel, "linen_state": state}


@check
def flax_train_state(ns, here):
  kernel = ns["model"].fc.kernel[...]
  assert kernel.sharding.spec == P(None, "model")
  np.testing.assert_array_equal(np.asarray(kernel), ucp_jax.open("ckpt").read("model/fc/kernel"))
  schema = ucp_jax.open("ckpt").manifest.schema
  assert set(schema["params"]["fc/kernel"]["slots"]) == {"exp_avg", "exp_avg_sq"}
  assert "norm/mean" in "".join(schema["buffers"].values())
  restored = ns["linen_state"]
  assert type(restored).__name__ == "TrainState"
  np.testing.assert_array_equal(
    np.asarray(restored.params["kernel"]), ucp_jax.open("linen_ckpt").read("params/kernel")
  )


@check
def auto_mesh(ns, here):
  kernel = ns["model"].fc.kernel[...]
  assert kernel.sharding.mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
  assert kernel.sharding.spec == P(None, "model")
  np.testing.assert_array_equal(np.asarray(kernel), ucp_jax.open("ckpt").read("model/fc/kernel"))
  assert ns["abstract"].fc.kernel.sharding.spec == P(None, "model")


@setup()
def gpt_converted(here):
  """`path`: a torch-named checkpoint of a GPT-2 (12 heads, tiny), as `ucp convert` writes;
  `model`: a `gpt.FlaxGPT` of its shape, and `target = nnx.state(model)`."""
  trained = gpt.FlaxGPT(GPT12, rngs=nnx.Rngs(1))
  torch_named = ucp_jax.rules.gpt2(num_heads=12).export_arrays(nnx.state(trained))
  ucp_jax.save("converted", {"params": torch_named})
  model = gpt.FlaxGPT(GPT12, rngs=nnx.Rngs(0))
  return {**_imports(), "path": "converted", "model": model, "target": nnx.state(model)}


@check
def rule_sets(ns, here):
  ckpt = ucp_jax.open(ns["path"])
  fc = ns["params"]["blocks"][0]["mlp"]["fc"]["kernel"]
  np.testing.assert_array_equal(np.asarray(fc[...]).T, ckpt.read("params/h.0.mlp.fc.weight"))
  assert {f"params/{k}" for k in ns["torch_named"]} == set(ckpt.keys())


@setup()
def train_loop(here):
  """`state` (sharded over 8 devices), `train_step`, `step` and a restore `target`."""
  mesh = jax.make_mesh((8,), ("data",))
  w = jax.device_put(jnp.ones((64, 8)), NamedSharding(mesh, P("data")))
  state = {"params": {"w": w}, "step": 100}

  @jax.jit
  def update(params):
    return jax.tree.map(lambda w: w * 2, params)

  def train_step(state):
    return {"params": update(state["params"]), "step": state["step"] + 1}

  target = jax.tree.map(lambda x: x, state)
  return {**_imports(), "state": state, "train_step": train_step, "step": 100, "target": target}


@check
def training_loop(ns, here):
  try:
    assert ns["manager"].latest_step() == 100
  finally:
    ns["manager"].close()
  assert ns["state"]["step"] == 101
  np.testing.assert_array_equal(np.asarray(ns["state"]["params"]["w"]), 2.0)
  assert ucp_jax.open("ckpt/100").step == 100
  assert ucp_jax.open("ckpts/100/default").keys() == ["params/w", "step"]


@setup(requires=("torch",), slow=True)
def deepspeed_gpt(here):
  """`ds_ckpt/`: a DeepSpeed ZeRO-2 checkpoint of a GPT (4 heads); `model` and `optimizer`:
  its Flax twin and an AdamW `nnx.Optimizer`. (The export writes .pt files: torch.)"""
  shutil.copytree(GPT_FIXTURE / "ckpt", "ds_ckpt")
  return _gpt_and_adamw()


def _gpt_and_adamw() -> dict[str, Any]:
  model = gpt.FlaxGPT(gpt.GPTConfig(**_gpt_info()["model"]), rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  return {**_imports(), "model": model, "optimizer": optimizer}


@check
def deepspeed_round_trip(ns, here):
  info = _gpt_info()
  assert int(ns["optimizer"].step[...]) == info["steps_before_save"]
  for folder in ("ds_universal", "ds_export"):
    assert (Path(folder) / "latest_universal").read_text().strip() == info["tag"]


def _tiny_llama_config():
  import transformers

  return transformers.LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
  )  # fmt: skip


@setup(requires=("torch", "transformers"), slow=True)
def hf_llama(here):
  """`hf_model/`: a tiny Llama saved by `save_pretrained` (sharded, with an index);
  `transformers`."""
  import torch
  import transformers

  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(_tiny_llama_config()).eval()
  hf.save_pretrained("hf_model", max_shard_size="20KB")
  return {**_imports(), "transformers": transformers}


@check
def hf_logits(ns, here):
  import torch
  import transformers

  ids = np.arange(12).reshape(2, 6) % 64
  hf = transformers.AutoModelForCausalLM.from_pretrained("hf_model").eval()
  with torch.no_grad():
    want = hf(torch.tensor(ids)).logits.numpy()
    again = ns["reloaded"].eval()(torch.tensor(ids)).logits.numpy()  # "same logits"
  np.testing.assert_allclose(np.asarray(ns["model"](jnp.asarray(ids))), want, atol=1e-5)
  np.testing.assert_allclose(again, want, atol=1e-5)
  shutil.copytree("hf_out", "hf_out_python")


@check
def hf_cli(ns, here):
  assert ucp_jax.diff("hf_out", "hf_out_python").identical  # the CLI wrote what Python did
  assert ucp_jax.diff("universal", "hf_model").identical


# docs/export.md


@setup(requires=("torch", "transformers"), slow=True)
def llama_checkpoint(here):
  """`ckpt`: a torch-named checkpoint of a tiny Llama; `path/to/config.json`, its config."""
  import transformers

  config = _tiny_llama_config()
  model = transformers.LlamaForCausalLM(config)
  state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  schema = {"version": 1, "naming": "torch", "params": {n: {"value": f"params/{n}"} for n in state}}
  ucp_jax.save("ckpt", {"params": state}, schema=schema)
  config.save_pretrained("path/to")
  return {**_imports(), "transformers": transformers}


@setup(requires=("torch",))
def deepspeed_checkpoint(here):
  """`ckpt`: a DeepSpeed ZeRO-2 BF16 checkpoint (DP=3, 3 steps), converted."""
  ucp_jax.convert(FIXTURES / "deepspeed" / "z2_bf16_dp3" / "ckpt", "ckpt")
  return _imports()


@check
def export_report(ns, here):
  report = ns["report"]
  assert (report.tag, report.zero_stages) == ("global_step3", (3,))  # as its comment says
  assert report.notes


# docs/mapping.md


@setup()
def mapping_model(here):
  """`path`: a converted GPT-like checkpoint (12 heads); `model`, whose keys the rule set
  names, and `target = nnx.state(model)`."""
  layers, d, heads, head_dim = 2, 8, 12, 2
  rng = np.random.default_rng(0)
  torch_sd = {"wte.weight": rng.normal(size=(10, d)).astype(np.float32)}
  for i in range(layers):
    torch_sd[f"h.{i}.mlp.fc.weight"] = rng.normal(size=(4 * d, d)).astype(np.float32)
    qkv = rng.normal(size=(3 * heads * head_dim, d)).astype(np.float32)
    torch_sd[f"h.{i}.attn.qkv.weight"] = qkv
  torch_sd["lm_head.weight"] = torch_sd["wte.weight"]
  ucp_jax.save("converted", {"params": torch_sd})

  def param(*shape):
    return nnx.Param(jnp.zeros(shape))

  class Model(nnx.Module):
    def __init__(self):
      self.wte = nnx.Dict(embedding=param(10, d))
      blocks = {
        str(i): nnx.Dict(mlp=nnx.Dict(fc=nnx.Dict(kernel=param(d, 4 * d)))) for i in range(layers)
      }
      blocks["attn"] = nnx.Dict(qkv=nnx.Dict(kernel=param(layers, d, 3, heads, head_dim)))
      self.blocks = nnx.Dict(blocks)

  model = Model()
  return {**_imports(), "path": "converted", "model": model, "target": nnx.state(model)}


@check
def mapping_views(ns, here):
  ckpt = ucp_jax.open(ns["path"])
  qkv = np.stack([ckpt.read(f"params/h.{i}.attn.qkv.weight").T for i in range(2)])
  state = ns["state"]
  np.testing.assert_array_equal(
    np.asarray(state["blocks"]["attn"]["qkv"]["kernel"][...]), qkv.reshape(2, 8, 3, 12, 2)
  )
  np.testing.assert_array_equal(
    np.asarray(state["blocks"]["1"]["mlp"]["fc"]["kernel"][...]),
    ckpt.read("params/h.1.mlp.fc.weight").T,
  )
  assert {f"params/{k}" for k in ns["torch_named"]} == set(ckpt.keys())  # lm_head.weight too


@setup(requires=("torch", "transformers"), slow=True)
def hf_gpt2(here):
  """`hf_model`: a tiny `transformers` GPT-2; `tokens`: a batch of token ids."""
  import torch
  import transformers

  torch.manual_seed(0)
  config = transformers.GPT2Config(
    vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
  )
  hf_model = transformers.GPT2LMHeadModel(config).eval()
  return {**_imports(), "hf_model": hf_model, "tokens": np.arange(12).reshape(2, 6) % 64}


# docs/orbax.md


def _gpt_training() -> tuple[Any, Any, dict[str, Any]]:
  model = gpt.FlaxGPT(GPT12, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  return model, optimizer, {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}


@setup(requires=("torch",), slow=True)
def gpt_training(here):
  """`model`: a `gpt.FlaxGPT` (12 heads, tiny) and its AdamW `optimizer`; `target` and
  `target_on_any_mesh`: their state as saved, and abstract on a 2 x 4 mesh. (The block's
  DeepSpeed export writes .pt files: torch.)"""
  model, optimizer, target = _gpt_training()
  replicated = NamedSharding(jax.make_mesh((2, 4), ("data", "model")), P())
  on_mesh = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), target
  )
  return {**_imports(), "model": model, "optimizer": optimizer, "target": target,
          "target_on_any_mesh": on_mesh}  # fmt: skip


@check
def orbax_round_trip(ns, here):
  saved = jax.tree.leaves(ns["target"])
  assert all(np.array_equal(a, b) for a, b in zip(saved, jax.tree.leaves(ns["restored"])))
  assert sorted(os.listdir("run")) == ["ds", "hf", "orbax", "orbax2", "ucp"]  # no tmp folders


@setup(slow=True)
def orbax_checkpoint(here):
  """`run/orbax`: an Orbax `StandardCheckpointer` save of a GPT's model and AdamW states."""
  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as c:
    c.save(os.path.abspath("run/orbax"), _gpt_training()[2])
  return {}


# docs/dcp.md


@setup(requires=("torch",), slow=True)
def dcp_gpt(here):
  """`dcp_ckpt/`: a torch DCP checkpoint of a GPT (4 heads) with AdamW; `model` and
  `optimizer`: its Flax twin and an AdamW `nnx.Optimizer`."""
  ucp_jax.convert(GPT_FIXTURE / "ckpt", ".universal")
  ucp_jax.export(".universal", "dcp_ckpt", format="dcp")
  shutil.rmtree(".universal")
  return _gpt_and_adamw()


@setup(requires=("torch",), slow=True)
def torch_gpt(here):
  """`dcp_out/`: a DCP export of a JAX GPT (4 heads) and AdamW; `model` and `optimizer`: the
  GPT's torch twin and a torch AdamW; `dcp`, `get_state_dict` and `set_state_dict`."""

  import torch
  import torch.distributed.checkpoint as dcp
  from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
  from torch_twins import TorchGPT

  names = _gpt_and_adamw()
  ucp_jax.save_train_state(".jax_ckpt", names["model"], names["optimizer"])
  ucp_jax.export(".jax_ckpt", "dcp_out", format="dcp", rules=ucp_jax.rules.gpt2(num_heads=4))
  shutil.rmtree(".jax_ckpt")
  model = TorchGPT(gpt.GPTConfig(**_gpt_info()["model"]))
  optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
  return {"model": model, "optimizer": optimizer, "dcp": dcp, "get_state_dict": get_state_dict,
          "set_state_dict": set_state_dict}  # fmt: skip


# docs/scale.md


@setup()
def scripts(here):
  """`scripts/`: the repository's scripts (a link)."""
  os.symlink(Path(__file__).resolve().parents[2] / "scripts", "scripts")
  return {}


# docs/megatron.md


@setup()
def megatron_run(here):
  """`checkpoints/`: a Megatron-LM root (TP 2 x DP 2, the distributed optimizer's default
  dp_reshardable format) that megatron-core 0.19.2 wrote (tests/fixtures/megatron_core)."""
  fixture = Path(__file__).resolve().parents[1] / "fixtures/megatron_core/distopt_dp_reshardable"
  shutil.copytree(fixture, "checkpoints", ignore=shutil.ignore_patterns("*.npz", "info.json"))
  return {}
