"""Who writes what: every chunk exactly once, replicated shards shared among processes.

The plan runs on meshes far larger than this machine through stand-in devices (an
id and a process index are all a sharding's index map needs), and on the real 8 CPU
devices, where with one process it must be exactly "replica 0 writes".
"""

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ucp_jax.store import _chunks, _owners, _regions, _zarr


class StandIn:
  """A device of a simulated cluster."""

  platform = "cpu"
  device_kind = "simulated"

  def __init__(self, id: int, per_process: int):
    self.id = id
    self.process_index = id // per_process

  def __repr__(self):
    return f"StandIn({self.id})"


def simulated_mesh(shape, names, per_process=8) -> Mesh:
  n = int(np.prod(shape))
  return Mesh(np.array([StandIn(i, per_process) for i in range(n)]).reshape(shape), names)


def plan_of_every_process(key, sharding, shape, chunks):
  processes = {d.process_index for d in sharding.mesh.devices.flat}
  return {p: _owners.of_sharding(key, sharding, shape, chunks, p) for p in processes}


def chunk_owners(plans, shape, chunks) -> dict:
  owners: dict[tuple, list] = {}
  for process, by_device in plans.items():
    for device, regions in by_device.items():
      assert device.process_index == process
      for region in regions:
        for chunk in _chunks.chunks_in(region, chunks):
          # A region holds whole chunks (or the array's edge): no chunk has two writers.
          assert _chunks.chunk_region(chunk, chunks, shape) == _regions.overlap(
            region, _chunks.chunk_region(chunk, chunks, shape)
          ), (region, chunk)
          owners.setdefault(chunk, []).append(process)
  return owners


CASES = [
  # (mesh shape, axis names, array shape, partition spec)
  ((8, 4, 2), ("data", "fsdp", "tensor"), (1024, 512), P("fsdp", "tensor")),
  ((8, 4, 2), ("data", "fsdp", "tensor"), (1024, 512), P()),
  ((8, 4, 2), ("data", "fsdp", "tensor"), (4096,), P("tensor")),
  ((8, 4, 2), ("data", "fsdp", "tensor"), (), P()),
  ((8, 4, 2), ("data", "fsdp", "tensor"), (0, 16), P()),
  ((16, 8), ("data", "model"), (96, 40, 24), P(None, "model")),
  ((16, 8), ("data", "model"), (7, 3), P()),
]


@pytest.mark.parametrize(("mesh_shape", "names", "shape", "spec"), CASES)
def test_every_chunk_is_written_exactly_once(mesh_shape, names, shape, spec):
  mesh = simulated_mesh(mesh_shape, names)
  sharding = NamedSharding(mesh, spec)
  chunks = _zarr.choose_chunks(shape, sharding.shard_shape(shape), 4, 4096)
  owners = chunk_owners(plan_of_every_process("w", sharding, shape, chunks), shape, chunks)
  assert sorted(owners) == sorted(itertools.product(*map(range, _chunks.grid(shape, chunks))))
  assert all(len(o) == 1 for o in owners.values()), owners


def test_replicated_shards_are_spread_over_the_processes_holding_them():
  # 32 processes of 8 devices; tensor-parallel within a host, replicated over "data".
  mesh = simulated_mesh((32, 8), ("data", "tensor"))
  shape = (4096, 1024)
  sharding = NamedSharding(mesh, P(None, "tensor"))
  chunks = _zarr.choose_chunks(shape, sharding.shard_shape(shape), 4, 64 << 10)
  owners = chunk_owners(plan_of_every_process("w", sharding, shape, chunks), shape, chunks)
  per_process = np.bincount([o[0] for o in owners.values()], minlength=32)
  # Each process holds a whole replica; replica 0 alone would have written everything.
  assert per_process.min() == per_process.max() == len(owners) // 32


def test_single_chunk_arrays_rotate_over_the_processes():
  mesh = simulated_mesh((16, 8), ("data", "tensor"))
  sharding = NamedSharding(mesh, P())
  writers = []
  for i in range(400):  # 400 replicated scalars, each a single chunk
    plans = plan_of_every_process(f"layer_{i}/norm/scale", sharding, (64,), (64,))
    writers += [p for p, by_device in plans.items() if by_device]
  assert len(writers) == 400
  counts = np.bincount(writers, minlength=16)
  assert counts.min() >= 10, counts  # 25 each on average; no process is left out or flooded


def test_one_process_writes_what_replica_zero_holds(devices):
  mesh = Mesh(np.array(devices).reshape(2, 4), ("d", "m"))
  for spec, shape in [(P(), (64, 8)), (P(None, "m"), (64, 8)), (P("d"), (64, 8))]:
    x = jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))
    chunks = _zarr.choose_chunks(shape, x.sharding.shard_shape(shape), 4, 256)
    plan = _owners.of_sharding("k", x.sharding, shape, chunks, 0)
    replica0 = {
      s.device: [_regions.normalize(s.index, shape)]
      for s in x.addressable_shards
      if s.replica_id == 0
    }
    assert plan == replica0, spec


def test_a_region_not_on_chunk_boundaries_is_never_cut():
  region = (slice(3, 19), slice(0, 8))
  assert _owners.split(region, (4, 8), (19, 8), 4) == (region,)
  cut = _owners.split((slice(0, 19), slice(0, 8)), (4, 8), (19, 8), 2)
  assert cut == ((slice(0, 8), slice(0, 8)), (slice(8, 19), slice(0, 8)))


