"""Two param groups, DeepSpeed -> Flax NNX + Optax -> DeepSpeed, each group's state in place.

The DeepSpeed fixtures train with the usual split (scripts/make_deepspeed_fixtures.py):
group 0 holds the >=2-D weights (lr 0.01, weight_decay 0.1), group 1 the biases and LayerNorm
(lr 0.005, weight_decay 0). Here the converted z2_fp32_dp2 checkpoint restores into a Flax twin
of the fixture model whose optimizer is `optax.multi_transform` over two labels, declared in
the torch order and in the opposite one; one step in JAX and in torch AdamW must agree; the
save and export give DeepSpeed both groups with their own hyperparameters, and
`ucp_jax.deepspeed.finish_load` hands each engine group its own whatever the file's order.
"""

from __future__ import annotations

import importlib.util
import types

import ds_fixtures as F
import jax
import jax.numpy as jnp
import make_deepspeed_fixtures as mk
import numpy as np
import optax
import pytest
from flax import nnx

import ucp_jax
from ucp_jax import deepspeed as ucp_deepspeed
from ucp_jax.rules import Rule, RuleSet, transpose
from ucp_jax.tree import _tree

NAME = "z2_fp32_dp2"
META = F.info(NAME)
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")

RULES = RuleSet(
  [
    Rule(r"embed\.weight", "embed/embedding"),
    Rule(r"fc(\d)\.weight", "fc{0}/kernel", [transpose()]),
    Rule(r"fc(\d)\.bias", "fc{0}/bias"),
    Rule(r"ln\.weight", "ln/scale"),
    Rule(r"ln\.bias", "ln/bias"),
    Rule(r"gate", "gate"),
    Rule(r"scale", "scale"),
    Rule(r"head\.weight", "embed/embedding", tied=True),
  ]
)
TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("gate")))
# Label names per torch group. Optax numbers its groups by label, sorted: "decay" < "no_decay"
# keeps the torch order, "no_wd" < "wd" reverses it.
ORDERS = {"torch_order": ("decay", "no_decay"), "reversed": ("wd", "no_wd")}
HYPER = [  # per torch group
  {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1},
  {"lr": 0.005, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0},
]
TORCH_GROUPS = [g["names"] for g in META["param_groups"]]
FLAX_GROUPS = [list(RULES.map_names(names)) for names in TORCH_GROUPS]


class Tiny(nnx.Module):
  """The fixture model in Flax: tied embedding/head, frozen `gate`, buffer `scale`."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(mk.VOCAB, mk.DIM, rngs=rngs)
    self.fc1 = nnx.Linear(mk.DIM, mk.HIDDEN, rngs=rngs)
    self.ln = nnx.LayerNorm(mk.HIDDEN, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
    self.fc2 = nnx.Linear(mk.HIDDEN, mk.DIM, rngs=rngs)
    self.gate = nnx.Param(jnp.zeros(mk.HIDDEN))  # frozen: not in the optimizer
    self.scale = nnx.Variable(jnp.zeros(mk.DIM))  # a buffer

  def __call__(self, ids):
    h = self.embed(ids) * self.scale[...]
    h = self.fc1(h) * self.gate[...]
    h = self.ln(jax.nn.gelu(h, approximate=False))
    return self.embed.attend(self.fc2(h))


def _tx(labels: tuple[str, str], label_of=None):
  """AdamW with decay for the first label, Adam for the second, as torch's two groups."""
  decay, no_decay = labels
  b1, b2 = HYPER[0]["betas"]
  label_of = label_of or (lambda key: decay if key in FLAX_GROUPS[0] else no_decay)
  return optax.multi_transform(
    {
      decay: optax.adamw(HYPER[0]["lr"], b1, b2, HYPER[0]["eps"], weight_decay=0.1),
      no_decay: optax.adam(HYPER[1]["lr"], b1, b2, HYPER[1]["eps"]),
    },
    lambda params: nnx.map_state(lambda path, _: label_of("/".join(map(str, path))), params),
  )


