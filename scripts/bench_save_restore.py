#!/usr/bin/env python
"""Save / restore / reshard speed of ucp_jax against Orbax, raw files and jax.device_put.

One run, the same state for every contender: `--arrays` float32 arrays of random numbers,
`--size-mb` MiB in all (default 16 x 4096x4096 = 1 GiB), on 8 CPU devices. Arrays 3, 7, 11, ...
are sharded P(None, 'x') on an 8-device mesh ('x',), the others P('x', None).

"Different mesh" (the same for every contender): a (2, 4) mesh ('data', 'model') over the same
8 devices, every array P('data', 'model'), i.e. an 8-way FSDP layout resumed as 2-way data x
4-way tensor parallel.

Contenders, each in a fresh subprocess (this script re-invoked with `--worker NAME`), so that
peak RSS is per contender:
  ucp           ucp_jax.save; ucp_jax.restore onto the same mesh/specs; onto the different mesh.
  orbax         orbax-checkpoint defaults: ocp.StandardCheckpointer() (an AsyncCheckpointer over
                StandardCheckpointHandler: OCDBT on, zarr v2, zstd level 1),
                ckptr.save(path, state) + wait_until_finished(), ckptr.restore(path, abstract).
  orbax_nozstd  the same without compression: ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(
                use_compression=False, use_ocdbt=True, save_concurrent_gb=96,
                restore_concurrent_gb=96)), i.e. StandardCheckpointHandler's own settings with
                `use_compression=False` (orbax/checkpoint/_src/serialization/
                tensorstore_utils.py: `_build_zarr2_metadata` then writes `compressor: None`);
                save via ocp.args.PyTreeSave, restore via ocp.args.PyTreeRestore with
                ocp.checkpoint_utils.construct_restore_args(abstract tree).
  raw           numpy.ndarray.tofile, one file per array, from host copies made before timing,
                written by a thread pool; `readinto` back into preallocated (touched) arrays,
                and into fresh (untouched) ones, as any restore that returns new arrays must:
                the kernel faults every page in. What the disk, the page cache and fresh memory
                allow; no device transfer on either side.
  reshard_ucp / reshard_device_put
                ucp_jax.reshard(state, different-mesh shardings) vs jax.device_put(state, same).
                The first call is timed on its own (device_put compiles its resharding then),
                then `--settle` untimed calls (default 4: what `method="auto"` spends timing
                both paths; device_put's allocator warms up then too), then `--repeat` further
                calls: the steady state of a reshard repeated in a loop.
  reshard_memcpy
                The floor for any reshard that copies: numpy copies the same target slices out
                of the same source shards on 2 threads, with no JAX in the way. First call into
                fresh buffers (the kernel must fault every page in), repeated calls into buffers
                allocated and touched once (as a warm allocator hands out). Reported against
                device_put as the ceiling of any copying reshard's speedup on this machine.

Every phase: wall time (results block_until_ready; Orbax saves include wait_until_finished),
GB/s (10^9 bytes/s of array data) and peak RSS (the phase's own peak via /proc/self/clear_refs:
absolute, and above the RSS just before the phase, which holds the state). Every try starts
after an untimed `os.sync()`, so no writeback from an earlier phase lands in it. Every restore and
reshard is checked: the sharding is the one asked for and a crc32 of every array matches the
original. Each phase runs `--repeat` times in each of `--rounds` rounds (the contenders
interleaved round by round); the report gives the median of all tries and their range, and
computes every ratio from medians.

Durability is equal by default: every timed save ends with its data and directories on disk.
ucp_jax is durable by itself (`durable=True`: each chunk file fsynced by its writer thread, the
directories before the commit); Orbax fsyncs its data files (TensorStore's `file_io_sync`) and
gets an fsync of every file and directory of its checkpoint inside the timed save (a near no-op
for the data, which is synced already); raw fsyncs each file in its writer thread and the
directory. `--no-durable` measures without: ucp_jax with `durable=False`, raw without fsync,
Orbax as it is (it cannot be told not to sync its data). Restores read from the page cache (the
checkpoint was just written) unless `--drop-caches` (root: `sync; echo 3 >
/proc/sys/vm/drop_caches` before each restore / raw read).

Usage:
  python scripts/bench_save_restore.py                      # 1 GiB, 16 arrays
  python scripts/bench_save_restore.py --size-mb 128 --repeat 3 --json out.json
  python scripts/bench_save_restore.py --only ucp,raw --dir /mnt/nvme/bench
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import zlib

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as bu  # noqa: E402

CONTENDERS = (
  "ucp", "orbax", "orbax_nozstd", "raw", "reshard_ucp", "reshard_device_put", "reshard_memcpy",
)  # fmt: skip
PHASES = ("save", "restore_same", "restore_fresh", "restore_diff", "reshard_first", "reshard")
PHASE_LABEL = {
  "save": "save",
  "restore_same": "restore, same mesh",
  "restore_fresh": "read into fresh memory",
  "restore_diff": "restore, different mesh",
  "reshard_first": "reshard, first call",
  "reshard": "reshard, repeated",
}
ORBAX_OPTIONS = {
  "orbax": "ocp.StandardCheckpointer(): .save(path, state) + .wait_until_finished(), "
  ".restore(path, abstract_tree) "
  "(StandardCheckpointHandler defaults: use_ocdbt=True, zarr v2, zstd level 1, "
  "save/restore_concurrent_gb=96)",
  "orbax_nozstd": "ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False, "
  "use_ocdbt=True, save_concurrent_gb=96, restore_concurrent_gb=96)) + ocp.args.PyTreeSave/"
  "PyTreeRestore(restore_args=construct_restore_args(abstract))",
}


# ---------------------------------------------------------------------------------------------
# The state


def array_shape(size_mb: float, arrays: int) -> tuple[int, int]:
  """A square shape, both sides multiples of 8, with about size_mb/arrays MiB of float32."""
  elems = size_mb * bu.MiB / 4 / arrays
  side = max(8, int(math.sqrt(elems)) // 8 * 8)
  return side, side


def build_state(args):
  """(state, reference crc32 per key, same-mesh shardings, different-mesh shardings)."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  devices = jax.devices()
  if len(devices) != 8:
    raise SystemExit(f"need 8 devices, got {len(devices)} (XLA_FLAGS={os.environ['XLA_FLAGS']})")
  mesh8 = Mesh(np.array(devices), ("x",))
  mesh24 = Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
  shape = array_shape(args.size_mb, args.arrays)
  state, crcs, same, diff = {}, {}, {}, {}
  for i in range(args.arrays):
    key = f"w{i:02d}"
    spec = P(None, "x") if i % 4 == 3 else P("x", None)
    host = np.random.default_rng(args.seed + i).random(shape, dtype=np.float32)
    crcs[key] = zlib.crc32(host)
    same[key] = NamedSharding(mesh8, spec)
    diff[key] = NamedSharding(mesh24, P("data", "model"))
    state[key] = jax.device_put(host, same[key])
    del host
  jax.block_until_ready(state)
  return state, crcs, same, diff


