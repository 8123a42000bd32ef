#!/usr/bin/env python
"""Mixture-of-experts checkpoints: restore onto an expert mesh, and DeepSpeed conversion.

Two parts, each contender in its own subprocess, rounds interleaved, medians reported:

`hf`: a Hugging Face Mixtral folder (safetensors, one tensor per expert, as the Hub has them;
  `--experts` experts of `--dim` x `--hidden` in `--layers` layers, written once under `--dir`)
  restored onto an (expert 4, data 2) mesh of 8 CPU devices, every expert weight stacked
  `[experts, ...]` and split over `expert` (and its `d_model` over `data`):
    ucp        `rules.from_hf` + `models.build(mesh=..., abstract=True)` + `rules.load_into`:
               lazy per-expert views, each device reading its slice
    baseline   `safetensors.numpy.load_file` + `np.stack` per layer + `jax.device_put` onto
               the same shardings
  Reported: wall time, peak RSS above the start, and the bytes each process read from disk
  (`/proc/self/io` read_bytes, page cache dropped before each try) beside the bytes its
  devices hold. With `--processes 2` the ucp restore also runs as 2 JAX processes (4 devices
  each, `jax.distributed` on 127.0.0.1): each process must read within 1.1x of what it holds.

`ds`: a DeepSpeed AutoEP checkpoint (transformers Mixtral, ep 2 x dp 2, ZeRO-1, made once with
  real DeepSpeed on CPU) converted by `ucp_jax.convert` and by DeepSpeed's `ds_to_universal`
  (the commands of scripts/bench_convert.py: equal durability, every output file fsynced),
  then compared bit for bit.

Usage:
  python scripts/bench_moe.py hf --rounds 3
  python scripts/bench_moe.py ds --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as bu


def make_folder(folder: str, args) -> int:
  """A Mixtral folder with random weights (one tensor per expert); returns its bytes."""
  import numpy as np
  from safetensors.numpy import save_file

  if os.path.isfile(os.path.join(folder, "config.json")):
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(0)
  d, f, v = args.dim, args.hidden, 512
  config = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "vocab_size": v,
    "hidden_size": d,
    "intermediate_size": f,
    "num_hidden_layers": args.layers,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_local_experts": args.experts,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
  }
  with open(os.path.join(folder, "config.json"), "w") as fh:
    json.dump(config, fh)
  shards = []
  for layer in range(args.layers):
    p = f"model.layers.{layer}."
    t = {
      p + "input_layernorm.weight": np.ones(d, np.float32),
      p + "post_attention_layernorm.weight": np.ones(d, np.float32),
      p + "self_attn.q_proj.weight": rng.standard_normal((d, d), np.float32),
      p + "self_attn.k_proj.weight": rng.standard_normal((d // 2, d), np.float32),
      p + "self_attn.v_proj.weight": rng.standard_normal((d // 2, d), np.float32),
      p + "self_attn.o_proj.weight": rng.standard_normal((d, d), np.float32),
      p + "block_sparse_moe.gate.weight": rng.standard_normal((args.experts, d), np.float32),
    }
    for e in range(args.experts):
      q = f"{p}block_sparse_moe.experts.{e}."
      t[q + "w1.weight"] = rng.standard_normal((f, d), np.float32)
      t[q + "w3.weight"] = rng.standard_normal((f, d), np.float32)
      t[q + "w2.weight"] = rng.standard_normal((d, f), np.float32)
    shards.append(t)
  shards.append(
    {
      "model.embed_tokens.weight": rng.standard_normal((v, d), np.float32),
      "model.norm.weight": np.ones(d, np.float32),
      "lm_head.weight": rng.standard_normal((v, d), np.float32),
    }
  )
  weight_map = {}
  for i, t in enumerate(shards):  # sharded as save_pretrained shards, with its index
    name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(t, os.path.join(folder, name))
    weight_map |= dict.fromkeys(t, name)
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
    json.dump({"metadata": {}, "weight_map": weight_map}, fh)
  return make_folder(folder, args)


def _read_bytes() -> int:
  with open("/proc/self/io") as f:
    return int(next(x for x in f if x.startswith("read_bytes")).split()[1])


def _evict(folder: str) -> None:
  """Drops the folder's pages from the page cache (only its: libraries stay cached)."""
  os.sync()
  for name in os.listdir(folder):
    fd = os.open(os.path.join(folder, name), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def hf_worker(args) -> None:
  """One restore (`args.contender`), possibly one of `args.processes` JAX processes."""
  processes = args.processes
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // processes}"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  import numpy as np

  if processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", processes, args.process_id)
  from flax import nnx

  from ucp_jax import models, rules

  rs, cfg = rules.from_hf(args.folder)
  mesh = jax.make_mesh((4, 2), ("expert", "data"))  # experts over processes, d_model within
  abstract = models.build(cfg, mesh=mesh, abstract=True)
  held = sum(_held(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(abstract)))
  bu.reset_peak_rss()
  rss0, io0, t0 = bu.rss_bytes(), _read_bytes(), time.perf_counter()
  if args.contender == "ucp":
    rules.load_into(abstract, args.folder, rs, subtree="params")
    leaves = jax.tree.leaves(nnx.state(abstract))
  else:
    from safetensors.numpy import load_file

    arrays = {}
    for name in sorted(os.listdir(args.folder)):
      if name.endswith(".safetensors"):
        arrays |= load_file(os.path.join(args.folder, name))
    stacked = rs.import_arrays(arrays)  # np.stack of the experts, transposes
    leaves = []
    for path, v in nnx.to_flat_state(nnx.state(abstract)):
      key = "/".join(map(str, path))
      leaves.append(jax.device_put(np.asarray(stacked[key]), v.get_value().sharding))
  jax.block_until_ready(leaves)
  seconds = time.perf_counter() - t0
  out = {
    "seconds": seconds,
    "peak": bu.peak_rss_bytes(True) - rss0,
    "read": _read_bytes() - io0,
    "held": held,
  }
  bu.write_result(args.result_file, out)


def _held(x) -> int:
  """Bytes of the distinct slices this process's devices hold of `x` (a replicated one once)."""
  import numpy as np

  sharding = x.sharding
  seen = set()
  total = 0
  for index in sharding.addressable_devices_indices_map(x.shape).values():
    key = tuple((s.start, s.stop) for s in index)
    if key in seen:
      continue
    seen.add(key)
    n = 1
    for s, dim in zip(index, x.shape):
      start, stop, _ = s.indices(dim)
      n *= stop - start
    total += n * np.dtype(x.dtype).itemsize
  return total


def hf(args) -> int:
  folder = os.path.join(
    args.dir, f"mixtral_e{args.experts}_d{args.dim}_h{args.hidden}_l{args.layers}"
  )
  size = make_folder(folder, args)
  print(f"{folder}: {size / 2**20:.0f} MiB", flush=True)
  runs: dict[str, list[dict]] = {}
  contenders = [("ucp", 1), ("baseline", 1)] + ([("ucp", 2)] if args.processes > 1 else [])
  for _ in range(args.rounds):
    for name, procs in contenders:
      _evict(folder)
      out = _run_hf(name, procs, folder)
      runs.setdefault(f"{name} x{procs}", []).append(out)
  rows = []
  for name, outs in runs.items():
    med = {k: statistics.median(o[k] for o in outs) for k in ("seconds", "peak")}
    reads = [max(p["read"] / p["held"] for p in o["per_process"]) for o in outs]
    rows.append(
      [name, f"{med['seconds']:.2f}", bu.mib(int(med["peak"])), f"{statistics.median(reads):.2f}"]
    )
  print(
    bu.table(["contender", "seconds (median)", "peak RSS", "read / held (worst process)"], rows)
  )
  return 0


def _run_hf(name: str, processes: int, folder: str) -> dict:
  port = _free_port()
  procs, files = [], []
  for i in range(processes):
    fd, path = __import__("tempfile").mkstemp(suffix=".json")
    os.close(fd)
    files.append(path)
    cmd = [
      sys.executable,
      __file__,
      "hf-worker",
      "--contender",
      name,
      "--folder",
      folder,
      "--processes",
      str(processes),
      "--process-id",
      str(i),
      "--port",
      str(port),
      "--result-file",
      path,
    ]
    procs.append(subprocess.Popen(cmd))
  for p in procs:
    if p.wait():
      raise SystemExit(f"{name} worker failed")
  per = []
  for path in files:
    with open(path) as fh:
      per.append(json.load(fh))
  return {
    "seconds": max(p["seconds"] for p in per),
    "peak": max(p["peak"] for p in per),
    "per_process": per,
  }


def _free_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def ds(args) -> int:
  import bench_convert as bc
  from _ds_launch import generate_checkpoint

  ckpt = os.path.join(args.dir, f"autoep_e{args.experts}_d{args.dim}_h{args.hidden}_l{args.layers}")
  if not os.path.isfile(os.path.join(ckpt, "latest")):
    sizes = ["--experts", str(args.experts), "--dim", str(args.dim)]
    sizes += ["--hidden", str(args.hidden), "--layers", str(args.layers)]

    def cmd(tmp: str) -> list[str]:
      return [sys.executable, __file__, "ds-worker", "--out", tmp, *sizes]

    generate_checkpoint(ckpt, 2, cmd, what="AutoEP")
  with open(os.path.join(ckpt, "latest")) as f:
    tag_dir = os.path.join(ckpt, f.read().strip())
  env = dict(os.environ, DS_ACCELERATOR="cpu", JAX_PLATFORMS="cpu")
  outs = {"ucp": os.path.join(args.dir, "out_ucp"), "deepspeed": os.path.join(args.dir, "out_ds")}
  cmds = {
    "ucp": bc._ucp_cmd(tag_dir, outs["ucp"]),
    "deepspeed": bc._ds_cmd(tag_dir, outs["deepspeed"]),
  }
  runs: dict[str, list[dict]] = {}
  for _ in range(args.rounds):
    for name, cmd in cmds.items():
      __import__("shutil").rmtree(outs[name], ignore_errors=True)
      bc._warm(tag_dir)
      os.sync()
      result = bc.run(cmd, env)
      result.update(json.loads(result["output"].split("RESULT ", 1)[1].splitlines()[0]))
      runs.setdefault(name, []).append(result)
  med = {
    n: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "convert_s", "tree_pss")}
    for n, rs in runs.items()
  }
  rows = [
    [n, f"{m['seconds']:.2f}", f"{m['convert_s']:.2f}", bu.mib(int(m["tree_pss"]))]
    for n, m in med.items()
  ]
  print(bu.table(["contender", "command s (median)", "convert s", "peak PSS"], rows))
  print(
    f"speedup: {med['deepspeed']['seconds'] / med['ucp']['seconds']:.1f}x on the command, "
    f"{med['deepspeed']['convert_s'] / med['ucp']['convert_s']:.1f}x on the conversion"
  )
  print(f"bit for bit: {bc.check(outs['ucp'], outs['deepspeed'])} arrays equal")
  return 0


