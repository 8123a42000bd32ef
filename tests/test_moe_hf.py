"""Hugging Face mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) on expert meshes.

Tiny `transformers` 5.24 models are made here (no downloads), with every weight drawn at
random (transformers leaves routers at zero, which would route every token alike). The
reference Flax model must compute the same logits on a (data, expert, model) mesh from the
models' own `state_dict()` (fused experts), from `save_pretrained` folders (one tensor per
expert), with stacked layers, and back through `export --format hf` and `from_pretrained`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import tensorstore as ts

import ucp_jax
from ucp_jax import models
from ucp_jax import rules as R
from ucp_jax.mapping._load import ArraysCheckpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from flax import nnx  # noqa: E402

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]
TOKENS = np.random.RandomState(0).randint(0, 37, (2, 9))


def tiny(family: str, **overrides):
  torch.manual_seed(0)
  common = dict(
    vocab_size=37,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
  )
  if family == "mixtral":
    cfg = transformers.MixtralConfig(**common, intermediate_size=12, num_local_experts=4)
    model = transformers.MixtralForCausalLM(cfg)
  elif family == "qwen2_moe":  # a shared expert with its sigmoid gate; layer 1 dense
    cfg = transformers.Qwen2MoeConfig(
      **common,
      intermediate_size=20,
      moe_intermediate_size=12,
      shared_expert_intermediate_size=10,
      num_experts=4,
      norm_topk_prob=False,
      mlp_only_layers=[1],
      **overrides,
    )
    model = transformers.Qwen2MoeForCausalLM(cfg)
  else:
    cfg = transformers.Qwen3MoeConfig(
      **common,
      intermediate_size=20,
      moe_intermediate_size=12,
      num_experts=4,
      head_dim=8,
      norm_topk_prob=True,
      **overrides,
    )
    model = transformers.Qwen3MoeForCausalLM(cfg)
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn(p.shape) * 0.2)
  return model.eval()


def logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(TOKENS)).logits.numpy()


def mesh():
  return jax.make_mesh((2, 2, 2), ("data", "expert", "model"))


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
  "family",
  [pytest.param("mixtral", marks=SLOW), pytest.param("qwen2_moe", marks=SLOW), "qwen3_moe"],
)
def test_check_forward_on_an_expert_mesh(family):
  hf = tiny(family)
  rs, cfg = R.from_hf(hf)  # the model's own names: fused experts (transformers 5)
  assert isinstance(cfg, models.moe.MoeConfig) and cfg.num_experts == 4 and cfg.top_k == 2
  model = models.build(cfg, mesh=mesh(), abstract=True)
  experts = model.layers[0].mlp.experts
  assert experts.gate.sharding.spec == jax.sharding.PartitionSpec("expert", "data", "model")
  assert R.check_forward(hf, model, rs, TOKENS) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_routing_options_that_shapes_cannot_show_are_caught_by_outputs(family):
  hf = tiny(family)
  rs, cfg = R.from_hf(hf)
  wrong = dataclasses.replace(cfg, norm_topk_prob=not cfg.norm_topk_prob)
  with pytest.raises(ucp_jax.MappingError, match="outputs differ"):
    R.check_forward(hf, models.build(wrong, abstract=True), rs, TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_folder_to_jax_and_back_to_from_pretrained(tmp_path, family):
  import optax

  hf = tiny(family)
  want = logits(hf)
  hf.save_pretrained(tmp_path / "hf")  # one tensor per expert, as on the Hub
  rs, cfg = R.from_hf(tmp_path / "hf")
  sources = rs.map_names(_names(tmp_path / "hf"))["layers/0/mlp/experts/gate"]
  assert len(sources) == 4 and ".experts.3." in sources[3]  # per-expert names, stacked
  model = models.build(cfg, rngs=nnx.Rngs(1), mesh=mesh())
  R.load_into(model, tmp_path / "hf", rs, subtree="params")
  np.testing.assert_allclose(np.asarray(model(TOKENS)), want, atol=1e-5, rtol=1e-5)
  if not cfg.dense_layers:
    stacked, _ = R.from_hf(tmp_path / "hf", stacked=True)
    scanned = models.build(cfg, rngs=nnx.Rngs(1), mesh=mesh(), scan=True)
    R.load_into(scanned, tmp_path / "hf", stacked, subtree="params")
    assert scanned.layers.mlp.experts.gate[...].shape == (2, 4, 16, 12)  # [layers, experts, ...]
    np.testing.assert_allclose(np.asarray(scanned(TOKENS)), want, atol=1e-5, rtol=1e-5)
  opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  ucp_jax.save_train_state(tmp_path / "jax", model, opt)
  ucp_jax.export(tmp_path / "jax", tmp_path / "out", format="hf", rules=rs, config=tmp_path / "hf")
  back = type(hf).from_pretrained(tmp_path / "out").eval()
  np.testing.assert_allclose(logits(back), want, atol=1e-5, rtol=1e-5)


def _names(folder):
  return [k.split("/", 1)[1] for k in ucp_jax.open(folder).keys() if k.startswith("params/")]


def test_scan_needs_experts_in_every_layer():
  _, cfg = R.from_hf(tiny("qwen2_moe"))
  with pytest.raises(ucp_jax.InvalidArgumentError, match=r"layers \[1\] are dense") as e:
    models.build(cfg, abstract=True, scan=True)
  assert "\n" not in str(e.value)


class _CountingCheckpoint(ArraysCheckpoint):
  """In-memory arrays whose reads are recorded: {key: [region, ...]}."""

  def __init__(self, arrays):
    super().__init__(arrays)
    self.reads: dict[str, list] = {}

  def open_future(self, key):
    array = self._arrays[key]

    def read(domain, out, _params):
      region = tuple(slice(d.inclusive_min, d.exclusive_max) for d in domain)
      self.reads.setdefault(key, []).append(region)
      out[...] = array[region]

    layout = ts.ChunkLayout(read_chunk_shape=[2, 4])
    store = ts.virtual_chunked(
      read, dtype=ts.dtype(array.dtype.name), shape=array.shape, chunk_layout=layout
    )
    promise, future = ts.Promise.new()
    promise.set_result(store)
    return future


def test_each_device_reads_only_its_experts_and_slices():
  """Per-expert sources stacked lazily: a restore onto (expert 4 x model 2) reads every element
  once, and one device's slice reads its expert's tensor alone, only the rows it holds."""
  rs = R.hf_moe(family="mixtral", num_heads=4, num_kv_heads=2)
  arrays = {}
  for e in range(4):
    w = np.random.RandomState(e).randn(12, 16).astype(np.float32)  # [hidden, d]: w1
    arrays[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"] = w
  names = list(arrays)
  ckpt = _CountingCheckpoint(arrays)
  view = rs.view(ckpt)
  m = jax.make_mesh((4, 2), ("expert", "model"))
  sharding = jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec("expert", None, "model"))
  assert view["layers/0/mlp/experts/gate"].shape == (4, 16, 12)
  leaf = jax.ShapeDtypeStruct((4, 16, 12), np.float32, sharding=sharding)
  target = {"layers": {"0": {"mlp": {"experts": {"gate": leaf}}}}}
  got = ucp_jax.restore(view, target)["layers"]["0"]["mlp"]["experts"]["gate"]
  np.testing.assert_array_equal(np.asarray(got), np.stack([a.T for a in arrays.values()]))
  assert sum(_elements(r) for rs_ in ckpt.reads.values() for r in rs_) == 4 * 12 * 16
  ckpt.reads.clear()  # one device's slice: expert 1, the second half of its hidden units
  store = view.tensorstore("layers/0/mlp/experts/gate")
  np.testing.assert_array_equal(store[1, :, 6:12].read().result(), arrays[names[1]].T[:, 6:12])
  assert list(ckpt.reads) == [names[1]]
  assert all(r[0].start >= 6 for r in ckpt.reads[names[1]])
  assert sum(_elements(r) for r in ckpt.reads[names[1]]) == 6 * 16


def _elements(region) -> int:
  return int(np.prod([s.stop - s.start for s in region]))
