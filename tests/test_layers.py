"""The package's layers import only downwards, nothing imports in a circle, the store imports
no jax, and the converters stay free of JAX.

Each subpackage is a layer (README's Layout): `base` (errors, the processes of a run) below
everything; store < tree < mapping; parallel patterns, sources and sinks above the store;
integrations above all of those; the model families (`families`: a `config.json`'s model and
rule set) above the models and the mapping; the package root (the public modules) above every
layer but the command line, `cli`, on top. A module may import its own layer and the layers below
it (imports only for type checking are exempt); these tests fail on the first import that
reaches up or sideways.
"""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ucp_jax"

LAYERS = ["base", "store", "tree", "mapping", "parallel", "sources", "sinks", "integrations"]
BELOW = {
  "base": set(),
  "store": {"base"},
  "tree": {"store", "base"},
  "mapping": {"tree", "store", "base"},
  "parallel": {"store", "base"},
  "sources": {"parallel", "store", "base"},
  "sinks": {"sources", "mapping", "tree", "store", "base"},
  "integrations": {"sinks", "mapping", "tree", "store", "base"},
  "models": {"tree", "store", "base"},
  "families": {"models", "mapping", "tree", "store", "base"},
  "root": {*LAYERS, "models", "families"},
  "cli": {"root", *LAYERS, "models", "families"},
}
"""Layer -> the layers it may import."""

ROOT_MODULES = 8
"""The most modules the package root holds (`__init__` included): its public faces."""


def _layer(module: str) -> str:
  parts = module.split(".")
  if len(parts) < 2:
    return "root"
  return parts[1] if parts[1] in BELOW else "root"


def _imports(path: Path) -> list[tuple[int, str]]:
  """(line, module) of every ucp_jax import outside `if TYPE_CHECKING:` blocks."""
  tree = ast.parse(path.read_text())
  skipped = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      skipped |= {id(n) for n in ast.walk(node)}
  out = []
  for node in ast.walk(tree):
    if id(node) in skipped:
      continue
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ucp_jax"):
      if node.module == "ucp_jax":
        out += [(node.lineno, f"ucp_jax.{a.name}") for a in node.names]
      else:
        out.append((node.lineno, node.module))
    elif isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names if a.name.startswith("ucp_jax")]
  return out


def test_every_import_goes_down_the_layers():
  bad = []
  for path in sorted(PACKAGE.rglob("*.py")):
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    layer = _layer(module.removesuffix(".__init__"))
    for line, imported in _imports(path):
      target = _layer(imported)
      if target != layer and target not in BELOW[layer]:
        bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {layer} imports {imported}")
  assert not bad, "imports that go up or sideways:\n" + "\n".join(bad)


def test_the_root_holds_only_the_public_faces():
  modules = sorted(p.name for p in PACKAGE.glob("*.py"))
  assert len(modules) <= ROOT_MODULES, modules
  folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
  assert folders == set(BELOW) - {"root"}, folders


def _import_graph() -> dict[str, set[str]]:
  """Module -> the package modules it imports, anywhere in it (functions and type checking
  included): a circle is a circle wherever its imports sit. Importing a submodule imports
  its parent packages; those edges are not counted."""
  paths = {}
  for path in PACKAGE.rglob("*.py"):
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    paths[name.removesuffix(".__init__")] = path
  graph: dict[str, set[str]] = {}
  for module, path in paths.items():
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")
          base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        subs = {f"{base}.{a.name}" for a in node.names} & paths.keys()
        targets |= subs or {base}
      elif isinstance(node, ast.Import):
        targets |= {a.name for a in node.names}
    graph[module] = {
      t for t in targets & paths.keys() if t != module and not module.startswith(t + ".")
    }
  return graph


def test_no_module_imports_in_a_circle():
  graph = _import_graph()
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  circles = []

  def visit(v: str) -> None:  # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        circles.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  assert not circles, "modules that import each other:\n" + "\n".join(map(str, circles))


NO_JAX = ("jax", "jaxlib", "flax", "optax", "orbax")
"""Packages the store never imports: it knows host buffers, files and processes, not devices."""


