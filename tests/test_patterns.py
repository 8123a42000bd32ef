"""TP/PP/EP patterns: merge and split are inverses, layouts match DeepSpeed's, errors list all."""

import importlib.util
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_jax.base._errors import MappingError
from ucp_jax.parallel import _pattern_flat as pf
from ucp_jax.parallel import _pattern_rules as pr
from ucp_jax.parallel import _patterns as pt

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _x(*shape, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _autotp_widths(size: int, degree: int) -> list[int]:
  """DeepSpeed AutoTP's uneven split: the first `size % degree` ranks get one more."""
  return [size // degree + (r < size % degree) for r in range(degree)]


@st.composite
def _cases(draw):
  """(pattern, logical shape, degree) for every kind, with even and uneven widths."""
  kind = draw(st.sampled_from(pt.KINDS))
  degree = draw(st.integers(1, 4))
  other = draw(st.integers(1, 3))
  if kind in ("replicated", "average"):
    return pt.Pattern(kind), (draw(st.integers(1, 5)), other), degree, None
  if kind == "sub_params":
    sizes = tuple(degree * draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3))))
    return pt.sub_params(sizes), (sum(sizes), other), degree, None
  if kind == "expert":
    n = degree * draw(st.integers(1, 3))
    return pt.expert(n), (n, other, 2), degree, None
  size = draw(st.integers(degree, 9))
  widths = None if size % degree == 0 else [_autotp_widths(size, degree)]
  shape = (size, other) if kind == "column" else (other, size)
  return pt.Pattern(kind), shape, degree, widths


@settings(max_examples=150, deadline=None)
@given(case=_cases(), vocab=st.booleans())
def test_split_then_merge_is_identity(case, vocab):
  pattern, shape, degree, widths = case
  if vocab and pattern.kind in ("column", "replicated") and widths is None:
    pattern = pt.Pattern(pattern.kind, vocab_size=shape[0])
  x = _x(*shape)
  frags = pt.split(x, degree, pattern, widths=widths)
  assert len(frags) == degree
  assert [f.shape for f in frags] == list(
    pt.layout(pattern, shape, degree, widths=widths).fragment_shapes
  )
  if pattern.kind == "average":  # (x + x + x) / 3 rounds
    np.testing.assert_allclose(pt.merge(frags, pattern), x, rtol=1e-6)
  else:
    np.testing.assert_array_equal(pt.merge(frags, pattern), x)
  if pattern.kind not in ("replicated", "average"):  # every element in exactly one fragment
    assert (
      sum(f.size for f in frags)
      == pt.layout(pattern, shape, degree, widths=widths).padded_shape[0] * x[0].size
    )


def test_column_and_row_concatenate():
  x = _x(6, 4)
  c = pt.split(x, 2, pt.column())
  np.testing.assert_array_equal(c[1], x[3:])
  r = pt.split(x, 2, pt.row())
  np.testing.assert_array_equal(r[1], x[:, 2:])
  np.testing.assert_array_equal(pt.merge([x[:4], x[4:]], pt.column()), x)  # uneven: from shapes


def test_swiglu_fragments_hold_gate_and_up_pieces():
  gate, up = _x(8, 3, seed=1), _x(8, 3, seed=2)
  logical = np.concatenate([gate, up])
  frags = pt.split(logical, 2, pt.sub_params(2))
  np.testing.assert_array_equal(frags[0], np.concatenate([gate[:4], up[:4]]))
  np.testing.assert_array_equal(frags[1], np.concatenate([gate[4:], up[4:]]))
  np.testing.assert_array_equal(pt.merge(frags, pt.sub_params(2)), logical)
  # the same checkpoint re-split for TP=4
  four = pt.split(logical, 4, pt.sub_params(2))
  np.testing.assert_array_equal(four[3], np.concatenate([gate[6:], up[6:]]))


