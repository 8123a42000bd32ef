"""Sinks: a checkpoint with a parameter schema -> files another framework loads."""
