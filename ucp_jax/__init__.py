"""ucp_jax: Universal Checkpointing for JAX.

A checkpoint holds logical, unsharded arrays by name (zarr v3 through
TensorStore, plus a manifest), never the layout that wrote them: save from any
mesh, restore onto any other, and convert PyTorch/DeepSpeed checkpoints in and out.
"""

from typing import TYPE_CHECKING

from ucp_jax.base import _startup  # first: Ctrl-C while the `ucp` command starts

if not _startup.IS_CLI:  # numpy knows bfloat16 and the float8 types by name from here on
  import ml_dtypes  # noqa: F401  (the `ucp` command imports it for the commands that read arrays)
from ucp_jax.base._errors import ArrayNotFoundError as ArrayNotFoundError
from ucp_jax.base._errors import CheckpointExistsError as CheckpointExistsError
from ucp_jax.base._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ucp_jax.base._errors import CommitUncertainError as CommitUncertainError
from ucp_jax.base._errors import ConcurrentWriteError as ConcurrentWriteError
from ucp_jax.base._errors import CorruptCheckpointError as CorruptCheckpointError
from ucp_jax.base._errors import DtypeMismatchError as DtypeMismatchError
from ucp_jax.base._errors import InsufficientMemoryError as InsufficientMemoryError
from ucp_jax.base._errors import InvalidArgumentError as InvalidArgumentError
from ucp_jax.base._errors import InvalidKeyError as InvalidKeyError
from ucp_jax.base._errors import ManifestError as ManifestError
from ucp_jax.base._errors import MappingError as MappingError
from ucp_jax.base._errors import MissingDependencyError as MissingDependencyError
from ucp_jax.base._errors import RegionError as RegionError
from ucp_jax.base._errors import ShapeMismatchError as ShapeMismatchError
from ucp_jax.base._errors import ShardingError as ShardingError
from ucp_jax.base._errors import SourceFormatError as SourceFormatError
from ucp_jax.base._errors import StorageError as StorageError
from ucp_jax.base._errors import TreeMismatchError as TreeMismatchError
from ucp_jax.base._errors import UcpError as UcpError
from ucp_jax.base._errors import UnsafePickleError as UnsafePickleError
from ucp_jax.base._errors import UnsupportedLeafError as UnsupportedLeafError
from ucp_jax.store import _lazy
from ucp_jax.store._zarr_python import register_when_imported as _register_zarr_dtypes

_register_zarr_dtypes()  # zarr-python reads bfloat16 and float8 arrays

# The rest loads on first use (PEP 562), so `ucp --help` starts without TensorStore, and
# `ucp inspect`, `ucp convert` and the converters without JAX.
_LAZY = {
  "Checkpoint": ("ucp_jax.store._checkpoint", "Checkpoint"),
  "ArrayInfo": ("ucp_jax.store._manifest", "ArrayInfo"),
  "Manifest": ("ucp_jax.store._manifest", "Manifest"),
  "Schema": ("ucp_jax.store._schema", "Schema"),
  "open": ("ucp_jax.store._reader", "open"),
  "rules": ("ucp_jax.rules", None),
  "SaveHandle": ("ucp_jax.tree._pending", "SaveHandle"),
  "save_async": ("ucp_jax.tree._async", "save_async"),
  "wait_until_finished": ("ucp_jax.tree._pending", "wait_until_finished"),
  "ConvertReport": ("ucp_jax.sources._convert", "ConvertReport"),
  "convert": ("ucp_jax.sources._convert", "convert"),
  "ExportReport": ("ucp_jax.sinks._report", "ExportReport"),
  "DiffReport": ("ucp_jax._diff", "DiffReport"),
  "diff": ("ucp_jax._diff", "diff"),
  "export": ("ucp_jax._api", "export"),
  "reshard": ("ucp_jax.tree._reshard", "reshard"),
  "reshard_method": ("ucp_jax.tree._reshard", "reshard_method"),
  "restore": ("ucp_jax.tree._restore", "restore"),
  "save": ("ucp_jax.tree._save", "save"),
  "tp_shardings": ("ucp_jax.parallel._tp_shardings", "tp_shardings"),
  "restore_train_state": ("ucp_jax.integrations._train_state", "restore_train_state"),
  "save_train_state": ("ucp_jax.integrations._train_state", "save_train_state"),
}


if TYPE_CHECKING:  # what the names below are, for type checkers (loaded on first use)
  from ucp_jax import rules as rules
  from ucp_jax._api import export as export
  from ucp_jax._diff import DiffReport as DiffReport
  from ucp_jax._diff import diff as diff
  from ucp_jax.integrations._train_state import restore_train_state as restore_train_state
  from ucp_jax.integrations._train_state import save_train_state as save_train_state
  from ucp_jax.parallel._tp_shardings import tp_shardings as tp_shardings
  from ucp_jax.sinks._report import ExportReport as ExportReport
  from ucp_jax.sources._convert import ConvertReport as ConvertReport
  from ucp_jax.sources._convert import convert as convert
  from ucp_jax.store._checkpoint import Checkpoint as Checkpoint
  from ucp_jax.store._manifest import ArrayInfo as ArrayInfo
  from ucp_jax.store._manifest import Manifest as Manifest
  from ucp_jax.store._reader import open as open
  from ucp_jax.store._schema import Schema as Schema
  from ucp_jax.tree._async import save_async as save_async
  from ucp_jax.tree._pending import SaveHandle as SaveHandle
  from ucp_jax.tree._pending import wait_until_finished as wait_until_finished
  from ucp_jax.tree._reshard import reshard as reshard
  from ucp_jax.tree._reshard import reshard_method as reshard_method
  from ucp_jax.tree._restore import restore as restore
  from ucp_jax.tree._save import save as save

__getattr__, __dir__ = _lazy.attributes("ucp_jax", globals(), _LAZY)


__version__ = "0.1.0"

__all__ = [
  "ArrayInfo",
  "ArrayNotFoundError",
  "Checkpoint",
  "CheckpointExistsError",
  "CheckpointNotFoundError",
  "ConcurrentWriteError",
  "ConvertReport",
  "CorruptCheckpointError",
  "DiffReport",
  "DtypeMismatchError",
  "ExportReport",
  "InsufficientMemoryError",
  "InvalidArgumentError",
  "InvalidKeyError",
  "Manifest",
  "ManifestError",
  "MappingError",
  "MissingDependencyError",
  "RegionError",
  "SaveHandle",
  "Schema",
  "ShapeMismatchError",
  "ShardingError",
  "SourceFormatError",
  "StorageError",
  "CommitUncertainError",
  "TreeMismatchError",
  "UcpError",
  "UnsafePickleError",
  "UnsupportedLeafError",
  "convert",
  "diff",
  "export",
  "open",
  "reshard",
  "reshard_method",
  "restore",
  "restore_train_state",
  "rules",
  "save",
  "save_async",
  "save_train_state",
  "tp_shardings",
  "wait_until_finished",
]
