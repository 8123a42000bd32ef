"""`build` and `shardings`: the Flax reference models, their parameters sharded over a mesh."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from ucp_jax.models import gpt, llama, moe, neox
from ucp_jax.models._configs import Config
from ucp_jax.models._sharding import AxisRules

MODELS: dict[type, type] = {
  gpt.GPTConfig: gpt.FlaxGPT,
  llama.LlamaConfig: llama.FlaxLlama,
  neox.NeoXConfig: neox.FlaxNeoX,
  moe.MoeConfig: moe.FlaxMoe,
}
"""Config class -> Flax model class (a new family adds its pair here)."""


def build(
  cfg: Config,
  *,
  rngs: Any = None,
  scan: bool = False,
  mesh: jax.sharding.Mesh | None = None,
  axis_rules: AxisRules | None = None,
  abstract: bool = False,
) -> Any:
  """The Flax NNX model for `cfg`, its parameters sharded over `mesh` when given.

  With a mesh, every parameter is created on its sharding (no device holds a whole one
  unless it is replicated): the axes of `AXIS_RULES` (FSDP over `data`, TP over `model`, EP
  over `expert`), updated by `axis_rules`, each mesh axis used where it exists and divides
  the dimension (fewer key/value heads than the `model` axis: they are replicated). Each
  parameter's `PartitionSpec` is also its variable's `out_sharding` metadata (on a mesh of
  all-Explicit or all-Auto axes), so an `nnx.Optimizer`'s moments are sharded alike and
  `nnx.get_partition_spec` sees it. The model runs on meshes of Explicit axes
  (`jax.make_mesh`'s default), of Auto axes, and of both.

  Example:
    >>> import jax
    >>> from flax import nnx
    >>> from ucp_jax import models
    >>> cfg = models.llama.LlamaConfig(num_layers=1)
    >>> type(models.build(cfg, rngs=nnx.Rngs(0))).__name__
    'FlaxLlama'
    >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
    >>> model = models.build(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    >>> model.layers[0].attn.q.kernel[...].sharding.spec  # [d_model, heads, head_dim]
    P('data', 'model')
    >>> model.layers[0].attn.k.kernel[...].sharding.spec  # 2 kv heads: replicated over model
    P('data',)

  Args:
    cfg: the model config (from `ucp_jax.rules.from_hf`, for instance).
    rngs: the `nnx.Rngs` that initialize the parameters (default `nnx.Rngs(0)`).
    scan: stack the layers into one module run by `nnx.scan` (pair with `stacked=True`
      rules).
    mesh: shard the parameters over this mesh.
    axis_rules: logical axis name -> mesh axis (or a tuple of them, or None), over
      `AXIS_RULES`.
    abstract: no values: every parameter a `jax.ShapeDtypeStruct` (on its sharding), for
      `ucp_jax.rules.load_into` or `ucp_jax.restore` to fill without a random init.

  Returns:
    The model (`MODELS[type(cfg)]`): `FlaxGPT`, `FlaxLlama`, `FlaxNeoX` or `FlaxMoe`.

  Raises:
    KeyError: `cfg` is of no family in `MODELS`.
    InvalidArgumentError: options the model refuses (`FlaxMoe` with `scan=True` and
      dense layers, or with scaled embeddings).
  """
  model_class = MODELS[type(cfg)]
  rngs = nnx.Rngs(0) if rngs is None else rngs

  def make(rngs):
    return model_class(cfg, rngs=rngs, scan=scan)

  if mesh is None:
    return nnx.eval_shape(make, rngs) if abstract else make(rngs)
  shape_model = nnx.eval_shape(make, nnx.Rngs(0))
  target = shardings(shape_model, mesh, axis_rules=axis_rules)
  graphdef = nnx.graphdef(shape_model)
  if abstract:
    model = nnx.merge(graphdef, target)
  else:
    rng_graphdef, rng_state = nnx.split(rngs)

    def create(rng_state):
      rngs = nnx.merge(rng_graphdef, rng_state)
      return nnx.state(make(rngs)), nnx.state(rngs)

    out = (jax.tree.map(lambda t: t.sharding, target), None)
    state, rng_state = jax.jit(create, out_shardings=out)(rng_state)
    nnx.update(rngs, rng_state)
    model = nnx.merge(graphdef, state)
  _annotate(model, target, mesh)
  return model


def shardings(model: Any, mesh: jax.sharding.Mesh, *, axis_rules: AxisRules | None = None):
  """`nnx.state(model)` as `jax.ShapeDtypeStruct`s on the shardings `build` gives.

  Args:
    model: a model of this package (`build`'s), live or abstract (`nnx.eval_shape`).
    mesh: the mesh to shard over; each of `AXIS_RULES`'s axes is used where it exists
      and divides the dimension.
    axis_rules: logical axis -> mesh axis (or None) updates of `AXIS_RULES`.

  Returns:
    The model's `nnx.State`, each value a `jax.ShapeDtypeStruct` with a `NamedSharding`:
    a target for `ucp_jax.restore`.

  Raises:
    AttributeError: `model` is not one of this package's models (it has no
      `logical_axes`).

  Example:
    >>> import jax
    >>> from flax import nnx
    >>> from ucp_jax import models
    >>> from ucp_jax.models.gpt import GPTConfig
    >>> model = nnx.eval_shape(lambda: models.build(GPTConfig(num_layers=1), rngs=nnx.Rngs(0)))
    >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
    >>> target = models.shardings(model, mesh)
    >>> target["wte"]["embedding"].sharding.spec  # vocabulary over `model`, FSDP over `data`
    P('model', 'data')
  """
  from ucp_jax.models import _sharding

  rules = _sharding.merged_rules(axis_rules)
  layers = getattr(model, "layers_key", "layers")
  return _sharding.target(nnx.state(model), mesh, model.logical_axes, rules, layers)


def _annotate(model: Any, target: Any, mesh: jax.sharding.Mesh) -> None:
  """Sets each variable's `out_sharding` (and `mesh`) metadata to its sharding, so variables
  made from them (an `nnx.Optimizer`'s moments) are sharded alike. Flax shards only on a mesh
  whose axes are all Explicit or all Auto: on a mixed one the metadata is left out."""
  if not (mesh.are_all_axes_explicit or mesh.are_all_axes_auto):
    return
  for path, var in nnx.to_flat_state(nnx.state(model)):
    leaf = target
    for entry in path:
      leaf = leaf[entry]
    var.set_metadata(out_sharding=tuple(leaf.sharding.spec), mesh=mesh)
