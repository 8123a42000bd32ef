"""A GCS server on 127.0.0.1 for TensorStore's gcs driver, behind the same fault proxy as S3.

The server is gcp-storage-emulator's (PyPI), which speaks GCS's JSON API. TensorStore's
gcs driver relies on things the emulator does not do, added here around its handlers:
- listing by `startOffset`/`endOffset` (the driver lists a key range that way; the
  emulator answers with the whole bucket, and TensorStore then aborts the process with
  `std::out_of_range` while it strips the prefix from a name outside the range);
- preconditions: `ifGenerationMatch` on uploads, deletes and reads (0: the object must not
  exist), which the driver sends for conditional writes (ucp_jax's lock), and
  `ifGenerationNotMatch` on reads (a 304 when unchanged);
- suffix ranges (`Range: bytes=-N`, the last N bytes: a bundle's index), and a 416 for a
  range that starts past the end;
- the object's generation in an `x-goog-generation` header of every read;
- a thread per connection (the emulator serves one request at a time), without Nagle's
  delay (its answers go out in two writes: 40 ms each behind a delayed ACK).
TensorStore reaches the server through `TENSORSTORE_GCS_HTTP_URL` with the test token in
`GOOGLE_AUTH_TOKEN_FOR_TESTING` (both read when a store is opened).
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import threading
import urllib.parse
from collections.abc import Iterator
from http import HTTPStatus

import s3_faults

_BUCKETS = itertools.count()
_LOCK = threading.Lock()  # a precondition and the write it guards happen as one


def _patch_emulator() -> None:
  from gcp_storage_emulator import server
  from gcp_storage_emulator.handlers import objects

  if getattr(objects, "_ucp_patched", False):
    return
  replaced = {
    objects.ls: _listing(objects.ls),
    objects.insert: _guarded(objects.insert, "name"),
    objects.delete: _guarded(objects.delete, None),
    objects.download: _conditional_read(objects.download),
    objects.get: _conditional_read(objects.get),
  }
  for _, methods in server.HANDLERS:
    for method, handler in list(methods.items()):
      if handler in replaced:
        methods[method] = replaced[handler]
  for name in ("ls", "insert", "delete", "download", "get"):  # the router calls some by name
    setattr(objects, name, replaced[getattr(objects, name)])
  server.APIThread.run = _threaded_run
  objects._ucp_patched = True


def _threaded_run(self) -> None:
  """The emulator's server loop, a thread per connection (its own serves one request at a
  time, so one slow client would hold every other)."""
  from functools import partial
  from http.server import ThreadingHTTPServer

  from gcp_storage_emulator.server import RequestHandler

  RequestHandler.disable_nagle_algorithm = True  # headers and body go out in two writes
  self._httpd = ThreadingHTTPServer(
    (self._host, self._port), partial(RequestHandler, self._storage)
  )
  self._httpd.daemon_threads = True
  self._httpd.handle_error = lambda *_: None  # a client that hung up (a reset the proxy made)
  self.is_running.set()
  self._httpd.serve_forever()


def _query(request, name: str) -> str | None:
  values = request.query.get(name)
  return values[0] if values else None


def _generation(storage, bucket: str, name: str) -> int:
  try:
    return int(storage.get_file_obj(bucket, name).get("generation") or 0)
  except Exception:  # NotFound
    return 0


def _listing(real):
  def ls(request, response, storage, *args, **kwargs):
    real(request, response, storage, *args, **kwargs)
    if response.status != HTTPStatus.OK:
      return
    start, end = _query(request, "startOffset"), _query(request, "endOffset")
    listed = json.loads(response._content)
    listed["items"] = [
      item
      for item in listed.get("items", [])
      if (start is None or item["name"] >= start) and (end is None or item["name"] < end)
    ]
    response.json(listed)

  return ls


def _guarded(real, name_parameter: str | None):
  def handler(request, response, storage, *args, **kwargs):
    expected = _query(request, "ifGenerationMatch")
    bucket = request.params["bucket_name"]
    name = _query(request, name_parameter) if name_parameter else request.params["object_id"]
    with _LOCK:
      if expected is not None and _generation(storage, bucket, name) != int(expected):
        response.status = HTTPStatus.PRECONDITION_FAILED
        response.json({"error": {"code": 412, "message": "conditionNotMet"}})
        return None
      return real(request, response, storage, *args, **kwargs)

  return handler


def _conditional_read(real):
  def handler(request, response, storage, *args, **kwargs):
    bucket, name = request.params["bucket_name"], request.params["object_id"]
    generation = _generation(storage, bucket, name)
    unchanged = _query(request, "ifGenerationNotMatch")
    if unchanged is not None and generation and generation == int(unchanged):
      response.status = HTTPStatus.NOT_MODIFIED
      return None
    expected = _query(request, "ifGenerationMatch")
    if expected is not None and generation != int(expected):
      response.status = HTTPStatus.PRECONDITION_FAILED
      return None
    if generation:
      response["x-goog-generation"] = str(generation)
    result = real(request, response, storage, *args, **kwargs)
    wanted = (request.get_header("Range") or "").strip()
    if response.status == HTTPStatus.OK and wanted.startswith("bytes=-"):  # the last N bytes
      body = response._content
      lo = max(0, len(body) - int(wanted[len("bytes=-") :]))
      response.status = HTTPStatus.PARTIAL_CONTENT
      response["Content-Range"] = f"bytes {lo}-{len(body) - 1}/{len(body)}"
      response._content = body[lo:]
    elif response.status == HTTPStatus.PARTIAL_CONTENT and not response._content:
      response.status = HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE  # a start past the end
      response._headers.pop("Content-Range", None)
    return result

  return handler


class GCS:
  """gcp-storage-emulator's server and a fault proxy in front of it; `spec(path)` is a
  kvstore spec, `url(path)` a `gs://` URL (both through the proxy)."""

  def __init__(self, seed: int = 0):
    import logging

    from gcp_storage_emulator.server import create_server

    _patch_emulator()
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # a 404 is an error
    self.server = create_server("127.0.0.1", 0, in_memory=True)
    self.server.start()
    self.server_port = self.server._api._httpd.server_address[1]
    self.proxy = s3_faults.FaultProxy(("127.0.0.1", self.server_port), seed)

  @property
  def env(self) -> dict[str, str]:
    """TensorStore through the proxy; gcsfs (Orbax's path library for gs://) straight to
    the server (it sends chunked bodies, which the proxy does not forward)."""
    return {
      "TENSORSTORE_GCS_HTTP_URL": self.proxy.endpoint,
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "testing",
      "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{self.server_port}",
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # no gRPC probe of the bucket's layout
    }

  def bucket(self) -> str:
    name = f"ucp-{os.getpid()}-{next(_BUCKETS)}"
    status, _ = self._request("POST", "/storage/v1/b?project=test", json.dumps({"name": name}))
    assert status == 200, status
    return name

  def spec(self, bucket: str, path: str = "ckpt") -> dict:
    return {"driver": "gcs", "bucket": bucket, "path": path}

  def url(self, bucket: str, path: str = "ckpt") -> str:
    return f"gs://{bucket}/{path}"

  def keys(self, bucket: str, prefix: str = "") -> list[str]:
    """Every key in `bucket` below `prefix`, straight from the server."""
    query = urllib.parse.urlencode({"prefix": prefix})
    status, body = self._request("GET", f"/storage/v1/b/{bucket}/o?{query}")
    assert status == 200, status
    return [item["name"] for item in json.loads(body).get("items", [])]

  def _request(self, method: str, target: str, body: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", self.server_port, timeout=30)
    try:
      headers = {"Content-Type": "application/json"} if body is not None else {}
      conn.request(method, target, body=body, headers=headers)
      response = conn.getresponse()
      return response.status, response.read()
    finally:
      conn.close()

  def close(self) -> None:
    self.proxy.close()
    self.server.stop()


@contextlib.contextmanager
def running(seed: int = 0) -> Iterator[GCS]:
  """A `GCS` server and proxy, with TensorStore pointed at it while it runs."""
  server = GCS(seed)
  with s3_faults.serving(server, server.env):
    yield server


if __name__ == "__main__":  # a server of its own process, for benchmarks: gcs_server.py PORT
  import sys
  import time

  from gcp_storage_emulator.server import create_server

  _patch_emulator()
  standalone = create_server("127.0.0.1", int(sys.argv[1]), in_memory=True)
  standalone.start()
  while True:
    time.sleep(3600)
