"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks, and a fault/counting proxy.

``S3Server`` runs moto's S3 (in a thread of this process, or in a subprocess
with its own interpreter lock); ``HTTPProxy`` forwards plain HTTP to it and
counts requests by method, failing the next ``k`` of them on demand (503,
connection reset or a stall), so retries and GET counts are observed at the
wire, not mocked inside the package.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import http.server
import importlib.util
import os
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

__all__ = [
    "ACCESS_KEY",
    "SECRET_KEY",
    "HTTPProxy",
    "S3Server",
    "free_port",
    "moto_unavailable_reason",
    "s3_storage_options",
]

# Imported as tests.helpers.s3_server by the tests and as s3_server by the benchmarks: its
# sibling is loaded by path, once, under one name.
_MOTO_ATOMIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moto_atomic.py")


def _moto_atomic() -> Any:
    name = "_grain_replay_moto_atomic"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _MOTO_ATOMIC)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


ACCESS_KEY = "testing-key"
SECRET_KEY = "testing-secret"
REGION = "us-east-1"


def moto_unavailable_reason() -> str | None:
    """None when moto's server and s3fs import, else why not (for ``pytest.skip``)."""
    try:
        import boto3  # noqa: F401
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        return f"S3 tests need moto[server], boto3 and s3fs ({e}); pip install 'moto[server]' s3fs"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (closed again at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def s3_storage_options(endpoint_url: str, **extra: Any) -> dict[str, Any]:
    """fsspec ``storage_options`` for s3fs against ``endpoint_url`` with the test credentials."""
    opts: dict[str, Any] = {
        "key": ACCESS_KEY,
        "secret": SECRET_KEY,
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": REGION},
    }
    opts.update(extra)
    return opts


class S3Server:
    """moto's S3 on 127.0.0.1, on a free port.

    Args:
      subprocess: run ``moto.server`` in a child process (its own GIL: use it for
        timing); else a thread of this process (starts in well under a second).
    """

    def __init__(self, *, subprocess: bool = False):
        self._subprocess = subprocess
        self._thread_server: Any = None
        self._proc: Any = None
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        if self._subprocess:
            self.port = free_port()
            self._proc = subprocess.Popen(
                # moto.server with conditional creates as atomic as S3's (moto_atomic.py)
                [sys.executable, _MOTO_ATOMIC, "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 30
            while True:
                try:
                    urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=1).close()
                    break
                except OSError:
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError("moto_server did not start") from None
                    time.sleep(0.05)
        else:
            import logging

            from moto.server import ThreadedMotoServer

            _moto_atomic().apply()  # conditional creates as atomic as S3's

            # werkzeug logs every request at INFO; that costs time and floods output.
            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            self._thread_server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self._thread_server.start()
            self.port = int(self._thread_server.get_host_and_port()[1])
        return self

    def stop(self) -> None:
        if self._thread_server is not None:
            self._thread_server.stop()
            self._thread_server = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        return s3_storage_options(self.endpoint_url, **extra)

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)

    def upload(self, local: str, bucket: str, key: str) -> str:
        """Uploads a file, or a directory tree under ``key/``; returns ``s3://bucket/key``."""
        client = self.client()
        if os.path.isdir(local):
            for root, _, files in os.walk(local):
                for name in files:
                    full = os.path.join(root, name)
                    rel = os.path.relpath(full, local).replace(os.sep, "/")
                    client.upload_file(full, bucket, f"{key}/{rel}")
        else:
            client.upload_file(local, bucket, key)
        return f"s3://{bucket}/{key}"


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes: without this, Nagle's algorithm
        # and the client's delayed ACK add ~40 ms to every response.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.proxy._track(self.connection)

    def _forward(self) -> None:
        proxy = self.server.proxy
        body = b""
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            body = self.rfile.read(length)
        proxy._count(self.command)
        fault = proxy._take_fault()
        with proxy._in_flight():
            self._answer(fault, body)

    def _answer(self, fault: str | None, body: bytes) -> None:
        proxy = self.server.proxy
        if fault == "503":
            payload = (
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ServiceUnavailable</Code>"
                b"<Message>injected by the test proxy</Message></Error>"
            )
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        if fault == "reset":
            # RST instead of FIN: the client sees "connection reset by peer".
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        if fault == "stall":
            time.sleep(proxy.stall_s)
            self.close_connection = True
            return
        conn = getattr(self, "_upstream", None)
        if conn is None:
            conn = self._upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            self._upstream = None
            self.close_connection = True
            return
        self.send_response(resp.status, resp.reason)
        head = self.command == "HEAD"
        for k, v in resp.getheaders():
            # A HEAD response's Content-Length is the object's size, not the body's.
            if k.lower() not in _HOP_BY_HOP and (head or k.lower() != "content-length"):
                self.send_header(k, v)
        if not head:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "server",
    "date",
}


class _ProxyServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256
    proxy: HTTPProxy


class HTTPProxy:
    """A threaded HTTP forwarder on 127.0.0.1 that counts and can fail requests.

    Args:
      upstream_port: port of the server on 127.0.0.1 to forward to.
      stall_s: how long a ``"stall"`` fault holds the request before closing.
    """

    def __init__(self, upstream_port: int, *, stall_s: float = 5.0):
        self.upstream_port = upstream_port
        self.stall_s = stall_s
        self.counts: collections.Counter[str] = collections.Counter()
        self._faults: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()
        self._active = 0
        self._conns: list[socket.socket] = []
        # Most requests being answered at once since the last reset_counts().
        self.max_in_flight = 0
        self._server = _ProxyServer(("127.0.0.1", 0), _ProxyHandler)
        self._server.proxy = self
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HTTPProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops listening and drops open connections, as a server going down does."""
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join()

    def _track(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.append(conn)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def __enter__(self) -> HTTPProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def fail_next(self, k: int, mode: str = "503") -> None:
        """Fails the next ``k`` requests: ``"503"``, ``"reset"`` or ``"stall"``."""
        if mode not in ("503", "reset", "stall"):
            raise ValueError(f"mode must be '503', 'reset' or 'stall', got {mode!r}")
        with self._lock:
            self._faults.extend([mode] * k)

    def reset_counts(self) -> None:
        with self._lock:
            self.counts.clear()
            self.max_in_flight = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[collections.Counter[str]]:
        """Yields a counter of the requests made inside the block, by method."""
        with self._lock:
            before = collections.Counter(self.counts)
        got: collections.Counter[str] = collections.Counter()
        yield got
        with self._lock:
            got.update(self.counts)
        got.subtract(before)

    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        with self._lock:
            self._active += 1
            self.max_in_flight = max(self.max_in_flight, self._active)
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    def _count(self, method: str) -> None:
        with self._lock:
            self.counts[method] += 1

    def _take_fault(self) -> str | None:
        with self._lock:
            return self._faults.popleft() if self._faults else None


def serve_bucket(bucket: str) -> Iterator[S3Server]:
    """A module fixture's body: a local S3 server with ``bucket`` created, stopped
    afterwards; the test is skipped when moto cannot start on 127.0.0.1."""
    import pytest

    try:
        server = S3Server().start()
    except Exception as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"cannot start moto's S3 server on 127.0.0.1: {type(e).__name__}: {e}")
    server.create_bucket(bucket)
    yield server
    server.stop()
