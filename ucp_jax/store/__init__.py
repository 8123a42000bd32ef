"""The store layer: where a checkpoint lives, its zarr arrays, manifest, checksums, commit.

The layer every other one writes and reads through; it knows nothing of JAX, rule sets or
foreign formats. It imports no jax (tests/test_layers.py checks it): devices reach it as
host buffers, and as `_shards.DeviceArray`s that the tree layer implements.
"""
