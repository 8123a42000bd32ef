"""Named plugins: the formats sources read and sinks write, one `Registry` each.

A registry maps names to plugins: modules (or any objects) with every member of a protocol
(`members`). The built-in ones are named by module path and imported on first use; other
packages add theirs through entry points of the registry's group (read once, on the first
look-up, and each imported only when used), and code adds its own with `register`. A name
is taken once: a second plugin under it is an error unless it replaces the first.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ucp_jax.base import _errors


def protocol_members(protocol: type) -> tuple[str, ...]:
  """The attributes and methods a `typing.Protocol` declares (its own, not `object`'s)."""
  methods = [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
  return (*protocol.__annotations__, *methods)


class Registry(Mapping[str, Any]):
  """Plugins by name, in the order they joined: the built-in ones, then entry points and
  registered ones. Reading `registry[name]` imports the plugin and checks its members.

  Args:
    kind: what a plugin is, for messages ("source", "sink").
    group: the entry point group other packages declare plugins in.
    builtins: name -> the module path of each built-in plugin, in order.
    members: the names every plugin has (`protocol_members` of its protocol).
  """

  def __init__(self, kind: str, group: str, builtins: dict[str, str], members: tuple[str, ...]):
    self.kind, self.group, self.members = kind, group, members
    self._where: dict[str, Any] = dict(builtins)  # a module path, an entry point or the plugin
    self._loaded: dict[str, Any] = {}
    self._entry_points_read = False

  def register(self, plugin: Any, *, replace: bool = False) -> None:
    """Adds `plugin` under its `NAME`, after the plugins already there.

    Args:
      plugin: a module or any object with every member of the registry's protocol
        (`ucp_jax.plugins.Source` or `Sink`).
      replace: take the name from the plugin that has it (a built-in one too).

    Raises:
      InvalidArgumentError: it lacks a member, or another plugin has its name and `replace`
        is false (registering the same plugin again changes nothing).

    Example:
      >>> from ucp_jax import plugins
      >>> from ucp_jax.sinks import _hf
      >>> plugins.register_sink(_hf)  # the same plugin under its own name: nothing changes
      >>> plugins.register_source(_hf)
      Traceback (most recent call last):
      ucp_jax.base._errors.InvalidArgumentError: source ucp_jax.sinks._hf: lacks sniff, ...
    """
    self._check(plugin, f"{self.kind} {_origin(plugin)}")
    name = plugin.NAME
    if name in self and not replace and self[name] is not plugin:
      raise _errors.InvalidArgumentError(
        f"{self.kind} {name!r} is taken (by {_origin(self._where[name])}); pass replace=True "
        f"to replace it"
      )
    self._where[name] = plugin
    self._loaded[name] = plugin

  def lookup(self, name: str, unknown: Callable[[str], str]) -> Any:
    """The plugin `name`, or an `InvalidArgumentError` saying `unknown(names)` (the
    registered names, in order)."""
    if name not in self:
      raise _errors.InvalidArgumentError(unknown(", ".join(self)))
    return self[name]

  def __getitem__(self, name: str) -> Any:
    self._read_entry_points()
    if name not in self._loaded:
      where = self._where[name]  # KeyError: no plugin of that name
      if isinstance(where, str):
        plugin = importlib.import_module(where)
      elif isinstance(where, importlib.metadata.EntryPoint):
        try:
          plugin = where.load()
        except Exception as e:  # another package's code: one line naming it, not its traceback
          raise _errors.InvalidArgumentError(
            f"{self.kind} {name!r} ({_origin(where)}) fails to load: {type(e).__name__}: {e}"
          ) from e
      else:
        plugin = where
      self._check(plugin, f"{self.kind} {name!r} ({_origin(where)})")
      if name != plugin.NAME:
        raise _errors.InvalidArgumentError(
          f"{self.kind} {name!r} ({_origin(where)}): its NAME is {plugin.NAME!r}"
        )
      self._loaded[name] = plugin
    return self._loaded[name]

  def __contains__(self, name: object) -> bool:
    self._read_entry_points()
    return name in self._where  # without importing it

  def __iter__(self) -> Iterator[str]:
    self._read_entry_points()
    return iter(list(self._where))

  def __len__(self) -> int:
    self._read_entry_points()
    return len(self._where)

  def _check(self, plugin: Any, what: str) -> None:
    missing = [m for m in self.members if not hasattr(plugin, m)]
    if missing:
      raise _errors.InvalidArgumentError(
        f"{what}: lacks {', '.join(missing)}; a {self.kind} has {', '.join(self.members)} "
        "(docs/plugins.md)"
      )

  def _read_entry_points(self) -> None:
    """Adds the installed packages' plugins (once; none is imported here)."""
    if self._entry_points_read:
      return
    self._entry_points_read = True
    for point in importlib.metadata.entry_points(group=self.group):
      if point.name in self._where:
        taken = _origin(self._where[point.name])
        raise _errors.InvalidArgumentError(
          f"{self.kind} {point.name!r} of entry point {_origin(point)} is taken (by {taken}): "
          "uninstall one of them"
        )
      self._where[point.name] = point


def _origin(where: Any) -> str:
  """Where a plugin comes from, for messages."""
  if isinstance(where, str):
    return where
  if isinstance(where, importlib.metadata.EntryPoint):
    dist = where.dist.name if where.dist is not None else "an installed package"
    return f"{where.group} = {where.name} = {where.value} of {dist}"
  return where.__name__ if isinstance(where, types.ModuleType) else repr(where)
