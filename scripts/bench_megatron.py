#!/usr/bin/env python
"""A Megatron-LM checkpoint converted, and restored onto 8 CPU devices: ucp_jax against its peers.

The checkpoint is written once by megatron-core itself (scripts/make_megatron_core_fixtures.py,
`--sizes`: a Llama-style GPT of about 56 M parameters by default, TP 2 x DP 2, bf16 with the
distributed optimizer's fp32 masters and Adam moments, `--variant`), then every contender works
from the same iteration folder:

  ucp_convert       ucp_jax.convert(root, out): the universal checkpoint (durable).
  dcp_torch_save    torch's dcp_to_torch_save(iteration folder, out.pt), then the file fsynced
                    (equal durability): every tensor and object of the folder in one torch file.
  megatron_save     megatron-core's own load (TP 1, the model built beforehand, untimed), then
                    torch.save of the loaded state and an fsync: the reader Megatron users have
                    (needs megatron-core installed; left out otherwise).
  ucp_restore       ucp_jax.restore(root, target): masters, exp_avg and exp_avg_sq of every
                    parameter onto the mesh, each device reading its slice.
  dcp_load_put      dcp.load of the same tensors into preallocated torch tensors, then
                    jax.device_put onto the same shardings.

Each contender runs in its own subprocess (peak RSS), once untimed first (imports, pools), in
`--rounds` interleaved rounds of `--repeat` tries, each after an untimed `os.sync()`; the
checkpoint was just written, so the page cache is warm for all. Restores are checked against
each other (crc32 of every array). Reported: median, range, GB/s, peak RSS above the start,
and the ratios ucp/peer.

Usage:
  python scripts/bench_megatron.py
  python scripts/bench_megatron.py --sizes '{"hidden": 256, "layers": 4}' --rounds 2 --json out.json
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as bu  # noqa: E402

from ucp_jax.sinks._folder import sync_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = {
  "vocab": 32000,
  "hidden": 512,
  "heads": 8,
  "groups": 4,
  "ffn": 1408,
  "layers": 8,
  "seq": 64,
}
VARIANT = "distopt_fully_reshardable_bf16"
CONTENDERS = ("ucp_convert", "dcp_torch_save", "megatron_save", "ucp_restore", "dcp_load_put")
SLOTS = ("param", "exp_avg", "exp_avg_sq")  # the DCP names of what a restore reads


def make_checkpoint(folder: str, variant: str, sizes: dict) -> str:
  """Megatron-core writes the run (4 gloo ranks); the root's path."""
  subprocess.run(
    [sys.executable, os.path.join(HERE, "make_megatron_core_fixtures.py"), "--out", folder,
     "--variant", variant, "--sizes", json.dumps(sizes), "--no-oracle"],
    check=True,
  )  # fmt: skip
  return os.path.join(folder, variant)


