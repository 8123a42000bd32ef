"""ucp_jax: Universal Checkpointing for JAX.

A checkpoint holds logical, unsharded arrays by name (zarr v3 through
TensorStore, plus a manifest), never the layout that wrote them: save from any
mesh, restore onto any other, and convert PyTorch/DeepSpeed checkpoints in and out.
"""

from ucp_jax import rules as rules
from ucp_jax._async import SaveHandle as SaveHandle
from ucp_jax._async import save_async as save_async
from ucp_jax._async import wait_until_finished as wait_until_finished
from ucp_jax._convert import ConvertReport as ConvertReport
from ucp_jax._convert import convert as convert
from ucp_jax._errors import CheckpointExistsError as CheckpointExistsError
from ucp_jax._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ucp_jax._errors import ConcurrentWriteError as ConcurrentWriteError
from ucp_jax._errors import CorruptCheckpointError as CorruptCheckpointError
from ucp_jax._errors import DtypeMismatchError as DtypeMismatchError
from ucp_jax._errors import ManifestError as ManifestError
from ucp_jax._errors import MappingError as MappingError
from ucp_jax._errors import MissingDependencyError as MissingDependencyError
from ucp_jax._errors import ShapeMismatchError as ShapeMismatchError
from ucp_jax._errors import ShardingError as ShardingError
from ucp_jax._errors import SourceFormatError as SourceFormatError
from ucp_jax._errors import TreeMismatchError as TreeMismatchError
from ucp_jax._errors import UcpError as UcpError
from ucp_jax._errors import UnsafePickleError as UnsafePickleError
from ucp_jax._errors import UnsupportedLeafError as UnsupportedLeafError
from ucp_jax._export import ExportReport as ExportReport
from ucp_jax._export import export as export
from ucp_jax._manifest import ArrayInfo as ArrayInfo
from ucp_jax._manifest import Manifest as Manifest
from ucp_jax._reader import Checkpoint as Checkpoint
from ucp_jax._reader import open as open
from ucp_jax._reshard import reshard as reshard
from ucp_jax._restore import restore as restore
from ucp_jax._save import save as save
from ucp_jax._tp_shardings import tp_shardings as tp_shardings
from ucp_jax._train_state import restore_train_state as restore_train_state
from ucp_jax._train_state import save_train_state as save_train_state

__version__ = "0.1.0"

__all__ = [
  "ArrayInfo",
  "Checkpoint",
  "CheckpointExistsError",
  "CheckpointNotFoundError",
  "ConcurrentWriteError",
  "ConvertReport",
  "CorruptCheckpointError",
  "DtypeMismatchError",
  "ExportReport",
  "Manifest",
  "ManifestError",
  "MappingError",
  "MissingDependencyError",
  "SaveHandle",
  "ShapeMismatchError",
  "ShardingError",
  "SourceFormatError",
  "TreeMismatchError",
  "UcpError",
  "UnsafePickleError",
  "UnsupportedLeafError",
  "convert",
  "export",
  "open",
  "reshard",
  "restore",
  "restore_train_state",
  "rules",
  "save",
  "save_async",
  "save_train_state",
  "tp_shardings",
  "wait_until_finished",
]
