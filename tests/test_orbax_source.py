"""Orbax as a source: checkpoints Orbax wrote, opened, inspected, restored and converted in place.

Each layout Orbax writes (OCDBT or a folder per array, zarr v2 or v3, zstd or raw; a
`CheckpointManager` step) holds a Flax NNX training state saved by Orbax itself; ucp_jax
reads it without Orbax, onto a 2x4 mesh, bit for bit, and bad input gets one line naming the
file and the key, with nothing committed.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import orbax_states as S
import pytest

import ucp_jax
from ucp_jax import cli
from ucp_jax.store import _keypath


@pytest.fixture(scope="module")
def state():
  return S.trained()[2]


@pytest.fixture
def mesh(devices):
  return jax.make_mesh((2, 4), ("data", "model"), devices=devices)


B = ("bias", "kernel")


def _infos(ckpt):
  return [(k, ckpt[k]) for k in ckpt.keys()]


LAYOUTS = [
  pytest.param(dict(ocdbt=o, zarr3=z, compression=c), id=f"{n}-{v}-{k}")
  for o, n in ((True, "ocdbt"), (False, "folders"))
  for z, v in ((False, "zarr2"), (True, "zarr3"))
  for c, k in ((True, "zstd"), (False, "raw"))
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_restores_onto_a_2x4_mesh_bit_exact(tmp_path, state, mesh, layout):
  S.save(tmp_path / "orbax", state, **layout)
  ckpt = ucp_jax.open(tmp_path / "orbax")
  ucp_jax.save(tmp_path / "ucp", state)  # the same tree saved by ucp_jax: the same keys
  ours = ucp_jax.open(tmp_path / "ucp")
  described = {k: (i.shape, i.dtype, i.kind, i.python_type, i.prng_impl) for k, i in _infos(ckpt)}
  assert described == {
    k: (i.shape, i.dtype, i.kind, i.python_type, i.prng_impl) for k, i in _infos(ours)
  }
  assert ckpt["model/rngs/default/key"].kind == "prng_key"
  target = S.on_mesh(S.abstract(), mesh)
  restored = ucp_jax.restore(tmp_path / "orbax", target)
  S.assert_same(restored, state)
  kernel = restored["model"]["l1"]["kernel"][...]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("data", "model")
  assert ckpt.verify() == {}


def test_keys_kinds_and_the_training_schema(tmp_path, state):
  with ocp.StandardCheckpointer() as checkpointer:  # Orbax's defaults
    checkpointer.save(tmp_path / "orbax", state)
  ckpt = ucp_jax.open(tmp_path / "orbax")
  assert ckpt.step == 2  # Adam's count
  assert ckpt["optimizer/step"].kind == "array"  # an NNX OptState: a jax.Array
  assert (ckpt["model/rngs/default/key"].prng_impl, ckpt["model/rngs/default/key"].shape) == (
    "threefry2x32",
    (2,),
  )
  schema = ckpt.manifest.schema
  assert schema["naming"] == "flax"
  assert sorted(schema["params"]) == sorted(
    f"{m}/{p}" for m, ps in {"bn": ("bias", "scale"), "l1": B, "l2": B}.items() for p in ps
  )
  assert schema["params"]["l1/kernel"] == {
    "value": "model/l1/kernel",
    "slots": {
      "exp_avg": "optimizer/opt_state/0/mu/l1/kernel",
      "exp_avg_sq": "optimizer/opt_state/0/nu/l1/kernel",
    },
    "group": 0,
    "frozen": False,
    "tied_to": None,
  }
  assert schema["buffers"] == {"bn/mean": "model/bn/mean", "bn/var": "model/bn/var"}
  assert schema["optimizer"] == {"type": "adam", "step": 2, "groups": [{}]}
  source = ckpt.manifest.source
  assert (source["format"], source["ocdbt"], source["zarr"]) == ("orbax", True, 2)
  assert source["orbax_tree"]["nnx_variables"] == "all"


def test_the_schema_is_the_one_save_train_state_writes(tmp_path):
  model, optimizer, state = S.trained()
  S.save(tmp_path / "orbax", state)
  hyper = {"lr": 0.01, "weight_decay": 0.1}
  ucp_jax.save_train_state(tmp_path / "ucp", model, optimizer, hyperparams=hyper)
  ours = ucp_jax.convert(tmp_path / "orbax", tmp_path / "converted", hyperparams=hyper)
  expected = ucp_jax.open(tmp_path / "ucp").manifest.schema
  got = ucp_jax.open(ours.dst).manifest.schema
  assert got["params"] == expected["params"]
  assert ours.params == len(expected["params"]) > 0  # the report counts them too
  # Orbax records no Optax state classes (adam's and adabelief's are both `mu`, `nu`), and
  # no hyperparameters but those given (or injected)
  want = {k: v for k, v in expected["optimizer"].items() if k != "states"}
  want["groups"] = [{k: g[k] for k in hyper} for g in want["groups"]]
  assert got["optimizer"] == want
  floating = {k: v for k, v in expected["buffers"].items() if not k.startswith("rngs/")}
  assert got["buffers"] == floating  # the Rngs counter and key are no torch buffers


def test_convert_writes_the_same_tree_and_a_schema_hyperparams_fill(tmp_path, state, mesh):
  S.save(tmp_path / "orbax", state, ocdbt=True, zarr3=True)
  report = ucp_jax.convert(
    tmp_path / "orbax", tmp_path / "ucp", hyperparams={"lr": 0.01, "weight_decay": 0.1}
  )
  assert (report.format, report.step, report.arrays) == ("orbax", 2, 24)
  ckpt = ucp_jax.open(tmp_path / "ucp")
  assert ckpt.checksummed and ckpt.verify() == {}
  assert ckpt.manifest.schema["optimizer"]["type"] == "adamw"
  assert ckpt.manifest.schema["optimizer"]["groups"] == [{"lr": 0.01, "weight_decay": 0.1}]
  S.assert_same(ucp_jax.restore(tmp_path / "ucp", S.on_mesh(S.abstract(), mesh)), state)
  with pytest.raises(ucp_jax.InvalidArgumentError, match="2 dict"):
    ucp_jax.convert(tmp_path / "orbax", tmp_path / "x", hyperparams=[{}, {}])


def test_injected_hyperparams_are_read(tmp_path):
  params = {"w": jnp.ones((4, 2))}
  tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.003, weight_decay=0.02)
  S.save(tmp_path / "orbax", {"params": params, "opt_state": tx.init(params), "step": 5})
  optimizer = ucp_jax.open(tmp_path / "orbax").manifest.schema["optimizer"]
  assert optimizer["type"] == "adamw"
  assert optimizer["groups"] == [
    {"lr": 0.003, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.02}
  ]


def test_plain_trees_scalars_sequences_and_leaves_named_value(tmp_path, mesh):
  tree = {
    "w": jnp.arange(16.0).reshape(4, 4),
    "n": np.arange(3, dtype=np.int16),
    "count": 7,
    "lr": 0.5,
    "flag": True,
    "key": jax.random.key(3),
    "pair": (jnp.ones(2, jnp.bfloat16), jnp.zeros(1)),
    "node": {"value": jnp.ones(3), "other": jnp.zeros(2)},  # not an NNX Variable
    "var": {"value": jnp.full(2, 4.0)},  # looks like one: read as `var`
    "nothing": None,
  }
  S.save(tmp_path / "orbax", tree)
  ckpt = ucp_jax.open(tmp_path / "orbax")
  assert ckpt.keys() == sorted(
    ["count", "flag", "key", "lr", "n", "node/other", "node/value", "pair/0", "pair/1", "var", "w"]
  )
  assert (ckpt["count"].kind, ckpt["count"].python_type, ckpt["lr"].python_type) == (
    "scalar",
    "int",
    "float",
  )
  floating = {"w", "pair/0", "pair/1", "node/value", "node/other", "var"}  # a model alone
  assert set(ckpt.manifest.schema["params"]) == floating
  assert ckpt.manifest.source["orbax_tree"]["nnx_variables"] == ["var"]
  untargeted = ucp_jax.restore(tmp_path / "orbax")
  assert untargeted["count"] == 7 and untargeted["flag"] is True
  np.testing.assert_array_equal(untargeted["pair"][0], np.ones(2, jnp.bfloat16))
  expected = {k: v for k, v in tree.items() if k != "nothing"} | {"var": tree["var"]["value"]}
  arrays = {k: v for k, v in expected.items() if k not in ("count", "lr", "flag")}
  target = S.on_mesh(jax.eval_shape(lambda: arrays), mesh) | {"count": 0, "lr": 0.0, "flag": False}
  S.assert_same(ucp_jax.restore(tmp_path / "orbax", target), expected)


def test_checkpoint_manager_steps(tmp_path, state, mesh, capsys):
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    for step in (1, 2):
      manager.save(step, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
  root = str(tmp_path / "run")
  assert cli.main(["inspect", root]) == 2
  err = capsys.readouterr().err.replace("\n", "")
  assert "an Orbax CheckpointManager folder with steps 1, 2 (latest 2); pass one step" in err
  assert f"{root}/2" in err
  assert cli.main(["inspect", f"{root}/2"]) == 0
  out = capsys.readouterr().out
  assert "model/l1/kernel" in out and "format: orbax, read in place" in out
  assert ucp_jax.open(f"{root}/2").step == 2  # the step folder's number
  assert ucp_jax.open(f"{root}/2/default").step == 2
  S.assert_same(ucp_jax.restore(f"{root}/2", S.on_mesh(S.abstract(), mesh)), state)
  assert cli.main(["convert", f"{root}/1", str(tmp_path / "ucp")]) == 0
  assert ucp_jax.open(tmp_path / "ucp").step == 1


def test_steps_with_several_items_or_ucp_items_say_what_to_open(tmp_path, state):
  with ocp.CheckpointManager(tmp_path / "run", item_names=("a", "b", "meta")) as manager:
    args = dict(a=ocp.args.StandardSave(state), b=ocp.args.StandardSave({"x": jnp.ones(2)}))
    manager.save(3, args=ocp.args.Composite(**args, meta=ocp.args.JsonSave({"k": 1})))
    manager.wait_until_finished()
  step = tmp_path / "run" / "3"
  with pytest.raises(ucp_jax.SourceFormatError, match="2 pytree items; pass one of them"):
    ucp_jax.open(step)
  assert ucp_jax.open(step / "b").keys() == ["x"]
  from ucp_jax.orbax import UcpSave

  with ocp.CheckpointManager(tmp_path / "ours") as manager:
    manager.save(4, args=UcpSave({"x": jnp.ones(2)}, step=4))
    manager.wait_until_finished()
  with pytest.raises(ucp_jax.SourceFormatError, match=r"is a ucp_jax checkpoint.*open it"):
    ucp_jax.open(tmp_path / "ours" / "4")


# Bad input: one line naming the file and the key; nothing committed.


def _convert_refused(src, dst, error, match) -> str:
  with pytest.raises(error, match=match) as caught:
    ucp_jax.convert(src, dst)
  assert not os.path.exists(dst)
  assert not [n for n in os.listdir(os.path.dirname(dst)) if ".ucp-tmp" in n]
  message = str(caught.value)
  assert "\n" not in message
  return message


def _manager_with_steps(path, state) -> str:
  with ocp.CheckpointManager(path) as manager:
    for step in (1, 2):
      manager.save(step, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
  return str(path)


def test_a_step_without_its_commit_marker_is_refused(tmp_path, state, capsys):
  root = _manager_with_steps(tmp_path / "run", state)
  step = os.path.join(root, "2")
  for folder in (step, os.path.join(step, "default")):
    os.remove(os.path.join(folder, "commit_success.txt"))
  metadata = os.path.join(step, "_CHECKPOINT_METADATA")
  with open(metadata) as f:
    data = json.load(f)
  with open(metadata, "w") as f:
    json.dump({**data, "commit_timestamp_nsecs": None}, f)  # as Orbax leaves it mid-save
  message = _convert_refused(
    step, str(tmp_path / "ucp"), ucp_jax.CheckpointNotFoundError, "did not finish"
  )
  assert f"{step}: an Orbax save that did not finish (no commit_success.txt" in message
  assert f"`commit_timestamp_nsecs` in {metadata} is not set" in message
  assert "committed steps beside it: 1" in message
  for path in (step, os.path.join(step, "default")):
    with pytest.raises(ucp_jax.CheckpointNotFoundError):
      ucp_jax.restore(path, S.abstract())
  assert cli.main(["inspect", root]) == 2  # the root lists only the committed step
  assert "steps 1 (latest 1); not committed, so not read: 2" in capsys.readouterr().err


def test_a_temporary_step_folder_is_refused(tmp_path, state):
  root = _manager_with_steps(tmp_path / "run", state)
  tmp = os.path.join(root, "3.orbax-checkpoint-tmp-1234")
  shutil.copytree(os.path.join(root, "2"), tmp)
  message = _convert_refused(tmp, str(tmp_path / "ucp"), ucp_jax.CheckpointNotFoundError, "tmp")
  assert "its folder still has its temporary name" in message
  with pytest.raises(ucp_jax.SourceFormatError, match=r"steps 1, 2 \(latest 2\)"):
    ucp_jax.open(root)


def test_a_missing_ocdbt_manifest_is_refused(tmp_path, state):
  S.save(tmp_path / "orbax", state)
  os.remove(tmp_path / "orbax" / "manifest.ocdbt")
  message = _convert_refused(
    tmp_path / "orbax", str(tmp_path / "ucp"), ucp_jax.SourceFormatError, "manifest.ocdbt"
  )
  assert message.startswith(f"{tmp_path / 'orbax' / 'manifest.ocdbt'}: missing: the OCDBT")
  assert "`model/bn/bias`" in message and "`use_ocdbt` in _METADATA" in message


def test_a_missing_array_file_is_refused(tmp_path, state, mesh):
  S.save(tmp_path / "orbax", state, ocdbt=False)
  chunk = tmp_path / "orbax" / "model.l1.kernel.value" / "0.0"
  os.remove(chunk)
  ckpt = ucp_jax.open(tmp_path / "orbax")  # the metadata is whole: it opens
  message = _convert_refused(
    tmp_path / "orbax", str(tmp_path / "ucp"), ucp_jax.SourceFormatError, "cannot read"
  )
  assert "(`model/l1/kernel`): cannot read" in message and str(chunk) in message
  assert list(ckpt.verify()) == ["model/l1/kernel"]
  with pytest.raises(ucp_jax.CorruptCheckpointError, match=r"`model/l1/kernel`.*0\.0"):
    ucp_jax.restore(tmp_path / "orbax", S.on_mesh(S.abstract(), mesh))
  os.remove(tmp_path / "orbax" / "model.l2.bias.value" / ".zarray")
  message = _convert_refused(
    tmp_path / "orbax", str(tmp_path / "ucp"), ucp_jax.SourceFormatError, "zarray"
  )
  assert f"{tmp_path / 'orbax'}/model.l2.bias.value (`model/l2/bias`): NOT_FOUND" in message


def test_a_missing_ocdbt_data_file_is_refused(tmp_path, state):
  S.save(tmp_path / "orbax", state)
  data = tmp_path / "orbax" / "d"
  for name in os.listdir(data):
    os.remove(data / name)
  message = _convert_refused(
    tmp_path / "orbax", str(tmp_path / "ucp"), ucp_jax.SourceFormatError, "Error reading"
  )
  assert str(data) in message and "(`model/bn/bias`)" in message and "more arrays alike" in message


def test_a_folder_without_metadata_and_a_manager_without_steps(tmp_path):
  os.makedirs(tmp_path / "item" / "d")
  (tmp_path / "item" / "manifest.ocdbt").write_bytes(b"")
  with pytest.raises(ucp_jax.SourceFormatError, match=r"_METADATA: missing: the file that holds"):
    ucp_jax.open(tmp_path / "item")
  (tmp_path / "item" / "_METADATA").write_text("{not json")
  with pytest.raises(ucp_jax.SourceFormatError, match=r"_METADATA: not valid JSON"):
    ucp_jax.open(tmp_path / "item")
  (tmp_path / "item" / "_METADATA").write_text(json.dumps({"tree_metadata": {"('a',)": 3}}))
  with pytest.raises(ucp_jax.SourceFormatError, match=r"entry \"\('a',\)\": not an object with"):
    ucp_jax.open(tmp_path / "item")


def test_a_bare_sharding_restores_typed_keys(tmp_path, devices):
  """A target leaf that is only a Sharding takes shape and dtype from the checkpoint: a
  typed PRNG key comes back as one (its key data sharded as the keys are)."""
  tree = {"key": jax.random.key(5), "keys": jax.random.split(jax.random.key(6), 8)}
  S.save(tmp_path / "orbax", tree)
  mesh = jax.make_mesh((8,), ("data",), devices=devices)
  target = {
    "key": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
    "keys": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
  }
  restored = ucp_jax.restore(tmp_path / "orbax", target)
  S.assert_same(restored, tree)
  assert restored["keys"].sharding == target["keys"]


def test_keys_are_the_tree_layers(tmp_path):
  tree = {"a/b": jnp.ones(2), "c d": jnp.zeros(1), "__x": jnp.ones(1)}
  S.save(tmp_path / "orbax", {"x": tree})
  assert ucp_jax.open(tmp_path / "orbax").keys() == sorted(
    "x/" + _keypath.encode_part(k) for k in tree
  )


def test_a_zstd_checkpoint_of_zeros_converts(tmp_path, monkeypatch):
  """A fresh optimizer's moments compress far past 4x; Orbax's bound is the codec's ratio."""
  from ucp_jax.sources import _convert

  monkeypatch.setattr(_convert, "GROWTH_SLACK", 0)  # as for a checkpoint past the slack
  tree = {"mu": np.zeros((512, 512), np.float32), "w": np.ones((64, 64), np.float32)}
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "orbax", tree)
  ckptr.wait_until_finished()
  ckptr.close()
  report = ucp_jax.convert(tmp_path / "orbax", tmp_path / "ucp")
  assert report.bytes == tree["mu"].nbytes + tree["w"].nbytes
  np.testing.assert_array_equal(ucp_jax.open(tmp_path / "ucp").read("mu"), tree["mu"])


