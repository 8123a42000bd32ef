"""Hugging Face checkpoints: safetensors files, sharded folders, `config.json`."""
