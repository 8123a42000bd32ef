#!/usr/bin/env python
"""Incremental saves of a LoRA-like training state: ten steps, side by side.

The state, on 8 CPU devices: a frozen base of 64 float32 matrices of 2048 x 2048 (1 GiB,
rows sharded over the devices) with LoRA adapters of rank 16 on each (A 2048 x 16, B 16 x
2048: 16 MiB, replicated) trained with optax.adam (mu and nu: 32 MiB more, and a count).
`--layout stacked` (the default) stacks the layers of each of 4 projections into one array
(as MaxText and `nnx.scan` models hold them: 4 frozen arrays, 25 arrays in all);
`--layout per-layer` keeps one array per matrix (as an unscanned Flax model: 449 arrays).
Each step updates the adapters and Adam's state with a jitted step that takes the frozen
base as an input and does not return it (so it stays the same jax.Array objects), then
saves.

Contenders, each writing ten steps into a fresh folder, durable:
  incremental   ucp_jax.save(STEP, state, base=STEP-1): the frozen base's files linked
  full          ucp_jax.save(STEP, state): every array written at every step
  orbax         ocp.StandardCheckpointer().save(STEP, state) + wait, then an fsync of every
                file and folder it wrote (as docs/benchmarks.md makes every contender durable)
  adapters      ucp_jax.save(STEP, adapters and Adam state only): what Megatron's and
                torchtitan's workarounds keep; a step does not restore alone

Rounds are interleaved (each round runs every contender, in a rotated order), each save
timed after an untimed os.sync(). Reported: median and range of the save time of step 1
and of the later steps, the bytes each later step adds to the disk (the blocks of inodes
not already on disk: hard links count once) against the bytes that changed (adapters and
Adam state), the disk used by all ten steps, and, for the incremental series, the newest
step restored and compared after the nine older ones are deleted.

Usage:
  python scripts/bench_incremental.py                  # 3 rounds, about 4 minutes on 2 cores
  python scripts/bench_incremental.py --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
import time

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as bu  # noqa: E402

CONTENDERS = ("incremental", "full", "orbax", "adapters")
STEPS = 10


def build(layers: int, side: int, rank: int, layout: str = "stacked"):
  """(frozen, adapters, optimizer state, the jitted step) of the LoRA-like state.

  `layout`: "stacked" holds each projection's layers in one array ([L, side, side], as
  MaxText and `nnx.scan` models do; 4 projections), "per-layer" one array per matrix (as
  an unscanned Flax model does: `layers` matrices, and 6 adapter and Adam arrays each).
  Frozen weights are sharded by rows over the 8 devices, adapters replicated (data parallel).
  """
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((8,), ("d",))
  replicated = NamedSharding(mesh, P())
  key = jax.random.key(0)
  frozen, adapters = {}, {}
  if layout == "stacked":
    shapes = {f"proj{p}": (layers // 4,) for p in range(4)}
    rows = NamedSharding(mesh, P(None, "d", None))
  else:
    shapes = {f"layer{i}": () for i in range(layers)}
    rows = NamedSharding(mesh, P("d", None))
  for name, lead in shapes.items():
    k1, k2, key = jax.random.split(key, 3)
    frozen[name] = jax.device_put(jax.random.normal(k1, (*lead, side, side)) * 0.02, rows)
    adapters[name] = {
      "a": jax.device_put(jax.random.normal(k2, (*lead, side, rank)) * 0.01, replicated),
      "b": jax.device_put(jnp.zeros((*lead, rank, side)), replicated),
    }
  optimizer = optax.adam(1e-3)
  opt_state = optimizer.init(adapters)

  @jax.jit
  def step(frozen, adapters, opt_state, x):
    def loss(adapters):
      total = 0.0
      for name, w in frozen.items():
        a, b = adapters[name]["a"], adapters[name]["b"]
        total += jnp.mean((x @ w + (x @ a) @ b) ** 2)
      return total

    grads = jax.grad(loss)(adapters)
    updates, opt_state = optimizer.update(grads, opt_state, adapters)
    return optax.apply_updates(adapters, updates), opt_state

  return frozen, adapters, opt_state, step


def nbytes(tree) -> int:
  import jax

  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def disk_bytes(roots: list[str], seen: set | None = None) -> int:
  """Blocks on disk of every file and folder under `roots`, each inode counted once."""
  seen = set() if seen is None else seen
  total = 0
  for root in roots:
    for folder, _dirs, files in os.walk(root):
      for name in [folder, *(os.path.join(folder, f) for f in files)]:
        st = os.lstat(name)
        if (st.st_dev, st.st_ino) not in seen:
          seen.add((st.st_dev, st.st_ino))
          total += st.st_blocks * 512
  return total


def fsync_tree(path: str) -> None:
  """fsyncs every file and folder under `path` (what makes an Orbax save durable here)."""
  names = [path]
  for folder, dirs, files in os.walk(path):
    names += [os.path.join(folder, n) for n in dirs + files]
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    list(pool.map(_fsync, names))


def _fsync(name: str) -> None:
  fd = os.open(name, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def run_series(name: str, root: str, frozen, adapters, opt_state, step, x) -> dict:
  """Ten steps of training and saving with contender `name` into `root`; what it measured."""
  import jax
  import orbax.checkpoint as ocp

  import ucp_jax

  checkpointer = ocp.StandardCheckpointer() if name == "orbax" else None
  seconds, added, changed = [], [], []
  on_disk = 0
  for i in range(1, STEPS + 1):
    adapters, opt_state = step(frozen, adapters, opt_state, x)
    jax.block_until_ready((adapters, opt_state))
    state = {"frozen": frozen, "adapters": adapters, "opt": opt_state}
    path = os.path.join(root, str(i))
    os.sync()
    t0 = time.perf_counter()
    if name == "incremental":
      base = os.path.join(root, str(i - 1)) if i > 1 else None
      ucp_jax.save(path, state, step=i, base=base)
    elif name == "full":
      ucp_jax.save(path, state, step=i)
    elif name == "adapters":
      ucp_jax.save(path, {"adapters": adapters, "opt": opt_state}, step=i)
    else:
      checkpointer.save(path, state)
      checkpointer.wait_until_finished()
      fsync_tree(path)
    seconds.append(time.perf_counter() - t0)
    total = disk_bytes([os.path.join(root, str(j)) for j in range(1, i + 1)])
    added.append(total - on_disk)
    on_disk = total
    changed.append(nbytes({"adapters": adapters, "opt": opt_state}) if i > 1 else nbytes(state))
  if checkpointer is not None:
    checkpointer.close()
  out = {"seconds": seconds, "added": added, "changed": changed, "total_disk": on_disk}
  if name == "incremental":
    out["restored_alone"] = _restore_newest(root, state)
  return out


def _restore_newest(root: str, state) -> bool:
  """Deletes steps 1..9, restores step 10 onto the state's layout, and compares."""
  import jax
  import numpy as np

  import ucp_jax

  for i in range(1, STEPS):
    shutil.rmtree(os.path.join(root, str(i)))
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
  )
  restored = ucp_jax.restore(os.path.join(root, str(STEPS)), target)
  same = jax.tree.map(
    lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), restored, state
  )
  return all(jax.tree.leaves(same)) and not ucp_jax.open(os.path.join(root, str(STEPS))).verify()


