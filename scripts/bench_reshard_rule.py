"""Where `reshard(method="auto")`'s rule crosses over: host copies against `jax.device_put`.

Moves a state of `--total-mb` MiB from `P('x', None)` on 8 CPU devices to a (2, 4) mesh with
`P('a', 'b')`, for arrays of each `--sizes-mb` size, with both pinned methods: the first call
(device_put compiles then) and the median of the repeated ones after two untimed calls.
`HOST_COPY_MIN_BYTES` (`ucp_jax/tree/_reshard.py`) sits where the repeated calls cross.

  python scripts/bench_reshard_rule.py --total-mb 256 --sizes-mb 1 4 16 64
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax

CALLS = 7  # the first timed alone, two untimed, the median of the rest


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--total-mb", type=int, default=256)
  ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64])
  args = ap.parse_args()
  devices = np.array(jax.devices())
  src = NamedSharding(Mesh(devices, ("x",)), P("x", None))
  dst = NamedSharding(Mesh(devices.reshape(2, 4), ("a", "b")), P("a", "b"))
  for mib in args.sizes_mb:
    count = max(1, int(args.total_mb / mib))
    rows = round((mib * 2**20 / 4) ** 0.5 / 8) * 8
    cols = int(mib * 2**20 / 4 / rows) // 8 * 8
    state = {
      f"a{i}": jax.device_put(jnp.full((rows, cols), i, jnp.float32), src) for i in range(count)
    }
    times = {}
    for method in ("host", "device_put"):
      seconds = []
      for _ in range(CALLS):
        start = time.perf_counter()
        jax.block_until_ready(ucp_jax.reshard(state, dst, method=method))
        seconds.append(time.perf_counter() - start)
      times[method] = (seconds[0], statistics.median(seconds[3:]))
    picks = ucp_jax.reshard_method(state, dst)[0]
    print(
      f"{mib:g} MiB x {count}: host first {times['host'][0]:.3f} s, repeated "
      f"{times['host'][1]:.3f} s | device_put first {times['device_put'][0]:.3f} s, repeated "
      f"{times['device_put'][1]:.3f} s | auto: {picks}",
      flush=True,
    )


if __name__ == "__main__":
  main()
