"""Malicious pickles: the safe reader never runs them.

Every payload tries to create a canary file. Each is loaded raw and as the `data.pkl` of an
otherwise valid torch zip file: the canary must never appear, and the load must give inert data
or raise `UnsafePickleError` (a few broken payloads: `SourceFormatError`), as the corpus says. A
control test shows that plain `pickle.loads` does run the live payloads, so the corpus has teeth.
"""

from __future__ import annotations

import collections
import copyreg
import functools
import os
import pickle
import re
import shlex
import subprocess
import zipfile

import hostile_corpus as corpus
import numpy as np
import pytest

from ucp_jax.base._errors import SourceFormatError, UnsafePickleError
from ucp_jax.sources._torch_reader import _pickle_limits, _torch_pickle
from ucp_jax.sources._torch_reader._torch_file import InertGlobal, InertObject, load

REFUSED, INERT, MALFORMED = "refused", "inert", "malformed"


class _Reduce:
  """Pickles as the call `fn(*args)`."""

  def __init__(self, fn, *args):
    self.fn, self.args = fn, args

  def __reduce__(self):
    return self.fn, self.args


def _cmd(canary: str) -> str:
  return f"touch {shlex.quote(canary)}"


def _code(canary: str) -> str:
  return f"open({canary!r}, 'w').close()"


def _dumps(obj, protocol=2) -> bytes:
  return pickle.dumps(obj, protocol=protocol)


def _short_str(text: str) -> bytes:  # SHORT_BINUNICODE
  data = text.encode()
  return b"\x8c" + bytes([len(data)]) + data


def _short_bytes(data: bytes) -> bytes:  # SHORT_BINBYTES
  return b"C" + bytes([len(data)]) + data


def _system(c):
  return _dumps(_Reduce(os.system, _cmd(c)))


