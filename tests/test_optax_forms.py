"""Training states as users write them: Optax and Flax forms x meshes x NNX and Linen.

Each form of `optax_forms.FORMS` (adamw, adam, sgd with momentum or nesterov, chains with
clipping, weight decay, schedules, `inject_hyperparams`, `multi_transform` labels from a
callable, `nnx.map_state` or a pytree, frozen parameters by `set_to_zero`, `optax.masked` or
`nnx.Optimizer(wrt=...)`, `MultiSteps`, an EMA tree, and optimizers DeepSpeed has no names
for) goes through the legs that apply to it:

- a converted DeepSpeed checkpoint (z2_fp32_dp2; an SGD twin of it) restores, and one step
  equals torch's from the same state (loss and parameters within 1e-5);
- a JAX save restores onto another mesh (one device <-> 2x4) with every leaf identical, and
  training continues the same;
- the DeepSpeed export holds the JAX state in torch names, and torch's step from the exported
  files equals JAX's next step (live DeepSpeed continuing: the slow test at the end);
- forms with no DeepSpeed equivalent: the restore and the export name the Optax state.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import ds_fixtures as F
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from optax_forms import (
  FORMS,
  JAX_ONLY_FORMS,
  NAME,
  RULES,
  RUNS,
  TORCH_FORMS,
  TRAINABLE,
  Tiny,
  TPTiny,
  mesh_of,
  mk,
  torch_params,
  torch_step,
)

import ucp_jax
from ucp_jax.tree import _tree

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
SGD_HYPER = {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  return ucp_jax.convert(F.FIXTURES / NAME / "ckpt", tmp_path_factory.mktemp("forms") / "c").dst


@pytest.fixture(scope="module")
def converted_sgd(tmp_path_factory):
  """The fixture's state as a torch SGD checkpoint would convert: `momentum_buffer` slots."""
  tree, schema = F.fixture_state(NAME)
  tree["momentum_buffer"] = tree.pop("exp_avg")
  del tree["exp_avg_sq"]
  for entry in schema["params"].values():
    if entry.get("slots"):
      entry["slots"] = {"momentum_buffer": entry["value"].replace("params/", "momentum_buffer/")}
  schema["optimizer"].update(type="sgd", groups=[SGD_HYPER, SGD_HYPER])
  return ucp_jax.save(tmp_path_factory.mktemp("forms") / "sgd", tree, schema=schema, step=3)


def _oracle_state(sgd: bool):
  """The fixture's state in torch names: (values with gate and scale, slots, step)."""
  tree, schema = F.fixture_state(NAME)
  values = {**tree["params"], **tree["buffers"]}
  slots = (
    {"momentum_buffer": tree["exp_avg"]}
    if sgd
    else {
      "exp_avg": tree["exp_avg"],
      "exp_avg_sq": tree["exp_avg_sq"],
    }
  )
  return values, slots, schema["optimizer"]["step"]


@functools.cache
def _batch(step: int = mk.STEPS):
  """What rank 0 of the fixture run trains on at `step` (3: the step after the checkpoint)."""
  ids, targets = mk._batch(0, step)
  return ids.numpy(), targets.numpy()


def _jax_step(run, ids, targets) -> float:
  """One optimizer step: `micro` mini-steps on the same batch for optax.MultiSteps."""
  losses = [run.step(ids, targets) for _ in range(run.form.torch.micro if run.form.torch else 1)]
  return losses[0]


def _max_diff(ours: dict, theirs: dict) -> float:
  return max(float(np.max(np.abs(np.asarray(ours[n]) - theirs[n]))) for n in theirs)


def _placeholders(tree) -> dict[str, str]:
  """Keys of the MaskedNode placeholders (NNX wraps them in variables) and abstract leaves."""
  flat, _ = _tree.flatten(tree)
  return {
    k: type(v).__name__
    for k, v in flat.items()
    if isinstance(v, (optax.MaskedNode, jax.ShapeDtypeStruct))
  }


