"""Public functions whose options the command line spells as text, taken as text here too."""

from __future__ import annotations

import functools

from ucp_jax import _rule_specs
from ucp_jax.sinks import _export


@functools.wraps(_export.export)
def export(ckpt, dst, *, format, rules=None, **options):
  rules = _rule_specs.parse(rules, ckpt, options.get("config"))
  return _export.export(ckpt, dst, format=format, rules=rules, **options)