def _stats(values: list[float]) -> dict:
  return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--layers", type=int, default=64)
  parser.add_argument("--side", type=int, default=2048)
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--layout", choices=("stacked", "per-layer"), default="stacked")
  parser.add_argument("--only", default=",".join(CONTENDERS))
  parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp

  contenders = [c for c in args.only.split(",") if c]
  frozen, adapters0, opt0, step = build(args.layers, args.side, args.rank, args.layout)
  x = jnp.ones((8, args.side))
  base_bytes, adapter_bytes = nbytes(frozen), nbytes(adapters0)
  arrays = len(jax.tree.leaves((frozen, adapters0, opt0)))
  print(
    f"{args.layout}: frozen base {base_bytes / bu.MiB:.0f} MiB, adapters "
    f"{adapter_bytes / bu.MiB:.0f} MiB (+ Adam {nbytes(opt0) / bu.MiB:.0f} MiB), {arrays} "
    f"arrays, {len(jax.devices())} devices",
    flush=True,
  )
  jax.block_until_ready(step(frozen, adapters0, opt0, x))  # compiled before any timing
  work = tempfile.mkdtemp(prefix="bench_incremental_", dir=args.dir)
  runs: dict[str, list[dict]] = {c: [] for c in contenders}
  try:
    for r in range(args.rounds):
      order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
      for name in order:
        root = os.path.join(work, f"{name}-{r}")
        os.makedirs(root)
        result = run_series(name, root, frozen, adapters0, opt0, step, x)
        runs[name].append(result)
        shutil.rmtree(root)
        later = result["seconds"][1:]
        print(
          f"round {r} {name:11s} step 1 {result['seconds'][0]:.3f} s, later median "
          f"{statistics.median(later):.3f} s, disk {result['total_disk'] / bu.MiB:.0f} MiB",
          flush=True,
        )
  finally:
    shutil.rmtree(work, ignore_errors=True)

  summary = {}
  for name, results in runs.items():
    later = [s for res in results for s in res["seconds"][1:]]
    ratios = [a / c for res in results for a, c in zip(res["added"][1:], res["changed"][1:])]
    summary[name] = {
      "first": _stats([res["seconds"][0] for res in results]),
      "later": _stats(later),
      "added_over_changed": _stats(ratios),
      "added_mib": _stats([a / bu.MiB for res in results for a in res["added"][1:]]),
      "total_disk_mib": _stats([res["total_disk"] / bu.MiB for res in results]),
    }
    if name == "incremental":
      summary[name]["restored_alone"] = all(res["restored_alone"] for res in results)
  changed = runs[contenders[0]][0]["changed"][1]
  rows = []
  for name, s in summary.items():
    rows.append(
      [
        name,
        f"{s['first']['median']:.3f} ({s['first']['min']:.2f}-{s['first']['max']:.2f})",
        f"{s['later']['median']:.3f} ({s['later']['min']:.3f}-{s['later']['max']:.3f})",
        f"{s['added_mib']['median']:.1f}",
        f"{s['added_over_changed']['median']:.3f} ({s['added_over_changed']['min']:.3f}-"
        f"{s['added_over_changed']['max']:.3f})",
        f"{s['total_disk_mib']['median']:.0f}",
      ]
    )
  print()
  print(
    f"changed per later step: {changed / bu.MiB:.2f} MiB; one base + ten changes: "
    f"{(base_bytes + STEPS * changed) / bu.MiB:.0f} MiB"
  )
  print(
    bu.table(
      [
        "contender",
        "step 1 (s)",
        "steps 2-10 (s)",
        "added/step MiB",
        "added/changed",
        "10 steps MiB",
      ],
      rows,
    )
  )
  checks = {}
  if "incremental" in summary:
    inc = summary["incremental"]
    checks["added <= 1.2x changed (worst step)"] = inc["added_over_changed"]["max"] <= 1.2
    if "full" in summary:
      speedup = summary["full"]["later"]["median"] / inc["later"]["median"]
      checks[f"10x faster than a full durable save ({speedup:.1f}x)"] = speedup >= 10
    one_plus_ten = (base_bytes + STEPS * changed) / bu.MiB
    checks[
      f"ten steps ~ one base + ten changes ({inc['total_disk_mib']['median']:.0f} MiB "
      f"vs {one_plus_ten:.0f})"
    ] = inc["total_disk_mib"]["median"] <= 1.05 * one_plus_ten
    checks["newest step restores equal after the others are deleted"] = inc["restored_alone"]
  for what, ok in checks.items():
    print(f"{'PASS' if ok else 'FAIL'}  {what}")
  if args.json:
    bu.write_result(args.json, {"summary": summary, "runs": runs, "checks": checks})
  return 0 if all(checks.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
