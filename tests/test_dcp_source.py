"""torch DCP folders as a source: read in place, lazily, exactly; bad folders refused.

The fixtures are written by torch itself (`scripts/make_dcp_fixtures.py`): FSDP2 on 2 gloo
ranks with AdamW state, and DTensors on a 2 x 2 mesh of 4 ranks. torch's own `dcp.load` is the
oracle where torch is installed; forged folders start from the fixtures.
"""

from __future__ import annotations

import itertools
import os
import pickle
import shutil
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from make_dcp_fixtures import dtensor_values

import ucp_jax
from ucp_jax.base._errors import SourceFormatError, UnsafePickleError
from ucp_jax.sources import _registry
from ucp_jax.sources._torch_reader import _torch_file
from ucp_jax.sources.dcp import _chunks, _metadata, _source, _tiling

FIXTURES = Path(__file__).parent / "fixtures" / "dcp"
FSDP2 = FIXTURES / "fsdp2_adamw"
GRID = FIXTURES / "dtensor_2d"
FLAT = FIXTURES / "fsdp2_flat"


def torch_state(folder) -> dict:
  """Every tensor and object of a DCP folder, whole, read by torch's own loader."""
  torch = pytest.importorskip("torch")
  dcp = pytest.importorskip("torch.distributed.checkpoint")
  from torch.distributed.checkpoint.metadata import TensorStorageMetadata

  meta = dcp.FileSystemReader(str(folder)).read_metadata()
  state = {
    k: torch.empty(md.size, dtype=md.properties.dtype)
    if isinstance(md, TensorStorageMetadata)
    else 0
    for k, md in meta.state_dict_metadata.items()
  }
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
  return state


def source_key(key: str) -> str:
  """The DCP key of a converted checkpoint's key (`exp_avg/NAME` -> `optim.state.NAME.exp_avg`)."""
  kind, name = key.split("/", 1)
  return f"model.{name}" if kind in ("params", "buffers") else f"optim.state.{name}.{kind}"


def test_describes_fsdp2_model_and_adamw_state():
  assert _registry.sniff(FSDP2) is _source
  plan = _source.describe(str(FSDP2))
  by_name = {p.name: p for p in plan.params}
  assert plan.format == "dcp" and plan.step == 3 and plan.buffers == {}
  assert by_name["lm_head.weight"].tied_to == "wte.weight"
  assert by_name["lm_head.weight"].value is None
  fc = by_name["h.0.mlp.fc.weight"]
  assert fc.value.shape == (64, 16) and sorted(fc.slots) == ["exp_avg", "exp_avg_sq"]
  assert fc.group == 0 and by_name["h.0.mlp.fc.bias"].group == 1
  assert fc.shard_shape == (32, 16)  # FSDP2's dimension-0 shard on 2 ranks
  groups = [g.values for g in plan.optimizer.groups]
  assert plan.optimizer.type == "adamw" and plan.optimizer.step == 3
  assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
  assert groups[0]["betas"] == [0.9, 0.95] and groups[0]["step"] == 3
  assert plan.extra["source_layout"]["files"] == ["__0_0.distcp", "__1_0.distcp"]


def test_every_array_equals_torchs_own_load_bit_for_bit(tmp_path):
  state = torch_state(FSDP2)
  view = ucp_jax.open(FSDP2)
  converted = ucp_jax.open(ucp_jax.convert(FSDP2, tmp_path / "u").dst)
  assert view.keys() == converted.keys() and len(view.keys()) == 48
  for key in view.keys():
    want = state[source_key(key)].numpy()
    for got in (view.read(key), converted.read(key)):
      assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), key
  assert converted.manifest.schema["optimizer"] == view.manifest.schema["optimizer"]
  assert view.manifest.schema["params"]["lm_head.weight"]["value"] == "params/wte.weight"


def test_dtensor_grid_chunks_read_in_any_region():
  view = ucp_jax.open(GRID)
  assert view.manifest.schema["optimizer"] == {}
  rng = np.random.default_rng(0)
  for name, want in dtensor_values().items():
    key = f"params/{name}"
    assert np.array_equal(view.read(key), want), key
    for _ in range(5):
      index = tuple(
        np.s_[a : b + 1] for a, b in (sorted(rng.integers(0, n, 2)) for n in want.shape)
      )
      assert np.array_equal(view.read(key, index), want[index]), (key, index)
  assert view["params/transposed.weight"].chunks == (3, 2)  # the 2 x 2 DTensor grid's block


