"""A save's options as one value: built by `save`, `save_async` and the Orbax handler from
their keywords, checked once, and passed down whole."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Literal

from ucp_jax.base import _errors
from ucp_jax.store import _bundle, _schema, _zarr
from ucp_jax.tree import _unchanged

if TYPE_CHECKING:
  from ucp_jax.store._checkpoint import Checkpoint

DEFAULT_HOST_BYTES = 1 << 30
"""Default bound on host memory held by array data in flight during a save or restore."""


@dataclasses.dataclass(frozen=True)
class SaveOptions:
  """What a save is asked to do besides writing its tree (`ucp_jax.save` says what each is).

  `pool_levels` places the pool of an incremental save on an object store that many folders
  up (the Orbax handler's: the manager's folder); None: beside the checkpoint, or the base's.
  """

  step: int | None = None
  metadata: dict | None = None
  overwrite: bool = False
  compression: str | None = None
  max_host_bytes: int = DEFAULT_HOST_BYTES
  chunk_bytes: int = _zarr.CHUNK_BYTES
  bundle_bytes: int | Literal["auto"] | None = "auto"
  durable: bool = True
  schema: _schema.Schema | dict | None = None  # stored as its JSON, checked (`checked`)
  source: dict | None = None
  base: str | os.PathLike | Checkpoint | None = None
  unchanged: _unchanged.Unchanged = "identity"
  pool_levels: int | None = None

  @classmethod
  def of(cls, keywords: dict) -> SaveOptions:
    """The options among `keywords` (a public function's `locals()`: its keyword arguments,
    named as here)."""
    return cls(**{f.name: keywords[f.name] for f in dataclasses.fields(cls) if f.name in keywords})

  def checked(self) -> SaveOptions:
    """These options, once each is known valid (raises `InvalidArgumentError` otherwise),
    the schema in the JSON form the manifest stores."""
    _zarr.check_compression(self.compression)
    _zarr.check_chunk_bytes(self.chunk_bytes)
    _unchanged.check_mode(self.unchanged)
    if self.bundle_bytes != _bundle.AUTO:
      _bundle.check_limit(self.bundle_bytes)  # type: ignore[arg-type]
    schema = _schema.written(self.schema, "schema=", _errors.InvalidArgumentError)
    return dataclasses.replace(self, schema=schema)

  def bundle_limit(self, local: bool) -> int | None:
    """`bundle_bytes` for a save to a local disk (`local`) or an object store."""
    return _bundle.limit_for(local, self.bundle_bytes)

  @property
  def schema_json(self) -> dict | None:
    """The schema as the manifest stores it (its canonical JSON, once `checked`)."""
    assert not isinstance(self.schema, _schema.Schema), "the options are not checked yet"
    return self.schema

  @property
  def hashed(self) -> bool:
    """Whether the save records the sha256 of every chunk (`unchanged="sha256"`)."""
    return self.unchanged == "sha256"
