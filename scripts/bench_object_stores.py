#!/usr/bin/env python
"""Save and resharded restore through a local object store, against the store's bound and Orbax.

The server runs in its own process on 127.0.0.1: moto's S3 server (`--store s3`) or a GCS
server (`--store gcs`: gcp-storage-emulator with what TensorStore's gcs driver needs,
tests/support/gcs_server.py). The state is `--arrays` float32 arrays, `--size-mb` MiB in all, on 8
CPU devices sharded P('x', None). Interleaved rounds of:
  ucp_save       ucp_jax.save(path, state) to a new path each round (a training loop's steps)
  orbax_save     Orbax's StandardCheckpointer.save of the same state to a new path (gcs only)
  put_bound      the same bytes PUT through a TensorStore kvstore, in objects of the sizes
                 ucp_jax's save wrote, all in flight at once (what the server takes, no layout)
  ucp_restore    ucp_jax.restore(path, target) onto a 2 x 4 mesh, P('y', 'x'): resharded
  orbax_restore  StandardCheckpointer.restore of Orbax's checkpoint onto the same target
  get_bound      every object of ucp_jax's checkpoint GET through a TensorStore kvstore
Both libraries write and read the arrays through TensorStore, with the same durability (an
object store has no fsync: a PUT that returned is stored), into a fresh path each round.
Reported: medians and ranges, the ratios, and the objects per checkpoint of each.

Orbax runs on gs:// only: for s3:// its TensorStore spec builder (orbax-checkpoint 0.12.8)
takes the path for a local one ("Checkpoint path should be absolute. Got s3:/..."). Its
metadata files go through gcsfs (etils' gs:// paths), which the GCS server also answers.

Usage:
  python scripts/bench_object_stores.py                         # gcs, 256 MiB, 3 rounds
  python scripts/bench_object_stores.py --store s3 --size-mb 1024 --rounds 5
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
from pathlib import Path

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")

MiB = 1 << 20
SUPPORT = Path(__file__).resolve().parent.parent / "tests" / "support"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_server(store: str) -> tuple[subprocess.Popen, int]:
  """The server in its own process, with one bucket named "bench"."""
  port = _free_port()
  if store == "s3":
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    create = urllib.request.Request(f"http://127.0.0.1:{port}/bench", method="PUT")
  else:
    command = [sys.executable, str(SUPPORT / "gcs_server.py"), str(port)]
    create = urllib.request.Request(
      f"http://127.0.0.1:{port}/storage/v1/b?project=bench",
      data=b'{"name": "bench"}',
      headers={"Content-Type": "application/json"},
      method="POST",
    )
  server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  for _ in range(600):
    try:
      urllib.request.urlopen(create)
      return server, port
    except OSError:
      time.sleep(0.1)
  server.kill()
  raise RuntimeError(f"the {store} server did not start")


def _spec(store: str, port: int, path: str) -> dict:
  if store == "s3":
    return {
      "driver": "s3",
      "bucket": "bench",
      "path": path,
      "endpoint": f"http://127.0.0.1:{port}",
      "aws_region": "us-east-1",
      "aws_credentials": {"type": "environment"},
    }
  return {"driver": "gcs", "bucket": "bench", "path": path}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--store", choices=["gcs", "s3"], default="gcs")
  parser.add_argument("--size-mb", type=int, default=256)
  parser.add_argument("--arrays", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--bundle-mib", type=float, default=None, help="ucp_jax's bundle_bytes")
  args = parser.parse_args()
  options = {} if args.bundle_mib is None else {"bundle_bytes": int(args.bundle_mib * MiB)}

  server, port = _start_server(args.store)
  if args.store == "gcs":
    os.environ.update(
      TENSORSTORE_GCS_HTTP_URL=f"http://127.0.0.1:{port}",
      GOOGLE_AUTH_TOKEN_FOR_TESTING="bench",
      STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{port}",
      GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
    )

  import jax
  import numpy as np
  import tensorstore as ts
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import ucp_jax
  from ucp_jax.store import _location

  try:
    spec = _spec(args.store, port, "ckpt")
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
    ucp_jax.save(spec, state, **options)

    def listing(path: str) -> list[str]:
      kv = ts.KvStore.open(_spec(args.store, port, path), context=_location.context()).result()
      return [k.decode() for k in kv.list().result()]

    kv = ts.KvStore.open(_spec(args.store, port, "ckpt/"), context=_location.context()).result()
    sizes = {k: len(kv.read(k).result().value) for k in listing("ckpt/")}
    bound_kv = ts.KvStore.open(_spec(args.store, port, "bound/"), context=_location.context())
    bound_kv = bound_kv.result()
    blobs = {k: np.random.default_rng(1).bytes(n) for k, n in sizes.items()}
    rounds = {name: iter(range(1, 10**6)) for name in ("ucp", "orbax", "put")}

    def ucp_save():  # a new step's path, as a training loop saves: nothing replaced
      ucp_jax.save({**spec, "path": f"ckpt{next(rounds['ucp'])}"}, state, **options)

    def put_bound():
      n = next(rounds["put"])
      for f in [bound_kv.write(f"{n}/{k}", v) for k, v in blobs.items()]:
        f.result()

    def ucp_restore():
      return jax.block_until_ready(ucp_jax.restore(spec, target))

    def get_bound():
      kv_now = ts.KvStore.open(_spec(args.store, port, "ckpt/"), context=_location.context())
      kv_now = kv_now.result()
      for f in [kv_now.read(k) for k in listing("ckpt/")]:
        f.result()

    contenders = {"ucp_save": ucp_save, "put_bound": put_bound}
    if args.store == "gcs":
      import orbax.checkpoint as ocp

      checkpointer = ocp.StandardCheckpointer()
      checkpointer.save("gs://bench/orbax0", state)
      checkpointer.wait_until_finished()

      def orbax_save():
        checkpointer.save(f"gs://bench/orbax{next(rounds['orbax'])}", state)
        checkpointer.wait_until_finished()

      def orbax_restore():
        return jax.block_until_ready(checkpointer.restore("gs://bench/orbax0", target))

      contenders |= {"orbax_save": orbax_save}
    contenders |= {"ucp_restore": ucp_restore, "get_bound": get_bound}
    if args.store == "gcs":
      contenders |= {"orbax_restore": orbax_restore}

    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
      for name, fn in contenders.items():
        t0 = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t0)
    for restore in ("ucp_restore", "orbax_restore"):
      if restore in contenders:
        out = contenders[restore]()
        for k, v in host.items():
          np.testing.assert_array_equal(np.asarray(out[k]), v, err_msg=restore)

    server_name = "moto's S3 server" if args.store == "s3" else "a GCS server (gcs_server.py)"
    print(
      f"{nbytes / MiB:.0f} MiB in {args.arrays} arrays on 8 devices, {args.rounds} interleaved "
      f"rounds, {server_name} on 127.0.0.1 (its own process)"
    )
    print(f"{'contender':<15}{'median s':>10}{'range':>18}{'GB/s':>8}")
    for name, seconds in times.items():
      med = statistics.median(seconds)
      spread = f"{min(seconds):.3f}-{max(seconds):.3f}"
      print(f"{name:<15}{med:>10.3f}{spread:>18}{nbytes / med / 1e9:>8.2f}")
    pairs = [("ucp_save", "put_bound"), ("ucp_restore", "get_bound")]
    if args.store == "gcs":
      pairs += [("ucp_save", "orbax_save"), ("ucp_restore", "orbax_restore")]
    for ours, other in pairs:
      ratio = statistics.median(times[ours]) / statistics.median(times[other])
      print(f"{ours} / {other}: {ratio:.2f}x")
    print(f"objects per checkpoint: ucp_jax {len(listing('ckpt/'))}", end="")
    if args.store == "gcs":
      print(f", Orbax {len(listing('orbax0/'))}", end="")
    print(f" ({args.arrays} arrays)")
  finally:
    server.terminate()
    server.wait()
  return 0


if __name__ == "__main__":
  sys.exit(main())