def test_gqa_fused_qkv_with_uneven_widths():
  # 4 query heads and 1 kv head of size 2 on TP=2: the kv head goes to rank 0 only
  q, k, v = _x(8, 3, seed=1), _x(2, 3, seed=2), _x(2, 3, seed=3)
  logical = np.concatenate([q, k, v])
  pattern = pt.sub_params((8, 2, 2), shard_widths=((4, 4), (2, 0), (2, 0)))
  frags = pt.split(logical, 2, pattern)
  np.testing.assert_array_equal(frags[0], np.concatenate([q[:4], k, v]))
  np.testing.assert_array_equal(frags[1], q[4:])
  np.testing.assert_array_equal(pt.merge(frags, pattern), logical)
  # at TP=1 the widths recorded for TP=2 do not apply: the whole array
  np.testing.assert_array_equal(pt.split(logical, 1, pattern)[0], logical)
  with pytest.raises(MappingError, match=r"size 2 does not split evenly over 4 ranks"):
    pt.split(logical, 4, pattern)


def test_vocab_padding_is_stripped_and_restored():
  x = _x(5, 3)
  pattern = pt.column(vocab_size=5)
  frags = pt.split(x, 2, pattern, padded_size=8)
  assert [f.shape for f in frags] == [(4, 3), (4, 3)]
  np.testing.assert_array_equal(frags[1][1:], 0)
  np.testing.assert_array_equal(pt.merge(frags, pattern), x)
  assert [f.shape for f in pt.split(x, 2, pattern)] == [(3, 3), (3, 3)]  # next multiple of 2
  assert pt.padded_vocab(50257, 2, 128) == 50432


def test_replicated_divergence_names_the_max_difference():
  a = _x(3, 2)
  b = a.copy()
  b[2, 1] += 0.5
  b[0, 0] += 0.25
  with pytest.raises(MappingError) as e:
    pt.merge([a, a, b], pt.replicated(), name="ln.weight")
  assert str(e.value) == (
    "`ln.weight`: replicated copies diverge (tolerance 0.0):\n"
    "  copy 2 differs from copy 0 in 2 elements, max |difference| 0.5 at index (2, 1)\n"
    "Classify it as `average` if the copies are meant to differ."
  )
  np.testing.assert_array_equal(pt.merge([a, b], pt.replicated(), atol=0.5), a)


def test_average_and_its_split():
  a, b = _x(4, seed=1), _x(4, seed=2)
  np.testing.assert_array_equal(pt.merge([a, b], pt.average()), (a + b) / 2)
  assert all(np.shares_memory(f, a) for f in pt.split(a, 3, pt.average()))


def test_experts_per_rank_and_per_expert():
  w = _x(4, 3, 2)
  ranks = pt.split(w, 2, pt.expert(4))
  np.testing.assert_array_equal(ranks[1], w[2:])
  np.testing.assert_array_equal(pt.merge(ranks, pt.expert(4)), w)
  per = pt.split(w, 4, pt.expert(4), per_expert=True)
  assert per[3].shape == (3, 2)
  np.testing.assert_array_equal(pt.merge(per, pt.expert(4), per_expert=True), w)


def test_tied_pipeline_copies():
  e = _x(6, 2)
  np.testing.assert_array_equal(pt.merge_stage_copies({0: e, 1: e.copy()}, name="embed"), e)
  with pytest.raises(
    MappingError, match=r"(?s)`embed`: replicated copies diverge.*stages \[0, 1\]"
  ):
    pt.merge_stage_copies({0: e, 1: e + 1}, name="embed")


def test_merge_misfits_say_why():
  with pytest.raises(MappingError, match=r"`w`: fragments .* differ outside the cat dim 0"):
    pt.merge([_x(2, 3), _x(2, 4)], pt.column(), name="w")
  with pytest.raises(MappingError) as e:
    pt.merge([_x(5, 2), _x(3, 2)], pt.sub_params(2), name="w")
  assert str(e.value) == (
    "`w`: fragments do not fit the pattern {'kind': 'sub_params', 'cat_dim': 0, 'sub_params': 2}:\n"
    "  rank 0 holds (5, 2), expected (4, 2)\n"
    "  rank 1 holds (3, 2), expected (4, 2)"
  )
  with pytest.raises(
    MappingError, match=r"sub-parameter sizes \[4, 4\] sum to 8, but dimension 0 has size 6"
  ):
    pt.merge([_x(3, 2), _x(3, 2)], pt.sub_params((4, 4)), name="w")


