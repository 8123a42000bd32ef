"""Fused arrays (Phi-3's `qkv_proj` and `gate_up_proj`) as sub-parameters: split lazily on
read, each a view of its slice, and fused again on export. No torch needed."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax
from ucp_jax import rules as R

H, KV, K, D = 4, 2, 8, 32  # query heads, key/value heads, head width, model width
QKV = R.RuleSet(
  [
    R.Rule(
      r"layers\.(\d+)\.qkv\.weight",
      f"layers/{{0}}/{name}/kernel",
      [R.sub_param(0, (H, KV, KV), i), R.transpose(), R.split(1, (heads, -1))],
    )
    for i, (name, heads) in enumerate((("q", H), ("k", KV), ("v", KV)))
  ]
)


def _fused(n=2):
  rng = np.random.default_rng(0)
  return {
    f"layers.{i}.qkv.weight": rng.standard_normal(((H + 2 * KV) * K, D), np.float32)
    for i in range(n)
  }


def test_a_fused_array_splits_and_fuses_back_bit_for_bit():
  sd = _fused()
  got = QKV.import_arrays(sd)
  w = sd["layers.1.qkv.weight"]
  np.testing.assert_array_equal(got["layers/1/q/kernel"], w[: H * K].T.reshape(D, H, K))
  np.testing.assert_array_equal(
    got["layers/1/k/kernel"], w[H * K : (H + KV) * K].T.reshape(D, KV, K)
  )
  np.testing.assert_array_equal(got["layers/1/v/kernel"], w[(H + KV) * K :].T.reshape(D, KV, K))
  back = QKV.export_arrays(got)
  assert sorted(back) == sorted(sd)
  for name, array in sd.items():
    assert back[name].tobytes() == array.tobytes(), name
  assert QKV.map_names(list(sd))["layers/0/k/kernel"] == ("layers.0.qkv.weight",)


def test_stacked_sub_parameters_and_the_ready_phi3_rules():
  sd = _fused(3)
  stacked = R.RuleSet(
    [
      R.Rule(
        r"layers\.(\d+)\.qkv\.weight",
        f"layers/{n}/kernel",
        [R.sub_param(0, (H, KV, KV), i), R.stack(0), R.transpose((0, 2, 1))],
      )
      for i, n in enumerate("qkv")
    ]
  )
  got = stacked.import_arrays(sd)
  assert got["layers/v/kernel"].shape == (3, D, KV * K)
  back = stacked.export_arrays(got)
  assert all(back[n].tobytes() == sd[n].tobytes() for n in sd)

  phi3 = R.hf_llama(num_heads=H, num_kv_heads=KV, fused=True, stacked=True)
  names = [
    f"model.layers.{i}.{n}.weight"
    for i in range(2)
    for n in ("self_attn.qkv_proj", "mlp.gate_up_proj")
  ]
  assert sorted(phi3.map_names(names)) == [
    "layers/attn/k/kernel",
    "layers/attn/q/kernel",
    "layers/attn/v/kernel",
    "layers/mlp/gate/kernel",
    "layers/mlp/up/kernel",
  ]


def test_export_needs_every_sub_parameter_and_rules_must_agree():
  got = QKV.import_arrays(_fused(1))
  del got["layers/0/v/kernel"]
  with pytest.raises(
    ucp_jax.MappingError, match=r"layers\.0\.qkv\.weight: sub-parameters 2 of \(4, 2, 2\) missing"
  ):
    QKV.export_arrays(got)
  clash = R.RuleSet(
    [
      R.Rule(r"w", "a", [R.sub_param(0, (1, 1), 0)]),
      R.Rule(r"w", "b", [R.sub_param(0, (1, 1), 0)]),  # the same sub-parameter twice
    ]
  )
  with pytest.raises(ucp_jax.MappingError, match="matched by 2 rules"):
    clash.import_arrays({"w": np.zeros((4, 2))})
  with pytest.raises(ucp_jax.MappingError, match="must be the first transform"):
    R.Rule(r"w", "a", [R.transpose(), R.sub_param(0, (1, 1), 0)])
  with pytest.raises(ucp_jax.MappingError, match=r"cannot cut axis 0 of size 5"):
    R.RuleSet([R.Rule(r"w", "a", [R.sub_param(0, (1, 1), 0)])]).import_arrays(
      {"w": np.zeros((5, 2))}
    )


def test_each_device_reads_its_slice_of_one_sub_parameter(devices, tmp_path):
  sd = _fused(1)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  on_rows = NamedSharding(mesh, P("model"))  # saved in 4 row blocks of 16: q 0-1, k 2, v 3
  tree = {"params": {k: jax.device_put(v, on_rows) for k, v in sd.items()}}
  ucp_jax.save(tmp_path / "c", tree, bundle_bytes=None)  # a file per chunk, to damage apart
  assert ucp_jax.open(tmp_path / "c")["params/layers.0.qkv.weight"].chunks[0] == 16
  root = os.path.join(tmp_path, "c", "params", "layers.0.qkv.weight")
  target = {"layers": {"0": {"k": {"kernel": NamedSharding(mesh, P("model"))}}}}
  # the keys' rows live in row block 2: corrupt every other block, the keys still restore
  for block in os.listdir(os.path.join(root, "c")):
    for name in os.listdir(os.path.join(root, "c", block)):
      path = os.path.join(root, "c", block, name)
      if block != "2":
        with open(path, "r+b") as f:
          f.write(b"\xff" * os.path.getsize(path))
  got = ucp_jax.restore(tmp_path / "c", target, subtree="params", rules=QKV, partial=True)
  w = sd["layers.0.qkv.weight"]
  np.testing.assert_array_equal(
    np.asarray(got["layers"]["0"]["k"]["kernel"]), w[H * K : (H + KV) * K].T.reshape(D, KV, K)
  )
