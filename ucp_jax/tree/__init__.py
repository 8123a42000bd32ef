"""The tree layer: pytrees of `jax.Array`s on any sharding <-> the store's logical arrays.

`save`, `save_async`, `restore` (each device reading only its slice) and `reshard`.
"""