def _restored(converted, labels, label_of=None):
  model = Tiny(nnx.Rngs(0))
  opt = nnx.Optimizer(model, _tx(labels, label_of), wrt=TRAINABLE)
  ucp_jax.restore_train_state(converted, model, opt, rules=RULES)
  return model, opt


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  return ucp_jax.convert(F.FIXTURES / NAME / "ckpt", tmp_path_factory.mktemp("pg") / "c").dst


@pytest.fixture(scope="module")
def expected():
  """DeepSpeed's own universal files (ds_to_universal) in Flax keys and layouts."""
  tree, _ = F.fixture_state(NAME)
  out = {role: RULES.import_arrays(tree[role]) for role in ("params", "exp_avg", "exp_avg_sq")}
  out["buffers"] = RULES.import_arrays(tree["buffers"])
  return out


def _flat(state) -> dict[str, np.ndarray]:
  return {k: np.asarray(v) for k, v in _tree.flatten(state)[0].items()}


def _np(x) -> np.ndarray:
  return np.asarray(x[...] if isinstance(x, nnx.Variable) else x)


@pytest.mark.parametrize("order", list(ORDERS))
def test_each_groups_moments_land_in_its_optax_state(converted, expected, order):
  labels = ORDERS[order]
  model, opt = _restored(converted, labels)
  for label, keys in zip(labels, FLAX_GROUPS):
    adam = opt.opt_state.inner_states[label].inner_state[0]
    assert int(adam.count[...]) == 3
    mu, nu = _flat(adam.mu), _flat(adam.nu)
    assert sorted(mu) == sorted(nu) == sorted(keys)
    for key in keys:
      np.testing.assert_array_equal(mu[key], expected["exp_avg"][key], err_msg=key)
      np.testing.assert_array_equal(nu[key], expected["exp_avg_sq"][key], err_msg=key)
  assert int(opt.step[...]) == 3
  for key, value in _flat(nnx.state(model, nnx.Param)).items():
    np.testing.assert_array_equal(value, expected["params"][key], err_msg=key)
  np.testing.assert_array_equal(_np(model.scale), expected["buffers"]["scale"])


def test_optax_groups_other_than_the_checkpoints_are_refused(converted):
  # fc1's bias labelled with the weights: its torch group trains without weight decay.
  label_of = lambda key: "decay" if key in FLAX_GROUPS[0] or key == "fc1/bias" else "no_decay"  # noqa: E731
  with pytest.raises(ucp_jax.MappingError) as e:
    _restored(converted, ORDERS["torch_order"], label_of)
  assert str(e.value).endswith(
    "cannot restore this training state:\n"
    "  optimizer group 0 (`optimizer/opt_state/inner_states/decay/inner_state/0`) holds "
    "parameters of several checkpoint groups (each Optax group must hold exactly one checkpoint "
    "group's, in any order): checkpoint group 0 (lr 0.01, weight_decay 0.1): "
    "embed/embedding, fc1/kernel, fc2/kernel; checkpoint group 1 (lr 0.005, weight_decay 0.0): "
    "fc1/bias"
  )
  three = lambda key: "decay" if key in FLAX_GROUPS[0] else "ln" if "ln" in key else "no_decay"  # noqa: E731
  model = Tiny(nnx.Rngs(0))
  tx = optax.multi_transform(
    {k: optax.adam(1e-3) for k in ("decay", "no_decay", "ln")},
    lambda p: nnx.map_state(lambda path, _: three("/".join(map(str, path))), p),
  )
  opt = nnx.Optimizer(model, tx, wrt=TRAINABLE)
  with pytest.raises(ucp_jax.MappingError, match="the optimizer has 3 parameter groups, the che"):
    ucp_jax.restore_train_state(converted, model, opt, rules=RULES)