def _counts(run) -> set[int]:
  """Every step counter in the optimizer state (count, gradient_step)."""
  flat, _ = _tree.flatten(run.opt_state)
  return {int(v) for k, v in flat.items() if k.split("/")[-1] in ("count", "gradient_step")}


# NNX goes from the 2x4 mesh to one device, Linen the other way; the swapped directions, and
# the forms whose state a fast one already covers, run with the slow tests.
DIRECTIONS = {"nnx": ("2x4", "1"), "linen": ("1", "2x4")}
FAST = {
  "nnx": {"frozen_set_to_zero", "labels_callable_wrt", "inject_hyperparams", "multi_steps"},
  "linen": {"labels_pytree", "ema_tree"},
}
FAST["nnx"] |= {"sgd_nesterov", "lion"}


def _layouts(names: list[str]) -> list:
  out = []
  for name in names:
    for framework, (a, b) in DIRECTIONS.items():
      for meshes, fast in (((a, b), name in FAST[framework]), ((b, a), False)):
        out.append(
          pytest.param(
            name,
            framework,
            *meshes,
            marks=[] if fast else [pytest.mark.slow],
            id=f"{name}-{framework}-{meshes[0]}-{meshes[1]}",
          )
        )
  return out


def _same_state(a, b) -> None:
  fa, _ = _tree.flatten(a.tree)
  fb, _ = _tree.flatten(b.tree)
  assert fa.keys() == fb.keys()
  for key, value in fa.items():
    if isinstance(value, optax.MaskedNode):
      assert isinstance(fb[key], optax.MaskedNode), key
    else:
      np.testing.assert_array_equal(np.asarray(fb[key]), np.asarray(value), err_msg=key)


def _exported_state(root, names, scale):
  """(values, slots, step) that DeepSpeed's universal load reads from an export (torch names)."""
  zero = root / "zero"
  states = F.load_pt(root / "mp_rank_00_model_states.pt")
  values = {n: np.asarray(F.load_pt(zero / n / "fp32.pt")["param"]) for n in names}
  values["gate"] = np.asarray(states["module"]["gate"])
  values["scale"] = np.asarray(states["module"].get("scale", scale))
  slots: dict[str, dict] = {}
  for n in names:
    for file in (zero / n).iterdir():
      if file.stem not in ("fp32", "step"):
        slots.setdefault(file.stem, {})[n] = np.asarray(F.load_pt(file)["param"])
  steps = {float(F.load_pt(zero / n / "step.pt")) for n in names}
  assert len(steps) == 1
  return values, slots, steps.pop()


def _export(run, path, dst, sgd: bool):
  """Saves `run` (hyperparameters for each of its groups) and exports it to DeepSpeed."""
  groups = ucp_jax.open(run.save(path)).manifest.schema["optimizer"]["groups"]
  hyper = [SGD_HYPER if sgd else {"lr": 0.01}] * len(groups)
  run.save(path, hyperparams=hyper, overwrite=True)
  return ucp_jax.export(path, dst, rules=RULES, format="deepspeed")


TRAINABLE_NAMES = [n for group in F.info(NAME)["param_groups"] for n in group["names"]]


