"""Sources: checkpoints of other formats, described without reading data and read lazily.

Importing this package lets `ucp_jax.open` (and through it `restore`, `ucp inspect`,
`ucp verify`) open any path a source recognizes (`_registry`).
"""

from ucp_jax.sources import _view
from ucp_jax.store import _reader

_reader.register_opener(_view.open_source)
