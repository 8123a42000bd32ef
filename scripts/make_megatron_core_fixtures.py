#!/usr/bin/env python
"""Megatron-core checkpoints written by megatron-core itself, on CPU, as Megatron-LM writes them.

Each variant trains a tiny Llama-style `GPTModel` (the local layer spec: GQA, SwiGLU, RMSNorm,
RoPE, untied output layer) for two steps on 4 gloo ranks (TP 2 x DP 2) with Megatron's own
`DistributedDataParallel`, `get_megatron_optimizer` and `OptimizerParamScheduler`, then saves it
with `dist_checkpointing.save` in Megatron-LM's folder layout and state dict (the megatron-core
wheel lacks `megatron/training`; `generate_state_dict` and `save_checkpoint` are followed here):

  <out>/<variant>/latest_checkpointed_iteration.txt       "2"
  <out>/<variant>/iter_0000002/                           the torch_dist checkpoint
  <out>/<variant>/expected.npz                            the logical state (below)
  <out>/<variant>/logits.npz                              Megatron's logits for fixed tokens
  <out>/<variant>/info.json                               what the variant is, and the losses
                                                          of two more steps after the save

Variants: the distributed optimizer in its two formats (`dp_reshardable`, Megatron-LM's default,
and `fully_reshardable`) and the plain optimizer, in fp32 and bf16.

`expected.npz` is the oracle, assembled from Megatron's own sharded state dicts (not from the
files): every model tensor under its checkpoint key (layers stacked), and every optimizer
tensor in the per-parameter form `optimizer.state.<slot>.<key>`: for the distributed optimizer
Megatron's `fully_reshardable` gather gives it, whatever format the files use.

megatron-core installs with `pip install --no-deps --ignore-requires-python megatron-core==0.19.2
psutil triton` (its cp311 wheels run on 3.11; it imports triton). On a CPU-only torch a training
step needs these stand-ins for CUDA, installed by `cpu_stand_ins()` and nothing else:

- `torch.cuda.current_device()` names the device of DDP's buffers: "cpu".
- `torch.cuda.current_stream()` is waited on before a gradient reduction: a stream that waits
  on nothing.
- `torch.cuda.synchronize()` before the checkpoint writer copies tensors: nothing to wait for.
- Tensor factories called with `device="cuda"` (the optimizer's overflow flag, DDP's buffers)
  make CPU tensors.
- `Tensor.cuda()` moves the distributed optimizer's buffers before a gather: they stay.
- `Tensor.type()` is compared with "torch.cuda.FloatTensor" when the optimizer sorts parameters
  by precision: it reports the CUDA name of the same precision.
- The RNG tracker is Megatron's inference tracker (`initialize_rng_tracker(inference_rng_tracker
  =True)`, no CUDA RNG), with dropout 0; `cuda_rng_state` in the saved RNG state holds the CPU
  generator's state.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
TP, DP = 2, 2
ITERATION = 2
CONTINUED = 2  # steps trained after the save, for tests that resume from it
SIZES = {"vocab": 60, "hidden": 16, "heads": 4, "groups": 2, "ffn": 24, "layers": 2, "seq": 8}
SIZES.update(json.loads(os.environ.get("UCP_MEGATRON_SIZES") or "{}"))  # larger models: --sizes
VOCAB, DIVISIBLE_BY = SIZES["vocab"], 16  # 60 is padded to 64 at TP 2, as Megatron-LM pads
HIDDEN, HEADS, GROUPS, FFN = SIZES["hidden"], SIZES["heads"], SIZES["groups"], SIZES["ffn"]
LAYERS, SEQ = SIZES["layers"], SIZES["seq"]
LR, WEIGHT_DECAY, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8

VARIANTS = {
  # name: (use_distributed_optimizer, distrib_optim_sharding_type, bf16)
  "distopt_dp_reshardable": (True, "dp_reshardable", False),
  "distopt_fully_reshardable_bf16": (True, "fully_reshardable", True),
  "adam": (False, None, False),
  "adam_bf16": (False, None, True),
}


def padded_vocab() -> int:
  step = DIVISIBLE_BY * TP
  return -(-VOCAB // step) * step


def cpu_stand_ins() -> None:
  """The CUDA calls a megatron-core training step makes, answered on the CPU (module doc)."""
  import torch

  class NoStream:
    def wait_event(self, event):
      pass

    def wait_stream(self, stream):
      pass

  torch.cuda.current_device = lambda: "cpu"
  torch.cuda.current_stream = lambda *a, **k: NoStream()
  torch.cuda.synchronize = lambda *a, **k: None

  def on_cpu(factory):
    @functools.wraps(factory)
    def made(*args, **kwargs):
      if str(kwargs.get("device", "")).startswith("cuda"):
        kwargs["device"] = "cpu"
      return factory(*args, **kwargs)

    return made

  for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like"):
    setattr(torch, name, on_cpu(getattr(torch, name)))
  type_name = torch.Tensor.type

  def cuda_type_name(self, *args, **kwargs):
    if args or kwargs:
      return type_name(self, *args, **kwargs)
    return type_name(self).replace("torch.", "torch.cuda.", 1)

  torch.Tensor.type = cuda_type_name
  torch.Tensor.cuda = lambda self, *args, **kwargs: self


def megatron_args(distopt: bool, sharding: str | None, bf16: bool) -> argparse.Namespace:
  """The `args` Megatron-LM saves: the fields its checkpoint loading and converters read."""
  return argparse.Namespace(
    num_layers=LAYERS,
    hidden_size=HIDDEN,
    ffn_hidden_size=FFN,
    num_attention_heads=HEADS,
    group_query_attention=True,
    num_query_groups=GROUPS,
    kv_channels=HIDDEN // HEADS,
    max_position_embeddings=SEQ * 4,
    seq_length=SEQ,
    vocab_size=VOCAB,
    padded_vocab_size=padded_vocab(),
    make_vocab_size_divisible_by=DIVISIBLE_BY,
    normalization="RMSNorm",
    norm_epsilon=1e-5,
    swiglu=True,
    add_bias_linear=False,
    add_qkv_bias=False,
    position_embedding_type="rope",
    rotary_base=10000,
    rotary_percent=1.0,
    untie_embeddings_and_output_weights=True,
    tensor_model_parallel_size=TP,
    pipeline_model_parallel_size=1,
    context_parallel_size=1,
    expert_model_parallel_size=1,
    data_parallel_size=DP,
    world_size=TP * DP,
    transformer_impl="local",
    use_distributed_optimizer=distopt,
    dist_ckpt_optim_fully_reshardable=sharding == "fully_reshardable",
    ckpt_format="torch_dist",
    optimizer="adam",
    lr=LR,
    min_lr=LR / 10,
    weight_decay=WEIGHT_DECAY,
    adam_beta1=BETAS[0],
    adam_beta2=BETAS[1],
    adam_eps=EPS,
    clip_grad=0.0,
    bf16=bf16,
    fp16=False,
    params_dtype="torch.bfloat16" if bf16 else "torch.float32",
    micro_batch_size=2,
    global_batch_size=2 * DP,
    train_iters=10,
    iteration=ITERATION,
    consumed_train_samples=ITERATION * 2 * DP,
    seed=1234,
  )


def assemble(sharded: dict, group=None) -> dict[str, np.ndarray]:
  """The global tensors of every main-replica `ShardedTensor` in `sharded`, on rank 0."""
  import torch
  import torch.distributed as dist
  from megatron.core.dist_checkpointing.dict_utils import nested_values
  from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

  apply_factories(sharded)  # SwiGLU's fc1: its gate and up halves
  pieces = []
  for item in nested_values(sharded):
    if not isinstance(item, ShardedTensor):
      continue
    if any(r != 0 for r in np.atleast_1d(np.asarray(item.replica_id, dtype=object)).tolist()):
      continue
    assert item.flattened_range is None, item.key
    local = item.data.detach().to(torch.float32).numpy()
    local = local.reshape((1,) * item.prepend_axis_num + local.shape)
    pieces.append((item.key, item.global_shape, item.global_offset, local, str(item.dtype)))
  everyone = [None] * dist.get_world_size()
  dist.all_gather_object(everyone, pieces)
  out: dict[str, np.ndarray] = {}
  filled: dict[str, int] = {}
  for key, shape, offset, local, _ in (p for rank in everyone for p in rank):
    whole = out.setdefault(key, np.full(shape, np.nan, np.float32))
    index = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
    whole[index] = local
    filled[key] = filled.get(key, 0) + local.size
  for key, whole in out.items():
    assert filled[key] == whole.size and not np.isnan(whole).any(), key
  return out


def build(distopt: bool, bf16: bool, tp: int):
  """Megatron's GPT (this script's sizes), DDP, optimizer and scheduler, on initialized gloo
  ranks split `tp` ways: (ddp, optimizer, scheduler)."""
  import torch
  from megatron.core import parallel_state as ps
  from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
  from megatron.core.models.gpt import GPTModel
  from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
  from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
  from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
  from megatron.core.tensor_parallel.random import initialize_rng_tracker
  from megatron.core.transformer import TransformerConfig

  ps.initialize_model_parallel(tensor_model_parallel_size=tp)
  initialize_rng_tracker(inference_rng_tracker=True)
  torch.manual_seed(1234)
  dtype = torch.bfloat16 if bf16 else torch.float32
  config = TransformerConfig(
    num_layers=LAYERS,
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    num_query_groups=GROUPS,
    ffn_hidden_size=FFN,
    gated_linear_unit=True,
    activation_func=torch.nn.functional.silu,
    normalization="RMSNorm",
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_cpu_initialization=True,
    bf16=bf16,
    params_dtype=dtype,
    pipeline_dtype=dtype,
    tensor_model_parallel_size=tp,
  )
  model = GPTModel(
    config=config,
    transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
    vocab_size=padded_vocab(),
    max_sequence_length=SEQ * 4,
    position_embedding_type="rope",
    share_embeddings_and_output_weights=False,
  )
  if bf16:  # as Megatron-LM's get_model: the whole model in bf16, norms included
    from megatron.core.transformer.module import Float16Module

    model = Float16Module(config, model)
  ddp = DistributedDataParallel(
    config,
    DistributedDataParallelConfig(use_distributed_optimizer=distopt, grad_reduce_in_fp32=True),
    model,
  )
  optimizer = get_megatron_optimizer(
    OptimizerConfig(
      optimizer="adam",
      lr=LR,
      min_lr=LR / 10,
      weight_decay=WEIGHT_DECAY,
      adam_beta1=BETAS[0],
      adam_beta2=BETAS[1],
      adam_eps=EPS,
      bf16=bf16,
      params_dtype=dtype,
      use_distributed_optimizer=distopt,
      clip_grad=0.0,
    ),
    [ddp],
  )
  scheduler = OptimizerParamScheduler(
    optimizer,
    init_lr=0.0,
    max_lr=LR,
    min_lr=LR / 10,
    lr_warmup_steps=1,
    lr_decay_steps=10,
    lr_decay_style="cosine",
    start_wd=WEIGHT_DECAY,
    end_wd=WEIGHT_DECAY,
    wd_incr_steps=10,
    wd_incr_style="constant",
  )
  return ddp, optimizer, scheduler


def train_step(ddp, optimizer, scheduler, tokens) -> float:
  """One step of Megatron's training loop on `tokens` (labels are the tokens): the loss."""
  import torch

  positions = torch.arange(tokens.shape[1]).expand(*tokens.shape)
  ddp.zero_grad_buffer()
  optimizer.zero_grad()
  loss = ddp(tokens, positions, None, labels=tokens).float().mean()
  loss.backward()
  ddp.finish_grad_sync()
  assert optimizer.step()[0]
  scheduler.step(increment=1)
  return float(loss)