@needs_torch
@pytest.mark.parametrize(("name", "framework", "mesh_a", "mesh_b"), _layouts(TORCH_FORMS))
def test_deepspeed_in_jax_across_meshes_and_out(
  tmp_path, converted, converted_sgd, name, framework, mesh_a, mesh_b
):
  form = FORMS[name]
  sgd, micro = form.torch.optimizer == "SGD", form.torch.micro
  # 1. The converted DeepSpeed checkpoint restores; one step equals torch's.
  a = RUNS[framework](form, mesh_of(mesh_a), seed=7)
  holes = _placeholders(a.tree)
  a.restore(converted_sgd if sgd else converted, rules=RULES)
  assert _placeholders(a.tree) == holes  # MaskedNodes where optax put them, nothing abstract
  assert _counts(a) <= {3}
  values, slots, step = _oracle_state(sgd)
  assert _max_diff(torch_params(a), {n: values[n] for n in [*TRAINABLE_NAMES, "gate"]}) == 0.0
  ids, targets = _batch()
  loss = _jax_step(a, ids, targets)
  torch_loss, torch_after = torch_step(form, values, slots, step, ids, targets)
  assert abs(loss - torch_loss) <= 1e-5 * abs(torch_loss)
  assert _max_diff(torch_params(a), torch_after) <= 1e-5
  # 2. A JAX save (MultiSteps: one mini-step into the next step) restores onto the other mesh.
  for _ in range(micro - 1):
    a.step(*_batch(4))
  a.save(tmp_path / "a")
  if micro > 1:  # mid-accumulation: the export says what it leaves out
    pending = _export(a, tmp_path / "pending", tmp_path / "ds_pending", sgd)
    assert "(1 pending mini-step(s))" in pending.notes[-1]
  b = RUNS[framework](form, mesh_of(mesh_b), seed=1)
  b.restore(tmp_path / "a")
  _same_state(a, b)
  assert np.isclose(a.step(*_batch(4)), b.step(*_batch(4)), rtol=1e-6, atol=0)
  assert _max_diff(b.params(), a.params()) <= 1e-6
  # 3. The export holds the JAX state in torch names; torch's step from it equals JAX's.
  report = _export(b, tmp_path / "b", tmp_path / "ds", sgd)
  root = tmp_path / "ds" / report.tag
  values, slots, step = _exported_state(root, TRAINABLE_NAMES, F.buffer_value(NAME, "scale"))
  assert step == 5 and sorted(slots) == (["momentum_buffer"] if sgd else ["exp_avg", "exp_avg_sq"])
  assert _max_diff(torch_params(b), {n: values[n] for n in [*TRAINABLE_NAMES, "gate"]}) == 0.0
  ids, targets = _batch(5)
  loss = _jax_step(b, ids, targets)
  torch_loss, torch_after = torch_step(form, values, slots, step, ids, targets)
  assert abs(loss - torch_loss) <= 1e-5 * abs(torch_loss)
  assert _max_diff(torch_params(b), torch_after) <= 1e-5
  if form.ema_tree:
    where = "optimizer/ema" if framework == "nnx" else "ema_params"
    assert any(note.startswith(f"`{where}`") for note in report.notes), report.notes


JAX_ONLY_STATES = {
  "lion": "ScaleByLionState: mu",
  "adafactor": "FactoredState: v_row, v_col, v",
  "muon": "MuonState: mu",
  "ema": "EmaState: ema",
}


@pytest.mark.parametrize(("name", "framework", "mesh_a", "mesh_b"), _layouts(JAX_ONLY_FORMS))
def test_state_deepspeed_has_no_names_for_moves_between_meshes(
  tmp_path, converted, name, framework, mesh_a, mesh_b
):
  a = RUNS[framework](FORMS[name], mesh_of(mesh_a))
  with pytest.raises(ucp_jax.MappingError) as e:
    a.restore(converted, rules=RULES)
  message = str(e.value)
  assert f"(optax {JAX_ONLY_STATES[name]} of " in message and "MaskedNode" not in message
  for i in range(2):
    a.step(*_batch(i))
  a.save(tmp_path / "a", hyperparams={"lr": 1e-3})
  b = RUNS[framework](FORMS[name], mesh_of(mesh_b), seed=1)
  b.restore(tmp_path / "a")
  _same_state(a, b)
  assert np.isclose(a.step(*_batch(2)), b.step(*_batch(2)), rtol=1e-6, atol=0)
  assert _max_diff(b.params(), a.params()) <= 1e-6
  pytest.importorskip("torch")
  with pytest.raises(ucp_jax.MappingError) as e:
    ucp_jax.export(tmp_path / "a", tmp_path / "ds", rules=RULES, format="deepspeed")
  assert f"(optax {JAX_ONLY_STATES[name]} of " in str(e.value)
  assert not (tmp_path / "ds").exists()


