"""The mapping layer: transforms both ways, rule sets, errors listed at once, lazy per-slice reads."""

import math
import os
import re

import jax
import numpy as np
import pytest
import tensorstore as ts
from chunk_reads import ChunkReads
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax import rules as R

# --- transforms, property-style: shape, lazy view, numpy forward and inverse all agree ---


@st.composite
def _splits(draw):
  """(shape, axis, sizes): an axis whose size is the product of `sizes` (one may be -1)."""
  sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
  shape = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
  axis = draw(st.integers(0, len(shape)))
  shape.insert(axis, math.prod(sizes))
  if draw(st.booleans()):
    sizes[draw(st.integers(0, len(sizes) - 1))] = -1
  return tuple(shape), axis - draw(st.sampled_from([0, len(shape)])), tuple(sizes)


def _check_transform(t, x):
  y = t.forward(x)
  assert t.shape(x.shape, x.dtype) == (y.shape, y.dtype)
  assert t.inverse_shape(y.shape, y.dtype) == (x.shape, x.dtype)
  np.testing.assert_array_equal(t.view(ts.array(x)).read().result(), y)
  back = t.inverse(y)
  assert back.dtype == x.dtype
  np.testing.assert_array_equal(back, x)


@settings(max_examples=60, deadline=None)
@given(case=_splits(), seed=st.integers(0, 99))
def test_split_and_merge_are_inverse_reshapes(case, seed):
  shape, axis, sizes = case
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  _check_transform(R.split(axis, sizes), x)
  split = R.split(axis, sizes).forward(x)
  _check_transform(R.merge(axis, sizes), split)


@settings(max_examples=40, deadline=None)
@given(
  shape=st.lists(st.integers(1, 4), min_size=0, max_size=4), data=st.data(), seed=st.integers(0, 9)
)
def test_transpose_any_permutation(shape, data, seed):
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  _check_transform(R.transpose(), x)
  _check_transform(R.transpose(data.draw(st.permutations(range(len(shape))))), x)


def test_split_views_pick_the_cheaper_stack():
  x = np.arange(2 * 96).reshape(2, 96)
  for sizes in [(3, 32), (32, 3), (1, 96), (96, 1), (2, 3, 16), (16, 3, 2), (-1, 4, 4)]:
    _check_transform(R.split(1, sizes), x)


def test_cast_both_ways():
  x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
  t = R.cast("bfloat16", "float32")
  assert t.shape((3, 4), np.dtype("float32")) == ((3, 4), np.dtype("bfloat16"))
  _check_transform(R.cast("float64", "float32"), x)
  assert R.cast("float64").inverse(x.astype(np.float64)).dtype == np.float64  # no source: kept


def test_transform_misfits_say_why():
  with pytest.raises(ValueError, match=r"split\(1, \(5, -1\)\) cannot split axis 1 of size 12"):
    R.split(1, (5, -1)).shape((2, 12), np.float32)
  with pytest.raises(ValueError, match=r"does not permute the 3 axes"):
    R.transpose((1, 0)).shape((2, 3, 4), np.float32)
  with pytest.raises(ValueError, match=r"merge\(0, \(3, 4\)\) does not fit axes 0..1 of shape"):
    R.merge(0, (3, 4)).shape((4, 3), np.float32)


# --- rules and rule sets ---


def _sd(rng=None, layers=3):
  rng = rng or np.random.default_rng(0)
  sd = {"emb.weight": rng.standard_normal((10, 8)).astype(np.float32)}
  for i in range(layers):
    sd[f"h.{i}.fc.weight"] = rng.standard_normal((12, 8)).astype(np.float32)
    sd[f"h.{i}.fc.bias"] = rng.standard_normal(12).astype(np.float32)
  return sd


def _rules(stacked=False):
  if stacked:
    return R.RuleSet(
      [
        R.Rule(r"emb\.weight", "emb/embedding"),
        R.Rule(r"h\.(\d+)\.fc\.weight", "blocks/fc/kernel", [R.transpose(), R.stack(0)]),
        R.Rule(r"h\.(\d+)\.fc\.bias", "blocks/fc/bias", [R.stack(0), R.split(1, (3, -1))]),
      ]
    )
  return R.RuleSet(
    [
      R.Rule(r"emb\.weight", "emb/embedding"),
      R.Rule(r"h\.(\d+)\.fc\.weight", "blocks/{0}/fc/kernel", [R.transpose()]),
      R.Rule(r"h\.(\d+)\.fc\.bias", "blocks/{0}/fc/bias", [R.split(0, (3, -1))]),
    ]
  )


