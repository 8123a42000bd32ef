"""Save and restore planned for thousands of hosts, without the hosts (docs/scale.md).

Runs ucp_jax's own planners (chunk and bundle choice, who-writes-what, the chunks each host
reads) on meshes of 4,096 and 32,768 simulated devices (8 per process) for the
training state of a Llama-2-70B-shaped model with Adam (params and two moments in
float32, about 0.8 TB), and reports per layout:

  - planning time of one process (every array, cold caches);
  - bytes written per process, and their balance;
  - objects per checkpoint;
  - coordination-service round trips per process per save (the agreement calls a
    real save makes, recorded, at the round trips each one costs);
  - bytes each process reads restoring onto a different mesh.

No data is allocated: a sharding's index map needs only device ids and process
indices, which stand-in devices provide.

Usage: python scripts/simulate_scale.py [--chunk-mib 4] [--bundle-mib 256] [--layers 80] [--stacked]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax.base import _multihost
from ucp_jax.store import _bundle, _chunks, _owners, _regions, _zarr

DEVICES_PER_PROCESS = 8
ITEMSIZE = 4  # float32 params and Adam moments


class StandIn:
  """A simulated device: an id and the process it belongs to."""

  platform = "cpu"
  device_kind = "simulated"

  def __init__(self, id: int):
    self.id = id
    self.process_index = id // DEVICES_PER_PROCESS

  def __repr__(self):
    return f"StandIn({self.id})"


def mesh(data: int, fsdp: int, tensor: int) -> Mesh:
  devices = np.array([StandIn(i) for i in range(data * fsdp * tensor)])
  return Mesh(devices.reshape(data, fsdp, tensor), ("data", "fsdp", "tensor"))


def llama70b(layers: int, stacked: bool = False) -> dict[str, tuple[tuple[int, ...], P]]:
  """Parameter shapes and partition specs, as a Megatron/MaxText-style FSDP+TP layout.

  `stacked`: the layers scanned over, as MaxText and `nnx.scan` models hold them (one
  array per kind of layer parameter, the layer its leading dimension).
  """
  d, ff, kv, vocab = 8192, 28672, 1024, 128256
  params = {
    "embed": ((vocab, d), P("tensor", "fsdp")),
    "final_norm": ((d,), P()),
    "lm_head": ((d, vocab), P("fsdp", "tensor")),
  }
  layer = {
    "attn/q": ((d, d), P("fsdp", "tensor")),
    "attn/k": ((d, kv), P("fsdp", "tensor")),
    "attn/v": ((d, kv), P("fsdp", "tensor")),
    "attn/o": ((d, d), P("tensor", "fsdp")),
    "mlp/gate": ((d, ff), P("fsdp", "tensor")),
    "mlp/up": ((d, ff), P("fsdp", "tensor")),
    "mlp/down": ((ff, d), P("tensor", "fsdp")),
    "attn_norm": ((d,), P()),
    "mlp_norm": ((d,), P()),
  }
  for name, (shape, spec) in layer.items():
    if stacked:
      params[f"layers/{name}"] = ((layers, *shape), P(None, *spec))
    else:
      params |= {f"layers_{i}/{name}": (shape, spec) for i in range(layers)}
  return {f"{slot}/{k}": v for slot in ("params", "opt/mu", "opt/nu") for k, v in params.items()}


def plan_save(state, m: Mesh, chunk_bytes: int, bundle_bytes: int | None, process: int):
  """Chunks and bundles per array and the units `process` owns, timed as one process computes them.

  Returns (chunks, files, plans, seconds): `files` is the shape of each array's files (its
  bundle, or its chunk when chunks are not bundled), the unit an owner writes whole.
  """
  start = time.perf_counter()
  chunks, files, plans = {}, {}, {}
  for key, (shape, spec) in state.items():
    sharding = NamedSharding(m, spec)
    shard = sharding.shard_shape(shape)
    chunks[key] = _zarr.choose_chunks(shape, shard, ITEMSIZE, chunk_bytes)
    writers = _owners.writers(sharding, shape)
    block = _owners.block_shape(sharding, shape) or shard  # what one process holds
    bundle = _bundle.choose(shape, block, chunks[key], ITEMSIZE, bundle_bytes, writers)
    files[key] = bundle or chunks[key]
    plans[key] = _owners.of_sharding(key, sharding, shape, files[key], process)
  return chunks, files, plans, time.perf_counter() - start


def bytes_written(state, m: Mesh, chunks) -> np.ndarray:
  """Bytes each process writes under the plan."""
  written = np.zeros(m.devices.size // DEVICES_PER_PROCESS, dtype=np.int64)
  for key, (shape, spec) in state.items():
    sharding = NamedSharding(m, spec)
    for process, _, region in _owners.every_of_sharding(key, sharding, shape, chunks[key]):
      written[process] += _regions.size(region) * ITEMSIZE
  return written


def bytes_written_replica_zero(state, m: Mesh) -> np.ndarray:
  """The same, had replica 0 of every shard written it (the rule before the plan)."""
  processes = m.devices.size // DEVICES_PER_PROCESS
  written = np.zeros(processes, dtype=np.int64)
  cache = {}
  for shape, spec in state.values():
    if (shape, spec) not in cache:
      cache[shape, spec] = per_process = np.zeros(processes, dtype=np.int64)
      index_map = NamedSharding(m, spec).devices_indices_map(shape)
      for region, devices in _regions.group_regions(index_map, shape):
        per_process[devices[0].process_index] += _regions.size(region) * ITEMSIZE
    written += cache[shape, spec]
  return written


def bytes_read(state, m: Mesh, chunks) -> tuple[np.ndarray, np.ndarray]:
  """(bytes read, bytes held) per process restoring onto `m`: each needed chunk once, whole."""
  processes = m.devices.size // DEVICES_PER_PROCESS
  read = np.zeros(processes, dtype=np.int64)
  held = np.zeros(processes, dtype=np.int64)
  cache = {}  # arrays of one shape, layout and chunking read alike
  for key, (shape, spec) in state.items():
    layout = (shape, spec, chunks[key])
    if layout not in cache:
      cache[layout] = _restore_reads(NamedSharding(m, spec), shape, chunks[key], processes)
    read += cache[layout][0]
    held += cache[layout][1]
  return read, held


def _restore_reads(sharding, shape, chunks, processes):
  local = collections.defaultdict(dict)
  for device, index in sharding.devices_indices_map(shape).items():
    local[device.process_index][device] = index
  chunk_bytes = int(np.prod(chunks)) * ITEMSIZE
  read = np.zeros(processes, dtype=np.int64)
  held = np.zeros(processes, dtype=np.int64)
  for p, index_map in local.items():
    needed = set()
    for region, _ in _regions.group_regions(index_map, shape):
      needed.update(_chunks.chunks_in(region, chunks))
      held[p] += _regions.size(region) * ITEMSIZE
    read[p] = len(needed) * chunk_bytes
  return read, held


def objects(state, files) -> int:
  """Chunk (or bundle) objects, one zarr.json per array and group, and the manifest."""
  groups = {"/".join(k.split("/")[:i]) for k in state for i in range(len(k.split("/")))}
  return (
    sum(_chunks.count(s, files[k]) for k, (s, _) in state.items()) + len(state) + len(groups) + 1
  )


# Coordination-service round trips each agreement costs one process (see _multihost.Sync):
# broadcast: a set (process 0, deleted later) or a blocking get; all_ok: a barrier and a
# directory read; gather: a set (not process 0, deleted later), a barrier, and one
# directory read (process 0). At most, on any process:
_ROUND_TRIPS = {"broadcast_from_primary": 2, "all_ok": 2, "gather_to_primary": 3}


def agreements_of_a_save() -> collections.Counter:
  """The agreement calls a real (one-process) save makes, recorded."""
  calls: collections.Counter = collections.Counter()
  originals = {name: getattr(_multihost.Sync, name) for name in _ROUND_TRIPS}

  def recorder(name):
    def record(self, *args, **kwargs):
      calls[name] += 1
      return originals[name](self, *args, **kwargs)

    return record

  for name in originals:
    setattr(_multihost.Sync, name, recorder(name))
  try:
    with tempfile.TemporaryDirectory() as tmp:
      state = {"w": jax.numpy.ones((64, 64)), "b": np.zeros(3), "step": 1}
      ucp_jax.save(os.path.join(tmp, "ckpt"), state, step=1)
  finally:
    for name, fn in originals.items():
      setattr(_multihost.Sync, name, fn)
  return calls


def time_metadata(state, chunks, files) -> float:
  """Seconds process 0 takes to create every array's metadata (real, on local disk)."""
  from ucp_jax.store import _location, _manifest, _writer

  arrays = {
    k: _manifest.ArrayInfo(
      shape=s, dtype="float32", chunks=chunks[k], bundle=None if files[k] == chunks[k] else files[k]
    )
    for k, (s, _) in state.items()
  }
  with tempfile.TemporaryDirectory() as tmp:
    writer = _writer.Writer(_location.resolve(os.path.join(tmp, "ckpt")))
    with writer:
      start = time.perf_counter()
      writer.create(arrays, compression=None)
      return time.perf_counter() - start  # leaving without a commit removes the staging


