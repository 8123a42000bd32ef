"""Integrations with training libraries: Flax NNX / Linen train states, Optax, Orbax."""