def test_import_export_round_trip_unstacked():
  sd = _sd()
  out = _rules().import_arrays(sd)
  assert sorted(out) == sorted(
    ["emb/embedding"] + [f"blocks/{i}/fc/{n}" for i in range(3) for n in ("kernel", "bias")]
  )
  np.testing.assert_array_equal(out["blocks/1/fc/kernel"], sd["h.1.fc.weight"].T)
  assert out["blocks/2/fc/bias"].shape == (3, 4)
  back = _rules().export_arrays(out)  # a flat dict with `/` keys
  assert sorted(back) == sorted(sd)
  for k in sd:
    np.testing.assert_array_equal(back[k], sd[k])


def test_stack_and_unstack():
  sd = _sd()
  out = _rules(stacked=True).import_arrays(sd)
  assert out["blocks/fc/kernel"].shape == (3, 8, 12)
  assert out["blocks/fc/bias"].shape == (3, 3, 4)  # split after the stack: axis 1 of [3, 12]
  np.testing.assert_array_equal(out["blocks/fc/kernel"][2], sd["h.2.fc.weight"].T)
  nested = {
    "emb": {"embedding": out["emb/embedding"]},
    "blocks": {"fc": {"kernel": out["blocks/fc/kernel"], "bias": out["blocks/fc/bias"]}},
  }
  back = _rules(stacked=True).export_arrays(nested)  # any pytree
  assert sorted(back) == sorted(sd)
  for k in sd:
    np.testing.assert_array_equal(back[k], sd[k])


def test_stack_on_another_axis_and_layer_group():
  rs = R.RuleSet([R.Rule(r"(\w+)\.(\d+)", "{0}", [R.stack(1, axis=1)])])
  arrays = {f"a.{i}": np.full((2, 3), i) for i in range(4)}
  out = rs.import_arrays(arrays)
  assert out["a"].shape == (2, 4, 3)
  assert rs.export_arrays(out).keys() == arrays.keys()


def test_chained_rule_sets_compose_both_ways():
  # `model\.(h\..+)` spells `h.*` names only, so export knows `emb.weight` is not its
  hf = R.RuleSet([R.Rule(r"model\.(h\..+)", "{0}"), R.Rule(r"lm_head\.weight", "emb.weight")])
  chain = hf.then(_rules(stacked=True))
  sd = {"model." + k: v for k, v in _sd().items() if k != "emb.weight"}
  sd["lm_head.weight"] = _sd()["emb.weight"]
  assert chain.map_names(sd)["blocks/fc/kernel"] == tuple(
    f"model.h.{i}.fc.weight" for i in range(3)
  )
  out = chain.import_arrays(sd)
  np.testing.assert_array_equal(out["blocks/fc/kernel"][0], sd["model.h.0.fc.weight"].T)
  back = chain.export_arrays(out)
  assert sorted(back) == sorted(sd)
  for k in sd:
    np.testing.assert_array_equal(back[k], sd[k])


def test_rule_sets_add_and_go_under_prefixes():
  sd = _sd()
  rs = _rules().under("params") + _rules().under("exp_avg", "opt/mu")
  names = {f"params/{k}": v for k, v in sd.items()} | {f"exp_avg/{k}": v for k, v in sd.items()}
  out = rs.import_arrays(names)
  assert "params/blocks/0/fc/kernel" in out and "opt/mu/blocks/0/fc/kernel" in out
  assert sorted(rs.export_arrays(out)) == sorted(names)
  with pytest.raises(ucp_jax.MappingError, match="only single-stage rule sets add up"):
    _ = rs.then(rs) + rs


def test_tied_and_dropped_names():
  rs = R.RuleSet(
    [
      R.Rule(r"wte\.weight", "wte/embedding"),
      R.Rule(r"lm_head\.weight", "wte/embedding", tied=True),
      R.Rule(r"h\.\d+\.attn\.bias", None),  # a causal-mask buffer: dropped
    ]
  )
  w = np.arange(6.0).reshape(3, 2)
  out = rs.import_arrays({"wte.weight": w, "lm_head.weight": w, "h.0.attn.bias": np.ones(2)})
  assert list(out) == ["wte/embedding"]
  back = rs.export_arrays(out)
  assert sorted(back) == ["lm_head.weight", "wte.weight"]
  np.testing.assert_array_equal(back["lm_head.weight"], w)


