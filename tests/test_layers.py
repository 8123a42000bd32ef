"""The package's layers import only downwards, and the converters stay free of JAX.

Each subpackage is a layer (DESIGN.md): store < tree < mapping; parallel patterns, sources
and sinks above the store; integrations above all of those; the public modules and the CLI
on top. A module may import its own layer and the layers below it (imports only for type
checking are exempt); these tests fail on the first import that reaches up or sideways.
"""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ucp_jax"

BELOW = {
  "_errors": set(),
  "store": {"_errors"},
  "tree": {"store", "_errors"},
  "mapping": {"tree", "store", "_errors"},
  "parallel": {"store", "_errors"},
  "sources": {"parallel", "store", "_errors"},
  "sinks": {"sources", "mapping", "tree", "store", "_errors"},
  "integrations": {"sinks", "mapping", "tree", "store", "_errors"},
  "models": {"store", "_errors"},
}
"""Layer -> the layers it may import (the top level may import anything)."""


def _layer(module: str) -> str:
  parts = module.split(".")
  if len(parts) < 2:
    return "top"
  return parts[1] if parts[1] in BELOW else "top"


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
    if layer == "top":
      continue
    for line, imported in _imports(path):
      target = _layer(imported)
      if target != layer and target not in BELOW[layer]:
        bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {layer} imports {imported}")
  assert not bad, "imports that go up or sideways:\n" + "\n".join(bad)


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
    "import sys, ucp_jax, ucp_jax._cli, ucp_jax.sources._convert, ucp_jax.sources._registry\n"
    "for name in ucp_jax.sources._registry.SOURCES:\n"
    "  ucp_jax.sources._registry.get(name)\n"
    "print(sorted(m for m in ('jax', 'flax', 'optax', 'orbax', 'torch') if m in sys.modules))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"
