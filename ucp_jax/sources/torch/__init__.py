"""The safe torch file reader: pickles that never run code, tensors as memory maps."""