def test_cast_rule_exports_the_source_dtype():
  rs = R.RuleSet([R.Rule(r"w", "w", [R.cast("float32", "bfloat16")])])
  x = np.arange(4, dtype="bfloat16")
  out = rs.import_arrays({"w": x})
  assert out["w"].dtype == np.float32
  back = rs.export_arrays(out)["w"]
  assert back.dtype == x.dtype and np.array_equal(back, x)


# --- errors: every problem, at once ---


def test_import_errors_list_everything_at_once():
  rs = R.RuleSet(
    [
      R.Rule(r"emb\.weight", "emb/embedding"),
      R.Rule(r"emb\.(\w+)", "emb/{0}"),
      R.Rule(r"h\.(\d+)\.w", "blocks/{0}/w", [R.transpose()]),
      R.Rule(r"g\.(\d+)\.w", "blocks/{0}/w"),
    ]
  )
  names = ["emb.weight", "emb.bias", "h.0.w", "h.1.w", "g.1.w", "x.y", "z"]
  with pytest.raises(ucp_jax.MappingError) as e:
    rs.map_names(names)
  assert str(e.value) == (
    "cannot map these source names onto target keys:\n"
    "  emb.weight: matched by 2 rules: emb\\.weight -> emb/embedding; emb\\.(\\w+) -> emb/{0}\n"
    "  blocks/1/w: made by two rules: h\\.(\\d+)\\.w -> blocks/{0}/w [transpose()] and "
    "g\\.(\\d+)\\.w -> blocks/{0}/w (from g.1.w)\n"
    "  x.y: no rule matches\n"
    "  z: no rule matches"
  )
  assert rs.map_names(["emb.bias", "x.y"], partial=True) == {"emb/bias": ("emb.bias",)}


def test_import_errors_duplicates_stacks_and_shapes_at_once():
  rs = R.RuleSet(
    [
      R.Rule(r"a\.(\d+)", "a", [R.stack(0)]),
      R.Rule(r"b\.(\d+)", "b", [R.stack(0)]),
      R.Rule(r"c(\d)", "c"),
      R.Rule(r"d", "a"),
      R.Rule(r"e", "e", [R.split(0, (5, -1))]),
      R.Rule(r"f\.(\w+)", "f", [R.stack(0)]),
    ]
  )
  arrays = {
    "a.0": np.zeros(2),
    "a.1": np.zeros(2),
    "a.3": np.zeros(2),
    "a.5": np.zeros(2),
    "b.0": np.zeros(2),
    "b.1": np.zeros(3),
    "c1": np.zeros(1),
    "c2": np.zeros(1),
    "d": np.zeros(2),
    "e": np.zeros(12),
    "f.x": np.zeros(1),
  }
  with pytest.raises(ucp_jax.MappingError) as e:
    rs.import_arrays(arrays)
  assert str(e.value) == (
    "cannot map these source names onto target keys:\n"
    "  a: made by two rules: a\\.(\\d+) -> a [stack(group=0, axis=0)] and d -> a (from d)\n"
    "  f.x: layer number 'x' is not a number (stack(group=0, axis=0))\n"
    "  a: layers 2, 4 missing from the stack of layers 0-1, 3, 5 (a\\.(\\d+))\n"
    "  b: cannot stack layers of different shapes or dtypes: b.0 (2,) float64; b.1 (3,) float64\n"
    "  c: made twice, from c1, c2\n"
    "  e: from e (12,) float64: split(0, (5, -1)) cannot split axis 0 of size 12"
  )


def test_malformed_rules_list_every_problem():
  with pytest.raises(ucp_jax.MappingError) as e:
    R.Rule(r"h\.(\d+)\.w", "x/{0}/{2}", [R.stack(0), R.stack(1), "T"])
  assert str(e.value) == (
    "rule 'h\\\\.(\\\\d+)\\\\.w' -> 'x/{0}/{2}' is malformed:\n"
    "  'T' is not a transform\n"
    "  more than one stack(...) marker\n"
    "  target uses {2}; the regex has 1 capture groups\n"
    "  stack(group=0, axis=0): the layer group {0} cannot also appear in the target\n"
    "  stack(group=1, axis=0) numbers layers by a group the regex does not have"
  )
  with pytest.raises(ucp_jax.MappingError, match="not a valid regex"):
    R.Rule(r"(", "x")
  with pytest.raises(ucp_jax.MappingError, match="placeholders must be capture group numbers"):
    R.Rule(r"(a)", "{name}")


