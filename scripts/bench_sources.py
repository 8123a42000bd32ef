#!/usr/bin/env python
"""A sharded safetensors checkpoint restored onto 8 CPU devices: ucp_jax against its peers.

One run, the same folder for every contender: `--arrays` float32 tensors of random numbers,
`--size-mb` MiB in all (default 16 x 4096x4096 = 1 GiB), written by the `safetensors` library
itself into shards of `--shard-mb` MiB with a `model.safetensors.index.json`, as
`save_pretrained` lays a Hugging Face folder out. The target: every tensor on an 8-device mesh,
3/4 of them `P('x', None)` and 1/4 `P(None, 'x')`.

Contenders, each in its own subprocess (peak RSS per contender), in `--rounds` interleaved
rounds of `--repeat` tries:
  ucp             ucp_jax.restore(folder, target, subtree="params"): the folder read in place,
                  each device's slice straight from the memory-mapped file.
  load_put        safetensors.numpy.load_file(shard) for every shard, then
                  jax.device_put(array, sharding): what loading a state dict and placing it does.
  slices_put      safe_open(shard, "numpy").get_slice(name)[index] for every device slice, then
                  jax.make_array_from_single_device_arrays: the best one can do by hand with the
                  safetensors library.
(transformers 5 has no Flax models any more, so there is no `from_pretrained` into JAX to time.)

With `--dcp` (the default), the same tensors are also saved by `torch.distributed.checkpoint`
(one process, `dcp.save`), and:
  dcp_ucp         ucp_jax.restore(dcp_dir, target, subtree="params"): each slice read in place.
  dcp_load_put    dcp.load into preallocated torch tensors, then jax.device_put of each.
  dcp_convert     ucp_jax.convert(dcp_dir, out): a universal checkpoint (durable).
  dcp_torch_save  torch.distributed.checkpoint.format_utils.dcp_to_torch_save(dcp_dir, out.pt),
                  then the file fsynced (equal durability).

Every contender first runs once untimed (imports, thread pools, compile caches), and every try
starts after an untimed `os.sync()`; the files were just written, so the page cache is warm for
all (the same cache and compile state). Every result is checked: sharding as asked and a
crc32 of every array equal to the original. Reported: median and range of all tries, GB/s,
peak RSS above the state, and the ratios ucp/peer.

Usage:
  python scripts/bench_sources.py                          # 1 GiB, 16 tensors, 256 MiB shards
  python scripts/bench_sources.py --size-mb 256 --rounds 3 --repeat 2 --json out.json
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import zlib

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as bu  # noqa: E402

CONTENDERS = ("ucp", "load_put", "slices_put")
DCP_CONTENDERS = ("dcp_ucp", "dcp_load_put", "dcp_convert", "dcp_torch_save")


def _shape(size_mb: float, arrays: int) -> tuple[int, int]:
  side = max(8, int(math.sqrt(size_mb * bu.MiB / 4 / arrays)) // 8 * 8)
  return side, side


def _names(arrays: int) -> list[str]:
  return [f"model.layers.{i}.weight" for i in range(arrays)]


def write_folder(folder: str, size_mb: float, arrays: int, shard_mb: float, seed: int) -> dict:
  """The sharded folder, written by `safetensors` (as save_pretrained does); crc32 per tensor."""
  import numpy as np
  from safetensors.numpy import save_file

  os.makedirs(folder, exist_ok=True)
  shape = _shape(size_mb, arrays)
  crcs, weight_map, shard, size, files = {}, {}, {}, 0, []

  def flush():
    nonlocal shard, size
    if shard:
      name = f"model-{len(files) + 1:05d}.safetensors"
      save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
      files.append(name)
      weight_map.update(dict.fromkeys(shard, name))
      shard, size = {}, 0

  for i, name in enumerate(_names(arrays)):
    array = np.random.default_rng(seed + i).random(shape, dtype=np.float32)
    crcs[name] = zlib.crc32(array)
    if shard and size + array.nbytes > shard_mb * bu.MiB:
      flush()
    shard[name] = array
    size += array.nbytes
  flush()
  total = len(crcs) * shape[0] * shape[1] * 4
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  return {"crcs": crcs, "shape": list(shape), "bytes": total, "files": files}


def write_dcp(folder: str, info: dict, seed: int) -> None:
  """The same tensors, saved by torch.distributed.checkpoint from one process."""
  import numpy as np
  import torch
  import torch.distributed.checkpoint as dcp

  shape = tuple(info["shape"])
  state = {
    name: torch.from_numpy(np.random.default_rng(seed + i).random(shape, dtype=np.float32))
    for i, name in enumerate(_names(len(info["crcs"])))
  }
  dcp.save(state, checkpoint_id=folder)


def _shardings(names):
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()), ("x",))
  return {
    n: NamedSharding(mesh, P(None, "x") if i % 4 == 3 else P("x", None))
    for i, n in enumerate(names)
  }


def _check(arrays: dict, crcs: dict, shardings: dict) -> str | None:
  import numpy as np

  bad = []
  for name, array in arrays.items():
    if not array.sharding.is_equivalent_to(shardings[name], array.ndim):
      bad.append(f"{name}: sharding {array.sharding}")
    elif zlib.crc32(np.ascontiguousarray(np.asarray(array))) != crcs[name]:
      bad.append(f"{name}: crc32 differs")
  if set(arrays) != set(crcs):
    bad.append(f"keys differ: {sorted(set(arrays) ^ set(crcs))}")
  return "; ".join(bad) or None


def worker(args) -> int:
  import jax

  with open(os.path.join(args.dir, "info.json")) as f:
    info = json.load(f)
  names = sorted(info["crcs"])
  shardings = _shardings(names)
  shape = tuple(info["shape"])
  folder = os.path.join(args.dir, "hf")
  with open(os.path.join(folder, "model.safetensors.index.json")) as f:
    index = json.load(f)["weight_map"]
  out = {"name": args.worker, "phases": {}, "errors": []}

  dcp_dir = os.path.join(args.dir, "dcp")
  if args.worker in ("ucp", "dcp_ucp"):
    import ucp_jax

    target = {n: jax.ShapeDtypeStruct(shape, "float32", sharding=s) for n, s in shardings.items()}
    where = folder if args.worker == "ucp" else dcp_dir

    def run():
      return ucp_jax.restore(where, target, subtree="params")

  elif args.worker == "dcp_load_put":
    import torch
    import torch.distributed.checkpoint as dcp

    def run():
      state = {n: torch.empty(shape, dtype=torch.float32) for n in names}
      dcp.load(state, checkpoint_id=dcp_dir)
      return jax.block_until_ready(
        {n: jax.device_put(t.numpy(), shardings[n]) for n, t in state.items()}
      )

  elif args.worker in ("dcp_convert", "dcp_torch_save"):
    return _convert_worker(args, dcp_dir, out)

  elif args.worker == "load_put":
    from safetensors.numpy import load_file

    def run():
      arrays = {}
      for file in sorted(set(index.values())):
        for name, array in load_file(os.path.join(folder, file)).items():
          arrays[name] = jax.device_put(array, shardings[name])
      return jax.block_until_ready(arrays)

  else:
    from safetensors import safe_open

    def run():
      arrays = {}
      for file in sorted(set(index.values())):
        with safe_open(os.path.join(folder, file), framework="numpy") as f:
          for name in f.keys():
            sharding = shardings[name]
            piece = f.get_slice(name)
            singles = [
              jax.device_put(piece[index], device)
              for device, index in sharding.addressable_devices_indices_map(shape).items()
            ]
            arrays[name] = jax.make_array_from_single_device_arrays(shape, sharding, singles)
      return jax.block_until_ready(arrays)

  jax.block_until_ready(
    run()
  )  # untimed: imports, thread pools, jit caches warm for every contender
  errors = []
  stats, _ = bu.measure(
    lambda: jax.block_until_ready(run()),
    repeat=args.repeat,
    after=lambda result, i: errors.append(_check(result, info["crcs"], shardings)),
  )
  stats["verified"] = not any(errors)
  out["errors"] = [e for e in errors if e]
  out["phases"]["restore"] = stats
  print(f"  [{args.worker}] restore: {stats['seconds']:.3f} s, verified={stats['verified']}")
  bu.write_result(args.result_file, out)
  return 0


def _convert_worker(args, dcp_dir: str, out: dict) -> int:
  """Times a DCP folder -> one file or checkpoint, synced to disk; checks nothing is lost."""
  target = os.path.join(args.dir, f"out_{args.worker}")

  def run():
    shutil.rmtree(target, ignore_errors=True)
    if os.path.exists(target + ".pt"):
      os.remove(target + ".pt")
    if args.worker == "dcp_convert":
      import ucp_jax

      return ucp_jax.convert(dcp_dir, target).arrays
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dcp_dir, target + ".pt")
    fd = os.open(target + ".pt", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return 1

  run()  # untimed: imports and first use
  stats, _ = bu.measure(run, repeat=args.repeat)
  out["phases"]["restore"] = stats
  print(f"  [{args.worker}] convert: {stats['seconds']:.3f} s")
  bu.write_result(args.result_file, out)
  return 0


def main(argv=None) -> int:
  ap = bu.worker_parser(__doc__)
  ap.add_argument("--size-mb", type=float, default=1024)
  ap.add_argument("--arrays", type=int, default=16)
  ap.add_argument("--shard-mb", type=float, default=256)
  bu.add_round_args(ap, repeat=2, rounds=2)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--no-dcp", dest="dcp", action="store_false", help="skip the DCP contenders")
  args = ap.parse_args(argv)
  if args.worker:
    return worker(args)
  with bu.work_dir(args, "ucp_bench_sources_"):
    info = write_folder(
      os.path.join(args.dir, "hf"), args.size_mb, args.arrays, args.shard_mb, args.seed
    )
    with open(os.path.join(args.dir, "info.json"), "w") as f:
      json.dump(info, f)
    if args.dcp:
      write_dcp(os.path.join(args.dir, "dcp"), info, args.seed)
    common = ["--dir", args.dir, "--repeat", str(args.repeat)]
    names = CONTENDERS + (DCP_CONTENDERS if args.dcp else ())
    rounds = bu.worker_rounds(os.path.abspath(__file__), names, common, args.rounds)
    results = bu.gather_rounds(rounds, "restore")
  nbytes = info["bytes"]
  print()
  print(
    f"{len(info['crcs'])} x {info['shape']} float32 = {nbytes / bu.MiB:.0f} MiB in {len(info['files'])} safetensors shards, onto 8 CPU devices"
  )
  print(
    bu.table(
      ["contender", "median s", "range s (tries)", "GB/s", "peak RSS +MiB", "verified"],
      bu.timing_rows(results, nbytes),
      align="lrrrrl",
    )
  )
  pairs = (
    ("ucp", "load_put"),
    ("ucp", "slices_put"),
    ("dcp_ucp", "dcp_load_put"),
    ("dcp_convert", "dcp_torch_save"),
  )
  summary = {"bytes": nbytes, "results": results, "ratios": bu.ratios(results, pairs)}
  if args.json:
    bu.write_result(args.json, summary)
  return 1 if any(r["errors"] for r in results.values()) else 0


if __name__ == "__main__":
  sys.exit(main())