def _abstract(mesh, form):
  """An NNX model and optimizer from `nnx.eval_shape`: shardings on an AbstractMesh."""
  with jax.set_mesh(mesh):
    model = nnx.eval_shape(lambda: TPTiny(nnx.Rngs(0)))
    wrt = TRAINABLE if form.wrt else nnx.Param
    opt = nnx.eval_shape(lambda: nnx.Optimizer(TPTiny(nnx.Rngs(0)), form.tx(False, None), wrt=wrt))
  return model, opt


@needs_torch
def test_abstract_target_restores_on_the_current_mesh(tmp_path, converted):
  """`nnx.eval_shape` targets: placed on `jax.set_mesh`'s mesh, from DeepSpeed and from JAX."""
  form, mesh = FORMS["labels_map_state"], mesh_of("2x4")
  model, opt = _abstract(mesh, form)
  assert isinstance(model.fc1.kernel.get_value().sharding.mesh, jax.sharding.AbstractMesh)
  with jax.set_mesh(mesh):
    ucp_jax.restore_train_state(converted, model, opt, rules=RULES)
  assert model.fc1.kernel[...].sharding == NamedSharding(mesh, P("model", None))
  counts = opt.opt_state.inner_states["decay"].inner_state[0].count[...]
  assert isinstance(counts, jax.Array) and int(counts) == 3 and int(opt.step[...]) == 3
  assert (
    "ShapeDtypeStruct" not in _placeholders({"m": nnx.state(model), "o": nnx.state(opt)}).values()
  )
  run = RUNS["nnx"](form, mesh)  # its step function, on the restored objects
  run.model, run.opt = model, opt
  values, slots, step = _oracle_state(False)
  ids, targets = _batch()
  loss = run.step(ids, targets)
  torch_loss, torch_after = torch_step(form, values, slots, step, ids, targets)
  assert abs(loss - torch_loss) <= 1e-5 * abs(torch_loss)
  assert _max_diff(torch_params(run), torch_after) <= 1e-5
  ucp_jax.save_train_state(tmp_path / "jax", model, opt)
  again, again_opt = _abstract(mesh, form)
  with jax.set_mesh(mesh):
    ucp_jax.restore_train_state(tmp_path / "jax", again, again_opt)
  run_again = RUNS["nnx"](form, mesh)
  run_again.model, run_again.opt = again, again_opt
  _same_state(run, run_again)


def test_abstract_target_needs_a_mesh_of_its_axes(tmp_path, converted):
  form = FORMS["labels_map_state"]
  model, opt = _abstract(mesh_of("2x4"), form)
  with pytest.raises(ucp_jax.ShardingError) as e:
    ucp_jax.restore_train_state(converted, model, opt, rules=RULES)
  assert str(e.value) == (
    "the target is sharded on (data=2, model=4), an AbstractMesh (nnx.eval_shape builds one), "
    "which no device holds; pass mesh=... or restore inside `with jax.set_mesh(mesh):`"
  )
  other = jax.make_mesh((4, 2), ("data", "model"), (AxisType.Auto,) * 2)
  with jax.set_mesh(other), pytest.raises(ucp_jax.ShardingError) as e:
    ucp_jax.restore_train_state(converted, model, opt, rules=RULES)
  assert str(e.value) == (
    "the target is sharded on (data=2, model=4), the mesh to place it on is (data=4, model=2): "
    "axis names and sizes must match"
  )


