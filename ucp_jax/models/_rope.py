"""Rotary position embeddings as Hugging Face `transformers` 5 computes them.

`tables(t, rot_dim, theta, scaling)` gives the `[t, rot_dim]` cosines and sines (times the
attention factor of yarn and longrope); `apply(x, cos, sin)` rotates the first `rot_dim`
features of each head (rotate-half), leaving the rest as they are (partial rotary).

The scalings (`scaling["rope_type"]`) and the numbers each needs, every one resolved from the
config beforehand (`ucp_jax.models._hf` fills in transformers' defaults):

| `rope_type` | numbers |
|---|---|
| `linear` | `factor` |
| `llama3` | `factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings` |
| `dynamic` | `factor`, `max_position_embeddings` (NTK-aware, from the sequence's length) |
| `yarn` | `factor`, `attention_factor`, `beta_fast`, `beta_slow`, `original_max_position_embeddings`, `truncate` |
| `longrope` | `short_factor`, `long_factor` (one per frequency), `attention_factor`, `original_max_position_embeddings` |

`dynamic` and `longrope` depend on the sequence's length, here `t` (a static shape): a
`transformers` model computes the same for a fresh call on `t` positions (its `dynamic`
cache keeps the largest length seen, so a longer earlier call changes a later shorter one
there; here every call is computed afresh).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ucp_jax.models._configs import SCALINGS as SCALINGS


def inv_freq(rot_dim: int, theta: float, scaling: Any, t: int) -> tuple[np.ndarray, float]:
  """The inverse frequencies `[rot_dim // 2]` (float32) and the attention factor, for `t` steps."""
  s: Mapping[str, Any] = dict(scaling or ())
  kind = s.get("rope_type")
  exponents = np.arange(0, rot_dim, 2, dtype=np.float32) / np.float32(rot_dim)
  base_theta = np.float32(theta)
  if kind == "dynamic" and t > s["max_position_embeddings"]:
    # NTK-aware: a larger base once the sequence outgrows the training length (float32, as
    # torch computes it from the sequence-length tensor)
    f32 = np.float32
    ratio = f32(s["factor"]) * f32(t) / f32(s["max_position_embeddings"]) - f32(s["factor"] - 1)
    base_theta = f32(theta) * ratio ** f32(rot_dim / (rot_dim - 2))
  base = base_theta**exponents
  freq = np.float32(1.0) / base
  if kind == "linear":
    return freq / np.float32(s["factor"]), 1.0
  if kind == "llama3":
    return _llama3(freq, s), 1.0
  if kind == "yarn":
    return _yarn(base, rot_dim, theta, s), float(s["attention_factor"])
  if kind == "longrope":
    factors = s["long_factor"] if t > s["original_max_position_embeddings"] else s["short_factor"]
    ext = np.asarray(factors, np.float32)
    return np.float32(1.0) / (ext * base), float(s["attention_factor"])
  return freq, 1.0


def _llama3(freq: np.ndarray, s: Mapping[str, Any]) -> np.ndarray:
  factor, low, high = (s[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
  context = s["original_max_position_embeddings"]
  wavelen = np.float32(2 * math.pi) / freq
  scaled = np.where(wavelen > context / low, freq / np.float32(factor), freq)
  smooth = (context / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
  medium = ~(wavelen < context / high) & ~(wavelen > context / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(base: np.ndarray, dim: int, theta: float, s: Mapping[str, Any]) -> np.ndarray:
  factor, context = s["factor"], s["original_max_position_embeddings"]

  def correction_dim(rotations: float) -> float:
    return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

  low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
  if s["truncate"]:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # as transformers does, against a division by zero
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = (np.float32(1.0) - ramp).astype(np.float32)
  interpolation = np.float32(1.0) / (np.float32(factor) * base)
  return (interpolation * (1 - extrapolation) + (np.float32(1.0) / base) * extrapolation).astype(
    np.float32
  )


def tables(t: int, rot_dim: int, theta: float, scaling: Any = None) -> tuple[jax.Array, jax.Array]:
  """`cos, sin`, each `[t, rot_dim]` float32, for positions `0..t-1` (rotate-half layout)."""
  freq, factor = inv_freq(rot_dim, theta, scaling, t)
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * jnp.asarray(freq)[None]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates `x` `[batch, time, heads, head_dim]` by `cos`/`sin` `[time, rot_dim]` (the first
  `rot_dim` features of each head; the rest pass through)."""
  r = cos.shape[-1]
  rot, rest = x[..., :r], x[..., r:]
  cos, sin = cos[None, :, None, :].astype(x.dtype), sin[None, :, None, :].astype(x.dtype)
  half = r // 2
  rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
  out = rot * cos + rotated * sin
  return out if r == x.shape[-1] else jnp.concatenate([out, rest], axis=-1)