# On object stores: `memory://` and `file://` URLs stand in for `gs://` and `s3://` (the same
# kvstore listings and reads).

_uploads = iter(range(10**6))


def _upload_tree(local, url: str) -> str:
  """Copies every file below `local` to the objects below `url`; returns `url`."""
  from ucp_jax.store import _location

  store = _location.kvstore(_location.resolve(url + "/"))
  for path in sorted(p for p in local.rglob("*") if p.is_file()):
    store.write(path.relative_to(local).as_posix(), path.read_bytes()).result()
  return url


@pytest.mark.parametrize(
  "layout", [LAYOUTS[0], LAYOUTS[-1]], ids=["ocdbt-zarr2-zstd", "folders-zarr3-raw"]
)
def test_a_checkpoint_on_an_object_store_restores_and_converts(tmp_path, state, mesh, layout):
  from ucp_jax.sources import _registry

  S.save(tmp_path / "orbax", state, **layout)
  url = _upload_tree(tmp_path / "orbax", f"memory://orbax{next(_uploads)}/ckpt")
  assert _registry.sniff(url).NAME == "orbax"
  ckpt = ucp_jax.open(url)
  assert ckpt.keys() == ucp_jax.open(tmp_path / "orbax").keys()
  assert ckpt.manifest.source["format"] == "orbax" and ckpt.step == 2
  S.assert_same(ucp_jax.restore(url, S.on_mesh(S.abstract(), mesh)), state)
  assert ckpt.verify() == {}
  ucp_jax.convert(url, tmp_path / "ucp")
  S.assert_same(ucp_jax.restore(tmp_path / "ucp", S.on_mesh(S.abstract(), mesh)), state)
  file_url = f"file://{tmp_path / 'orbax'}"
  S.assert_same(ucp_jax.restore(file_url, S.on_mesh(S.abstract(), mesh)), state)


