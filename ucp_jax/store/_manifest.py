"""The manifest: one JSON file, written last, that makes a checkpoint a checkpoint.

Since format version 2 it carries a sha256 of its own content (`checksum`), the
crc32c of every chunk by position (`chunk_crc32c` per array, see `_chunks`), and,
on object stores, the prefix below the root where this save's arrays live (`data`).
Since version 3 an array's chunks may be bundled into fewer files (`bundle`, see
`_bundle`), and a save may record its token, whether it was durable, and the sha256 of
every chunk (`chunk_sha256`) for the incremental saves that compare with it (`_reuse`).
Version 4 (object stores only) keeps arrays in a pool shared by a series of checkpoints
(`pool`, and each array's generation there, `at`; see `_pool`). Versions 1 to 3 are
still read.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import re
from typing import Any

import numpy as np

from ucp_jax.base import _errors
from ucp_jax.store import _bundle, _chunks, _keypath, _location, _schema, _untrusted

FORMAT = "ucp_jax"
FORMAT_VERSION = 3
POOLED_VERSION = 4
"""The version of a checkpoint whose arrays live in a pool (older readers refuse it)."""
READABLE_VERSIONS = (1, 2, 3, 4)
MANIFEST_KEY = "manifest.json"
_DATA_PREFIX = re.compile(r"^g[0-9a-f]{16}/$")
_TOKEN = re.compile(r"^[0-9a-f]{16}$")
POOL_NAME = ".ucp-pool"
_POOL = re.compile(r"^(\.\./){1,8}\.ucp-pool/$")
"""A pool is a `.ucp-pool` folder in one of the checkpoint's first eight ancestors."""


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
  """What the manifest says of one stored array.

  Attributes:
    shape: logical (unsharded) shape.
    dtype: zarr v3 / numpy dtype name (`float32`, `bfloat16`, ...).
    chunks: the zarr chunk shape.
    kind: `array`, `scalar` (a Python number) or `prng_key` (typed key data).
    python_type: for scalars, `int`, `float`, `bool` or `complex`.
    prng_impl: for PRNG keys, the implementation name (`threefry2x32`, ...).
    role: optional meaning in the universal schema (`value`, `exp_avg`, ...).
    compression: the chunk codec, None when chunks are stored raw.
    bundle: the shape of the blocks of chunks stored together in one file (zarr's
      `sharding_indexed`, see `_bundle`); None when each chunk is its own file.
    checksums: the crc32c of every chunk, shaped as the chunk grid (`_chunks`);
      None in format version 1 checkpoints and before a save commits.
    hashes: the sha256 of every chunk (grid shape + (32,) bytes), recorded by saves that
      compare chunks by hash (`unchanged="sha256"`); None otherwise.
    at: the generation of the pool that holds the array (`g<16 hex>/`, version 4 only).
  """

  shape: tuple[int, ...]
  dtype: str
  chunks: tuple[int, ...]
  kind: str = "array"
  python_type: str | None = None
  prng_impl: str | None = None
  role: str | None = None
  compression: str | None = None
  bundle: tuple[int, ...] | None = None
  checksums: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
  hashes: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
  at: str | None = dataclasses.field(default=None, compare=False)

  @property
  def nbytes(self) -> int:
    size = 1
    for d in self.shape:
      size *= d
    return size * _itemsize(self.dtype)

  def to_json(self, checksums: bool = True) -> dict:
    out = {"shape": list(self.shape), "dtype": self.dtype, "chunks": list(self.chunks)}
    for name in ("kind", "python_type", "prng_impl", "role", "compression"):
      value = getattr(self, name)
      if value is not None and not (name == "kind" and value == "array"):
        out[name] = value
    if self.bundle is not None:
      out["bundle"] = list(self.bundle)
    if checksums and self.checksums is not None:
      out["chunk_crc32c"] = _chunks.encode(self.checksums)
    if checksums and self.hashes is not None:
      out["chunk_sha256"] = _chunks.encode_hashes(self.hashes)
    if self.at is not None:
      out["at"] = self.at
    return out

  @classmethod
  def from_json(cls, data: dict) -> ArrayInfo:
    return cls(
      shape=tuple(data["shape"]),
      dtype=data["dtype"],
      chunks=tuple(data["chunks"]),
      kind=data.get("kind", "array"),
      python_type=data.get("python_type"),
      prng_impl=data.get("prng_impl"),
      role=data.get("role"),
      compression=data.get("compression"),
      bundle=None if data.get("bundle") is None else tuple(data["bundle"]),
      at=data.get("at"),
    )

  def expected_crc(self, index: tuple[int, ...]) -> int | None:
    """The recorded checksum of chunk `index` (None in a version 1 checkpoint)."""
    return None if self.checksums is None else int(self.checksums[index])


