"""save_train_state / restore_train_state: Flax NNX and Linen with Optax slots, across meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _continuity import next_token_step
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax.models import gpt


def _mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(8, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, rngs=rngs)
    self.fc2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.relu(self.norm(self.fc1(x), use_running_average=True)))


def _train(model, opt, steps, seed=0):
  @nnx.jit
  def step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
    return loss

  losses = []
  for i in range(steps):
    key = jax.random.fold_in(jax.random.key(seed), i)
    x = jax.random.normal(key, (8, 8))
    losses.append(float(step(model, opt, x, jnp.sin(x[:, :4]))))
  return losses


TXS = {
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  "chain": lambda: optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.inject_hyperparams(optax.adamw)(
      learning_rate=optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.01
    ),
  ),
  "adam_decay": lambda: optax.chain(optax.add_decayed_weights(1e-3), optax.adam(1e-2)),
  "sgd": lambda: optax.sgd(1e-2, momentum=0.9),
}


@pytest.mark.parametrize("tx", list(TXS))
def test_nnx_save_restore_continue_on_another_mesh(tmp_path, tx):
  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, TXS[tx](), wrt=nnx.Param)
  _train(model, opt, 3)
  ucp_jax.save_train_state(tmp_path / "c", model, opt, hyperparams={"lr": 1e-2})
  schema = ucp_jax.open(tmp_path / "c").manifest.schema
  slots = schema["params"]["fc1/kernel"]["slots"]
  assert set(slots) == ({"momentum_buffer"} if tx == "sgd" else {"exp_avg", "exp_avg_sq"})
  assert "norm/mean" in schema["buffers"] and schema["params"]["norm/scale"]["frozen"] is False
  assert schema["optimizer"]["step"] == 3
  expected = _train(model, opt, 2, seed=1)

  mesh = _mesh((2, 4), ("data", "model"))
  fresh = MLP(nnx.Rngs(7))
  fresh_opt = nnx.Optimizer(fresh, TXS[tx](), wrt=nnx.Param)

  def shard(x):
    spec = P("model") if x.ndim == 1 and x.shape[0] % 4 == 0 else P()
    return jax.device_put(x, NamedSharding(mesh, spec))

  nnx.update(fresh, jax.tree.map(shard, nnx.state(fresh)))
  nnx.update(fresh_opt, jax.tree.map(shard, nnx.state(fresh_opt)))
  ucp_jax.restore_train_state(tmp_path / "c", fresh, fresh_opt)
  assert fresh.fc1.bias[...].sharding.spec == P("model")
  np.testing.assert_allclose(_train(fresh, fresh_opt, 2, seed=1), expected, rtol=1e-6)


def test_schema_records_hyperparams_from_inject_hyperparams(tmp_path):
  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, TXS["chain"](), wrt=nnx.Param)
  _train(model, opt, 1)
  ucp_jax.save_train_state(tmp_path / "c", model, opt)
  group = ucp_jax.open(tmp_path / "c").manifest.schema["optimizer"]["groups"][0]
  assert group["weight_decay"] == pytest.approx(0.01) and group["betas"] == [0.9, 0.999]
  assert group["lr"] == pytest.approx(1e-2)  # what the schedule gave the step just taken


def test_linen_train_state(tmp_path):
  import flax.linen as nn
  from flax.training import train_state

  module = nn.Dense(4)
  params = module.init(jax.random.key(0), jnp.ones((1, 3)))
  state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=optax.adam(1e-2))
  grads = jax.tree.map(jnp.ones_like, params)
  state = state.apply_gradients(grads=grads)
  ucp_jax.save_train_state(tmp_path / "c", state)
  schema = ucp_jax.open(tmp_path / "c").manifest.schema
  assert schema["params"]["params/kernel"]["slots"]["exp_avg"] == "opt_state/0/mu/params/kernel"
  blank = train_state.TrainState.create(
    apply_fn=module.apply, params=jax.tree.map(jnp.zeros_like, params), tx=optax.adam(1e-2)
  )
  restored = ucp_jax.restore_train_state(tmp_path / "c", blank)
  assert int(restored.step) == 1
  np.testing.assert_array_equal(
    restored.params["params"]["kernel"], state.params["params"]["kernel"]
  )
  np.testing.assert_array_equal(
    restored.opt_state[0].nu["params"]["bias"], state.opt_state[0].nu["params"]["bias"]
  )


def _converted_gpt(tmp_path, cfg, step=5):
  """A torch-named checkpoint in the converter's schema, made from a Flax GPT's state."""
  rules = ucp_jax.rules.gpt2(num_heads=cfg.num_heads)
  model = gpt.FlaxGPT(cfg, rngs=nnx.Rngs(3))
  torch_named = rules.export_arrays(nnx.state(model, nnx.Param))
  rng = np.random.default_rng(0)
  mu = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in torch_named.items()}
  nu = {k: np.abs(rng.standard_normal(v.shape)).astype(np.float32) for k, v in torch_named.items()}
  names = [k for k in torch_named if k != "lm_head.weight"]
  schema = {
    "version": 1,
    "naming": "torch",
    "params": {
      n: {
        "value": f"params/{n}",
        "slots": {"exp_avg": f"exp_avg/{n}", "exp_avg_sq": f"exp_avg_sq/{n}"},
        "group": 0,
        "frozen": False,
      }
      for n in names
    },
    "buffers": {},
    "optimizer": {
      "type": "adamw",
      "step": step,
      "groups": [{"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}],
    },
  }
  tree = {
    "params": {n: torch_named[n] for n in names},
    "exp_avg": {n: mu[n] for n in names},
    "exp_avg_sq": {n: nu[n] for n in names},
  }
  ucp_jax.save(tmp_path / "conv", tree, schema=schema, step=step)
  return rules, model, mu, nu


def test_restore_converted_torch_checkpoint_into_nnx_on_tensor_parallel_mesh(tmp_path):
  cfg = gpt.GPTConfig(vocab_size=32, max_len=8, num_layers=2, num_heads=4, d_model=16)
  rules, source, mu, nu = _converted_gpt(tmp_path, cfg)
  mesh = _mesh((2, 4), ("data", "model"))
  model = gpt.FlaxGPT(cfg, rngs=nnx.Rngs(9))
  opt = nnx.Optimizer(model, optax.adamw(1e-3, b2=0.99, weight_decay=0.1), wrt=nnx.Param)
  target = gpt.tp_state(nnx.state(model), mesh)
  nnx.update(
    model, jax.tree.map(lambda t: jax.device_put(np.zeros(t.shape, t.dtype), t.sharding), target)
  )
  ucp_jax.restore_train_state(tmp_path / "conv", model, opt, rules=rules)
  mu_kernel = opt.opt_state[0].mu["blocks"][0]["mlp"]["fc"]["kernel"][...]
  assert mu_kernel.sharding == model.blocks[0].mlp.fc.kernel[...].sharding  # slots follow params
  assert opt.opt_state[0].count[...].sharding.mesh == mesh  # counters replicated on the mesh
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)),
    jax.tree.leaves(nnx.state(source, nnx.Param)),
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
  assert int(opt.opt_state[0].count[...]) == 5 and int(opt.step[...]) == 5
  flax_mu = rules.import_arrays(mu)
  np.testing.assert_array_equal(
    np.asarray(opt.opt_state[0].mu["blocks"][1]["mlp"]["fc"]["kernel"][...]),
    flax_mu["blocks/1/mlp/fc/kernel"],
  )
  flax_nu = rules.import_arrays(nu)
  np.testing.assert_array_equal(
    np.asarray(opt.opt_state[0].nu["wte"]["embedding"][...]), flax_nu["wte/embedding"]
  )


def test_converted_checkpoint_problems_are_listed_at_once(tmp_path):
  cfg = gpt.GPTConfig(vocab_size=32, max_len=8, num_layers=2, num_heads=4, d_model=16)
  _converted_gpt(tmp_path, cfg)
  model = gpt.FlaxGPT(cfg, rngs=nnx.Rngs(9))
  opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  with pytest.raises(ucp_jax.MappingError, match="rules="):
    ucp_jax.restore_train_state(tmp_path / "conv", model, opt)
  bigger = gpt.FlaxGPT(
    gpt.GPTConfig(vocab_size=32, max_len=8, num_layers=3, num_heads=4, d_model=16), rngs=nnx.Rngs(0)
  )
  opt = nnx.Optimizer(bigger, optax.adamw(1e-3), wrt=nnx.Param)
  with pytest.raises(ucp_jax.MappingError) as e:
    ucp_jax.restore_train_state(
      tmp_path / "conv", bigger, opt, rules=ucp_jax.rules.gpt2(num_heads=4)
    )
  message = str(e.value)
  for subtree in ("params", "exp_avg", "exp_avg_sq"):
    assert f"blocks/2/mlp/fc/kernel: no `{subtree}` for it in the checkpoint" in message


def test_flax_train_state_exports_to_deepspeed_names_and_layouts(tmp_path):
  pytest.importorskip("torch")
  from ucp_jax.sources._torch_reader import _torch_file

  cfg = gpt.GPTConfig(vocab_size=32, max_len=8, num_layers=2, num_heads=4, d_model=16)
  rules = ucp_jax.rules.gpt2(num_heads=4)
  model = gpt.FlaxGPT(cfg, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adamw(1e-3, b2=0.99, weight_decay=0.1), wrt=nnx.Param)
  next_token_step()(model, opt, jax.random.randint(jax.random.key(0), (2, 8), 0, 32))
  hyper = {"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}
  ucp_jax.save_train_state(tmp_path / "jax", model, opt, hyperparams=hyper)
  with pytest.raises(ucp_jax.MappingError, match="rules="):
    ucp_jax.export(tmp_path / "jax", tmp_path / "ds", format="deepspeed")
  report = ucp_jax.export(tmp_path / "jax", tmp_path / "ds", rules=rules, format="deepspeed")
  assert report.step == 1 and report.tied == {"lm_head.weight": "wte.weight"}
  zero = tmp_path / "ds" / report.tag / "zero"
  torch_values = rules.export_arrays(nnx.state(model, nnx.Param))
  torch_mu = rules.export_arrays(opt.opt_state[0].mu)
  for name in ("h.1.mlp.fc.weight", "h.0.attn.qkv.weight", "wte.weight", "ln_f.bias"):
    np.testing.assert_array_equal(
      _torch_file.load(zero / name / "fp32.pt")["param"], torch_values[name]
    )
    np.testing.assert_array_equal(
      _torch_file.load(zero / name / "exp_avg.pt")["param"], torch_mu[name]
    )
  alias = _torch_file.load(zero / "lm_head.weight" / "fp32.pt")["param"]  # the tied alias
  np.testing.assert_array_equal(alias, torch_values["wte.weight"])
  from ucp_jax import cli

  assert (
    cli.main(
      [
        "export",
        "--format",
        "deepspeed",
        str(tmp_path / "jax"),
        str(tmp_path / "ds2"),
        "--rules",
        "gpt2:num_heads=4",
      ]
    )
    == 0
  )
  assert (tmp_path / "ds2" / report.tag / "zero" / "h.1.mlp.fc.weight" / "fp32.pt").exists()
  assert (
    cli.main(
      [
        "export",
        "--format",
        "deepspeed",
        str(tmp_path / "jax"),
        str(tmp_path / "ds3"),
        "--rules",
        "bert",
      ]
    )
    == 2
  )


def _saved_with(tmp_path, tx, name="c"):
  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  _train(model, opt, 2)
  ucp_jax.save_train_state(tmp_path / name, model, opt)
  return model, opt


def test_another_optimizers_state_is_refused_naming_both(tmp_path):
  model, _ = _saved_with(tmp_path, optax.adamw(1e-2), "adamw")
  _saved_with(tmp_path, optax.adabelief(1e-2), "adabelief")
  states = ucp_jax.open(tmp_path / "adamw").manifest.schema["optimizer"]["states"]
  assert states == {"optimizer/opt_state/0": "ScaleByAdamState"}
  for saved, tx, was, now in (
    ("adamw", optax.adabelief(1e-2), "ScaleByAdamState", "ScaleByBeliefState"),
    ("adabelief", optax.adamw(1e-2), "ScaleByBeliefState", "ScaleByAdamState"),
  ):
    fresh = MLP(nnx.Rngs(1))
    with pytest.raises(ucp_jax.MappingError) as e:
      ucp_jax.restore_train_state(tmp_path / saved, fresh, nnx.Optimizer(fresh, tx, wrt=nnx.Param))
    message = str(e.value)
    assert "not the one this checkpoint was saved with" in message and "params_only=True" in message
    assert f"optimizer/opt_state/0: optax {was}" in message and f"optax {now}" in message
  # states that several optimizers share restore into each other (said in docs/schema.md)
  fresh = MLP(nnx.Rngs(1))
  ucp_jax.restore_train_state(
    tmp_path / "adamw", fresh, nnx.Optimizer(fresh, optax.adam(1e-2), wrt=nnx.Param)
  )
  np.testing.assert_array_equal(fresh.fc1.kernel[...], model.fc1.kernel[...])


def test_params_only_restores_into_any_optimizer(tmp_path):
  model, _ = _saved_with(tmp_path, optax.adamw(1e-2))
  fresh = MLP(nnx.Rngs(1))
  opt = nnx.Optimizer(fresh, optax.lion(1e-3), wrt=nnx.Param)
  before = jax.tree.map(np.asarray, nnx.state(opt))
  ucp_jax.restore_train_state(tmp_path / "c", fresh, opt, params_only=True)
  np.testing.assert_array_equal(fresh.fc2.kernel[...], model.fc2.kernel[...])
  np.testing.assert_array_equal(fresh.norm.mean[...], model.norm.mean[...])  # buffers too
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(opt)), before)
  _train(fresh, opt, 1)  # the new optimizer trains on
  alone = MLP(nnx.Rngs(2))  # a model without its optimizer: the parameters only
  ucp_jax.restore_train_state(tmp_path / "c", alone)
  np.testing.assert_array_equal(alone.fc1.bias[...], model.fc1.bias[...])


def test_linen_params_only_keeps_the_new_optimizer(tmp_path):
  import flax.linen as nn
  from flax.training import train_state

  module = nn.Dense(4)
  params = module.init(jax.random.key(0), jnp.ones((1, 3)))
  state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=optax.adam(1e-2))
  state = state.apply_gradients(grads=jax.tree.map(jnp.ones_like, params))
  ucp_jax.save_train_state(tmp_path / "c", state)
  blank = train_state.TrainState.create(
    apply_fn=module.apply, params=jax.tree.map(jnp.zeros_like, params), tx=optax.adabelief(1e-3)
  )
  with pytest.raises(ucp_jax.MappingError, match="opt_state/0: optax ScaleByAdamState"):
    ucp_jax.restore_train_state(tmp_path / "c", blank)
  restored = ucp_jax.restore_train_state(tmp_path / "c", blank, params_only=True)
  np.testing.assert_array_equal(
    restored.params["params"]["kernel"], state.params["params"]["kernel"]
  )
  assert int(restored.step) == 0
  assert type(restored.opt_state[0]).__name__ == "ScaleByBeliefState"


def test_plain_optax_hyperparameters_are_read_from_the_optimizer(tmp_path):
  for tx, kind, group in (
    (optax.adamw(1e-3, weight_decay=0.05), "adamw", {"lr": 1e-3, "weight_decay": 0.05}),
    (optax.adam(3e-4, b1=0.8), "adam", {"lr": 3e-4, "betas": [0.8, 0.999], "eps": 1e-8}),
    (optax.sgd(0.1, momentum=0.9), "sgd", {"lr": 0.1, "momentum": 0.9}),
    (optax.adamw(optax.linear_schedule(1e-3, 0.0, 10)), "adamw", {"weight_decay": 1e-4}),
  ):
    model = MLP(nnx.Rngs(0))
    ucp_jax.save_train_state(
      tmp_path / kind, model, nnx.Optimizer(model, tx, wrt=nnx.Param), overwrite=True
    )
    optimizer = ucp_jax.open(tmp_path / kind).manifest.schema["optimizer"]
    assert optimizer["type"] == kind
    assert group.items() <= optimizer["groups"][0].items(), optimizer["groups"]
    if "lr" not in group:
      assert "lr" not in optimizer["groups"][0]  # a schedule is no number: not guessed


def test_a_linen_state_into_an_nnx_model_is_one_line_with_a_recipe(tmp_path):
  import flax.linen as nn
  from flax.training import train_state

  module = nn.Dense(4)
  params = module.init(jax.random.key(0), jnp.ones((1, 3)))
  state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=optax.adam(1e-2))
  ucp_jax.save_train_state(tmp_path / "linen", state)
  model = nnx.Linear(3, 4, rngs=nnx.Rngs(1))
  with pytest.raises(ucp_jax.TreeMismatchError) as e:
    ucp_jax.restore_train_state(
      tmp_path / "linen", model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    )
  message = str(e.value)
  assert (
    len(message.splitlines()) == 1 and "holds a Linen TrainState (keys under params/)" in message
  )
  restored = ucp_jax.restore(
    tmp_path / "linen", nnx.state(model, nnx.Param), subtree="params/params"
  )
  nnx.update(model, restored)  # the recipe the message gives
  np.testing.assert_array_equal(model.kernel[...], params["params"]["kernel"])


def test_a_mismatch_hints_what_restore_train_state_takes(tmp_path):
  _saved_with(tmp_path, optax.adamw(1e-2))
  other = nnx.Linear(8, 4, rngs=nnx.Rngs(0))  # another model: keys differ
  with pytest.raises(ucp_jax.TreeMismatchError) as e:
    ucp_jax.restore_train_state(
      tmp_path / "c", other, nnx.Optimizer(other, optax.adamw(1e-2), wrt=nnx.Param)
    )
  assert "partial=True" not in str(e.value) and "params_only=True" in str(e.value)
