"""DeepSpeed training checkpoints (ZeRO-1/2/3, BF16 optimizer, TP/PP/EP, universal)."""
