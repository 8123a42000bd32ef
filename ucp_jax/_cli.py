"""The `ucp` command line: inspect, verify, convert and export checkpoints."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ucp_jax import _errors, _native_logs, _rule_specs
from ucp_jax.store import _reader

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


class Reporter:
  """Progress of one long operation on stderr: a live bar on a terminal, else a line now and then.

  `update(item, nbytes, total)` after each item. Where stderr is not a terminal (a log file, a
  batch job), a plain line is printed at most every `interval` seconds, so short operations
  print nothing and long ones show they are alive.
  """

  interval = 10.0

  def __init__(self, console: Console, description: str, total: int | None = None):
    self._console = console
    self._description = description
    self._total = total
    self._done = 0
    self._bar = None
    self._last = time.monotonic()
    if console.is_terminal:
      self._bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TimeRemainingColumn(),
        TextColumn("{task.fields[item]}"),
        console=console,
        transient=True,
      )
      self._task = self._bar.add_task(description, total=total, item="")

  def __enter__(self) -> Reporter:
    if self._bar is not None:
      self._bar.start()
    return self

  def __exit__(self, *exc) -> None:
    if self._bar is not None:
      self._bar.stop()

  def update(self, item: str, nbytes: int, total: int | None = None) -> None:
    self._done += nbytes
    self._total = total if total is not None else self._total
    if self._bar is not None:
      self._bar.update(self._task, total=self._total, advance=nbytes, item=item)
      return
    now = time.monotonic()
    if now - self._last >= self.interval and nbytes:
      self._last = now
      of = (
        f" of {_human(self._total)} ({100 * self._done / self._total:.0f}%)" if self._total else ""
      )
      self._console.print(
        f"{self._description}: {_human(self._done)}{of}, at {item}", markup=False, highlight=False
      )


def _open(path: str, source: str | None = None) -> _reader.Checkpoint:
  """Opens a ucp_jax checkpoint, or any other format a source recognizes (read-only).

  A folder that is neither is explained by the sources (what each looks for, what is there),
  not as a ucp_jax checkpoint missing its manifest.
  """
  try:
    return _reader.open(path, source=source)
  except _errors.CheckpointNotFoundError:
    from ucp_jax.sources import _registry
    from ucp_jax.store import _location

    ours = os.path.isdir(path) and (
      os.path.lexists(os.path.join(path, "manifest.json")) or _location.staging_dirs(path)
    )
    if "://" in str(path) or not os.path.isdir(path) or ours:
      raise  # no folder, a file, or a save's (unfinished, or staged): said as it is
    _registry.find(path)  # raises what no source recognized
    raise


@_command
def cmd_inspect(args, out: Console, err: Console) -> int:
  ckpt = _open(args.checkpoint, args.source)
  m = ckpt.manifest
  if args.json:
    data = {
      "path": str(ckpt.location),
      "step": m.step,
      "format_version": m.format_version,
      "created": m.created,
      "source": m.source,
      "metadata": m.metadata,
      "arrays": {
        k: {**m.arrays[k].to_json(checksums=False), "bytes": m.arrays[k].nbytes}
        for k in ckpt.keys()
      },
      "total_arrays": len(m.arrays),
      "total_bytes": m.nbytes,
      "schema": m.schema,
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
  for line in _schema_lines(m.schema):
    out.print(line, markup=False)
  framework = m.source.get("framework", "?")
  if not ckpt.checksummed:
    out.print(f"format: {m.source['format']}, read in place (`ucp convert` makes a copy)")
  else:
    out.print(f"source: {framework}; created {m.created}; format v{m.format_version}")
  return 0


def _schema_lines(schema: dict | None) -> list[str]:
  """What a parameter schema says, in a few lines: the parameters, the optimizer, its groups."""
  if not isinstance(schema, dict) or not isinstance(schema.get("params"), dict):
    return []
  params = [p for p in schema["params"].values() if isinstance(p, dict)]
  frozen = sum(1 for p in params if p.get("frozen"))
  optimizer = schema.get("optimizer") if isinstance(schema.get("optimizer"), dict) else {}
  lines = [
    f"parameters: {len(params)} ({frozen} frozen), named the {schema.get('naming', 'torch')} "
    f"way; optimizer {optimizer.get('type', '?')}, step {optimizer.get('step')}"
  ]
  groups = optimizer.get("groups") if isinstance(optimizer.get("groups"), list) else []
  for i, group in enumerate(groups):
    members = sum(1 for p in params if p.get("group") == i and not p.get("frozen"))
    shown = ", ".join(f"{k} {v}" for k, v in group.items()) if isinstance(group, dict) else group
    lines.append(f"  group {i}: {members} parameters; {shown or 'no hyperparameters recorded'}")
  return lines


@_command
def cmd_verify(args, out: Console, err: Console) -> int:
  ckpt = _open(args.checkpoint)
  start = time.perf_counter()
  with Reporter(err, "verify", ckpt.nbytes) as progress:
    problems = ckpt.verify(progress.update)
  seconds = time.perf_counter() - start
  if problems:
    out.print(f"[red]{escape(str(ckpt.location))}: {len(problems)} bad array(s):")
    for key, problem in problems.items():
      out.print(f"  {key}: {problem}", markup=False)
    return 1
  out.print(
    f"{ckpt.location}: OK, {len(ckpt.keys())} arrays, {_human(ckpt.nbytes)} "
    f"{'read and checksummed' if ckpt.checksummed else 'read'} in {seconds:.2f} s"
  )
  return 0


@_command
def cmd_convert(args, out: Console, err: Console) -> int:
  from ucp_jax import _processes
  from ucp_jax.sources import _convert

  _outlives_process(args.dst)
  helpers, joined = None, False
  if args.processes is not None:
    if args.coordinator is not None or args.processes < 1:
      raise _errors.UcpError("--processes N (N >= 1) starts a run here; --coordinator joins one")
    if args.processes > 1:
      args.coordinator = f"127.0.0.1:{_processes.free_port()}"
      args.num_processes = args.processes
      args.process_id = 0
  if args.coordinator is not None and (args.num_processes is None or args.process_id is None):
    raise _errors.UcpError("--coordinator needs --num-processes and --process-id")
  try:
    if args.processes is not None and args.processes > 1:
      helpers = _processes.Helpers(_convert_argv(args), args.processes)
    if args.coordinator is not None:
      _processes.join(args.coordinator, args.num_processes, args.process_id)
      joined = True
    with Reporter(err, "convert") as progress:
      report = _convert.convert(
        args.src,
        args.dst,
        source=args.source,
        overwrite=args.overwrite,
        progress=progress.update,
        **_options(args.option),
      )
  except KeyboardInterrupt:
    if helpers is not None:
      helpers.kill()
    if joined:  # jax's own exit would wait for the processes just stopped
      _processes.exit_now(err, 130)
    raise
  except BaseException:
    if helpers is not None and not joined:  # they wait for a run that never started
      helpers.kill()
    raise
  finally:  # a failure reached every process (the save agrees on it): all leave together
    if joined and sys.exc_info()[0] is not KeyboardInterrupt:
      _processes.leave()
    failed = helpers.wait() if helpers is not None else []
  if failed:
    raise _errors.UcpError("conversion helpers failed:\n" + _errors.bullet_list(failed))
  by = f" by {report.processes} processes" if report.processes > 1 else ""
  out.print(
    f"{report.dst}: {report.params} params, {report.arrays} arrays, {_human(report.bytes)}, "
    f"step {report.step}, in {report.seconds:.2f} s{by} (from {report.format} {report.src})",
    markup=False,
  )
  return 0


def _convert_argv(args) -> list[str]:
  """The command line of a helper of `args`'s conversion (its --process-id added later)."""
  argv = ["convert", args.src, args.dst]
  argv += ["--coordinator", args.coordinator, "--num-processes", str(args.num_processes)]
  if args.source:
    argv += ["--from", args.source]
  if args.overwrite:
    argv.append("--overwrite")
  for option in args.option or ():
    argv += ["--option", option]
  return argv


