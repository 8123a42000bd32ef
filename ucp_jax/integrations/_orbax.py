"""The ucp_jax format inside Orbax's `CheckpointManager`, as a checkpoint handler.

Orbax keeps the steps (latest step, `max_to_keep`, `save_interval_steps`, async
saves, atomic step directories); the handler writes each item as a plain ucp_jax
checkpoint at `STEP/ITEM`, which `ucp_jax.open` and `ucp_jax.restore` read
directly. An async save copies the state to host memory in `async_save` and
returns a future that writes and commits it in Orbax's background thread, after
Orbax has created the step directory.

Saves are incremental by default: the item of the manager's latest step is the base
(`ucp_jax.save(..., base=...)`), so arrays unchanged since then are not written again,
and every step stays complete on its own (deleting older steps, as `max_to_keep` does,
never breaks a newer one). `UcpSave(..., incremental=False)` writes every array.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future as ocp_future

from ucp_jax.base import _errors
from ucp_jax.store import _location, _manifest, _reader, _zarr
from ucp_jax.tree import _async, _restore, _save, _unchanged
from ucp_jax.tree._options import SaveOptions


class UcpCheckpointHandler(ocp.AsyncCheckpointHandler):
  """Saves and restores a pytree as a ucp_jax checkpoint (args: `UcpSave`, `UcpRestore`).

  Orbax picks it from the args' type, so it need not be named to the manager.

  Example:
    >>> import tempfile, jax.numpy as jnp, orbax.checkpoint as ocp
    >>> from ucp_jax.orbax import UcpRestore, UcpSave
    >>> manager = ocp.CheckpointManager(tempfile.mkdtemp())
    >>> manager.save(1, args=UcpSave({"w": jnp.ones(4)}, step=1))
    True
    >>> manager.wait_until_finished()
    >>> manager.restore(manager.latest_step(), args=UcpRestore({"w": jnp.zeros(4)}))["w"]
    Array([1., 1., 1., 1.], dtype=float32)
  """

  async def async_save(self, directory: epath.Path, args: UcpSave) -> list[ocp_future.Future]:
    """Copies the state to host memory; returns the future that writes and commits it."""
    _check_fresh(directory)
    job = _async.snapshot(str(directory), args.item, _options(directory, args))

    async def write() -> None:
      job.run()

    # Waits for the directory Orbax may still be creating, then writes.
    return [ocp_future.CommitFutureAwaitingContractedSignals(write(), name="ucp_jax_save")]

  def save(self, directory: epath.Path, args: UcpSave) -> None:
    """Saves synchronously (used by Orbax when the handler is not run asynchronously)."""
    _check_fresh(directory)
    _save.run(str(directory), args.item, _options(directory, args))

  def restore(self, directory: epath.Path, args: UcpRestore | None = None) -> Any:
    """Restores onto `args.target` (see `ucp_jax.restore`); without args, numpy arrays."""
    args = args or UcpRestore()
    return _restore.restore(
      str(directory),
      args.target,
      subtree=args.subtree,
      partial=args.partial,
      cast=args.cast,
      max_host_bytes=args.max_host_bytes,
    )

  def metadata(self, directory: epath.Path) -> _manifest.Manifest:
    """The checkpoint's manifest: step, arrays (shape, dtype), tree, user metadata."""
    return _reader.open(str(directory)).manifest


def _options(directory: epath.Path, args: UcpSave) -> SaveOptions:
  """The save's options: Orbax hands out a fresh directory for every step (nothing to
  overwrite); an incremental save takes the latest step's item as its base, its pool in the
  manager's folder."""
  incremental = _incremental(directory, args)
  return SaveOptions(
    step=args.step,
    metadata=args.metadata,
    compression=args.compression,
    max_host_bytes=args.max_host_bytes,
    chunk_bytes=args.chunk_bytes,
    bundle_bytes=args.bundle_bytes,
    durable=args.durable,
    schema=args.schema,
    base=latest_item(directory) if incremental else None,
    unchanged=args.unchanged,
    pool_levels=_POOL_LEVELS if incremental else 0,
  )


def _check_fresh(directory: epath.Path) -> None:
  """The handler's directory must be its own: Orbax gives each item of a step a fresh one."""
  path = epath.Path(directory)
  names = sorted(p.name for p in path.iterdir()) if path.exists() else []
  if names:
    raise _errors.CheckpointExistsError(
      f"{directory}: UcpCheckpointHandler writes a ucp_jax checkpoint into a directory of its "
      f"own, and this one holds {names}. Use it for an item of ocp.CheckpointManager or "
      "ocp.args.Composite (a plain ocp.Checkpointer puts its own metadata in the directory), "
      "or ucp_jax.save for a checkpoint outside Orbax."
    )


