"""The log lines of C++ libraries, kept out of what the `ucp` command prints.

TensorStore logs through Abseil straight to the process's standard error, below Python and
with no setting to turn it off: reading `gs://` without credentials prints an `E1201 ...
google_auth_provider.cc:188] Could not find the credentials file ...` line before ucp_jax's
own one-line error says the same in its words. While a command runs with its standard error
in a file or a pipe (a log, CI), file descriptor 2 is a pipe whose lines are passed on unless
they are in Abseil's format (`[IWEF]mmdd hh:mm:ss.us thread file:line] ...`, and its "before
absl::InitializeLog()" notice); on a terminal, where progress bars redraw partial lines, they
are left alone. Python's own Abseil logging (Orbax's warnings) is set to errors only, always.
`UCP_NATIVE_LOGS=1` keeps everything.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

_ABSL_LINE = re.compile(
  rb"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
  rb"STDERR|[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]\n]+\] )"
)


@contextlib.contextmanager
def filtered() -> Iterator[None]:
  """Runs the body with Abseil's lines dropped from file descriptor 2 (not a terminal's)."""
  if os.environ.get("UCP_NATIVE_LOGS") == "1":
    yield
    return
  _quiet_python_absl()
  if os.isatty(2):
    yield
    return
  sys.stderr.flush()
  original = os.dup(2)
  read, write = os.pipe()
  os.dup2(write, 2)
  os.close(write)
  pump = threading.Thread(target=_pass_on, args=(read, original), daemon=True)
  pump.start()
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(original, 2)  # the pipe's last writer closed: the pump sees its end
    pump.join(timeout=10)
    os.close(original)


def _pass_on(read: int, out: int) -> None:
  with os.fdopen(read, "rb", buffering=0) as pipe:
    pending = b""
    while chunk := pipe.read(1 << 16):
      lines = (pending + chunk).split(b"\n")
      pending = lines.pop()
      kept = [line + b"\n" for line in lines if not _ABSL_LINE.match(line)]
      if kept:
        os.write(out, b"".join(kept))
    if pending and not _ABSL_LINE.match(pending):
      os.write(out, pending)


def _quiet_python_absl() -> None:
  try:
    from absl import logging as absl_logging
  except ImportError:
    return
  absl_logging.set_verbosity(absl_logging.ERROR)
