"""Universal checkpoints (with a parameter schema) built from the DeepSpeed fixtures' files.

`fixture_checkpoint(name, path)` saves, with `ucp_jax.save(..., schema=...)`, what DeepSpeed's
own `ds_to_universal` wrote for fixture `name` (`universal/zero/<name>/*.pt`), plus the frozen
parameter and buffer from the model-states files: the same state a converter produces, read
with the safe torch reader. No torch or DeepSpeed needed.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

import ucp_jax
from ucp_jax.sources._torch_reader import _torch_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "info.json").is_file())


def info(name: str) -> dict[str, Any]:
  return json.loads((FIXTURES / name / "info.json").read_text())


def load_pt(path: str | os.PathLike) -> Any:
  return _torch_file.load(path)


def tensor_of(obj: Any) -> np.ndarray:
  """The tensor of a universal `*.pt` file: a bare tensor (ZeRO-3) or `{'param': tensor}`."""
  return np.asarray(obj["param"] if isinstance(obj, dict) else obj)


def _model_states(name: str) -> list[dict]:
  """The fixture's own model-states files (rank order; one for ZeRO-1/2)."""
  tag = info(name)["tag"]
  files = glob.glob(str(FIXTURES / name / "ckpt" / tag / "*model_states.pt"))
  key = lambda p: int(p.split("zero_pp_rank_")[1].split("_")[0]) if "zero_pp_rank_" in p else 0  # noqa: E731
  return [load_pt(p) for p in sorted(files, key=key)]


def frozen_value(name: str, param: str) -> np.ndarray:
  """A frozen parameter in the model dtype: `module` (ZeRO-1/2) or the ZeRO-3 rank fragments."""
  states = _model_states(name)
  shape = info(name)["params"][param]["shape"]
  if info(name)["zero_stage"] != 3:
    return np.array(states[0]["module"][param])
  pieces = [np.asarray(s["frozen_param_fragments"][param]).ravel() for s in states]
  return np.concatenate(pieces)[: int(np.prod(shape))].reshape(shape)


def buffer_value(name: str, buffer: str) -> np.ndarray:
  return np.array(_model_states(name)[0]["module"][buffer])


def fixture_state(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
  """(arrays tree, schema) of fixture `name`, from DeepSpeed's universal output."""
  meta = info(name)
  zero = FIXTURES / name / "universal" / "zero"
  opt = load_pt(zero / "optimizer_state.pt")
  tree: dict[str, dict[str, np.ndarray]] = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
  params: dict[str, Any] = {}
  for group, entry in enumerate(meta["param_groups"]):
    for p in entry["names"]:
      shape = meta["params"][p]["shape"]
      for key, stem in (("params", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        tree[key][p] = np.array(tensor_of(load_pt(zero / p / f"{stem}.pt"))).reshape(shape)
      params[p] = {
        "value": f"params/{p}",
        "slots": {"exp_avg": f"exp_avg/{p}", "exp_avg_sq": f"exp_avg_sq/{p}"},
        "group": group,
        "frozen": False,
        "tied_to": None,
      }
  for p in meta["frozen"]:
    tree["params"][p] = frozen_value(name, p)
    params[p] = {"value": f"params/{p}", "slots": {}, "group": None, "frozen": True}
  for alias, real in meta["tied"].items():
    params[alias] = {"value": None, "slots": {}, "group": None, "frozen": False, "tied_to": real}
  tree["buffers"] = {b: buffer_value(name, b) for b in meta["buffers"]}
  if "optimizer_state_dict" in opt:
    step = opt["optimizer_state_dict"]["state"][0]["step"]
  else:
    step = load_pt(zero / meta["param_groups"][0]["names"][0] / "step.pt")
  groups = [
    {k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
    for g in opt["param_groups"]
  ]
  schema = {
    "version": 1,
    "naming": "torch",
    "params": params,
    "buffers": {b: f"buffers/{b}" for b in meta["buffers"]},
    "optimizer": {"type": "adamw", "step": int(np.asarray(step)), "groups": groups},
    "extra": {
      "global_steps": meta["steps"],
      "global_samples": meta["steps"] * meta["micro_batch"] * meta["dp"],
      "skipped_steps": 0,
      "source_layout": {"zero_stage": meta["zero_stage"], "dp": meta["dp"]},
    },
  }
  return tree, schema


def fixture_checkpoint(name: str, path: str | os.PathLike) -> str:
  """Saves fixture `name`'s universal state as a ucp_jax checkpoint at `path`."""
  tree, schema = fixture_state(name)
  return ucp_jax.save(path, tree, schema=schema, step=schema["optimizer"]["step"])
