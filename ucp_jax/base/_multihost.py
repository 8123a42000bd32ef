"""The processes of a run, and what they must agree on during a save: a token, and that all
went well.

A run of several processes is a `jax.distributed` run (a training job, or `ucp convert
--processes N`), so this module speaks to jax's coordination service; it finds jax in
`sys.modules` and never imports it: a process that has not loaded jax runs alone. It sits
below the store (which imports no jax) as the one place that knows the processes of a run.
"""

from __future__ import annotations

import itertools
import sys

import numpy as np

from ucp_jax.base import _errors

TIMEOUT_S = 3600
"""How long a process waits for the others at one agreement point of a save."""


def _jax():
  """jax, if this process loaded it; a process that never did runs alone."""
  return sys.modules.get("jax")


def process_count() -> int:
  jax = _jax()
  return 1 if jax is None else jax.process_count()


def process_index() -> int:
  jax = _jax()
  return 0 if jax is None else jax.process_index()


def is_primary() -> bool:
  return process_index() == 0


def broadcast_from_primary(values: np.ndarray) -> np.ndarray:
  """Process 0's `values` on every process (a no-op with one process)."""
  if process_count() == 1:
    return values
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.broadcast_one_to_all(values))


def all_ok(ok: bool) -> bool:
  """True on every process iff `ok` was true on every process; also a barrier."""
  if process_count() == 1:
    return ok
  from jax.experimental import multihost_utils

  flags = multihost_utils.process_allgather(np.array([ok], dtype=np.int32))
  return bool(np.all(flags))


def _allgather_bytes(data: bytes) -> list[bytes]:
  """Every process's `data` on every process, through device collectives."""
  from jax.experimental import multihost_utils

  sizes = multihost_utils.process_allgather(np.array([len(data)], dtype=np.int64)).reshape(-1)
  padded = np.zeros(max(1, int(sizes.max())), dtype=np.uint8)
  padded[: len(data)] = np.frombuffer(data, dtype=np.uint8)
  rows = multihost_utils.process_allgather(padded).reshape(len(sizes), -1)
  return [rows[i, : int(n)].tobytes() for i, n in enumerate(sizes)]


class Sync:
  """The agreements of one save among the processes of a run.

  With several processes it goes through `jax.distributed`'s coordination
  service (a key-value store and barriers), never through device collectives, so
  a save may agree from a background thread while training steps run their
  collectives on the devices. Every process creates its `Sync`s in the same order
  (they are numbered, which keeps the keys of two saves apart) and makes the same
  calls on each. Without a coordination service it falls back to the collectives
  of `broadcast_from_primary` and `all_ok`.
  """

  _numbers = itertools.count()

  def __init__(self, name: str):
    self._name = name
    self._prefix = f"ucp_jax/sync/{next(Sync._numbers)}"
    self._rounds = itertools.count()
    self._client = None
    if process_count() > 1:
      from jax._src import distributed

      self._client = distributed.global_state.client
    self._mine: list[str] = []  # keys this process set, deleted once all have read them

  def broadcast_from_primary(self, values: np.ndarray, what: str) -> np.ndarray:
    """Process 0's `values` on every process; the others pass an array of the same shape."""
    if process_count() == 1:
      return values
    if self._client is None:
      return broadcast_from_primary(values)
    key = f"{self._prefix}/{next(self._rounds)}/value"
    if is_primary():
      self._client.key_value_set_bytes(key, np.ascontiguousarray(values).tobytes())
      self._mine.append(key)
      return values
    data = self._wait(what, self._client.blocking_key_value_get_bytes, key)
    return np.frombuffer(data, dtype=values.dtype).reshape(values.shape).copy()

  def gather_to_primary(self, data: bytes, what: str) -> list[bytes]:
    """Every process's `data`, in process order, on process 0 (an empty list elsewhere)."""
    if process_count() == 1:
      return [data]
    if self._client is None:
      gathered = _allgather_bytes(data)  # every process takes part in the collective
      return gathered if is_primary() else []
    # Each process posts its part, all meet at a barrier, and process 0 takes every part
    # with one directory read: one round trip each, not one per process on process 0.
    key = f"{self._prefix}/{next(self._rounds)}/gather"
    if not is_primary():
      self._client.key_value_set_bytes(f"{key}/{process_index()}", data)
      self._mine.append(f"{key}/{process_index()}")
    self._wait(what, self._client.wait_at_barrier, key)
    if not is_primary():
      return []
    parts = {
      int(k.rsplit("/", 1)[1]): v for k, v in self._client.key_value_dir_get_bytes(f"{key}/")
    }
    missing = sorted(set(range(1, process_count())) - set(parts))
    if missing:
      raise _errors.UcpError(f"{self._name}: {what}: nothing from processes {missing}")
    return [data, *(parts[i] for i in range(1, process_count()))]

  def all_ok(self, ok: bool, what: str) -> bool:
    """True on every process iff `ok` was true on every process; also a barrier."""
    if process_count() == 1:
      return ok
    if self._client is None:
      return all_ok(ok)
    round_key = f"{self._prefix}/{next(self._rounds)}"
    if not ok:
      self._client.key_value_set(f"{round_key}/failed/{process_index()}", "1")
    self._wait(what, self._client.wait_at_barrier, round_key)
    # Every process has read the earlier rounds' keys before reaching this barrier.
    for key in self._mine:
      self._client.key_value_delete(key)
    self._mine = [f"{round_key}/failed/{process_index()}"] if not ok else []
    return not self._client.key_value_dir_get(f"{round_key}/failed/")

  def _wait(self, what: str, fn, key: str):
    try:
      return fn(key, TIMEOUT_S * 1000)
    except _jax().errors.JaxRuntimeError as e:
      raise _errors.UcpError(
        f"{self._name}: {what}: waiting for the other processes failed (timeout {TIMEOUT_S} s): {e}"
      ) from e