def batches(dp_rank: int, steps: int):
  """The token batches DP rank `dp_rank` trains on, step by step."""
  import torch

  generator = torch.Generator().manual_seed(dp_rank)
  return [torch.randint(0, VOCAB, (2, SEQ), generator=generator) for _ in range(steps)]


def oracle(ddp, optimizer, distopt: bool, metadata: dict) -> dict[str, np.ndarray]:
  """The logical state (module doc): model tensors and per-parameter optimizer tensors."""
  expected = assemble(ddp.module.sharded_state_dict(metadata=metadata))
  if distopt:  # Megatron's own gather, whatever format the files use
    metadata = {
      **metadata,
      "distrib_optim_sharding_type": "fully_reshardable",
      "distrib_optim_fully_reshardable_mem_efficient": False,
    }
  model_state = ddp.module.sharded_state_dict(metadata=metadata)
  expected.update(assemble(optimizer.sharded_state_dict(model_state, metadata=metadata)))
  return expected


def forward(ddp) -> tuple[np.ndarray, np.ndarray]:
  """Megatron's logits (float32, the padded vocabulary gathered over TP) for fixed tokens."""
  import torch
  import torch.distributed as dist
  from megatron.core import parallel_state as ps

  tokens = (torch.arange(2 * SEQ) * 7 % VOCAB).reshape(2, SEQ)
  positions = torch.arange(SEQ).expand(2, SEQ)
  with torch.no_grad():
    local = ddp(tokens, positions, None).float()
  group = ps.get_tensor_model_parallel_group()
  pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
  dist.all_gather(pieces, local.contiguous(), group=group)
  return tokens.numpy(), torch.cat(pieces, dim=-1).numpy()