def _jax_uses(path: Path) -> list[tuple[int, str]]:
  """(line, text) of every import of a JAX package in `path`, type-checking ones included, and
  every reach for one through `sys.modules` or `importlib`."""
  source = path.read_text()
  out = []
  for node in ast.walk(ast.parse(source)):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names = [node.module or ""]
    elif isinstance(node, ast.Call):  # importlib.import_module("jax"), sys.modules.get("jax")
      names = [a.value for a in node.args if isinstance(a, ast.Constant)]
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
      names = [node.slice.value]  # sys.modules["jax"]
    names = [n for n in names if isinstance(n, str) and n == n.strip() and " " not in n]
    if any(n.split(".")[0] in NO_JAX for n in names):
      out.append((node.lineno, ast.get_source_segment(source, node) or names[0]))
  return out


def test_the_store_imports_no_jax():
  bad = [
    f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
    for path in sorted((PACKAGE / "store").rglob("*.py"))
    for line, text in _jax_uses(path)
  ]
  assert not bad, "the store reaches for JAX:\n" + "\n".join(bad)


def test_the_jax_check_sees_every_way_in(tmp_path):
  module = tmp_path / "m.py"
  for code in (
    "import jax",
    "import jax.numpy as jnp",
    "from jax import sharding",
    "from jax.experimental import multihost_utils",
    "if TYPE_CHECKING:\n  import jax",
    "jax = sys.modules['jax']",
    'jax = sys.modules.get("jax")',
    "jax = importlib.import_module('jax')",
    "import flax.nnx",
  ):
    module.write_text(code + "\n")
    assert _jax_uses(module), code
  module.write_text('"""Knows nothing of jax meshes."""\nimport numpy, tensorstore, ml_dtypes\n')
  assert not _jax_uses(module)
  module.write_text('NAMINGS = ("torch", "flax")  # a value that names no module to import\n')
  assert not _jax_uses(module)


def test_no_module_reaches_into_another_modules_private_names():
  bad = []
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id.startswith("_")
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.value.id not in ("_utils", "_tensor")  # torch's own names, in pickles
      ):
        bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
  assert not bad, "\n".join(bad)


