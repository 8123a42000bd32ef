#!/usr/bin/env python
"""Generate Megatron-DeepSpeed-style tensor-parallel checkpoints from a known logical state.

Megatron-DeepSpeed builds every layer from its TP rank's slice of the weights and hands DeepSpeed
an ``mpu``; the patterns it declares in ``universal_checkpoint_info`` are those AutoTP does not
produce on CPU: a padded vocabulary (``VocabParallelEmbedding`` and the output layer, padded to a
multiple of ``make_vocab_size_divisible_by * tp``), SwiGLU ``dense_h_to_4h`` with each rank
holding ``[gate_k; up_k]`` (``parameter_with_2_sub_params_cat_dim_0``), fused QKV with grouped-
query attention, each rank holding ``[q_k; k_k; v_k]`` (``parameter_with_sub_params``, the
pre-0.4 ``SubparamShape`` without widths), row-parallel biases whose TP copies differ
(``parameter_to_average_patterns``), replicated layer norms, and native DeepSpeed MoE experts in
per-expert files (``layer_{L}_expert_{E}_mp_rank_{TP}_model_states.pt``).

The script does the same on CPU with real DeepSpeed (ZeRO-1, fp32, 2 gloo ranks, TP=2 through
a small ``mpu``): each rank's module holds the slices of ``logical_state()`` cut here by hand in
Megatron's layout, the gradient of every parameter is the same slicing of ``logical_grads()``
(loss = sum(param * grad)), and one AdamW step with lr 0 leaves the fp32 weights unchanged and
sets ``exp_avg = (1 - beta1) * grad``, ``exp_avg_sq = (1 - beta2) * grad**2``. So the expected
universal checkpoint is known exactly; ``ds_to_universal`` runs on the files as well (it does
not read native MoE experts: they are values only, written by this script). Output::

  <out>/megatron_tp2/ckpt/global_step1/   mp_rank_0X + zero_pp_rank_0_mp_rank_0X + expert files
  <out>/megatron_tp2/universal/           ds_to_universal output
  <out>/megatron_tp2/info.json

``logical_state()``/``logical_grads()`` need only numpy, so tests recompute the known state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ds_launch import dir_size, ds_to_universal, init_rank, install_fixture, launch_ranks

REPO_ROOT = Path(__file__).resolve().parents[1]
NAME = "megatron_tp2"
TP = 2
SEED = 99
VOCAB, DIVISIBLE_BY = 50, 4  # padded to 56 at TP=2
HIDDEN, HEADS, KV_HEADS = 16, 4, 2
HEAD_DIM = HIDDEN // HEADS
FFN = 24
LAYERS = 2
NUM_EXPERTS, EP = 4, 2
BETAS = (0.9, 0.999)
PREFIX = "language_model.encoder.layers"
MOE = "mlp.deepspeed_moe.experts.deepspeed_experts"


def padded_vocab() -> int:
  step = DIVISIBLE_BY * TP
  return -(-VOCAB // step) * step


def universal_checkpoint_info() -> dict:
  """What Megatron-DeepSpeed's GPT model declares for this configuration."""
  kv = KV_HEADS * HEAD_DIM
  return {
    "universal_checkpoint_version": 0.2,
    "vocabulary_parameter_patterns": [
      r"language_model\.embedding\.word_embeddings\.weight",
      r"language_model\.output_layer\.weight",
    ],
    "original_vocab_size": VOCAB,
    "padded_vocab_size": padded_vocab(),
    "tp_replicated_parameter_patterns": [
      r".*layers\.\d+\.\w+_layernorm\.(weight|bias)$",
      r"language_model\.encoder\.final_layernorm\..*",
    ],
    "parameter_to_average_patterns": [r".*self_attention\.dense\.bias$", r".*dense_4h_to_h\.bias$"],
    "parameter_with_row_parallelism_patterns": [
      r".*self_attention\.dense\.weight$",
      r".*dense_4h_to_h\.weight$",
    ],
    "parameter_with_2_sub_params_cat_dim_0": [r".*dense_h_to_4h\.weight$"],
    "parameter_with_sub_params": [
      {
        "patterns": [r".*self_attention\.query_key_value\.weight$"],
        "shape": ((HIDDEN, kv, kv), HIDDEN),  # tuples, as asdict(SubparamShape(...)) gives
        "partition_dim": 0,
      }
    ],
  }


