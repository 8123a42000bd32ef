"""The Optax and Flax forms users write, as runnable training states, and torch's step for each.

Every form trains the DeepSpeed fixtures' model (scripts/make_deepspeed_fixtures.py: tied
embedding, frozen `gate`, buffer `scale`) in Flax NNX (`test_param_groups.Tiny`) or Linen
(`LinenTiny`), on one device or a 2x4 mesh. `Form.torch` says how torch trains the same
way (the oracle), or is None where torch and DeepSpeed have no such optimizer.

Torch's groups are the fixtures' (0: the >=2-D weights, 1: biases and LayerNorm); a form's
hyperparameters for them are given per torch group.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import ds_fixtures as F
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_param_groups import FLAX_GROUPS, NAME, RULES, TORCH_GROUPS, TRAINABLE, Tiny, mk

import ucp_jax
from ucp_jax.tree import _tree

B1, B2, EPS = 0.9, 0.99, 1e-8
DECAY = set(FLAX_GROUPS[0])
GATE = np.linspace(0.5, 1.5, mk.HIDDEN, dtype=np.float32)  # the torch model's init
SCALE = F.buffer_value(NAME, "scale")  # the fixtures' buffer (never trained)


def label_of(key: str) -> str:
  return "frozen" if key == "gate" else "decay" if key in DECAY else "no_decay"


def _key(path) -> str:
  return _tree.from_path(path).removesuffix("/value")  # NNX variables end in `value`


def by_callable(fn: Callable[[str], Any]) -> Callable[[Any], Any]:
  """Labels (or a mask) from a plain `jax.tree_util` callable over the parameters."""
  return lambda params: jax.tree_util.tree_map_with_path(lambda path, _: fn(_key(path)), params)


def by_framework(fn: Callable[[str], Any], linen: bool) -> Callable[[Any], Any]:
  """Labels from the framework's own helper: `nnx.map_state`, `traverse_util.path_aware_map`."""
  if linen:
    return lambda params: traverse_util.path_aware_map(lambda path, _: fn("/".join(path)), params)
  return lambda params: nnx.map_state(lambda path, _: fn("/".join(map(str, path))), params)


@dataclasses.dataclass(frozen=True)
class Torch:
  """torch's optimizer for a form: class, hyperparameters per torch group, clipping, micro-steps."""

  optimizer: str  # "AdamW", "Adam" or "SGD"
  groups: tuple[dict, dict]
  clip: float | None = None
  micro: int = 1
  schedule: Callable[[int], Any] | None = None  # lr of the step taken at each step count


@dataclasses.dataclass(frozen=True)
class Form:
  """An Optax optimizer as users write it, and how it leaves `gate` untrained."""

  tx: Callable[[bool, Any], optax.GradientTransformation]  # (linen, params)
  wrt: bool  # NNX: frozen by `nnx.Optimizer(wrt=...)` (Linen: an optax.set_to_zero label)
  torch: Torch | None
  ema_tree: bool = False  # an EMA of the parameters beside the optimizer state


def _adamw(lr=0.01, **kw):
  return optax.adamw(lr, B1, B2, EPS, weight_decay=0.1, mask=by_callable(DECAY.__contains__), **kw)


def _labels3(linen: bool, params: Any, fn=by_callable):
  groups = {
    "decay": optax.adamw(0.01, B1, B2, EPS, weight_decay=0.1),
    "no_decay": optax.adam(0.005, B1, B2, EPS),
    "frozen": optax.set_to_zero(),
  }
  labels = fn(label_of) if fn is by_callable else fn(label_of, linen)
  return optax.multi_transform(groups, labels)


def _labels2(linen: bool, params: Any):
  groups = {
    "decay": optax.adamw(0.01, B1, B2, EPS, weight_decay=0.1),
    "no_decay": optax.adam(0.005, B1, B2, EPS),
  }
  return optax.multi_transform(groups, by_callable(label_of))


def _labels_pytree(linen: bool, params: Any):
  labels = by_framework(label_of, linen)(params)  # a pytree, computed once
  return optax.multi_transform(
    {
      "decay": optax.adamw(0.01, B1, B2, EPS, weight_decay=0.1),
      "no_decay": optax.adam(0.005, B1, B2, EPS),
      "frozen": optax.set_to_zero(),
    },
    labels,
  )


def _inject(linen: bool, params: Any):
  wrong = dict(b1=0.5, b2=0.5, eps=1e-3)  # restored from the checkpoint's groups
  return optax.multi_transform(
    {
      "decay": optax.inject_hyperparams(optax.adamw)(1e-4, weight_decay=0.5, **wrong),
      "no_decay": optax.inject_hyperparams(optax.adam)(1e-4, **wrong),
      "frozen": optax.set_to_zero(),
    },
    by_callable(label_of),
  )