def abstract(state, shardings):
  import jax

  return {
    k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[k]) for k, x in state.items()
  }


def verify(tree, crcs, shardings=None) -> str | None:
  """None when every array matches its reference crc32 (and sharding); else what differs."""
  import numpy as np

  bad = []
  if set(tree) != set(crcs):
    return f"keys differ: {sorted(set(tree) ^ set(crcs))}"
  for key, x in tree.items():
    if shardings is not None and not x.sharding.is_equivalent_to(shardings[key], x.ndim):
      bad.append(f"{key}: sharding {x.sharding} != {shardings[key]}")
      continue
    if zlib.crc32(np.ascontiguousarray(np.asarray(x))) != crcs[key]:
      bad.append(f"{key}: crc32 differs")
  return "; ".join(bad) or None


# ---------------------------------------------------------------------------------------------
# Workers


class Phases:
  """Collects one worker's measurements."""

  def __init__(self, args, name: str):
    self.args = args
    self.out = {"name": name, "phases": {}, "notes": []}
    self.errors = []

  def before_restore(self):
    if self.args.drop_caches:
      err = bu.drop_caches()
      if err and err not in self.out["notes"]:
        self.out["notes"].append(err)

  def run(self, phase, fn, *, before=None, check=None, cleanup=None):
    """Times `fn`; `check(result)` returns an error or None; `cleanup(result, i)` untimed."""
    verdicts = []

    def after(result, i):
      if check is not None:
        verdicts.append(check(result))
      if cleanup is not None:
        cleanup(result, i)

    stats, _ = bu.measure(fn, repeat=self.args.repeat, before=before, after=after)
    errs = [v for v in verdicts if v]
    stats["verified"] = None if check is None else not errs
    if errs:
      stats["verify_error"] = errs[0]
      self.errors.append(f"{phase}: {errs[0]}")
    self.out["phases"][phase] = stats
    print(
      f"  [{self.out['name']}] {phase}: {stats['seconds']:.3f} s"
      + ("" if check is None else f", verified={stats['verified']}"),
      flush=True,
    )


