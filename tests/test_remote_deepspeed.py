"""DeepSpeed checkpoints and torch files on object stores, read by byte ranges.

`memory://` and `file://` URLs stand in for `gs://` and `s3://` (the same kvstore listings and
range reads). A torch file there is located, not downloaded: its zip directory and pickle are
fetched, and each tensor's elements when a conversion or a restore needs them. The fixtures
are real DeepSpeed 0.19.8 checkpoints (tests/fixtures/deepspeed); each converts from an object
store to exactly what it converts to from a local disk.
"""

import itertools
import os
from pathlib import Path

import hostile_corpus as hostile
import jax
import numpy as np
import pytest
from ds_fixtures import FIXTURES, NAMES
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax import cli
from ucp_jax.sources import _registry, _remote
from ucp_jax.store import _location

_ids = itertools.count()


def _upload(folder: Path, skip=(), cut: dict | None = None) -> str:
  """Every file below `folder` as an object below a fresh `memory://` URL (less `skip`; `cut`
  maps relative names to the length they are truncated to)."""
  url = f"memory://ds{next(_ids)}/run"
  store = _location.kvstore(_location.resolve(url + "/"))
  for path in sorted(p for p in folder.rglob("*") if p.is_file()):
    name = path.relative_to(folder).as_posix()
    if name in skip:
      continue
    data = path.read_bytes()
    store.write(name, data[: (cut or {}).get(name, len(data))]).result()
  return url


def _same(a, b) -> None:
  assert a.keys() == b.keys() and a.manifest.schema == b.manifest.schema
  assert a.step == b.step
  for key in a.keys():
    x, y = a.read(key), b.read(key)
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), key


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", ["ckpt", "universal"])
def test_every_fixture_reads_from_an_object_store_as_from_disk(tmp_path, name, layout):
  url = f"{_upload(FIXTURES / name)}/{layout}"
  assert _registry.sniff(url).NAME == "deepspeed"
  local = ucp_jax.open(FIXTURES / name / layout)
  view = ucp_jax.open(url)
  assert view.manifest.source["format"] == local.manifest.source["format"]
  _same(view, local)
  _same(ucp_jax.open(ucp_jax.convert(url, tmp_path / "u").dst), local)


TP = FIXTURES.parent / "tp"


@pytest.mark.parametrize("name", ["autotp_tp2_dp2", "megatron_tp2", "pp2_tp2"])
def test_tensor_and_pipeline_parallel_ranks_merge_from_an_object_store(name):
  _same(ucp_jax.open(f"{_upload(TP / name)}/ckpt"), ucp_jax.open(TP / name / "ckpt"))


def test_a_file_url_and_the_cli(tmp_path, capsys):
  folder = FIXTURES / "z2_fp32_dp2" / "ckpt"
  url = f"file://{folder}"
  assert cli.main(["inspect", url]) == 0
  assert "format: deepspeed" in capsys.readouterr().out
  assert cli.main(["convert", url, str(tmp_path / "u")]) == 0
  _same(ucp_jax.open(tmp_path / "u"), ucp_jax.open(folder))


def test_a_restore_onto_a_mesh_from_an_object_store(devices):
  name = "z3_fp32_dp2"
  view = ucp_jax.open(f"{_upload(FIXTURES / name)}/ckpt")
  mesh = jax.make_mesh((2, 4), ("a", "b"), devices=devices)
  key = max(view.keys(), key=lambda k: view[k].shape[-1] % 4 == 0 and len(view[k].shape) == 2)
  sharding = NamedSharding(mesh, P(None, "b"))
  kind, param = key.split("/", 1)
  restored = ucp_jax.restore(view, {kind: {param: sharding}}, partial=True)[kind][param]
  assert restored.sharding == sharding
  assert np.array_equal(np.asarray(restored), ucp_jax.open(FIXTURES / name / "ckpt").read(key))


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
  """A generated ZeRO-3 checkpoint of 4 x (512, 512) params over 2 ranks (6 MiB per rank)."""
  pytest.importorskip("torch")
  import make_zero3_checkpoint as z3

  folder = tmp_path_factory.mktemp("z3") / "ckpt"
  shapes = z3.model(512, 4)
  z3.generate(str(folder), shapes, 2, log=lambda *_: None)
  return folder, shapes


def test_an_object_replaced_while_it_is_converted_is_refused(tmp_path, monkeypatch, generated):
  folder, _ = generated
  url = _upload(folder)
  store = _location.kvstore(_location.resolve(url + "/"))
  optim = "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"
  describe = _registry.describe

  def then_replace(*args, **kwargs):
    plan = describe(*args, **kwargs)  # the files' directories and pickles are read
    store.write(optim, (folder / optim).read_bytes()).result()  # same bytes, a new generation
    return plan

  monkeypatch.setattr(_registry, "describe", then_replace)
  with pytest.raises(
    ucp_jax.SourceFormatError, match=r"optim_states\.pt: replaced while it was read"
  ):
    ucp_jax.convert(url, tmp_path / "u")
  assert not (tmp_path / "u").exists()