def _masked(linen: bool, params: Any):
  return optax.chain(
    optax.masked(optax.set_to_zero(), by_callable(lambda k: k == "gate")),
    optax.masked(_adamw(), by_callable(lambda k: k != "gate")),
  )


CKPT = ({"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.005, "weight_decay": 0.0})
ONE_LR = ({"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.01, "weight_decay": 0.0})
SCHEDULE = optax.linear_schedule(0.02, 0.002, 10)
SGD = {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}

FORMS: dict[str, Form] = {
  "adamw": Form(lambda linen, params: _adamw(), True, Torch("AdamW", ONE_LR)),
  "adam": Form(
    lambda linen, params: optax.adam(0.005, B1, B2, EPS),
    True,
    Torch("Adam", ({"lr": 0.005, "weight_decay": 0.0},) * 2),
  ),
  "clip_adamw": Form(
    lambda linen, params: optax.chain(optax.clip_by_global_norm(0.1), _adamw()),
    True,
    Torch("AdamW", ONE_LR, clip=0.1),
  ),
  "decayed_weights_adam": Form(
    lambda linen, params: optax.chain(
      optax.add_decayed_weights(1e-3), optax.adam(0.005, B1, B2, EPS)
    ),
    True,
    Torch("Adam", ({"lr": 0.005, "weight_decay": 1e-3},) * 2),
  ),
  "schedule": Form(
    lambda linen, params: _adamw(SCHEDULE),
    True,
    Torch("AdamW", ONE_LR, schedule=SCHEDULE),
  ),
  "inject_hyperparams": Form(_inject, False, Torch("AdamW", CKPT)),
  "labels_callable_wrt": Form(_labels2, True, Torch("AdamW", CKPT)),
  "frozen_set_to_zero": Form(_labels3, False, Torch("AdamW", CKPT)),
  "labels_map_state": Form(
    lambda linen, params: _labels3(linen, params, by_framework), False, Torch("AdamW", CKPT)
  ),
  "labels_pytree": Form(_labels_pytree, False, Torch("AdamW", CKPT)),
  "frozen_masked": Form(_masked, False, Torch("AdamW", ONE_LR)),
  "multi_steps": Form(
    lambda linen, params: optax.MultiSteps(_labels2(linen, params), every_k_schedule=2),
    True,
    Torch("AdamW", CKPT, micro=2),
  ),
  "sgd_momentum": Form(
    lambda linen, params: optax.sgd(0.01, momentum=0.9), True, Torch("SGD", (SGD, SGD))
  ),
  "sgd_nesterov": Form(
    lambda linen, params: optax.sgd(0.01, momentum=0.9, nesterov=True),
    True,
    Torch("SGD", ({**SGD, "nesterov": True},) * 2),
  ),
  "ema_tree": Form(lambda linen, params: _adamw(), True, Torch("AdamW", ONE_LR), ema_tree=True),
  "lion": Form(lambda linen, params: optax.lion(1e-3, weight_decay=0.1), True, None),
  "adafactor": Form(lambda linen, params: optax.adafactor(1e-2), True, None),
  "muon": Form(lambda linen, params: optax.contrib.muon(1e-3), True, None),
  "ema": Form(lambda linen, params: optax.chain(_adamw(), optax.ema(0.9)), True, None),
}
TORCH_FORMS = [name for name, form in FORMS.items() if form.torch is not None]
JAX_ONLY_FORMS = [name for name, form in FORMS.items() if form.torch is None]


def mesh_of(kind: str) -> jax.sharding.Mesh | None:
  return None if kind == "1" else jax.make_mesh((2, 4), ("data", "model"), (AxisType.Auto,) * 2)


def _spec(shape: tuple[int, ...]) -> P:
  """A 2x4-mesh layout: the first dimension of size 12 (mk.DIM) split over `model`."""
  dims: list[str | None] = [None] * len(shape)
  if mk.DIM in shape:
    dims[shape.index(mk.DIM)] = "model"
  return P(*dims)


def shard(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
  if mesh is None:
    return tree
  flat, unflatten = _tree.flatten(tree)
  return unflatten(
    {
      k: jax.device_put(v, NamedSharding(mesh, _spec(np.shape(v))))
      if isinstance(v, jax.Array)
      else v
      for k, v in flat.items()
    }
  )


def _ce(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class EmaOptimizer(nnx.Optimizer):
  """An `nnx.Optimizer` that keeps an EMA of the parameters it trains."""

  def __init__(self, model, tx, *, wrt):
    super().__init__(model, tx, wrt=wrt)
    self.ema = nnx.data(jax.tree.map(lambda v: nnx.OptState(v[...]), nnx.state(model, wrt)))

  def update(self, model, grads, **kwargs):
    super().update(model, grads, **kwargs)
    params = nnx.state(model, self.wrt)
    new = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, nnx.as_pure(self.ema), nnx.as_pure(params))
    nnx.update(self.ema, new)


_TX: dict[tuple[int, bool], tuple[Form, Any]] = {}


def _shared_tx(form: Form, linen: bool, make: Callable[[], Any]) -> Any:
  """One optimizer per form and framework, made by its first run. A jitted step's cache is
  keyed by the state's static parts (`tx`, `apply_fn`): runs that share them compile a
  program once, not once per run. (A form is keyed by identity; `_TX` keeps it alive.)"""
  key = (id(form), linen)
  if key not in _TX:
    _TX[key] = (form, make())
  return _TX[key][1]


@functools.cache
def _nnx_step(trainable_only: bool):
  """The jitted NNX step: `wrt` the trainable parameters (`gate` left out) or every Param."""
  wrt = TRAINABLE if trainable_only else nnx.Param

  @nnx.jit
  def step(model, opt, ids, targets):
    loss, grads = nnx.value_and_grad(lambda m: _ce(m(ids), targets), argnums=nnx.DiffState(0, wrt))(
      model
    )
    opt.update(model, grads)
    return loss

  return step


class NNXRun:
  """An NNX model and `nnx.Optimizer` in `form`, on `mesh`, from init seed `seed`."""

  linen = False

  def __init__(self, form: Form, mesh, seed: int = 0):
    self.form, self.mesh = form, mesh
    self.model = Tiny(nnx.Rngs(seed))
    self.model.gate[...] = jnp.asarray(GATE)  # as the torch model's, not zeros
    self.model.scale[...] = jnp.asarray(SCALE)
    nnx.update(self.model, shard(nnx.state(self.model), mesh))
    self.wrt = TRAINABLE if form.wrt else nnx.Param
    tx = _shared_tx(form, False, lambda: form.tx(False, nnx.state(self.model, self.wrt)))
    kind = EmaOptimizer if form.ema_tree else nnx.Optimizer
    self.opt = kind(self.model, tx, wrt=self.wrt)
    self._step = _nnx_step(form.wrt)

  def step(self, ids, targets) -> float:
    return float(self._step(self.model, self.opt, jnp.asarray(ids), jnp.asarray(targets)))

  def loss(self, ids, targets) -> float:
    return float(_ce(self.model(jnp.asarray(ids)), jnp.asarray(targets)))

  def save(self, path, **kw) -> str:
    return ucp_jax.save_train_state(path, self.model, self.opt, **kw)

  def restore(self, path, **kw) -> None:
    ucp_jax.restore_train_state(path, self.model, self.opt, **kw)

  @property
  def tree(self) -> Any:
    return {"model": nnx.state(self.model), "optimizer": nnx.state(self.opt)}

  @property
  def opt_state(self) -> Any:
    return self.opt.opt_state

  def params(self) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in _tree.flatten(nnx.state(self.model, nnx.Param))[0].items()}


class TPTiny(Tiny):
  """`Tiny` with partition annotations (the dimension of size 12 over `model`), as a model
  written for a mesh is: `nnx.eval_shape` gives it shardings on an `AbstractMesh`."""

  def __init__(self, rngs: nnx.Rngs):
    super().__init__(rngs)
    init = nnx.initializers.lecun_normal()
    part = nnx.with_partitioning
    self.embed = nnx.Embed(mk.VOCAB, mk.DIM, embedding_init=part(init, (None, "model")), rngs=rngs)
    self.fc1 = nnx.Linear(mk.DIM, mk.HIDDEN, kernel_init=part(init, ("model", None)), rngs=rngs)
    self.fc2 = nnx.Linear(
      mk.HIDDEN,
      mk.DIM,
      kernel_init=part(init, (None, "model")),
      bias_init=part(nnx.initializers.zeros, ("model",)),
      rngs=rngs,
    )


class LinenTiny(nn.Module):
  """The fixture model in Linen; `scale` (a buffer in torch) is a constant here."""

  scale: Any

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(mk.VOCAB, mk.DIM, name="embed")
    h = embed(ids) * self.scale
    gate = self.param("gate", nn.initializers.zeros, (mk.HIDDEN,))
    h = nn.Dense(mk.HIDDEN, name="fc1")(h) * gate
    h = nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, name="ln")(
      jax.nn.gelu(h, approximate=False)
    )
    return embed.attend(nn.Dense(mk.DIM, name="fc2")(h))


class EmaTrainState(train_state.TrainState):
  ema_params: Any = None

  def apply_gradients(self, *, grads, **kwargs):
    new = super().apply_gradients(grads=grads, **kwargs)
    ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, self.ema_params, new.params)
    return new.replace(ema_params=ema)


def _frozen_by_label(tx):
  return optax.multi_transform(
    {"train": tx, "frozen": optax.set_to_zero()},
    by_callable(lambda k: "frozen" if k == "gate" else "train"),
  )


@functools.cache
def _linen_module() -> LinenTiny:
  return LinenTiny(scale=jnp.asarray(SCALE))


@jax.jit
def _linen_step(state, ids, targets):
  loss, grads = jax.value_and_grad(lambda p: _ce(state.apply_fn({"params": p}, ids), targets))(
    state.params
  )
  return state.apply_gradients(grads=grads), loss


class LinenRun:
  """A Linen `TrainState` in `form`, on `mesh`, from init seed `seed`."""

  linen = True

  def __init__(self, form: Form, mesh, seed: int = 0):
    self.form, self.mesh = form, mesh
    self.module = _linen_module()
    ids = jnp.zeros((1, mk.SEQ), jnp.int32)
    params = dict(self.module.init(jax.random.key(seed), ids)["params"])
    params["gate"] = GATE
    params = shard(jax.tree.map(jnp.asarray, params), mesh)

    def make_tx():
      tx = form.tx(True, params)
      return _frozen_by_label(tx) if form.wrt else tx

    tx = _shared_tx(form, True, make_tx)
    kind = EmaTrainState if form.ema_tree else train_state.TrainState
    extra = {"ema_params": jax.tree.map(jnp.copy, params)} if form.ema_tree else {}
    self.state = kind.create(apply_fn=self.module.apply, params=params, tx=tx, **extra)
    self._step = _linen_step

  def step(self, ids, targets) -> float:
    self.state, loss = self._step(self.state, jnp.asarray(ids), jnp.asarray(targets))
    return float(loss)

  def loss(self, ids, targets) -> float:
    logits = self.module.apply({"params": self.state.params}, jnp.asarray(ids))
    return float(_ce(logits, jnp.asarray(targets)))

  def save(self, path, **kw) -> str:
    return ucp_jax.save_train_state(path, self.state, **kw)

  def restore(self, path, **kw) -> None:
    self.state = ucp_jax.restore_train_state(path, self.state, **kw)

  @property
  def tree(self) -> Any:
    return self.state

  @property
  def opt_state(self) -> Any:
    return self.state.opt_state

  def params(self) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in _tree.flatten(self.state.params)[0].items()}


RUNS = {"nnx": NNXRun, "linen": LinenRun}


def torch_params(run) -> dict[str, np.ndarray]:
  """The run's parameters in torch names and layouts."""
  return RULES.export_arrays(run.params())


def torch_step(form: Form, values, slots, step, ids, targets):
  """One torch step of `form.torch` from a state in torch names (fixture or export).

  `values`: parameters, frozen `gate` and buffer `scale`; `slots`: {slot: {name: array}}.
  Returns (loss, parameters after the step).
  """
  import torch

  spec = form.torch
  model = mk._build_model()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(torch.from_numpy(np.array(values[name])))
    model.scale.copy_(torch.from_numpy(np.array(values["scale"])))
  params = dict(model.named_parameters())
  lr = {} if spec.schedule is None else {"lr": float(spec.schedule(int(step)))}
  groups = [
    {"params": [params[n] for n in names], **hyper, **lr}
    for names, hyper in zip(TORCH_GROUPS, spec.groups)
  ]
  if spec.optimizer == "SGD":
    opt = torch.optim.SGD(groups)
  else:
    opt = getattr(torch.optim, spec.optimizer)(groups, betas=(B1, B2), eps=EPS)
  for name in (n for names in TORCH_GROUPS for n in names):
    state = {k: torch.from_numpy(np.array(v[name])) for k, v in slots.items()}
    if spec.optimizer != "SGD":
      state["step"] = torch.tensor(float(step))
    opt.state[params[name]] = state
  ids, targets = torch.from_numpy(np.asarray(ids)), torch.from_numpy(np.asarray(targets))
  losses = []
  for _ in range(spec.micro):
    loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, mk.VOCAB), targets.reshape(-1))
    (loss / spec.micro).backward()
    losses.append(float(loss.detach()))
  if spec.clip is not None:
    torch.nn.utils.clip_grad_norm_([p for p in params.values() if p.requires_grad], spec.clip)
  opt.step()
  return losses[0], {n: p.detach().numpy() for n, p in params.items()}