def _warm_small(save, restore, root):
  """Untimed first use (thread pools, imports, TensorStore contexts) on a tiny tree."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()), ("x",))
  s = NamedSharding(mesh, P("x", None))
  tree = {"a": jax.device_put(jnp.ones((64, 64), jnp.float32), s)}
  path = os.path.join(root, "warmup")
  save(path, tree)
  jax.block_until_ready(
    restore(path, {"a": jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=s)})
  )
  shutil.rmtree(path, ignore_errors=True)


def _checkpoint_phases(
  ph: Phases, state, crcs, same, diff, root, save, restore, *, sync_after: bool = True
):
  """save; restore onto the same shardings; restore onto the different mesh.

  `sync_after`: fsync the checkpoint inside the timed save (`--durable`), for contenders that
  are not durable by themselves.
  """
  import jax

  _warm_small(save, restore, root)
  paths = []

  def do_save():
    path = os.path.join(root, f"ckpt_{len(paths)}")
    paths.append(path)
    save(path, state)
    if ph.args.durable and sync_after:
      fsync_tree(path)
    return path

  def drop_older(_, i):
    for p in paths[:-1]:
      shutil.rmtree(p, ignore_errors=True)

  ph.run("save", do_save, cleanup=drop_older)
  path = paths[-1]
  ph.out["checkpoint_bytes"] = _du(path)
  same_t, diff_t = abstract(state, same), abstract(state, diff)
  ph.run(
    "restore_same",
    lambda: jax.block_until_ready(restore(path, same_t)),
    before=ph.before_restore,
    check=lambda r: verify(r, crcs, same),
  )
  ph.run(
    "restore_diff",
    lambda: jax.block_until_ready(restore(path, diff_t)),
    before=ph.before_restore,
    check=lambda r: verify(r, crcs, diff),
  )


def fsync_tree(path: str, files: bool = True) -> None:
  """fsyncs every file (unless `files=False`) and directory under `path`, from a thread pool."""
  from concurrent.futures import ThreadPoolExecutor

  def one(p):
    fd = os.open(p, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)

  paths = [
    os.path.join(d, n) for d, _, names in os.walk(path) for n in [*(names if files else []), "."]
  ]
  with ThreadPoolExecutor(16) as pool:
    list(pool.map(one, paths))


def _du(path: str) -> int:
  total = 0
  for dirpath, _, files in os.walk(path):
    for f in files:
      total += os.path.getsize(os.path.join(dirpath, f))
  return total


def worker_ucp(ph, state, crcs, same, diff, root):
  import ucp_jax

  def save(path, tree):
    ucp_jax.save(path, tree, durable=ph.args.durable)

  # durable=True fsyncs every file and directory before the commit: no pass after it.
  _checkpoint_phases(ph, state, crcs, same, diff, root, save, ucp_jax.restore, sync_after=False)


def _orbax_logging_quiet():
  import logging

  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.ERROR)
  logging.getLogger("absl").setLevel(logging.ERROR)


def worker_orbax(ph, state, crcs, same, diff, root):
  import orbax.checkpoint as ocp

  _orbax_logging_quiet()
  ph.out["options"] = ORBAX_OPTIONS["orbax"]
  ckptr = ocp.StandardCheckpointer()

  def save(path, tree):
    ckptr.save(path, tree)
    ckptr.wait_until_finished()

  def restore(path, target):
    return ckptr.restore(path, target)

  try:
    _checkpoint_phases(ph, state, crcs, same, diff, root, save, restore)
  finally:
    ckptr.close()


def worker_orbax_nozstd(ph, state, crcs, same, diff, root):
  import orbax.checkpoint as ocp

  _orbax_logging_quiet()
  ph.out["options"] = ORBAX_OPTIONS["orbax_nozstd"]
  handler = ocp.PyTreeCheckpointHandler(
    use_compression=False, use_ocdbt=True, save_concurrent_gb=96, restore_concurrent_gb=96
  )
  ckptr = ocp.AsyncCheckpointer(handler)

  def save(path, tree):
    ckptr.save(path, args=ocp.args.PyTreeSave(tree))
    ckptr.wait_until_finished()

  def restore(path, target):
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    return ckptr.restore(path, args=ocp.args.PyTreeRestore(target, restore_args=restore_args))

  try:
    _checkpoint_phases(ph, state, crcs, same, diff, root, save, restore)
  finally:
    ckptr.close()


def worker_raw(ph, state, crcs, same, diff, root):
  from concurrent.futures import ThreadPoolExecutor

  import numpy as np

  keys = list(state)
  host = {k: np.asarray(state[k]) for k in keys}  # host copies, made before timing
  out = {k: np.zeros_like(host[k]) for k in keys}  # preallocated and touched
  threads = max(1, min(len(keys), os.cpu_count() or 1))
  ph.out["threads"] = threads
  paths = []

  def write_one(path):
    def go(key):
      with open(os.path.join(path, f"{key}.bin"), "wb") as f:
        host[key].tofile(f)
        if ph.args.durable:  # in the writer thread, as ucp_jax does
          f.flush()
          os.fsync(f.fileno())

    return go

  def do_save():
    path = os.path.join(root, f"raw_{len(paths)}")
    os.makedirs(path)
    paths.append(path)
    with ThreadPoolExecutor(threads) as pool:
      list(pool.map(write_one(path), keys))
    if ph.args.durable:
      fsync_tree(path, files=False)
    return path

  def drop_older(_, i):
    for p in paths[:-1]:
      shutil.rmtree(p, ignore_errors=True)

  ph.run("save", do_save, cleanup=drop_older)

  def read_one(key):
    with open(os.path.join(paths[-1], f"{key}.bin"), "rb", buffering=0) as f:
      view = memoryview(out[key]).cast("B")
      got = 0
      while got < len(view):
        n = f.readinto(view[got:])
        if not n:
          raise OSError(f"{key}: short read")
        got += n

  def do_read():
    with ThreadPoolExecutor(threads) as pool:
      list(pool.map(read_one, keys))
    return out

  ph.run("restore_same", do_read, before=ph.before_restore, check=lambda r: verify(r, crcs))

  def do_read_fresh():  # what any restore that returns new arrays must at least do
    nonlocal out
    out = {k: np.empty_like(host[k]) for k in keys}  # untouched: the kernel faults pages in
    with ThreadPoolExecutor(threads) as pool:
      list(pool.map(read_one, keys))
    return out

  ph.run("restore_fresh", do_read_fresh, before=ph.before_restore, check=lambda r: verify(r, crcs))


def _worker_reshard(ph, state, crcs, same, diff, root, method):
  import jax

  import ucp_jax

  if method == "ucp":

    def fn():
      return jax.block_until_ready(ucp_jax.reshard(state, diff))
  else:

    def fn():
      return jax.block_until_ready(jax.device_put(state, diff))

  # The first call is what a job that changes shape pays once (device_put compiles its
  # resharding computations then); later calls show the steady state.
  repeat = ph.args.repeat
  ph.args.repeat = 1
  ph.run("reshard_first", fn, check=lambda r: verify(r, crcs, diff))
  for _ in range(ph.args.settle):
    fn()
  ph.args.repeat = repeat
  ph.run("reshard", fn, check=lambda r: verify(r, crcs, diff))


def worker_reshard_ucp(*a):
  _worker_reshard(*a, method="ucp")


def worker_reshard_device_put(*a):
  _worker_reshard(*a, method="device_put")


def worker_reshard_memcpy(ph, state, crcs, same, diff, root):
  """Copies every target slice with numpy alone: what copying memory costs on this machine."""
  from concurrent.futures import ThreadPoolExecutor

  import numpy as np

  jobs = []  # (key, target index, [(source index, source view)])
  for key, x in state.items():
    sources = [(s.index, np.asarray(s.data)) for s in x.addressable_shards if s.replica_id == 0]
    for index in diff[key].addressable_devices_indices_map(x.shape).values():
      jobs.append((key, _bounds(index, x.shape), [(_bounds(i, x.shape), v) for i, v in sources]))
  warm = [np.ones([b - a for a, b in region], np.float32) for _, region, _ in jobs]

  def copy(job, out):
    _, region, sources = job
    out = np.empty([b - a for a, b in region], np.float32) if out is None else out
    for src_region, view in sources:
      lo = [max(a, c) for (a, _), (c, _) in zip(region, src_region)]
      hi = [min(b, d) for (_, b), (_, d) in zip(region, src_region)]
      if all(a < b for a, b in zip(lo, hi)):
        dst = tuple(slice(a - r, b - r) for a, b, (r, _) in zip(lo, hi, region))
        src = tuple(slice(a - r, b - r) for a, b, (r, _) in zip(lo, hi, src_region))
        out[dst] = view[src]
    return out

  pool = ThreadPoolExecutor(2)

  def fresh():
    return list(pool.map(copy, jobs, [None] * len(jobs)))

  def reuse():
    return list(pool.map(copy, jobs, warm))

  def check(outs):
    return verify(_stitch(jobs, outs, state), crcs)

  repeat = ph.args.repeat
  ph.args.repeat = 1
  ph.run("reshard_first", fresh, check=check)
  ph.args.repeat = repeat
  ph.run("reshard", reuse, check=check)


def _bounds(index, shape):
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _stitch(jobs, outs, state):
  """Whole host arrays from the copied slices (for verification only)."""
  import numpy as np

  full = {k: np.empty(x.shape, x.dtype) for k, x in state.items()}
  for (key, region, _), out in zip(jobs, outs):
    full[key][tuple(slice(a, b) for a, b in region)] = out
  return full


def worker_main(args) -> int:
  import jax

  name = args.worker
  ph = Phases(args, name)
  root = os.path.join(args.dir, name)
  os.makedirs(root, exist_ok=True)
  try:
    state, crcs, same, diff = build_state(args)
    ph.out["state_bytes"] = sum(int(x.nbytes) for x in state.values())
    ph.out["array_shape"] = list(next(iter(state.values())).shape)
    ph.out["baseline_rss"] = bu.rss_bytes()
    ph.out["jax_version"] = jax.__version__
    globals()[f"worker_{name}"](ph, state, crcs, same, diff, root)
  except Exception as e:
    import traceback

    traceback.print_exc()
    ph.errors.append(f"{type(e).__name__}: {e}")
  finally:
    shutil.rmtree(root, ignore_errors=True)
  ph.out["ru_maxrss"] = bu.ru_maxrss_bytes()
  ph.out["errors"] = ph.errors
  bu.write_result(args.result_file, ph.out)
  return 0


# ---------------------------------------------------------------------------------------------
# The report


def _sec(results, who, phase):
  p = results.get(who, {}).get("phases", {}).get(phase)
  return None if p is None else statistics.median(p["tries"])


def _ratio(a, b):
  return None if a is None or b is None or b == 0 else a / b


def _merge_rounds(old: dict | None, new: dict) -> dict:
  """Every try of every round, per phase; the higher peak memory; verified only if all were."""
  if old is None or "error" in old:
    return new
  if "error" in new:
    return old
  merged = dict(old, phases=dict(old["phases"]))
  for phase, stats in new["phases"].items():
    kept = merged["phases"].get(phase)
    if kept is None:
      merged["phases"][phase] = stats
      continue
    both = dict(kept, tries=[*kept["tries"], *stats["tries"]])
    for key in ("peak_delta", "peak_rss"):
      if key in stats and key in kept:
        both[key] = max(stats[key], kept[key])
    both["verified"] = (
      None
      if stats.get("verified") is None
      else bool(stats.get("verified")) and bool(kept.get("verified"))
    )
    merged["phases"][phase] = both
  merged["errors"] = [*old.get("errors", []), *new.get("errors", [])]
  return merged


# (description, time A, time B, target for A / B, higher is better), times as contender/phase
TARGETS = [
  ("ucp save speedup vs orbax (default, zstd)", "orbax/save", "ucp/save", 3.0, True),
  ("ucp save speedup vs orbax_nozstd", "orbax_nozstd/save", "ucp/save", 1.5, True),
  (
    "ucp restore-different-mesh speedup vs orbax_nozstd",
    "orbax_nozstd/restore_diff", "ucp/restore_diff", 2.0, True,
  ),
  (
    "ucp restore-different / restore-same time",
    "ucp/restore_diff", "ucp/restore_same", 1.2, False,
  ),
  ("ucp save bandwidth / raw write", "raw/save", "ucp/save", 0.5, True),
  ("ucp restore-same bandwidth / raw read", "raw/restore_same", "ucp/restore_same", 0.5, True),
  ("ucp restore-different bandwidth / raw read", "raw/restore_same", "ucp/restore_diff", 0.5, True),
  (
    "ucp restore-same bandwidth / raw read into fresh memory",
    "raw/restore_fresh", "ucp/restore_same", 0.5, True,
  ),
  (
    "ucp restore-different bandwidth / raw read into fresh memory",
    "raw/restore_fresh", "ucp/restore_diff", 0.5, True,
  ),
  (
    "ucp.reshard speedup vs jax.device_put, first call",
    "reshard_device_put/reshard_first", "reshard_ucp/reshard_first", 5.0, True,
  ),
  (
    "ucp.reshard speedup vs jax.device_put, repeated",
    "reshard_device_put/reshard", "reshard_ucp/reshard", 5.0, True,
  ),
]  # fmt: skip
# What memory bandwidth allows any reshard that copies: device_put's time over numpy's.
CEILINGS = [
  (
    "ceiling of any copying reshard vs device_put, first call (fresh memory)",
    "reshard_device_put/reshard_first", "reshard_memcpy/reshard_first",
  ),
  (
    "ceiling of any copying reshard vs device_put, repeated (warm memory)",
    "reshard_device_put/reshard", "reshard_memcpy/reshard",
  ),
]  # fmt: skip


def report(results: dict, args) -> dict:
  nbytes = next((r["state_bytes"] for r in results.values() if "state_bytes" in r), 0)
  shape = next((r["array_shape"] for r in results.values() if "array_shape" in r), None)
  print()
  print(
    f"state: {args.arrays} x {shape} float32 = {nbytes / bu.MiB:.0f} MiB ({nbytes / bu.GB:.3f} GB) "
    f"on 8 CPU devices; repeat={args.repeat}, rounds={args.rounds} (medians of all tries); "
    f"drop_caches={args.drop_caches}; "
    f"durable={args.durable}; dir={args.dir}"
  )
  rows = []
  for phase in PHASES:
    for who in CONTENDERS:
      r = results.get(who)
      if r is None:
        continue
      p = r.get("phases", {}).get(phase)
      if p is None:
        continue
      ver = {True: "ok", False: "FAILED", None: "-"}[p.get("verified")]
      median = statistics.median(p["tries"])
      rows.append(
        [
          PHASE_LABEL[phase],
          who,
          bu.fmt(median, ".3f"),
          f"{min(p['tries']):.3f}-{max(p['tries']):.3f} ({len(p['tries'])})",
          bu.fmt(bu.gbps(nbytes, median)),
          bu.mib(p["peak_delta"]),
          bu.mib(p["peak_rss"]),
          ver,
        ]
      )
  print(
    bu.table(
      [
        "phase",
        "contender",
        "median s",
        "range s (tries)",
        "GB/s",
        "peak RSS +MiB",
        "peak RSS MiB",
        "verified",
      ],
      rows,
      align="llrrrrrl",
    )
  )
  sizes = [
    f"{w}={r['checkpoint_bytes'] / bu.MiB:.0f} MiB"
    for w, r in results.items()
    if r.get("checkpoint_bytes")
  ]
  if sizes:
    print("checkpoint size on disk: " + ", ".join(sizes))

  def ratio(over: str, under: str) -> float | None:  # "contender/phase" seconds over seconds
    return _ratio(_sec(results, *over.split("/")), _sec(results, *under.split("/")))

  checks = [(desc, ratio(a, b), target, higher) for desc, a, b, target, higher in TARGETS]
  ceilings = [(desc, ratio(a, b)) for desc, a, b in CEILINGS]
  crow = []
  for desc, value, target, higher in checks:
    tgt = (">= " if higher else "<= ") + (
      f"{target:.0%}" if "bandwidth" in desc else f"{target:g}x"
    )
    val = "-" if value is None else (f"{value:.0%}" if "bandwidth" in desc else f"{value:.2f}x")
    crow.append([desc, val, tgt, bu.verdict(value, target, higher)])
  print()
  print(bu.table(["ratio", "value", "target", ""], crow, align="lrrl"))
  if any(v is not None for _, v in ceilings):
    print()
    print(
      bu.table(
        ["bound (numpy copies of the same slices)", "value"],
        [[d, "-" if v is None else f"{v:.2f}x"] for d, v in ceilings],
        align="lr",
      )
    )
  for w in ("orbax", "orbax_nozstd"):
    print(f"{w}: {ORBAX_OPTIONS[w]}")
  problems = []
  for w, r in results.items():
    for e in r.get("errors", []) + ([r["error"]] if "error" in r else []):
      problems.append(f"{w}: {e}")
    for n in r.get("notes", []):
      print(f"note ({w}): {n}")
  for p in problems:
    print(f"ERROR {p}")
  return {
    "state_bytes": nbytes,
    "array_shape": shape,
    "arrays": args.arrays,
    "repeat": args.repeat,
    "drop_caches": args.drop_caches,
    "durable": args.durable,
    "orbax_options": ORBAX_OPTIONS,
    "results": results,
    "checks": [
      {"ratio": d, "value": v, "target": t, "higher_is_better": h, "pass": bu.verdict(v, t, h)}
      for d, v, t, h in checks
    ],
    "bounds": [{"ratio": d, "value": v} for d, v in ceilings],
    "errors": problems,
  }


def main(argv=None) -> int:
  ap = bu.worker_parser(__doc__)
  ap.add_argument("--size-mb", type=float, default=1024, help="total state size in MiB (1024)")
  ap.add_argument("--arrays", type=int, default=16, help="number of arrays (16)")
  ap.add_argument("--repeat", type=int, default=1, help="timed tries per phase, best kept (1)")
  ap.add_argument(
    "--rounds",
    type=int,
    default=1,
    help="runs of every contender, interleaved; medians of all tries (1)",
  )
  ap.add_argument("--dir", default=None, help="where checkpoints go (a temp dir under /tmp)")
  ap.add_argument("--json", default=None, help="write all numbers to this file")
  ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before restores")
  ap.add_argument(
    "--no-durable",
    dest="durable",
    action="store_false",
    help="saves without fsync (ucp_jax durable=False, raw without fsync; Orbax syncs anyway)",
  )
  ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(CONTENDERS)}")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument(
    "--settle",
    type=int,
    default=4,
    help="untimed reshard calls between the first and the repeated ones (4)",
  )
  args = ap.parse_args(argv)
  if args.arrays < 1 or args.size_mb <= 0:
    ap.error("--arrays and --size-mb must be positive")

  if args.worker:
    return worker_main(args)

  names = CONTENDERS if not args.only else tuple(args.only.split(","))
  unknown = set(names) - set(CONTENDERS)
  if unknown:
    ap.error(f"unknown contenders: {sorted(unknown)}")
  with bu.work_dir(args, "ucp_bench_"):
    os.makedirs(args.dir, exist_ok=True)
    results = _run_rounds(args, names)
  summary = report(results, args)
  if args.json:
    bu.write_result(args.json, summary)
  return 1 if summary["errors"] else 0


def _run_rounds(args, names) -> dict:
  """Each contender's results (`_merge_rounds`) over `args.rounds` workers each."""
  common = [
    "--size-mb", str(args.size_mb), "--arrays", str(args.arrays), "--repeat", str(args.repeat),
    "--dir", args.dir, "--seed", str(args.seed), "--settle", str(args.settle),
  ]  # fmt: skip
  if args.drop_caches:
    common.append("--drop-caches")
  if not args.durable:
    common.append("--no-durable")
  results = {}
  for name, run in bu.worker_rounds(os.path.abspath(__file__), names, common, args.rounds):
    results[name] = _merge_rounds(results.get(name), run)
  return results


if __name__ == "__main__":
  sys.exit(main())
