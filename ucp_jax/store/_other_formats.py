"""The hook through which `ucp_jax.open` reads what is not a ucp_jax checkpoint.

The store knows no format but its own; the package root installs the sources' opener here,
once. It lives apart from `_reader` so that installing it imports no TensorStore (`ucp
--help` starts at once).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

from ucp_jax.base import _errors

if TYPE_CHECKING:
  from ucp_jax.store._checkpoint import Checkpoint


class OtherFormats(Protocol):
  """Opens what is not a ucp_jax checkpoint: `(path, source)` -> a read-only view, or None
  when no source (or not the one named `source`) reads `path`."""

  def __call__(self, path: str | os.PathLike, source: str | None) -> Checkpoint | None: ...


opener: OtherFormats | None = None
"""The installed opener (None: `open` reads ucp_jax checkpoints only)."""


def read_with(new: OtherFormats) -> None:
  """Lets `open` read other formats through `new`.

  Raises:
    InvalidArgumentError: another opener is installed already.
  """
  global opener
  if opener is not None and _name(opener) != _name(new):
    raise _errors.InvalidArgumentError(
      f"open already reads other formats with {_name(opener)}; not {_name(new)}"
    )
  opener = new


def _name(fn) -> str:
  return f"{fn.__module__}.{fn.__qualname__}"
