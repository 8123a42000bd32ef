"""The `ucp` command line: inspect, verify, convert and export checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ucp_jax import _errors, _reader

_COMMANDS = {}


def _command(fn):
  _COMMANDS[fn.__name__.removeprefix("cmd_")] = fn
  return fn


def _human(nbytes: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if nbytes < 1024 or unit == "TiB":
      return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
    nbytes /= 1024
  return ""


def progress_bar(console: Console) -> Progress:
  """The progress bar every long CLI operation shows (on stderr)."""
  return Progress(
    TextColumn("[bold]{task.description}"),
    BarColumn(),
    DownloadColumn(),
    TimeRemainingColumn(),
    TextColumn("{task.fields[item]}"),
    console=console,
    transient=True,
  )


@_command
def cmd_inspect(args, out: Console, err: Console) -> int:
  ckpt = _reader.open(args.checkpoint)
  m = ckpt.manifest
  if args.json:
    data = {
      "path": str(ckpt.location),
      "step": m.step,
      "format_version": m.format_version,
      "created": m.created,
      "source": m.source,
      "metadata": m.metadata,
      "arrays": {k: {**m.arrays[k].to_json(), "bytes": m.arrays[k].nbytes} for k in ckpt.keys()},
      "total_arrays": len(m.arrays),
      "total_bytes": m.nbytes,
    }
    out.print_json(json.dumps(data))
    return 0
  table = Table(title=f"{ckpt.location}  (step {m.step})", title_justify="left")
  for col, justify in (("key", "left"), ("shape", "left"), ("dtype", "left"), ("bytes", "right")):
    table.add_column(col, justify=justify)
  for key in ckpt.keys():
    info = m.arrays[key]
    dtype = info.dtype if info.kind == "array" else f"{info.dtype} ({info.kind})"
    table.add_row(key, str(info.shape), dtype, _human(info.nbytes))
  table.add_section()
  table.add_row(f"{len(m.arrays)} arrays", "", "", _human(m.nbytes))
  out.print(table)
  framework = m.source.get("framework", "?")
  out.print(f"source: {framework}; created {m.created}; format v{m.format_version}")
  return 0


@_command
def cmd_verify(args, out: Console, err: Console) -> int:
  ckpt = _reader.open(args.checkpoint)
  start = time.perf_counter()
  with progress_bar(err) as bar:
    task = bar.add_task("verify", total=ckpt.nbytes, item="")
    problems = ckpt.verify(lambda key, n: bar.update(task, advance=n, item=key))
  seconds = time.perf_counter() - start
  if problems:
    out.print(f"[red]{ckpt.location}: {len(problems)} bad array(s):")
    for key, problem in problems.items():
      out.print(f"  {key}: {problem}", markup=False)
    return 1
  out.print(
    f"{ckpt.location}: OK, {len(ckpt.keys())} arrays, {_human(ckpt.nbytes)} "
    f"read and checksummed in {seconds:.2f} s"
  )
  return 0


@_command
def cmd_demo(args, out: Console, err: Console) -> int:
  from ucp_jax import _demo

  result = _demo.run(args.out, steps=args.steps, log=lambda line: out.print(line, markup=False))
  ok = result["exact_restore"] and result["max_rel_diff"] <= 1e-5
  out.print("[green]PASS[/green]" if ok else "[red]FAIL[/red]: the runs diverged")
  return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="ucp", description="Universal checkpoints for JAX.")
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("inspect", help="list a checkpoint's arrays (key, shape, dtype, bytes)")
  p.add_argument("checkpoint")
  p.add_argument("--json", action="store_true", help="machine-readable output")
  p = sub.add_parser("verify", help="read every chunk, check checksums against the manifest")
  p.add_argument("checkpoint")
  p = sub.add_parser("demo", help="train, save, restore onto other meshes, compare with no restart")
  p.add_argument("--out", default="demo_out", help="where the checkpoints go (default: demo_out)")
  p.add_argument("--steps", type=int, default=20, help="training steps per leg (default: 20)")
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  out = Console(highlight=False, soft_wrap=True)
  err = Console(stderr=True, highlight=False, soft_wrap=True)
  try:
    return _COMMANDS[args.command](args, out, err)
  except _errors.UcpError as e:
    err.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
    return 2


if __name__ == "__main__":
  sys.exit(main())
