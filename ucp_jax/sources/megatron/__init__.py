"""Megatron-core `torch_dist` checkpoints (Megatron-LM, NeMo 2) as a source."""
