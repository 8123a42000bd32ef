"""Formats as plugins: a package adds a source and a sink through entry points.

The package is docs/plugins.md's example (its first python block, as written), installed
the way pip leaves one: a module and a `*.dist-info` folder (METADATA, entry_points.txt) on
`sys.path`. The `ucp` commands run as subprocesses, each a fresh interpreter that finds it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import doc_blocks
import numpy as np
import pytest

import ucp_jax
from ucp_jax.base import _plugins

ENTRY_POINTS = """\
[ucp_jax.sources]
npy = npy_format:source

[ucp_jax.sinks]
npy = npy_format:sink
"""


def _install(site, entry_points: str = ENTRY_POINTS, name: str = "npy_format") -> None:
  """Writes the example plugin as an installed package `name` into the folder `site`."""
  blocks, _ = doc_blocks.parse("docs/plugins.md")
  code = next(b.code for b in blocks if b.kind == "python")
  site.mkdir(exist_ok=True)
  (site / "npy_format.py").write_text(code)
  info = site / f"{name}-0.1.dist-info"
  info.mkdir()
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
  (info / "entry_points.txt").write_text(entry_points)


def _ucp(site, *args: str, check: bool = True) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
  proc = subprocess.run(
    [sys.executable, "-m", "ucp_jax.cli", *args], capture_output=True, text=True, env=env
  )
  if check:
    assert proc.returncode == 0, f"ucp {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
  return proc


@pytest.fixture
def arrays(tmp_path):
  """A folder of .npy files: what the plugin reads."""
  folder = tmp_path / "arrays"
  (folder / "params").mkdir(parents=True)
  w = np.arange(24, dtype=np.float32).reshape(4, 6)
  np.save(folder / "params" / "w.npy", w)
  np.save(folder / "step.npy", np.int64(7))
  return folder, {"params/w": w, "step": np.int64(7)}


def test_the_commands_use_a_source_and_a_sink_from_entry_points(tmp_path, arrays):
  site = tmp_path / "site"
  _install(site)
  folder, expected = arrays

  shown = _ucp(site, "inspect", str(folder)).stdout
  assert "params/w" in shown and "(4, 6)" in shown and "float32" in shown and "step" in shown

  converted = _ucp(site, "convert", str(folder), str(tmp_path / "universal"))
  assert f"(from npy {folder})" in converted.stdout + converted.stderr
  ckpt = ucp_jax.open(tmp_path / "universal")
  assert ckpt.keys() == ["params/w", "step"]
  np.testing.assert_array_equal(ckpt.read("params/w"), expected["params/w"])

  _ucp(site, "convert", str(folder), str(tmp_path / "named"), "--from", "npy")
  assert ucp_jax.open(tmp_path / "named").keys() == ["params/w", "step"]

  out = _ucp(site, "export", str(tmp_path / "universal"), str(tmp_path / "out"), "--format", "npy")
  assert "2 .npy files" in out.stdout + out.stderr
  np.testing.assert_array_equal(
    np.load(tmp_path / "out" / "params" / "w.npy"), expected["params/w"]
  )
  assert np.load(tmp_path / "out" / "step.npy") == 7

  shown = _ucp(site, "export", "--help").stdout  # the sink's Options, as flags
  assert "--cast CAST" in shown and "npy: cast every array to this numpy dtype" in shown
  cast = tmp_path / "cast"
  _ucp(site, "export", str(tmp_path / "universal"), str(cast), "--format", "npy", "--cast", "f2")
  assert np.load(cast / "params" / "w.npy").dtype == np.float16
  refused = _ucp(
    site,
    "export",
    str(tmp_path / "universal"),
    str(tmp_path / "x"),
    "--format",
    "dcp",
    "--cast",
    "f2",
    check=False,
  )
  assert "format 'dcp' takes no cast; its options: ranks" in refused.stderr


def test_without_the_package_the_format_is_unknown(tmp_path, arrays):
  folder, _ = arrays
  empty = tmp_path / "site"
  empty.mkdir()
  assert "not a checkpoint ucp_jax reads" in _ucp(empty, "inspect", str(folder), check=False).stderr
  refused = _ucp(empty, "export", str(folder), str(tmp_path / "o"), "--format", "npy", check=False)
  assert refused.returncode == 2 and "npy" in refused.stderr


def test_an_entry_point_may_not_take_a_built_in_name(tmp_path, arrays):
  site = tmp_path / "site"
  _install(site, "[ucp_jax.sources]\nhf = npy_format:source\n", name="bad_plugin")
  proc = _ucp(site, "inspect", str(arrays[0]), check=False)
  assert proc.returncode == 2
  assert "source 'hf' of entry point ucp_jax.sources = hf = npy_format:source of bad_plugin" in (
    proc.stderr
  )
  assert "is taken (by ucp_jax.sources.hf._source)" in proc.stderr


def test_a_plugin_that_fails_to_import_is_one_line_naming_it(tmp_path, arrays):
  site = tmp_path / "site"
  _install(site, "[ucp_jax.sources]\nbroken = broken_format:source\n", name="broken_plugin")
  (site / "broken_format.py").write_text("raise RuntimeError('its own bug')\n")
  proc = _ucp(site, "inspect", str(arrays[0]), check=False)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert "source 'broken' (ucp_jax.sources = broken = broken_format:source of broken_plugin)" in (
    proc.stderr
  )
  assert "fails to load: RuntimeError: its own bug" in proc.stderr


def _registry() -> _plugins.Registry:
  return _plugins.Registry("source", "ucp_jax.no_such_group", {}, ("NAME", "sniff"))


def _plugin(name: str) -> types.SimpleNamespace:
  return types.SimpleNamespace(NAME=name, sniff=lambda path: False)


def test_a_name_is_taken_once_unless_replaced():
  registry = _registry()
  first, second = _plugin("x"), _plugin("x")
  registry.register(first)
  registry.register(first)  # the same plugin again: nothing changes
  with pytest.raises(ucp_jax.InvalidArgumentError, match=r"source 'x' is taken .*replace=True"):
    registry.register(second)
  assert registry["x"] is first
  registry.register(second, replace=True)
  assert registry["x"] is second and list(registry) == ["x"]


def test_a_plugin_lacking_a_member_is_refused():
  registry = _registry()
  with pytest.raises(ucp_jax.InvalidArgumentError, match="lacks sniff; a source has NAME, sniff"):
    registry.register(types.SimpleNamespace(NAME="y"))
  assert "y" not in registry


def test_the_built_in_formats_declare_every_member():
  from ucp_jax.sinks import _registry as sinks
  from ucp_jax.sources import _registry as sources

  assert sources.SOURCES.members == (
    "NAME",
    "DESCRIPTION",
    "sniff",
    "sniff_remote",
    "sniff_weak",
    "describe",
  )
  assert sinks.SINKS.members == (
    "NAME",
    "DESCRIPTION",
    "TORCH_NAMES",
    "Options",
    "check_options",
    "export",
  )
  assert [sources.get(n).NAME for n in sources.SOURCES] == list(sources.SOURCES)
  assert [sinks.get(n).NAME for n in sinks.SINKS] == list(sinks.SINKS)
  members = {m: getattr(sources.get("hf"), m) for m in sources.SOURCES.members}
  with pytest.raises(ucp_jax.InvalidArgumentError, match="source 'hf' is taken"):
    sources.register(types.SimpleNamespace(**members))
  assert sources.get("hf").__name__ == "ucp_jax.sources.hf._source"
