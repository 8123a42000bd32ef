"""Direct reads: byte runs of local files read with `pread` into host buffers, on the I/O pool.

A checkpoint that reads its own files (a ucp_jax checkpoint's chunk and bundle files:
`_direct`; another format's tensors: `sources/_file_reads`) answers `Checkpoint.start_read`
with `start_read` here. Its format turns the regions asked for into `Task`s; `start_read`
gives each region an aligned host buffer that a CPU device can adopt (`_hostmem`), runs the
tasks on the local I/O pool (`_threads`) and returns the buffers with one wait. A task reads
each run of bytes with `read_full` straight into the final buffer where the run lands
contiguously there, else into a block it copies out; what its format checks (sizes, chunk
checksums, a file replaced since it was opened) it checks around those reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ucp_jax.store import _hostmem, _regions, _threads

MAX_READ = 1 << 30
"""The most one `preadv` is asked for: Linux moves at most ~2 GiB per call; stay well below."""


class Task(NamedTuple):
  """One read task: `fill([buffers of users], *args)` fills (parts of) those buffers."""

  fill: Callable[..., None]
  users: tuple[int, ...]
  args: tuple


def start_read(
  regions: Sequence[_regions.Region], dtype, tasks: Sequence[Task]
) -> tuple[list[np.ndarray], Callable[[], None]]:
  """Starts `tasks`, reading `regions` of one array into new aligned host buffers.

  Returns the buffers, one per region, and a function that waits for every task (raising
  the first failure, in order).
  """
  dtype = np.dtype(dtype)
  outs = [_hostmem.aligned_empty(tuple(s.stop - s.start for s in r), dtype) for r in regions]
  futures = [
    _threads.submit(task.fill, [outs[u] for u in task.users], *task.args) for task in tasks
  ]
  return outs, lambda: _threads.wait_all(futures)


def byte_view(out: np.ndarray) -> memoryview:
  """The bytes of the C-contiguous `out`, writable."""
  if not out.size:
    return memoryview(bytearray())
  return memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy<3.12 stubs


def read_full(fd: int, at: int, view: memoryview) -> int:
  """Fills `view` from byte `at` of the open file `fd` with `preadv` (the one read loop of
  direct reads); returns the bytes read: fewer than `view` holds where the file ends first."""
  done = 0
  while done < view.nbytes:
    got = os.preadv(fd, [view[done : done + MAX_READ]], at + done)
    if got == 0:
      break
    done += got
  return done
