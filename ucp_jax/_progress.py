"""Progress of the `ucp` command's long operations, and byte counts in human units."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn


def human(nbytes: int) -> str:
  """`nbytes` in B, KiB, MiB, GiB or TiB (one decimal above bytes)."""
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
        f" of {human(self._total)} ({100 * self._done / self._total:.0f}%)" if self._total else ""
      )
      self._console.print(
        f"{self._description}: {human(self._done)}{of}, at {item}", markup=False, highlight=False
      )