def test_export_errors_list_everything_at_once():
  rs = R.RuleSet(
    [
      R.Rule(r"h\.(\d+)\.w", "blocks/{0}/w", [R.transpose()]),
      R.Rule(r"h\.(\d+)\.(?:w|v)", "blocks/{0}/w"),
      R.Rule(r"x\d", "x"),
      R.Rule(r"s\.(\d+)", "s", [R.stack(0), R.split(1, (3, -1))]),
      R.Rule(r"a", "a"),
      R.Rule(r"b", "a", tied=True),
      R.Rule(r"b", "c"),
    ]
  )
  tree = {
    "blocks/0/w": np.zeros((2, 2)),
    "x": np.zeros(1),
    "s": np.zeros((2, 4)),
    "a": np.zeros(1),
    "c": np.zeros(1),
    "zzz": np.zeros(1),
  }
  with pytest.raises(ucp_jax.MappingError) as e:
    rs.export_arrays(tree)
  assert str(e.value) == (
    "cannot map these target keys back onto source names:\n"
    "  blocks/0/w: made by 2 rules: h\\.(\\d+)\\.w -> blocks/{0}/w [transpose()]; "
    "h\\.(\\d+)\\.(?:w|v) -> blocks/{0}/w\n"
    "  x: rule x\\d -> x cannot be run backwards (its regex must be a literal with capture "
    "groups, and the target must use every group but the layer's)\n"
    "  s: merge(1, (3, -1)) needs 2 axes from axis 1; the array has 2 "
    "(s\\.(\\d+) -> s [stack(group=0, axis=0), split(1, (3, -1))])\n"
    "  b: given twice, by a and c\n"
    "  zzz: no rule makes this key"
  )


# --- lazy views over checkpoints: only the chunks under a slice are read ---


_direct_reads: list = [None]


@pytest.fixture(autouse=True)
def _count_direct_reads(monkeypatch):
  """Chunk files of raw local arrays are read without TensorStore: count those too."""
  _direct_reads[0] = ChunkReads(monkeypatch)
  yield
  _direct_reads[0] = None


def _file_reads() -> int:
  """Files read so far: by TensorStore's file kvstore, and chunk files read directly."""
  direct = len(_direct_reads[0].files) if _direct_reads[0] is not None else 0
  for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/read"):
    if metric["name"] == "/tensorstore/kvstore/file/read":
      return metric["values"][0]["value"] + direct
  return direct


def _save_layers(path, n=1, shape=(16, 32)):
  """Arrays `h.{i}.w` of `shape` stored in (4, 8) chunks (128 bytes of float32), a file each."""
  rng = np.random.default_rng(0)
  sd = {f"h.{i}.w": rng.standard_normal(shape).astype(np.float32) for i in range(n)}
  sharding = NamedSharding(jax.make_mesh((2, 4), ("x", "y")), P("x", "y"))  # (8, 8) shards
  params = {k: jax.device_put(v, sharding) for k, v in sd.items()}
  ucp_jax.save(path, {"params": params}, chunk_bytes=4 * 8 * 4, bundle_bytes=None)
  assert ucp_jax.open(path)["params/h.0.w"].chunks == (4, 8)
  return sd


def _corrupt_all_but(path, key, keep):
  """Overwrites every chunk file of `key` except the grid indices in `keep`."""
  root = os.path.join(path, key, "c")
  for i in os.listdir(root):
    for j in os.listdir(os.path.join(root, i)):
      if (int(i), int(j)) not in keep:
        file = os.path.join(root, i, j)
        size = os.path.getsize(file)
        with open(file, "wb") as f:
          f.write(b"\xff" * size)


TRANSPOSED = R.RuleSet([R.Rule(r"h\.(\d+)\.w", "blocks/{0}/kernel", [R.transpose()])])
STACKED = R.RuleSet([R.Rule(r"h\.(\d+)\.w", "blocks/kernel", [R.transpose(), R.stack(0)])])


