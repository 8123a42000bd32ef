"""The `ucp` command line, the package's top layer: `ucp inspect | convert | export | verify |
diff | demo`.

`main(argv)` runs one subcommand and returns its exit status; `run()` is the console
script. Both load the command's modules on first use: `ucp --help` imports no TensorStore.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
  """Runs the `ucp` command with `argv` (default: `sys.argv[1:]`); returns its exit status."""
  from ucp_jax.cli import _main

  return _main.main(argv)


def run() -> None:
  """The `ucp` console script: `main`, then exit with its status."""
  from ucp_jax.cli import _main

  _main.run()


def build_parser() -> argparse.ArgumentParser:
  """The command's argument parser."""
  from ucp_jax.cli import _main

  return _main.build_parser()