@_command
def cmd_export(args, out: Console, err: Console) -> int:
  from ucp_jax.sinks import _export

  rules = _rule_specs.parse(args.rules, args.checkpoint, args.config)
  names = ("zero_stage", "tag", "config", "max_shard_size", "dtype")
  options = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
  options.update(_options(args.option))
  with Reporter(err, "export") as progress:
    report = _export.export(
      args.checkpoint,
      args.dst,
      format=args.format,
      overwrite=args.overwrite,
      rules=rules,
      progress=progress.update,
      **options,
    )
  out.print(
    f"{report.path}: {report.summary}; {_human(report.nbytes)} in {report.seconds:.2f} s",
    markup=False,
  )
  for note in report.notes:
    out.print(f"  note: {note}", markup=False)
  return 0


_SHOWN = 20  # keys present on one side only, listed before "... and N more"
_ROWS = 50  # arrays in diff's table


@_command
def cmd_diff(args, out: Console, err: Console) -> int:
  from ucp_jax import _diff

  rules = _rule_specs.parse(args.rules, args.b, args.config, flax_side=args.a)
  with Reporter(err, "diff") as progress:
    report = _diff.diff(
      args.a,
      args.b,
      rules=rules,
      subtree=args.subtree,
      atol=args.atol,
      rtol=args.rtol,
      progress=progress.update,
    )
  if args.json:
    data = dataclasses.asdict(report) | {"verdict": report.verdict()}
    out.print_json(json.dumps(data, default=str))
    return 0 if report.same_within_tolerance else 1
  for where, keys in ((report.a, report.only_a), (report.b, report.only_b)):
    for key in keys[:_SHOWN]:
      out.print(f"  only in {where}: {key}", markup=False)
    if len(keys) > _SHOWN:
      out.print(f"  ... and {len(keys) - _SHOWN} more only in {where} (--json lists all)")
  shown = report.differing if not args.all else report.arrays
  if shown:
    table = Table(title_justify="left")
    for col in ("key", "max abs", "max rel", "elements off", "note"):
      table.add_column(col, justify="left" if col in ("key", "note") else "right")
    for d in shown[:_ROWS]:
      table.add_row(
        d.key, f"{d.max_abs:.3g}", f"{d.max_rel:.3g}", str(d.mismatched), d.problem or ""
      )
    out.print(table)
    if len(shown) > _ROWS:
      out.print(f"  ... and {len(shown) - _ROWS} more arrays (--json lists all)", markup=False)
  out.print(report.verdict(), markup=False)
  return 0 if report.same_within_tolerance else 1