def test_view_is_lazy_and_reads_only_the_chunks_of_a_slice_through_a_transpose(tmp_path):
  sd = _save_layers(tmp_path / "c")
  view = TRANSPOSED.view(ucp_jax.open(tmp_path / "c"), subtree="params")
  assert view.keys() == ["params/blocks/0/kernel"]
  info = view["params/blocks/0/kernel"]
  assert (info.shape, info.dtype, info.chunks) == ((32, 16), "float32", (8, 4))
  store = view.tensorstore("params/blocks/0/kernel")  # opening reads metadata only
  before = _file_reads()
  got = store[8:16, 4:8].read().result()  # = w[4:8, 8:16]: chunk (1, 1) alone
  assert _file_reads() - before == 1
  np.testing.assert_array_equal(got, sd["h.0.w"].T[8:16, 4:8])
  before = _file_reads()
  store[0:16, 0:8].read().result()  # w[0:8, 0:16]: 2 x 2 chunks
  assert _file_reads() - before == 4
  # No other chunk is touched: with every other chunk corrupt the slice still reads.
  _corrupt_all_but(tmp_path / "c", "params/h.0.w", keep={(1, 1)})
  np.testing.assert_array_equal(view.read("params/blocks/0/kernel", np.s_[8:16, 4:8]), got)
  with pytest.raises(ucp_jax.CorruptCheckpointError):
    view.read("params/blocks/0/kernel")


def test_view_reads_only_the_chunks_of_a_slice_through_a_stack(tmp_path):
  sd = _save_layers(tmp_path / "c", n=3)
  view = STACKED.view(tmp_path / "c", subtree="params")
  info = view["params/blocks/kernel"]
  assert (info.shape, info.chunks) == ((3, 32, 16), (1, 8, 4))
  assert view.source_keys("params/blocks/kernel") == (
    "params/h.0.w",
    "params/h.1.w",
    "params/h.2.w",
  )
  store = view.tensorstore("params/blocks/kernel")
  before = _file_reads()
  got = store[1, 8:16, 4:8].read().result()  # layer 1 only, chunk (1, 1)
  assert _file_reads() - before == 1
  np.testing.assert_array_equal(got, sd["h.1.w"].T[8:16, 4:8])
  before = _file_reads()
  store[:, 0:8, 0:4].read().result()  # one chunk of each layer
  assert _file_reads() - before == 3
  for i in (0, 2):
    _corrupt_all_but(tmp_path / "c", f"params/h.{i}.w", keep=set())
  _corrupt_all_but(tmp_path / "c", "params/h.1.w", keep={(1, 1)})
  np.testing.assert_array_equal(view.read("params/blocks/kernel", np.s_[1, 8:16, 4:8]), got)


@pytest.mark.parametrize("sizes, chunk", [((4, -1), (0, 1)), ((16, 2), (0, 0))])
def test_view_reads_only_the_chunks_of_a_slice_through_a_split(tmp_path, sizes, chunk):
  sd = _save_layers(tmp_path / "c")
  rs = R.RuleSet([R.Rule(r"h\.0\.w", "w", [R.split(1, sizes)])])
  store = rs.view(tmp_path / "c", subtree="params").tensorstore("params/w")
  index = np.s_[0:4, 1] if sizes == (4, -1) else np.s_[0:4, 0:4]
  before = _file_reads()
  got = store[index].read().result()
  assert _file_reads() - before == 1
  np.testing.assert_array_equal(got, R.split(1, sizes).forward(sd["h.0.w"])[index])
  _corrupt_all_but(tmp_path / "c", "params/h.0.w", keep={chunk})
  np.testing.assert_array_equal(store[index].read().result(), got)