def check_object_count() -> None:
  """The object formula against a real save's files."""
  with tempfile.TemporaryDirectory() as tmp:
    state = {"a/w": (np.zeros((64, 48), np.float32), P()), "a/b": (np.zeros((5,), np.float32), P())}
    path = os.path.join(tmp, "ckpt")
    ucp_jax.save(path, {"a": {k[2:]: v for k, (v, _) in state.items()}}, chunk_bytes=1024)
    files = sum(len(f) for _, _, f in os.walk(path))
    shapes = {k: (v.shape, s) for k, (v, s) in state.items()}
    stored = {k: ucp_jax.open(path)[k] for k in state}
    assert stored["a/w"].bundle is not None  # the formula counts bundles, not chunks
    units = {k: info.bundle or info.chunks for k, info in stored.items()}
    assert files == objects(shapes, units), (files, objects(shapes, units))


def describe(name: str, values: np.ndarray) -> str:
  gib = values / 2**30
  return (
    f"  {name:<34} median {statistics.median(gib):8.2f} GiB  max {gib.max():8.2f}  "
    f"min {gib.min():8.2f}  max/mean {values.max() / max(values.mean(), 1):5.2f}"
  )


def simulate(label, save_mesh, restore_mesh, state, chunk_bytes, bundle_bytes, trips):
  processes = save_mesh.devices.size // DEVICES_PER_PROCESS
  total = sum(int(np.prod(s)) for s, _ in state.values()) * ITEMSIZE
  print(
    f"\n{label}: {save_mesh.devices.size} devices, {processes} processes, {len(state)} arrays, "
    f"{total / 2**40:.2f} TiB"
  )
  chunks, files, _, cold = plan_save(state, save_mesh, chunk_bytes, bundle_bytes, processes - 1)
  *_, warm = plan_save(state, save_mesh, chunk_bytes, bundle_bytes, 0)
  print(
    f"  planning, one process: {cold:.2f} s cold (index maps), {warm:.3f} s for the next process"
  )
  written = bytes_written(state, save_mesh, files)
  assert written.sum() == total, (written.sum(), total)
  print(describe("written per process", written))
  print(describe("... had replica 0 written it all", bytes_written_replica_zero(state, save_mesh)))
  n = objects(state, files)
  bundled = sum(files[k] != chunks[k] for k in state)
  print(
    f"  objects per checkpoint: {n:,} ({total / n / 2**20:.1f} MiB each on average; "
    f"{bundled} of {len(state)} arrays bundled, {objects(state, chunks):,} unbundled)"
  )
  table = sum(_chunks.count(s, chunks[k]) for k, (s, _) in state.items()) * 4 * 4 / 3
  print(f"  manifest checksum tables: {table / 2**20:.1f} MiB of base64")
  print(f"  round trips per process per save: at most {trips}, whatever the process count")
  print(
    f"  process 0 creating {len(state)} arrays' metadata (local disk, durable): "
    f"{time_metadata(state, chunks, files):.2f} s"
  )
  read, held = bytes_read(state, restore_mesh, chunks)
  print(f"  restore onto {restore_mesh.devices.size} devices {dict(restore_mesh.shape)}:")
  print(describe("held per process (what it needs)", held))
  print(describe("read per process", read))
  print(f"  {'read / held, worst process':<34} {(read / np.maximum(held, 1)).max():.2f}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chunk-mib", type=float, default=4.0, help="save's chunk_bytes (MiB)")
  parser.add_argument("--layers", type=int, default=80)
  parser.add_argument("--stacked", action="store_true", help="layers scanned: one array per kind")
  parser.add_argument(
    "--bundle-mib", type=float, default=_bundle.BUNDLE_BYTES / 2**20, help="0: a file per chunk"
  )
  args = parser.parse_args()
  chunk_bytes = int(args.chunk_mib * 2**20)
  bundle_bytes = int(args.bundle_mib * 2**20) or None
  check_object_count()
  calls = agreements_of_a_save()
  trips = sum(_ROUND_TRIPS[name] * n for name, n in calls.items())
  print(f"agreements of one save: {dict(calls)}")
  state = llama70b(args.layers, args.stacked)
  for label, save, restore in (
    ("4,096 devices", mesh(32, 16, 8), mesh(16, 32, 8)),
    ("32,768 devices", mesh(256, 16, 8), mesh(240, 16, 8)),
  ):
    simulate(label, save, restore, state, chunk_bytes, bundle_bytes, trips)
  sys.stdout.flush()


if __name__ == "__main__":
  main()