STORED_DTYPES = {
  "bool": 1,
  **{f"int{b}": b // 8 for b in (8, 16, 32, 64)},
  **{f"uint{b}": b // 8 for b in (8, 16, 32, 64)},
  **{f"float{b}": b // 8 for b in (16, 32, 64)},
  "complex64": 8,
  "complex128": 16,
  "bfloat16": 2,
  **dict.fromkeys(("int2", "int4", "float4_e2m1fn", "float8_e3m4", "float8_e4m3b11fnuz"), 1),
  **dict.fromkeys(("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"), 1),
  "float8_e8m0fnu": 1,
}
"""The data types a checkpoint stores, by name, with their item sizes: numpy's numbers and
ml_dtypes' (named as numpy and TensorStore name them; a test keeps the table equal to what
both accept). Known here, reading a manifest imports neither TensorStore nor ml_dtypes (half
a second of CPU: `ucp inspect` starts at once); a name not listed is checked by both."""


def _itemsize(dtype: str) -> int:
  if dtype in STORED_DTYPES:
    return STORED_DTYPES[dtype]
  import ml_dtypes  # noqa: F401  (numpy then knows its types by name)

  return np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Manifest:
  """Everything a checkpoint says about itself besides the array data (`manifest.json`).

  Written last by a save, so a checkpoint with a manifest is complete; read, checked
  against its own sha256 and validated by `ucp_jax.open` (`Checkpoint.manifest`).
  docs/format.md gives the JSON form.

  Attributes:
    arrays: every array by key path (`params/dense/kernel`): shape, dtype, role, and
      the crc32c of every chunk by position (`ArrayInfo`).
    tree: the outline of the saved pytree (containers and key names), to rebuild it.
    step: the training step the save recorded, or None.
    metadata: the user's JSON metadata (`save(metadata=...)`).
    source: where the state came from: a converted format's framework, version and
      parallel layout; empty for a plain JAX save.
    schema: the universal parameter schema (parameters with their optimizer slots,
      groups, step), filled by the Flax/Optax helpers and converters; None otherwise.
    created: when the save committed (ISO 8601, UTC).
    format_version: the on-disk format version it was written in.
    data: where the arrays lie below the checkpoint's root ("" for the root itself).
    token: the save's identity (16 hex digits); incremental saves compare it.
    durable: whether the save fsynced its files before the commit (None: not recorded).
    pool: the shared pool holding the arrays, relative to the root ("" for none).

  Example:
    >>> import jax.numpy as jnp, ucp_jax
    >>> _ = ucp_jax.save("/tmp/ucp_doc_manifest", {"w": jnp.ones((2, 3))}, step=7, overwrite=True)
    >>> m = ucp_jax.open("/tmp/ucp_doc_manifest").manifest
    >>> m.step, m.arrays["w"].shape, m.nbytes
    (7, (2, 3), 24)
  """

  arrays: dict[str, ArrayInfo]
  tree: Any = None
  step: int | None = None
  metadata: dict = dataclasses.field(default_factory=dict)
  source: dict = dataclasses.field(default_factory=dict)
  schema: dict | None = None
  created: str = ""
  format_version: int = FORMAT_VERSION
  data: str = ""  # where the arrays live below the root ("" = at the root)
  token: str = ""  # the save's token (16 hex digits): who wrote it, for incremental saves
  durable: bool | None = None  # whether the save fsynced its files (None: not recorded)
  pool: str = ""  # the pool that holds the arrays, relative to the root (version 4)

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.arrays.values())

  @functools.cached_property
  def typed_schema(self) -> _schema.Schema | None:
    """`schema` as typed records (`Schema`: parameters, buffers, optimizer), None without one.

    Raises:
      ManifestError: a schema of the wrong structure (a manifest read from storage is checked
        when it is read).
    """
    return _schema.of(self.schema, "the manifest")

  def to_bytes(self) -> bytes:
    data = {
      "format": FORMAT,
      "format_version": POOLED_VERSION if self.pool else FORMAT_VERSION,
      "created": self.created or datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "step": self.step,
      "source": self.source,
      "metadata": self.metadata,
      "schema": self.schema,
      "tree": self.tree,
      "arrays": {k: v.to_json() for k, v in sorted(self.arrays.items())},
    }
    for name in ("data", "token", "pool"):
      if getattr(self, name):
        data[name] = getattr(self, name)
    if self.durable is not None:
      data["durable"] = self.durable
    return seal(data)

  @classmethod
  def from_bytes(cls, raw: bytes, where: str) -> Manifest:
    data = _untrusted.loads_json(raw, where, _errors.ManifestError)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
      raise _errors.ManifestError(
        f'{where}: not a ucp_jax manifest (no "format": "{FORMAT}" entry)'
      )
    version = data.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
      raise _errors.ManifestError(
        f"{where}: format version {_errors.shown(version)}; this ucp_jax reads versions "
        f"{', '.join(map(str, READABLE_VERSIONS))}. Upgrade ucp_jax to read it."
      )
    if version >= 2:
      _check_seal(data, where)
    elif "checksum" in data or any(
      isinstance(v, dict) and "chunk_crc32c" in v for v in (data.get("arrays") or {}).values()
    ):
      raise _errors.ManifestError(
        f"{where}: a version 2 manifest marked version 1 (edited to skip its checksums)"
      )
    problem = _top_problem(data)
    if problem:
      raise _errors.ManifestError(f"{where}: malformed manifest: {problem}")
    _check_keys(data["arrays"], data.get("tree"), where)
    arrays = {k: _array_info(k, v, where, sealed=version >= 2) for k, v in data["arrays"].items()}
    manifest = cls(
      arrays=arrays,
      tree=data.get("tree"),
      step=data.get("step"),
      metadata=data.get("metadata") or {},
      source=data.get("source") or {},
      schema=data.get("schema"),
      created=data.get("created", ""),
      format_version=version,
      data=data.get("data", ""),
      token=data.get("token", ""),
      durable=data.get("durable"),
      pool=data.get("pool", ""),
    )
    if manifest.schema is not None:  # checked once, here, naming the file
      manifest.__dict__["typed_schema"] = _schema.Schema.from_json(manifest.schema, where)
    return manifest


_TOP_FIELDS: dict[
  str, tuple[type | tuple[type, ...], str]
] = {  # field: (types a save writes, what they are called)
  "arrays": (dict, "an object"),
  "step": ((int, type(None)), "an integer or null"),
  "metadata": ((dict, type(None)), "an object"),
  "source": ((dict, type(None)), "an object"),
  "schema": ((dict, type(None)), "an object or null"),
  "tree": ((dict, list, str, type(None)), "an outline of keys"),
  "created": (str, "a string"),
  "data": (str, "a string"),
  "token": (str, "a string"),
  "durable": (bool, "true or false"),
  "pool": (str, "a string"),
}


def _top_problem(data: dict) -> str | None:
  """Why the top-level fields of a manifest cannot be what a save wrote (None if they can)."""
  for name, (types, what) in _TOP_FIELDS.items():
    if name not in data and name != "arrays":
      continue
    value = data.get(name)
    if not isinstance(value, types) or (name == "step" and isinstance(value, bool)):
      return f'"{name}" is {_errors.shown(value)}, not {what}'
  prefix = data.get("data", "")
  if prefix != "" and not _DATA_PREFIX.match(prefix):
    return f"data prefix {_errors.shown(prefix)}"
  token = data.get("token", "")
  if token != "" and not _TOKEN.match(token):
    return f"token {_errors.shown(token)} (16 hex digits)"
  return _pool_problem(data)


def _pool_problem(data: dict) -> str | None:
  """Why the pool references of a manifest cannot be what a save wrote (None if they can):
  a pool is a `.ucp-pool` folder of an ancestor, named only by version 4, with no `data`
  prefix, and every array then names its generation there (and only then)."""
  pool = data.get("pool", "")
  if pool and not _POOL.match(pool):
    return f"pool {_errors.shown(pool)} (a .ucp-pool folder of one of the first 8 ancestors)"
  if pool and (data.get("format_version") != POOLED_VERSION or data.get("data")):
    return "a pool in a manifest that is not of version 4, or that has a data prefix too"
  if data.get("format_version") == POOLED_VERSION and not pool:
    return "version 4 without a pool"
  for key, entry in data["arrays"].items():
    at = entry.get("at") if isinstance(entry, dict) else None
    if (at is not None) != bool(pool) or (at is not None and not _DATA_PREFIX.match(str(at))):
      return f"array `{_errors.shown(key)}` at {_errors.shown(at)} (a pool generation, in pooled manifests only)"
  return None


def seal(data: dict) -> bytes:
  """The manifest file for `data`: its JSON with a sha256 of its canonical form added."""
  body = {k: v for k, v in data.items() if k != "checksum"}
  sealed = {**body, "checksum": "sha256:" + hashlib.sha256(_canonical(body)).hexdigest()}
  return json.dumps(sealed, indent=1, allow_nan=False).encode()


def _canonical(data: dict) -> bytes:
  return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _check_seal(data: dict, where: str) -> None:
  stored = data.pop("checksum", None)
  try:
    computed = "sha256:" + hashlib.sha256(_canonical(data)).hexdigest()
  except ValueError as e:  # NaN or infinity: never written by a save
    raise _errors.ManifestError(f"{where}: the manifest holds {e}") from e
  if stored != computed:
    raise _errors.ManifestError(
      f"{where}: the manifest's checksum does not match its content (edited or damaged "
      f"after the save; stored {stored!r}, computed {computed!r})"
    )


def _check_keys(arrays: dict, tree: Any, where: str) -> None:
  """Every key is one a save could write, none lies below another, the tree names them all."""
  bad = _keypath.problems(arrays)
  if tree is not None:
    leaves = _tree_leaves(tree)
    if leaves is None or sorted(leaves) != sorted(arrays):
      bad.append("the tree outline does not name exactly the stored arrays")
  if bad:
    raise _errors.ManifestError(
      f"{where}: malformed manifest: keys that cannot name arrays inside the checkpoint:\n"
      + _errors.bullet_list(bad)
    )


def _tree_leaves(tree: Any) -> list[str] | None:
  """The keys at the leaves of a tree outline; None if a leaf is not a string."""
  if isinstance(tree, str):
    return [tree]
  children = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else None
  if children is None:
    return None
  out: list[str] = []
  for child in children:
    leaves = _tree_leaves(child)
    if leaves is None:
      return None
    out += leaves
  return out


def _array_info(key: str, data: Any, where: str, sealed: bool) -> ArrayInfo:
  """One `arrays` entry, checked enough that reading its size or dtype cannot fail later."""
  try:
    info = ArrayInfo.from_json(data)
  except (KeyError, TypeError, AttributeError, ValueError) as e:
    raise _errors.ManifestError(f"{where}: malformed manifest entry `{key}`: {e!r}") from e
  problem = _untrusted.shape_problem(list(info.shape)) or _untrusted.shape_problem(
    list(info.chunks)
  )
  if problem is None and (
    len(info.chunks) != len(info.shape)
    or not all(0 < c <= max(d, 1) for c, d in zip(info.chunks, info.shape))
  ):
    problem = f"chunks {list(info.chunks)} do not fit shape {list(info.shape)}"
  if problem is None and info.bundle is not None:
    problem = _bundle.check(info.shape, info.chunks, info.bundle)
  if problem is None:
    problem = _dtype_problem(info.dtype) or _fields_problem(info)
  if problem is None:
    problem = _untrusted.shape_problem(list(info.shape), _itemsize(info.dtype))
  if problem is None and sealed:
    checked = _attach_checksums(info, data.get("chunk_crc32c"), data.get("chunk_sha256"))
    if isinstance(checked, ArrayInfo):
      return checked
    problem = checked
  if problem:
    raise _errors.ManifestError(f"{where}: malformed manifest entry `{key}`: {problem}")
  return info


def _dtype_problem(name: Any) -> str | None:
  """Why `name` is not a data type a save writes (plain numbers: no objects, no strings)."""
  if isinstance(name, str) and name in STORED_DTYPES:
    return None
  import ml_dtypes  # noqa: F401  (numpy then knows its types by name)
  import tensorstore as ts

  try:
    dtype = np.dtype(name) if isinstance(name, str) else None
    ts.dtype(name)
  except (TypeError, ValueError):
    dtype = None
  if dtype is None or dtype.name != name or dtype.hasobject or dtype.kind in "SUMm":
    return f"dtype {name!r} is not one a checkpoint stores"
  return None


_KINDS: dict[str, tuple[str, ...]] = {
  "array": (),
  "scalar": ("bool", "int", "float", "complex"),
  "prng_key": (),
}


def _fields_problem(info: ArrayInfo) -> str | None:
  """Why the descriptive fields of an entry cannot be what a save wrote."""
  if info.kind not in _KINDS:
    return f"kind {_errors.shown(info.kind)} (one of {', '.join(_KINDS)})"
  if info.kind == "scalar" and info.python_type not in _KINDS["scalar"]:
    return (
      f"a scalar's python_type {_errors.shown(info.python_type)} (one of bool, int, float, complex)"
    )
  if info.kind == "scalar" and info.shape:
    return f"a scalar with shape {list(info.shape)}"
  if info.kind != "scalar" and info.python_type is not None:
    return f"python_type {info.python_type!r} on an entry of kind {info.kind!r}"
  if (info.kind == "prng_key") != isinstance(info.prng_impl, str):
    return f"prng_impl {info.prng_impl!r} on an entry of kind {info.kind!r}"
  if info.role is not None and not isinstance(info.role, str):
    return f"role {info.role!r}"
  if info.compression not in (None, "zstd"):
    return f"compression {info.compression!r} (None or zstd)"
  return None


def _attach_checksums(info: ArrayInfo, text: Any, hashes: Any = None) -> ArrayInfo | str:
  """`info` with its chunk checksums (and hashes, where recorded), or what is wrong with them."""
  if not isinstance(text, str):
    return "no chunk checksums (chunk_crc32c)"
  if hashes is not None and not isinstance(hashes, str):
    return f"chunk hashes (chunk_sha256) {_errors.shown(hashes)}"
  try:
    table = _chunks.decode(text, info.shape, info.chunks)
    hashed = None if hashes is None else _chunks.decode_hashes(hashes, info.shape, info.chunks)
  except (ValueError, UnicodeEncodeError) as e:
    return f"chunk checksums: {e}"
  return dataclasses.replace(info, checksums=table, hashes=hashed)


def read(location: _location.Location, *, staged: bool = False) -> Manifest:
  """Reads the manifest of a committed checkpoint, or says why there is none.

  `staged`: `location` is a committed save's staging directory, read on purpose.
  """
  where = str(location)
  target = location.local_dir and not staged and _location.staged_for(location.local_dir)
  if target:  # it may hold a manifest: written just before the rename that commits
    raise _errors.CheckpointNotFoundError(
      f"{where}: not a checkpoint but the staging directory of a save to {target} "
      "(still running, or it died before committing; the next save there removes it)"
    )
  raw = _location.read_small(location, MANIFEST_KEY, _errors.ManifestError)
  if raw is None:
    raise _errors.CheckpointNotFoundError(_why_missing(location))
  manifest = Manifest.from_bytes(raw, f"{where}/{MANIFEST_KEY}")
  if manifest.pool and location.local_dir is not None:
    raise _errors.ManifestError(
      f"{where}/{MANIFEST_KEY}: names a pool ({manifest.pool}), which only checkpoints on "
      "object stores use; a local checkpoint holds every file itself"
    )
  if manifest.format_version < 2 and _root_version(location) >= 2:
    raise _errors.ManifestError(
      f"{where}/{MANIFEST_KEY}: version {manifest.format_version} in a checkpoint whose "
      "zarr.json says version 2 or later (edited to skip its checksums)"
    )
  return manifest


def _root_version(location: _location.Location) -> int:
  """The format version the root group's attributes record (0 when they record none)."""
  where = f"{location}/zarr.json"
  raw = _location.read_small(location, "zarr.json", _errors.ManifestError)
  if raw is None:
    return 0
  try:
    version = _untrusted.loads_json(raw, where, _errors.ManifestError)["attributes"]["ucp_jax"]
    version = version["format_version"]
  except (_errors.ManifestError, KeyError, TypeError):
    return 0
  return version if isinstance(version, int) else 0


def no_such_path(where: str) -> str:
  """The words for a path that does not exist, the same from every command and call."""
  return f"{where}: no such file or directory"


def file_not_read(where: str) -> str:
  """The words for a file that no reader recognizes, the same from every command and call."""
  return (
    f"{where}: a file that is no checkpoint ucp_jax reads (a checkpoint is a folder; the files "
    "read are torch.save files and .safetensors files)"
  )


def _why_missing(location: _location.Location) -> str:
  where = str(location)
  unfinished = (
    f"{where}: no committed checkpoint (a save to this path started and has not committed: "
    "still running, or it died)"
  )
  if location.local_dir is not None:
    if _location.staging_dirs(location.local_dir):
      return unfinished
    if not os.path.exists(location.local_dir):
      return no_such_path(where)
    if not os.path.isdir(location.local_dir):
      return file_not_read(where)
  else:
    try:
      lock = _location.kvstore(location).read(".ucp-lock").result().state == "value"  # _commit's
    except _errors.StorageError:
      lock = False
    if lock:
      return unfinished
    if location.url.startswith("memory://"):
      return (
        f"{where}: no committed checkpoint ({MANIFEST_KEY} is missing; a memory:// checkpoint "
        "lives only in the process that saved it)"
      )
  return f"{where}: no committed checkpoint ({MANIFEST_KEY} is missing)"