def test_one_optax_state_may_hold_both_groups(converted, expected):
  """A masked AdamW (one Adam state, decay by mask) is the other usual way to split."""
  model = Tiny(nnx.Rngs(0))
  mask = lambda p: nnx.map_state(lambda path, _: "/".join(map(str, path)) in FLAX_GROUPS[0], p)  # noqa: E731
  opt = nnx.Optimizer(model, optax.adamw(1e-2, 0.9, 0.99, mask=mask), wrt=TRAINABLE)
  ucp_jax.restore_train_state(converted, model, opt, rules=RULES)
  np.testing.assert_array_equal(
    _np(opt.opt_state[0].mu["ln"]["bias"]), expected["exp_avg"]["ln/bias"]
  )
  assert int(opt.opt_state[0].count[...]) == 3


def _jax_step(model, opt, ids, targets) -> float:
  def loss_fn(m):
    logits = m(jnp.asarray(ids))
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(targets)).mean()

  loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, TRAINABLE))(model)
  opt.update(model, grads)
  return float(loss)


def _torch_step(ids, targets):
  """torch AdamW, the fixture's two groups, from DeepSpeed's own universal state: one step."""
  import torch

  tree, schema = F.fixture_state(NAME)
  model = mk._build_model()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(torch.from_numpy(tree["params"][name]))
    model.scale.copy_(torch.from_numpy(tree["buffers"]["scale"]))
  params = dict(model.named_parameters())
  groups = [
    {"params": [params[n] for n in names], "lr": h["lr"], "weight_decay": h["weight_decay"]}
    for names, h in zip(TORCH_GROUPS, HYPER)
  ]
  opt = torch.optim.AdamW(groups, betas=tuple(HYPER[0]["betas"]), eps=HYPER[0]["eps"])
  for name in (n for names in TORCH_GROUPS for n in names):
    opt.state[params[name]] = {
      "step": torch.tensor(float(schema["optimizer"]["step"])),
      "exp_avg": torch.from_numpy(tree["exp_avg"][name].copy()),
      "exp_avg_sq": torch.from_numpy(tree["exp_avg_sq"][name].copy()),
    }
  logits = model(torch.from_numpy(ids))
  loss = torch.nn.functional.cross_entropy(
    logits.reshape(-1, mk.VOCAB), torch.from_numpy(targets).reshape(-1)
  )
  loss.backward()
  opt.step()
  state = {
    n: {k: v.numpy() for k, v in opt.state[params[n]].items()}
    for n in params
    if params[n].requires_grad
  }
  return float(loss.detach()), {n: p.detach().numpy() for n, p in params.items()}, state


def _batch():
  ids, targets = mk._batch(0, mk.STEPS)  # what rank 0 would have trained on next
  return ids.numpy(), targets.numpy()