def test_restore_onto_a_mesh_reads_only_the_bytes_under_each_slice(monkeypatch, devices):
  monkeypatch.setattr(_chunks, "CELL_BYTES", 128)  # cells of 2 rows: reads as fine as slices
  reads = []
  pread = _chunks._pread

  def record(fd, path, at, out):
    reads.append((os.path.basename(path), at, at + out.nbytes))
    pread(fd, path, at, out)

  monkeypatch.setattr(_chunks, "_pread", record)
  key = "params/h.0.mlp.fc.weight"  # (64, 16) float32: rows 0-31 on rank 0, 32-63 on rank 1
  chunk0 = _chunk_bytes(key, 0)
  view = ucp_jax.open(FSDP2)  # (describing reads the steps and compares a tied weight)
  reads.clear()
  got = view.tensorstore(key)[8:16].read().result()  # one device's slice of 8
  rows = [(r, r + 2) for r in range(8, 16, 2)]  # the cells under rows 8-15, in rank 0's file
  assert sorted(reads) == [("__0_0.distcp", chunk0 + 64 * a, chunk0 + 64 * b) for a, b in rows]
  reads.clear()
  mesh = jax.make_mesh((8,), ("x",))
  target = {"params": {"h.0.mlp.fc.weight": NamedSharding(mesh, P("x"))}}
  view = ucp_jax.open(FSDP2)
  reads.clear()
  restored = ucp_jax.restore(view, target, partial=True)["params"]
  assert np.array_equal(np.asarray(restored["h.0.mlp.fc.weight"])[8:16], got)
  spans = sorted(reads)
  assert sum(b - a for _, a, b in spans) == 64 * 64  # every byte once, none more
  assert all(b <= c or f != g for (f, _, b), (g, c, _) in itertools.pairwise(spans))


def test_a_column_slice_reads_each_rows_span_of_columns(monkeypatch):
  monkeypatch.setattr(_chunks, "CELL_BYTES", 32)  # cells of (2, 4): read a row's span at a time
  reads = []
  pread = _chunks._pread
  monkeypatch.setattr(
    _chunks,
    "_pread",
    lambda fd, path, at, out: (reads.append((at, out.nbytes)), pread(fd, path, at, out)),
  )
  view = ucp_jax.open(FSDP2)
  reads.clear()
  key = "params/h.0.mlp.proj.weight"  # (16, 64): rows 0-7 on rank 0
  got = view.read(key, np.s_[2:5, 8:12])
  chunk0 = _chunk_bytes(key, 0)
  assert sorted(reads) == [(chunk0 + 256 * r + 32, 16) for r in range(2, 6)]  # 2 cells
  assert np.array_equal(got, torch_state(FSDP2)["model.h.0.mlp.proj.weight"].numpy()[2:5, 8:12])


def _chunk_bytes(key: str, rank: int) -> int:
  """Where a chunk's elements start in its rank file: from torch's own blob, as mapped by the
  safe reader (an address in the file's map, less the map's start)."""
  layout = _metadata.read(str(FSDP2))
  name = "model." + key.split("/", 1)[1]
  chunk = next(c for c in layout.entries[name].chunks if c.stored.file == f"__{rank}_0.distcp")
  stored = chunk.stored
  data = _torch_file.load(FSDP2 / stored.file, span=(stored.offset, stored.length))
  base = data
  while isinstance(base, np.ndarray):
    base = base.base
  origin = np.frombuffer(base.obj if isinstance(base, memoryview) else base, np.uint8, 1)
  return data.__array_interface__["data"][0] - origin.__array_interface__["data"][0]


def test_a_torch_file_inside_a_rank_file_is_read_by_span():
  layout_file = FSDP2 / "__0_0.distcp"
  data = _torch_file.load(layout_file, span=(0, 2601))
  assert data.shape == (16, 16) and data.dtype == np.float32
  with pytest.raises(SourceFormatError, match=r"__0_0\.distcp\[0:2590\]: .*zip"):
    _torch_file.load(layout_file, span=(0, 2590))
  size = os.path.getsize(layout_file)
  with pytest.raises(SourceFormatError, match=f"lie outside the file \\({size} bytes\\)"):
    _torch_file.load(layout_file, span=(size - 10, 100))


