"""numpy values in a pickle, built by the safe reader from checked plain fields.

numpy pickles a dtype as ``numpy.dtype(spec, align, copy)`` followed by a BUILD state, an array
as ``_reconstruct(ndarray, (0,), b'b')`` followed by a BUILD state, a scalar as
``scalar(dtype, raw bytes)``, and (protocol 5) an array as ``_frombuffer(buffer, dtype, shape,
order)``. numpy's own ``__setstate__`` trusts its input: a state that clears an object dtype's
flags makes numpy read pointers from the pickle's bytes. So the reader never hands a pickle's
state to numpy. It allows only the plain numeric dtypes (`PLAIN_TYPES`: bool, signed and
unsigned integers, float16/32/64, complex64/128), judged by the dtype's type and fields, never
by its flags; it checks every field of a BUILD state and applies a state it builds itself from
those checked values. Anything else is a `SourceFormatError` naming the file.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from ucp_jax.base._errors import SourceFormatError

PLAIN_TYPES = frozenset(
  {np.bool_, np.float16, np.float32, np.float64, np.complex64, np.complex128}
  | {np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64}
)
_SPEC = re.compile(r"^[biufc](1|2|4|8|16)$")


def _bad(source: str, what: str) -> SourceFormatError:
  return SourceFormatError(
    f"{source}: {what}; the safe reader builds only numpy arrays and scalars of plain numeric "
    "dtypes (bool, int, uint, float, complex)"
  )


def is_plain(dtype: Any) -> bool:
  """Whether `dtype` is a numpy dtype of `PLAIN_TYPES`: no fields, no sub-array, no objects."""
  return (
    isinstance(dtype, np.dtype)
    and dtype.type in PLAIN_TYPES
    and dtype.kind in "biufc"
    and dtype.fields is None
    and dtype.subdtype is None
    and dtype.itemsize == np.dtype(dtype.type).itemsize
  )


def dtype(spec: Any, align: Any = False, copy: Any = True, *, source: str) -> np.dtype:
  """``numpy.dtype(spec, align, copy)`` for a plain spec such as ``'f4'``; a fresh object."""
  if not isinstance(spec, str) or not _SPEC.match(spec) or type(align) not in (bool, int) or align:
    raise _bad(source, f"numpy.dtype({spec!r:.40}, align={align!r:.10})")
  made = np.dtype(spec, copy=True)
  if not is_plain(made):
    raise _bad(source, f"numpy.dtype({spec!r}) is {made}")
  return made


def build_dtype(made: np.dtype, state: Any, *, source: str) -> None:
  """Applies the BUILD state of a dtype from `dtype`: its byte order, nothing else.

  numpy writes ``(3, byteorder, None, None, None, -1, -1, 0)`` for a plain dtype; any other
  value (sub-arrays, fields, sizes, flags) is refused, and numpy is given a state made here.
  """
  order = state[1] if isinstance(state, tuple) and len(state) == 8 else None
  plain = (3, order, None, None, None, -1, -1, 0)
  orders = ("<", ">", "|", "=") if made.itemsize == 1 else ("<", ">", "=")
  if type(order) is not str or order not in orders or not _same(state, plain):
    raise _bad(source, f"a numpy dtype BUILD state {state!r:.100} that is not a plain dtype's")
  if made.itemsize > 1:
    made.__setstate__(plain)
  if not is_plain(made):
    raise _bad(source, f"numpy dtype {made} after BUILD")


def build_array(array: np.ndarray, state: Any, *, source: str) -> None:
  """Applies the BUILD state of an array from ``_reconstruct``: shape, dtype, order, bytes."""
  if not (isinstance(state, tuple) and len(state) == 5 and _same(state[0], 1)):
    raise _bad(source, f"a numpy array BUILD state {state!r:.100} of an unknown form")
  _, shape, kind, fortran, raw = state
  shape = _shape(shape, source)
  if not is_plain(kind) or fortran not in (True, False) or not isinstance(raw, bytes):
    raise _bad(source, f"a numpy array of {kind!r:.40} (fortran={fortran!r:.10}) from {raw!r:.40}")
  kind = np.dtype(kind.str)  # a dtype made here, from a checked plain one
  if len(raw) != math.prod(shape) * kind.itemsize:
    raise _bad(source, f"a numpy array of shape {shape} and {kind} from {len(raw)} bytes")
  array.__setstate__((1, shape, kind, bool(fortran), raw))


def scalar(kind: Any, data: Any = None, *, source: str) -> Any:
  """``numpy.core.multiarray.scalar(dtype, raw bytes)`` for a plain dtype."""
  if not is_plain(kind) or not isinstance(data, bytes) or len(data) != kind.itemsize:
    raise _bad(source, f"a numpy scalar of {kind!r:.40} from {data!r:.40}")
  return np.frombuffer(data, np.dtype(kind.str))[0]


def frombuffer(buffer: Any, kind: Any, shape: Any, order: Any, *, source: str) -> np.ndarray:
  """``numpy.core.numeric._frombuffer(buffer, dtype, shape, order)`` for a plain dtype."""
  shape = _shape(shape, source)
  if not is_plain(kind) or order not in ("C", "F") or not isinstance(buffer, bytes | bytearray):
    raise _bad(source, f"numpy _frombuffer of {kind!r:.40}, {shape}, {order!r:.10}")
  kind = np.dtype(kind.str)
  if len(buffer) != math.prod(shape) * kind.itemsize:
    raise _bad(source, f"numpy _frombuffer of shape {shape} and {kind} from {len(buffer)} bytes")
  return np.frombuffer(bytes(buffer), kind).reshape(shape, order=order)


def _same(value: Any, plain: Any) -> bool:
  """`value == plain` for a tuple of ints, strings and None, comparing types too."""
  if isinstance(plain, tuple):
    return (
      type(value) is tuple
      and len(value) == len(plain)
      and all(_same(v, p) for v, p in zip(value, plain, strict=True))
    )
  return type(value) is type(plain) and value == plain


def _shape(shape: Any, source: str) -> tuple[int, ...]:
  if not (
    isinstance(shape, tuple) and len(shape) <= 32 and all(type(n) is int and n >= 0 for n in shape)
  ):
    raise _bad(source, f"numpy array shape {shape!r:.60} is not a tuple of at most 32 ints >= 0")
  return shape