@needs_torch
@pytest.mark.parametrize("order", list(ORDERS))
def test_one_step_agrees_with_torch_adamw(converted, order):
  ids, targets = _batch()
  model, opt = _restored(converted, ORDERS[order])
  jax_loss = _jax_step(model, opt, ids, targets)
  torch_loss, torch_params, torch_state = _torch_step(ids, targets)
  assert jax_loss == pytest.approx(torch_loss, rel=1e-6)
  ours = RULES.export_arrays(nnx.state(model, nnx.Param))
  for name, value in torch_params.items():
    np.testing.assert_allclose(ours[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  for label, names in zip(ORDERS[order], TORCH_GROUPS):
    adam = opt.opt_state.inner_states[label].inner_state[0]
    mu = RULES.export_arrays(adam.mu)
    for name in names:
      np.testing.assert_allclose(mu[name], torch_state[name]["exp_avg"], rtol=1e-5, atol=1e-7)
    assert int(adam.count[...]) == 4


def _export(converted, order, tmp_path):
  """Restore, one JAX step, save (hyperparameters in Optax's group order), export."""
  labels = ORDERS[order]
  model, opt = _restored(converted, labels)
  _jax_step(model, opt, *_batch())
  by_label = dict(zip(labels, HYPER))
  hyper = [by_label[label] for label in sorted(labels)]  # Optax's group order: labels sorted
  ucp_jax.save_train_state(tmp_path / "jax", model, opt, hyperparams=hyper)
  report = ucp_jax.export(tmp_path / "jax", tmp_path / "ds", rules=RULES, format="deepspeed")
  return model, opt, report


@needs_torch
@pytest.mark.parametrize("order", list(ORDERS))
def test_save_and_export_give_deepspeed_both_groups(converted, tmp_path, order):
  model, opt, report = _export(converted, order, tmp_path)
  schema = ucp_jax.open(tmp_path / "jax").manifest.schema
  optax_group = [0, 1] if order == "torch_order" else [1, 0]  # per torch group
  for torch_group, keys in enumerate(FLAX_GROUPS):
    assert {schema["params"][k]["group"] for k in keys} == {optax_group[torch_group]}
    assert schema["optimizer"]["groups"][optax_group[torch_group]] == HYPER[torch_group]
  assert schema["params"]["gate"]["frozen"] and schema["buffers"] == {"scale": "model/scale"}

  root = tmp_path / "ds" / report.tag
  assert report.step == 4 and report.frozen == ("gate",) and report.buffers == ("scale",)
  assert report.tied == {"head.weight": "embed.weight"}
  optim = F.load_pt(root / "zero" / "optimizer_state.pt")
  states = F.load_pt(root / "mp_rank_00_model_states.pt")
  # What DeepSpeed reads: param_groups[i]'s hyperparameters for its group i, whose members
  # the model states' param_shapes[i] name (ds_to_universal writes the same two keys).
  ds_own = F.load_pt(F.FIXTURES / NAME / "universal" / "zero" / "optimizer_state.pt")
  own = {tuple(sorted(names)): g for names, g in zip(TORCH_GROUPS, ds_own["param_groups"])}
  assert len(optim["param_groups"]) == len(states["param_shapes"]) == 2
  for group, shapes in zip(optim["param_groups"], states["param_shapes"]):
    theirs = own[tuple(sorted(shapes))]
    for key in ("lr", "weight_decay", "betas", "eps"):
      assert group[key] == pytest.approx(theirs[key]), key
  order_written = [sorted(s) for s in states["param_shapes"]]
  torch_sorted = [sorted(n) for n in TORCH_GROUPS]
  assert order_written == (torch_sorted if order == "torch_order" else torch_sorted[::-1])
  zero3 = optim["optimizer_state_dict"]["param_groups"][0]  # only what both groups share
  assert "lr" not in zero3 and "weight_decay" not in zero3 and zero3["eps"] == 1e-8
  # every value and slot is the JAX state, in torch names and layouts
  values = RULES.export_arrays(nnx.state(model, nnx.Param))
  for label, names in zip(ORDERS[order], TORCH_GROUPS):
    adam = opt.opt_state.inner_states[label].inner_state[0]
    slots = {"exp_avg": RULES.export_arrays(adam.mu), "exp_avg_sq": RULES.export_arrays(adam.nu)}
    for name in names:
      np.testing.assert_array_equal(
        F.load_pt(root / "zero" / name / "fp32.pt")["param"], values[name]
      )
      for slot, arrays in slots.items():
        np.testing.assert_array_equal(
          F.load_pt(root / "zero" / name / f"{slot}.pt")["param"], arrays[name]
        )
      assert float(F.load_pt(root / "zero" / name / "step.pt")) == 4.0
  np.testing.assert_array_equal(states["module"]["gate"], values["gate"])
  np.testing.assert_array_equal(states["module"]["scale"], _np(model.scale))


def test_finish_load_matches_groups_by_their_parameters():
  """DeepSpeed applies param_groups[i] to its group i; finish_load goes by membership."""
  a, b, c = object(), object(), object()
  saved = [{"lr": 0.005, "params": [0]}, {"lr": 0.01, "params": [1]}]
  live = [{"lr": 0.005}, {"lr": 0.01}]  # what DeepSpeed's by-position load left
  engine = types.SimpleNamespace(
    param_names={a: "w1", b: "w2", c: "b1"},
    zero_optimization_partition_weights=lambda: False,
    optimizer=types.SimpleNamespace(
      bit16_groups=[[a, b], [c]], optimizer=types.SimpleNamespace(param_groups=live)
    ),
  )
  shapes = [{"b1": (3,)}, {"w1": (2, 3), "w2": (3, 3)}]
  assert ucp_deepspeed._matching_groups(engine, saved, shapes) == saved[::-1]
  assert ucp_deepspeed._matching_groups(engine, saved, None) == saved  # unknown: by position
  with pytest.raises(ValueError) as e:
    ucp_deepspeed._matching_groups(engine, saved, [{"b1": (3,), "w2": (3, 3)}, {"w1": (2, 3)}])
  assert str(e.value) == (
    "the engine's param groups are not the checkpoint's (each must hold exactly the parameters "
    "of one checkpoint group, in any order):\n"
    "  engine group 0: w1, w2\n"
    "  engine group 1: b1\n"
    "  checkpoint group 0: b1, w2\n"
    "  checkpoint group 1: w1"
  )


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_live_deepspeed_continues_the_jax_run(converted, tmp_path):
  """The reversed export into the fixture's own engine (decay group first), ZeRO-2 and 3."""
  import deepspeed_live as L

  model, opt, report = _export(converted, "reversed", tmp_path)
  ids, targets = _batch()  # the batch the live step trains on (rank 0 at step 3), again
  loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(ids), targets).mean()  # noqa: E731
  loss = float(loss_fn(model))
  _jax_step(model, opt, ids, targets)
  loss_after = float(loss_fn(model))
  no_clip = {"gradient_clipping": 0.0}  # DeepSpeed 0.19.8 clips to norm 1.0 unless told not to
  z3 = {**no_clip, "zero_optimization": {"sub_group_size": 100}}
  jobs = [
    L.Job("z2", 2, str(tmp_path / "ds"), config=no_clip, perturb=True, finish=True),
    L.Job("z3", 3, str(tmp_path / "ds"), config=z3, perturb=True, finish=True),
  ]
  results = L.launch(1, jobs, tmp_path / "live")
  lr_wd = lambda groups: [(g["lr"], g["weight_decay"]) for g in groups]  # noqa: E731
  # DeepSpeed's ZeRO-2 load applies the file's groups by position: swapped before finish_load.
  assert lr_wd(results["z2"][0]["before_finish"]["param_groups"]) == [(0.005, 0.0), (0.01, 0.1)]
  exported = F.load_pt(tmp_path / "ds" / report.tag / "mp_rank_00_model_states.pt")
  for job in ("z2", "z3"):
    (dump,) = results[job]
    assert lr_wd(dump["param_groups"]) == [(0.01, 0.1), (0.005, 0.0)]
    assert dump["finished"] == ["gate", "scale"]
    for name, slots in dump["logical"].items():
      for slot, value in slots.items():
        stored = F.load_pt(tmp_path / "ds" / report.tag / "zero" / name / f"{slot}.pt")["param"]
        np.testing.assert_array_equal(value.numpy(), stored, err_msg=f"{job} {name} {slot}")
    assert {float(s["step"]) for s in dump["raw"]["state"]} == {4.0}
    np.testing.assert_array_equal(dump["module"]["scale"].numpy(), exported["module"]["scale"])
    (ds_loss, _), (ds_after, _) = dump["train"]["loss"], dump["train"]["loss_after"]
    assert ds_loss == pytest.approx(loss, rel=1e-6)
    assert ds_after == pytest.approx(loss_after, rel=1e-5)
