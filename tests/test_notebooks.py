"""Every notebook in notebooks/ runs top to bottom (nbclient, kernel python3)."""

import importlib.util
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
  missing = [
    m for m in ("nbclient", "nbformat", "ipykernel") if importlib.util.find_spec(m) is None
  ]
  if missing:
    pytest.skip(f"{', '.join(missing)} not installed (pip install 'ucp_jax[test]')")
  import nbformat
  from nbclient import NotebookClient

  notebook = nbformat.read(path, as_version=4)
  client = NotebookClient(
    notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
  )
  client.execute()