def _options(items: list[str] | None) -> dict:
  """`--option key=value` pairs: JSON values (true, 3, "x", {...}), else the text itself."""
  options = {}
  for item in items or []:
    key, sep, value = item.partition("=")
    if not sep or not key.isidentifier():
      raise _errors.InvalidArgumentError(f"--option {item!r}: expected KEY=VALUE")
    try:
      options[key] = json.loads(value)
    except ValueError:
      options[key] = value
  return options


def _outlives_process(dst: str) -> None:
  """A destination that outlives this process: not `memory://`."""
  if dst.startswith("memory://"):
    raise _errors.UcpError(
      f"{dst}: a memory:// checkpoint would vanish when ucp exits; write to a directory or to "
      "a gs:// or s3:// URL"
    )


@_command
def cmd_demo(args, out: Console, err: Console) -> int:
  from ucp_jax import _demo

  result = _demo.run(args.out, steps=args.steps, log=lambda line: out.print(line, markup=False))
  ok = result["exact_restore"] and result["max_rel_diff"] <= 1e-5
  out.print("[green]PASS[/green]" if ok else "[red]FAIL[/red]: the runs diverged")
  return 0 if ok else 1


def _positive(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
  return value


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="ucp",
    description="Universal checkpoints for JAX.",
    epilog="exit status: 0 done; 1 verify found bad arrays (or the demo's runs diverged); "
    "2 bad input or a failed command; 130 interrupted; diff: 1 when the checkpoints differ",
  )
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser(
    "inspect", help="list a checkpoint's arrays (key, shape, dtype, bytes); any source format"
  )
  p.add_argument("checkpoint")
  p.add_argument("--json", action="store_true", help="machine-readable output")
  p.add_argument("--from", dest="source", help="read it as this format (deepspeed, hf, torch, ...)")
  p = sub.add_parser("verify", help="read every chunk, check checksums against the manifest")
  p.add_argument("checkpoint")
  from ucp_jax.sources import _registry as sources

  p = sub.add_parser("convert", help="a checkpoint of another format -> a universal checkpoint")
  p.add_argument("src", help="a DeepSpeed, Hugging Face, torch, DCP or Orbax checkpoint")
  p.add_argument("dst", help="where the universal checkpoint goes")
  p.add_argument(
    "--from",
    dest="source",
    choices=list(sources.SOURCES),
    help="the source's format (default: found from its files)",
  )
  p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
  p.add_argument(
    "--option",
    action="append",
    metavar="KEY=VALUE",
    help="a source's own option (docs/sources.md), e.g. hyperparams='{\"lr\": 1e-3}'",
  )
  p.add_argument(
    "--processes", type=int, help="convert with N processes on this host (each a share)"
  )
  p.add_argument(
    "--coordinator",
    metavar="HOST:PORT",
    help="join a conversion across hosts: process 0's address (as jax.distributed)",
  )
  p.add_argument("--num-processes", type=int, help="with --coordinator: processes in all")
  p.add_argument("--process-id", type=int, help="with --coordinator: this process's number")
  from ucp_jax.sinks import _registry as sinks

  p = sub.add_parser("export", help="a checkpoint -> another framework's format")
  p.add_argument("checkpoint", help="a checkpoint with a parameter schema")
  p.add_argument("dst", help="where the export goes")
  p.add_argument("--format", required=True, choices=sorted(sinks.SINKS), help="the format to write")
  p.add_argument(
    "--zero-stage", type=int, choices=[1, 2, 3], help="deepspeed: target ZeRO stage (default: all)"
  )
  p.add_argument("--tag", help="deepspeed: checkpoint tag (default: global_step<N>)")
  p.add_argument("--config", help="hf: the model's config.json (default: the one recorded)")
  p.add_argument("--max-shard-size", help="hf: bytes per safetensors file (default: 5GB)")
  p.add_argument("--dtype", help="hf: cast floating-point weights (bfloat16, float16, float32)")
  p.add_argument(
    "--option",
    action="append",
    metavar="KEY=VALUE",
    help="any other option of the format (docs/export.md), e.g. ocdbt=false for orbax",
  )
  p.add_argument("--overwrite", action="store_true", help="replace an export at DST")
  p.add_argument(
    "--rules",
    help="for a Flax-named checkpoint: a rule set and its options: a ready one "
    "(gpt2:num_heads=4, llama:num_heads=8,num_kv_heads=2, hf_gpt2:..., hf_llama:...), hf "
    "(from the config.json: hf:config=PATH, --config, or the checkpoint's own; options "
    "stacked, prefix), or module:function[:key=value,...] (any function returning a RuleSet)",
  )
  p = sub.add_parser(
    "diff", help="compare two checkpoints of any formats array by array (exit 1 if they differ)"
  )
  p.add_argument("a", help="a checkpoint, DeepSpeed folder, Hugging Face folder, ...")
  p.add_argument("b", help="the other one")
  p.add_argument("--rules", help="a rule set mapping B's names onto A's keys (as for export)")
  p.add_argument("--config", help="with --rules hf: the model's config.json (default: B's own)")
  p.add_argument(
    "--subtree", help="with --rules: the key prefix of A's parameters (default: from its schema)"
  )
  p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
  p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
  p.add_argument(
    "--all", action="store_true", help="list every common array, not only those that differ"
  )
  p.add_argument("--json", action="store_true", help="machine-readable output")
  p = sub.add_parser("demo", help="train, save, restore onto other meshes, compare with no restart")
  p.add_argument("--out", default="demo_out", help="where the checkpoints go (default: demo_out)")
  p.add_argument("--steps", type=_positive, default=20, help="training steps per leg (default: 20)")
  return parser


def main(argv: list[str] | None = None) -> int:
  from ucp_jax import _startup

  err = Console(stderr=True, highlight=False, soft_wrap=True)
  try:
    _startup.done()
    args = build_parser().parse_args(argv)
    out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 1 << 16)
    with _native_logs.filtered():
      return _COMMANDS[args.command](args, out, err)
  except (_errors.UcpError, OSError) as e:  # bad input: one message; a bug keeps its traceback
    err.print("[red]error:[/red]", escape(_message(e)), highlight=False)
    return 2
  except KeyboardInterrupt:
    err.print("[red]interrupted[/red]", highlight=False)
    return 130


def _message(error: BaseException) -> str:
  """What went wrong, in the CLI's words (`--overwrite`, not `overwrite=True`)."""
  if isinstance(error, OSError) and not isinstance(error, _errors.UcpError) and error.strerror:
    paths = [p for p in (error.filename, error.filename2) if p is not None]
    return f"{' -> '.join(map(str, paths)) or 'I/O'}: {error.strerror}"
  text = str(error) or type(error).__name__
  return text.replace("pass overwrite=True (--overwrite)", "pass --overwrite").replace(
    "pass overwrite=True", "pass --overwrite"
  )


if __name__ == "__main__":
  sys.exit(main())
