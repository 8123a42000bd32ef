#!/usr/bin/env python
"""Bundled chunks (one file per shard, zarr's sharding codec) against a file per chunk.

The same ucp_jax save and restores, with `bundle_bytes` at its default and with
`bundle_bytes=None` (a file per chunk, as format 2 wrote), on 8 CPU devices, in one process,
interleaved round by round (same compile state; each save durable and into a fresh folder;
each restore from the page cache the save left). States:

  many         1,000 arrays of (256, 512) float32 (500 MiB), on a 2x4 mesh P(None, 'b'):
               128 KiB shards, one chunk each at the default chunk size.
  many-small   the same with chunk_bytes=32 KiB: 4 chunks per shard.
  large        16 arrays of (4096, 4096) float32 (1 GiB), P('a', None): 32 MiB shards, 8
               chunks each, each shard held by 4 devices (tensor 2 x data 4).

Reported per state and variant: files written, then median and range of the save, of a
restore onto the same shardings and onto another mesh (1x8, P(None, 'x')), and the peak RSS
above the state's own. Values are checked after every restore.

Usage:
  python scripts/bench_bundles.py --rounds 5
  python scripts/bench_bundles.py --rounds 8 --states large --save-only   # saves alone
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as bu
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax

STATES = {
  "many": (1000, (256, 512), P(None, "b"), None),
  "many-small": (1000, (256, 512), P(None, "b"), 32 << 10),
  "large": (16, (4096, 4096), P("a", None), None),
}
VARIANTS = {"bundled": {}, "a file per chunk": {"bundle_bytes": None}}


def build(count, shape, spec):
  grid = jax.make_mesh((2, 4), ("a", "b"))
  flat = jax.make_mesh((1, 8), ("y", "x"))
  state = {
    f"w{i:04d}": jax.device_put(np.full(shape, i, np.float32), NamedSharding(grid, spec))
    for i in range(count)
  }
  same = {k: jax.ShapeDtypeStruct(shape, np.float32, sharding=v.sharding) for k, v in state.items()}
  other_sharding = NamedSharding(flat, P(None, "x"))
  other = {k: jax.ShapeDtypeStruct(shape, np.float32, sharding=other_sharding) for k in state}
  return jax.block_until_ready(state), same, other


def check(restored) -> None:
  for key, value in restored.items():
    shard = value.addressable_shards[-1]
    assert np.all(np.asarray(shard.data) == int(key[1:])), f"wrong values in {key}"


def files_in(path: str) -> int:
  return sum(len(f) for _, _, f in os.walk(path))


def one_round(path, state, same, other, options, times, save_only=False) -> int:
  """A save and two restores, timed into `times`; returns the files the save wrote."""
  shutil.rmtree(path, ignore_errors=True)
  m, _ = bu.measure(lambda: ucp_jax.save(path, state, **options))
  times["save"].append(m["seconds"])
  times["peak"].append(m["peak_delta"])
  for phase, target in () if save_only else (("same", same), ("other", other)):
    m, out = bu.measure(lambda t=target: jax.block_until_ready(ucp_jax.restore(path, t)))
    check(out)
    times[phase].append(m["seconds"])
    times["peak"].append(m["peak_delta"])
  return files_in(path)


def run(args) -> None:
  root = tempfile.mkdtemp(prefix="ucp_bench_bundles_", dir=args.dir)
  try:
    for name in args.states:
      count, shape, spec, chunk_bytes = STATES[name]
      state, same, other = build(count, shape, spec)
      nbytes = sum(v.nbytes for v in state.values())
      chunking = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
      times = {v: {"save": [], "same": [], "other": [], "peak": []} for v in VARIANTS}
      files = {}
      for _ in range(args.rounds):
        for variant, options in VARIANTS.items():
          path = os.path.join(root, "ckpt")
          files[variant] = one_round(
            path, state, same, other, chunking | options, times[variant], args.save_only
          )
      print(f"\n{name}: {count} arrays, {nbytes / 2**20:.0f} MiB, {args.rounds} rounds")
      rows = []
      for variant in VARIANTS:
        t = times[variant]
        rows.append(
          [variant, f"{files[variant]:,}"]
          + [_spread(t[p]) if t[p] else "-" for p in ("save", "same", "other")]
          + [bu.mib(max(t["peak"]))]
        )
      base, bundled = times["a file per chunk"], times["bundled"]
      rows.append(
        ["bundled / per chunk", f"{files['bundled'] / files['a file per chunk']:.2f}x"]
        + [
          f"{statistics.median(base[p]) / statistics.median(bundled[p]):.2f}x speed"
          if base[p]
          else "-"
          for p in ("save", "same", "other")
        ]
        + [""]
      )
      headers = ["", "files", "save (s)", "restore same (s)", "restore other (s)", "peak RSS"]
      print(bu.table(headers, rows))
  finally:
    shutil.rmtree(root, ignore_errors=True)


def _spread(values) -> str:
  return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--states", nargs="+", choices=list(STATES), default=list(STATES))
  parser.add_argument("--save-only", action="store_true", help="no restores between saves")
  parser.add_argument("--dir", default=None, help="where to write (default: the temp folder)")
  run(parser.parse_args())


if __name__ == "__main__":
  main()
