"""`python -m ucp_jax.cli ARGS` runs the `ucp` command."""

from ucp_jax.cli import run

run()
