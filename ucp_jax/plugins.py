"""Formats as plugins: a package adds a format ucp_jax reads or writes without editing it.

A *source* reads a format: `sniff(path)` says whether a path is its own, and
`describe(path, **options)` returns a `Plan` of its arrays (names, shapes, dtypes, and a
way to read any region: `lazy_tensor`) without reading their data. `ucp_jax.open`,
`restore`, `convert`, `ucp inspect` and `ucp convert` then read it like any other.

A *sink* writes a format: `export(ckpt, dst, ...)` receives an open `Checkpoint` (its
`keys()`, each key's `ArrayInfo`, `read(key, region)`, the manifest's schema and step) and
returns an `ExportReport`. `ucp_jax.export(..., format=NAME)` and `ucp export --format NAME`
then write it.

Code registers plugins with `register_source` and `register_sink`; an installed package
declares them as entry points (groups `ucp_jax.sources` and `ucp_jax.sinks`, each name the
plugin's `NAME`), which ucp_jax reads once, on the first look-up, importing a plugin only
when it is used. A name is taken once. docs/plugins.md has a complete example.
"""

from ucp_jax.sinks._registry import Destination as Destination
from ucp_jax.sinks._registry import NoOptions as NoOptions
from ucp_jax.sinks._registry import Sink as Sink
from ucp_jax.sinks._registry import option as option
from ucp_jax.sinks._registry import register as register_sink
from ucp_jax.sinks._report import ExportReport as ExportReport
from ucp_jax.sources._registry import Source as Source
from ucp_jax.sources._registry import register as register_source
from ucp_jax.sources._source_plan import Plan as Plan
from ucp_jax.sources._source_plan import SourceParam as SourceParam
from ucp_jax.sources._source_plan import Tensor as Tensor
from ucp_jax.sources._source_plan import lazy_tensor as lazy_tensor
from ucp_jax.store._checkpoint import Checkpoint as Checkpoint
from ucp_jax.store._manifest import ArrayInfo as ArrayInfo
from ucp_jax.store._schema import GroupEntry as GroupEntry
from ucp_jax.store._schema import Optimizer as Optimizer
from ucp_jax.store._schema import ParamEntry as ParamEntry
from ucp_jax.store._schema import Schema as Schema

__all__ = [
  "ArrayInfo",
  "Checkpoint",
  "Destination",
  "ExportReport",
  "NoOptions",
  "GroupEntry",
  "Optimizer",
  "ParamEntry",
  "SourceParam",
  "Plan",
  "Schema",
  "Sink",
  "Source",
  "Tensor",
  "lazy_tensor",
  "option",
  "register_sink",
  "register_source",
]