def ds_worker(args) -> None:
  """One rank of the AutoEP run the `ds` part converts (1 step, then a checkpoint)."""
  os.environ.setdefault("DS_ACCELERATOR", "cpu")
  import deepspeed
  import torch
  import transformers
  from make_moe_fixtures import autoep_shim

  torch.set_num_threads(1)
  deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
  autoep_shim()
  torch.manual_seed(0)
  cfg = transformers.MixtralConfig(
    vocab_size=512,
    hidden_size=args.dim,
    intermediate_size=args.hidden,
    num_hidden_layers=args.layers,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_local_experts=args.experts,
    num_experts_per_tok=2,
  )
  model = transformers.MixtralForCausalLM(cfg)
  config = {
    "train_micro_batch_size_per_gpu": 1,
    "steps_per_print": 1_000_000,
    "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "lr": 1e-3}},
    "zero_optimization": {"stage": 1},
    "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"},
  }
  engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=config
  )
  ids = torch.randint(0, 512, (1, 8))
  engine.backward(engine(input_ids=ids, labels=ids).loss)
  engine.step()
  engine.save_checkpoint(args.out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("part", choices=["hf", "ds", "hf-worker", "ds-worker"])
  parser.add_argument("--dir", default="/tmp/ucp_bench_moe")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--experts", type=int, default=8)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--contender", help=argparse.SUPPRESS)
  parser.add_argument("--folder", help=argparse.SUPPRESS)
  parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--result-file", help=argparse.SUPPRESS)
  parser.add_argument("--out", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  os.makedirs(args.dir, exist_ok=True)
  if args.part == "hf-worker":
    hf_worker(args)
    return 0
  if args.part == "ds-worker":
    ds_worker(args)
    return 0
  return hf(args) if args.part == "hf" else ds(args)


if __name__ == "__main__":
  sys.exit(main())
