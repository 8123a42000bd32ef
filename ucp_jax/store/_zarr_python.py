"""The data types of machine learning that zarr-python does not know, taught to it.

A checkpoint's arrays are zarr v3 arrays that any zarr reader opens, but zarr-python 3 knows
only numpy's own data types: a `bfloat16` or `float8_e4m3fn` array, the ones large models are
trained in, stops it ("No Zarr data type found"), and so does listing a group that holds one.
zarr-python has a registry for more, which this module fills with ml_dtypes' floats, stored
as TensorStore stores them (named as numpy names them, little-endian, fill value a JSON
number or "NaN"/"Infinity"). `import ucp_jax` registers them: at once when zarr is already
imported, else the moment it is (an import hook; ucp_jax never imports zarr itself). The
package also declares them as `zarr.data_type` entry points, for the zarr releases that load
those (3.1 collects them and never does). Sub-byte types (`int4`, `float4_e2m1fn`) are left
out: no writer agrees yet on how to lay them out.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import sys
import warnings

NAMES = (
  "bfloat16",
  "float8_e3m4",
  "float8_e4m3b11fnuz",
  "float8_e4m3fn",
  "float8_e4m3fnuz",
  "float8_e5m2",
  "float8_e5m2fnuz",
  "float8_e8m0fnu",
)


def _data_type(name: str) -> type:
  """A zarr-python data type class for the ml_dtypes float `name`."""
  import ml_dtypes  # here, not at import: `import ucp_jax` stays light
  import numpy as np
  from zarr.core.dtype.npy.float import BaseFloat

  dtype = np.dtype(getattr(ml_dtypes, name))

  def to_native_dtype(self) -> np.dtype:
    return dtype

  namespace = {
    "__doc__": f"The {name} data type of ml_dtypes, as TensorStore stores it in zarr.",
    "__module__": __name__,
    "dtype_cls": type(dtype),
    "_zarr_v3_name": name,
    "_zarr_v2_names": (dtype.str,),
    "item_size": property(lambda self: dtype.itemsize),
    "to_native_dtype": to_native_dtype,
  }
  return dataclasses.dataclass(frozen=True, kw_only=True)(
    type(_class_name(name), (BaseFloat,), namespace)
  )


def _class_name(name: str) -> str:
  return "".join(part.capitalize() for part in name.split("_"))


def __getattr__(attr: str) -> type:  # the entry points name the classes: Bfloat16, Float8E4m3fn
  for name in NAMES:
    if _class_name(name) == attr:
      cls = _data_type(name)
      globals()[attr] = cls
      return cls
  raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def register() -> None:
  """Adds the data types to zarr-python's registry (idempotent)."""
  from zarr.core.dtype import data_type_registry

  for name in NAMES:
    data_type_registry.register(name, __getattr__(_class_name(name)))
  # A checkpoint's manifest sits beside its arrays, where zarr-python warns on listing a group.
  warnings.filterwarnings("ignore", r"Object at manifest\.json is not recognized")


def register_when_imported() -> None:
  """`register` now if zarr-python is imported, else right after its import (ucp_jax does not
  import it: most programs never use it)."""
  if "zarr" in sys.modules:
    register()
  elif not any(isinstance(f, _AfterZarr) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterZarr())


class _AfterZarr(importlib.abc.MetaPathFinder):
  """Finds `zarr` as the other finders do, and registers the data types once it has loaded."""

  def find_spec(self, fullname, path, target=None):
    if fullname != "zarr":
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(fullname)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
      return spec
    loader = spec.loader

    class Then(importlib.abc.Loader):
      def create_module(self, spec):
        return loader.create_module(spec)

      def exec_module(self, module):
        loader.exec_module(module)
        register()

    spec.loader = Then()
    return spec
