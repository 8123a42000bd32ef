"""Parallel patterns: how TP/PP/EP ranks split a parameter, merged and split back."""