# name -> (builder of the payload for a canary path, live under plain pickle, expected outcome)
_PAYLOADS = {
  **{
    f"os.system/protocol{p}": (lambda c, p=p: _dumps(_Reduce(os.system, _cmd(c)), p), True, REFUSED)
    for p in (0, 1, 2, 4, 5)
  },
  "posix.system": (lambda c: f"cposix\nsystem\n(V{_cmd(c)}\ntR.".encode(), True, REFUSED),
  "nt.system": (lambda c: f"cnt\nsystem\n(V{_cmd(c)}\ntR.".encode(), False, REFUSED),
  "builtins.eval": (lambda c: _dumps(_Reduce(eval, _code(c)), 4), True, REFUSED),
  "__builtin__.eval": (lambda c: _dumps(_Reduce(eval, _code(c)), 2), True, REFUSED),
  "builtins.exec": (lambda c: _dumps(_Reduce(exec, _code(c)), 4), True, REFUSED),
  "builtins.open": (lambda c: _dumps(_Reduce(open, c, "w"), 4), True, REFUSED),
  "subprocess.Popen": (
    lambda c: _dumps(_Reduce(subprocess.Popen, ["touch", c])),
    True,
    REFUSED,
  ),
  "subprocess.check_output": (
    lambda c: _dumps(_Reduce(subprocess.check_output, ["touch", c]), 4),
    True,
    REFUSED,
  ),
  "subprocess.run/STACK_GLOBAL": (
    lambda c: _dumps(_Reduce(subprocess.run, ["touch", c]), 5),
    True,
    REFUSED,
  ),
  "getattr(__import__('os'), 'system')": (
    lambda c: (
      f"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\ntR(V{_cmd(c)}\ntR."
    ).encode(),
    True,
    REFUSED,
  ),
  "getattr chain/STACK_GLOBAL": (
    lambda c: (
      b"\x80\x04\x8c\x08builtins\x8c\x07getattr\x93\x8c\x08builtins\x8c\n__import__\x93"
      b"\x8c\x02os\x85R\x8c\x06system\x86R" + _short_str(_cmd(c)) + b"\x85R."
    ),
    True,
    REFUSED,
  ),
  "importlib.import_module": (
    lambda c: (
      f"cbuiltins\ngetattr\n(cimportlib\nimport_module\n(Vos\ntRVsystem\ntR(V{_cmd(c)}\ntR."
    ).encode(),
    True,
    REFUSED,
  ),
  "copyreg._reconstructor(Popen)": (
    lambda c: (
      f"ccopyreg\n_reconstructor\n(csubprocess\nPopen\ncsubprocess\nPopen\n(Vtouch\nV{c}\nltR."
    ).encode(),
    True,
    REFUSED,
  ),
  "copyreg._reconstructor(OrderedDict)": (
    lambda c: b"ccopyreg\n_reconstructor\n(ccollections\nOrderedDict\ncbuiltins\ndict\nNtR.",
    False,
    REFUSED,
  ),
  "copyreg._reconstructor(inert class)": (
    lambda c: b"ccopyreg\n_reconstructor\n(cevil\nThing\ncbuiltins\nobject\nNtR.",
    False,
    INERT,
  ),
  "functools.partial(os.system)()": (
    lambda c: _dumps(_Reduce(functools.partial(os.system, _cmd(c)))),
    True,
    REFUSED,
  ),
  "functools.partial(eval)()": (
    lambda c: f"cfunctools\npartial\n(cbuiltins\neval\nV{_code(c)}\ntR)R.".encode(),
    True,
    REFUSED,
  ),
  "operator.attrgetter(...)(x)": (
    lambda c: b"coperator\nattrgetter\n(Vsystem\ntR(Vx\ntR.",
    False,
    REFUSED,
  ),
  "operator.methodcaller": (
    lambda c: f"coperator\nmethodcaller\n(Vsystem\nV{_cmd(c)}\ntR.".encode(),
    False,
    INERT,
  ),
  "pickle.loads nested": (lambda c: _dumps(_Reduce(pickle.loads, _system(c))), True, REFUSED),
  "_pickle.loads nested": (
    lambda c: b"c_pickle\nloads\n(" + _short_bytes(_system(c)) + b"tR.",
    True,
    REFUSED,
  ),
  "INST os.system": (lambda c: f"(V{_cmd(c)}\nios\nsystem\n.".encode(), True, REFUSED),
  "INST builtins.exec": (lambda c: f"(V{_code(c)}\nibuiltins\nexec\n.".encode(), True, REFUSED),
  "OBJ os.system": (lambda c: f"(cos\nsystem\nV{_cmd(c)}\no.".encode(), True, REFUSED),
  "NEWOBJ_EX subprocess.Popen": (
    lambda c: (
      b"\x80\x04\x8c\nsubprocess\x8c\x05Popen\x93]\x94(\x8c\x05touch"
      + _short_str(c)
      + b"e\x85}\x92."
    ),
    False,
    REFUSED,
  ),
  "NEWOBJ_EX inert class": (
    lambda c: b"\x80\x04\x8c\x04evil\x8c\x05Thing\x93)}\x92.",
    False,
    INERT,
  ),
  "EXT1": (lambda c: b"\x80\x02\x82\x01.", False, REFUSED),
  "EXT2": (lambda c: b"\x80\x02\x83\x01\x02.", False, REFUSED),
  "EXT4": (lambda c: b"\x80\x02\x84\x01\x02\x03\x04.", False, REFUSED),
  "marshal.loads": (lambda c: b"cmarshal\nloads\n(C\x00tR.", False, REFUSED),
  "types.FunctionType": (lambda c: b"ctypes\nFunctionType\n(NNtR.", False, REFUSED),
  "runpy._run_code": (lambda c: f"crunpy\n_run_code\n(V{_code(c)}\n(dtR.".encode(), True, REFUSED),
  "sys.modules": (lambda c: b"csys\nmodules\n.", False, REFUSED),
  "numpy runstring gadget": (
    lambda c: f"cnumpy.testing._private.utils\nrunstring\n(V{_code(c)}\n(dtR.".encode(),
    True,
    INERT,
  ),
  "torch.load gadget": (lambda c: f"ctorch.serialization\nload\n(V{c}\ntR.".encode(), False, INERT),
  "BUILD on an allowed function": (
    lambda c: b"ctorch._utils\n_rebuild_tensor_v2\n(dV__defaults__\n(I1\ntsb.",
    False,
    REFUSED,
  ),
  "BUILD on a loaded OrderedDict twice": (
    lambda c: b"ccollections\nOrderedDict\n)R(db(db.",
    False,
    REFUSED,
  ),
  "REDUCE on a string": (lambda c: b"Vsystem\n(tR.", False, REFUSED),
  "APPEND on an OrderedDict": (lambda c: b"ccollections\nOrderedDict\n)RI1\na.", False, REFUSED),
  "SETITEM on a numpy dtype": (lambda c: b"cnumpy\ndtype\n(Vf8\ntRVnames\nI1\ns.", False, REFUSED),
  "numpy _reconstruct of an inert class": (
    lambda c: b"cnumpy._core.multiarray\n_reconstruct\n(cevil\nArray\n(I0\ntC\x01btR.",
    False,
    REFUSED,
  ),
  "_codecs.encode with a code codec": (
    lambda c: b"c_codecs\nencode\n(Vx\nVrot13\ntR.",
    False,
    MALFORMED,
  ),
  "persistent id as a string": (lambda c: b"P0\n.", False, MALFORMED),
}


