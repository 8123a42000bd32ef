"""The `ucp` command line: its arguments, and `main`, which runs one subcommand.

The subcommands themselves are in `_commands`; progress output is `_progress`'s.
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console
from rich.markup import escape

from ucp_jax.base import _errors
from ucp_jax.cli import _export_flags, _native_logs

_PIPED_WIDTH = 1 << 16
"""Columns of output to a pipe or file: wide enough that no line wraps (a script reads it)."""


def _positive(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
  return value


def _version() -> str:
  from importlib import metadata

  try:
    return metadata.version("ucp_jax")
  except metadata.PackageNotFoundError:  # run from a source tree that was not installed
    return "(not installed)"


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
  """The `ucp` argument parser: one subparser per command. The export formats' flags come
  from their sinks' `Options`, which are imported only when `argv` (None: any) may run
  `export`: `ucp --help` imports no sink."""
  parser = argparse.ArgumentParser(
    prog="ucp",
    description="Universal checkpoints for JAX.",
    epilog="exit status: 0 done; 1 verify found bad arrays (or the demo's runs diverged); "
    "2 bad input or a failed command; 130 interrupted; diff: 1 when the checkpoints differ",
  )
  parser.add_argument("--version", action="version", version=f"ucp_jax {_version()}")
  sub = parser.add_subparsers(dest="command", required=True)
  _add_inspect_and_verify(sub)
  _add_convert(sub)
  _add_export(sub, sink_flags=argv is None or "export" in argv)
  _add_diff(sub)
  p = sub.add_parser("demo", help="train, save, restore onto other meshes, compare with no restart")
  p.add_argument("--out", default="demo_out", help="where the checkpoints go (default: demo_out)")
  p.add_argument("--steps", type=_positive, default=20, help="training steps per leg (default: 20)")
  return parser


def _add_inspect_and_verify(sub) -> None:
  p = sub.add_parser(
    "inspect", help="list a checkpoint's arrays (key, shape, dtype, bytes); any source format"
  )
  p.add_argument("checkpoint")
  p.add_argument("--json", action="store_true", help="machine-readable output")
  p.add_argument("--from", dest="source", help="read it as this format (deepspeed, hf, torch, ...)")
  p = sub.add_parser("verify", help="read every chunk, check checksums against the manifest")
  p.add_argument("checkpoint")


def _add_convert(sub) -> None:
  from ucp_jax.sources import _registry as sources

  p = sub.add_parser("convert", help="a checkpoint of another format -> a universal checkpoint")
  p.add_argument("src", help="a DeepSpeed, Megatron, Hugging Face, torch, DCP or Orbax checkpoint")
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
    "--iteration",
    help="a Megatron-LM root: the iteration to read, a number or 'release' (default: the latest)",
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


def _add_export(sub, sink_flags: bool) -> None:
  from ucp_jax.sinks import _registry as sinks

  p = sub.add_parser("export", help="a checkpoint -> another framework's format")
  p.add_argument("checkpoint", help="a checkpoint with a parameter schema")
  p.add_argument("dst", help="where the export goes")
  p.add_argument("--format", required=True, choices=sorted(sinks.SINKS), help="the format to write")
  p.add_argument(
    "--config",
    help="the model's Hugging Face config.json, which --rules hf reads and --format hf writes "
    "into the folder (default: the one the checkpoint recorded)",
  )
  if sink_flags:
    _export_flags.add(p)
  p.add_argument(
    "--option",
    action="append",
    metavar="KEY=VALUE",
    help="an option of the format as JSON (docs/export.md), e.g. ocdbt=false for orbax",
  )
  p.add_argument("--overwrite", action="store_true", help="replace an export at DST")
  p.add_argument("--rules", help=_RULES_HELP)


_RULES_HELP = (
  "for a Flax-named checkpoint: a rule set and its options: a ready one "
  "(gpt2:num_heads=4, llama:num_heads=8,num_kv_heads=2, hf_gpt2:..., hf_llama:...), hf "
  "(from the config.json: hf:config=PATH, --config, or the checkpoint's own; options "
  "stacked, prefix), or module:function[:key=value,...] (any function returning a RuleSet)"
)


def _add_diff(sub) -> None:
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


def main(argv: list[str] | None = None) -> int:
  """Runs `ucp ARGV...`; returns its exit status (the epilog of `ucp --help` lists them)."""
  from ucp_jax.base import _startup

  err = Console(stderr=True, highlight=False, soft_wrap=True)
  try:
    _startup.done()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    out = Console(
      highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else _PIPED_WIDTH
    )
    if args.command != "inspect":  # inspect reads a manifest: names, shapes, sizes
      import ml_dtypes  # noqa: F401  (numpy knows bfloat16 and the float8 types by name)
    from ucp_jax.cli import _commands  # after parsing: `ucp --help` imports no TensorStore

    with _native_logs.filtered():
      return _commands.COMMANDS[args.command](args, out, err)
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


def run() -> None:
  """The `ucp` script: `main`, then exit. After Ctrl-C the process ends at once: a thread of
  the I/O pools may still wait on a store that does not answer, and the interpreter's exit
  would join it first."""
  code = main()
  if code == 130:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)
  sys.exit(code)


if __name__ == "__main__":
  run()
