"""How much a pickle may ask of the safe reader, and the check of the tree it built.

A pickle is a small program, and a small one can ask for a lot: a billion list items made of a
few shared ones ("billion laughs"), a tuple nested a million deep (which crashes `hash` in C),
a dict key that takes minutes to hash, or a tree so deep that any recursive walk of it fails.
The reader (`_torch_pickle`) refuses each with a `SourceFormatError` that names the file and
the limit. The limits, far above what a real checkpoint needs:

* `MAX_PICKLE_BYTES`: the size of one pickle (a torch file's ``data.pkl``).
* `MAX_STEPS`: opcodes run plus elements hashed (each dict key and set member costs the nodes
  of its tuple tree). Each opcode makes at most one object, so this bounds the objects made,
  the memory they take (at most about 100 bytes a step: 800 MiB) and the time (about 1 us a
  step: 8 s at worst; a 50000-tensor state dict takes 1.6 million steps).
* `MAX_MEMO`: entries of the pickle's memo (the objects it refers back to).
* `MAX_DEPTH`: nesting of containers (dicts, lists, tuples, sets, records), checked on the
  finished tree and, for tuples, frozensets and records (the hashable ones), as they are made.
* `MAX_TREE_NODES`: nodes of the tree as a recursive walk sees it, a node shared `k` times
  counted `k` times: what any later copy, comparison or JSON dump of the tree will visit.

A finished tree must also be acyclic: a container that holds itself is refused.
"""

from __future__ import annotations

import collections
import itertools
import pickle
from collections.abc import Callable
from typing import Any

from ucp_jax.base._errors import SourceFormatError
from ucp_jax.sources._torch_reader._pickle_records import InertObject

MAX_PICKLE_BYTES = 256 << 20
MAX_STEPS = 1 << 23
MAX_MEMO = 1 << 22
MAX_DEPTH = 100
MAX_TREE_NODES = 1 << 23


def exceeded(source: str, what: str, limit: int, name: str) -> SourceFormatError:
  """The error for a pickle whose `what` goes past `limit` (the constant `name` here)."""
  return SourceFormatError(
    f"{source}: {what} exceeds the safe reader's limit of {limit:,} ({name}): refusing a "
    "file that would take unbounded memory or time (a forged or corrupt file)"
  )


def check_tree(root: Any, source: str) -> None:
  """Checks the depth, the expanded size and the absence of cycles of a finished tree.

  Args:
    root: the unpickled object.
    source: names the file in errors.

  Raises:
    SourceFormatError: a cycle, more than `MAX_DEPTH` levels, or more than `MAX_TREE_NODES`
      nodes counted the way a recursive walk counts them. The walk itself is iterative and
      visits each container once.
  """
  kids = _children(root)
  if kids is None:
    return
  done: dict[int, tuple[int, int]] = {}  # id -> (height, expanded nodes) of a finished container
  active = {id(root)}
  stack = [[root, iter(kids), 0, 1]]  # container, its children left, tallest child, nodes
  while stack:
    frame = stack[-1]
    for child in frame[1]:
      key = id(child)
      if key in done:
        height, nodes = done[key]
        if len(stack) + height > MAX_DEPTH:
          raise exceeded(source, "nesting depth", MAX_DEPTH, "MAX_DEPTH")
      elif key in active:
        raise SourceFormatError(f"{source}: a container holds itself (a cycle in the pickle)")
      else:
        grandchildren = _children(child)
        if grandchildren is not None:
          if len(stack) >= MAX_DEPTH:
            raise exceeded(source, "nesting depth", MAX_DEPTH, "MAX_DEPTH")
          active.add(key)
          stack.append([child, iter(grandchildren), 0, 1])
          break
        height, nodes = 0, 1
      frame[2] = max(frame[2], height)
      frame[3] += nodes
      if frame[3] > MAX_TREE_NODES:
        raise exceeded(source, "the expanded object tree", MAX_TREE_NODES, "MAX_TREE_NODES")
    else:
      stack.pop()
      active.discard(id(frame[0]))
      done[id(frame[0])] = (frame[2] + 1, frame[3])
      if stack:
        parent = stack[-1]
        parent[2] = max(parent[2], frame[2] + 1)
        parent[3] += frame[3]
        if parent[3] > MAX_TREE_NODES:
          raise exceeded(source, "the expanded object tree", MAX_TREE_NODES, "MAX_TREE_NODES")


