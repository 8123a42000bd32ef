#!/usr/bin/env python
"""Save and resharded restore through a local S3 server (moto's), against the store's bound.

The server runs in its own process (`python -m moto.server`) on 127.0.0.1; the state is
`--arrays` float32 arrays, `--size-mb` MiB in all, on 8 CPU devices sharded P('x', None).
Interleaved rounds of:
  ucp_save      ucp_jax.save(spec, state) to a new path each round (a training loop's steps)
  put_bound     the same bytes PUT through a TensorStore kvstore, in objects of the sizes
                the save wrote, all in flight at once (what the server takes, no layout)
  ucp_restore   ucp_jax.restore(spec, target) onto a 2 x 4 mesh, P('y', 'x'): resharded
  get_bound     every object of the checkpoint GET through a TensorStore kvstore
Reported: medians and ranges, ucp's time over the bound, and the objects per checkpoint.

Orbax is not a contender here: its StandardCheckpointer writes its metadata through etils
epath, which reaches S3 only through fsspec's s3fs, and builds the TensorStore spec of its
arrays from the path, with AWS's endpoint; neither takes a local server's endpoint without
patching Orbax.

Usage:
  python scripts/bench_s3.py                    # 256 MiB, 3 rounds
  python scripts/bench_s3.py --size-mb 1024 --arrays 16 --rounds 5
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")

MiB = 1 << 20


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_server() -> tuple[subprocess.Popen, int]:
  port = _free_port()
  server = subprocess.Popen(
    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  for _ in range(600):
    try:
      urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/bench", method="PUT"))
      return server, port
    except OSError:
      time.sleep(0.1)
  raise RuntimeError("moto's server did not start")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size-mb", type=int, default=256)
  parser.add_argument("--arrays", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()

  import jax
  import numpy as np
  import tensorstore as ts
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import ucp_jax
  from ucp_jax.store import _location

  server, port = _start_server()
  try:
    spec = {
      "driver": "s3",
      "bucket": "bench",
      "path": "ckpt",
      "endpoint": f"http://127.0.0.1:{port}",
      "aws_region": "us-east-1",
      "aws_credentials": {"type": "environment"},
    }
    mesh = jax.make_mesh((8,), ("x",))
    side = max(8, int(math.sqrt(args.size_mb * MiB / 4 / args.arrays)) // 8 * 8)
    rng = np.random.default_rng(0)
    host = {f"w{i}": rng.random((side, side), dtype=np.float32) for i in range(args.arrays)}
    state = {k: jax.device_put(v, NamedSharding(mesh, P("x", None))) for k, v in host.items()}
    nbytes = sum(v.nbytes for v in host.values())
    mesh2 = jax.make_mesh((2, 4), ("y", "x"))
    target = {
      k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh2, P("y", "x")))
      for k, v in host.items()
    }
    ucp_jax.save(spec, state)
    kv = ts.KvStore.open({**spec, "path": "ckpt/"}, context=_location.CONTEXT).result()
    keys = [k.decode() for k in kv.list().result()]
    sizes = {k: len(kv.read(k).result().value) for k in keys}
    bound_kv = ts.KvStore.open({**spec, "path": "bound/"}, context=_location.CONTEXT).result()
    blobs = {k: np.random.default_rng(1).bytes(n) for k, n in sizes.items()}

    rounds = iter(range(1, 10**6))
    puts = iter(range(1, 10**6))

    def ucp_save():  # a new step's path, as a training loop saves: nothing replaced
      ucp_jax.save({**spec, "path": f"ckpt{next(rounds)}"}, state)

    def put_bound():
      n = next(puts)
      for f in [bound_kv.write(f"{n}/{k}", v) for k, v in blobs.items()]:
        f.result()

    def ucp_restore():
      out = ucp_jax.restore(spec, target)
      jax.block_until_ready(out)
      return out

    def get_bound():
      kv_now = ts.KvStore.open({**spec, "path": "ckpt/"}, context=_location.CONTEXT).result()
      names = [k.decode() for k in kv_now.list().result()]
      for f in [kv_now.read(k) for k in names]:
        f.result()

    contenders = {
      "ucp_save": ucp_save,
      "put_bound": put_bound,
      "ucp_restore": ucp_restore,
      "get_bound": get_bound,
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
      for name, fn in contenders.items():
        t0 = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t0)
    out = ucp_restore()
    for k, v in host.items():
      np.testing.assert_array_equal(np.asarray(out[k]), v)
    objects = len([k for k in kv.list().result()])
    print(
      f"{nbytes / MiB:.0f} MiB in {args.arrays} arrays on 8 devices, {args.rounds} interleaved "
      f"rounds, moto's S3 server on 127.0.0.1 (its own process)"
    )
    print(f"{'contender':<14}{'median s':>10}{'range':>18}{'GB/s':>8}")
    for name, ts_ in times.items():
      med = statistics.median(ts_)
      print(
        f"{name:<14}{med:>10.3f}{f'{min(ts_):.3f}-{max(ts_):.3f}':>18}{nbytes / med / 1e9:>8.2f}"
      )
    for ours, bound in (("ucp_save", "put_bound"), ("ucp_restore", "get_bound")):
      ratio = statistics.median(times[ours]) / statistics.median(times[bound])
      print(f"{ours} / {bound}: {ratio:.2f}x")
    print(f"objects per checkpoint: {objects} ({args.arrays} arrays)")
  finally:
    server.terminate()
    server.wait()
  return 0


if __name__ == "__main__":
  sys.exit(main())
