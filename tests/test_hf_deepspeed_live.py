"""A DeepSpeed-trained `transformers` model -> JAX -> DeepSpeed, with the ready rules only.

Issue 11's proof, live (DeepSpeed 0.19.8 on gloo ranks, tests/support/hf_deepspeed_worker.py):

1. Tiny random `LlamaForCausalLM` (grouped-query) and `GPT2LMHeadModel` (tied head) train
   `N` steps under DeepSpeed ZeRO-2 at DP=2 with Hugging Face `Trainer`'s two AdamW groups
   (decay / no decay), save, and train `K` more: DeepSpeed's own continuation.
2. `ucp_jax.convert`; the Flax model and its rules come from `rules.from_hf(model.config)`
   alone; `restore_train_state` onto a 2 x 4 (data x model) mesh, heads and MLP units split
   over `model`, into `optax.multi_transform` groups like DeepSpeed's. `K` JAX steps equal
   DeepSpeed's continuation (relative 1e-5).
3. `save_train_state`, `export` to DeepSpeed and to a Hugging Face folder; JAX trains `K` more.
   A fresh DeepSpeed ZeRO-2 job at DP=3 loads the export (`load_universal`, `finish_load`)
   and trains the same `K` steps: equal to JAX's (relative 1e-5). `from_pretrained` on the
   Hugging Face export gives the Flax model's logits (absolute 1e-5).

One DeepSpeed launch per leg trains both models; 35-60 s on 2 cores (measured).
"""

from __future__ import annotations

import importlib.util
import time

import pytest

pytestmark = [
  pytest.mark.slow,
  pytest.mark.deepspeed,
  pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "deepspeed", "transformers")),
    reason="needs torch, deepspeed and transformers (pip install 'ucp_jax[deepspeed,hf]')",
  ),
]

N, K = 3, 3  # DeepSpeed steps before its save; steps of every continuation
TOLERANCE = 1e-5
RESUME_DP = 3


def _jax_trainer(cfg, decay_keys: set[str]):
  """The Flax model of `cfg` on a 2 x 4 mesh, `Trainer`'s groups as Optax labels, `train`."""
  import jax
  import numpy as np
  import optax
  from _continuity import MeshTrainer
  from flax import nnx
  from hf_deepspeed_worker import HYPER, batch
  from jax.sharding import AxisType

  from ucp_jax import models

  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  model = nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))  # no random init
  family = models.gpt if isinstance(cfg, models.gpt.GPTConfig) else models.llama
  target = family.tp_state(nnx.state(model), mesh)  # heads, MLP units over "model"
  nnx.update(
    model, jax.tree.map(lambda t: jax.device_put(np.zeros(t.shape, t.dtype), t.sharding), target)
  )
  b1, b2 = HYPER["betas"]
  tx = optax.multi_transform(
    {
      "decay": optax.adamw(HYPER["lr"], b1, b2, HYPER["eps"], weight_decay=HYPER["weight_decay"]),
      "no_decay": optax.adam(HYPER["lr"], b1, b2, HYPER["eps"]),
    },
    lambda params: nnx.map_state(
      lambda path, _: "decay" if "/".join(map(str, path)) in decay_keys else "no_decay", params
    ),
  )
  trainer = MeshTrainer(model, mesh, HYPER, batch, tx=tx)  # `batch`'s rows over "data"
  return model, trainer.optimizer, trainer.train


def _worst(ours: list[float], ref: list[float]) -> float:
  assert len(ours) == len(ref) > 0
  return max(abs(a - b) / abs(b) for a, b in zip(ours, ref))


