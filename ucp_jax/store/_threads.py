"""The package's I/O thread pools: the one place that starts threads for file and network work.

Two pools, because their tasks wait on different things:
- `submit` runs local work that releases the GIL: chunk file reads and writes, fsyncs,
  links, and numpy copies between host buffers (a reshard's slices). It is sized to keep
  the disk busy while the cores copy: `IO_THREADS`.
- `fetch` runs requests to object stores, which wait on the network, not on a core:
  `FETCH_THREADS` of them may be in flight whatever the core count.
"""

from __future__ import annotations

import concurrent.futures
import os

IO_THREADS = max(4, 2 * (os.cpu_count() or 1))
"""Threads for local I/O and copies: two per core (while one waits on the disk or the page
cache, the other copies), and at least 4 so that a small VM still queues several requests."""
FETCH_THREADS = 16
"""Object-store range requests in flight at once (each waits on the network, not on a core)."""

_IO = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="ucp_io")
_FETCH = concurrent.futures.ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="ucp_fetch")


def submit(fn, *args) -> concurrent.futures.Future:
  """Runs `fn(*args)` on the local I/O pool."""
  return _IO.submit(fn, *args)


def submit_or_run(fn, *args) -> concurrent.futures.Future:
  """`submit`, or, once the interpreter is shutting down (the pool takes no more work), runs
  `fn(*args)` here and returns its outcome as a future."""
  try:
    return _IO.submit(fn, *args)
  except RuntimeError:
    done: concurrent.futures.Future = concurrent.futures.Future()
    try:
      done.set_result(fn(*args))
    except Exception as e:
      done.set_exception(e)
    return done


def fetch(fn) -> concurrent.futures.Future:
  """Runs `fn()`, a request to an object store, on the pool of range requests."""
  return _FETCH.submit(fn)


def wait_all(futures) -> None:
  """Waits for every future, raising the first failure (in order)."""
  for future in futures:
    future.result()
