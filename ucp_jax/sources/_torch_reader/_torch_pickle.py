"""A restricted unpickler: it builds data and never runs pickled code.

It subclasses the pure-Python `pickle._Unpickler` and replaces every opcode that calls, mutates or
looks something up, so the policy below holds for any byte stream, not only for well-formed ones.
Three kinds of global, from most to least trusted:

* **Allowed** (an explicit list; each is a wrapper written here or in `_torch_file` that checks its
  arguments): `collections.OrderedDict`, `collections.defaultdict` (read as a plain dict),
  `builtins.set`, `frozenset`, `complex`, `slice`, `range`, `bytearray`, `bytes`, `_codecs.encode`
  (text to bytes: how pickle protocol 2 stores bytes), numpy's `_reconstruct`, `scalar`, `dtype` and
  `_frombuffer` (under `numpy.core` or `numpy._core`), `copyreg._reconstructor` of an inert class,
  and the torch names that the caller adds (see `_torch_file`).
* **Refused** with `UnsafePickleError` as soon as the pickle names them: globals whose only use in a
  pickle is to run code or reach the system: `builtins.eval`, `exec`, `compile`, `getattr`,
  `setattr`, `delattr`, `__import__`, `open`, ... and anything in `os`, `posix`, `nt`, `subprocess`,
  `sys`, `importlib`, `runpy`, `pickle`, `marshal`, `types`, `ctypes`, `shutil`, `socket`, ...
  Also refused: the EXT1/EXT2/EXT4 opcodes (they read the process-wide copyreg extension registry
  and its cache, around `find_class`), calling anything other than an allowed or inert global, and
  BUILD, SETITEM(S), APPEND(S), ADDITEMS on objects other than the ones the reader just made.
* **Inert**: every other global becomes an `InertGlobal`; nothing is imported or looked up.
  Calling one (REDUCE, NEWOBJ, NEWOBJ_EX, INST, OBJ) gives an `InertObject` that records the
  arguments; BUILD, SETITEMS and APPENDS on the record store its state and items. An enum member
  comes out as ``InertObject("pkg.Enum", args=(value,))``.

Python 2 names (``__builtin__``, ``copy_reg``) are read as their Python 3 names first. numpy
values are built from checked plain fields, never by numpy's ``__setstate__`` on the pickle's
state (`_pickle_numpy`). What a pickle may ask for (size, objects, memo, nesting, the expanded
size of its tree) is bounded by `_pickle_limits`, and a finished tree has no cycles.
"""

from __future__ import annotations

import _compat_pickle
import collections
import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from ucp_jax.base._errors import SourceFormatError, UcpError
from ucp_jax.sources._torch_reader import _pickle_limits as limits
from ucp_jax.sources._torch_reader import _pickle_numpy
from ucp_jax.sources._torch_reader._pickle_records import (
  NDARRAY,
  Allowed,
  InertGlobal,
  InertObject,
  call,
  unsafe,
)

_REFUSED_MODULES = frozenset(
  {"os", "posix", "nt", "subprocess", "_posixsubprocess", "sys", "importlib", "runpy", "pickle"}
  | {"_pickle", "marshal", "types", "code", "codeop", "ctypes", "_ctypes", "shutil", "socket"}
  | {"pty", "multiprocessing", "pdb", "webbrowser", "io", "_io"}
)
_REFUSED_BUILTINS = frozenset(
  {"eval", "exec", "compile", "getattr", "setattr", "delattr", "__import__", "open", "input"}
  | {"breakpoint", "globals", "locals", "vars", "help", "exit", "quit", "__build_class__"}
)
_TEXT_ENCODINGS = frozenset({"latin1", "latin-1", "utf-8", "utf8", "ascii"})
# Allowed globals: (module, name) -> the `_SafeUnpickler` method that stands in for it.
_BUILTIN_GLOBALS = {
  ("collections", "OrderedDict"): "_ordered_dict",
  ("collections", "defaultdict"): "_defaultdict",
  ("builtins", "set"): "_set",
  ("builtins", "frozenset"): "_frozenset",
  ("builtins", "complex"): "_complex",
  ("builtins", "slice"): "_slice",
  ("builtins", "range"): "_range",
  ("builtins", "bytearray"): "_bytearray",
  ("builtins", "bytes"): "_bytes",
  ("_codecs", "encode"): "_encode",
  ("copyreg", "_reconstructor"): "_reconstructor",
  ("numpy", "dtype"): "_np_dtype",
}
for _numpy in ("numpy.core", "numpy._core"):
  _BUILTIN_GLOBALS[(f"{_numpy}.multiarray", "_reconstruct")] = "_np_reconstruct"
  _BUILTIN_GLOBALS[(f"{_numpy}.multiarray", "scalar")] = "_np_scalar"
  _BUILTIN_GLOBALS[(f"{_numpy}.numeric", "_frombuffer")] = "_np_frombuffer"