def test_manager_steps_on_an_object_store(tmp_path, state, mesh, capsys):
  root = _manager_with_steps(tmp_path / "run", state)
  for folder in (os.path.join(root, "2"), os.path.join(root, "2", "default")):
    os.remove(os.path.join(folder, "commit_success.txt"))
  metadata = os.path.join(root, "2", "_CHECKPOINT_METADATA")
  with open(metadata) as f:
    data = json.load(f)
  with open(metadata, "w") as f:
    json.dump({**data, "commit_timestamp_nsecs": None}, f)
  url = _upload_tree(tmp_path / "run", f"memory://orbax{next(_uploads)}/run")
  assert cli.main(["inspect", url]) == 2
  err = capsys.readouterr().err.replace("\n", "")
  assert "steps 1 (latest 1); not committed, so not read: 2" in err and f"{url}/1" in err
  with pytest.raises(ucp_jax.CheckpointNotFoundError, match="committed steps beside it: 1"):
    ucp_jax.open(f"{url}/2/default")
  assert ucp_jax.open(f"{url}/1").step == 1
  assert cli.main(["convert", f"{url}/1/default", str(tmp_path / "ucp")]) == 0
  S.assert_same(ucp_jax.restore(tmp_path / "ucp", S.on_mesh(S.abstract(), mesh)), state)


