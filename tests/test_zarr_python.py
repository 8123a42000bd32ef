"""zarr-python reads every array of a checkpoint, bfloat16 and float8 included.

Run in fresh interpreters: what counts is what a user gets after `import ucp_jax` and
nothing else, whichever of ucp_jax and zarr is imported first.
"""

import subprocess
import sys

import pytest

pytest.importorskip("zarr")

_SAVE = """
import numpy as np, ml_dtypes, ucp_jax
from ucp_jax.store._zarr_python import NAMES
values = {n: (np.arange(48) % 13 - 6).astype(getattr(ml_dtypes, n)).reshape(4, 12) for n in NAMES}
values["float32"] = np.arange(48, dtype=np.float32).reshape(4, 12)
layouts = {"bundled": dict(chunk_bytes=8), "chunk files": dict(chunk_bytes=8, bundle_bytes=None),
           "one chunk": {}, "zstd": dict(compression="zstd", chunk_bytes=8)}
for name, options in layouts.items():
  ucp_jax.save(f"{ROOT}/{name}", {"m": values}, overwrite=True, **options)
"""
_READ = """
import warnings
for name in layouts:
  for key, value in values.items():
    array = zarr.open_array(f"{ROOT}/{name}/m/{key}", mode="r")
    assert array.dtype == value.dtype, (name, key, array.dtype)
    np.testing.assert_array_equal(array[:], value)
    np.testing.assert_array_equal(array[1:3, 5:], value[1:3, 5:])
  with warnings.catch_warnings(record=True) as caught:  # the manifest beside the arrays
    root = zarr.open_group(f"{ROOT}/{name}", mode="r")
    assert list(root.group_keys()) == ["m"], list(root.group_keys())
    group = zarr.open_group(f"{ROOT}/{name}/m", mode="r")
    assert sorted(group.array_keys()) == sorted(values), sorted(group.array_keys())
  assert not caught, [str(w.message) for w in caught]
print("read", len(layouts) * len(values), "arrays")
"""


@pytest.mark.parametrize("first", ["ucp_jax", "zarr"])
def test_zarr_python_reads_every_dtype_after_import_ucp_jax(tmp_path, first):
  imports = (
    "import ucp_jax\nimport zarr\n" if first == "ucp_jax" else "import zarr\nimport ucp_jax\n"
  )
  code = f"ROOT = {str(tmp_path)!r}\n{imports}import numpy as np\n{_SAVE}{_READ}"
  run = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "read 36 arrays" in run.stdout