class _Unhashable:
  """A custom sharding that cannot be hashed: its plans are made on every call."""

  __hash__ = None

  def __init__(self, sharding):
    self._sharding = sharding
    self.calls = 0

  @property
  def device_set(self):
    return self._sharding.device_set

  def devices_indices_map(self, shape):
    self.calls += 1
    return self._sharding.devices_indices_map(shape)


def test_an_unhashable_sharding_is_planned_each_time_not_refused():
  sharding = NamedSharding(
    simulated_mesh((4, 4), ("data", "model"), per_process=4), P(None, "model")
  )
  custom = _Unhashable(sharding)
  shape, chunks = (64, 32), (8, 8)
  for _ in range(2):
    assert _owners.writers(custom, shape) == _owners.writers(sharding, shape) == 4
    for p in range(4):
      assert _owners.of_sharding("k", custom, shape, chunks, p) == _owners.of_sharding(
        "k", sharding, shape, chunks, p
      )
  assert custom.calls == 2 * (1 + 4)  # never cached: `writers` once, the plan once per process


def test_clear_caches_empties_every_plan_cache():
  from ucp_jax.store import _caches

  made = []
  memo = _caches.Memo(maxsize=2)
  assert memo.get("a", lambda: made.append("a") or 1) == memo.get("a", lambda: 2) == 1
  assert memo.get(["unhashable"], lambda: made.append("u") or 3) == 3
  assert memo.get(["unhashable"], lambda: made.append("u") or 3) == 3
  assert made == ["a", "u", "u"]
  memo.get("b", lambda: 0)
  memo.get("c", lambda: 0)  # full: emptied whole, then "c" kept
  assert memo.get("a", lambda: made.append("a") or 4) == 4

  sharding = NamedSharding(simulated_mesh((2, 2), ("a", "b"), per_process=2), P("a"))
  _owners.writers(sharding, (8, 8))
  assert _owners._CACHE.get(("writers", sharding, (8, 8)), lambda: "made") != "made"
  _caches.clear_caches()
  assert _owners._CACHE.get(("writers", sharding, (8, 8)), lambda: "made") == "made"
  assert memo.get("a", lambda: "again") == "again"


def _bundle_owners(plans, shape, unit) -> dict:
  owners: dict[tuple, set] = {}
  for process, by_device in plans.items():
    for regions in by_device.values():
      for region in regions:
        for index in _chunks.chunks_in(region, unit):
          owners.setdefault(index, set()).add(process)
  return owners


@pytest.mark.parametrize(("mesh_shape", "names", "shape", "spec"), CASES)
@pytest.mark.parametrize("limit", [1 << 30, 4096, 512])
def test_bundles_by_process_have_one_writer_each(mesh_shape, names, shape, spec, limit):
  """Bundles as a save chooses them (a process's block, halved while larger than `limit`):
  every chunk is written once and every bundle by one process, replicated or not."""
  from ucp_jax.store import _bundle

  mesh = simulated_mesh(mesh_shape, names)
  sharding = NamedSharding(mesh, spec)
  shard = sharding.shard_shape(shape)
  chunks = _zarr.choose_chunks(shape, shard, 4, 256)
  block = _owners.block_shape(sharding, shape) or shard
  writers = _owners.writers(sharding, shape)
  bundle = _bundle.choose(shape, block, chunks, 4, limit, writers)
  unit = bundle or chunks
  plans = plan_of_every_process("w", sharding, shape, unit)
  owners = chunk_owners(plans, shape, chunks)
  assert sorted(owners) == sorted(itertools.product(*map(range, _chunks.grid(shape, chunks))))
  assert all(len(o) == 1 for o in owners.values()), owners
  assert all(len(o) == 1 for o in _bundle_owners(plans, shape, unit).values())


def test_a_process_block_is_one_bundle_replicated_or_not():
  # (data 4, fsdp 2, tensor 8): a process holds one fsdp row of 8 tensor shards, the same
  # as the 3 other processes of its data column
  mesh = simulated_mesh((4, 2, 8), ("data", "fsdp", "tensor"))
  shape = (256, 512)
  sharding = NamedSharding(mesh, P("fsdp", "tensor"))
  assert sharding.shard_shape(shape) == (128, 64)
  assert _owners.block_shape(sharding, shape) == (128, 512)
  blocks = _owners.blocks(sharding.devices_indices_map(shape), shape, lambda d: d.process_index)
  assert [holders for _, holders, _ in blocks.blocks] == [(0, 2, 4, 6), (1, 3, 5, 7)]
  plans = plan_of_every_process("w", sharding, shape, (128, 512))  # a block per bundle
  writers = {p for p, by_device in plans.items() if by_device}
  assert len(writers) == 2  # one replica of each block writes all 8 of its shards
  assert all(len(plans[p]) == 8 for p in writers)


def test_processes_that_hold_no_grid_keep_bundles_per_shard():
  # devices dealt to processes round robin: process p holds rows p, p+4, ... of the shards
  n = 16
  devices = np.array([StandIn(i, 4) for i in range(n)])
  order = np.array([devices[(i % 4) * 4 + i // 4] for i in range(n)])
  sharding = NamedSharding(Mesh(order, ("x",)), P("x"))
  assert _owners.block_shape(sharding, (64, 8)) is None
  chunks = _zarr.choose_chunks((64, 8), (4, 8), 4, 64)
  owners = chunk_owners(plan_of_every_process("w", sharding, (64, 8), chunks), (64, 8), chunks)
  assert all(len(o) == 1 for o in owners.values())