def _shapes() -> dict[str, tuple[int, ...]]:
  kv = KV_HEADS * HEAD_DIM
  out = {"language_model.embedding.word_embeddings.weight": (VOCAB, HIDDEN)}
  for i in range(LAYERS):
    p = f"{PREFIX}.{i}"
    out |= {
      f"{p}.input_layernorm.weight": (HIDDEN,),
      f"{p}.input_layernorm.bias": (HIDDEN,),
      f"{p}.self_attention.query_key_value.weight": (HIDDEN + 2 * kv, HIDDEN),
      f"{p}.self_attention.dense.weight": (HIDDEN, HIDDEN),
      f"{p}.self_attention.dense.bias": (HIDDEN,),
      f"{p}.post_attention_layernorm.weight": (HIDDEN,),
      f"{p}.mlp.dense_h_to_4h.weight": (2 * FFN, HIDDEN),
      f"{p}.mlp.dense_4h_to_h.weight": (HIDDEN, FFN),
      f"{p}.mlp.dense_4h_to_h.bias": (HIDDEN,),
    }
  out |= {"language_model.encoder.final_layernorm.weight": (HIDDEN,)}
  out |= {"language_model.output_layer.weight": (VOCAB, HIDDEN)}
  return out


def expert_shapes() -> dict[str, tuple[int, ...]]:
  """Logical (stacked) expert arrays: `{layer}.{MOE}.{w}` -> [NUM_EXPERTS, ...]."""
  p = f"{PREFIX}.1.{MOE}"
  return {
    f"{p}.dense_h_to_4h.weight": (NUM_EXPERTS, FFN, HIDDEN),
    f"{p}.dense_4h_to_h.weight": (NUM_EXPERTS, HIDDEN, FFN),
  }


def logical_state() -> dict[str, np.ndarray]:
  """The known logical fp32 weights (averaged parameters: the mean of the two TP copies)."""
  rng = np.random.default_rng(SEED)
  state = {n: rng.standard_normal(s).astype(np.float32) for n, s in _shapes().items()}
  state |= {n: rng.standard_normal(s).astype(np.float32) for n, s in expert_shapes().items()}
  return state


def average_copies() -> dict[str, list[np.ndarray]]:
  """The two TP ranks' diverging copies of each averaged bias (their mean is logical)."""
  rng = np.random.default_rng(SEED + 1)
  out = {}
  logical = logical_state()
  for n in _shapes():
    if n.endswith("self_attention.dense.bias") or n.endswith("dense_4h_to_h.bias"):
      delta = rng.standard_normal(logical[n].shape).astype(np.float32) * np.float32(0.25)
      out[n] = [logical[n] + delta, logical[n] - delta]
  return out


def logical_grads() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(SEED + 2)
  return {n: rng.standard_normal(s).astype(np.float32) for n, s in _shapes().items()}


def megatron_slice(name: str, x: np.ndarray, rank: int, *, pad_value: float = 0.0) -> np.ndarray:
  """Rank `rank`'s slice of logical array `x` of parameter `name`, as Megatron lays it out."""
  if "word_embeddings" in name or "output_layer" in name:
    rows = padded_vocab() // TP
    padded = np.full((padded_vocab(), x.shape[1]), pad_value, x.dtype)
    padded[: x.shape[0]] = x
    return padded[rank * rows : (rank + 1) * rows]
  if "query_key_value" in name:
    kv = KV_HEADS * HEAD_DIM
    q, k, v = x[:HIDDEN], x[HIDDEN : HIDDEN + kv], x[HIDDEN + kv :]
    return np.concatenate([np.split(t, TP)[rank] for t in (q, k, v)])
  if "dense_h_to_4h" in name:
    gate, up = np.split(x, 2)
    return np.concatenate([np.split(gate, TP)[rank], np.split(up, TP)[rank]])
  if name.endswith("dense.weight") or name.endswith("dense_4h_to_h.weight"):
    return np.split(x, TP, axis=1)[rank]
  return x  # layer norms and the averaged biases: the whole array


# --------------------------------------------------------------------------------------------
# Worker


class _Mpu:
  """The part of Megatron's mpu DeepSpeed asks for: TP groups of `TP` adjacent ranks."""

  def __init__(self, dist) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    self.tp_rank, self.dp_rank = rank % TP, rank // TP
    self.dp_size = world // TP
    self.tp_group = self.dp_group = None
    for start in range(0, world, TP):
      g = dist.new_group(list(range(start, start + TP)))
      if rank // TP == start // TP:
        self.tp_group = g
    for r in range(TP):
      g = dist.new_group(list(range(r, world, TP)))
      if rank % TP == r:
        self.dp_group = g

  def get_model_parallel_rank(self):
    return self.tp_rank

  def get_model_parallel_world_size(self):
    return TP

  def get_model_parallel_group(self):
    return self.tp_group

  get_tensor_model_parallel_rank = get_model_parallel_rank
  get_tensor_model_parallel_world_size = get_model_parallel_world_size
  get_tensor_model_parallel_group = get_model_parallel_group

  def get_data_parallel_rank(self):
    return self.dp_rank

  def get_data_parallel_world_size(self):
    return self.dp_size

  def get_data_parallel_group(self):
    return self.dp_group