def _payload(name: str, canary) -> bytes:
  return _PAYLOADS[name][0](str(canary))


def _assert_inert(tree) -> None:
  if isinstance(tree, dict):
    for key, value in tree.items():
      _assert_inert(key)
      _assert_inert(value)
  elif isinstance(tree, list | tuple | set | frozenset):
    for item in tree:
      _assert_inert(item)
  elif isinstance(tree, InertObject):
    _assert_inert([tree.args, tree.kwargs, tree.state, tree.listitems, tree.dictitems])
  else:
    assert tree is None or isinstance(tree, str | bytes | int | float | InertGlobal | np.ndarray)


def _check(name: str, load_fn) -> None:
  expected = _PAYLOADS[name][2]
  if expected == INERT:
    _assert_inert(load_fn())
  else:
    error = UnsafePickleError if expected == REFUSED else SourceFormatError
    with pytest.raises(error) as info:
      load_fn()
    assert (expected == REFUSED) == isinstance(info.value, UnsafePickleError)


def _torch_zip(path, data: bytes, storages=()):
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("archive/data.pkl", data)
    z.writestr("archive/byteorder", "little")
    z.writestr("archive/version", "3\n")
    for i, storage in enumerate(storages):
      z.writestr(f"archive/data/{i}", storage)
  return path


@pytest.fixture
def canary(tmp_path):
  path = tmp_path / "canary"
  yield path
  assert not path.exists(), "a payload ran"


@pytest.mark.parametrize("name", list(_PAYLOADS))
def test_raw_payload_never_runs(name, canary):
  _check(name, lambda: _torch_pickle.loads(_payload(name, canary), source="payload.pkl"))


@pytest.mark.parametrize("name", list(_PAYLOADS))
def test_payload_in_torch_file_never_runs(name, canary, tmp_path):
  path = _torch_zip(tmp_path / "evil.pt", _payload(name, canary))
  _check(name, lambda: load(path))


@pytest.mark.parametrize("name", [name for name, (_, live, _) in _PAYLOADS.items() if live])
def test_control_plain_pickle_runs_the_live_payloads(name, tmp_path):
  canary = tmp_path / "canary"
  result = pickle.loads(_payload(name, canary))
  for obj in result if isinstance(result, tuple) else [result]:
    if isinstance(obj, subprocess.Popen):
      obj.wait()
    elif hasattr(obj, "close"):
      obj.close()
  assert canary.exists()


def test_refusals_name_the_source_and_the_global(canary):
  for name, qualname in [
    ("os.system/protocol2", "posix.system"),
    ("__builtin__.eval", "builtins.eval"),
  ]:
    with pytest.raises(
      UnsafePickleError, match=rf"^evil\.pkl: refusing to unpickle: global `{qualname}`"
    ):
      _torch_pickle.loads(_payload(name, canary), source="evil.pkl")


def test_ext_opcodes_are_refused_even_when_registered(canary):
  copyreg.add_extension("posix", "system", 240)
  try:
    data = _system(str(canary))
    assert b"\x82\xf0" in data
    pickle.loads(b"\x80\x02\x82\xf0.")  # primes the C unpickler's extension cache
    with pytest.raises(UnsafePickleError, match="EXT opcode"):
      _torch_pickle.loads(data, source="ext.pkl")
  finally:
    copyreg.remove_extension("posix", "system", 240)


def test_inert_calls_are_recorded_not_made(canary):
  out = _torch_pickle.loads(_payload("numpy runstring gadget", canary), source="p")
  assert out == InertObject("numpy.testing._private.utils.runstring", args=(_code(str(canary)), {}))
  out = _torch_pickle.loads(_payload("NEWOBJ_EX inert class", canary), source="p")
  assert out == InertObject("evil.Thing", args=(), kwargs={})


_STORAGE = b"(Vstorage\nctorch\nFloatStorage\nV0\nVcpu\nI4\ntQ"