@needs_torch
def test_abstract_target_takes_other_optimizer_leaves_from_a_fresh_init(converted):
  """`inject_hyperparams` leaves torch has no name for (`eps_root`): a fresh `tx.init`'s."""
  form = FORMS["inject_hyperparams"]
  model = nnx.eval_shape(lambda: Tiny(nnx.Rngs(0)))
  opt = nnx.eval_shape(
    lambda: nnx.Optimizer(Tiny(nnx.Rngs(0)), form.tx(False, None), wrt=nnx.Param)
  )
  ucp_jax.restore_train_state(converted, model, opt, rules=RULES)
  hyper = {
    label: {
      k: float(v[...]) for k, v in opt.opt_state.inner_states[label].inner_state.hyperparams.items()
    }
    for label in ("decay", "no_decay")
  }
  assert hyper["decay"] == pytest.approx(
    {
      "learning_rate": 0.01,
      "b1": 0.9,
      "b2": 0.99,
      "eps": 1e-8,
      "eps_root": 0.0,
      "weight_decay": 0.1,
    }
  )
  assert hyper["no_decay"] == pytest.approx(
    {"learning_rate": 0.005, "b1": 0.9, "b2": 0.99, "eps": 1e-8, "eps_root": 0.0}
  )
  assert (
    "ShapeDtypeStruct" not in _placeholders({"m": nnx.state(model), "o": nnx.state(opt)}).values()
  )
  run = RUNS["nnx"](form, None)
  run.model, run.opt = model, opt
  values, slots, step = _oracle_state(False)
  ids, targets = _batch()
  loss = run.step(ids, targets)
  torch_loss, torch_after = torch_step(form, values, slots, step, ids, targets)
  assert abs(loss - torch_loss) <= 1e-5 * abs(torch_loss)
  assert _max_diff(torch_params(run), torch_after) <= 1e-5


ADAM, SGD = {"exp_avg", "exp_avg_sq"}, {"momentum_buffer"}
SCHEMAS = {  # form -> (slots of fc1/kernel, number of groups, jax_only forms)
  "adamw": (ADAM, 1, []),
  "adam": (ADAM, 1, []),
  "clip_adamw": (ADAM, 1, []),
  "decayed_weights_adam": (ADAM, 1, []),
  "schedule": (ADAM, 1, []),
  "inject_hyperparams": (ADAM, 2, []),
  "labels_callable_wrt": (ADAM, 2, []),
  "frozen_set_to_zero": (ADAM, 2, []),
  "labels_map_state": (ADAM, 2, []),
  "labels_pytree": (ADAM, 2, []),
  "frozen_masked": (ADAM, 1, []),
  "multi_steps": (ADAM, 2, ["MultiStepsState"]),
  "sgd_momentum": (SGD, 1, []),
  "sgd_nesterov": (SGD, 1, []),
  "ema_tree": (ADAM, 1, ["not optimizer state"]),
  "lion": (set(), 1, ["ScaleByLionState"]),
  "adafactor": (set(), 1, ["FactoredState"]),
  "muon": (set(), 2, ["MuonState"]),
  "ema": (ADAM, 1, ["EmaState"]),
}


