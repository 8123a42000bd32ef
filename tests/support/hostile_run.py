"""Runs hostile checkpoints through every entry point, in one limited process per batch.

A corpus is a list of `Case`s: each makes a hostile checkpoint (a folder or a file) under a
directory and says what must happen. `run_batch` makes them all, then runs every case through
every entry point a user has (`ucp inspect`, `verify`, `convert`, `diff`, `open().read` of every
key, `restore` to numpy and onto an 8-device mesh) inside one subprocess that runs under an
address-space limit, with a watchdog per call: a signal, an abort, a hang or a blowup of memory
ends the batch, and the batch's report names the case and entry point that was running.

Each call's outcome is checked here:
- `refused`: a `UcpError` (the CLI: exit 2) with one line that names the file given by the case,
  no traceback, and no write beside the destination;
- `ok`: it worked;
- `either`: refused as above, or worked (a hostile input that a reader may also simply read).
Calls not named by a case are `refused` when the case says `default="refused"`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ENTRY_POINTS = ("inspect", "verify", "convert", "diff", "read", "restore", "restore_mesh")
MEMORY = 6 << 30
"""The address space a batch may take (JAX and TensorStore reserve about 2 GiB at start)."""
CALL_SECONDS = 60
"""A call that takes longer is a hang (real calls here take well under a second)."""


@dataclasses.dataclass
class Case:
  """One hostile input.

  Attributes:
    name: what it is, as test output shows it.
    make: writes the input below the directory it is given and returns its path (a folder or
      a file, the path a user would give `ucp`).
    names: a path (relative to that directory) that every refusal must name; defaults to what
      `make` returned.
    expect: entry point -> `refused`, `ok` or `either`; entry points left out get `default`.
    pattern: a regular expression every refusal message must match.
    source: `--source` / `source=` to pass (None: sniffed).
  """

  name: str
  make: Callable[[Path], Path]
  names: str | None = None
  expect: dict[str, str] = dataclasses.field(default_factory=dict)
  default: str = "refused"
  pattern: str | None = None
  source: str | None = None

  def outcome(self, entry: str) -> str:
    return self.expect.get(entry, self.default)


def run_batch(cases: list[Case], root: Path, entries: tuple[str, ...] = ENTRY_POINTS) -> list[str]:
  """Runs every case through `entries`; returns what went wrong (empty when all went right)."""
  jobs = []
  for i, case in enumerate(cases):
    folder = root / f"case{i}"
    folder.mkdir(parents=True)
    path = case.make(folder)
    named = str(folder / case.names) if case.names else str(path)
    for entry in entries:
      if case.outcome(entry) is None:
        continue
      jobs.append(
        {
          "case": case.name,
          "entry": entry,
          "path": str(path),
          "source": case.source,
          "dst": str(folder / f"dst-{entry}"),
          "names": named,
        }
      )
  spec = root / "jobs.json"
  spec.write_text(json.dumps(jobs))
  run = subprocess.run(
    [sys.executable, str(Path(__file__).with_name("hostile_worker.py")), str(spec), str(MEMORY)],
    capture_output=True,
    text=True,
    timeout=CALL_SECONDS * 3 + 30 * len(jobs),
    cwd=root,
  )
  results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
  problems = []
  if run.returncode != 0:
    started = [r for r in results if "start" in r]
    last = started[-1]["start"] if started else "before any case"
    problems.append(
      f"the batch ended with {_exit_name(run.returncode)} while running {last}:\n"
      f"{run.stderr[-4000:]}"
    )
  by_case = {c.name: c for c in cases}
  for r in results:
    if "start" in r:
      continue
    problem = _judge(by_case[r["case"]], r)
    if problem:
      problems.append(f"{r['case']} / {r['entry']}: {problem}")
  return problems


def _exit_name(code: int) -> str:
  if code < 0:
    return f"signal {-code}"
  return f"exit {code}" + (" (a hang: the watchdog fired)" if code == 3 else "")


def _judge(case: Case, r: dict) -> str | None:
  want = case.outcome(r["entry"])
  if r["outcome"] == "bug":
    return f"a traceback, not an error line:\n{r['message'][-3000:]}"
  if r.get("wrote_beside"):
    return f"left files beside the destination: {r['wrote_beside']}"
  if r["outcome"] == "ok":
    return None if want in ("ok", "either") else "it worked; it must be refused"
  message = r["message"]
  if want == "ok":
    return f"refused; it must work: {message}"
  lines = message.strip().splitlines()
  if r["entry"] == "verify":  # a report: a line for the checkpoint, then one per bad array
    lines = lines[:1] if len(lines) == 2 else lines
  if len(lines) != 1:
    return f"a refusal of {len(lines)} lines, not one:\n{message}"
  if r["names"] not in message:
    return f"the refusal does not name {r['names']}: {message}"
  if case.pattern and not re.search(case.pattern, message):
    return f"the refusal does not say /{case.pattern}/: {message}"
  return None
