"""A Llama-3-8B-shaped bf16 Hugging Face folder restored onto 8 CPU devices, sharded for the
Flax model (FSDP over `data` x TP over `model`): ucp_jax against its peers.

The folder has Llama 3 8B's widths (hidden 4096, MLP 14336, 32 heads, 8 key/value heads,
vocabulary 128256) with `--layers` layers (32 in the real model; fewer fit this machine),
bfloat16 weights written by the `safetensors` library into shards of `--shard-mb` MiB with a
`model.safetensors.index.json` and a `config.json`, as `save_pretrained` writes. Every
contender makes the same arrays: the Flax layout (`rules.from_hf`: transposed kernels, heads
split), bfloat16, on the shardings `models.shardings` gives on a 2 x 4 mesh.

Contenders, each in its own subprocess (peak RSS per contender), in `--rounds` interleaved
rounds, their order rotated each round:
  ucp        `ucp_jax.restore(folder, target, subtree="params", rules=rs)`: each device reads
             its slice through the rules' views
  load_put   per shard, `safetensors.numpy.load_file`, the rules run eagerly
             (`rs.import_arrays`), then `jax.device_put` of each array onto its sharding
  safe_open  per tensor, `safe_open(...).get_slice` of each device's slice (the rules' index
             arithmetic done by hand), `device_put` to the device, then
             `jax.make_array_from_single_device_arrays`
  bound      the physical bound: every shard's tensor bytes read by `preadv` into fresh
             anonymous memory, one thread per core, nothing laid out (what any restore
             that makes new arrays from the page cache pays at least)

Each worker warms up on a few small arrays (imports, thread pools), then restores everything
once, timed (`--repeat` more tries would start with the first's freed memory still held by
the process); the table gives medians over all tries with their range, and the median peak
RSS above the process's RSS before the try (VmHWM). Every contender's arrays are checked equal
(a crc32 per array).

  python scripts/bench_llama8b.py --layers 4 --rounds 3
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_util as bu

CONTENDERS = ("ucp", "load_put", "safe_open", "bound")
LLAMA3_8B = {
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 128256,
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "num_attention_heads": 32,
  "num_key_value_heads": 8,
  "max_position_embeddings": 8192,
  "rms_norm_eps": 1e-5,
  "rope_theta": 500000.0,
  "tie_word_embeddings": False,
  "dtype": "bfloat16",
}


def write_folder(folder: str, layers: int, shard_mb: float, seed: int) -> dict:
  """The folder: bf16 tensors of small random values, sharded as `save_pretrained` shards."""
  import ml_dtypes
  import numpy as np
  from safetensors.numpy import save_file

  c = LLAMA3_8B
  d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
  kv = d // c["num_attention_heads"] * c["num_key_value_heads"]
  shapes = {"model.embed_tokens.weight": (v, d)}
  for i in range(layers):
    p = f"model.layers.{i}."
    shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
    for name, shape in (("q", (d, d)), ("k", (kv, d)), ("v", (kv, d)), ("o", (d, d))):
      shapes[f"{p}self_attn.{name}_proj.weight"] = shape
    for name, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
      shapes[f"{p}mlp.{name}_proj.weight"] = shape
  shapes |= {"model.norm.weight": (d,), "lm_head.weight": (v, d)}
  rng = np.random.default_rng(seed)
  os.makedirs(folder, exist_ok=True)
  files, current, size, weight_map = [], {}, 0, {}
  limit = shard_mb * bu.MiB

  def flush():
    nonlocal current, size
    if current:
      name = f"model-{len(files) + 1:05d}.safetensors"
      save_file(current, os.path.join(folder, name), metadata={"format": "pt"})
      files.append(name)
      weight_map.update({k: name for k in current})
      current, size = {}, 0

  for name, shape in shapes.items():
    # bit patterns below 2**14: finite bfloat16 values under 1 in magnitude
    bits = rng.integers(0, 1 << 14, size=shape, dtype=np.uint16)
    array = bits.view(ml_dtypes.bfloat16)
    if current and size + array.nbytes > limit:
      flush()
    current[name] = array
    size += array.nbytes
  flush()
  n = len(files)
  for i, name in enumerate(files):  # the names save_pretrained gives: model-0000i-of-0000n
    os.rename(
      os.path.join(folder, name), os.path.join(folder, f"model-{i + 1:05d}-of-{n:05d}.safetensors")
    )
  weight_map = {
    k: f"model-{int(v[6:11]):05d}-of-{n:05d}.safetensors" for k, v in weight_map.items()
  }
  nbytes = sum(int(np.prod(s)) * 2 for s in shapes.values())
  index = {"metadata": {"total_size": nbytes}, "weight_map": weight_map}
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
    json.dump(index, f)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({**LLAMA3_8B, "num_hidden_layers": layers}, f)
  return {"nbytes": nbytes, "files": n, "tensors": len(shapes), "layers": layers}


def _setup(folder: str):
  """The rule set, the bf16 restore target on a 2 x 4 mesh, and target key -> (name, rule)."""
  import jax

  from ucp_jax import models, rules
  from ucp_jax.tree import _tree

  rs, cfg = rules.from_hf(folder)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  model = models.build(cfg, abstract=True)
  target = jax.tree.map(
    lambda t: jax.ShapeDtypeStruct(t.shape, "bfloat16", sharding=t.sharding),
    models.shardings(model, mesh),
  )
  flat = {
    _tree.from_path(p).removesuffix("/value"): leaf
    for p, leaf in jax.tree_util.tree_leaves_with_path(target)
  }
  with open(os.path.join(folder, "model.safetensors.index.json")) as f:
    names = list(json.load(f)["weight_map"])
  sources = {key: srcs[0] for key, srcs in rs.map_names(names).items()}
  plan = {r.source: r for r in rs.rules}
  by_key = {}
  for key, name in sources.items():
    rule = next(r for r in plan.values() if r.regex.fullmatch(name))
    by_key[key] = (name, rule)
  return rs, target, flat, by_key


def _slice_of(piece, rule, index, shape):
  """The target slice `index` (of a target of `shape`) read from the source slice `piece`:
  the index arithmetic of the Llama rules (transpose, then split heads on axis 1 or 0)."""
  from ucp_jax.mapping._transforms import Split, Transpose

  ts = rule.transforms
  full = [(s.start or 0, shape[i] if s.stop is None else s.stop) for i, s in enumerate(index)]
  if not ts:
    return piece[tuple(slice(a, b) for a, b in full)]
  assert isinstance(ts[0], Transpose)
  if len(ts) == 1:  # [in, out] from [out, in]
    (a0, a1), (b0, b1) = full
    return piece[b0:b1, a0:a1].T
  split = ts[1]
  assert isinstance(split, Split) and len(ts) == 2
  k = shape[2] if split.axis == 1 else shape[1]
  if split.axis == 1:  # [in, heads, k] from [heads * k, in]
    (i0, i1), (h0, h1), _ = full
    return piece[h0 * k : h1 * k, i0:i1].T.reshape(i1 - i0, h1 - h0, k)
  (h0, h1), _, (d0, d1) = full  # [heads, k, d] from [d, heads * k]
  return piece[d0:d1, h0 * k : h1 * k].T.reshape(h1 - h0, k, d1 - d0)


def worker(args) -> int:
  import jax
  import numpy as np

  folder = os.path.join(args.dir, "hf")
  rs, target, flat, by_key = _setup(folder)
  with open(os.path.join(folder, "model.safetensors.index.json")) as f:
    weight_map = json.load(f)["weight_map"]
  out = {"name": args.worker, "phases": {}, "errors": []}

  small = [k for k in flat if k.endswith(("norm/scale", "attn/k/kernel"))]  # for warming up
  if args.worker == "ucp":
    import ucp_jax

    def run(keys=None):
      state = ucp_jax.restore(folder, target, subtree="params", rules=rs, partial=keys is not None)
      leaves = {
        ucp_jax.tree._tree.from_path(p).removesuffix("/value"): x
        for p, x in jax.tree_util.tree_leaves_with_path(state)
      }
      return leaves if keys is None else {k: leaves[k] for k in keys}

    def warm():
      part = {}
      for key in small:  # a partial target: the keys named, below params/
        node = part
        *parents, last = key.split("/")
        for name in parents:
          node = node.setdefault(name, {})
        node[last] = flat[key]
      return ucp_jax.restore(folder, part, subtree="params", rules=rs, partial=True)

  elif args.worker == "load_put":
    from safetensors.numpy import load_file

    def run():
      arrays = {}
      for file in sorted(set(weight_map.values())):
        mapped = rs.import_arrays(load_file(os.path.join(folder, file)))
        for key, array in mapped.items():
          arrays[key] = jax.device_put(array, flat[key].sharding)
        del mapped
      return jax.block_until_ready(arrays)

    def warm():  # no file loaded whole here: that memory would stay with the process
      rs.import_arrays({})
      return [jax.device_put(np.zeros(flat[k].shape, "bfloat16"), flat[k].sharding) for k in small]

  elif args.worker == "bound":
    import concurrent.futures
    import mmap

    files = sorted(set(weight_map.values()))

    def read_into_fresh(file):
      path = os.path.join(folder, file)
      with open(path, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
      size = os.path.getsize(path) - start
      block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
      view, done, fd = memoryview(block), 0, os.open(path, os.O_RDONLY)
      try:
        while done < size:
          done += os.preadv(fd, [view[done : done + (64 << 20)]], start + done)
      finally:
        os.close(fd)
      view.release()
      return block

    def run():
      with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        return {f: b for f, b in zip(files, pool.map(read_into_fresh, files))}

    def warm():
      return None

  else:
    from safetensors import safe_open

    def run(keys=None):
      arrays = {}
      handles = {}
      for key, (name, rule) in by_key.items():
        if keys is not None and key not in keys:
          continue
        file = weight_map[name]
        if file not in handles:
          handles[file] = safe_open(os.path.join(folder, file), framework="numpy")
        piece = handles[file].get_slice(name)
        leaf = flat[key]
        singles = [
          jax.device_put(np.ascontiguousarray(_slice_of(piece, rule, index, leaf.shape)), device)
          for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items()
        ]
        arrays[key] = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, singles)
      return jax.block_until_ready(arrays)

    def warm():
      return run(set(small))

  crcs = {}

  def check(result, i):
    if i == 0 and args.worker != "bound":
      for key, array in result.items():
        crcs[key] = zlib.crc32(np.asarray(array).tobytes())

  # untimed: imports, thread pools and caches warmed on a few small arrays only, so that the
  # peak RSS of the timed try is what the restore needs (memory a whole earlier restore freed
  # would stay with the process and hide it)
  jax.block_until_ready(warm())
  stats, _ = bu.measure(lambda: jax.block_until_ready(run()), repeat=args.repeat, after=check)
  if args.worker == "bound":
    crcs = None  # bytes, not arrays: nothing to compare
  out["phases"]["restore"] = stats
  out["crcs"] = crcs
  print(f"  [{args.worker}] restore: {stats['seconds']:.2f} s", flush=True)
  bu.write_result(args.result_file, out)
  return 0


def main(argv=None) -> int:
  ap = bu.worker_parser(__doc__)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--shard-mb", type=float, default=1024)
  bu.add_round_args(ap, repeat=1, rounds=3)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  if args.worker:
    return worker(args)
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
  env.setdefault("JAX_PLATFORMS", "cpu")
  with bu.work_dir(args, "ucp_bench_llama8b_"):
    info = write_folder(os.path.join(args.dir, "hf"), args.layers, args.shard_mb, args.seed)
    print(
      f"Llama-3-8B-shaped folder, {args.layers} layers: {info['tensors']} bf16 tensors, "
      f"{info['nbytes'] / bu.MiB:.0f} MiB in {info['files']} safetensors shards",
      flush=True,
    )
    common = ["--dir", args.dir, "--repeat", str(args.repeat)]
    results: dict[str, dict] = {}
    script = os.path.abspath(__file__)
    for name, run in bu.worker_rounds(
      script, CONTENDERS, common, args.rounds, env=env, rotate=True
    ):
      kept = results.setdefault(name, {"tries": [], "peaks": [], "errors": [], "crcs": None})
      if "error" in run:
        kept["errors"].append(run["error"])
        continue
      stats = run["phases"]["restore"]
      kept["tries"] += stats["tries"]
      kept["peaks"].append(stats["peak_delta"])
      kept["crcs"] = kept["crcs"] or run["crcs"]
    reference = results["ucp"]["crcs"]
    rows, summary = [], {"info": info, "results": {}}
    for name in CONTENDERS:
      r = results[name]
      tries = r["tries"]
      med = statistics.median(tries) if tries else None
      same = r["crcs"] == reference and reference is not None
      peak = statistics.median(r["peaks"]) if r["peaks"] else None
      rows.append(
        [
          name,
          bu.fmt(med),
          f"{bu.fmt(min(tries) if tries else None)}-{bu.fmt(max(tries) if tries else None)} ({len(tries)})",
          bu.fmt(bu.gbps(info["nbytes"], med)),
          bu.mib(peak),
          "n/a" if name == "bound" else "yes" if same else "NO",
        ]
      )
      summary["results"][name] = {"median_s": med, "tries": tries, "peak_delta": peak, "same": same}
      summary["results"][name]["errors"] = r["errors"]
    print(
      bu.table(
        ["contender", "median s", "range s (tries)", "GB/s", "peak RSS +MiB", "same arrays"], rows
      )
    )
    mine = summary["results"]["ucp"]
    for peer in CONTENDERS[1:-1]:
      theirs = summary["results"][peer]
      if mine["median_s"] and theirs["median_s"]:
        speed = theirs["median_s"] / mine["median_s"]
        memory = mine["peak_delta"] / max(1, theirs["peak_delta"])
        print(f"ucp vs {peer}: {speed:.2f}x faster (median), peak RSS {memory:.2f}x of theirs")
    bound = summary["results"]["bound"]["median_s"]
    if mine["median_s"] and bound:
      print(
        f"ucp takes {mine['median_s'] / bound:.2f}x the bound (the bytes read, nothing laid out)"
      )
    if args.json:
      with open(args.json, "w") as f:
        json.dump(summary, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