@pytest.mark.parametrize("spec", [P("y", "x"), P(None, ("x", "y")), P(("x", "y"))])
def test_restore_through_a_mapping_reads_each_device_slice_only(tmp_path, spec):
  sd = _save_layers(tmp_path / "c")
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  sharding = NamedSharding(mesh, spec)
  target = {"blocks": [{"kernel": jax.ShapeDtypeStruct((32, 16), np.float32, sharding=sharding)}]}
  slices = {
    tuple(sl.indices(n)[:2] for sl, n in zip(index, (32, 16)))
    for index in sharding.devices_indices_map((32, 16)).values()
  }
  chunks = set()  # chunks (4, 8) of the source under the slices; target rows = its columns
  for (r0, r1), (c0, c1) in slices:
    rows, cols = range(c0 // 4, -(-c1 // 4)), range(r0 // 8, -(-r1 // 8))
    chunks |= {(i, j) for i in rows for j in cols}
  expected = len(chunks)
  before = _file_reads()
  # The source's chunk files are read directly (`MappedCheckpoint.start_read`): every slice of
  # the array in one unit, each chunk under them read once, none other.
  out = ucp_jax.restore(
    tmp_path / "c", target, subtree="params", rules=TRANSPOSED, max_host_bytes=1
  )
  assert _file_reads() - before == expected  # (the manifest is read by os, not counted here)
  kernel = out["blocks"][0]["kernel"]
  assert kernel.sharding == sharding
  np.testing.assert_array_equal(np.asarray(kernel), sd["h.0.w"].T)


def test_restore_through_a_stack_onto_a_mesh(tmp_path):
  sd = _save_layers(tmp_path / "c", n=4)
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  sharding = NamedSharding(mesh, P("x", None, "y"))
  target = {"blocks": {"kernel": jax.ShapeDtypeStruct((4, 32, 16), np.float32, sharding=sharding)}}
  out = ucp_jax.restore(tmp_path / "c", target, subtree="params", rules=STACKED)
  np.testing.assert_array_equal(
    np.asarray(out["blocks"]["kernel"]), np.stack([sd[f"h.{i}.w"].T for i in range(4)])
  )
  as_numpy = ucp_jax.restore(tmp_path / "c", subtree="params", rules=STACKED)
  np.testing.assert_array_equal(as_numpy["blocks"]["kernel"], np.asarray(out["blocks"]["kernel"]))


def test_restore_through_a_mapping_lists_every_shape_mismatch(tmp_path):
  _save_layers(tmp_path / "c", n=2)
  target = {"blocks": [{"kernel": np.zeros((16, 32), np.float32)}] * 2}
  with pytest.raises(ucp_jax.ShapeMismatchError) as e:
    ucp_jax.restore(tmp_path / "c", target, subtree="params", rules=TRANSPOSED)
  where = str(tmp_path / "c")
  assert str(e.value) == (
    f"{where}: shapes differ:\n"
    "  params/blocks/0/kernel: shape (16, 32) in target, (32, 16) in checkpoint "
    "(from params/h.0.w (16, 32) float32 via transpose())\n"
    "  params/blocks/1/kernel: shape (16, 32) in target, (32, 16) in checkpoint "
    "(from params/h.1.w (16, 32) float32 via transpose())"
  )


def test_restore_mapping_errors_name_the_checkpoint_and_partial_skips_unmatched(tmp_path):
  _save_layers(tmp_path / "c", n=2)
  ucp_jax.save(
    tmp_path / "d",
    {"params": {"h.0.w": np.zeros((16, 32), np.float32), "other": np.zeros(2)}, "step": 3},
  )
  target = {"blocks": [{"kernel": np.zeros((32, 16), np.float32)}]}
  with pytest.raises(
    ucp_jax.MappingError,
    match=re.escape(
      f"{tmp_path / 'd'}: cannot map these source names onto target keys:\n  other: no rule matches"
    ),
  ):
    ucp_jax.restore(tmp_path / "d", target, subtree="params", rules=TRANSPOSED)
  out = ucp_jax.restore(tmp_path / "d", target, subtree="params", rules=TRANSPOSED, partial=True)
  assert out["blocks"][0]["kernel"].shape == (32, 16)


def test_chained_view_restores(tmp_path):
  sd = _save_layers(tmp_path / "c", n=2)
  rename = R.RuleSet([R.Rule(r"h\.(\d+)\.w", "layers.{0}.weight")])
  chain = rename.then(
    R.RuleSet([R.Rule(r"layers\.(\d+)\.weight", "k", [R.stack(0), R.transpose((0, 2, 1))])])
  )
  view = chain.view(tmp_path / "c", subtree="params")
  assert view.keys() == ["params/k"]
  assert view.comes_from("params/k").startswith(
    "from params/layers.0.weight .. params/layers.1.weight"
  )
  out = ucp_jax.restore(
    tmp_path / "c", {"k": np.zeros((2, 32, 16), np.float32)}, subtree="params", rules=chain
  )
  np.testing.assert_array_equal(out["k"], np.stack([sd["h.0.w"].T, sd["h.1.w"].T]))