# Bad input: every problem named by file and key, nothing committed.


def _copy(tmp_path) -> Path:
  bad = tmp_path / "bad"
  shutil.copytree(FSDP2, bad)
  return bad


def _forge(folder: Path, edit) -> None:
  """Rewrites `.metadata` with torch's own classes after `edit(metadata)`."""
  pytest.importorskip("torch.distributed.checkpoint")
  path = folder / ".metadata"
  with open(path, "rb") as f:
    meta = pickle.load(f)  # our own fixture: trusted
  edit(meta)
  with open(path, "wb") as f:
    pickle.dump(meta, f)


def _move_chunk(meta, key: str, index: int, offsets, sizes=None) -> None:
  """Moves chunk `index` of `key` (its storage entry too) to `offsets` (and `sizes`)."""
  import torch
  from torch.distributed.checkpoint.metadata import MetadataIndex

  md = meta.state_dict_metadata[key]
  chunk = md.chunks[index]
  info = next(v for k, v in meta.storage_data.items() if k.fqn == key and k.offset == chunk.offsets)
  chunk.offsets = torch.Size(offsets)
  if sizes is not None:
    chunk.sizes = torch.Size(sizes)
  meta.storage_data[MetadataIndex(key, offsets)] = info


def _refused(
  folder: Path, tmp_path, *needles: str, error=SourceFormatError, at_open: bool = True
) -> str:
  dst = tmp_path / "dst"
  with pytest.raises(error) as info:
    ucp_jax.convert(folder, dst)
  assert not dst.exists()
  message = str(info.value)
  for needle in needles:
    assert needle in message, message
  for line in message.splitlines()[1:]:
    assert str(folder) in line, line  # each problem names its file
  if at_open:  # the metadata's problems; a chunk's own bytes are checked when read
    with pytest.raises(error):
      ucp_jax.open(folder)
  return message


def test_overlapping_chunks(tmp_path):
  bad = _copy(tmp_path)
  _forge(bad, lambda m: _move_chunk(m, "model.wpe.weight", 1, (2, 0)))
  _refused(
    bad, tmp_path, "`model.wpe.weight`", "chunks at (0, 0) (sizes (4, 16)) and (2, 0)", "overlap"
  )


def test_chunks_that_leave_a_hole(tmp_path):
  bad = _copy(tmp_path)
  _forge(bad, lambda m: m.state_dict_metadata["optim.state.wte.weight.exp_avg"].chunks.pop())
  _refused(
    bad, tmp_path, "`optim.state.wte.weight.exp_avg`", "cover 256 of its 512", "rows [16, 32)"
  )


def test_a_chunk_past_the_declared_size(tmp_path):
  bad = _copy(tmp_path)
  _forge(bad, lambda m: _move_chunk(m, "model.h.0.ln_1.bias", 1, (10,)))
  _refused(bad, tmp_path, "`model.h.0.ln_1.bias`", "ends at (18,), past the declared size (16,)")


def test_metadata_of_another_dcp_version(tmp_path):
  bad = _copy(tmp_path)
  raw = (bad / ".metadata").read_bytes()
  assert raw.count(b"1.0.0") == 1
  (bad / ".metadata").write_bytes(raw.replace(b"1.0.0", b"9.9.9"))
  message = _refused(bad, tmp_path, "DCP format version '9.9.9'", "'1.0.0'")
  assert len(message.splitlines()) == 1