def worker(ckpt_dir: str) -> None:
  torch, deepspeed = init_rank()
  import deepspeed.comm as dist

  deepspeed.init_distributed(dist_backend="gloo")
  mpu = _Mpu(dist)
  rank = mpu.tp_rank
  state, grads, copies = logical_state(), logical_grads(), average_copies()
  rng = np.random.default_rng(SEED + 10)
  pad = {
    n: rng.standard_normal((padded_vocab() - VOCAB, HIDDEN)).astype(np.float32)
    for n in state
    if "word_embeddings" in n or "output_layer" in n
  }

  class Local(torch.nn.Module):
    """Megatron's parameter names on nested modules; each holds this rank's slice."""

    def __init__(self) -> None:
      super().__init__()
      self.names = list(_shapes())
      for n in self.names:
        x = megatron_slice(n, state[n], rank)
        if n in copies:  # averaged parameters: the TP copies differ, their mean is logical
          x = copies[n][rank]
        if n in pad:  # Megatron initializes the padded rows like the others
          full = np.concatenate([state[n], pad[n]])
          x = full[rank * (padded_vocab() // TP) : (rank + 1) * (padded_vocab() // TP)]
        *path, leaf = n.split(".")
        module = self
        for part in path:
          if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
          module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.from_numpy(x.copy())))

    def forward(self):
      params = dict(self.named_parameters())
      loss = 0.0
      for n in self.names:
        g = megatron_slice(n, grads[n], rank)
        loss = loss + (params[n] * torch.from_numpy(g.copy())).sum()
      return loss

  model = Local()
  config = {
    "train_micro_batch_size_per_gpu": 1,
    "steps_per_print": 1_000_000,
    "gradient_clipping": 0.0,  # the moments must be those of the known gradients
    "optimizer": {
      "type": "AdamW",
      "params": {"torch_adam": True, "lr": 0.0, "betas": list(BETAS), "weight_decay": 0.0},
    },
    "zero_optimization": {"stage": 1},
  }
  engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=list(model.parameters()), config=config, mpu=mpu
  )
  loss = engine()
  engine.backward(loss)
  engine.step()
  engine.save_checkpoint(
    ckpt_dir,
    client_state={"universal_checkpoint_info": universal_checkpoint_info(), "iteration": 1},
  )
  if mpu.dp_rank == 0:  # native MoE: one file per expert and TP rank, values only
    tag = os.path.join(ckpt_dir, f"global_step{engine.global_steps}")
    for name, x in logical_state().items():
      if MOE not in name:
        continue
      for e in range(NUM_EXPERTS):
        key = name.replace(f"{MOE}.", f"{MOE}.{e}.")
        path = os.path.join(tag, f"layer_0_expert_{e}_mp_rank_{rank:02d}_model_states.pt")
        sd = torch.load(path, weights_only=True) if os.path.exists(path) else {}
        sd[key] = torch.from_numpy(x[e].copy())
        torch.save(sd, path)
  dist.barrier()


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--out",
    type=Path,
    help="output folder (the committed fixtures: tests/fixtures/tp)",
  )
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    worker(args.worker)
    return 0
  if args.out is None:
    parser.error("--out is required (tests/fixtures/tp for the committed fixtures)")
  dest = args.out / NAME
  with tempfile.TemporaryDirectory(prefix="megfix_") as tmp:
    tmp_path = Path(tmp)
    ckpt = tmp_path / "ckpt"
    try:
      launch_ranks(TP, [sys.executable, __file__, "--worker", str(ckpt)], tmp_path, what=NAME)
    except RuntimeError as e:
      print(e)
      return 1
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
      (ckpt / script).unlink(missing_ok=True)
    tag = (ckpt / "latest").read_text().strip()
    universal = tmp_path / "universal"
    try:
      ds_to_universal(ckpt / tag, universal)
    except RuntimeError as e:
      print(e)
      return 1
    install_fixture(dest, ckpt, universal)
    info = {
      "name": NAME,
      "tp": TP,
      "dp": 1,
      "tag": tag,
      "seed": SEED,
      "betas": list(BETAS),
      "vocab": VOCAB,
      "padded_vocab": padded_vocab(),
      "num_experts": NUM_EXPERTS,
      "ep": EP,
      "universal_checkpoint_info": universal_checkpoint_info(),
      "logical_shapes": {n: list(s) for n, s in (_shapes() | expert_shapes()).items()},
      "ds_to_universal": "python -m deepspeed.checkpoint.ds_to_universal --input_folder "
      f"ckpt/{tag} --output_folder universal",
      "files": sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()),
    }
    (dest / "info.json").write_text(json.dumps(info, indent=1) + "\n")
  print(f"{NAME}: {dir_size(dest) / 1024:.1f} KiB")
  return 0


if __name__ == "__main__":
  sys.exit(main())