def _targets(root: str):
  """{DCP key: (ucp key, shape, sharding)} for every master and moment; the mesh's axis `x`
  splits the first axis after the layer axis that 8 divides, else nothing."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import ucp_jax

  mesh = Mesh(np.array(jax.devices()), ("x",))
  ckpt = ucp_jax.open(root)
  out = {}
  for name, entry in ckpt.manifest.typed_schema.params.items():
    shape = ckpt[entry.value].shape
    lead = 1 if name.startswith("decoder.layers.") else 0
    spec = [None] * len(shape)
    axis = next((d for d in range(lead, len(shape)) if shape[d] % 8 == 0), None)
    if axis is not None:
      spec[axis] = "x"
    sharding = NamedSharding(mesh, P(*spec))
    out[f"optimizer.state.param.{name}"] = (entry.value, shape, sharding)
    for slot, key in entry.slots.items():
      out[f"optimizer.state.{slot}.{name}"] = (key, shape, sharding)
  return out


def _crcs(arrays) -> dict[str, int]:
  import numpy as np

  return {k: zlib.crc32(np.ascontiguousarray(np.asarray(a))) for k, a in sorted(arrays.items())}


def worker(args) -> int:
  import jax

  root = os.path.join(args.dir, args.variant)
  with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
    folder = os.path.join(root, f"iter_{int(f.read()):07d}")
  out = {"name": args.worker, "phases": {}, "errors": []}
  target = os.path.join(args.dir, f"out_{args.worker}")
  if args.worker in ("ucp_restore", "dcp_load_put"):
    targets = _targets(root)
    if args.worker == "ucp_restore":
      import ucp_jax

      tree: dict = {}
      for key, shape, sharding in targets.values():
        kind, name = key.split("/", 1)
        tree.setdefault(kind, {})[name] = jax.ShapeDtypeStruct(shape, "float32", sharding=sharding)

      def run():
        state = ucp_jax.restore(root, tree)
        return {f"{kind}/{name}": a for kind, part in state.items() for name, a in part.items()}

    else:
      import torch
      import torch.distributed.checkpoint as dcp

      def run():
        state = {k: torch.empty(shape, dtype=torch.float32) for k, (_, shape, _) in targets.items()}
        dcp.load(state, checkpoint_id=folder, no_dist=True)
        return {targets[k][0]: jax.device_put(t.numpy(), targets[k][2]) for k, t in state.items()}

    jax.block_until_ready(run())  # untimed: imports, pools
    crcs: list = []
    stats, _ = bu.measure(
      lambda: jax.block_until_ready(run()),
      repeat=args.repeat,
      after=lambda result, i: crcs.append(_crcs(result)),
    )
    out["crcs"] = crcs[-1]
  else:
    run = _converter(args.worker, root, folder, target)
    run()  # untimed: imports and first use
    stats, _ = bu.measure(run, repeat=args.repeat)
  out["phases"]["run"] = stats
  print(f"  [{args.worker}] {stats['seconds']:.3f} s")
  bu.write_result(args.result_file, out)
  return 0


def _converter(name: str, root: str, folder: str, target: str):
  def clear():
    shutil.rmtree(target, ignore_errors=True)
    if os.path.exists(target + ".pt"):
      os.remove(target + ".pt")

  if name == "ucp_convert":
    import ucp_jax

    def run():
      clear()
      return ucp_jax.convert(root, target).arrays

    return run
  if name == "dcp_torch_save":
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def run():
      clear()
      dcp_to_torch_save(folder, target + ".pt")
      sync_file(target + ".pt")

    return run
  import warnings

  import torch
  import torch.distributed as dist

  warnings.filterwarnings("ignore")
  import socket

  import make_megatron_core_fixtures as fixtures

  fixtures.cpu_stand_ins()
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
  with open(os.path.join(root, "info.json")) as f:
    bf16 = json.load(f)["bf16"]
  model = fixtures.build(True, bf16, 1)  # untimed: the model Megatron loads into

  def run():
    clear()
    fixtures.load(*model, root)
    ddp, optimizer, _ = model
    state = {"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, target + ".pt")
    sync_file(target + ".pt")

  return run


def main(argv=None) -> int:
  ap = bu.worker_parser(__doc__)
  ap.add_argument("--sizes", type=json.loads, default=SIZES, help="JSON: the model's sizes")
  ap.add_argument("--variant", default=VARIANT)
  bu.add_round_args(ap, repeat=2, rounds=2)
  args = ap.parse_args(argv)
  os.environ["UCP_MEGATRON_SIZES"] = json.dumps(args.sizes)  # the megatron_save worker's model
  if args.worker:
    return worker(args)
  import importlib.util

  names = [n for n in CONTENDERS if n != "megatron_save" or importlib.util.find_spec("megatron")]
  with bu.work_dir(args, "ucp_bench_megatron_"):
    root = os.path.join(args.dir, args.variant)
    if not os.path.isdir(root):
      print(f"megatron-core writes the checkpoint ({json.dumps(args.sizes)}) ...", flush=True)
      make_checkpoint(args.dir, args.variant, args.sizes)
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    common = ["--dir", args.dir, "--repeat", str(args.repeat), "--variant", args.variant]
    common += ["--sizes", json.dumps(args.sizes)]
    rounds = bu.worker_rounds(os.path.abspath(__file__), names, common, args.rounds)
    results = bu.gather_rounds(rounds, "run")
  restored = [r["last"]["crcs"] for r in results.values() if "crcs" in r.get("last", {})]
  agree = all(c == restored[0] for c in restored)
  print()
  print(f"Megatron-LM root of {nbytes / bu.MiB:.0f} MiB ({args.variant}, {json.dumps(args.sizes)})")
  print(bu.table(["contender", "median s", "range s (tries)", "GB/s", "peak RSS +MiB", "ran"],
                 bu.timing_rows(results, nbytes), align="lrrrrl"))  # fmt: skip
  print(f"restores agree (crc32 of every array): {agree}")
  pairs = (("ucp_convert", "dcp_torch_save"), ("ucp_convert", "megatron_save"),
           ("ucp_restore", "dcp_load_put"))  # fmt: skip
  summary = {"bytes": nbytes, "results": results, "restores_agree": agree}
  summary["ratios"] = bu.ratios(results, pairs)
  if args.json:
    bu.write_result(args.json, summary)
  return 1 if any(r["errors"] for r in results.values()) or not agree else 0


if __name__ == "__main__":
  sys.exit(main())
