"""One operation on an S3 checkpoint, in a process of its own (for stalls and Ctrl-C).

usage: s3_worker.py OP SPEC_JSON   (OP: save | restore | read | verify)
Prints "ok" or the error's one line; exits 0, or 2 on a UcpError.
"""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

import ucp_jax


def _restore(spec):
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((2, 4), ("a", "b"))
  target = {"w": NamedSharding(mesh, P("b", "a")), "b": np.zeros(3)}
  return ucp_jax.restore(spec, target)


OPS = {
  "save": lambda spec: ucp_jax.save(
    spec, {"w": np.full((64, 32), 2.0, np.float32)}, overwrite=True
  ),
  "restore": _restore,
  "read": lambda spec: ucp_jax.open(spec).read("w", np.s_[8:40]),
  "verify": lambda spec: ucp_jax.open(spec).verify(),
}

if __name__ == "__main__":
  op, spec = sys.argv[1], json.loads(sys.argv[2])
  print("started", flush=True)
  try:
    OPS[op](spec)
  except ucp_jax.UcpError as e:
    print(f"{type(e).__name__}: {e}", flush=True)
    sys.exit(2)
  print("ok", flush=True)
