"""What a save commits: every chunk's checksum gathered and checked, in the final manifest.

A `Writer` (`_writer`) records the checksum of each chunk it writes in a `_chunks.Table`;
process 0 merges the other processes' entries into its tables, adds the base's chunks of
the arrays an incremental save reused, refuses an array with a chunk nobody wrote, and
writes the tables into the manifest (`sealed_manifest`). After the commit, the pools the
save may have left garbage in are collected (`collect_after_commit`).
"""

from __future__ import annotations

import contextlib
import dataclasses

from ucp_jax.base import _errors
from ucp_jax.store import _chunks, _location, _manifest, _pool


def merge_tables(
  target: _location.Location,
  tables: dict[str, _chunks.Table],
  entries: list[bytes],
  reused: dict[str, _manifest.ArrayInfo],
  hashed: bool,
) -> None:
  """Merges the other processes' `entries` (`_chunks.pack_entries`; process 0's own first, in
  its tables already) and the reused arrays' chunks into `tables`.

  Raises:
    UcpError: an array has a chunk no process wrote (each such array named).
  """
  keys = sorted(tables)
  for raw in entries[1:]:
    _chunks.merge_entries(tables, keys, raw, hashed)
  for key, info in reused.items():  # the base's chunks, checked by place as its own
    assert info.checksums is not None  # a base's arrays were read from its sealed manifest
    tables[key].fill(info.checksums, info.hashes)
  incomplete = [
    f"{k}: {t.missing()} of {t.written.size} chunks not written"
    for k, t in tables.items()
    if t.missing()
  ]
  if incomplete:
    raise _errors.UcpError(
      f"{target}: refusing to commit arrays that were not wholly written:\n"
      + _errors.bullet_list(incomplete)
    )


def sealed_manifest(
  manifest: _manifest.Manifest,
  written: dict[str, _manifest.ArrayInfo],
  tables: dict[str, _chunks.Table],
  reused: dict[str, _manifest.ArrayInfo],
  *,
  pool: _pool.Pool | None,
  token: int,
  data: str,
  durable: bool,
) -> _manifest.Manifest:
  """`manifest` with the checksums of the `written` arrays (their compression as written),
  the generation of the `pool` that holds each array, and this save's token and data prefix."""
  arrays = {
    k: dataclasses.replace(
      v,
      compression=written[k].compression,
      checksums=tables[k].crcs,
      hashes=tables[k].hashes,
    )
    if k in written
    else v
    for k, v in manifest.arrays.items()
  }
  if pool is not None:  # each array names the generation of the pool that holds it
    own = pool.generation(token)
    arrays = {
      k: dataclasses.replace(v, at=reused[k].at if k in reused else own) for k, v in arrays.items()
    }
  return dataclasses.replace(
    manifest,
    arrays=arrays,
    data=data,
    token=f"{token:016x}",
    durable=durable,
    pool=pool.relative if pool is not None else "",
  )


def collect_after_commit(target: _location.Location, pool: _pool.Pool | None, replaced) -> None:
  """Collects the pools a commit to `target` may have left garbage in: its own (`pool`), and
  that of the checkpoint it `replaced` (its manifest, if it had a readable one). The commit
  is done: a collection that fails leaves garbage, nothing else."""
  pools = [pool.location] if pool is not None else []
  if isinstance(replaced, _manifest.Manifest):
    with contextlib.suppress(_errors.ManifestError):
      old = _pool.location_of(target, replaced)
      if old is not None and not any(_pool.same(old, p) for p in pools):
        pools.append(old)
  for location in pools:
    with contextlib.suppress(Exception):
      _pool.collect(location)
