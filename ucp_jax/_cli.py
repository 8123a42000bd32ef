"""The `ucp` command line: inspect, verify, convert and export checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.console import Console
from rich.markup import escape
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
    out.print(f"[red]{escape(str(ckpt.location))}: {len(problems)} bad array(s):")
    for key, problem in problems.items():
      out.print(f"  {key}: {problem}", markup=False)
    return 1
  out.print(
    f"{ckpt.location}: OK, {len(ckpt.keys())} arrays, {_human(ckpt.nbytes)} "
    f"read and checksummed in {seconds:.2f} s"
  )
  return 0


@_command
def cmd_convert(args, out: Console, err: Console) -> int:
  from ucp_jax import _convert

  with progress_bar(err) as bar:
    task = bar.add_task("convert", total=None, item="")

    def on_array(key: str, nbytes: int, total: int) -> None:
      bar.update(task, total=total, advance=nbytes, item=key)

    report = _convert.convert(args.src, args.dst, overwrite=args.overwrite, progress=on_array)
  out.print(
    f"{report.dst}: {report.params} params, {report.arrays} arrays, {_human(report.bytes)}, "
    f"step {report.step}, in {report.seconds:.2f} s (from {report.format} {report.src})",
    markup=False,
  )
  return 0


@_command
def cmd_export(args, out: Console, err: Console) -> int:
  from ucp_jax import _export

  with progress_bar(err) as bar:
    task = bar.add_task("export", total=None, item="")

    def on_item(item: str, nbytes: int, total: int) -> None:
      bar.update(task, total=total, advance=nbytes, item=item)

    report = _export.export(
      args.checkpoint,
      args.dst,
      format=args.format,
      zero_stage=args.zero_stage,
      tag=args.tag,
      overwrite=args.overwrite,
      rules=_rule_set(args.rules),
      progress=on_item,
    )
  stages = "/".join(str(s) for s in report.zero_stages)
  out.print(
    f"{report.path}: DeepSpeed universal checkpoint {report.tag} (step {report.step}) for "
    f"ZeRO-{stages} targets: {report.params} trainable params, {len(report.frozen)} frozen, "
    f"{len(report.buffers)} buffers, {len(report.tied)} tied; {_human(report.nbytes)} in "
    f"{report.seconds:.2f} s",
    markup=False,
  )
  for note in report.notes:
    out.print(f"  note: {note}", markup=False)
  return 0


def _rule_set(spec: str | None):
  """`gpt2:num_heads=4` -> `ucp_jax.rules.gpt2(num_heads=4)`."""
  if not spec:
    return None
  from ucp_jax import rules

  name, _, options = spec.partition(":")
  factory = {"gpt2": rules.gpt2, "llama": rules.llama}.get(name)
  if factory is None:
    raise _errors.MappingError(f"--rules {spec!r}: ready rule sets are gpt2 and llama")
  kwargs = {}
  for item in filter(None, options.split(",")):
    key, _, value = item.partition("=")
    try:
      kwargs[key] = value.lower() == "true" if value.lower() in ("true", "false") else int(value)
    except ValueError:
      raise _errors.MappingError(f"--rules {spec!r}: {key}={value!r} is not an integer") from None
  try:
    return factory(**kwargs)
  except TypeError as e:
    raise _errors.MappingError(f"--rules {spec!r}: {e}") from None


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
  p = sub.add_parser("convert", help="a DeepSpeed checkpoint -> a universal checkpoint")
  p.add_argument("src", help="DeepSpeed checkpoint folder, tag folder or universal folder")
  p.add_argument("dst", help="where the universal checkpoint goes")
  p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
  p = sub.add_parser("export", help="a universal checkpoint -> DeepSpeed (load_universal)")
  p.add_argument("checkpoint", help="a checkpoint with a parameter schema")
  p.add_argument("dst", help="where the DeepSpeed universal checkpoint goes")
  p.add_argument("--format", default="deepspeed", choices=["deepspeed"])
  p.add_argument(
    "--zero-stage", type=int, choices=[1, 2, 3], help="target ZeRO stage (default: all)"
  )
  p.add_argument("--tag", help="checkpoint tag (default: global_step<N>)")
  p.add_argument("--overwrite", action="store_true", help="replace an export at DST")
  p.add_argument(
    "--rules",
    help="for a Flax-named checkpoint: a ready rule set and its options, e.g. gpt2:num_heads=4 "
    "or llama:num_heads=8,num_kv_heads=2",
  )
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
  except (_errors.UcpError, ValueError) as e:  # bad input: one line, no traceback
    err.print("[red]error:[/red]", escape(str(e)), highlight=False)
    return 2


if __name__ == "__main__":
  sys.exit(main())