@pytest.mark.parametrize(
  ("geometry", "message"),
  [
    (b"I2\n(I3\nt(I1\nt", "storage 'archive/data/0' holds 4 elements of float32, but a tensor"),
    (b"I0\n(I2\nI2\nt(I3\nI1\nt", "reads up to element 5"),
    (b"I0\n(I-2\nt(I1\nt", "tensor size (-2,) is not a tuple of ints >= 0"),
    (b"I0\n(I2\nt(I1\nI1\nt", "disagree"),
  ],
)
def test_tensors_cannot_read_outside_their_storage(geometry, message, tmp_path):
  data = b"ctorch._utils\n_rebuild_tensor_v2\n(" + _STORAGE + geometry + b"I00\nNtR."
  path = _torch_zip(tmp_path / "oob.pt", data, [np.arange(4, dtype=np.float32).tobytes()])
  with pytest.raises(SourceFormatError, match=r"oob\.pt: .*" + re.escape(message)):
    load(path)


def test_storage_keys_only_name_zip_entries(tmp_path):
  data = b"ctorch._utils\n_rebuild_tensor_v2\n((Vstorage\nctorch\nFloatStorage\nV../../etc/passwd\nVcpu\nI1\ntQI0\n(I1\nt(I1\ntI00\nNtR."
  path = _torch_zip(tmp_path / "keys.pt", data)
  with pytest.raises(
    SourceFormatError, match=r"entry 'archive/data/\.\./\.\./etc/passwd' is missing"
  ):
    load(path)


# numpy values: built from checked plain fields, never by numpy's __setstate__ on pickle state.


@pytest.mark.parametrize(
  ("fragment", "message"),
  [
    (corpus.forged_object_dtype(), r"numpy\.dtype\('O8'"),
    (
      corpus.forged_dtype_flags(),
      r"numpy dtype BUILD state \(3, '<', None, None, None, -1, -1, 63\)",
    ),
    (corpus.forged_array_state(), r"numpy array of shape \(2,\) and float64 from 8 bytes"),
    (b"cnumpy\ndtype\n(VV8\nI00\nI01\ntR", r"numpy\.dtype\('V8'"),
    (b"cnumpy\ndtype\n(Vf8\nI01\nI01\ntR", r"numpy\.dtype\('f8', align=True\)"),
    (b"cnumpy\ndtype\n(Vf16\nI00\nI01\ntR", r"numpy\.dtype\('f16'\) is float128"),
    (b"cnumpy\ndtype\n(Vf8\nI00\nI01\ntR(I3\nV|\nNNNI-1\nI-1\nI0\ntb", r"BUILD state"),
    (b"cnumpy\ndtype\n(Vf8\nI00\nI01\ntR(I3\nV<\nNNNI8\nI8\nI0\ntb", r"BUILD state"),
    (b"cnumpy._core.multiarray\nscalar\n(cevil\nThing\n)RC\x01atR", r"numpy scalar of"),
  ],
  ids=[
    "object",
    "flags",
    "short array",
    "void",
    "aligned",
    "longdouble",
    "order",
    "sizes",
    "inert",
  ],
)
def test_forged_numpy_values_are_refused(fragment, message):
  with pytest.raises(SourceFormatError, match=r"^p\.pkl: .*" + message):
    _torch_pickle.loads(corpus.pickled(fragment), source="p.pkl")


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_plain_numpy_values_are_read(protocol):
  values = [np.arange(6).astype(d).reshape(2, 3) for d in ("b1", "i1", "u2", "i4", "u8", "f2")]
  values += [np.asfortranarray(np.arange(6.0).reshape(2, 3)), np.arange(3, dtype=">f4")]
  values += [np.arange(4, dtype=np.complex64), np.zeros((0, 3)), np.array(2.5)]
  values += [np.float32(1.5), np.int64(-7), np.bool_(True), np.complex128(1 - 2j)]
  values += [np.dtype("f4"), np.dtype(">i8"), np.dtype("u1")]
  out = _torch_pickle.loads(pickle.dumps(values, protocol=protocol), source="p.pkl")
  for got, want in zip(out, values, strict=True):
    assert type(got) is type(want) and got == want if isinstance(want, np.generic | np.dtype) else 1
    if isinstance(want, np.ndarray):
      np.testing.assert_array_equal(got, want)
      assert got.shape == want.shape  # byte order: numpy's own unpickling may make it native
      assert got.dtype.newbyteorder("=") == want.dtype.newbyteorder("=")
      assert got.flags.f_contiguous == want.flags.f_contiguous


def test_numpy_values_of_other_dtypes_are_refused():
  for value in (np.array(["a"]), np.array([object()]), np.zeros(2, [("a", "f4")]), np.str_("x")):
    with pytest.raises(SourceFormatError, match="plain numeric dtypes"):
      _torch_pickle.loads(pickle.dumps(value, protocol=2), source="p.pkl")


# Records and containers.


