"""The `ucp` subcommands: each `cmd_NAME(args, out, err)` runs one and returns its exit status."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ucp_jax import _rule_specs
from ucp_jax.base import _errors
from ucp_jax.cli._progress import Reporter, human
from ucp_jax.store import _checkpoint, _reader
from ucp_jax.store._schema import Schema

COMMANDS: dict[str, Callable[..., int]] = {}
"""Subcommand name -> its function (filled by `@_command`)."""


def _command(fn):
  COMMANDS[fn.__name__.removeprefix("cmd_")] = fn
  return fn


def _open(path: str, source: str | None = None) -> _checkpoint.Checkpoint:
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
  for col in ("key", "shape", "dtype"):
    table.add_column(col, justify="left")
  table.add_column("bytes", justify="right")
  for key in ckpt.keys():
    info = m.arrays[key]
    dtype = info.dtype if info.kind == "array" else f"{info.dtype} ({info.kind})"
    table.add_row(key, str(info.shape), dtype, human(info.nbytes))
  table.add_section()
  table.add_row(f"{len(m.arrays)} arrays", "", "", human(m.nbytes))
  out.print(table)
  for line in _schema_lines(m.typed_schema):
    out.print(line, markup=False)
  framework = m.source.get("framework", "?")
  if not ckpt.checksummed:
    out.print(f"format: {m.source['format']}, read in place (`ucp convert` makes a copy)")
  else:
    out.print(f"source: {framework}; created {m.created}; format v{m.format_version}")
  return 0


def _schema_lines(schema: Schema | None) -> list[str]:
  """What a parameter schema says, in a few lines: the parameters, the optimizer, its groups."""
  if schema is None:
    return []
  params = list(schema.params.values())
  frozen = sum(1 for p in params if p.frozen)
  optimizer = schema.optimizer
  state = (
    f"optimizer {optimizer.type}, step {optimizer.step}"
    if optimizer is not None
    else "no optimizer state (weights alone)"
  )
  lines = [f"parameters: {len(params)} ({frozen} frozen), named the {schema.naming} way; {state}"]
  for i, group in enumerate(() if optimizer is None else optimizer.groups):
    members = sum(1 for p in params if p.group == i and not p.frozen)
    shown = ", ".join(f"{k} {v}" for k, v in group.values.items())
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
    f"{ckpt.location}: OK, {len(ckpt.keys())} arrays, {human(ckpt.nbytes)} "
    f"{'read and checksummed' if ckpt.checksummed else 'read'} in {seconds:.2f} s"
  )
  return 0


@_command
def cmd_convert(args, out: Console, err: Console) -> int:
  from ucp_jax.cli import _processes
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
        **_iteration(args.iteration),
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
    f"{report.dst}: {report.params} params, {report.arrays} arrays, {human(report.bytes)}, "
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
  if args.iteration is not None:
    argv += ["--iteration", args.iteration]
  return argv


@_command
def cmd_export(args, out: Console, err: Console) -> int:
  from ucp_jax.cli import _export_flags
  from ucp_jax.sinks import _export
  from ucp_jax.sinks import _registry as sinks

  rules = _rule_specs.parse(args.rules, args.checkpoint, args.config)
  flags = _export_flags.sink_flags()
  options = {k: getattr(args, k) for k in flags if getattr(args, k, None) is not None}
  if args.config is not None:  # the model's config.json: for the rules, the folder, or both
    writes = "config" in sinks.option_names(sinks.get(args.format))
    if writes:
      options["config"] = args.config
    elif not _rule_specs.reads_config(args.rules):
      raise _errors.InvalidArgumentError(
        f"--config: the model's Hugging Face config.json, which --rules hf reads and "
        f"--format hf writes; format {args.format!r} without --rules hf has no use for it"
      )
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
    f"{report.path}: {report.summary}; {human(report.nbytes)} in {report.seconds:.2f} s",
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


def _iteration(value: str | None) -> dict:
  """`--iteration N` (or `release`): the Megatron source's `iteration` option."""
  if value is None:
    return {}
  if value != "release" and not value.isdigit():
    raise _errors.InvalidArgumentError(
      f"--iteration {value!r}: an iteration number (as in iter_0000100) or 'release'"
    )
  return {"iteration": value if value == "release" else int(value)}


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
  from ucp_jax.cli import _demo

  result = _demo.run(args.out, steps=args.steps, log=lambda line: out.print(line, markup=False))
  ok = result["exact_restore"] and result["max_rel_diff"] <= _demo.TOLERANCE
  out.print("[green]PASS[/green]" if ok else "[red]FAIL[/red]: the runs diverged")
  return 0 if ok else 1