def test_metadata_that_is_not_torchs(tmp_path):
  bad = _copy(tmp_path)
  (bad / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
  _refused(bad, tmp_path, "holds a dict, not torch.distributed.checkpoint's Metadata")


def test_hostile_metadata_pickle_runs_nothing(tmp_path):
  bad = _copy(tmp_path)
  marker = tmp_path / "ran"
  (bad / ".metadata").write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
  _refused(bad, tmp_path, ".metadata", "os.system", error=UnsafePickleError)
  assert not marker.exists()


def test_a_missing_rank_file(tmp_path):
  bad = _copy(tmp_path)
  os.remove(bad / "__1_0.distcp")
  message = _refused(bad, tmp_path, "__1_0.distcp: missing (a rank file;", "`model.wte.weight`")
  assert len(message.splitlines()) == 1  # one problem: one line


def test_a_truncated_rank_file(tmp_path):
  bad = _copy(tmp_path)
  with open(bad / "__0_0.distcp", "r+b") as f:
    f.truncate(50000)
  message = _refused(
    bad, tmp_path, "__0_0.distcp: truncated: 50000 of ", "entries lie past its end)"
  )
  assert len(message.splitlines()) == 1  # one cause: one line


def test_a_chunk_whose_blob_is_not_the_declared_dtype(tmp_path):
  import_torch = pytest.importorskip("torch")
  bad = _copy(tmp_path)
  key = "optim.state.wpe.weight.exp_avg"

  def edit(meta):
    meta.state_dict_metadata[key].properties.dtype = import_torch.float64

  _forge(bad, edit)
  message = _refused(
    bad, tmp_path, f"`{key}` chunk at (", "holds a float32 tensor of shape (4, 16)", at_open=False
  )
  assert "float64" in message and len(message.splitlines()) == 1


def test_torchtitans_flattened_layout():
  """Model keys and `flatten_optimizer_state_dict=True` optimizer keys at the top level."""
  plan = _source.describe(str(FLAT))
  by_name = {p.name: p for p in plan.params}
  assert [g.values["weight_decay"] for g in plan.optimizer.groups] == [0.1, 0.0]
  assert (by_name["wte.weight"].group, by_name["ln_f.bias"].group) == (0, 1)
  assert by_name["lm_head.weight"].tied_to == "wte.weight" and plan.step == 2
  state = torch_state(FLAT)
  view = ucp_jax.open(FLAT)
  for key in view.keys():
    kind, name = key.split("/", 1)
    want = state[name if kind == "params" else f"state.{name}.{kind}"].numpy()
    assert view.read(key).tobytes() == want.tobytes(), key


def test_per_rank_metadata_is_named(tmp_path):
  bad = _copy(tmp_path)
  os.rename(bad / ".metadata", bad / "__0.metadata")
  _refused(bad, tmp_path, "__0.metadata is there: each rank's own metadata")


def test_hostile_pickle_inside_a_rank_file_runs_nothing(tmp_path):
  pytest.importorskip("torch.distributed.checkpoint")
  import io
  import zipfile

  from torch.distributed.checkpoint.filesystem import _StorageInfo
  from torch.distributed.checkpoint.metadata import MetadataIndex

  bad = _copy(tmp_path)
  marker = tmp_path / "ran"
  buffer = io.BytesIO()
  with zipfile.ZipFile(buffer, "w") as z:  # a torch.save file whose data.pkl runs a command
    z.writestr("archive/data.pkl", b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    z.writestr("archive/byteorder", b"little")
  start = os.path.getsize(bad / "__1_0.distcp")
  with open(bad / "__1_0.distcp", "ab") as f:
    f.write(buffer.getvalue())
  info = _StorageInfo("__1_0.distcp", start, len(buffer.getvalue()))
  _forge(bad, lambda m: m.storage_data.__setitem__(MetadataIndex("optim.param_groups.0.lr"), info))
  _refused(
    bad,
    tmp_path,
    "__1_0.distcp[",
    "os.system",
    "`optim.param_groups.0.lr`",
    error=UnsafePickleError,
  )
  assert not marker.exists()


# Chunks: the tiling is checked by corners, linear in the chunks; reads find the chunks under
# a region without looking at the others. (A metadata file of 20,000 chunks took minutes.)


def _boxes(*specs) -> list:
  return [
    _metadata.Chunk(tuple(o), tuple(s), _metadata.Stored("f", i, 1))
    for i, (o, s) in enumerate(specs)
  ]


def _tiles(shape, chunks) -> list[str]:
  return _tiling.problems(shape, chunks, _tiling.Budget())


def test_the_tiling_of_20000_chunks_is_checked_by_corners():
  row = _boxes(*[((0, i), (1, 1)) for i in range(20_000)])
  assert _tiles((1, 20_000), row) == []
  moved = row[:-1] + _boxes(((0, 5), (1, 1)))  # onto another chunk: an overlap and a hole
  assert _tiles((1, 20_000), moved) == [
    "chunks at (0, 5) (sizes (1, 1)) and (0, 5) (sizes (1, 1)) overlap"
  ]
  assert _tiles((1, 20_000), row[:-1]) == ["chunks cover 19999 of its 20000 elements: holes"]
  grid = _boxes(*[((r, c), (3, 2)) for r in range(0, 300, 3) for c in range(0, 400, 2)])
  assert _tiles((300, 400), grid) == []
  bricks = _boxes(((0, 0), (1, 3)), ((0, 3), (1, 5)), ((1, 0), (1, 5)), ((1, 5), (1, 3)))
  assert _tiles((2, 8), bricks) == []
  assert _tiles((2, 8), bricks[:1] + _boxes(((0, 2), (1, 6))) + bricks[2:]) == [
    "chunks at (0, 0) (sizes (1, 3)) and (0, 2) (sizes (1, 6)) overlap"
  ]
  assert _tiles((), _boxes(((), ()), ((), ()))) == [
    "chunks at () (sizes ()) and () (sizes ()) overlap"
  ]


def test_tensors_split_along_many_dimensions_are_bounded():
  shape = (2,) * 24
  halves = _boxes((tuple([0] * 24), tuple([1] * 24)), (tuple([1] * 24), tuple([1] * 24)))
  budget = _tiling.Budget()
  assert "more corners to check than" in _tiling.problems(shape, halves, budget)[0]
  assert budget.left < 0


@pytest.mark.parametrize("kind", ["grid", "bricks"])
def test_the_index_finds_every_chunk_under_a_region(kind):
  if kind == "grid":
    shape = (12, 10)
    chunks = _boxes(
      *[((r, c), (min(5, 12 - r), min(4, 10 - c))) for r in (0, 5, 10) for c in (0, 4, 8)]
    )
  else:
    shape = (4, 10)
    cuts = [(0, 3, 10), (0, 7, 10), (0, 2, 5, 10), (0, 10)]
    chunks = _boxes(
      *[((r, a), (1, b - a)) for r, row in enumerate(cuts) for a, b in itertools.pairwise(row)]
    )
  assert _tiles(shape, chunks) == []
  index = _tiling.Index(chunks)
  rng = np.random.default_rng(0)
  for _ in range(200):
    region = tuple(slice(a, b + 1) for a, b in (sorted(rng.integers(0, n, 2)) for n in shape))
    met = {
      id(c)
      for c in chunks
      if all(o < s.stop and o + n > s.start for o, n, s in zip(c.offsets, c.sizes, region))
    }
    found = {id(c) for c in index.under(region)}
    assert met <= found and (kind != "grid" or met == found), region


def test_blocks_cover_an_array_once_in_c_order():
  seen = np.zeros((3, 5, 7), np.int8)
  for region in _chunks._blocks((3, 5, 7), 4, 40):  # 10 elements a block at most
    assert seen[region].size * 4 <= 40 or seen[region].size == 7
    seen[region] += 1
  assert (seen == 1).all()


def test_records_that_differ_in_their_state_hash_apart():
  """DCP's MetadataIndex keys differ only in their state: hashed alike, a dict of 20,000 of
  them took quadratic time to build."""
  from ucp_jax.sources._torch_reader._pickle_records import InertObject, _digest

  a = InertObject("m.MetadataIndex", state={"fqn": "w", "offset": (0, 4), "index": None})
  b = InertObject("m.MetadataIndex", state={"fqn": "w", "offset": (0, 8), "index": None})
  same = InertObject("m.MetadataIndex", state={"index": None, "offset": (0, 4), "fqn": "w"})
  assert a == same and hash(a) == hash(same)
  assert _digest(a.state) != _digest(b.state)


# On object stores: `memory://` and `file://` URLs stand in for `gs://` and `s3://` (the same
# kvstore listings and byte-range reads).

_uploads = itertools.count()


def _upload(folder: Path, drop: str | None = None, cut: tuple[str, int] | None = None) -> str:
  """The files of `folder` as objects below a fresh `memory://` URL (less `drop`; `cut`:
  (name, length) to truncate one to)."""
  from ucp_jax.store import _location

  url = f"memory://dcp{next(_uploads)}/ckpt"
  store = _location.kvstore(_location.resolve(url + "/"))
  for path in sorted(folder.iterdir()):
    data = path.read_bytes()
    if cut is not None and path.name == cut[0]:
      data = data[: cut[1]]
    if path.name != drop:
      store.write(path.name, data).result()
  return url


def test_a_folder_on_an_object_store_reads_and_converts_bit_for_bit(tmp_path):
  local = ucp_jax.open(FSDP2)
  for url in (_upload(FSDP2), f"file://{FSDP2}"):
    assert _registry.sniff(url) is _source
    view = ucp_jax.open(url)
    assert view.keys() == local.keys() and view.manifest.schema == local.manifest.schema
    assert view.step == 3
    for key in view.keys():
      assert view.read(key).tobytes() == local.read(key).tobytes(), key
  converted = ucp_jax.open(ucp_jax.convert(_upload(FSDP2), tmp_path / "u").dst)
  for key in local.keys():
    assert converted.read(key).tobytes() == local.read(key).tobytes(), key
  grid = ucp_jax.open(_upload(GRID))
  for name, want in dtensor_values().items():
    index = tuple(np.s_[1:3] for _ in want.shape)
    assert np.array_equal(grid.read(f"params/{name}", index), want[index]), name


def test_a_restore_from_an_object_store_reads_each_tensor_byte_once(monkeypatch, devices):
  fetched = []
  fetch = _chunks.RankFiles._fetch_runs

  def record(self, name, runs):
    fetched.append(runs[-1][0] + runs[-1][1].nbytes - runs[0][0])
    fetch(self, name, runs)

  monkeypatch.setattr(_chunks.RankFiles, "_fetch_runs", record)
  monkeypatch.setattr(_chunks, "CELL_BYTES", 128)  # cells of 2 rows: reads as fine as slices
  view = ucp_jax.open(_upload(FSDP2))
  fetched.clear()
  mesh = jax.make_mesh((8,), ("x",), devices=devices)
  target = {"params": {"h.0.mlp.fc.weight": NamedSharding(mesh, P("x"))}}  # (64, 16) float32
  restored = ucp_jax.restore(view, target, partial=True)["params"]["h.0.mlp.fc.weight"]
  assert sum(fetched) == 64 * 16 * 4 and len(fetched) == 32  # a request per cell, no byte twice
  assert np.array_equal(np.asarray(restored), ucp_jax.open(FSDP2).read("params/h.0.mlp.fc.weight"))


def test_a_rank_file_replaced_while_it_is_read_is_refused():
  from ucp_jax.store import _location

  url = _upload(FSDP2)
  view = ucp_jax.open(url)
  view.read("params/h.0.mlp.fc.weight")  # rank 0's file is read: its generation is pinned
  store = _location.kvstore(_location.resolve(url + "/"))
  store.write("__0_0.distcp", (FSDP2 / "__0_0.distcp").read_bytes()).result()  # same bytes, new
  with pytest.raises(SourceFormatError, match=r"__0_0.distcp: replaced while it was read"):
    view.read("params/h.0.mlp.proj.weight")


def test_missing_and_truncated_rank_objects_are_named(tmp_path):
  url = _upload(FSDP2, drop="__1_0.distcp")
  with pytest.raises(SourceFormatError, match=r"__1_0.distcp: missing \(a rank file;"):
    ucp_jax.open(url)
  url = _upload(FSDP2, cut=("__0_0.distcp", 50000))
  with pytest.raises(SourceFormatError, match=r"__0_0.distcp: shorter than the \d+ bytes"):
    ucp_jax.convert(url, tmp_path / "dst")
  assert not (tmp_path / "dst").exists()
  with pytest.raises(SourceFormatError, match=r"\.metadata: missing"):
    ucp_jax.open(_upload(FSDP2, drop=".metadata"), source="dcp")


def test_devices_whose_slices_share_a_cell_read_it_once(monkeypatch, devices):
  sizes = []
  read = _chunks.RankFiles.read

  def record(self, entry, chunk, part, out):
    sizes.append(out.nbytes)
    read(self, entry, chunk, part, out)

  monkeypatch.setattr(_chunks.RankFiles, "read", record)
  for path in (FSDP2, _upload(FSDP2)):
    view = ucp_jax.open(path)
    sizes.clear()
    target = {"params": {"h.0.mlp.fc.weight": NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))}}
    restored = ucp_jax.restore(view, target, partial=True)["params"]["h.0.mlp.fc.weight"]
    # (64, 16) float32 in two cells, one per rank's chunk; 8 devices take 8 rows each
    assert sorted(sizes) == [2048, 2048], path
    assert np.array_equal(np.asarray(restored), view.read("params/h.0.mlp.fc.weight"))