@pytest.mark.parametrize("framework", ["nnx", "linen"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_of_every_form(tmp_path, name, framework):
  slots, groups, jax_only = SCHEMAS[name]
  schema = ucp_jax.open(RUNS[framework](FORMS[name], None).save(tmp_path / "c")).manifest.schema
  params = schema["params"]
  assert set(params["fc1/kernel"]["slots"]) == slots
  assert params["gate"] == {
    "value": params["gate"]["value"],
    "slots": {},
    "group": None,
    "frozen": True,
    "tied_to": None,
  }
  assert not any(p["frozen"] for k, p in params.items() if k != "gate")
  assert len(schema["optimizer"]["groups"]) == groups and schema["optimizer"]["step"] == 0
  assert {p["group"] for k, p in params.items() if k != "gate"} == set(range(groups))
  assert [j["form"] for j in schema["optimizer"].get("jax_only", [])] == jax_only
  assert "MaskedNode" not in str(schema)


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_live_deepspeed_continues_exported_forms(tmp_path, converted):
  """Exports of JAX states in three forms: DeepSpeed (ZeRO-2, the fixture's engine) continues."""
  import deepspeed_live as L

  hyper = [  # per Optax group: `decay`, `no_decay` (labels sorted: the torch order)
    {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1},
    {"lr": 0.005, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0},
  ]
  cases = {"inject_hyperparams": "nnx", "labels_pytree": "nnx", "multi_steps": "linen"}
  expected, jobs = {}, []
  ids, targets = _batch()  # the batch the live step trains on (rank 0 at step 3), again
  for name, framework in cases.items():
    run = RUNS[framework](FORMS[name], None, seed=5)
    run.restore(converted, rules=RULES)
    _jax_step(run, ids, targets)
    run.save(tmp_path / name, hyperparams=hyper)
    ucp_jax.export(tmp_path / name, tmp_path / f"ds_{name}", rules=RULES, format="deepspeed")
    loss = run.loss(ids, targets)
    _jax_step(run, ids, targets)
    expected[name] = (loss, run.loss(ids, targets))
    # Linen's `scale` is a constant, not exported: the engine keeps its own (the same values).
    config = {"gradient_clipping": 0.0}
    job = L.Job(name, 2, str(tmp_path / f"ds_{name}"), config=config, finish=True)
    job.perturb = framework == "nnx"
    jobs.append(job)
  results = L.launch(1, jobs, tmp_path / "live")
  for name, (loss, after) in expected.items():
    (dump,) = results[name]
    assert [(g["lr"], g["weight_decay"]) for g in dump["param_groups"]] == [
      (0.01, 0.1),
      (0.005, 0.0),
    ]
    assert dump["finished"] == (["gate", "scale"] if cases[name] == "nnx" else ["gate"])
    assert {float(s["step"]) for s in dump["raw"]["state"]} == {4.0}
    (ds_loss, _), (ds_after, _) = dump["train"]["loss"], dump["train"]["loss_after"]
    assert ds_loss == pytest.approx(loss, rel=1e-6), name
    assert ds_after == pytest.approx(after, rel=1e-5), name


def test_errors_name_the_optax_state(tmp_path, converted):
  """The full messages: what is refused, which state, and what to do."""
  frozen_trained = RUNS["nnx"](
    dataclasses.replace(FORMS["adam"], wrt=False), None
  )  # wrt=nnx.Param: the optimizer holds `gate`, which the checkpoint froze
  with pytest.raises(ucp_jax.MappingError) as e:
    frozen_trained.restore(converted, rules=RULES)
  assert str(e.value) == (
    f"{converted}: cannot restore this training state:\n"
    "  gate: frozen in the checkpoint (a value, no optimizer state), but the optimizer holds it "
    "(exp_avg, exp_avg_sq); leave it out (nnx.Optimizer(wrt=...), an optax.set_to_zero label "
    "or optax.masked)"
  )
  lion = RUNS["nnx"](FORMS["lion"], None)
  with pytest.raises(ucp_jax.MappingError) as e:
    lion.restore(converted, rules=RULES)
  assert str(e.value) == (
    f"{converted}: cannot restore this training state:\n"
    "  `optimizer/opt_state/0` (optax ScaleByLionState: mu of 7 parameter(s)): a converted "
    "checkpoint holds no such state (DeepSpeed has no names for it; this checkpoint's optimizer "
    "is adamw); it restores only from a JAX save"
  )
  path = lion.save(tmp_path / "lion", hyperparams={"lr": 1e-3})
  pytest.importorskip("torch")
  with pytest.raises(ucp_jax.MappingError) as e:
    ucp_jax.export(path, tmp_path / "ds", rules=RULES, format="deepspeed")
  assert str(e.value) == (
    f"{path}: cannot export: 1 problem(s) in the parameter schema:\n"
    "  `optimizer/opt_state/0` (optax ScaleByLionState: mu of 7 parameter(s)): DeepSpeed has no "
    "slot names for this state (it keeps exp_avg, exp_avg_sq for Adam and momentum_buffer for "
    "SGD), so its optimizer could not continue; this checkpoint moves between JAX meshes only"
  )