def loads(
  data: bytes,
  *,
  source: str,
  extra_globals: Mapping[tuple[str, str], Any] | None = None,
  persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
  """Unpickles `data` under the policy of this module.

  Args:
    data: the pickle bytes.
    source: names the data in error messages (the file path).
    extra_globals: (module, name) -> value for more allowed globals: an `Allowed` to let the
      pickle call a function, any other value to use as is (a dtype, say). Refusals come first.
    persistent_load: resolves persistent ids; None refuses them.

  Returns:
    The object tree: builtins, numpy values, `InertGlobal`, `InertObject`, and the extras.

  Raises:
    UnsafePickleError: the pickle asks for something that can run code.
    SourceFormatError: the pickle is malformed, or goes past a limit of `_pickle_limits`.
  """
  if len(data) > limits.MAX_PICKLE_BYTES:
    raise limits.exceeded(source, "the pickle's size", limits.MAX_PICKLE_BYTES, "MAX_PICKLE_BYTES")
  unpickler = _SafeUnpickler(data, source, extra_globals or {}, persistent_load)
  try:
    tree = unpickler.load()
  except UcpError:
    raise
  except Exception as e:
    raise SourceFormatError(f"{source}: not a valid pickle ({type(e).__name__}: {e!s:.200})") from e
  limits.check_tree(tree, source)
  return tree


def _modern_name(module: str, name: str) -> tuple[str, str]:
  if (module, name) in _compat_pickle.NAME_MAPPING:
    return _compat_pickle.NAME_MAPPING[(module, name)]
  return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _is_refused(module: str, name: str) -> bool:
  if module.split(".")[0] in _REFUSED_MODULES:
    return True
  return module == "builtins" and name.split(".")[0] in _REFUSED_BUILTINS


class _SafeUnpickler(limits.Budget, pickle._Unpickler):
  """`pickle._Unpickler` with every calling or mutating opcode replaced; see the module doc.

  `limits.Budget` holds it to the limits of `_pickle_limits` as it runs.
  """

  dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)

  def __init__(
    self,
    data: bytes,
    source: str,
    extra_globals: Mapping[tuple[str, str], Any],
    persistent_load: Callable[[Any], Any] | None,
  ) -> None:
    super().__init__(io.BytesIO(data), encoding="utf-8")
    self._source = source
    self._extra_globals = extra_globals
    self._persistent_load = persistent_load
    self._fresh: dict[int, Any] = {}  # objects made here that one BUILD may still fill
    self._steps = 0  # of limits.MAX_STEPS
    self._shapes: dict[int, tuple[Any, int, int]] = {}  # see limits.Budget

  def _bad(self, what: str) -> SourceFormatError:
    return SourceFormatError(f"{self._source}: {what}")

  def _new(self, obj: Any) -> Any:
    self._fresh[id(obj)] = obj
    return obj

  def find_class(self, module: str, name: str) -> Any:
    module, name = _modern_name(module, name)
    if _is_refused(module, name):
      raise unsafe(self._source, f"global `{module}.{name}` can run code or reach the system")
    if (module, name) in self._extra_globals:
      return self._extra_globals[(module, name)]
    if (module, name) == ("numpy", "ndarray"):
      return NDARRAY
    method = _BUILTIN_GLOBALS.get((module, name))
    if method is None:
      return InertGlobal(f"{module}.{name}")
    return Allowed(f"{module}.{name}", getattr(self, method))

  def persistent_load(self, pid: Any) -> Any:
    if self._persistent_load is None:
      raise self._bad(f"persistent id {pid!r:.80} outside a torch file")
    return self._persistent_load(pid)

  # Opcodes that make tuples, frozensets and dicts.

  def _load_tuple(self) -> None:
    items = self.pop_mark()  # before `self.append`: pop_mark rebinds it
    self.append(self._made(tuple(items)))

  def _load_tuple1(self) -> None:
    self.stack[-1] = self._made((self.stack[-1],))

  def _load_tuple2(self) -> None:
    self.stack[-2:] = [self._made((self.stack[-2], self.stack[-1]))]

  def _load_tuple3(self) -> None:
    self.stack[-3:] = [self._made((self.stack[-3], self.stack[-2], self.stack[-1]))]

  def _load_frozenset(self) -> None:
    items = self.pop_mark()
    self._hashing(items)
    self.append(self._made(frozenset(items)))

  def _load_dict(self) -> None:
    items = self.pop_mark()
    if len(items) % 2:
      raise self._bad("DICT with an odd number of items")
    self._hashing(items[::2])
    self.append(dict(zip(items[::2], items[1::2], strict=True)))

  # Opcodes that call.

  def _call(self, func: Any, args: Any, kwargs: Any = None) -> Any:
    return self._made(call(func, args, source=self._source, kwargs=kwargs))

  def _load_reduce(self) -> None:  # also NEWOBJ: cls.__new__(cls, *args) is a call here
    args = self.stack.pop()
    self.stack[-1] = self._call(self.stack[-1], args)

  def _load_newobj_ex(self) -> None:
    kwargs = self.stack.pop()
    args = self.stack.pop()
    self.stack[-1] = self._call(self.stack[-1], args, kwargs)

  def _instantiate(self, klass: Any, args: list) -> None:  # INST and OBJ
    self.append(self._call(klass, self._made(tuple(args))))

  def _refuse_ext(self) -> None:
    raise unsafe(self._source, "an EXT opcode reads the process-wide copyreg extension registry")

  # Opcodes that fill an object.

  def _load_build(self) -> None:
    state = self.stack.pop()
    inst = self.stack[-1]
    if type(inst) is InertObject:
      object.__setattr__(inst, "state", state)
    elif self._fresh.pop(id(inst), None) is not inst:
      raise unsafe(
        self._source, f"BUILD on an object of type {type(inst).__name__} it did not just make"
      )
    elif isinstance(inst, np.dtype):
      _pickle_numpy.build_dtype(inst, state, source=self._source)
    elif isinstance(inst, np.ndarray):
      _pickle_numpy.build_array(inst, state, source=self._source)
    else:  # an OrderedDict: a state_dict's `_metadata`
      bad = not isinstance(state, dict) or not all(_is_attribute(k) for k in state)
      if bad:
        raise self._bad(f"OrderedDict state {state!r:.80} is not a dict of new attribute names")
      inst.__dict__.update(state)

  def _set_items(self, items: list) -> None:
    target = self.stack[-1]
    if type(target) is InertObject:
      if target.dictitems is None:
        object.__setattr__(target, "dictitems", {})
      target = target.dictitems
    elif type(target) not in (dict, collections.OrderedDict):
      raise unsafe(self._source, f"SETITEM on an object of type {type(target).__name__}")
    if len(items) % 2:
      raise self._bad("SETITEMS with an odd number of items")
    self._hashing(items[::2])
    for i in range(0, len(items), 2):
      target[items[i]] = items[i + 1]

  def _load_setitem(self) -> None:
    value = self.stack.pop()
    key = self.stack.pop()
    self._set_items([key, value])

  def _load_setitems(self) -> None:
    self._set_items(self.pop_mark())

  def _extend(self, items: list) -> None:
    target = self.stack[-1]
    if type(target) is InertObject:
      if target.listitems is None:
        object.__setattr__(target, "listitems", [])
      target = target.listitems
    elif type(target) is not list:
      raise unsafe(self._source, f"APPEND on an object of type {type(target).__name__}")
    target.extend(items)

  def _load_append(self) -> None:
    self._extend([self.stack.pop()])

  def _load_appends(self) -> None:
    self._extend(self.pop_mark())

  def _load_additems(self) -> None:
    items = self.pop_mark()
    if type(self.stack[-1]) is not set:
      raise unsafe(self._source, f"ADDITEMS on an object of type {type(self.stack[-1]).__name__}")
    self._hashing(items)
    self.stack[-1].update(items)

  for _op, _fn in [
    (pickle.TUPLE, _load_tuple),
    (pickle.TUPLE1, _load_tuple1),
    (pickle.TUPLE2, _load_tuple2),
    (pickle.TUPLE3, _load_tuple3),
    (pickle.FROZENSET, _load_frozenset),
    (pickle.DICT, _load_dict),
    (pickle.REDUCE, _load_reduce),
    (pickle.NEWOBJ, _load_reduce),
    (pickle.NEWOBJ_EX, _load_newobj_ex),
    (pickle.EXT1, _refuse_ext),
    (pickle.EXT2, _refuse_ext),
    (pickle.EXT4, _refuse_ext),
    (pickle.BUILD, _load_build),
    (pickle.SETITEM, _load_setitem),
    (pickle.SETITEMS, _load_setitems),
    (pickle.APPEND, _load_append),
    (pickle.APPENDS, _load_appends),
    (pickle.ADDITEMS, _load_additems),
  ]:
    dispatch[_op[0]] = _fn
  for _op in (pickle.PUT, pickle.BINPUT, pickle.LONG_BINPUT, pickle.MEMOIZE):
    dispatch[_op[0]] = limits.memo_limited(dispatch[_op[0]])
  dispatch = {code: limits.counted(fn, code) for code, fn in dispatch.items()}
  del _op, _fn

  # Allowed globals.

  def _items(self, items: Any, what: str) -> list | tuple:
    if type(items) not in (list, tuple):
      raise self._bad(f"{what} of a {type(items).__name__}, not of a list or tuple")
    return items

  def _ordered_dict(self, items=()):
    pairs = self._items(items, "OrderedDict")
    if not all(type(p) in (tuple, list) and len(p) == 2 for p in pairs):
      raise self._bad("OrderedDict of items that are not (key, value) pairs")
    self._hashing([key for key, _ in pairs])
    return self._new(collections.OrderedDict(tuple(p) for p in pairs))

  def _defaultdict(self, default_factory=None, *args):
    if args:
      raise self._bad("defaultdict with initial items (torch pickles add them with SETITEMS)")
    return {}

  def _set(self, items=()):
    items = self._items(items, "set")
    self._hashing(items)
    return set(items)

  def _frozenset(self, items=()):
    items = self._items(items, "frozenset")
    self._hashing(items)
    return frozenset(items)

  def _complex(self, real=0.0, imag=0.0):
    if not all(type(v) in (int, float) for v in (real, imag)):
      raise self._bad(f"complex({real!r:.40}, {imag!r:.40})")
    return complex(real, imag)

  def _slice(self, *args):
    if len(args) > 3 or not all(v is None or type(v) is int for v in args):
      raise self._bad(f"slice{args!r:.80}")
    return slice(*args)

  def _range(self, *args):
    if not 1 <= len(args) <= 3 or not all(type(v) is int for v in args):
      raise self._bad(f"range{args!r:.80}")
    return range(*args)

  def _bytearray(self, source=b"", encoding=None):
    if isinstance(source, str):
      return bytearray(self._encode(source, encoding))
    if not isinstance(source, bytes):
      raise self._bad(f"bytearray({source!r:.40})")
    return bytearray(source)

  def _bytes(self, source=b""):  # protocol 2 writes b"" as bytes()
    if not isinstance(source, bytes):
      raise self._bad(f"bytes({source!r:.40})")
    return source

  def _encode(self, text, encoding="utf-8"):
    if not isinstance(text, str) or encoding not in _TEXT_ENCODINGS:
      raise self._bad(f"_codecs.encode({text!r:.40}, {encoding!r:.20})")
    return text.encode(encoding)

  def _reconstructor(self, cls, base, state):
    if type(cls) is not InertGlobal or cls == NDARRAY:
      raise unsafe(self._source, f"copyreg._reconstructor of {getattr(cls, 'qualname', cls)!r:.80}")
    return InertObject(cls.qualname, () if state is None else (state,))

  def _np_reconstruct(self, subtype, shape, dtype):
    if type(subtype) is not InertGlobal or subtype != NDARRAY:
      raise unsafe(self._source, f"numpy _reconstruct of {subtype!r:.80}, not of numpy.ndarray")
    return self._new(np.empty(0, np.uint8))

  def _np_dtype(self, spec, align=False, copy=True):
    return self._new(_pickle_numpy.dtype(spec, align, copy, source=self._source))

  def _np_scalar(self, dtype, data=None):
    return _pickle_numpy.scalar(dtype, data, source=self._source)

  def _np_frombuffer(self, buffer, dtype, shape, order):
    return _pickle_numpy.frombuffer(buffer, dtype, shape, order, source=self._source)


def _is_attribute(name: Any) -> bool:
  """A name BUILD may set on an OrderedDict: new (`_metadata`), never one that hides a method."""
  return (
    type(name) is str and not name.startswith("__") and not hasattr(collections.OrderedDict, name)
  )