def _children(obj: Any) -> Any:
  """What ``check_tree`` walks into: the objects a container of the reader's holds."""
  kind = type(obj)
  if kind is list or kind is tuple or kind is set or kind is frozenset:
    return obj
  if kind is dict:
    return itertools.chain.from_iterable(obj.items())
  if kind is collections.OrderedDict:
    return itertools.chain(itertools.chain.from_iterable(obj.items()), vars(obj).values())
  if kind is InertObject:
    return (obj.args, obj.kwargs, obj.state, obj.listitems, obj.dictitems)
  return None


_HASHED = (tuple, frozenset, InertObject)  # containers whose hash walks what they hold


def counted(op: Callable[[Any], None], code: int) -> Callable[[Any], None]:
  """Opcode `code`, which costs one step of `MAX_STEPS`, or more for a large empty object."""
  cost = _COSTS.get(code, 1)

  def step(self: Budget) -> None:
    self._charge(cost)
    op(self)

  return step


# An empty set is 216 bytes, more than three times a dict or list: it costs 4 steps.
_COSTS = {pickle.EMPTY_SET[0]: 4, pickle.FROZENSET[0]: 4}


def memo_limited(op: Callable[[Any], None]) -> Callable[[Any], None]:
  """A memo store (PUT, BINPUT, LONG_BINPUT, MEMOIZE) held to `MAX_MEMO` entries."""

  def put(self: Budget) -> None:
    op(self)
    if len(self.memo) > MAX_MEMO:
      raise exceeded(self._source, "the memo", MAX_MEMO, "MAX_MEMO")

  return put


class Budget:
  """The limits an unpickler (with `_source`, `_steps` and `_shapes`) is held to as it runs.

  `_shapes` keeps the depth and node count of every tuple, frozenset and record as it is made,
  so hashing one (a dict key, a set member) never recurses past `MAX_DEPTH` and is paid for in
  `MAX_STEPS`. Mutable containers are checked on the finished tree (`check_tree`).
  """

  _source: str
  _steps: int
  _shapes: dict[int, tuple[Any, int, int]]  # id -> (object, depth, nodes)

  def _charge(self, steps: int) -> None:
    self._steps += steps
    if self._steps > MAX_STEPS:
      raise exceeded(
        self._source,
        "the work of unpickling (opcodes and hashed elements)",
        MAX_STEPS,
        "MAX_STEPS",
      )

  def _shape(self, obj: Any) -> tuple[int, int]:
    """(depth, nodes) of `obj`: what hashing it walks."""
    entry = self._shapes.get(id(obj))
    if entry is not None:
      return entry[1], entry[2]
    return (1, 1) if type(obj) in _HASHED else (0, 1)

  def _made(self, obj: Any) -> Any:
    """Records the shape of a new tuple, frozenset or record, within the limits."""
    kind = type(obj)
    if kind is not tuple and kind is not frozenset and kind is not InertObject:
      return obj
    depth, nodes = 0, 1
    for item in (obj.args,) if kind is InertObject else obj:
      d, n = self._shape(item)
      depth, nodes = max(depth, d), nodes + n
    if depth + 1 > MAX_DEPTH:
      raise exceeded(self._source, "nesting depth", MAX_DEPTH, "MAX_DEPTH")
    if nodes > MAX_TREE_NODES:
      raise exceeded(self._source, "the expanded object tree", MAX_TREE_NODES, "MAX_TREE_NODES")
    if nodes > 1:
      self._shapes[id(obj)] = (obj, depth + 1, nodes)
    return obj

  def _hashing(self, keys: Any) -> None:
    """Pays for hashing `keys` (dict keys or set members) before they are hashed."""
    self._charge(sum(self._shape(key)[1] for key in keys))