def _jax_leg(name: str, tmp_path, ds_first: dict) -> dict:
  """Steps 2 and 3 in JAX for one model; the HF export's check. Returns what it measured."""
  import jax
  import numpy as np
  import torch
  import transformers
  from flax import nnx
  from hf_deepspeed_worker import HYPER, MODELS, batch, decay_names, hf_model

  import ucp_jax

  hf = hf_model(name)
  rules, cfg = ucp_jax.rules.from_hf(hf.config)  # the ready rules, nothing hand-written
  decay_keys = set(rules.map_names(decay_names(hf)))
  universal = ucp_jax.convert(tmp_path / "ds_first" / name, tmp_path / "universal" / name).dst
  model, optimizer, train = _jax_trainer(cfg, decay_keys)
  groups = ucp_jax.open(universal).manifest.schema["optimizer"]["groups"]
  assert [g["weight_decay"] for g in groups] == [HYPER["weight_decay"], 0.0]  # Trainer's two
  ucp_jax.restore_train_state(universal, model, optimizer, rules=rules)
  assert int(optimizer.step[...]) == N
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  sharded = [x.shape for x in params if "model" in tuple(x.sharding.spec)]
  assert sharded, "nothing split over the model axis"

  jax_losses = train(N, K)
  hyper = [dict(HYPER), dict(HYPER, weight_decay=0.0)]  # Optax's label order: decay, no_decay
  ucp_jax.save_train_state(tmp_path / "jax" / name, model, optimizer, hyperparams=hyper)
  ucp_jax.export(
    tmp_path / "jax" / name, tmp_path / "ds_export" / name, rules=rules, format="deepspeed"
  )
  hf_dir = tmp_path / "hf_export" / name
  ucp_jax.export(
    tmp_path / "jax" / name, hf_dir, format="hf", rules=rules, config=hf.config.to_dict()
  )
  tokens = batch(N + K)[:, :-1]
  flax_logits = np.asarray(nnx.jit(lambda m, t: m(t))(model, jax.numpy.asarray(tokens, np.int32)))
  loaded = getattr(transformers, MODELS[name][0]).from_pretrained(hf_dir).eval()
  with torch.no_grad():
    torch_logits = loaded(input_ids=torch.from_numpy(tokens)).logits.numpy()
  jax_more = train(N + K, K)
  return {
    "sharded": len(sharded),
    "params": len(params),
    "jax": jax_losses,
    "jax_vs_ds": _worst(jax_losses, ds_first["losses"][N:]),
    "jax_more": jax_more,
    "hf_logits_diff": float(np.max(np.abs(flax_logits - torch_logits))),
    "hf_logits_scale": float(np.max(np.abs(torch_logits))),
  }


def _report(name: str, ds_first: list[float], m: dict) -> None:
  fmt = lambda losses: " ".join(f"{v:.7f}" for v in losses)  # noqa: E731
  steps = lambda a: f"steps {a}-{a + K - 1}"  # noqa: E731
  print(
    f"{name} ({m['sharded']} of {m['params']} parameters split over the model axis):\n"
    f"  steps 0-{N - 1}  DeepSpeed DP=2  {fmt(ds_first[:N])}\n"
    f"  {steps(N)}  DeepSpeed DP=2  {fmt(ds_first[N:])}\n"
    f"  {'':9}  JAX 2x4         {fmt(m['jax'])}  worst rel {m['jax_vs_ds']:.1e}\n"
    f"  {steps(N + K)}  JAX 2x4         {fmt(m['jax_more'])}\n"
    f"  {'':9}  DeepSpeed DP={RESUME_DP}  {fmt(m['ds_resumed'])}  worst rel {m['ds_vs_jax']:.1e}\n"
    f"  HF export: max |flax - torch logits| {m['hf_logits_diff']:.1e} "
    f"(max |logit| {m['hf_logits_scale']:.2f})"
  )


def test_deepspeed_hf_model_to_jax_and_back(tmp_path):
  import hf_deepspeed_worker as W

  names = list(W.MODELS)
  t0 = time.perf_counter()
  first = W.launch(
    2,
    W.Leg(
      names,
      0,
      N + K,
      str(tmp_path / "ds_first_out"),
      save_after=N,
      save_dir=str(tmp_path / "ds_first"),
    ),
    tmp_path / "ds_first_logs",
  )
  t_first = time.perf_counter() - t0
  measured = {name: _jax_leg(name, tmp_path, first[name]) for name in names}
  t_jax = time.perf_counter() - t0 - t_first
  resumed = W.launch(
    RESUME_DP,
    W.Leg(names, N + K, K, str(tmp_path / "ds_resume_out"), load_dir=str(tmp_path / "ds_export")),
    tmp_path / "ds_resume_logs",
  )
  t_resume = time.perf_counter() - t0 - t_first - t_jax
  print(f"\nDeepSpeed DP=2 {t_first:.1f} s, JAX {t_jax:.1f} s, ", end="")
  print(f"DeepSpeed DP={RESUME_DP} {t_resume:.1f} s")
  for name in names:
    m = measured[name]
    m["ds_resumed"] = resumed[name]["losses"]
    m["ds_vs_jax"] = _worst(m["ds_resumed"], m["jax_more"])
    _report(name, first[name]["losses"], m)
  for name in names:
    m = measured[name]
    assert first[name]["global_steps"] == N + K
    assert resumed[name]["global_steps"] == N + 2 * K
    assert m["jax_vs_ds"] <= TOLERANCE, (name, m["jax"], first[name]["losses"][N:])
    assert m["ds_vs_jax"] <= TOLERANCE, (name, m["ds_resumed"], m["jax_more"])
    assert m["hf_logits_diff"] <= TOLERANCE, name
    losses = first[name]["losses"] + m["jax"] + m["ds_resumed"]
    assert losses[-1] < losses[0] - 0.1, (name, losses)  # it trains: the proof is not vacuous
