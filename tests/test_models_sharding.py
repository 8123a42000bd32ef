"""`models.build(cfg, mesh=...)`: parameters created sharded by logical axes, on any mesh.

FSDP over `data`, TP over `model`, a dimension an axis does not divide replicated over it
(one key/value head on a 4-way `model` axis), user rules over the defaults, and a forward
pass that runs on meshes of Explicit axes (`jax.make_mesh`'s default) and of Auto axes with
the unsharded model's logits. No torch needed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _continuity import next_token_step
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax import models, rules
from ucp_jax.models import gpt, llama, neox

ONE_KV = llama.LlamaConfig(
  vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=1, d_model=32, hidden=64
)
CONFIGS = {
  "llama": ONE_KV,
  "gemma2-like": llama.LlamaConfig(
    vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32, hidden=64,
    head_dim=16, norms="sandwich", norm_offset=1.0, embed_scale=True, qk_norm="head",
    sliding_window=3, layer_types=("sliding_attention", "full_attention"),
    local_rope_theta=100.0, attn_softcap=5.0, final_softcap=3.0, query_scale=12.0,
  ),
  "olmo2-like": llama.LlamaConfig(
    vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32, hidden=64,
    norms="post", qk_norm="all", partial_rotary=0.5,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
  ),
  "neox": neox.NeoXConfig(vocab_size=96, num_layers=2, num_heads=4, d_model=32, hidden=64),
  "gpt": gpt.GPTConfig(vocab_size=96, max_len=16, num_layers=2, num_heads=4, d_model=32),
}  # fmt: skip
TOKENS = np.random.default_rng(0).integers(0, 96, (4, 9))
MESHES = {
  "explicit": lambda: jax.make_mesh((2, 4), ("data", "model")),
  "auto": lambda: jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2),
}


def _specs(model) -> dict[str, P]:
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    value = var.get_value()
    out["/".join(map(str, path))] = value.sharding.spec
  return out


COMBOS = [  # every config, both mesh kinds, layers and scan
  ("llama", False, "explicit"),
  ("gemma2-like", True, "explicit"),
  ("gemma2-like", False, "auto"),
  ("olmo2-like", True, "auto"),
  ("neox", False, "explicit"),
  ("gpt", True, "explicit"),
]


@pytest.mark.parametrize(
  ("name", "scan", "mesh_kind"), COMBOS, ids=["-".join(map(str, c)) for c in COMBOS]
)
def test_a_built_model_is_sharded_and_computes_the_unsharded_logits(devices, name, scan, mesh_kind):
  cfg, mesh = CONFIGS[name], MESHES[mesh_kind]()
  model = models.build(cfg, rngs=nnx.Rngs(3), scan=scan, mesh=mesh)
  plain = models.build(cfg, rngs=nnx.Rngs(3), scan=scan, abstract=True)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    assert isinstance(var.get_value().sharding, NamedSharding), path
    assert var.get_metadata()["out_sharding"] == tuple(var.get_value().sharding.spec)
  host = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))  # the same values, unsharded
  nnx.update(plain, host)
  run = nnx.jit(lambda m, x: m(x))
  want = np.asarray(run(plain, jnp.asarray(TOKENS)))
  np.testing.assert_allclose(np.asarray(run(model, jnp.asarray(TOKENS))), want, atol=2e-5)


def test_the_sharded_init_is_the_unsharded_one(devices):
  mesh = MESHES["explicit"]()
  model = models.build(ONE_KV, rngs=nnx.Rngs(3), mesh=mesh)
  plain = models.build(ONE_KV, rngs=nnx.Rngs(3))
  for (_, a), (_, b) in zip(
    nnx.to_flat_state(nnx.state(model, nnx.Param)), nnx.to_flat_state(nnx.state(plain, nnx.Param))
  ):  # up to float32 rounding: compiled there, op by op here
    np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value()), atol=1e-6)


def test_fsdp_over_data_tp_over_model_and_fewer_kv_heads_replicated(devices):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  specs = _specs(models.build(ONE_KV, mesh=mesh, abstract=True))
  assert specs["embed/embedding"] == P("model", "data")  # [vocab, d_model]
  assert specs["layers/0/attn/q/kernel"] == P("data", "model")  # [d, heads, head_dim]
  assert specs["layers/0/attn/k/kernel"] == P("data")  # 1 kv head: replicated over model
  assert specs["layers/0/attn/o/kernel"] == P("model", None, "data")
  assert specs["layers/0/mlp/down/kernel"] == P("model", "data")
  assert specs["layers/0/attn_norm/scale"] == P()
  assert specs["lm_head/kernel"] == P("data", "model")
  stacked = _specs(models.build(ONE_KV, mesh=mesh, abstract=True, scan=True))
  assert stacked["layers/attn/q/kernel"] == P(None, "data", "model")  # the layer axis whole

  tp_only = _specs(models.build(ONE_KV, mesh=mesh, abstract=True, axis_rules={"embed": None}))
  assert tp_only["layers/0/attn/q/kernel"] == P(None, "model")
  two_axes = {"mlp": ("model", "data"), "embed": None}
  both = _specs(models.build(ONE_KV, mesh=mesh, abstract=True, axis_rules=two_axes))
  assert both["layers/0/mlp/up/kernel"] == P(None, ("model", "data"))  # 64 over 8 devices
  one_axis = jax.make_mesh((8,), ("data",))  # no model axis: FSDP only
  assert _specs(models.build(ONE_KV, mesh=one_axis, abstract=True))["lm_head/kernel"] == P("data")


def test_tp_state_replicates_kv_heads_the_axis_does_not_divide(devices, tmp_path):
  # one kv head (Gemma) and two (Qwen3) on a 4-way model axis restored from a checkpoint
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  for kv in (1, 2):
    cfg = llama.LlamaConfig(vocab_size=96, num_heads=4, num_kv_heads=kv, d_model=32)
    source = models.build(cfg, rngs=nnx.Rngs(1))
    ucp_jax.save(tmp_path / f"kv{kv}", {"params": nnx.state(source, nnx.Param)})
    abstract = nnx.eval_shape(lambda cfg=cfg: llama.FlaxLlama(cfg, rngs=nnx.Rngs(0)))
    target = llama.tp_state(nnx.state(abstract, nnx.Param), mesh)
    assert target["layers"][0]["attn"]["k"]["kernel"].sharding.spec == P()
    assert target["layers"][0]["attn"]["q"]["kernel"].sharding.spec == P(None, "model")
    state = ucp_jax.restore(tmp_path / f"kv{kv}", target, subtree="params")
    model = nnx.merge(nnx.graphdef(abstract), state)
    np.testing.assert_allclose(
      np.asarray(model(jnp.asarray(TOKENS))), np.asarray(source(jnp.asarray(TOKENS))), atol=2e-5
    )


def test_load_into_an_abstract_sharded_model_reads_each_slice(devices, tmp_path):
  cfg = CONFIGS["gemma2-like"]
  source = models.build(cfg, rngs=nnx.Rngs(5))
  ucp_jax.save(tmp_path / "ckpt", {"params": nnx.state(source, nnx.Param)})
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  model = models.build(cfg, mesh=mesh, abstract=True)
  rules.load_into(model, tmp_path / "ckpt")
  assert model.layers[0].attn.q.kernel[...].sharding.spec == P("data", "model")
  np.testing.assert_allclose(
    np.asarray(model(jnp.asarray(TOKENS))), np.asarray(source(jnp.asarray(TOKENS))), atol=2e-5
  )
  assert nnx.get_partition_spec(nnx.state(model))["embed"]["embedding"].get_value() == P(
    "model", "data"
  )


@pytest.mark.slow
def test_a_sharded_model_trains_on_an_explicit_mesh(devices):
  optax = pytest.importorskip("optax")
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  model = models.build(CONFIGS["olmo2-like"], rngs=nnx.Rngs(0), mesh=mesh)
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  tokens = jax.device_put(jnp.asarray(TOKENS), NamedSharding(mesh, P("data")))
  step = next_token_step()
  first, second = float(step(model, opt, tokens)), float(step(model, opt, tokens))
  assert second < first
  assert model.layers[0].mlp.up.kernel[...].sharding.spec == P("data", "model")