_POOL_LEVELS = 2  # on object stores, the pool of STEP/ITEM is the manager's folder's
_TMP = re.compile(r"\.orbax-checkpoint-tmp.*$")  # the suffix of a step Orbax has not finalized


def _incremental(directory: epath.Path, args: UcpSave) -> bool:
  """Whether this save may take arrays from an earlier step: as asked, except on an object
  store where Orbax moves the step into place after the save (S3: a copy), which would
  leave the pool's references naming a path that no longer holds the step."""
  local = _location.resolve(str(directory)).local_dir is not None
  return args.incremental and (local or not _TMP.search(str(directory)))


def latest_item(directory: epath.Path) -> str | None:
  """The same item in the manager's latest finalized step other than this one (its highest
  step number), when that holds a ucp_jax checkpoint: the base of an incremental save."""
  path = epath.Path(directory)
  item, step_dir = _TMP.sub("", path.name), path.parent
  named = re.fullmatch(r"(.*?)(\d+)", _TMP.sub("", step_dir.name))
  if named is None or not step_dir.parent.exists():
    return None
  prefix, current = named.group(1), int(named.group(2))
  steps = []
  for child in step_dir.parent.iterdir():
    match = re.fullmatch(re.escape(prefix) + r"(\d+)", child.name)
    if match and int(match.group(1)) != current:
      steps.append((int(match.group(1)), child / item))
  for _, candidate in sorted(steps, reverse=True):
    if (candidate / _manifest.MANIFEST_KEY).exists():
      return str(candidate)
  return None


@ocp.args.register_with_handler(UcpCheckpointHandler, for_save=True)
@dataclasses.dataclass
class UcpSave(ocp.args.CheckpointArgs):
  """Orbax save args: `item` (the state) and the options of `ucp_jax.save`.

  `incremental` (default True) takes the manager's latest step as the base of the save
  (`ucp_jax.save(..., base=...)`); `unchanged` says how unchanged arrays are known.
  `schema` is the universal parameter schema (docs/schema.md) that an export to DeepSpeed or
  Hugging Face reads: `UcpSave.train_state(model, optimizer)` fills it, as
  `ucp_jax.save_train_state` does, and `ucp_jax.restore_train_state` restores the item.

  Example:
    >>> import jax.numpy as jnp
    >>> from ucp_jax.orbax import UcpSave
    >>> UcpSave({"w": jnp.ones(2)}, step=7, metadata={"run": "a"}).step
    7
  """

  item: Any
  _: dataclasses.KW_ONLY
  step: int | None = None
  metadata: dict | None = None
  compression: str | None = None
  max_host_bytes: int = _save.DEFAULT_HOST_BYTES
  chunk_bytes: int = _zarr.CHUNK_BYTES
  bundle_bytes: int | Literal["auto"] | None = "auto"
  durable: bool = True
  incremental: bool = True
  unchanged: _unchanged.Unchanged = "identity"
  schema: dict | None = None

  @classmethod
  def train_state(
    cls,
    model: Any,
    optimizer: Any = None,
    *,
    step: int | None = None,
    hyperparams: dict | list[dict] | None = None,
    **options: Any,
  ) -> UcpSave:
    """The save args of a Flax training state with its schema, as `save_train_state` saves it.

    Example:
      >>> import optax
      >>> from flax import nnx
      >>> from ucp_jax.orbax import UcpSave
      >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      >>> args = UcpSave.train_state(model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param))
      >>> args.schema["params"]["kernel"]["slots"]["exp_avg"], args.step
      ('optimizer/opt_state/0/mu/kernel', 0)

    Args:
      model: an `nnx.Module` (with `optimizer` an `nnx.Optimizer`), or a Linen `TrainState`.
      optimizer: the `nnx.Optimizer`, for NNX.
      step: the training step (default: the optimizer's).
      hyperparams: per-group hyperparameters in torch's names, as `save_train_state` takes.
      **options: the other fields (`metadata`, `incremental`, ...).
    """
    from ucp_jax.integrations import _train_state

    item, schema = _train_state.with_schema(model, optimizer, hyperparams)
    if step is None and schema.optimizer is not None:
      step = schema.optimizer.step
    return cls(item, step=step, schema=schema.to_json(), **options)


@ocp.args.register_with_handler(UcpCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class UcpRestore(ocp.args.CheckpointArgs):
  """Orbax restore args: `target` and the options of `ucp_jax.restore`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from ucp_jax.orbax import UcpRestore
    >>> UcpRestore({"w": jax.ShapeDtypeStruct((2,), jnp.float32)}, partial=True).partial
    True
  """

  target: Any = None
  _: dataclasses.KW_ONLY
  subtree: str | None = None
  partial: bool = False
  cast: bool = False
  max_host_bytes: int = _save.DEFAULT_HOST_BYTES
