"""A real S3 server (moto's, on 127.0.0.1) behind a fault-injecting proxy of our own.

The proxy also stands in front of a GCS server (`gcs_server`): it knows both APIs' requests.
TensorStore's s3 driver talks HTTP/1.1 to the proxy, which forwards each request to the
server unless a rule says otherwise. A rule picks requests by kind and method and does
one of:
- `status`: answers 503 SlowDown (or another code) without forwarding;
- `reset`: resets the connection without forwarding (nothing was applied);
- `lost`: forwards the request (it is applied) and resets the connection instead of
  answering, so the client never learns that it was;
- `stall`: holds the request without an answer (for `seconds`, or until the proxy closes);
- `truncate`: forwards and sends the answer's headers with only half of its body, then
  resets (a body cut half way);
- `stall-body`: forwards and sends the headers and half of the body, then holds the rest
  (a body that stops half way, the connection left open);
- `kill` / `kill-after`: SIGKILLs the process `pid` before forwarding the request, or after
  it was applied (then the request is not answered).

Kinds, from the key a request names: `lock` (`.ucp-lock`), `manifest` (`manifest.json`),
`metadata` (`zarr.json`), `list` (a bucket listing), `delete` (DELETE and batch deletes),
`chunk` (every other object), `any`. Rules are chosen per request by a seeded random
draw (`rate`), so a run is repeatable, and may be limited to `count` hits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import itertools
import json
import os
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator

_SLOWDOWN = (
  b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
  b"<Message>Please reduce your request rate.</Message></Error>"
)

_BUCKETS = itertools.count()

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
"""The credentials the server accepts (any would do); TensorStore reads them from the env."""


@dataclasses.dataclass
class Rule:
  action: str  # status | reset | lost | stall | truncate | stall-body
  kind: str = "any"
  method: str | None = None  # GET, PUT, HEAD, DELETE, POST; None: any
  rate: float = 1.0
  count: int | None = None  # at most this many hits; None: no limit
  status: int = 503
  seconds: float | None = None  # a stall's length; None: until the proxy closes
  after: int = 0  # let this many matching requests through first
  pid: int | None = None  # the process `kill` kills
  hits: int = 0
  passed: int = 0

  def matches(self, kind: str, method: str) -> bool:
    return (self.kind in ("any", kind)) and (self.method in (None, method))


def kind_of(method: str, target: str) -> str:
  """The kind of request `method target` (see the module docstring), in S3's API or GCS's
  JSON API (`/storage/v1/b/BUCKET/o[/KEY]`, `/upload/storage/v1/b/BUCKET/o?name=KEY`)."""
  parsed = urllib.parse.urlsplit(target)
  query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
  if parsed.path.startswith(("/storage/v1/b/", "/upload/storage/v1/b/", "/batch/")):
    key = _gcs_key(parsed.path, query)
  else:
    path = urllib.parse.unquote(parsed.path)
    key = path.split("/", 2)[-1] if path.count("/") > 1 else ""
  if method == "DELETE" or (method == "POST" and "delete" in query) or "/batch/" in parsed.path:
    return "delete"
  if "list-type" in query or not key:
    return "list"
  if key.endswith(".ucp-lock"):
    return "lock"
  if key.endswith("manifest.json"):
    return "manifest"
  if key.endswith("zarr.json"):
    return "metadata"
  return "chunk"


def _gcs_key(path: str, query: dict) -> str:
  """The object a GCS JSON API request names ("" for a listing)."""
  if path.startswith("/upload/"):
    return query.get("name", [""])[0]
  _, _, rest = path.partition("/o/")
  return urllib.parse.unquote(rest)


class FaultProxy:
  """An HTTP proxy on 127.0.0.1 in front of `upstream` ("host:port"), injecting faults."""

  def __init__(self, upstream: tuple[str, int], seed: int = 0):
    self.upstream = upstream
    self.rules: list[Rule] = []
    self.log: list[tuple[str, str, str, str]] = []  # (kind, method, target, what happened)
    self._random = random.Random(seed)
    self._lock = threading.Lock()
    self._closed = threading.Event()
    self._server = socket.create_server(("127.0.0.1", 0))
    self.port = self._server.getsockname()[1]
    self._connections: set[socket.socket] = set()
    threading.Thread(target=self._accept, daemon=True, name="s3-fault-proxy").start()

  @property
  def endpoint(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def add(self, action: str, kind: str = "any", **options) -> Rule:
    rule = Rule(action, kind, **options)
    with self._lock:
      self.rules.append(rule)
    return rule

  def reseed(self, seed: int) -> None:
    with self._lock:
      self._random.seed(seed)

  def clear(self) -> None:
    with self._lock:
      self.rules.clear()

  @contextlib.contextmanager
  def faults(self, *rules: Rule) -> Iterator[None]:
    with self._lock:
      self.rules.extend(rules)
    try:
      yield
    finally:
      with self._lock:
        for rule in rules:
          self.rules.remove(rule)

  def seen(
    self, kind: str | None = None, what: str | None = None, method: str | None = None
  ) -> int:
    """How many requests of `kind` and `method` (any) the proxy saw, ending as `what` (any)."""
    with self._lock:
      return sum(
        kind in (None, k) and what in (None, w) and method in (None, m) for k, m, _, w in self.log
      )

  def close(self) -> None:
    self._closed.set()
    with contextlib.suppress(OSError):
      self._server.close()
    with self._lock:
      for conn in list(self._connections):
        _reset(conn)

  def _choose(self, kind: str, method: str) -> Rule | None:
    with self._lock:
      for rule in self.rules:
        if not rule.matches(kind, method) or (rule.count is not None and rule.hits >= rule.count):
          continue
        if rule.passed < rule.after:
          rule.passed += 1
          continue
        if self._random.random() < rule.rate:
          rule.hits += 1
          return rule
    return None

  def _accept(self) -> None:
    while not self._closed.is_set():
      try:
        conn, _ = self._server.accept()
      except OSError:
        return
      with self._lock:
        self._connections.add(conn)
      threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

  def _serve(self, conn: socket.socket) -> None:
    upstream = http.client.HTTPConnection(*self.upstream, timeout=60)
    reader = conn.makefile("rb")
    try:
      while not self._closed.is_set():
        request = _read_request(reader)
        if request is None:
          return
        method, target, headers, body = request
        kind = kind_of(method, target)
        rule = self._choose(kind, method)
        what = rule.action if rule else "ok"
        with self._lock:
          self.log.append((kind, method, target, what))
        if rule is not None and rule.action == "status":
          _answer(conn, rule.status, _SLOWDOWN if rule.status == 503 else b"")
          continue
        if rule is not None and rule.action == "reset":
          _reset(conn)
          return
        if rule is not None and rule.action == "kill":
          _kill(rule.pid)
          _reset(conn)
          return
        if rule is not None and rule.action == "stall":
          self._closed.wait(rule.seconds)
          _reset(conn)
          return
        upstream.request(method, target, body=body, headers=headers)
        response = upstream.getresponse()
        payload = response.read()
        if rule is not None and rule.action in ("lost", "kill-after"):
          if rule.action == "kill-after":
            _kill(rule.pid)
          _reset(conn)
          return
        head = [f"HTTP/1.1 {response.status} {response.reason}"]
        head += [f"{k}: {v}" for k, v in response.getheaders() if k.lower() != "connection"]
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if rule is not None and rule.action in ("truncate", "stall-body"):
          conn.sendall(payload[: len(payload) // 2])
          if rule.action == "stall-body":
            self._closed.wait(rule.seconds)
          time.sleep(0.05)
          _reset(conn)
          return
        conn.sendall(payload)
    except OSError:
      return
    finally:
      upstream.close()
      with self._lock:
        self._connections.discard(conn)
      with contextlib.suppress(OSError):
        conn.close()


def _read_request(reader) -> tuple[str, str, dict[str, str], bytes] | None:
  line = reader.readline()
  if not line:
    return None
  method, target, _ = line.decode("latin-1").split(" ", 2)
  headers: dict[str, str] = {}
  while True:
    line = reader.readline()
    if line in (b"\r\n", b"\n", b""):
      break
    name, _, value = line.decode("latin-1").partition(":")
    headers[name.strip()] = value.strip()
  length = int(next((v for k, v in headers.items() if k.lower() == "content-length"), "0"))
  body = reader.read(length) if length else b""
  if any(k.lower() == "transfer-encoding" for k in headers):
    raise OSError("chunked request bodies are not supported by this proxy")
  return method, target, headers, body


def _answer(conn: socket.socket, status: int, body: bytes) -> None:
  reason = {503: "Slow Down", 500: "Internal Server Error", 429: "Too Many Requests"}
  head = (
    f"HTTP/1.1 {status} {reason.get(status, 'Error')}\r\nContent-Type: application/xml\r\n"
    f"Content-Length: {len(body)}\r\n\r\n"
  )
  conn.sendall(head.encode() + body)


def _kill(pid: int | None) -> None:
  import signal

  if pid is not None:
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGKILL)


def _reset(conn: socket.socket) -> None:
  """Closes `conn` with a TCP reset (no orderly shutdown)."""
  with contextlib.suppress(OSError):
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    conn.close()


class S3:
  """moto's S3 server and a fault proxy in front of it; `spec(path)` is a kvstore spec."""

  def __init__(self, seed: int = 0):
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    self.server.start()
    self.server_port = self.server._server.server_port
    self.proxy = FaultProxy(("127.0.0.1", self.server_port), seed)

  def bucket(self) -> str:
    """A new, empty bucket."""
    # moto's state is per process, not per server: names unique across servers too
    name = f"ucp-{os.getpid()}-{next(_BUCKETS)}"
    conn = http.client.HTTPConnection("127.0.0.1", self.server_port, timeout=30)
    conn.request("PUT", f"/{name}")
    assert conn.getresponse().status == 200
    conn.close()
    return name

  def spec(self, bucket: str, path: str = "ckpt", *, direct: bool = False) -> dict:
    """The kvstore spec of `path` in `bucket`, through the proxy (or `direct` to the server)."""
    port = self.server_port if direct else self.proxy.port
    return {
      "driver": "s3",
      "bucket": bucket,
      "path": path,
      "endpoint": f"http://127.0.0.1:{port}",
      "aws_region": "us-east-1",
      "aws_credentials": {"type": "environment"},
    }

  def text(self, bucket: str, path: str = "ckpt", **options) -> str:
    return json.dumps(self.spec(bucket, path, **options))

  def keys(self, bucket: str, prefix: str = "") -> list[str]:
    """Every key in `bucket` below `prefix`, straight from the server."""
    import xml.etree.ElementTree as ET

    keys, token = [], None
    while True:
      query = {
        "list-type": "2",
        "prefix": prefix,
        **({"continuation-token": token} if token else {}),
      }
      conn = http.client.HTTPConnection("127.0.0.1", self.server_port, timeout=30)
      conn.request("GET", f"/{bucket}?{urllib.parse.urlencode(query)}")
      root = ET.fromstring(conn.getresponse().read())
      conn.close()
      ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
      keys += [e.text for e in root.iter(f"{ns}Key")]
      token = next((e.text for e in root.iter(f"{ns}NextContinuationToken")), None)
      if not token:
        return keys

  def close(self) -> None:
    self.proxy.close()
    self.server.stop()


@contextlib.contextmanager
def serving(server, env: dict[str, str]) -> Iterator:
  """`server` (S3, GCS) until the block ends, with `env` set for TensorStore meanwhile; then
  the server is closed and the environment put back."""
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    yield server
  finally:
    server.close()
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


@contextlib.contextmanager
def running(seed: int = 0) -> Iterator[S3]:
  """An `S3` server and proxy, with `ENV`'s credentials set for TensorStore while it runs."""
  with serving(S3(seed), ENV) as server:
    yield server
