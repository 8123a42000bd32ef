"""Progress of the `ucp` command's long operations, and byte counts in human units."""

from __future__ import annotations

import threading
import time

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn


def human(nbytes: float) -> str:
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
  print nothing and long ones show they are alive: while an item larger than the others takes
  its time, a line every `interval` says how long the operation has run, so a log never looks
  stalled at the last item that finished.
  """

  interval = 10.0

  def __init__(self, console: Console, description: str, total: int | None = None):
    self._console = console
    self._description = description
    self._total = total
    self._done = 0
    self._bar = None
    self._start = self._last = time.monotonic()
    self._stop = threading.Event()
    self._ticker: threading.Thread | None = None
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
    elif self.interval > 0:
      self._ticker = threading.Thread(target=self._tick, name="ucp-progress", daemon=True)
      self._ticker.start()
    return self

  def __exit__(self, *exc) -> None:
    if self._bar is not None:
      self._bar.stop()
    self._stop.set()
    if self._ticker is not None:
      self._ticker.join()

  def update(self, item: str, nbytes: int, total: int | None = None) -> None:
    self._done += nbytes
    self._total = total if total is not None else self._total
    if self._bar is not None:
      self._bar.update(self._task, total=self._total, advance=nbytes, item=item)
      return
    if time.monotonic() - self._last >= self.interval and nbytes:
      self._line(f"at {item}")

  def beat(self) -> None:
    """The line of an interval in which no item finished (the ticker's, every `interval`)."""
    self._line("working on the next item (each reports when it is done)")

  def _tick(self) -> None:
    while not self._stop.wait(self.interval):
      if time.monotonic() - self._last >= self.interval:
        self.beat()

  def _line(self, what: str) -> None:
    self._last = now = time.monotonic()
    of = f" of {human(self._total)} ({100 * self._done / self._total:.0f}%)" if self._total else ""
    self._console.print(
      f"{self._description}: {human(self._done)}{of} in {now - self._start:.0f} s, {what}",
      markup=False,
      highlight=False,
    )