def test_pattern_json_round_trip():
  for p in [
    pt.row(),
    pt.column(vocab_size=7),
    pt.sub_params((4, 2, 2), shard_widths=[[2, 2], [1, 1], [1, 1]]),
    pt.expert(8),
    pt.replicated(),
  ]:
    assert pt.Pattern.from_json(p.to_json()) == p
  assert pt.sub_params(2).resolved((10, 3)).sub_params == (5, 5)
  assert pt.row().to_json() == {"kind": "row", "cat_dim": 1}


AUTOTP_INFO = {  # as DeepSpeed AutoTP writes it (tests/fixtures/tp/autotp_tp2_dp1)
  "universal_checkpoint_version": 0.4,
  "parameter_with_row_parallelism_patterns": [r"^layers\.0\.o_proj\.weight$"],
  "tp_replicated_parameter_patterns": [r"^norm\.weight$"],
  "vocabulary_parameter_patterns": [r"^lm_head\.weight$"],
  "parameter_with_sub_params": [
    {"patterns": [r"^layers\.0\.qkv\.weight$"], "shape": [(8, 4, 4), -1], "partition_dim": 0},
  ],
  "sub_param_shard_widths": {r"^layers\.0\.qkv\.weight$": [[4, 4], [2, 2], [2, 2]]},
  "original_vocab_size": 50,
}


def test_classify_from_universal_info():
  names = [
    "layers.0.o_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "layers.0.qkv.weight",
    "layers.0.up.weight",
  ]
  got = pr.classify(names, info=AUTOTP_INFO)
  assert got == {
    "layers.0.o_proj.weight": pt.row(),
    "norm.weight": pt.replicated(),
    "lm_head.weight": pt.column(vocab_size=50),
    "layers.0.qkv.weight": pt.sub_params((8, 4, 4), shard_widths=[[4, 4], [2, 2], [2, 2]]),
    "layers.0.up.weight": pt.column(),
  }
  # user rules override the checkpoint's
  assert pr.classify(["norm.weight"], info=AUTOTP_INFO, rules=[(r"norm", "average")]) == {
    "norm.weight": pt.average()
  }


def test_classify_lists_every_unclaimed_and_ambiguous_name():
  rules = [(r".*\.weight$", "column"), (r"b\.", "row"), (r"zzz", "row")]
  with pytest.raises(MappingError) as e:
    pr.classify(
      ["a.weight", "b.weight", "c.bias", "d.bias"],
      rules=rules,
      default=None,
      where="ckpt/global_step3",
    )
  assert str(e.value) == (
    "ckpt/global_step3: cannot assign a parallel layout pattern to every parameter.\n"
    "parameters matched by two rules:\n"
    "  b.weight: matched by '.*\\\\.weight$', 'b\\\\.'\n"
    "parameters no rule claims:\n"
    "  c.bias\n"
    "  d.bias\n"
    "rules that claim nothing:\n"
    "  'zzz' (user rule) matches no parameter\n"
    "Pass rules=[(regex, pattern), ...] to say how these parameters are split."
  )


# --- DeepSpeed as the oracle: its own merge (ds_to_universal.merge_tp_slices) on our splits ---