def load(ddp, optimizer, scheduler, root: str) -> int:
  """Loads a Megatron-LM root's latest iteration into `ddp`, `optimizer` and `scheduler` as
  Megatron-LM's `load_checkpoint` does (the checkpoint's content metadata, one
  `dist_checkpointing.load` of the sharded state dicts, then `load_state_dict`): the iteration.

  On a CPU without Apex or TransformerEngine, megatron-core falls back to torch's Adam, and two
  stand-ins keep that path working (GPU installs take the other): the distributed optimizer's
  `state_dict()` reads a step a fresh optimizer lacks (megatron-core's own zero-gradient step,
  `_init_optimizer_states_with_dummy_values`, makes it; the load overwrites it), and its load
  gives all parameters one `step` tensor, which torch's Adam would increment once per parameter
  (each gets its own) and which its fully_reshardable load looks up among the loaded tensors
  (skipped there: the step comes from the param groups).
  """
  from megatron.core import dist_checkpointing
  from megatron.core import parallel_state as ps

  inners = getattr(optimizer, "chained_optimizers", [optimizer])
  for inner in inners:
    inner._init_optimizer_states_with_dummy_values()
    _skip_step_when_setting_states(type(inner))
  iteration = int(Path(root, "latest_checkpointed_iteration.txt").read_text())
  folder = str(Path(root) / f"iter_{iteration:07d}")
  metadata = dict(dist_checkpointing.load_content_metadata(folder) or {})
  with_optimizer = "distrib_optim_sharding_type" in metadata  # else weights alone
  metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
  wanted = {"model": ddp.module.sharded_state_dict(metadata=metadata)}
  if with_optimizer:
    wanted["optimizer"] = optimizer.sharded_state_dict(
      wanted["model"], is_loading=True, metadata=metadata
    )
  state = dist_checkpointing.load(wanted, folder)
  ddp.module.load_state_dict(state["model"])
  if not with_optimizer:
    return iteration
  optimizer.load_state_dict(state["optimizer"])
  for inner in inners:
    for param_state in inner.optimizer.state.values():
      if "step" in param_state:
        param_state["step"] = param_state["step"].clone()
  if "opt_param_scheduler" in state:
    scheduler.load_state_dict(state["opt_param_scheduler"])
  return iteration