def test_ordered_dict_attributes_cannot_hide_its_methods():
  for name in ("get", "items", "keys", "__class__", "__dict__", "move_to_end"):
    data = corpus.pickled(corpus.call(corpus.glob("collections", "OrderedDict")))
    data = data[:-1] + b"}" + corpus.text(name) + b"I5\nsb."
    with pytest.raises(SourceFormatError, match="is not a dict of new attribute names"):
      _torch_pickle.loads(data, source="p.pkl")
  od = collections.OrderedDict(a=1)
  od._metadata = {"": {"version": 1}}
  out = _torch_pickle.loads(pickle.dumps(od, protocol=2), source="p.pkl")
  assert out == od and out._metadata == od._metadata


def test_records_hash_by_name_and_arguments():
  enum_key = b"}cpkg\nStage\n(I2\ntRI7\ns."  # {Stage(2): 7}
  out = _torch_pickle.loads(enum_key, source="p.pkl")
  (key,) = out
  assert key == InertObject("pkg.Stage", args=(2,)) and out[key] == 7
  key = InertObject("a.B", args=(1,))
  hashed = hash(key)  # a dict key before its BUILD
  object.__setattr__(key, "state", {"x": [1]})  # BUILD later: the hash is unchanged
  assert hash(key) == hashed == hash(InertObject("a.B", args=(1,)))
  # records that differ only in their state (DCP's MetadataIndex keys) hash apart
  a, b = (InertObject("m.Index", state={"fqn": "w", "offset": (i,)}) for i in (0, 8))
  assert hash(a) != hash(b)


@pytest.mark.parametrize(
  ("fragment", "message"),
  [
    (corpus.set_of_range(), "set of a range, not of a list or tuple"),
    (b"cbuiltins\nfrozenset\n(cbuiltins\nrange\n(I9\ntRtR", "frozenset of a range"),
    (b"ccollections\nOrderedDict\n(cbuiltins\nrange\n(I9\ntRtR", "OrderedDict of a range"),
    (b"ccollections\nOrderedDict\n((I1\nttR", "not \\(key, value\\) pairs"),
    (b"ccollections\ndefaultdict\n(N(dtR", "defaultdict with initial items"),
    (b"cbuiltins\nslice\n((ltR", "slice\\(\\[\\],\\)"),
    (corpus.cycle(), "a container holds itself"),
    (b"(I1\nI2\nI3\nd", "DICT with an odd number of items"),
  ],
)
def test_containers_take_only_what_they_can_hold(fragment, message):
  with pytest.raises(SourceFormatError, match=message):
    _torch_pickle.loads(corpus.pickled(fragment), source="p.pkl")


# Limits (ucp_jax.sources._torch_reader._pickle_limits), each met by a pickle just past it.


@pytest.mark.parametrize(
  ("limit", "value", "fragment"),
  [
    ("MAX_DEPTH", 10, b"N" + b"\x85" * 11),  # tuples: checked as they are made
    ("MAX_DEPTH", 10, b"]" * 11 + b"a" * 10),  # lists: checked on the finished tree
    ("MAX_TREE_NODES", 1000, b"]" + b"(" + b"N" * 1000 + b"e"),
    ("MAX_TREE_NODES", 1000, b"N" + b"q\x00h\x00\x86" * 10),  # a tuple DAG of 2**10 leaves
    ("MAX_STEPS", 1000, b"]" + b"N0" * 500),
    ("MAX_STEPS", 1000, b"}" + b"N" + b"q\x00h\x00\x86" * 8 + b"q\x010" + b"h\x01Ns" * 8),
    ("MAX_MEMO", 100, b"N" + b"".join(b"r" + i.to_bytes(4, "little") for i in range(101))),
    ("MAX_PICKLE_BYTES", 100, b"N" * 100),
  ],
  ids=["tuples", "lists", "list", "tuple dag", "opcodes", "hashing", "memo", "bytes"],
)
def test_limits(limit, value, fragment, monkeypatch):
  data = corpus.pickled(fragment)
  _torch_pickle.loads(data, source="p.pkl")  # within the default limits
  monkeypatch.setattr(_pickle_limits, limit, value)
  with pytest.raises(SourceFormatError, match=rf"^p\.pkl: .*\({limit}\)"):
    _torch_pickle.loads(data, source="p.pkl")


def test_shared_subtrees_count_once_per_reference():
  shared = list(range(10))
  tree = {"a": [shared] * 50, "b": (shared, shared)}
  assert _torch_pickle.loads(pickle.dumps(tree, protocol=2), source="p.pkl") == tree
  _pickle_limits.check_tree(tree, "t")