def test_missing_objects_on_an_object_store_are_named(tmp_path, state):
  S.save(tmp_path / "orbax", state)
  url = f"memory://orbax{next(_uploads)}/ckpt"
  files = {p.relative_to(tmp_path / "orbax").as_posix() for p in (tmp_path / "orbax").rglob("*")}
  _upload_tree(tmp_path / "orbax", url)
  from ucp_jax.store import _location

  store = _location.kvstore(_location.resolve(url + "/"))
  store.write("manifest.ocdbt", None).result()  # deleted
  assert "manifest.ocdbt" in files
  with pytest.raises(ucp_jax.SourceFormatError, match=rf"{url}/manifest.ocdbt: missing"):
    ucp_jax.open(url)
  store.write("_METADATA", b"{not json").result()
  with pytest.raises(ucp_jax.SourceFormatError, match=rf"{url}/_METADATA: not valid JSON"):
    ucp_jax.open(url)
  with pytest.raises(ucp_jax.CheckpointNotFoundError, match="no committed checkpoint"):
    ucp_jax.open(f"memory://orbax{next(_uploads)}/nothing")


def test_hidden_files_beside_the_array_metadata_are_not_read(tmp_path, state, mesh):
  S.save(tmp_path / "orbax", state)
  (tmp_path / "orbax" / "array_metadatas" / ".process_0.swp").write_bytes(b"\0vim swap")
  ckpt = ucp_jax.open(tmp_path / "orbax")
  assert ckpt["model/rngs/default/key"].kind == "prng_key"  # process_0's metadata still read
  S.assert_same(ucp_jax.restore(tmp_path / "orbax", S.on_mesh(S.abstract(), mesh)), state)
