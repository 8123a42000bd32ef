"""State dicts of torch tensors, as torch files hold them: their entries checked to be
tensors, tied entries found, buffers told from parameters by name. The torch-file source and
the Hugging Face folders (`pytorch_model.bin`) both read them.
"""

from __future__ import annotations

import numpy as np

from ucp_jax.base._errors import SourceFormatError, bullet_list
from ucp_jax.sources._byte_span import ByteSpan
from ucp_jax.sources._torch_reader._torch_file import is_tensor

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
BUFFER_NAMES = frozenset(
  {
    "running_mean",
    "running_var",
    "num_batches_tracked",
    "position_ids",
    "token_type_ids",
    "inv_freq",
    "original_inv_freq",
    "masked_bias",
  }
)
"""Last parts of state-dict names that are buffers, not parameters (BatchNorm statistics,
position ids, rotary frequencies)."""


def is_buffer(name: str) -> bool:
  """Whether a state-dict name is a buffer by its last part (`BUFFER_NAMES`)."""
  return name.rsplit(".", 1)[-1] in BUFFER_NAMES


def tensors(state: dict, file: str, prefix: str = "") -> dict[str, np.ndarray]:
  """The entries of a state dict, each checked to be a tensor (all problems at once)."""
  bad = []
  for name, value in state.items():
    if not isinstance(name, str):
      bad.append(f"{prefix}[{name!r:.80}]: a {type(name).__name__} key, not a parameter name")
    elif not name.isprintable():
      bad.append(f"{prefix}[{name!r:.80}]: not printable text, not a parameter name")
    elif not is_tensor(value):
      shown = getattr(value, "qualname", None) or f"{type(value).__name__} {value!r:.40}"
      bad.append(f"{prefix}[{name!r}] holds {shown}, not a tensor")
  if len(bad) == 1:
    raise SourceFormatError(f"{file}: not a state dict of tensors: {bad[0]}")
  if bad:
    raise SourceFormatError(f"{file}: not a state dict of tensors:\n{bullet_list(bad, 20)}")
  if not state:
    raise SourceFormatError(f"{file}: {prefix or 'the file'} holds no tensors")
  return dict(state)


def aliases(arrays: dict[str, np.ndarray]) -> dict[str, str]:
  """Entries on exactly the bytes of an earlier entry (a tied weight) -> that entry."""
  first: dict[tuple, str] = {}
  out = {}
  for name, array in arrays.items():
    if array.size == 0:
      continue
    if isinstance(array, ByteSpan):  # located: the same entry and offset are the same bytes
      place = (id(array.entry), array.offset, array.shape, array.strides, array.dtype.str)
    else:
      place = (array.__array_interface__["data"][0], array.shape, array.strides, array.dtype.str)
    if place in first:
      out[name] = first[place]
    else:
      first[place] = name
  return out
