#!/usr/bin/env python
"""Generate real DeepSpeed tensor- and pipeline-parallel checkpoints (and their universal form).

Every fixture trains a tiny model for a few steps with real DeepSpeed on CPU (gloo ranks as
subprocesses, shm op disabled, torch AdamW, ZeRO-1, fp32), saves a checkpoint and converts it
with DeepSpeed's own ``ds_to_universal``. Layout per fixture, as in
``scripts/make_deepspeed_fixtures.py``::

  <out>/<name>/ckpt/            ``latest`` + ``global_step<N>/``
  <out>/<name>/universal/       ds_to_universal output
  <out>/<name>/latest_universal
  <out>/<name>/info.json        config, degrees, parameter table, losses, reference logits

Fixtures:

* ``autotp_tp2_dp1`` / ``autotp_tp2_dp2``: DeepSpeed AutoTP (``tensor_parallel.autotp_size: 2``)
  on a Llama-like model (``LlamaLike``): fused QKV with grouped-query attention (uneven
  sub-parameters, ``sub_param_shard_widths``), fused SwiGLU ``gate_up_proj`` (2 sub-params),
  row-parallel ``o_proj``/``down_proj``, a column-parallel ``lm_head`` over an odd vocabulary
  (AutoTP splits it 26/25 and lists it as a vocabulary parameter), replicated norms and
  embedding. 2 and 4 gloo ranks. AutoTP writes ``universal_checkpoint_info`` itself.
* ``pp2``: a ``PipelineModule`` (``PipeLike``) over 2 stages with the embedding tied to the
  output head across the first and last stage; ``client_state`` carries
  ``pipeline_replicated_parameter_patterns`` for the tied weight.
* ``pp2_tp2``: the same pipeline with AutoTP at TP=2 on 4 ranks. DeepSpeed 0.19.8 does not
  combine AutoTP with its pipeline engine on its own: AutoTP replaces the engine's ``mpu`` by
  ``deepspeed.utils.groups`` and builds a (data, tensor) mesh over the whole world
  (``groups._init_tp_mesh_device``: data = world / tp = 2, ignoring the pipe axis), so
  ``PipelineEngine.__init__`` fails ``assert self.dp_world_size == self.grid.data_parallel_size``
  (runtime/pipe/engine.py:103); with that fixed, ``train_batch`` calls
  ``self.mpu.get_pipe_parallel_group()``, which ``groups`` lacks, the TP input-consistency
  hook calls ``mpu.get_tensor_model_parallel_src_rank()``, which the pipeline grid lacks, and
  ``checkpoint_mp_rank`` (fixed at init from ``groups``) makes both stages write the same
  ``mp_rank_0X`` files. The worker works around all four (preset groups from the pipeline
  grid, ``engine.mpu = engine.grid``, remove the hook, ``checkpoint_mp_rank`` from the grid).
  AutoTP then records per-stage ``universal_checkpoint_info`` (each stage lists only its own
  parameters) and ``ds_to_universal`` reads only the first file's: without help it
  concatenates stage 1's replicated norms to twice their size and its row-parallel weights on
  the wrong dim. The worker therefore passes the union over stages in ``client_state`` (kept in
  ``info.json`` as ``per_stage_universal_checkpoint_info`` too).

Usage::

  python scripts/make_tp_fixtures.py [--only NAME ...] [--list]

Regenerating gives identical tensors (fixed seeds, one thread per rank). Needs torch==2.13.0 and
deepspeed==0.19.8. About 1-2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ds_launch import (
  dir_size,
  ds_to_universal,
  init_rank,
  install_fixture,
  launch_ranks,
  token_batch,
)
from make_deepspeed_fixtures import RECOVERY_SCRIPTS

REPO_ROOT = Path(__file__).resolve().parents[1]

SEED = 4321
STEPS = 3
MICRO_BATCH = 2
SEQ = 6
LR = 1e-2
BETAS = (0.9, 0.99)
EPS = 1e-8
WEIGHT_DECAY = 0.01

# LlamaLike: vocabulary, hidden, heads, kv heads, head dim, ffn, layers
VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 51, 16, 4, 2, 4, 24, 2
# PipeLike: vocabulary, hidden, ffn, blocks
P_VOCAB, P_DIM, P_FFN, P_BLOCKS = 32, 8, 12, 3

# name -> (kind, tp, pp, dp)
FIXTURES: dict[str, tuple[str, int, int, int]] = {
  "autotp_tp2_dp1": ("autotp", 2, 1, 1),
  "autotp_tp2_dp2": ("autotp", 2, 1, 2),
  "pp2": ("pipe", 1, 2, 1),
  "pp2_tp2": ("pipe", 2, 2, 1),
}


def autotp_layer_specs(
  heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM
) -> list[dict[str, Any]]:
  """The AutoTP ``partition_config`` layer specs of ``LlamaLike``."""
  q, kv = heads * head_dim, kv_heads * head_dim
  return [
    {"patterns": [r".*\.o_proj\.weight$", r".*\.down_proj\.weight$"], "partition_type": "row"},
    {
      "patterns": [r".*\.qkv_proj\.weight$"],
      "partition_type": "column",
      "shape": [[q, kv, kv], -1],
      "partition_dim": 0,
    },
    {
      "patterns": [r".*\.gate_up_proj\.weight$"],
      "partition_type": "column",
      "shape": [2, -1],
      "partition_dim": 0,
    },
    {"patterns": [r".*lm_head\.weight$"], "partition_type": "column", "gather_output": True},
  ]


def pipe_layer_specs() -> list[dict[str, Any]]:
  return [
    {"patterns": [r".*\.down\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.up\.weight$"], "partition_type": "column"},
  ]


def ds_config(name: str) -> dict[str, Any]:
  """The DeepSpeed config of fixture ``name``."""
  kind, tp, _, _ = FIXTURES[name]
  config: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": 2 if kind == "pipe" else 1,
    "steps_per_print": 1_000_000,
    "optimizer": {
      "type": "AdamW",
      "params": {
        "torch_adam": True,
        "lr": LR,
        "betas": list(BETAS),
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
      },
    },
    "zero_optimization": {"stage": 1},
  }
  if kind == "pipe" and tp > 1:
    # The ZeRO optimizer was built with AutoTP's mpu (TP groups only), so each pipeline stage
    # would clip by its own gradient norm and the tied embedding's two copies would drift apart
    # (measured: max difference 1e-3 after 3 steps). No clipping keeps them equal.
    config["gradient_clipping"] = 0.0
  if tp > 1:
    specs = autotp_layer_specs() if kind == "autotp" else pipe_layer_specs()
    config["tensor_parallel"] = {
      "autotp_size": tp,
      "partition_config": {"use_default_specs": False, "layer_specs": specs},
    }
  return config


# --------------------------------------------------------------------------------------------
# Models (torch is imported lazily so ``--list`` needs none)


def build_llama_like(
  vocab: int = VOCAB,
  dim: int = DIM,
  heads: int = HEADS,
  kv_heads: int = KV_HEADS,
  head_dim: int = HEAD_DIM,
  ffn: int = FFN,
  layers: int = LAYERS,
):
  """A Llama-like model whose forward works on AutoTP shards and on whole weights."""
  import torch
  from torch import nn

  class Attention(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.qkv_proj = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
      self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x):
      qkv = self.qkv_proj(x)
      nq = self.o_proj.weight.shape[1]  # this rank's query width: o_proj is row-parallel
      nk = (qkv.shape[-1] - nq) // 2
      q, k, v = qkv.split([nq, nk, nk], -1)
      b, t, _ = x.shape
      q, k, v = (y.view(b, t, -1, head_dim).transpose(1, 2) for y in (q, k, v))
      rep = q.shape[1] // k.shape[1]
      k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
      a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
      return self.o_proj(a.transpose(1, 2).reshape(b, t, -1))

  class Mlp(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.gate_up_proj = nn.Linear(dim, 2 * ffn, bias=False)
      self.down_proj = nn.Linear(ffn, dim, bias=True)

    def forward(self, x):
      gate, up = self.gate_up_proj(x).chunk(2, -1)  # each rank holds [gate_k; up_k]
      return self.down_proj(torch.nn.functional.silu(gate) * up)

  class Layer(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.input_layernorm = nn.LayerNorm(dim)
      self.self_attn = Attention()
      self.post_attention_layernorm = nn.LayerNorm(dim)
      self.mlp = Mlp()

    def forward(self, x):
      x = x + self.self_attn(self.input_layernorm(x))
      return x + self.mlp(self.post_attention_layernorm(x))

  class LlamaLike(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.embed_tokens = nn.Embedding(vocab, dim)
      self.layers = nn.ModuleList([Layer() for _ in range(layers)])
      self.norm = nn.LayerNorm(dim)
      self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
      h = self.embed_tokens(ids)
      for layer in self.layers:
        h = layer(h)
      return self.lm_head(self.norm(h))

  return LlamaLike()


def build_pipe_like(topology):
  """A ``PipelineModule``: tied embedding/head, ``P_BLOCKS`` MLP blocks, a final LayerNorm."""
  import torch
  from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
  from torch import nn

  class Embed(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.embed = nn.Embedding(P_VOCAB, P_DIM)

    def forward(self, ids):
      return self.embed(ids)

  class Block(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.ln = nn.LayerNorm(P_DIM)
      self.up = nn.Linear(P_DIM, P_FFN)
      self.down = nn.Linear(P_FFN, P_DIM)

    def forward(self, x):
      return x + self.down(torch.relu(self.up(self.ln(x))))

  def head(module, h):
    return h @ module.embed.weight.t()

  def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, P_VOCAB), labels.reshape(-1))

  layers = [TiedLayerSpec("embed", Embed, tied_weight_attr="embed.weight")]
  layers += [LayerSpec(Block) for _ in range(P_BLOCKS)]
  layers += [LayerSpec(nn.LayerNorm, P_DIM)]
  layers += [TiedLayerSpec("embed", Embed, forward_fn=head, tied_weight_attr="embed.weight")]
  return PipelineModule(
    layers=layers, topology=topology, loss_fn=loss_fn, partition_method="uniform"
  )


def batch(seed: int, vocab: int):
  return token_batch(seed, vocab, MICRO_BATCH, SEQ)


# --------------------------------------------------------------------------------------------
# Workers


def _setup():
  return init_rank(deterministic=True, fill_uninitialized=True)


def worker_autotp(name: str, ckpt_dir: str, info_path: str) -> None:
  torch, deepspeed = _setup()
  import deepspeed.comm as dist

  torch.manual_seed(SEED)
  model = build_llama_like()
  logical = {n: p.detach().clone() for n, p in model.named_parameters()}
  engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=ds_config(name)
  )
  from deepspeed.utils import groups

  dp_rank = groups._get_data_parallel_rank()
  losses = []
  for step in range(STEPS):
    ids, targets = batch(SEED + 100 * step + dp_rank, VOCAB)
    logits = engine(ids)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    engine.backward(loss)
    engine.step()
    losses.append(float(loss))
  engine.eval()
  with torch.no_grad():
    ref = engine(batch(SEED - 1, VOCAB)[0]).float()
  engine.save_checkpoint(ckpt_dir)  # AutoTP adds its universal_checkpoint_info itself
  if dist.get_rank() == 0:
    _write_info(
      info_path,
      name,
      engine,
      extra={
        "model": "LlamaLike",
        "dims": {
          "vocab": VOCAB,
          "dim": DIM,
          "heads": HEADS,
          "kv_heads": KV_HEADS,
          "head_dim": HEAD_DIM,
          "ffn": FFN,
          "layers": LAYERS,
        },
        "logical_shapes": {n: list(p.shape) for n, p in logical.items()},
        "losses": losses,
        "reference_batch_seed": SEED - 1,
        "reference_logits": ref.tolist(),
        "universal_checkpoint_info": _jsonable(engine.module.universal_checkpoint_info),
      },
    )
  dist.barrier()


def worker_pipe(name: str, ckpt_dir: str, info_path: str) -> None:
  torch, deepspeed = _setup()
  import deepspeed.comm as dist
  from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

  _, tp, pp, _ = FIXTURES[name]
  deepspeed.init_distributed(dist_backend="gloo")
  torch.manual_seed(SEED)
  topo = PipeModelDataParallelTopology(
    num_pp=pp, num_mp=tp, num_dp=dist.get_world_size() // (pp * tp)
  )
  model = build_pipe_like(topo)
  if tp > 1:  # workaround 1: the TP/DP groups of the pipeline grid, before AutoTP makes its own
    from deepspeed.utils import groups

    groups._TENSOR_MODEL_PARALLEL_GROUP = model._grid.get_slice_parallel_group()
    groups._MODEL_PARALLEL_GROUP = model._grid.get_slice_parallel_group()
    groups._DATA_PARALLEL_GROUP = model._grid.get_data_parallel_group()
  engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=[p for p in model.parameters()], config=ds_config(name)
  )
  if tp > 1:
    engine.checkpoint_mp_rank = engine.grid.get_model_parallel_rank()  # workaround 4
    engine.mpu = engine.grid  # workaround 2
    if engine.first_dataloader_check is not None:  # workaround 3
      engine.first_dataloader_check.remove()

  def data(seed):
    step = 0
    while True:
      yield batch(seed + step, P_VOCAB)
      step += 1

  it = data(SEED + 1000 * engine.grid.data_parallel_id)
  losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
  tied = [r"^tied_modules\."]
  info = {"pipeline_replicated_parameter_patterns": tied}
  per_stage = None
  if tp > 1:
    own = _jsonable(engine.module.universal_checkpoint_info)
    per_stage = [None] * dist.get_world_size()
    dist.all_gather_object(per_stage, own)
    info = _union_info(per_stage) | info
  engine.save_checkpoint(ckpt_dir, client_state={"universal_checkpoint_info": info})
  if dist.get_rank() == 0:
    _write_info(
      info_path,
      name,
      engine,
      extra={
        "model": "PipeLike",
        "dims": {"vocab": P_VOCAB, "dim": P_DIM, "ffn": P_FFN, "blocks": P_BLOCKS},
        "losses": losses,
        "universal_checkpoint_info": info,
        "per_stage_universal_checkpoint_info": per_stage,
        "autotp_pipeline_workarounds": [
          "deepspeed.utils.groups TP/DP groups preset from the pipeline grid",
          "engine.mpu = engine.grid",
          "engine.first_dataloader_check removed",
          "engine.checkpoint_mp_rank = engine.grid.get_model_parallel_rank()",
        ]
        if tp > 1
        else [],
      },
    )
  dist.barrier()


def worker_load(load_dir: str, out_path: str, tp: int) -> None:
  """Loads a universal checkpoint into ``LlamaLike`` at TP ``tp`` (``load_universal``) and
  saves, on rank 0, the logits of the reference batch and every fp32 master and moment."""
  torch, deepspeed = _setup()
  import deepspeed.comm as dist
  from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

  torch.manual_seed(SEED + 7)  # other initial values: the load must replace them all
  model = build_llama_like()
  config = ds_config("autotp_tp2_dp1")
  config["checkpoint"] = {"load_universal": True}
  if tp == 1:
    del config["tensor_parallel"]
  else:
    config["tensor_parallel"]["autotp_size"] = tp
  engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=config
  )
  engine.load_checkpoint(load_dir)
  engine.eval()
  with torch.no_grad():
    logits = engine(batch(SEED - 1, VOCAB)[0]).float()
  state = {}
  for name, p in engine.module.named_parameters():
    state[name] = {
      "fp32": safe_get_full_fp32_param(p),
      "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
      "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq"),
    }
  if dist.get_rank() == 0:
    torch.save({"logits": logits, "state": state}, out_path)
  dist.barrier()


def run_load(load_dir: str, out_path: str, tp: int = 1, timeout: float = 300) -> None:
  """Runs ``worker_load`` on ``tp`` gloo ranks (subprocesses); raises with the log tail."""
  with tempfile.TemporaryDirectory(prefix="tpload_") as tmp:
    cmd = [sys.executable, __file__, "--load", load_dir, "--out-file", out_path, "--tp", str(tp)]
    launch_ranks(tp, cmd, tmp, what=f"load of {load_dir}", timeout=timeout)


def _jsonable(obj):
  """universal_checkpoint_info with tuples as lists and int dict keys as strings."""
  return json.loads(json.dumps(obj, default=list))


def _union_info(infos: list[dict]) -> dict:
  """The union of per-stage ``universal_checkpoint_info`` dicts (lists, dicts merged)."""
  out: dict[str, Any] = {}
  for info in infos:
    for key, value in info.items():
      if isinstance(value, list):
        merged = out.setdefault(key, [])
        merged.extend(v for v in value if v not in merged)
      elif isinstance(value, dict):
        merged = out.setdefault(key, {})
        for k, v in value.items():
          if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = {**merged[k], **v}
          else:
            merged[k] = v
      else:
        out[key] = value
  return out


def _write_info(path: str, name: str, engine, extra: dict) -> None:
  import deepspeed
  import torch

  kind, tp, pp, dp = FIXTURES[name]
  info = {
    "name": name,
    "kind": kind,
    "tp": tp,
    "pp": pp,
    "dp": dp,
    "deepspeed_version": deepspeed.__version__,
    "torch_version": torch.__version__.split("+")[0],
    "config": ds_config(name),
    "tag": f"global_step{engine.global_steps}",
    "steps": engine.global_steps,
    "seed": SEED,
    "adam": {"betas": list(BETAS), "eps": EPS, "lr": LR, "weight_decay": WEIGHT_DECAY},
    **extra,
  }
  with open(path, "w") as f:
    json.dump(info, f, indent=1)


# --------------------------------------------------------------------------------------------
# Driver


def make_fixture(name: str, out: Path, timeout: float = 600.0) -> dict[str, Any]:
  """Generates fixture ``name`` under ``out/name`` (replacing it)."""
  _, tp, pp, dp = FIXTURES[name]
  world = tp * pp * dp
  dest = out / name
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix=f"tpfix_{name}_") as tmp:
    tmp_path = Path(tmp)
    ckpt, info_path = tmp_path / "ckpt", tmp_path / "info.json"
    cmd = [
      sys.executable,
      __file__,
      "--worker",
      name,
      "--ckpt",
      str(ckpt),
      "--info",
      str(info_path),
    ]
    launch_ranks(world, cmd, tmp_path, what=name, timeout=timeout)
    info = json.loads(info_path.read_text())
    tag = info["tag"]
    for script in RECOVERY_SCRIPTS:
      (ckpt / script).unlink(missing_ok=True)
    universal = tmp_path / "universal"
    cmd = ds_to_universal(ckpt / tag, universal)
    info["ds_to_universal"] = " ".join(
      ["python", *cmd[1:3], "--input_folder", f"ckpt/{tag}", "--output_folder", "universal"]
    )
    info["files"] = {
      "ckpt": sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()),
      "universal": sorted(
        str(p.relative_to(universal)) for p in universal.rglob("*") if p.is_file()
      ),
    }
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    install_fixture(dest, ckpt, universal)
    shutil.copy(info_path, dest / "info.json")
  return {
    "name": name,
    "bytes": dir_size(dest),
    "seconds": round(time.perf_counter() - t0, 1),
    "losses": info["losses"],
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--out",
    type=Path,
    help="output folder (the committed fixtures: tests/fixtures/tp)",
  )
  parser.add_argument("--only", action="append", choices=sorted(FIXTURES))
  parser.add_argument("--list", action="store_true")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--ckpt", help=argparse.SUPPRESS)
  parser.add_argument("--info", help=argparse.SUPPRESS)
  parser.add_argument("--load", help=argparse.SUPPRESS)
  parser.add_argument("--out-file", help=argparse.SUPPRESS)
  parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.load:
    worker_load(args.load, args.out_file, args.tp)
    return 0
  if args.worker:
    kind = FIXTURES[args.worker][0]
    (worker_autotp if kind == "autotp" else worker_pipe)(args.worker, args.ckpt, args.info)
    return 0
  if args.list:
    for name, (kind, tp, pp, dp) in FIXTURES.items():
      print(f"{name}: {kind} tp={tp} pp={pp} dp={dp} ranks={tp * pp * dp}")
    return 0
  if args.out is None:
    parser.error("--out is required to make the fixtures (tests/fixtures/tp: the committed ones)")
  failed = []
  for name in args.only or list(FIXTURES):
    try:
      s = make_fixture(name, args.out)
    except Exception as e:  # report and go on
      failed.append(name)
      print(f"FAILED {name}: {e}", flush=True)
      continue
    print(
      f"{s['name']:<16} {s['bytes'] / 1024:7.1f} KiB  {s['seconds']:5.1f}s  losses "
      f"{', '.join(f'{x:.4f}' for x in s['losses'])}",
      flush=True,
    )
  total = dir_size(args.out) if args.out.exists() else 0
  print(f"total {total / 1024:.1f} KiB in {args.out}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