def test_the_converters_and_the_cli_start_without_jax():
  code = (
    "import sys, ucp_jax, ucp_jax.cli, ucp_jax.sources._convert, ucp_jax.sources._registry\n"
    "for name in ucp_jax.sources._registry.SOURCES:\n"
    "  ucp_jax.sources._registry.get(name)\n"
    "print(sorted(m for m in ('jax', 'flax', 'optax', 'orbax', 'torch') if m in sys.modules))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


_COMMANDS_OF_FILES = r"""
import json, sys
sys.argv[0] = "/venv/bin/ucp"  # as the console script starts: each command imports its needs
from ucp_jax import cli

heavy = ("jax", "flax", "optax", "orbax")
for argv in json.loads(sys.argv[1]):
  status = cli.main(argv)
  loaded = [m for m in heavy if m in sys.modules]
  print(json.dumps({"argv": argv, "status": status, "loaded": loaded}), flush=True)
"""


def test_no_command_of_files_imports_jax(tmp_path):
  """convert, inspect, verify, diff and export of files never place an array on a device, so
  they never import JAX (2 s of CPU, more than a small checkpoint's whole convert): the
  Flax-named checkpoint's export and diff, mapped back by a rule set, neither."""
  import json

  import ml_dtypes
  import numpy as np
  import optax
  import pytest
  from flax import nnx

  pytest.importorskip("torch")
  import ucp_jax
  from ucp_jax.models import gpt

  fixture = Path(__file__).parent / "fixtures" / "cross_framework"
  sizes = json.loads((fixture / "info.json").read_text())["model"]
  model = gpt.FlaxGPT(gpt.GPTConfig(**sizes), rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  ucp_jax.save_train_state(tmp_path / "flax", model, optimizer)
  rules = f"gpt2:num_heads={sizes['num_heads']}"
  ours, flax = str(tmp_path / "ours"), str(tmp_path / "flax")
  bf16 = Path(__file__).parent / "fixtures" / "deepspeed" / "z1_bf16_dp2" / "ckpt"
  half = str(tmp_path / "half")  # bfloat16 and float8 arrays: numpy must know their names
  ucp_jax.save(half, {"w": np.ones((2, 3), ml_dtypes.bfloat16), "f": np.ones(4, "float8_e5m2")})
  commands = [
    ["inspect", str(bf16)],  # a bfloat16 DeepSpeed checkpoint, read in place
    ["verify", str(bf16)],
    ["verify", half],
    ["diff", half, half],
    ["convert", str(fixture / "ckpt"), ours],
    ["inspect", ours],
    ["inspect", str(fixture / "ckpt")],
    ["verify", ours],
    ["diff", ours, ours],
    ["export", ours, str(tmp_path / "hf"), "--format", "hf"],
    ["export", ours, str(tmp_path / "dcp"), "--format", "dcp"],
    ["export", flax, str(tmp_path / "ds"), "--format", "deepspeed", "--rules", rules],
    ["diff", flax, ours, "--rules", rules],
  ]
  run = subprocess.run(
    [sys.executable, "-c", _COMMANDS_OF_FILES, json.dumps(commands)],
    capture_output=True,
    text=True,
    cwd=tmp_path,
  )
  results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
  assert len(results) == len(commands), run.stdout + run.stderr
  for result in results:
    assert result["status"] in (0, 1), (result, run.stderr)  # diff: 1 when they differ
    assert result["loaded"] == [], f"`ucp {' '.join(result['argv'])}` imported {result['loaded']}"


def test_help_version_and_inspect_import_no_tensorstore(tmp_path):
  """`ucp --help`, `ucp --version` and `ucp inspect` of a local checkpoint start at once:
  TensorStore and ml_dtypes (half a second of CPU together) load only for a command that
  reads arrays. The dtypes a manifest names are known without them (`STORED_DTYPES`)."""
  import ml_dtypes
  import numpy as np

  import ucp_jax

  ckpt = tmp_path / "ckpt"
  ucp_jax.save(ckpt, {"w": np.ones((2, 3), ml_dtypes.bfloat16), "f8": np.zeros(4, "float8_e4m3fn")})
  code = (
    "import contextlib, io, json, sys\n"
    "sys.argv[0] = '/venv/bin/ucp'\n"  # as the console script starts
    "from ucp_jax import cli\n"
    "out = io.StringIO()\n"
    "for argv in (['--help'], ['--version'], ['convert', '--help'], ['export', '--help'],\n"
    f"             ['inspect', {str(ckpt)!r}], ['inspect', {str(ckpt)!r}, '--json']):\n"
    "  with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):\n"
    "    cli.main(argv)\n"
    "print(json.dumps(sorted(m for m in ('tensorstore', 'ml_dtypes', 'jax', 'torch') if m in sys.modules)))\n"
    "print(json.dumps(out.getvalue()))"
  )
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  loaded, shown = run.stdout.splitlines()
  assert loaded == "[]", run.stderr
  assert "bfloat16" in shown and "float8_e4m3fn" in shown and '\\"bytes\\": 12' in shown, shown


def test_the_stored_dtypes_are_what_numpy_and_tensorstore_accept():
  import ml_dtypes
  import numpy as np
  import tensorstore as ts

  from ucp_jax.store import _manifest

  accepted = {}
  numpy_names = {np.dtype(t).name for t in set(np.sctypeDict.values())}
  for name in sorted(numpy_names | {n for n in dir(ml_dtypes) if n[0] != "_"}):
    try:
      dtype = np.dtype(name)
      ts.dtype(name)
    except (TypeError, ValueError, AttributeError):
      continue
    if dtype.name == name and not dtype.hasobject and dtype.kind not in "SUMm":
      accepted[name] = dtype.itemsize
  assert accepted == _manifest.STORED_DTYPES


def test_every_name_the_package_loads_on_first_use_is_typed():
  """`ucp_jax.save` and the other names loaded on first use (PEP 562) are imported for type
  checkers too, from the same place: a type checker sees their signatures, not `Any`."""
  import ucp_jax

  tree = ast.parse((PACKAGE / "__init__.py").read_text())
  typed = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
      for imp in node.body:
        assert isinstance(imp, ast.ImportFrom)
        for alias in imp.names:
          typed[alias.asname] = (imp.module, alias.name)
  lazy = {
    name: (where, attr) if attr is not None else tuple(where.rsplit(".", 1))
    for name, (where, attr) in ucp_jax._LAZY.items()
  }
  assert typed == lazy
