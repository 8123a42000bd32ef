"""Orbax `CheckpointManager` integration: ucp_jax checkpoints as an Orbax item.

    import orbax.checkpoint as ocp
    from ucp_jax.orbax import UcpRestore, UcpSave

    manager = ocp.CheckpointManager(
      "ckpts", options=ocp.CheckpointManagerOptions(max_to_keep=3, save_interval_steps=100)
    )
    manager.save(step, args=UcpSave(state, step=step))  # async by default; skipped off-interval
    state = manager.restore(manager.latest_step(), args=UcpRestore(target))

Each step's item is a plain ucp_jax checkpoint (`ucp_jax.open("ckpts/100/default")`).
"""

from ucp_jax.integrations._orbax import UcpCheckpointHandler as UcpCheckpointHandler
from ucp_jax.integrations._orbax import UcpRestore as UcpRestore
from ucp_jax.integrations._orbax import UcpSave as UcpSave

__all__ = ["UcpCheckpointHandler", "UcpRestore", "UcpSave"]
