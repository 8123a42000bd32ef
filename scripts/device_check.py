#!/usr/bin/env python
"""One short check of ucp_jax on whatever devices JAX sees (a GPU when one is lent): is every
result bit-identical, and how fast is it next to Orbax and jax.device_put?

The state: 16 float32 arrays of random numbers, `--size-mb` MiB in all. On N > 1 devices the
meshes of scripts/bench_save_restore.py: a 1-D mesh ('x',) with arrays 3, 7, 11, ... sharded
P(None, 'x') and the others P('x', None); "other" sharding: a (2, N/2) mesh ('data', 'model'),
every array P('data', 'model'). On one device no other layout exists, so "other" is a
SingleDeviceSharding (a bare Sharding as restore target, shape and dtype from the checkpoint).

Checks (any failure: exit status 1): ucp_jax.save, then ucp_jax.restore onto the same sharding,
the other one and host numpy (`restore(path)`); ucp_jax.reshard onto the other sharding with
method "auto" and "device_put"; save_async against Orbax's async save, each followed by a
jitted step that donates the state (the training-loop stall); every result's crc32 equals the
original's, and its sharding is the one asked for; `ucp_jax.open(path).verify()` finds
nothing; a dtype the checkpoint does not hold is refused with cast off. Timings (median and
range of `--repeat` tries, first calls included; never a failure) against
ocp.StandardCheckpointer (save + wait_until_finished, restore(path, abstract tree)) and
jax.device_put. Restores read from the page cache (the checkpoint was just written).

Usage, from the repository root:
  PYTHONPATH=. python scripts/device_check.py --out $OUT          # 1 GiB, 2 tries each
  python scripts/device_check.py --size-mb 16 --repeat 1 --out /tmp/dc
Writes DIR/device_check.json (every number) and DIR/device_check.txt (the table).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor


def _cpu_platform() -> bool:
  """Whether JAX will run on CPU: JAX_PLATFORMS says so, or no accelerator plugin is installed."""
  platforms = os.environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  if importlib.util.find_spec("libtpu") is not None:
    return False
  spec = importlib.util.find_spec("jax_plugins")  # CUDA / ROCm plugins live in this namespace
  locations = list(spec.submodule_search_locations or []) if spec else []
  return not any(n[0] not in "_." for loc in locations for n in os.listdir(loc))


_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
if _cpu_platform() and "xla_force_host_platform_device_count" not in _XLA_FLAGS:
  os.environ["XLA_FLAGS"] = (_XLA_FLAGS + " --xla_force_host_platform_device_count=8").strip()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as bu  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ucp_jax  # noqa: E402
from ucp_jax.tree import _reshard  # noqa: E402

ARRAYS = 16


def build_state(size_mb: float, devices):
  """(state, crc32 by key, same shardings, other shardings, description of both)."""
  n = len(devices)
  mesh = Mesh(np.array(devices), ("x",))
  if n == 1:
    other = dict.fromkeys(range(ARRAYS), SingleDeviceSharding(devices[0]))
    layout = "1 device: mesh ('x',) P('x', None) / P(None, 'x') -> SingleDeviceSharding"
  else:
    rows = 2 if n % 2 == 0 else 1
    mesh2 = Mesh(np.array(devices).reshape(rows, n // rows), ("data", "model"))
    other = dict.fromkeys(range(ARRAYS), NamedSharding(mesh2, P("data", "model")))
    layout = f"mesh ({n},) ('x',) -> mesh ({rows}, {n // rows}) ('data', 'model')"
  step = math.lcm(8, n)  # both sides divide evenly on either mesh
  side = max(step, int(math.sqrt(size_mb * bu.MiB / 4 / ARRAYS)) // step * step)
  state, crcs, same, diff = {}, {}, {}, {}
  for i in range(ARRAYS):
    key = f"w{i:02d}"
    host = np.random.default_rng(i).random((side, side), dtype=np.float32)
    crcs[key] = zlib.crc32(host)
    same[key] = NamedSharding(mesh, P(None, "x") if i % 4 == 3 else P("x", None))
    diff[key] = other[i]
    state[key] = jax.device_put(host, same[key])
  return jax.block_until_ready(state), crcs, same, diff, layout


def abstract(state, shardings):
  return {
    k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[k]) for k, x in state.items()
  }


def mismatches(tree, crcs, shardings=None) -> str | None:
  """None when every array has its original crc32 (and the sharding asked for); else what differs."""
  if set(tree) != set(crcs):
    return f"keys differ: {sorted(set(tree) ^ set(crcs))}"

  def one(key):
    x = tree[key]
    if shardings is not None and not (
      isinstance(x, jax.Array) and x.sharding.is_equivalent_to(shardings[key], x.ndim)
    ):
      return f"{key}: sharding {getattr(x, 'sharding', type(x).__name__)} != {shardings[key]}"
    host = np.ascontiguousarray(np.asarray(x))
    if host.dtype != np.float32 or zlib.crc32(host) != crcs[key]:
      return f"{key}: {host.dtype} crc32 differs"
    return None

  with ThreadPoolExecutor(8) as pool:  # zlib.crc32 releases the GIL
    bad = [b for b in pool.map(one, sorted(tree)) if b]
  return "; ".join(bad) or None


class Check:
  """Collects correctness results and timings; nothing it runs can stop the others."""

  def __init__(self, repeat: int, nbytes: int):
    self.repeat, self.nbytes = repeat, nbytes
    self.checks: list[dict] = []
    self.timings: dict[str, dict] = {}

  def check(self, name: str, fn) -> None:
    try:
      problem = fn()
    except Exception as e:
      traceback.print_exc()
      problem = f"{type(e).__name__}: {e}"
    self.checks.append({"name": name, "ok": not problem, "detail": problem or ""})
    print(f"  {'ok  ' if not problem else 'FAIL'} {name}" + (f": {problem}" if problem else ""))

  def time(self, name: str, fn, *, before=None, after=None, verify=None):
    """Best of `repeat` tries of `fn`; `verify(result)` (a problem or None) checks the last."""
    try:
      stats, result = bu.measure(fn, repeat=self.repeat, before=before, after=after)
    except Exception as e:
      traceback.print_exc()
      stats, result = {"error": f"{type(e).__name__}: {e}"}, None
    if "seconds" in stats:
      stats["gbps"] = bu.gbps(self.nbytes, stats["seconds"])
    self.timings[name] = stats
    print(f"  {name}: {bu.fmt(stats.get('seconds'), '.3f')} s", flush=True)
    if verify is not None:
      self.check(name, lambda: stats.get("error") or verify(result))
    return result


def fresh_paths(root: str, prefix: str):
  """(make a new path, drop all but the newest, the newest) for repeated saves."""
  made: list[str] = []

  def new() -> str:
    made.append(os.path.join(root, f"{prefix}_{len(made)}"))
    return made[-1]

  def prune(*_):
    for p in made[:-1]:
      shutil.rmtree(p, ignore_errors=True)

  return new, prune, lambda: made[-1]


def run(args, root: str) -> dict:
  import absl.logging
  import orbax.checkpoint as ocp

  absl.logging.set_verbosity(absl.logging.ERROR)
  devices = jax.devices()
  state, crcs, same, diff, layout = build_state(args.size_mb, devices)
  nbytes = sum(int(x.nbytes) for x in state.values())
  path, reason = _reshard.reshard_method(state, diff)  # what reshard(method="auto") does
  auto = "host copies" if path == "host" else path
  info = {
    "jax_version": jax.__version__, "orbax_version": getattr(ocp, "__version__", "?"),
    "platform": devices[0].platform, "device_kind": devices[0].device_kind,
    "devices": len(devices), "layout": layout, "state_bytes": nbytes,
    "array_shape": list(state["w00"].shape), "arrays": ARRAYS, "repeat": args.repeat,
    "reshard_auto_picks": auto, "reshard_auto_reason": reason,
  }  # fmt: skip
  print(f"{info['device_kind']} x{len(devices)}, jax {jax.__version__}: {layout}; "
        f"{nbytes / bu.MiB:.0f} MiB; reshard(method='auto') -> {auto}", flush=True)  # fmt: skip
  c = Check(args.repeat, nbytes)
  same_t, diff_t = abstract(state, same), abstract(state, diff)
  other_t = diff if len(devices) == 1 else diff_t  # one device: bare Shardings as the target
  ckptr = ocp.StandardCheckpointer()  # Orbax's defaults, as in bench_save_restore.py
  warm = {"a": state["w00"][:8]}  # untimed first use: thread pools, TensorStore contexts
  ucp_jax.save(os.path.join(root, "warm_ucp"), warm)
  ckptr.save(os.path.join(root, "warm_orbax"), warm)
  ckptr.wait_until_finished()

  new, prune, last = fresh_paths(root, "ucp")
  c.time("ucp save", lambda: ucp_jax.save(new(), state), after=prune)
  path = last()
  c.time("ucp restore, same sharding", lambda: jax.block_until_ready(ucp_jax.restore(path, same_t)),
         verify=lambda r: mismatches(r, crcs, same))  # fmt: skip
  c.time("ucp restore, other sharding",
         lambda: jax.block_until_ready(ucp_jax.restore(path, other_t)),
         verify=lambda r: mismatches(r, crcs, diff))  # fmt: skip
  c.time("ucp restore, host numpy", lambda: ucp_jax.restore(path),
         verify=lambda r: mismatches(r, crcs))  # fmt: skip
  c.check("ucp open(path).verify() is empty", lambda: ucp_jax.open(path).verify() or None)

  def refuses_other_dtype():
    wrong = {
      k: jax.ShapeDtypeStruct(s.shape, np.int32, sharding=s.sharding) for k, s in same_t.items()
    }
    try:
      ucp_jax.restore(path, wrong)
    except ucp_jax.DtypeMismatchError:
      return None
    return "restore onto int32 with cast off did not raise DtypeMismatchError"

  c.check("ucp restore refuses another dtype (cast off)", refuses_other_dtype)

  onew, oprune, olast = fresh_paths(root, "orbax")

  def orbax_save():
    ckptr.save(onew(), state)
    ckptr.wait_until_finished()

  c.time("orbax save", orbax_save, after=oprune)
  for name, target in (("same", same_t), ("other", diff_t)):
    c.time(f"orbax restore, {name} sharding",
           lambda t=target: jax.block_until_ready(ckptr.restore(olast(), t)))  # fmt: skip
  ckptr.close()

  # device_put's first call compiles the resharding, which reshard(method="device_put") then
  # reuses: jax.device_put goes first, so both pay (or skip) that cost alike.
  c.time("jax.device_put", lambda: jax.block_until_ready(jax.device_put(state, diff)))
  for method in ("auto", "device_put"):
    c.time(f"ucp reshard, {method}",
           lambda m=method: jax.block_until_ready(ucp_jax.reshard(state, diff, method=m)),
           verify=lambda r: mismatches(r, crcs, diff))  # fmt: skip
  async_saves(c, root, state, crcs, same, same_t, ocp.StandardCheckpointer)
  return {**info, "ok": all(x["ok"] for x in c.checks), "checks": c.checks, "timings": c.timings}


def async_saves(c: Check, root: str, state, crcs, same, same_t, ckptr_factory) -> None:
  """The training-loop stall of an asynchronous save, as scripts/bench_async.py measures it.

  Each try: a fresh copy of the state; start the save (the stall); one jitted step that donates
  the state; wait for the commit. The checkpoint must hold the values from before the step.
  """
  step = jax.jit(lambda s: jax.tree.map(lambda a: a * 0.5 + 1.0, s), donate_argnums=0)
  copy = jax.jit(lambda s: jax.tree.map(lambda a: a + 0, s))
  jax.block_until_ready(step(copy(state)))  # both compiled before timing
  ckptr = ckptr_factory()
  contenders = {
    "ucp": (lambda p, s: ucp_jax.save_async(p, s), lambda h: h.result(),
            lambda p: ucp_jax.restore(p, same_t)),
    "orbax": (lambda p, s: ckptr.save(p, s), lambda h: ckptr.wait_until_finished(),
              lambda p: ckptr.restore(p, same_t)),
  }  # fmt: skip
  tries = {(name, phase): [] for name in contenders for phase in ("stall", "total")}
  problems = dict.fromkeys(contenders)
  for i in range(c.repeat + 1):  # interleaved; the first round is an untimed warm-up
    for name, (start, finish, read) in contenders.items():
      live = jax.block_until_ready(copy(state))
      path = os.path.join(root, f"async_{name}_{i}")
      os.sync()
      t0 = time.perf_counter()
      handle = start(path, live)
      t1 = time.perf_counter()
      live = jax.block_until_ready(step(live))
      finish(handle)
      t2 = time.perf_counter()
      if i:
        tries[name, "stall"].append(t1 - t0)
        tries[name, "total"].append(t2 - t0)
      problems[name] = problems[name] or mismatches(read(path), crcs, same)
      del live
      shutil.rmtree(path, ignore_errors=True)
  ckptr.close()
  labels = {"ucp": "ucp save_async", "orbax": "orbax async save"}
  for (name, phase), values in tries.items():
    c.timings[f"{labels[name]} {phase}"] = {"seconds": min(values), "tries": values}
    print(f"  {labels[name]} {phase}: {min(values):.3f} s", flush=True)
  for name, problem in problems.items():
    c.check(f"{labels[name]} holds the values from before the donating step", lambda p=problem: p)


ROWS = [  # (table row, ucp_jax timing, baseline timing)
  ("save", "ucp save", "orbax save"),
  ("restore, same sharding", "ucp restore, same sharding", "orbax restore, same sharding"),
  ("restore, other sharding", "ucp restore, other sharding", "orbax restore, other sharding"),
  ("restore, host numpy", "ucp restore, host numpy", None),
  ("reshard, auto", "ucp reshard, auto", "jax.device_put"),
  ("reshard, device_put", "ucp reshard, device_put", "jax.device_put"),
  ("async save: stall", "ucp save_async stall", "orbax async save stall"),
  ("async save: stall+step+commit", "ucp save_async total", "orbax async save total"),
]


def report(res: dict) -> str:
  t, nbytes = res["timings"], res["state_bytes"]

  def tries(name):
    return (t.get(name, {}).get("tries") or []) if name else []

  def median(name):
    return statistics.median(tries(name)) if tries(name) else None

  def spread(name):
    return f"{min(tries(name)):.3f}-{max(tries(name)):.3f}" if tries(name) else "-"

  rows = []
  for label, ours, theirs in ROWS:
    a, b = median(ours), median(theirs)
    rows.append([
      label, bu.fmt(a, ".3f"), spread(ours), bu.fmt(bu.gbps(nbytes, a)),
      (theirs or "-").replace(" " + label, ""), bu.fmt(b, ".3f"), spread(theirs),
      bu.fmt(bu.gbps(nbytes, b)), "-" if not a or b is None else f"{b / a:.2f}x",
    ])  # fmt: skip
  head = ["ucp_jax", "median s", "range s", "GB/s", "vs", "median s", "range s", "GB/s", "speedup"]
  failed = [f"FAILED {x['name']}: {x['detail']}" for x in res["checks"] if not x["ok"]]
  return "\n".join([
    f"jax {res['jax_version']}, orbax {res['orbax_version']}, {res['platform']}: "
    f"{res['device_kind']} x{res['devices']}",
    f"state: {res['arrays']} x {res['array_shape']} float32 = {res['state_bytes'] / bu.MiB:.0f} "
    f"MiB; {res['layout']}; medians of {res['repeat']} tries",
    f"reshard(method='auto') picks: {res['reshard_auto_picks']}"
    + (f" ({res['reshard_auto_reason']})" if res["reshard_auto_reason"] else ""),
    "", bu.table(head, rows, align="lrrrlrrrr"), "",
    f"correctness: {sum(x['ok'] for x in res['checks'])}/{len(res['checks'])} checks passed",
    *failed,
  ])  # fmt: skip


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument("--size-mb", type=float, default=1024, help="state size in MiB (1024)")
  ap.add_argument("--repeat", type=int, default=2, help="timed tries per phase (2)")
  ap.add_argument("--out", required=True, help="writes device_check.json and .txt here")
  ap.add_argument("--dir", default=None, help="where checkpoints go (a temp dir, removed after)")
  args = ap.parse_args(argv)
  if args.size_mb <= 0 or args.repeat < 1:
    ap.error("--size-mb and --repeat must be positive")
  os.makedirs(args.out, exist_ok=True)
  root = tempfile.mkdtemp(prefix="ucp_device_check_", dir=args.dir)
  try:
    res = run(args, root)
  except Exception as e:  # the state or Orbax could not even be set up: still leave a record
    traceback.print_exc()
    res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
  finally:
    shutil.rmtree(root, ignore_errors=True)
  if "error" in res:
    bu.write_result(os.path.join(args.out, "device_check.json"), res)
    print(f"FAILED: {res['error']}")
    return 1
  text = report(res)
  print("\n" + text)
  bu.write_result(os.path.join(args.out, "device_check.json"), res)
  with open(os.path.join(args.out, "device_check.txt"), "w") as f:
    f.write(text + "\n")
  return 0 if res["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
