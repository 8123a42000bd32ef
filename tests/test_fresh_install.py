"""The README as a new user meets it: a fresh virtual environment, the documented install step
(`pip install -e .`, nothing else), the demo, then every README example that needs no extra.

The examples that need an extra (`[hf]`, `[torch]`: the README says which) run in the main
suite's environment (tests/test_docs_examples.py); here they are left out, and so is
anything the test extras bring (pytest, matplotlib): a missing dependency of the base install
fails this test, not a user.
"""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import doc_blocks
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _base_groups() -> list[int]:
  """The lines of the README's groups whose setups need no extra."""
  import doc_fixtures

  blocks, _ = doc_blocks.parse("README.md")
  found, _ = doc_blocks.groups(blocks)
  return [g.line for g in found if not any(doc_fixtures.SETUPS[name].requires for name in g.setups)]


@pytest.mark.slow
def test_the_readme_in_a_fresh_venv_with_the_documented_install(tmp_path):
  env_dir = tmp_path / "venv"
  venv.create(env_dir, with_pip=True)
  python, ucp = env_dir / "bin" / "python", env_dir / "bin" / "ucp"
  environment = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  environment["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
  install = subprocess.run(
    [python, "-m", "pip", "install", "-q", "-e", str(ROOT)],
    capture_output=True,
    text=True,
    env=environment,
  )
  assert install.returncode == 0, install.stdout + install.stderr
  demo = subprocess.run(
    [ucp, "demo", "--out", str(tmp_path / "demo")],
    capture_output=True,
    text=True,
    env=environment,
    cwd=tmp_path,
  )
  assert demo.returncode == 0 and "PASS" in demo.stdout, demo.stdout + demo.stderr
  assert "plot skipped: matplotlib is not installed (pip install matplotlib)" in demo.stdout
  lines = _base_groups()
  assert len(lines) >= 4, lines  # the screenful, Flax, rule sets, the training loop
  script, groups = str(ROOT / "tests" / "support" / "doc_blocks.py"), ",".join(map(str, lines))
  blocks = subprocess.run(
    [python, script, "README.md", "--lines", groups, "--dir", str(tmp_path / "blocks")],
    capture_output=True,
    text=True,
    env=environment,
    cwd=ROOT,
  )
  assert blocks.returncode == 0 and blocks.stdout.endswith("all ran\n"), (
    blocks.stdout[-4000:] + blocks.stderr[-4000:]
  )
  assert (
    "pytest"
    not in subprocess.run(
      [python, "-m", "pip", "list"], capture_output=True, text=True, env=environment
    ).stdout.lower()
  )  # the examples ran without the test extras
