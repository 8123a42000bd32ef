"""Orbax checkpoints: `StandardCheckpointer` / `PyTreeCheckpointHandler` folders and
`CheckpointManager` step folders, read through TensorStore without Orbax (docs/orbax.md)."""