def test_missing_and_truncated_objects_are_named(tmp_path):
  folder = FIXTURES / "z2_fp32_dp2" / "ckpt"
  tag = (folder / "latest").read_text().strip()
  optim = f"{tag}/zero_pp_rank_1_mp_rank_00_optim_states.pt"
  size = (folder / optim).stat().st_size
  for cut in (size - 100, 1000):
    url = _upload(folder, cut={optim: cut})
    with pytest.raises(ucp_jax.SourceFormatError, match=rf"{url}/{optim}: "):
      ucp_jax.convert(url, tmp_path / "u")
  url = _upload(folder, skip={optim})
  with pytest.raises(
    ucp_jax.SourceFormatError, match=r"rank_1_mp_rank_00_optim_states\.pt is missing"
  ):
    ucp_jax.convert(url, tmp_path / "u")
  assert not (tmp_path / "u").exists()


def test_a_large_checkpoint_fetches_each_tensor_byte_once(tmp_path, monkeypatch, generated):
  """The conversion fetches the tensors' bytes once, plus each file's zip directory and pickle
  (a tail and a head block)."""
  import make_zero3_checkpoint as z3

  folder, shapes = generated
  url = _upload(folder)
  fetched = []
  read = _remote.Folder.read

  def counted(self, name, start=0, stop=None, generation=None):
    value, gen = read(self, name, start, stop, generation)
    fetched.append((name, len(value)))
    return value, gen

  monkeypatch.setattr(_remote.Folder, "read", counted)
  ucp_jax.convert(url, tmp_path / "u")
  total = sum(n for _, n in fetched)
  files = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
  tensors = 3 * sum(-(-int(np.prod(s)) // 2) * 2 * 4 for s in shapes.values())  # fp32, padded
  per_file = {}
  for name, n in fetched:
    per_file[name] = per_file.get(name, 0) + n
  assert tensors <= total <= tensors + len(per_file) * 140_000  # a tail and a head block each
  assert total < files + 300_000
  for name in shapes:
    np.testing.assert_array_equal(
      ucp_jax.open(tmp_path / "u").read(f"params/{name}"), z3.expected(shapes, name, "fp32")
    )
  assert os.path.isdir(tmp_path / "u")


def _tensors(tree):
  """Every located tensor in a loaded tree."""
  from ucp_jax.sources._byte_span import ByteSpan

  if isinstance(tree, ByteSpan):
    yield tree
  elif isinstance(tree, dict):
    for value in tree.values():
      yield from _tensors(value)
  elif isinstance(tree, (list, tuple)):
    for value in tree:
      yield from _tensors(value)


@pytest.mark.parametrize("case", [c for c in hostile.CASES if c.make_pt], ids=lambda c: c.name)
def test_hostile_torch_files_on_an_object_store_are_refused(tmp_path, case):
  from ucp_jax.sources._torch_reader import _torch_file

  canary = tmp_path / "canary"
  case.make_pt(tmp_path / "bad.pt", canary)
  url = _upload(tmp_path, skip={"canary"}) + "/bad.pt"
  with pytest.raises(ucp_jax.UcpError) as caught:
    for tensor in _tensors(_torch_file.load_named(url)):  # located, then every tensor read
      tensor.read()
  assert url in str(caught.value)
  assert not canary.exists()


@pytest.mark.slow
def test_a_conversion_by_two_processes_from_a_url(tmp_path):
  import subprocess
  import sys

  folder = FIXTURES / "z3_bf16_dp3" / "ckpt"
  args = ["convert", f"file://{folder}", str(tmp_path / "u"), "--processes", "2"]
  run = subprocess.run(
    [sys.executable, "-m", "ucp_jax.cli", *args], capture_output=True, text=True, timeout=300
  )
  assert run.returncode == 0, run.stderr
  assert "by 2 processes" in run.stdout + run.stderr
  _same(ucp_jax.open(tmp_path / "u"), ucp_jax.open(folder))


# Found in review: each was wrong before the fix beside it.


def test_a_forged_end_record_costs_two_small_requests(monkeypatch):
  from ucp_jax.sources._torch_reader import _torch_file

  data = bytearray(4 << 20)  # an end record claiming the file ends at byte 70000
  data[-22:] = b"PK\x05\x06" + bytes(8) + (70000 - 22).to_bytes(4, "little") + bytes(6)
  url = _upload_files({"m.pt": bytes(data)}) + "/m.pt"
  fetched = _count_reads(monkeypatch)
  with pytest.raises(ucp_jax.SourceFormatError, match="do not say where it ends"):
    _torch_file.load_named(url)
  assert sum(fetched) < 70_000  # the tail and two bytes: never the 4 MiB after byte 70000


def test_reads_in_flight_before_any_pinned_the_generation_must_agree(monkeypatch):
  url = _upload_files({"r.bin": b"A" * 1000})
  blob = _remote.ObjectBlob(_remote.Folder.at(url), "r.bin")
  read = _remote.Folder.read
  store = _location.kvstore(_location.resolve(url + "/"))

  def unpinned(self, name, start=0, stop=None, generation=None):  # as if both went out at once
    return read(self, name, start, stop, None)

  monkeypatch.setattr(_remote.Folder, "read", unpinned)
  assert blob.pread(0, 10) == b"A" * 10
  store.write("r.bin", b"B" * 1000).result()
  with pytest.raises(ucp_jax.SourceFormatError, match="replaced while it was read"):
    blob.pread(500, 10)


@pytest.mark.parametrize("form", ["stride 2", "(1, n) of stride (1, 1)", "step (1, 1)"])
def test_tensors_saved_as_views_read_as_from_disk(tmp_path, form):
  torch = pytest.importorskip("torch")
  import shutil

  layout = "universal" if form.startswith("step") else "ckpt"
  folder = tmp_path / layout
  shutil.copytree(FIXTURES / "z1_fp32_dp2" / layout, folder)
  if layout == "universal":
    for file in folder.glob("zero/*/step.pt"):
      grid = torch.zeros(3, 4)
      grid[0, 1] = float(torch.load(file, weights_only=True))
      torch.save(grid[:1, 1:2], file)  # shape (1, 1), strides (4, 1)
  else:
    file = folder / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = torch.load(file, weights_only=False)
    groups = state["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    if form == "stride 2":
      spread = torch.zeros(2 * groups[0].numel())
      spread[::2] = groups[0]
      groups[0] = spread[::2]
    else:
      groups[0] = groups[0].reshape(-1, 1).T
    torch.save(state, file)
  _same(ucp_jax.open(f"{_upload(tmp_path)}/{layout}"), ucp_jax.open(folder))


def test_a_pointer_to_a_missing_tag_is_named(tmp_path):
  import shutil

  shutil.copytree(FIXTURES / "z1_fp32_dp2" / "ckpt", tmp_path / "ckpt")
  (tmp_path / "ckpt" / "latest").write_text("global_step99")
  url = _upload(tmp_path / "ckpt")
  with pytest.raises(
    ucp_jax.SourceFormatError, match=rf"{url}/latest names the tag 'global_step99'"
  ):
    ucp_jax.open(url)


def test_a_large_legacy_torch_file_gets_the_legacy_hint(tmp_path):
  torch = pytest.importorskip("torch")
  from ucp_jax.sources._torch_reader import _torch_file

  torch.save({"w": torch.zeros(100_000)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
  url = _upload(tmp_path) + "/old.pt"
  with pytest.raises(ucp_jax.SourceFormatError, match="legacy torch format"):
    _torch_file.load_named(url)


def _upload_files(files: dict[str, bytes]) -> str:
  url = f"memory://ds{next(_ids)}/files"
  store = _location.kvstore(_location.resolve(url + "/"))
  for name, data in files.items():
    store.write(name, data).result()
  return url


def _count_reads(monkeypatch) -> list[int]:
  fetched = []
  read = _remote.Folder.read

  def counted(self, name, start=0, stop=None, generation=None):
    value, gen = read(self, name, start, stop, generation)
    fetched.append(len(value))
    return value, gen

  monkeypatch.setattr(_remote.Folder, "read", counted)
  return fetched


def test_the_growth_check_counts_the_bytes_the_readers_saw(tmp_path, monkeypatch):
  """Listings give no sizes: a conversion from a URL checks its arrays against the bytes the
  readers saw the objects hold (zip sizes, DCP spans, safetensors data), not against zero."""
  from ucp_jax.sources import _convert

  monkeypatch.setattr(_convert, "GROWTH_SLACK", 0)
  dcp = FIXTURES.parent / "dcp" / "fsdp2_adamw"
  for i, url in enumerate(
    [f"{_upload(FIXTURES / 'z2_fp32_dp2')}/ckpt", f"{_upload(FIXTURES / 'z3_bf16_dp3')}/universal",
     _upload(dcp)]
  ):  # fmt: skip
    ucp_jax.convert(url, tmp_path / str(i))
  monkeypatch.setattr(_convert, "MAX_GROWTH", 0.01)
  with pytest.raises(ucp_jax.SourceFormatError, match="MAX_GROWTH"):
    ucp_jax.convert(f"{_upload(FIXTURES / 'z2_fp32_dp2')}/ckpt", tmp_path / "x")
