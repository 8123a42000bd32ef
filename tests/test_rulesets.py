"""Ready rule sets: torch GPT-2 / Llama checkpoints restore onto sharded Flax NNX twins and back."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding

import ucp_jax
from ucp_jax import rules
from ucp_jax.models import gpt, llama
from ucp_jax.tree import _tree

torch = pytest.importorskip("torch")
from torch_twins import TorchGPT, TorchLlama  # noqa: E402  (needs torch; in scripts/)

GPT = gpt.GPTConfig(vocab_size=96, max_len=16, num_layers=3, num_heads=4, d_model=32)
LLAMA = llama.LlamaConfig(vocab_size=96, num_layers=3, num_heads=8, num_kv_heads=4, d_model=32)

MODELS = {
  "gpt": (
    GPT,
    lambda: TorchGPT(GPT),
    lambda scan: gpt.FlaxGPT(GPT, rngs=nnx.Rngs(0), scan=scan),
    lambda stacked: rules.gpt2(num_heads=GPT.num_heads, stacked=stacked),
    gpt.tp_state,
  ),
  "llama": (
    LLAMA,
    lambda: TorchLlama(LLAMA),
    lambda scan: llama.FlaxLlama(LLAMA, rngs=nnx.Rngs(0), scan=scan),
    lambda stacked: rules.llama(
      num_heads=LLAMA.num_heads, num_kv_heads=LLAMA.num_kv_heads, stacked=stacked
    ),
    llama.tp_state,
  ),
}


def _torch_state(make_torch):
  torch.manual_seed(0)
  model = make_torch()
  with torch.no_grad():  # norms and biases away from their 1 / 0 init, so a mix-up shows
    for p in model.parameters():
      if p.dim() == 1:
        p.add_(0.1 * torch.randn_like(p))
  return model, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("stacked", [False, True], ids=["layers", "scan"])
def test_rules_name_every_flax_parameter(name, stacked):
  cfg, make_torch, make_flax, make_rules, _ = MODELS[name]
  _, sd = _torch_state(make_torch)
  abstract = nnx.eval_shape(lambda: make_flax(stacked))
  flax_keys, _ = _tree.flatten(nnx.state(abstract, nnx.Param))
  mapped = make_rules(stacked).map_names(sd)
  assert sorted(mapped) == sorted(flax_keys)
  if stacked:
    some = next(k for k in mapped if k.endswith("mlp/fc/kernel") or k.endswith("mlp/up/kernel"))
    assert len(mapped[some]) == cfg.num_layers


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("stacked", [False, True], ids=["layers", "scan"])
def test_torch_checkpoint_restores_onto_a_sharded_flax_model_and_exports_back(
  tmp_path, name, stacked
):
  cfg, make_torch, make_flax, make_rules, tp_state = MODELS[name]
  torch_model, sd = _torch_state(make_torch)
  ucp_jax.save(tmp_path / "ckpt", {"params": sd})  # torch names, torch layouts

  # Auto axes: XLA propagates the shardings through the forward pass (Explicit, the
  # default of `jax.make_mesh`, asks for an out_sharding at every contraction).
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
  abstract = nnx.eval_shape(lambda: make_flax(stacked))
  target = tp_state(nnx.state(abstract, nnx.Param), mesh)
  state = ucp_jax.restore(tmp_path / "ckpt", target, subtree="params", rules=make_rules(stacked))
  model = nnx.merge(nnx.graphdef(abstract), state)

  flat, _ = _tree.flatten(state)
  sharded = [
    k
    for k, v in flat.items()
    if isinstance(v.sharding, NamedSharding) and "model" in jax.tree.leaves(tuple(v.sharding.spec))
  ]
  assert len(sharded) >= (6 if stacked else 6 * cfg.num_layers)  # heads and MLP split over "model"

  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
  with torch.no_grad():
    expected = torch_model(torch.from_numpy(tokens)).numpy()
  got = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(tokens)))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

  back = make_rules(stacked).export_arrays(nnx.state(model, nnx.Param))
  assert sorted(back) == sorted(sd)
  for key, value in sd.items():
    assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
    assert back[key].tobytes() == value.tobytes(), key  # bit for bit


def test_gpt2_rules_report_a_wrong_head_count_for_every_key(tmp_path):
  _, sd = _torch_state(MODELS["gpt"][1])
  with pytest.raises(ucp_jax.MappingError) as e:
    rules.gpt2(num_heads=5).import_arrays(sd)
  lines = str(e.value).splitlines()[1:]
  assert len(lines) == 3 * GPT.num_layers  # qkv kernel and bias, proj kernel, of every layer
  assert lines[0].startswith("  blocks/0/attn/qkv/kernel: from h.0.attn.qkv.weight (96, 32)")


def test_torch_moments_map_like_the_parameters():
  _, sd = _torch_state(MODELS["llama"][1])
  llama_rules = rules.llama(num_heads=8, num_kv_heads=4)
  moments = llama_rules.under("params") + llama_rules.under("exp_avg", "opt_state/mu")
  names = {f"params/{k}": v for k, v in sd.items()} | {f"exp_avg/{k}": 2 * v for k, v in sd.items()}
  out = moments.import_arrays(names)
  np.testing.assert_array_equal(
    out["opt_state/mu/layers/1/mlp/up/kernel"], 2 * sd["layers.1.mlp.up_proj.weight"].T
  )
  assert sorted(moments.export_arrays(out)) == sorted(names)


@pytest.mark.parametrize("name", MODELS)
def test_check_forward_proves_the_twin_rules_and_catches_swapped_norms(name):
  cfg, make_torch, make_flax, make_rules, _ = MODELS[name]
  torch_model, _ = _torch_state(make_torch)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
  abstract = nnx.eval_shape(lambda: make_flax(False))
  assert rules.check_forward(torch_model, abstract, make_rules(False), tokens) < 1e-5
  first, second = {"gpt": ("ln_1", "ln_2"), "llama": ("attn_norm", "mlp_norm")}[name]
  swap = lambda m: f"/{second if m[1] == first else first}/"  # noqa: E731
  swapped = rules.RuleSet(  # same shapes: only the outputs can tell
    [
      dataclasses.replace(r, target=re.sub(rf"/({first}|{second})/", swap, r.target))
      if r.target
      else r
      for r in make_rules(False).rules
    ]
  )
  with pytest.raises(ucp_jax.MappingError, match="outputs differ beyond atol=1e-05"):
    rules.check_forward(torch_model, abstract, swapped, tokens)
