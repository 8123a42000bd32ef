"""The pool of an incremental series on an object store, and its garbage collection.

Object stores have no hard links, so an incremental save there (`save(..., base=...)`)
writes its arrays into a pool beside its checkpoints (`PARENT/.ucp-pool/`, or the
manager's folder for Orbax steps), below a generation of its own (`gTOKEN/`), and its
manifest names, for each array, the generation that holds it: its own for the arrays it
wrote, the base's for those it reused. Deleting a checkpoint (`rm -r`, Orbax's
`max_to_keep`, an overwrite) deletes its folder, never the pool, so no other checkpoint
loses anything.

What keeps a generation alive is a reference: `refs/TOKEN` in the pool, written by a
save before it writes any data, names the checkpoint it commits (relative to the pool's
folder) and every generation it uses. A reference is live while that checkpoint's lock
holds the save's token (the save runs, or died and its lock was not taken over yet) or
its manifest carries the token (it committed and was not replaced since); it is dead
forever after. The collector (`collect`, run after each pooled commit) deletes dead
references and the generations no live reference names (it lists the references only),
safely against saves running at the same time, by condemning first:

  collector: write condemned/G; list the references again; delete G unless one names G
  save:      write refs/TOKEN naming G; read condemned/G; use G only if unmarked and whole

Whichever goes second sees the other's write (the stores are strongly consistent): a
save that wrote its reference before the collector's second listing keeps G; one that
wrote it after reads the mark and writes the array itself. A mark is removed only after
G is deleted, so a save that finds no mark then finds G gone (its `zarr.json` missing) and
writes the array itself too. A collector killed half way leaves the mark, which later
saves respect and a later collection finishes. Whatever cannot be read makes the
collector keep everything.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from ucp_jax.base import _errors
from ucp_jax.store import _commit, _location, _manifest, _untrusted

MAX_LEVELS = 8  # a manifest's pool is in one of the checkpoint's first 8 ancestors
REFS = "refs/"
CONDEMNED = "condemned/"
_GENERATION = re.compile(r"^g[0-9a-f]{16}/$")
_PART = re.compile(r"^[^/]+$")


@dataclasses.dataclass(frozen=True)
class Pool:
  """A pool and the checkpoint a save writes: where each lives, and how they relate.

  Attributes:
    location: the pool (`ANCESTOR/.ucp-pool/`).
    relative: the pool as a manifest names it, from the checkpoint (`../.ucp-pool/`).
    checkpoint: the checkpoint's path from the pool's folder (`run/7`), for references.
  """

  location: _location.Location
  relative: str
  checkpoint: str

  def generation(self, token: int) -> str:
    return f"g{token:016x}/"


def of(target: _location.Location, levels: int) -> Pool | None:
  """The pool `levels` folders above the object-store checkpoint `target` (None on a local
  disk, or above the store's root)."""
  above = target.ancestor(levels) if levels else None
  if above is None:
    return None
  parts = [p for p in target.kvstore_spec().get("path", "").split("/") if p][-levels:]
  return Pool(
    above.child(_manifest.POOL_NAME), "../" * levels + _manifest.POOL_NAME + "/", "/".join(parts)
  )


def location_of(root: _location.Location, manifest: _manifest.Manifest):
  """The pool of the version 4 checkpoint at `root` (None for any other checkpoint).

  Raises:
    ManifestError: the pool would lie above the root of the store.
  """
  if not manifest.pool:
    return None
  levels = manifest.pool.count("../")
  above = root.ancestor(levels)
  if above is None:
    raise _errors.ManifestError(
      f"{root}/{_manifest.MANIFEST_KEY}: names a pool {levels} folders up "
      f"({manifest.pool}), above the root of its store"
    )
  return above.child(_manifest.POOL_NAME)


def levels_for(target: _location.Location, base: Any, levels: int | None = None) -> int:
  """How many folders above `target` its pool is: 0 (none: a local disk, or no base and
  `levels` not given), `levels` when given, else the level of the base's pool (`base` a
  Checkpoint) when that is a `.ucp-pool` of one of the target's ancestors, else 1 (beside
  the checkpoint)."""
  if target.local_dir is not None:
    return 0
  if levels is not None:
    return levels
  if base is None:
    return 0
  for n in range(1, MAX_LEVELS + 1):
    pool = of(target, n)
    if pool is None:
      break
    if same(pool.location, base.pool):
      return n
  return 1


def same(a: _location.Location | None, b: _location.Location | None) -> bool:
  return a is not None and b is not None and (a.url, a.spec) == (b.url, b.spec)


def register(pool: Pool, token: int, generations: list[str]) -> None:
  """Writes the reference of the save `token`: it will commit `pool.checkpoint`, using
  `generations` (its own first). Written before the save writes any data."""
  body = {"checkpoint": pool.checkpoint, "token": f"{token:016x}", "generations": generations}
  store = _location.kvstore(pool.location)
  store.write(f"{REFS}{token:016x}", json.dumps(body).encode()).result()


def usable(pool: Pool, generation: str, keys: list[str]) -> bool:
  """Whether a save that registered its use of `generation` may reference it: not
  condemned, and not deleted (each array's `zarr.json` there)."""
  store = _location.kvstore(pool.location)
  if store.read(f"{CONDEMNED}{generation.rstrip('/')}").result().state == "value":
    return False
  reads = [store.read(f"{generation}{key}/zarr.json") for key in keys]
  return all(r.result().state == "value" for r in reads)


def abort(pool: Pool, token: int) -> None:
  """Removes what a save that will not commit wrote to the pool: its data, then its reference."""
  store = _location.kvstore(pool.location)
  store.delete_range(_location.prefix_range(pool.generation(token))).result()
  store.write(f"{REFS}{token:016x}", None).result()


def collect(pool: _location.Location) -> list[str]:
  """Deletes dead references and the generations no live reference names; returns the
  generations deleted. Keeps everything when anything cannot be read.

  Only references are listed, never the generations' objects: every generation was named by
  the reference its save wrote before any of its data, which stays until the generation is
  gone, so the generations to delete are those of dead references that no live one names.
  """
  store = _location.kvstore(pool)
  parent = pool.ancestor(1)
  assert parent is not None  # a pool is a folder of an object store, below its checkpoints'
  refs = _references(store)
  live, dead = _judge(store, parent, refs)
  if live is None:
    return []
  doomed = sorted({g for name in dead for g in _parse(refs[name])["generations"]} - live)
  for generation in doomed:
    store.write(f"{CONDEMNED}{generation.rstrip('/')}", b"").result()
  if doomed:  # the references of saves that began meanwhile
    again, _ = _judge(store, parent, _references(store))
    if again is None:
      return []
    doomed = [g for g in doomed if g not in again]
  for generation in doomed:
    store.delete_range(_location.prefix_range(generation)).result()
    store.write(f"{CONDEMNED}{generation.rstrip('/')}", None).result()
  for name in dead:  # last: a collection cut short finds them again
    store.write(f"{REFS}{name}", None).result()
  return doomed


def _references(store) -> dict[str, bytes | None]:
  names = [k.decode(errors="replace") for k in store.list(_location.prefix_range(REFS)).result()]
  reads = {name.removeprefix(REFS): store.read(name) for name in names}
  return {
    name: (r.result().value if r.result().state == "value" else None) for name, r in reads.items()
  }


def _judge(store, parent: _location.Location, refs: dict) -> tuple[set[str] | None, list[str]]:
  """(the generations live references name, the dead references); (None, []) when a
  reference or its checkpoint cannot be read: nothing is then known to be dead."""
  live: set[str] = set()
  dead: list[str] = []
  for name, raw in refs.items():
    ref = _parse(raw)
    if ref is None:
      if raw is None:
        continue  # deleted since it was listed
      return None, []
    try:
      alive = _alive(parent.child(ref["checkpoint"]), ref["token"])
    except (_errors.StorageError, _errors.ManifestError):  # unknown: it may be alive
      return None, []
    if alive:
      live.update(ref["generations"])
    else:
      dead.append(name)
  return live, dead


def _parse(raw: bytes | None) -> dict | None:
  """A reference, checked: every field what `register` writes (None if it is not)."""
  if raw is None:
    return None
  try:
    ref = _untrusted.loads_json(raw, "a pool reference", ValueError)
  except ValueError:
    return None
  if not (
    isinstance(ref, dict)
    and isinstance(ref.get("checkpoint"), str)
    and all(_PART.match(p) and p not in (".", "..") for p in ref["checkpoint"].split("/"))
    and isinstance(ref.get("token"), str)
    and re.fullmatch(r"[0-9a-f]{16}", ref["token"])
    and isinstance(ref.get("generations"), list)
    and all(isinstance(g, str) and _GENERATION.match(g) for g in ref["generations"])
  ):
    return None
  return ref


def _alive(checkpoint: _location.Location, token: str) -> bool:
  """Whether the save `token` still holds (or may yet commit) `checkpoint`: its lock first,
  then the manifest (a save writes its manifest before it releases its lock)."""
  if _commit.lock_token(checkpoint) == token:
    return True
  raw = _location.read_small(checkpoint, _manifest.MANIFEST_KEY, _errors.ManifestError)
  if raw is None:
    return False
  return _manifest.Manifest.from_bytes(raw, str(checkpoint)).token == token  # or raises
