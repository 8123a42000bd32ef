"""Sources: checkpoints of other formats, described without reading data and read lazily.

`_registry` holds them (the built-in ones, those registered, those of installed packages'
`ucp_jax.sources` entry points); the package root lets `ucp_jax.open` (and through it
`restore`, `ucp inspect`, `ucp verify`) open any path one recognizes (`_view.open_source`).
"""