def _skip_step_when_setting_states(cls) -> None:
  """The fully_reshardable load's `step` lookup, skipped (see `load`)."""
  if getattr(cls, "_ucp_skips_step", False):
    return
  real = cls._set_main_param_and_optimizer_states

  def set_states(self, model_param, tensors):
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    step = self.optimizer.state[main_param].pop("step", None)
    try:
      real(self, model_param, tensors)
    finally:
      if step is not None:
        self.optimizer.state[main_param]["step"] = step

  cls._set_main_param_and_optimizer_states = set_states
  cls._ucp_skips_step = True


def run_rank(rank: int, variant: str, out: str, port: int) -> None:
  import torch
  import torch.distributed as dist

  cpu_stand_ins()
  distopt, sharding, bf16 = VARIANTS[variant]
  dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP * DP
  )
  from megatron.core import dist_checkpointing
  from megatron.core import parallel_state as ps
  from megatron.core.dist_checkpointing.mapping import ShardedObject
  from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

  ddp, optimizer, scheduler = build(distopt, bf16, TP)
  steps = batches(ps.get_data_parallel_rank(), ITERATION + CONTINUED)
  for tokens in steps[:ITERATION]:
    train_step(ddp, optimizer, scheduler, tokens)

  args = megatron_args(distopt, sharding, bf16)
  metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
  if distopt:
    metadata["distrib_optim_sharding_type"] = sharding
    if sharding == "fully_reshardable":
      metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
  with_group = {**metadata, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
  rng_state = {
    "random_rng_state": random.getstate(),
    "np_rng_state": np.random.get_state(),
    "torch_rng_state": torch.get_rng_state(),
    "cuda_rng_state": torch.get_rng_state(),  # stand-in: no CUDA generator here
    "rng_tracker_states": get_cuda_rng_tracker().get_states(),
  }
  state = {
    "args": args,
    "checkpoint_version": 3.0,
    "iteration": ITERATION,
    "model": ddp.module.sharded_state_dict(metadata=with_group),
  }
  state["optimizer"] = optimizer.sharded_state_dict(state["model"], metadata=with_group)
  state["opt_param_scheduler"] = scheduler.state_dict()
  state["rng_state"] = ShardedObject(
    "rng_state",
    [rng_state],
    (1, TP),
    (0, ps.get_tensor_model_parallel_rank()),
    replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
  )
  state["num_floating_point_operations_so_far"] = 1.0e6
  root = Path(out) / variant
  iter_dir = root / f"iter_{ITERATION:07d}"
  if rank == 0:
    iter_dir.mkdir(parents=True)
  dist.barrier()
  dist_checkpointing.save(state, str(iter_dir), content_metadata=metadata)
  expected = {}
  if not os.environ.get("UCP_MEGATRON_NO_ORACLE"):  # fresh state dicts: save applied its own
    expected = oracle(ddp, optimizer, distopt, with_group)
  saved_groups = [dict(g) for g in optimizer.param_groups]  # lr and weight decay as saved
  tokens, logits = forward(ddp)
  continued = [train_step(ddp, optimizer, scheduler, tokens) for tokens in steps[ITERATION:]]
  if rank == 0:
    (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    np.savez(root / "expected.npz", **expected)
    np.savez(root / "logits.npz", tokens=tokens, logits=logits)
    groups = saved_groups
    (root / "info.json").write_text(
      json.dumps(
        {
          "megatron_core": __import__("megatron.core").core.__version__,
          "tp": TP,
          "dp": DP,
          "iteration": ITERATION,
          "distributed_optimizer": distopt,
          "sharding_type": sharding,
          "bf16": bf16,
          "vocab": VOCAB,
          "padded_vocab": padded_vocab(),
          "hidden": HIDDEN,
          "heads": HEADS,
          "query_groups": GROUPS,
          "ffn": FFN,
          "layers": LAYERS,
          "lr": [g["lr"] for g in groups],
          "weight_decay": [g["weight_decay"] for g in groups],
          "step": ITERATION,
          "continued_losses": continued,  # DP rank 0's loss at the next iterations
        },
        indent=1,
      )
      + "\n"
    )
  dist.barrier()
  dist.destroy_process_group()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=str(REPO_ROOT / "tests/fixtures/megatron_core"))
  parser.add_argument("--variant", choices=sorted(VARIANTS), action="append")
  parser.add_argument(
    "--sizes", help='JSON: model sizes other than the fixtures\', e.g. {"hidden": 512, "layers": 8}'
  )
  parser.add_argument(
    "--no-oracle", action="store_true", help="no expected.npz (a checkpoint for benchmarks)"
  )
  options = parser.parse_args()
  if options.no_oracle:
    os.environ["UCP_MEGATRON_NO_ORACLE"] = "1"
  if options.sizes:  # the ranks import this module anew: they read it from the environment
    os.environ["UCP_MEGATRON_SIZES"] = options.sizes
    SIZES.update(json.loads(options.sizes))
  import torch.multiprocessing as mp

  for index, variant in enumerate(options.variant or VARIANTS):
    with tempfile.TemporaryDirectory() as scratch:
      mp.spawn(run_rank, args=(variant, scratch, 29600 + index), nprocs=TP * DP)
      target = Path(options.out) / variant
      shutil.rmtree(target, ignore_errors=True)
      target.parent.mkdir(parents=True, exist_ok=True)
      shutil.copytree(Path(scratch) / variant, target)
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    print(f"{variant}: {target} ({size / 1024:.0f} KiB)", file=sys.stderr)


if __name__ == "__main__":
  os.environ.setdefault("PYTHONWARNINGS", "ignore")
  main()
