"""Ctrl-C while the `ucp` command is still importing (seconds: TensorStore, JAX).

The command's `main` answers Ctrl-C with "interrupted" and exit status 130, but it runs only
once the package is imported; before, Python would print a traceback. While the `ucp` console
script imports the package, Ctrl-C ends it the same way. A program that imports ucp_jax keeps
its own handler: this applies only to the `ucp` script.
"""

import os
import signal
import sys

_CLI = bool(sys.argv) and os.path.basename(sys.argv[0]) in ("ucp", "ucp.exe")
IS_CLI = _CLI
"""Whether this process is the `ucp` command (which imports what each command needs)."""
_previous = None


def _interrupted(signum, frame) -> None:
  sys.stderr.write("interrupted\n")
  os._exit(130)


if _CLI:
  _previous = signal.signal(signal.SIGINT, _interrupted)


def done() -> None:
  """The command runs (`cli._main.main`): Ctrl-C is its own to handle from here on."""
  global _CLI
  if _CLI:
    signal.signal(signal.SIGINT, _previous)
    _CLI = False
