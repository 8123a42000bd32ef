"""The store layer: where a checkpoint lives, its zarr arrays, manifest, checksums, commit.

The layer every other one writes and reads through; it knows nothing of JAX meshes,
rule sets or foreign formats.
"""
