"""Host buffers that CPU devices can adopt without a copy, recycled while they are warm.

A restore or a reshard returns new arrays, and new memory costs the kernel a fault and
a zeroed page for every page before the first byte lands: on a 2-core VM reading 1 GiB
from the page cache into fresh memory takes 1.3-1.4x as long as into touched memory. So
large buffers come from a pool: when the last array over a buffer goes (the device
releases an adopted buffer, or the caller drops a numpy result), the buffer goes back to
the pool, and the next request of the same size gets it with its pages still mapped.
Buffers left unused for `IDLE_SECONDS` are returned to the system, and so are all unused
ones when a request finds none of its size (another workload, whose peak they would only
raise); the pool never keeps more than `pool_limit()` bytes unused.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import mmap
import os
import threading
import time
import weakref

import numpy as np

_ALIGN = 64  # XLA's CPU client aliases host buffers aligned to this many bytes
POOLED_BYTES = 1 << 20
"""Buffers at least this large are pooled; smaller ones come from numpy's allocator."""
IDLE_SECONDS = 10.0
"""How long an unused buffer stays in the pool."""
_PAGE = mmap.PAGESIZE


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """An uninitialized C-contiguous array whose data is 64-byte aligned (page-aligned when
  it comes from the pool)."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if nbytes >= POOLED_BYTES:
    return POOL.take(nbytes).view(dtype).reshape(shape)
  raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
  offset = (-raw.ctypes.data) % _ALIGN
  return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def fresh_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """An uninitialized C-contiguous array in a mapping of its own (page-aligned), outside the
  pool: for buffers that outlive the restore that makes them (the slices devices adopt),
  whose varied sizes would flush the pool's warm read blocks. Unlike numpy's large arrays
  its pages are not advised huge (`_new_block`): on a 2-core VM filling 1 GiB of fresh numpy
  memory took 2.3-3 s, of such a mapping 0.6-0.9 s.
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if nbytes < POOLED_BYTES:
    return aligned_empty(shape, dtype)
  return (
    np.frombuffer(_new_block(-(-nbytes // _PAGE) * _PAGE), np.uint8, nbytes)
    .view(dtype)
    .reshape(shape)
  )


def _new_block(size: int) -> mmap.mmap:
  """A fresh anonymous mapping of `size` bytes (a multiple of the page size); unmapped when
  the last array over it goes.

  No `MADV_HUGEPAGE` (numpy advises it for its large arrays): where the kernel defragments
  for advised regions on fault (THP `defrag` = `madvise`, a common default), a fault may wait
  for memory compaction. On a 2-core VM that made filling 1 GiB of fresh memory take
  0.25-2.8 s, against a steady 0.6-0.9 s in 4 KiB pages.
  """
  return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def pool_limit() -> int:
  """The most unused bytes the pool keeps: a quarter of the memory this process may use
  (physical memory, or a container's cgroup limit where that is lower)."""
  return _memory_bytes() // 4


@functools.lru_cache(maxsize=1)
def _memory_bytes() -> int:
  try:
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError):
    total = 4 << 30
  for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      with open(path) as f:
        limit = f.read().strip()
    except OSError:
      continue
    if limit.isdigit():
      total = min(total, int(limit))
  return total


class _Pool:
  """Anonymous mappings by size, lent as numpy arrays and taken back when those arrays go.

  A buffer comes back wherever its last array goes, even inside a garbage collection that
  an allocation under the pool's lock set off; so coming back takes no lock (a deque append),
  and the buffers that came back are sorted into the free lists by whoever next holds it.
  """

  def __init__(self, clock=time.monotonic, start_timer=None):
    """`clock` tells the time of returns and trims; `start_timer(seconds, fn)` arranges
    for `fn` to run later (a daemon `threading.Timer` by default). Tests pass their own,
    and run `_trim` themselves: nothing then depends on the wall clock."""
    self._clock = clock
    self._start_timer = start_timer or _start_timer
    self._lock = threading.Lock()
    self._returned: collections.deque = collections.deque()  # (size, block, when)
    self._free: dict[int, list[tuple[float, mmap.mmap]]] = {}  # size -> [(freed at, block)]
    self._free_bytes = 0
    self._timer: threading.Timer | None = None

  def take(self, nbytes: int) -> np.ndarray:
    size = -(-nbytes // _PAGE) * _PAGE
    with self._held():
      self._sort_returned()
      blocks = self._free.get(size)
      block = blocks.pop()[1] if blocks else None
      if block is not None:
        self._free_bytes -= size
      else:  # another workload: unused buffers of other sizes would only add to its peak
        unused, self._free, self._free_bytes = self._free, {}, 0
    if block is None:
      del unused  # unmapped here, outside the lock
      block = _new_block(size)
    lease = np.frombuffer(block, np.uint8, nbytes)  # every view of it keeps it alive
    # Not at exit: arrays still alive then may still be read (by atexit handlers, daemon
    # threads), so their buffers must not be lent again.
    weakref.finalize(lease, self._give_back, size, block).atexit = False
    return lease

  def _give_back(self, size: int, block: mmap.mmap) -> None:
    self._returned.append((size, block, self._clock()))
    self._sort_stragglers()

  def _sort_stragglers(self) -> None:
    """Sorts the buffers that came back, unless the lock is held: its holder then sorts them
    (every holder looks again after releasing it, see `_held`)."""
    while self._returned and self._lock.acquire(blocking=False):
      try:
        self._sort_returned()
      finally:
        self._lock.release()

  @contextlib.contextmanager
  def _held(self):
    with self._lock:
      yield
    self._sort_stragglers()  # any that came back after this holder sorted

  def _sort_returned(self) -> None:
    """(Lock held.) Files the buffers that came back, within the limit (the rest are
    unmapped when collected), and starts the idle timer."""
    while self._returned:
      size, block, when = self._returned.popleft()
      if self._free_bytes + size <= pool_limit():
        self._free.setdefault(size, []).append((when, block))
        self._free_bytes += size
    if self._free and self._timer is None:
      self._timer = self._start_timer(IDLE_SECONDS, self._trim)

  def _trim(self) -> None:
    """Drops the buffers unused for `IDLE_SECONDS`; runs again while any are left."""
    cutoff = self._clock() - IDLE_SECONDS
    with self._held():
      for size, blocks in list(self._free.items()):
        kept = [b for b in blocks if b[0] > cutoff]
        self._free_bytes -= size * (len(blocks) - len(kept))
        if kept:
          self._free[size] = kept
        else:
          del self._free[size]
      self._timer = None
      self._sort_returned()

  def free_bytes(self) -> int:
    """The bytes of the buffers the pool holds unused."""
    with self._held():
      self._sort_returned()
      return self._free_bytes

  def clear(self) -> None:
    """Returns every unused buffer to the system."""
    with self._held():
      self._returned.clear()
      self._free.clear()
      self._free_bytes = 0

  def _after_fork(self) -> None:
    """In a forked child: no idle timer runs there, and the lock may have been held."""
    self._lock = threading.Lock()
    self._timer = None


def _start_timer(seconds: float, fn) -> threading.Timer | None:
  """Runs `fn` in `seconds` in a daemon thread (None: no new threads, at shutdown)."""
  timer = threading.Timer(seconds, fn)
  timer.daemon = True
  try:
    timer.start()
  except RuntimeError:  # no new threads (the interpreter is shutting down)
    return None
  return timer


POOL = _Pool()
if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=lambda: POOL._after_fork())
