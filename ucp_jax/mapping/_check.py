"""`check_forward`: a rule set proven by outputs, where shapes cannot prove it.

A square weight read transposed (a GPT-2 `Conv1D`, `[in, out]`, mapped as a `Linear`,
`[out, in]`), two same-shaped norms swapped, heads split in the wrong order: each
passes every shape check and computes something else. Running the torch model and the
Flax model, loaded through the rules, on one batch and comparing their logits catches
all of them (and a model config that differs: epsilon, activation, RoPE, tied head).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.mapping._load import as_numpy, mapped_state
from ucp_jax.mapping._mapping import RuleSet

_HINT = (
  "The rules or the model config do not match the torch model: a layout the shapes allow "
  "(a Conv1D weight, [in, out], read as a Linear one, [out, in], or the reverse; two "
  "same-shaped norms or projections swapped; heads split in the wrong order), or a "
  "config that differs (epsilon, activation, RoPE, tied head, biases)"
)


def check_forward(
  torch_model: Any,
  flax_model: Any,
  rules: RuleSet | None,
  batch: Any,
  *,
  atol: float = 1e-5,
  rtol: float = 1e-5,
  partial: bool = False,
) -> float:
  """Runs both models on `batch` (the Flax one loaded from the torch one through `rules`).

  The torch model's `state_dict()` is mapped by `rules` into a copy of `flax_model`'s
  parameters (`flax_model` itself is not changed, and may be abstract, from
  `nnx.eval_shape`); both models run on the token ids `batch`, the torch one in eval
  mode without gradients, the Flax one at float32 matmul precision; their logits must
  agree within `atol + rtol * |torch|` everywhere.

  Example (a square `Linear` read without its transpose: every shape fits):
    >>> import numpy as np, torch  # doctest: +SKIP
    >>> from flax import nnx
    >>> from ucp_jax import rules
    >>> torch_model = torch.nn.Linear(3, 3)  # doctest: +SKIP
    >>> flax_model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    >>> bias = rules.Rule("bias", "bias")
    >>> right = rules.RuleSet([rules.Rule("weight", "kernel", [rules.transpose()]), bias])
    >>> wrong = rules.RuleSet([rules.Rule("weight", "kernel"), bias])
    >>> x = np.ones((2, 3), np.float32)
    >>> rules.check_forward(torch_model, flax_model, right, x) < 1e-6  # doctest: +SKIP
    True
    >>> rules.check_forward(torch_model, flax_model, wrong, x)  # doctest: +SKIP
    Traceback (most recent call last):
    ucp_jax.base._errors.MappingError: outputs differ beyond atol=1e-05 + rtol=1e-05 * |torch| ...

  Args:
    torch_model: a `torch.nn.Module` taking token ids `[batch, time]` and returning logits
      (a tensor, a tuple whose first item they are, or an output with `.logits`, as the
      `transformers` models do).
    flax_model: the Flax NNX model the rules map onto, called on `[batch, time]` ids.
    rules: the rule set under test (None: the names already match).
    batch: token ids, `[batch, time]` integers (numpy, jax or torch).
    atol: absolute tolerance.
    rtol: relative tolerance, of the torch logits.
    partial: leave out torch names no rule matches (buffers the rules do not know).

  Returns:
    The largest absolute difference between the two models' logits.

  Raises:
    MappingError: the logits differ beyond the tolerance (naming the largest difference,
      where it is, and how many values are off), or their shapes differ; and anything
      `load_into` raises for names, keys, shapes and dtypes.
    MissingDependencyError: torch is not installed.
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx

  torch = _torch()
  tokens = as_numpy(batch)
  expected = _torch_logits(torch, torch_model, tokens)
  graphdef, state, rest = mapped_state(
    flax_model, torch_model.state_dict(), rules, partial=partial, cast=True
  )
  with jax.default_matmul_precision("float32"):
    got = np.asarray(nnx.merge(graphdef, state, rest)(jnp.asarray(tokens)), np.float32)
  return compare_logits(got, expected, atol=atol, rtol=rtol)


def compare_logits(got: np.ndarray, expected: np.ndarray, *, atol: float, rtol: float) -> float:
  """The largest |got - expected|; raises MappingError, naming it, beyond the tolerance.

  Example:
    >>> import numpy as np
    >>> from ucp_jax.mapping._check import compare_logits
    >>> compare_logits(np.zeros((1, 2, 3)), np.zeros((1, 2, 3)), atol=1e-5, rtol=0)
    0.0
  """
  if got.shape != expected.shape:
    raise _errors.MappingError(
      f"outputs have shape {got.shape} from the Flax model, {expected.shape} from the torch "
      "model: the model configs differ"
    )
  diff = np.abs(got.astype(np.float64) - expected.astype(np.float64))
  diff = np.where(np.isnan(diff), np.inf, diff)
  bad = diff > atol + rtol * np.abs(expected)
  largest = float(diff.max()) if diff.size else 0.0
  if not bad.any():
    return largest
  where = np.unravel_index(int(np.argmax(diff)), diff.shape)
  first = ""
  if bad.ndim >= 2:  # [batch, time, ...]: the first time step that differs
    steps = bad.any(axis=tuple(a for a in range(bad.ndim) if a != 1))
    first = f"; the first position that differs is {int(np.argmax(steps))}"
  raise _errors.MappingError(
    f"outputs differ beyond atol={atol:g} + rtol={rtol:g} * |torch| in {int(bad.sum())} of "
    f"{bad.size} values: the largest |flax - torch| is {largest:.4g} at {list(map(int, where))} "
    f"(flax {got[where]:.6g}, torch {expected[where]:.6g}){first}. {_HINT}"
  )


def _torch():
  try:
    import torch
  except ImportError:
    raise _errors.MissingDependencyError(
      "check_forward runs the torch model: pip install torch"
    ) from None
  return torch


def _torch_logits(torch, model: Any, tokens: np.ndarray) -> np.ndarray:
  training = model.training
  model.eval()
  try:
    with torch.no_grad():
      out = model(torch.as_tensor(tokens))
  finally:
    model.train(training)
  if hasattr(out, "logits"):
    out = out.logits
  elif isinstance(out, (tuple, list)):
    out = out[0]
  return as_numpy(out).astype(np.float32)