def _deepspeed_merge(tmp_path, name, frags, info):
  import torch
  from deepspeed.checkpoint import ds_to_universal as d2u

  slices = tmp_path / "slices"
  for tp, f in enumerate(frags):
    d = slices / name / str(tp)
    d.mkdir(parents=True, exist_ok=True)
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
      torch.save(torch.from_numpy(np.ascontiguousarray(f).reshape(-1)), d / f"{state}.00")
  out = tmp_path / "zero"
  shapes = [tuple(f.shape) for f in frags]
  d2u.merge_tp_slices(info, str(out), str(slices), len(frags), (name, shapes))
  return torch.load(out / name / "fp32.pt", weights_only=False)


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
@pytest.mark.parametrize(
  "pattern,info,shape",
  [
    (pt.column(), {}, (6, 3)),
    (pt.row(), {pr.UC_ROW: ["^w$"]}, (3, 6)),
    (pt.replicated(), {pr.UC_REPLICATED: ["^w$"]}, (5,)),
    (pt.average(), {pr.UC_AVERAGE: ["^w$"]}, (5,)),
    (pt.sub_params(2), {pr.UC_TWO_SUB: ["^w$"]}, (8, 3)),
    (pt.column(vocab_size=7), {pr.UC_VOCAB: ["^w$"], pr.UC_ORIGINAL_VOCAB: 7}, (7, 3)),
    (
      pt.sub_params((8, 2, 2), shard_widths=((4, 4), (2, 0), (2, 0))),
      {
        pr.UC_VERSION: 0.4,
        pr.UC_SUB: [{"patterns": ["^w$"], "shape": [(8, 2, 2), -1], "partition_dim": 0}],
        pr.UC_SUB_WIDTHS: {"^w$": [[4, 4], [2, 0], [2, 0]]},
      },
      (12, 3),
    ),
  ],
)
def test_deepspeed_merges_our_fragments_the_same(tmp_path, pattern, info, shape):
  assert pr.classify(["w"], info=info) == {"w": pattern}
  x = _x(*shape)
  frags = pt.split(x, 2, pattern)
  if pattern.kind == "average":
    frags = [frags[0], _x(*shape, seed=5)]
  got = _deepspeed_merge(tmp_path, "w", frags, info)
  np.testing.assert_array_equal(got["param"].numpy(), pt.merge(frags, pattern))
  if pattern.kind in ("column", "row"):
    assert got["cat_dim"] == pattern.cat_dim


def test_rule_regexes_use_match_semantics():
  # re.match, as DeepSpeed: "norm" does not claim "x.norm.weight"
  with pytest.raises(MappingError, match=re.escape("'norm' (user rule) matches no parameter")):
    pr.classify(["x.norm.weight"], rules=[("norm", "replicated")])
  assert pr.classify(["x.norm.weight"], rules=[(r".*norm", "replicated")]) == {
    "x.norm.weight": pt.replicated()
  }


@settings(max_examples=150, deadline=None)
@given(case=_cases(), vocab=st.booleans(), data=st.data())
def test_merge_flat_equals_merge_for_any_zero_cut(case, vocab, data):
  # fragments cut into flat pieces anywhere (ZeRO partitions) merge like whole fragments
  pattern, shape, degree, widths = case
  if vocab and pattern.kind in ("column", "replicated") and widths is None:
    pattern = pt.Pattern(pattern.kind, vocab_size=shape[0])
  x = _x(*shape)
  frags = pt.split(x, degree, pattern, widths=widths)
  shards = []
  for f in frags:
    flat = np.ascontiguousarray(f).reshape(-1)
    cuts = sorted(data.draw(st.lists(st.integers(0, flat.size), max_size=4)))
    shards.append(np.split(flat, cuts))
  got = pf.merge_flat(shards, [f.shape for f in frags], pattern)
  if isinstance(got, list):
    got = np.concatenate(got).reshape(frags[0].shape)[: shape[0]]
  want = pt.merge(frags, pattern)
  np.testing.assert_array_equal(got, want)


def test_merge_flat_reports_replicated_divergence():
  a = _x(4, 3)
  b = a.copy()
  b[3, 2] = 7.0
  with pytest.raises(MappingError, match=r"copy 1 differs from copy 0 in 1 elements"):
    pf.merge_flat(
      [[a.reshape(-1)[:5], a.reshape(-1)[5:]], [b.reshape(-1)]],
      [(4, 3)] * 2,
      pt.replicated(),
      name="n",
    )
