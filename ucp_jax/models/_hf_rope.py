"""RoPE from a `config.json`, as `transformers` 5 standardizes it (`modeling_rope_utils`).

The parameters come from `rope_scaling` (older configs; it wins when both are there and it
is not empty) or `rope_parameters` (transformers 5), with `rope_theta` and
`partial_rotary_factor` filled in from the top level (or the family's own legacy names) where
the dict lacks them; `type` is the old spelling of `rope_type`. For `llama3`, `yarn` and
`longrope`, a top-level `original_max_position_embeddings` wins over the dict's (as
transformers sets it again when it computes the frequencies), else the dict's, else
`max_position_embeddings`. The numbers a scaling leaves out take transformers' defaults
(`factor` of yarn and longrope from the context lengths, their attention factors, yarn's
betas and truncation), so `ucp_jax.models._rope` computes from complete parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ucp_jax.base._errors import shown
from ucp_jax.models import _configs
from ucp_jax.models._hf_reader import Reader, is_int, is_number

Rope = tuple[float, "dict | None", float]
"""theta, the scaling for `ucp_jax.models._rope` (None: plain RoPE), partial rotary factor."""


def params(
  r: Reader,
  *,
  theta_key: str = "rope_theta",
  theta: float = 10000.0,
  partial_key: str | None = "partial_rotary_factor",
) -> dict:
  """The rope parameters as one flat dict: `rope_scaling` or `rope_parameters`, with theta
  (and the partial rotary factor) from the top level where the dict lacks them."""
  scaling, given = r.mapping("rope_scaling"), r.mapping("rope_parameters")
  p = dict(scaling) if scaling else dict(given or {})
  if "rope_theta" not in p:
    p["rope_theta"] = r.number(theta_key) if r.present(theta_key) else theta
  if partial_key is not None and r(partial_key) is not None:
    p.setdefault("partial_rotary_factor", fraction(r, partial_key, r(partial_key)))
  return p


def fraction(r: Reader, key: str, value: Any) -> float:
  """A number in (0, 1] (a partial rotary factor), checked."""
  if not (is_number(value) and 0 < value <= 1):
    r.problem(f"`{key}`: {shown(value)} is not a number in (0, 1]")
    return 1.0
  return float(value)


def read(r: Reader, p: Mapping[str, Any], *, head_dim: int, partial: bool, where: str = "") -> Rope:
  """Theta, scaling and partial rotary factor from the flat parameters `p`.

  `partial`: the family rotates part of each head (Phi-3, GPT-NeoX); the others ignore a
  partial factor with plain RoPE (their default frequencies span the whole head) and fail
  with a scaled one (transformers' frequencies and rotation would disagree in width).
  """
  theta = r.number(f"{where}rope_theta", value=p.get("rope_theta"))
  kind = p.get("rope_type", p.get("type", "default"))
  if not isinstance(kind, str):
    r.problem(f"`{where}rope_type`: {shown(kind)} is not a name")
    return theta, None, 1.0
  factor = fraction(r, f"{where}partial_rotary_factor", p.get("partial_rotary_factor", 1.0))
  if not partial:
    r.refuse(
      factor != 1.0 and kind != "default",
      f"{where}partial_rotary_factor {factor} with rope_type {kind!r}: transformers' rotary "
      "widths disagree for this family",
    )
    factor = 1.0
  if kind == "default":
    return theta, None, factor
  if kind not in _configs.SCALINGS:
    r.problem(f"{where}rope_type {kind!r}: supported are default, {', '.join(_configs.SCALINGS)}")
    return theta, None, factor
  rot_dim = int(head_dim * factor)
  return theta, _scaling(r, kind, p, theta, rot_dim, where), factor


def _scaling(r: Reader, kind: str, p: Mapping[str, Any], theta: float, dim: int, where: str):
  def number(key: str, default: Any = None, *, positive: bool = True) -> Any:
    value = p.get(key, default)
    ok = is_number(value) and (value > 0 or not positive)
    if value is None or not ok:
      r.problem(f"`{where}{key}`: {shown(value)} is not a {'positive ' * positive}number")
      return 1.0
    return float(value)

  def optional(key: str) -> Any:
    return None if p.get(key) is None else number(key)

  out: dict[str, Any] = {"rope_type": kind}
  if kind in ("llama3", "yarn", "longrope"):
    out["original_max_position_embeddings"] = _original(r, p, where)
  context = out.get("original_max_position_embeddings")
  if kind == "linear":
    out["factor"] = number("factor")
  elif kind == "llama3":
    out |= {k: number(k) for k in ("factor", "low_freq_factor", "high_freq_factor")}
  elif kind == "dynamic":
    r.refuse(dim <= 2, f"{where}rope_type 'dynamic' needs a rotary width over 2 (it is {dim})")
    out["factor"] = number("factor")
    out["max_position_embeddings"] = r.size("max_position_embeddings")
  elif kind == "yarn":
    r.refuse(theta <= 1, f"`{where}rope_theta` {theta} with yarn: its correction divides by log")
    factor = optional("factor") or r.size("max_position_embeddings") / context
    attention = optional("attention_factor")
    if attention is None:
      mscale, all_dim = optional("mscale"), optional("mscale_all_dim")
      attention = (
        _mscale(factor, mscale) / _mscale(factor, all_dim)
        if mscale and all_dim
        else _mscale(factor)
      )
    truncate = p.get("truncate", True)
    r.refuse(
      not isinstance(truncate, bool), f"`{where}truncate`: {shown(truncate)} is not true or false"
    )
    out |= {"factor": factor, "attention_factor": attention, "truncate": truncate is not False}
    out |= {"beta_fast": optional("beta_fast") or 32.0, "beta_slow": optional("beta_slow") or 1.0}
  elif kind == "longrope":
    factor = optional("factor") or r.size("max_position_embeddings") / context
    attention = optional("attention_factor")
    if attention is None:
      log_context = math.log(max(context, 2))  # (a context of 1 is a problem already named)
      attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / log_context)
    out["attention_factor"] = attention
    for key in ("short_factor", "long_factor"):
      values = p.get(key)
      ok = isinstance(values, list) and len(values) == dim // 2
      ok = ok and all(is_number(v) and v > 0 for v in values)
      if not ok:
        r.problem(f"`{where}{key}`: {shown(values)} is not {dim // 2} positive numbers")
        values = [1.0] * (dim // 2)
      out[key] = tuple(float(v) for v in values)
  return out


def _original(r: Reader, p: Mapping[str, Any], where: str) -> int:
  key = "original_max_position_embeddings"
  # Phi-3's config class has the field (its default counts); for others, the file's own
  value = r(key) if r.present(key) or key in r.defaults else p.get(key)
  if value is None:
    return r.size("max_position_embeddings")
  if not is_int(value, 1, 1 << 31):
    r.problem(f"`{where}{key}`: {shown(value)} is not a positive integer")
    return 1
  return value


def _mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
