"""End-to-end tests: real clients (curl, httpx, websockets, raw sockets) through the real
proxy process to real upstreams (the aiohttp demo upstream, nginx, and small asyncio
servers written here that misbehave on purpose). Everything runs on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hyperframe.frame import HeadersFrame
from websockets.exceptions import ConnectionClosedOK
from websockets.sync.client import connect as ws_connect

from aiproxy.demo.upstream import pattern
from tests.conftest import Proxy, simple_config
from tests.h2_raw_upstream import RawConn as H2RawConn
from tests.h2_raw_upstream import RawUpstream
from tests.h2_support import FrameClient, bytes_sha256
from tests.support import (
    RssMonitor,
    free_port,
    run_nginx,
    start_demo_upstream,
    stop_process,
)

KiB = 1024
MiB = 1024 * KiB
EMPTY_SHA = hashlib.sha256(b"").hexdigest()
# RSS growth allowed while streaming. With flow control the proxy grows by < 1 MiB; with
# either pause path disabled it grew 60-80 MiB in these tests (fast clients included), so
# the limits sit well below the transfer sizes and well above allocator noise.
RSS_LIMIT_STREAM = 32 * MiB
RSS_LIMIT_SLOW = 16 * MiB

StartProxy = Callable[..., Proxy]


# -- helpers: hashing, memory -------------------------------------------------------------


def upload_blocks(total: int, block: bytes) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        piece = block[: min(len(block), total - sent)]
        sent += len(piece)
        yield piece


def upload_sha256(total: int, block: bytes) -> str:
    digest = hashlib.sha256()
    for piece in upload_blocks(total, block):
        digest.update(piece)
    return digest.hexdigest()


def random_block(size: int = MiB, seed: int = 7) -> bytes:
    return random.Random(seed).randbytes(size)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def warm_up(proxy: Proxy, path: str = "/echo") -> None:
    """One request first, so the RSS baseline includes what the first request allocates."""
    with httpx.Client(timeout=10) as client:
        assert client.post(proxy.url + path, content=b"x" * (256 * KiB)).status_code == 200
        assert client.get(proxy.url + "/bytes/1048576").status_code == 200


# -- helpers: raw HTTP/1.x over a socket --------------------------------------------------


@dataclass
class RawResponse:
    version: str
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes = b""

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name.lower()]
        return ", ".join(values) if values else None

    def json(self) -> dict:
        return json.loads(self.body)


class RawConn:
    """A client socket that writes exactly the bytes given and parses responses itself."""

    def __init__(self, port: int, timeout: float = 10.0, rcvbuf: int | None = None) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(timeout)
        sock.connect(("127.0.0.1", port))
        self.sock = sock
        self.buf = bytearray()

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        data = self.sock.recv(256 * KiB)
        if not data:
            raise EOFError(f"connection closed; unparsed: {bytes(self.buf[:200])!r}")
        self.buf += data

    def read_until(self, delim: bytes) -> bytes:
        while True:
            i = self.buf.find(delim)
            if i >= 0:
                end = i + len(delim)
                out = bytes(self.buf[:end])
                del self.buf[:end]
                return out
            self._fill()

    def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def read_to_eof(self) -> bytes:
        while True:
            data = self.sock.recv(256 * KiB)
            if not data:
                break
            self.buf += data
        out = bytes(self.buf)
        self.buf.clear()
        return out

    def read_head(self) -> RawResponse:
        head = self.read_until(b"\r\n\r\n").decode("latin-1")
        lines = head[:-4].split("\r\n")
        version, status, reason = (lines[0].split(" ", 2) + [""])[:3]
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            assert sep, f"bad header line {line!r}"
            headers.append((name.strip().lower(), value.strip()))
        return RawResponse(version, int(status), reason, headers)

    def read_response(self, method: str = "GET") -> RawResponse:
        resp = self.read_head()
        if resp.status < 200 or method == "HEAD" or resp.status in (204, 304):
            return resp
        te = resp.header("transfer-encoding")
        cl = resp.header("content-length")
        if te is not None:
            assert te.lower() == "chunked", te
            assert cl is None, "both Transfer-Encoding and Content-Length"
            resp.body = self._read_chunked()
        elif cl is not None:
            resp.body = self.read_exact(int(cl))
        else:
            resp.body = self.read_to_eof()
        return resp

    def _read_chunked(self) -> bytes:
        parts = []
        while True:
            size = int(self.read_until(b"\r\n").split(b";")[0].strip(), 16)
            if size == 0:
                while self.read_until(b"\r\n") != b"\r\n":
                    pass  # trailer fields
                return b"".join(parts)
            parts.append(self.read_exact(size))
            assert self.read_exact(2) == b"\r\n"

    def closed_within(self, seconds: float) -> bool:
        """True if the peer closes (EOF or reset) within `seconds` without sending bytes."""
        assert not self.buf, f"unread bytes: {bytes(self.buf[:200])!r}"
        self.sock.settimeout(seconds)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
        assert data == b"", f"unexpected bytes: {data[:200]!r}"
        return True

    def silent_for(self, seconds: float) -> bool:
        """True if nothing at all arrives for `seconds` (and the connection stays open)."""
        if self.buf:
            return False
        old = self.sock.gettimeout()
        self.sock.settimeout(seconds)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return True
        finally:
            self.sock.settimeout(old)
        self.buf += data
        return False


def get(path: str, host: str = "test", extra: str = "", version: str = "1.1") -> bytes:
    return f"GET {path} HTTP/{version}\r\nHost: {host}\r\n{extra}\r\n".encode()


def assert_error(status: int, headers: object, body: bytes, expected: int,
                 code: str | None = None) -> dict:
    """The proxy's own error responses: the status and a JSON {"error": {code, message}}."""
    assert status == expected, body[:500]
    content_type = headers.get("content-type") if hasattr(headers, "get") else None
    assert content_type is not None and content_type.startswith("application/json")
    err = json.loads(body)["error"]
    assert isinstance(err["code"], str) and err["code"]
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def raw_error(resp: RawResponse, expected: int, code: str | None = None) -> dict:
    return assert_error(resp.status, {"content-type": resp.header("content-type")}, resp.body,
                        expected, code)


def httpx_error(resp: httpx.Response, expected: int, code: str | None = None) -> dict:
    return assert_error(resp.status_code, resp.headers, resp.content, expected, code)


def curl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["curl", "-sS", "--max-time", str(int(timeout)), *args],
        capture_output=True, timeout=timeout + 10, check=False,
    )


# -- helpers: small asyncio upstreams in a background thread ---------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class ThreadedServer:
    """An asyncio TCP server on 127.0.0.1:<free port> running in its own thread.

    `handler(reader, writer, conn_id)` runs per accepted connection (ids count from 1);
    `accepted` and `finished` count connections opened and handlers ended."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.accepted = 0
        self.finished = 0
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> ThreadedServer:
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"test upstream did not start: {self._error!r}")
        return self

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
        except BaseException as exc:  # pragma: no cover - reported by start()
            self._error = exc
            self._ready.set()
            return
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        loop.run_forever()
        server.close()
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            await self.handler(reader, writer, self.accepted)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.finished += 1
            writer.close()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)


@pytest.fixture
def serve() -> Iterator[Callable[[Handler], ThreadedServer]]:
    servers: list[ThreadedServer] = []

    def _serve(handler: Handler) -> ThreadedServer:
        server = ThreadedServer(handler)
        servers.append(server)
        return server.start()

    yield _serve
    for server in servers:
        server.stop()


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head[:-4].decode("latin-1").split("\r\n")
    method, target, _version = lines[0].split(" ")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return method, target, headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass
                return b"".join(parts)
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
    return await reader.readexactly(int(headers.get("content-length", "0")))


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0: the peer gets a TCP RST."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


SLOW_READ_SECONDS = 3.0


async def scripted_upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            conn_id: int) -> None:
    """A keep-alive HTTP/1.1 upstream whose behaviour depends on the request path.

    /ok (default)      200, body "conn=<id> req=<n on this connection> <method> <target>"
    /late              as /ok, 3 s late
    /garbage           a line that is not HTTP; the connection stays open
    /extra             Content-Length: 2 but more bytes follow; the connection stays open
    /reset-head        half a response head, then a TCP RST
    /truncate          Content-Length: 1000, 500 bytes, then close
    /truncate-chunked  chunked, one 500-byte chunk, then close (no last chunk)
    /hop               hop-by-hop response headers plus end-to-end ones
    /slow-read         reads the request body 16 KiB per 20 ms for SLOW_READ_SECONDS, then
                       fast; replies {"bytes", "sha256"}
    /early             answers 413 right after the head, then reads and drops the body
    /hints             103 Early Hints, then 200
    /hints-length      103 Early Hints with a Content-Length, then 200
    /hints-many/N      N 103 Early Hints in one write, then 200
    /hints-hop         103 Early Hints with hop-by-hop fields, then 200
    /continue-hints    100 Continue, 100 Continue, 103 Early Hints, then 200 (whether or
                       not the request had Expect: 100-continue)
    /big-head          200 whose head is larger than any max_header_bytes default
    /no-content        204 with a Content-Length (RFC 9110 8.6 says it must not have one)
    /bad-chunked       200 chunked, whose first chunk size is not hex, in the head's write
    /until-close       200 without Content-Length or chunked: the body ends at the close
    /drop-next         200; the next request on this connection is read, then the
                       connection is closed without an answer (a keep-alive race)
    """
    served = 0
    drop_next = False
    while True:
        req = await read_request(reader)
        if req is None or drop_next:
            return
        method, target, headers = req
        served += 1
        path = target.split("?", 1)[0]
        if path == "/early":
            writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 8\r\n"
                         b"Connection: close\r\n\r\ntoo big!")
            await writer.drain()
            while await reader.read(MiB):
                pass
            return
        if path == "/slow-read":
            total = int(headers["content-length"])
            digest = hashlib.sha256()
            got = 0
            slow_until = asyncio.get_running_loop().time() + SLOW_READ_SECONDS
            while got < total:
                slow = asyncio.get_running_loop().time() < slow_until
                data = await reader.read(min(16 * KiB if slow else MiB, total - got))
                if not data:
                    return
                digest.update(data)
                got += len(data)
                if slow:
                    await asyncio.sleep(0.02)
            body = json.dumps({"bytes": got, "sha256": digest.hexdigest()}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            continue
        body = await read_body(reader, headers)
        if path == "/late":
            await asyncio.sleep(3)
        if path == "/garbage":
            writer.write(b"THIS IS NOT HTTP\r\n\r\n")
            await writer.drain()
        elif path == "/extra":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokUNEXPECTED-BYTES")
            await writer.drain()
        elif path == "/reset-head":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Le")
            await writer.drain()
            await asyncio.sleep(0.2)
            reset(writer)
            return
        elif path == "/truncate":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 500)
            await writer.drain()
            await asyncio.sleep(0.1)
            return
        elif path == "/truncate-chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1f4\r\n"
                         + b"y" * 500 + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)
            return
        elif path == "/until-close":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
            for i in range(5):
                writer.write(b"piece %d;" % i)
                await writer.drain()
                await asyncio.sleep(0.01)
            return
        elif path == "/hints":
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal")
            await writer.drain()
        elif path == "/hints-length":
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\nContent-Length: 5\r\n\r\n"
                         b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal")
            await writer.drain()
        elif path.startswith("/hints-many/"):
            hint = b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"
            writer.write(hint * int(path[12:]) + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal")
            await writer.drain()
        elif path == "/hints-hop":
            writer.write(b"HTTP/1.1 103 Early Hints\r\nConnection: X-Secret\r\nX-Secret: s\r\n"
                         b"Keep-Alive: timeout=5\r\nLink: </a>; rel=preload\r\n\r\n"
                         b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal")
            await writer.drain()
        elif path == "/continue-hints":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n"
                         b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"
                         b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal")
            await writer.drain()
        elif path == "/big-head":
            writer.write(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * 200_000
                         + b"\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        elif path == "/no-content":
            writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n")
            await writer.drain()
        elif path == "/bad-chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"zz\r\nhello\r\n0\r\n\r\n")
            await writer.drain()
        elif path == "/drop-next":
            drop_next = True
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ndrop")
            await writer.drain()
        elif path == "/hop":
            writer.write(b"HTTP/1.1 200 OK\r\n"
                         b"Connection: keep-alive, X-Hop-Resp\r\n"
                         b"X-Hop-Resp: secret\r\n"
                         b"Keep-Alive: timeout=30\r\n"
                         b"X-End-To-End: kept\r\n"
                         b"Cache-Control: no-store\r\n"
                         b"Content-Length: 3\r\n\r\nhop")
            await writer.drain()
        else:
            text = f"conn={conn_id} req={served} {method} {target} body={len(body)}".encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(text), text))
            await writer.drain()


def conn_of(text: str) -> tuple[int, int]:
    """(conn id, request number on that connection) from a scripted /ok body."""
    fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
    return int(fields["conn"]), int(fields["req"])


# -- more fixtures ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_chat_upstream() -> Iterator[int]:
    """A demo upstream whose streamed chat completions wait 150 ms between events."""
    proc, port = start_demo_upstream("demo-slow", token_delay_ms=150)
    yield port
    stop_process(proc)


@pytest.fixture
def nginx_upstream(tmp_path: Path) -> Iterator[int]:
    """nginx on a free loopback port answering every request with its $connection."""
    with run_nginx(tmp_path, """
        location / {
            default_type text/plain;
            return 200 "conn=$connection req=$connection_requests uri=$request_uri\\n";
        }""", connections=64, http_extra="    keepalive_timeout 60s;") as port:
        yield port


@pytest.fixture
def full_backlog() -> Iterator[int]:
    """A port whose listen queue is full: the kernel drops new SYNs, so connect() hangs.

    This is the one loopback-only way to make a connect time out."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fillers.append(s)
    time.sleep(0.1)
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.settimeout(0.3)
    try:
        probe.connect(("127.0.0.1", port))
    except TimeoutError:
        pass
    else:
        pytest.skip("this kernel accepts connections beyond a full listen queue")
    finally:
        probe.close()
    yield port
    for s in fillers:
        s.close()
    listener.close()


# == methods, headers =======================================================================


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
def test_methods_path_query_and_forwarding_headers(
    start_proxy: StartProxy, demo_upstream: int, method: str
) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    body = b"" if method in ("GET", "DELETE", "OPTIONS") else f"{method} body".encode()
    target = "/echo/some/deep%2Fpath;p=1?a=1&b=two_words&c=&a=3"
    with httpx.Client(timeout=10) as client:
        r = client.request(
            method, proxy.url + target, content=body,
            headers={"X-Forwarded-For": "203.0.113.7", "X-Forwarded-Proto": "https",
                     "X-Custom": "end-to-end", "Authorization": "Bearer abc"},
        )
    assert r.status_code == 200, r.text
    assert r.headers["x-upstream"] == "demo-a"
    assert r.headers["via"] == "1.1 aiproxy"
    echo = r.json()
    assert echo["method"] == method
    assert echo["path"] == "/echo/some/deep/path;p=1"  # %2F decoded (escaped_slashes)
    assert echo["query"] == "a=1&b=two_words&c=&a=3"
    assert echo["body_bytes"] == len(body)
    assert echo["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert echo["http_version"] == "1.1"
    h = echo["headers"]
    assert h["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"
    assert h["x-forwarded-proto"] == "http"
    assert h["via"] == "1.1 aiproxy"
    assert h["x-custom"] == "end-to-end"
    assert h["authorization"] == "Bearer abc"
    assert h["host"] == f"127.0.0.1:{proxy.port}"


# What curl, httpx (so the openai client) and browsers send unencoded in a URL's path
# and query (the WHATWG query percent-encode set keeps these), though RFC 3986 has no
# place for them: refused, every such request would be a 400 the client cannot avoid.
CLIENT_RAW_TARGET = "/echo/a|b^c?q={a}|b^c`d\\e&r=[1]"


@pytest.mark.parametrize("client", ["curl", "curl-h2c", "httpx"])
def test_target_characters_real_clients_send_unencoded_pass(
    start_proxy: StartProxy, demo_upstream: int, client: str
) -> None:
    proxy = start_proxy(simple_config(demo_upstream), 'protocols = ["http1", "h2c"]')
    if client.startswith("curl"):
        mode = "--http2-prior-knowledge" if client == "curl-h2c" else "--http1.1"
        r = curl("-g", mode, proxy.url + CLIENT_RAW_TARGET, timeout=10)
        assert r.returncode == 0, r.stderr
        status, body = 200 if r.stdout.startswith(b"{") else 0, r.stdout
    else:
        with httpx.Client(timeout=10) as c:
            resp = c.get(proxy.url + CLIENT_RAW_TARGET)
        status, body = resp.status_code, resp.content
    assert status == 200, body
    echo = json.loads(body)
    assert echo["path"] == "/echo/a|b^c"
    assert echo["query"] == "q={a}|b^c`d\\e&r=[1]"


def test_x_forwarded_for_added_when_absent(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    out = curl(proxy.url + "/echo")
    assert out.returncode == 0, out.stderr
    h = json.loads(out.stdout)["headers"]
    assert h["x-forwarded-for"] == "127.0.0.1"
    assert h["x-forwarded-proto"] == "http"
    assert h["via"] == "1.1 aiproxy"
    assert h["user-agent"].startswith("curl/")


def test_repeated_x_forwarded_for_fields_are_merged(
    start_proxy: StartProxy, demo_upstream: int
) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    with RawConn(proxy.port) as c:
        c.send(get("/echo", extra="X-Forwarded-For: 10.0.0.1\r\n"
                                  "X-Forwarded-For: 10.0.0.2, 10.0.0.3\r\n"))
        r = c.read_response()
    assert r.status == 200
    assert r.json()["headers"]["x-forwarded-for"] == "10.0.0.1, 10.0.0.2, 10.0.0.3, 127.0.0.1"


def test_x_forwarded_for_named_by_connection_is_not_forwarded(
        start_proxy: StartProxy, demo_upstream: int) -> None:
    """RFC 9110 7.6.1: a field named in Connection is removed, X-Forwarded-For too; the
    proxy's own starts from the client's address."""
    proxy = start_proxy(simple_config(demo_upstream))
    with RawConn(proxy.port) as c:
        c.send(get("/echo", extra="Connection: X-Forwarded-For\r\n"
                                  "X-Forwarded-For: 6.6.6.6\r\n"))
        r = c.read_response()
    assert r.status == 200
    assert r.json()["headers"]["x-forwarded-for"] == "127.0.0.1"


def test_hop_by_hop_request_headers_not_forwarded(
    start_proxy: StartProxy, demo_upstream: int
) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    out = curl(
        proxy.url + "/echo/hop",
        "-H", "Connection: keep-alive, X-Hop-A, x-hop-b",
        "-H", "X-Hop-A: secret-a",
        "-H", "X-Hop-B: secret-b",
        "-H", "Keep-Alive: timeout=5, max=100",
        "-H", "TE: trailers",
        "-H", "Trailer: X-Checksum",
        "-H", "Upgrade: h2c",  # not named by Connection: a plain request
        "-H", "Proxy-Connection: keep-alive",
        "-H", "Proxy-Authorization: Basic Zm9vOmJhcg==",
        "-H", "X-End-To-End: kept",
        "-H", "Cache-Control: no-cache",
        "-H", "Authorization: Bearer token",
    )
    assert out.returncode == 0, out.stderr
    h = json.loads(out.stdout)["headers"]
    for name in ("connection", "x-hop-a", "x-hop-b", "keep-alive", "te", "trailer", "upgrade",
                 "proxy-connection", "proxy-authorization"):
        assert name not in h, (name, h)
    assert h["x-end-to-end"] == "kept"
    assert h["cache-control"] == "no-cache"
    assert h["authorization"] == "Bearer token"


def test_hop_by_hop_response_headers_not_forwarded(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with RawConn(proxy.port) as c:
        c.send(get("/hop"))
        r = c.read_response()
        assert r.status == 200 and r.body == b"hop"
        names = [k for k, _ in r.headers]
        assert "x-hop-resp" not in names and "keep-alive" not in names
        assert r.header("connection") in (None, "keep-alive")
        assert r.header("x-end-to-end") == "kept"
        assert r.header("cache-control") == "no-store"
        assert r.header("via") == "1.1 aiproxy"
        # The client connection is still usable afterwards. The target goes upstream as
        # sent but for path normalization (aiproxy/pipeline/paths.py): %7E is "~", an
        # encoded slash is a slash, parameters and the query are untouched.
        target = "/ok/a%2Fb/%7Euser;v=1?x=%20y&z=a+b&&q=%E2%9C%93"
        c.send(get(target))
        r = c.read_response()
        assert r.status == 200
        assert r.body.decode().split()[3] == "/ok/a/b/~user;v=1?x=%20y&z=a+b&&q=%E2%9C%93"


# == bodies ===================================================================================


def test_empty_and_1mib_bodies(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    block = random_block(MiB)
    with httpx.Client(timeout=30) as client:
        r = client.post(proxy.url + "/echo", content=b"")
        assert r.status_code == 200
        assert r.json()["body_bytes"] == 0 and r.json()["body_sha256"] == EMPTY_SHA
        assert r.json()["headers"].get("content-length") == "0"

        r = client.put(proxy.url + "/echo", content=block)
        echo = r.json()
        assert echo["body_bytes"] == MiB
        assert echo["body_sha256"] == hashlib.sha256(block).hexdigest()
        assert echo["headers"]["content-length"] == str(MiB)
        assert "transfer-encoding" not in echo["headers"]

        # Chunked upload (a generator body): the upstream gets chunked too.
        r = client.post(proxy.url + "/echo", content=upload_blocks(MiB, block[: 100 * KiB - 3]))
        echo = r.json()
        assert echo["headers"]["transfer-encoding"] == "chunked"
        assert echo["body_bytes"] == MiB
        assert echo["body_sha256"] == upload_sha256(MiB, block[: 100 * KiB - 3])

        # An empty chunked body.
        r = client.post(proxy.url + "/echo", content=iter([]))
        assert r.json()["body_bytes"] == 0

        r = client.get(proxy.url + "/bytes/0")
        assert r.status_code == 200 and r.content == b""
        r = client.get(proxy.url + "/bytes/1048576")
        assert r.headers["transfer-encoding"] == "chunked"
        assert r.content == pattern(MiB)


def test_curl_uploads_1mib_chunked_and_with_length(
    start_proxy: StartProxy, demo_upstream: int, tmp_path: Path
) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    data = random_block(MiB, seed=3)
    path = tmp_path / "body.bin"
    path.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    for extra in ([], ["-H", "Transfer-Encoding: chunked"]):
        out = curl(proxy.url + "/echo", "--data-binary", f"@{path}", "-H", "Expect:", *extra)
        assert out.returncode == 0, out.stderr
        echo = json.loads(out.stdout)
        assert echo["body_bytes"] == MiB and echo["body_sha256"] == want
        if extra:
            assert echo["headers"]["transfer-encoding"] == "chunked"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("framing", ["chunked", "content-length"])
def test_100mib_upload_streams(
    start_proxy: StartProxy, demo_upstream: int, framing: str
) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    warm_up(proxy)
    total = 100 * MiB
    block = random_block(MiB, seed=11)
    headers = {"Content-Length": str(total)} if framing == "content-length" else {}
    with RssMonitor(proxy.proc.pid) as rss, httpx.Client(timeout=60) as client:
        r = client.post(proxy.url + "/echo", content=upload_blocks(total, block), headers=headers)
    assert r.status_code == 200, r.text
    echo = r.json()
    assert echo["body_bytes"] == total
    assert echo["body_sha256"] == upload_sha256(total, block)
    if framing == "chunked":
        assert echo["headers"]["transfer-encoding"] == "chunked"
    else:
        assert echo["headers"]["content-length"] == str(total)
        assert "transfer-encoding" not in echo["headers"]
    assert rss.growth < RSS_LIMIT_STREAM, rss.describe()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("query", ["", "?length=1"])
def test_100mib_download_streams(start_proxy: StartProxy, demo_upstream: int, query: str) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    warm_up(proxy)
    total = 100 * MiB
    digest = hashlib.sha256()
    size = 0
    with RssMonitor(proxy.proc.pid) as rss, httpx.Client(timeout=60) as client:
        with client.stream("GET", f"{proxy.url}/bytes/{total}{query}") as r:
            assert r.status_code == 200
            if query:
                assert r.headers["content-length"] == str(total)
                assert "transfer-encoding" not in r.headers
            else:
                assert r.headers["transfer-encoding"] == "chunked"
                assert "content-length" not in r.headers
            for piece in r.iter_raw():
                digest.update(piece)
                size += len(piece)
    assert size == total
    assert digest.hexdigest() == bytes_sha256(total)
    assert rss.growth < RSS_LIMIT_STREAM, rss.describe()


# == HEAD, 204/304, HTTP/1.0 ==================================================================


def test_head_keeps_content_length_without_body(
    start_proxy: StartProxy, demo_upstream: int
) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    with RawConn(proxy.port) as c:
        c.send(b"HEAD /bytes/12345?length=1 HTTP/1.1\r\nHost: t\r\n\r\n")
        r = c.read_response("HEAD")
        assert r.status == 200
        assert r.header("content-length") == "12345"
        assert c.silent_for(0.3), "HEAD response carried body bytes"
        c.send(b"HEAD /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        r = c.read_response("HEAD")
        assert r.status == 200 and int(r.header("content-length")) > 0
        assert c.silent_for(0.3), "HEAD response carried body bytes"
        # The same connection then serves a normal request.
        c.send(get("/echo/after-head"))
        r = c.read_response()
        assert r.status == 200 and r.json()["path"] == "/echo/after-head"
    out = curl("-I", proxy.url + "/bytes/777?length=1")
    assert out.returncode == 0, out.stderr
    assert b"content-length: 777" in out.stdout.lower()


@pytest.mark.parametrize("status", [204, 304])
def test_no_body_statuses(start_proxy: StartProxy, demo_upstream: int, status: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    with RawConn(proxy.port) as c:
        for _ in range(2):
            c.send(get(f"/status/{status}"))
            r = c.read_response()
            assert r.status == status
            assert r.header("transfer-encoding") is None
            assert r.header("content-length") in (None, "0")
            assert c.silent_for(0.3), f"{status} response carried body bytes"
        c.send(get("/echo/next"))
        r = c.read_response()
        assert r.status == 200 and r.json()["path"] == "/echo/next"
    with httpx.Client(timeout=10) as client:
        r = client.get(f"{proxy.url}/status/{status}")
        assert r.status_code == status and r.content == b""


@pytest.mark.parametrize("query", ["", "?length=1"])
def test_http10_client_close_delimited_or_length(
    start_proxy: StartProxy, demo_upstream: int, query: str
) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    with RawConn(proxy.port) as c:
        c.send(get(f"/bytes/100000{query}", version="1.0"))
        r = c.read_head()
        assert r.status == 200
        assert r.header("transfer-encoding") is None, "chunked sent to an HTTP/1.0 client"
        assert r.header("connection") == "close"
        body = c.read_to_eof()  # the proxy must close after the response
        if query:
            assert r.header("content-length") == "100000"
        assert body == pattern(100000)


def test_http10_keep_alive(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    with RawConn(proxy.port) as c:
        for i in range(3):
            c.send(get(f"/echo/ten{i}", version="1.0", extra="Connection: keep-alive\r\n"))
            r = c.read_response()
            assert r.status == 200
            assert r.header("connection").lower() == "keep-alive"
            assert r.json()["path"] == f"/echo/ten{i}"
        c.send(get("/echo/last", version="1.0"))
        r = c.read_head()
        assert r.header("connection") == "close"
        rest = c.read_to_eof()
        assert json.loads(rest)["path"] == "/echo/last"


# == streaming (SSE) ==========================================================================


@pytest.mark.timeout(30)
def test_sse_streams_event_by_event(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    arrivals: list[tuple[float, str]] = []
    with httpx.Client(timeout=10) as client:
        client.get(proxy.url + "/healthz")  # warm connection paths
        start = time.monotonic()
        with client.stream("GET", proxy.url + "/sse?n=5&delay_ms=300") as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["transfer-encoding"] == "chunked"
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.monotonic() - start, line[6:]))
    assert [data for _, data in arrivals] == [f"event {i}" for i in range(5)]
    times = [t for t, _ in arrivals]
    # The upstream sends event 0 at once and the others 300 ms apart (1.2 s in all).
    assert times[0] < 0.8, times
    assert times[-1] > 1.1, times
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert min(gaps) > 0.15, f"events arrived in batches: {times}"


@pytest.mark.timeout(30)
def test_chat_completion_stream_event_by_event(
    start_proxy: StartProxy, slow_chat_upstream: int
) -> None:
    proxy = start_proxy(simple_config(slow_chat_upstream))
    request = {
        "model": "demo-model",
        "stream": True,
        "messages": [{"role": "user", "content": "hello there big world"}],
    }
    arrivals: list[tuple[float, str]] = []
    with httpx.Client(timeout=10) as client:
        start = time.monotonic()
        with client.stream("POST", proxy.url + "/v1/chat/completions", json=request) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.monotonic() - start, line[6:]))
    assert arrivals[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in arrivals[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "You said: hello there big world"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # 6 words + the stop chunk: 6 gaps of 150 ms upstream.
    times = [t for t, _ in arrivals]
    assert times[-1] - times[0] > 0.6, times
    assert times[0] < times[-1] - 0.6, f"first chunk held back until the end: {times}"
    assert len({round(t, 2) for t in times[:-1]}) >= 5, f"chunks arrived in batches: {times}"


# == keep-alive, pipelining ===================================================================


def test_keepalive_reuses_upstream_and_client_connections(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    # upstream pools are per worker process: one process, so both client connections
    # below share one pool
    proxy = start_proxy("[server]\nworkers = 1\n" + simple_config(up.port))
    # Raw socket: 50 sequential requests on one client connection.
    with RawConn(proxy.port) as c:
        for i in range(50):
            c.send(get(f"/ok/{i}"))
            r = c.read_response()
            assert r.status == 200
            conn, n = conn_of(r.body.decode())
            assert (conn, n) == (1, i + 1), r.body
    assert up.accepted == 1
    # httpx with a single-connection pool: the same client socket every time.
    with httpx.Client(timeout=10, limits=httpx.Limits(max_connections=1)) as client:
        ports = set()
        for i in range(50):
            r = client.get(f"{proxy.url}/ok/x{i}")
            assert r.status_code == 200
            assert conn_of(r.text)[0] == 1
            ports.add(r.extensions["network_stream"].get_extra_info("client_addr")[1])
    assert len(ports) == 1
    assert up.accepted == 1, "upstream connection not reused"


def test_keepalive_with_nginx_upstream(start_proxy: StartProxy, nginx_upstream: int) -> None:
    proxy = start_proxy(simple_config(nginx_upstream))
    seen = []
    with httpx.Client(timeout=10) as client:
        for i in range(30):
            r = client.get(f"{proxy.url}/n/{i}?q={i}")
            assert r.status_code == 200
            fields = dict(p.split("=", 1) for p in r.text.split())
            assert fields["uri"] == f"/n/{i}?q={i}"
            seen.append((fields["conn"], int(fields["req"])))
    assert len({conn for conn, _ in seen}) == 1, seen
    assert [n for _, n in seen] == list(range(1, 31))


def test_upstream_pool_limits_and_idle_expiry(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port, cluster_extra="idle_timeout_ms = 300"))
    with httpx.Client(timeout=10) as client:
        assert conn_of(client.get(proxy.url + "/ok").text) == (1, 1)
        assert conn_of(client.get(proxy.url + "/ok").text) == (1, 2)
        deadline = time.monotonic() + 3
        while up.finished < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert up.finished == 1, "idle upstream connection was not closed"
        assert conn_of(client.get(proxy.url + "/ok").text) == (2, 1)

    up2 = serve(scripted_upstream)
    proxy2 = start_proxy(simple_config(up2.port, cluster_extra="max_idle_connections = 0"))
    with httpx.Client(timeout=10) as client:
        for i in range(5):
            assert conn_of(client.get(proxy2.url + "/ok").text) == (i + 1, 1)
    assert up2.accepted == 5


def test_pipelined_requests_answered_in_order(
    start_proxy: StartProxy, demo_upstream: int
) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    big = random_block(300 * KiB, seed=5)
    reqs = [
        get("/echo/p1?i=1"),
        b"POST /echo/p2 HTTP/1.1\r\nHost: t\r\nContent-Length: 11\r\n\r\nhello world",
        get("/echo/p3"),
        b"POST /echo/p4 HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        b"HEAD /bytes/100?length=1 HTTP/1.1\r\nHost: t\r\n\r\n",
        b"PUT /echo/p6 HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big),
        get("/bytes/70000"),
        get("/echo/p8", extra="Connection: close\r\n"),
    ]
    with RawConn(proxy.port) as c:
        c.send(b"".join(reqs))
        r1 = c.read_response()
        assert r1.json()["path"] == "/echo/p1" and r1.json()["query"] == "i=1"
        r2 = c.read_response().json()
        assert (r2["method"], r2["path"], r2["body_bytes"]) == ("POST", "/echo/p2", 11)
        assert r2["body_sha256"] == hashlib.sha256(b"hello world").hexdigest()
        assert c.read_response().json()["path"] == "/echo/p3"
        r4 = c.read_response().json()
        assert r4["path"] == "/echo/p4"
        assert r4["body_sha256"] == hashlib.sha256(b"hello world").hexdigest()
        r5 = c.read_response("HEAD")
        assert r5.status == 200 and r5.header("content-length") == "100"
        r6 = c.read_response().json()
        assert r6["path"] == "/echo/p6" and r6["body_bytes"] == len(big)
        assert r6["body_sha256"] == hashlib.sha256(big).hexdigest()
        r7 = c.read_response()
        assert r7.body == pattern(70000)
        r8 = c.read_response()
        assert r8.json()["path"] == "/echo/p8"
        assert r8.header("connection") == "close"
        assert c.closed_within(3)


def test_many_pipelined_requests(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    n = 200
    with RawConn(proxy.port) as c:
        c.send(b"".join(get(f"/echo/q{i}?n={i}") for i in range(n)))
        for i in range(n):
            r = c.read_response()
            assert r.status == 200
            assert (r.json()["path"], r.json()["query"]) == (f"/echo/q{i}", f"n={i}")


# == Expect: 100-continue =====================================================================


def test_expect_100_continue_curl(
    start_proxy: StartProxy, demo_upstream: int, tmp_path: Path
) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    data = random_block(3 * MiB, seed=9)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    # --expect100-timeout: curl would send the body anyway after 1 s; make that 30 s so a
    # proxy that never says 100 Continue shows up as a slow run (and the timing check below).
    start = time.monotonic()
    out = curl("-v", "--expect100-timeout", "30", "-H", "Expect: 100-continue",
               "--data-binary", f"@{path}", proxy.url + "/echo")
    elapsed = time.monotonic() - start
    assert out.returncode == 0, out.stderr
    assert b"HTTP/1.1 100 Continue" in out.stderr
    echo = json.loads(out.stdout)
    assert echo["body_bytes"] == len(data)
    assert echo["body_sha256"] == hashlib.sha256(data).hexdigest()
    assert "expect" not in echo["headers"]
    assert elapsed < 10


def test_expect_100_continue_raw(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    with RawConn(proxy.port) as c:
        c.send(b"POST /echo/expect HTTP/1.1\r\nHost: t\r\nContent-Length: 11\r\n"
               b"Expect: 100-continue\r\n\r\n")
        interim = c.read_response()
        assert (interim.version, interim.status) == ("HTTP/1.1", 100)
        c.send(b"hello world")
        r = c.read_response()
        assert r.status == 200
        echo = r.json()
        assert echo["body_bytes"] == 11 and echo["path"] == "/echo/expect"
        # Keep-alive still works, and a request without a body gets no 100.
        c.send(b"GET /echo/plain HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n\r\n")
        r = c.read_response()
        assert r.status == 200 and r.json()["path"] == "/echo/plain"


# == WebSocket ================================================================================


@pytest.mark.timeout(30)
def test_websocket_echo(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    big = random_block(MiB, seed=13)
    fds_before = open_fds(proxy.proc.pid)
    with ws_connect(f"ws://127.0.0.1:{proxy.port}/ws", max_size=4 * MiB,
                    open_timeout=10, close_timeout=5) as ws:
        assert ws.response.headers["x-upstream"] == "demo-a"
        for i in range(5):
            ws.send(f"text message {i} ✓")
            assert ws.recv(timeout=10) == f"text message {i} ✓"
        ws.send(b"\x00\x01\x02binary\xff")
        assert ws.recv(timeout=10) == b"\x00\x01\x02binary\xff"
        ws.send(big)
        assert ws.recv(timeout=10) == big
        ws.send("after the big one")
        assert ws.recv(timeout=10) == "after the big one"
        ws.close()
        assert ws.close_code == 1000
        with pytest.raises(ConnectionClosedOK):
            ws.recv(timeout=5)
    # Both directions closed: the proxy must release both sockets (client and upstream)...
    assert wait_for(lambda: open_fds(proxy.proc.pid) <= fds_before, 3), (
        f"proxy holds {open_fds(proxy.proc.pid) - fds_before} more descriptors after the "
        "WebSocket closed")
    # ...so a graceful stop has nothing to wait for (the drain timeout is 10 s).
    start = time.monotonic()
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(timeout=15) == 0
    assert time.monotonic() - start < 3, "SIGTERM waited for a WebSocket that had closed"


def test_concurrent_requests_do_not_cross(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    n = 100

    async def run() -> list[tuple[int, httpx.Response]]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(timeout=20, limits=limits) as client:
            async def one(i: int) -> tuple[int, httpx.Response]:
                body = f"request {i} ".encode() * (i * 37 + 1)
                return i, await client.post(f"{proxy.url}/echo/c{i}?i={i}", content=body)

            return await asyncio.gather(*(one(i) for i in range(n)))

    for i, r in asyncio.run(run()):
        assert r.status_code == 200
        echo = r.json()
        body = f"request {i} ".encode() * (i * 37 + 1)
        assert (echo["path"], echo["query"]) == (f"/echo/c{i}", f"i={i}")
        assert echo["body_sha256"] == hashlib.sha256(body).hexdigest()


def test_upload_to_a_path_no_filter_reads_is_not_held(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    """[llm] reads the bodies of LLM API calls only: an upload elsewhere goes upstream as
    it arrives (this upstream answers right after the head, before the body's end)."""
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port) + "\n[llm]\n")
    with RawConn(proxy.port, timeout=3) as c:
        c.send(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        assert c.read_response().status == 413


def test_upload_to_a_route_no_intent_can_change_is_not_held(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    """With intent routes in the table, a streamed upload to a path only a route without
    an intent can take is not held for classification (this upstream answers right after
    the head); a small JSON body to an intent route still is classified."""
    up = serve(scripted_upstream)
    proxy = start_proxy(f"""
[semantic]

[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{up.port}"]

[[routes]]
name = "bank"
match = {{ path_prefix = "/v1/", intent_domain = "banking" }}
cluster = "up"

[[routes]]
name = "rest"
cluster = "up"
""")
    with RawConn(proxy.port, timeout=3) as c:
        c.send(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        assert c.read_response().status == 413
    body = b'{"messages": [{"role": "user", "content": "transfer 100 dollars to savings"}]}'
    with RawConn(proxy.port) as c:
        c.send(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert c.read_response().status == 200
    assert wait_for(lambda: '"route":"bank"' in proxy.log(), 5), proxy.log()[-1500:]


def test_early_hints_forwarded_to_http11_only(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with RawConn(proxy.port) as c:
        c.send(get("/hints"))
        hints = c.read_response()
        assert hints.status == 103
        assert hints.header("link") == "</style.css>; rel=preload"
        assert hints.header("via") == "1.1 aiproxy"  # RFC 9110 7.6.3: every message
        final = c.read_response()
        assert final.status == 200 and final.body == b"final"
    with RawConn(proxy.port) as c:
        c.send(get("/hints", version="1.0"))
        r = c.read_response()
        assert r.status == 200 and r.body == b"final"


def test_early_hints_to_an_http2_client_carry_via(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port), 'protocols = ["h2c"]')
    with FrameClient(proxy.port) as c:
        c.handshake()
        c.send(c.request(1, "/hints"))
        frames = c.frames_until(lambda f: "END_STREAM" in f.flags and f.stream_id == 1)
    heads = [dict(f.decoded) for f in frames if isinstance(f, HeadersFrame)]
    assert [h[b":status"] for h in heads] == [b"103", b"200"], heads
    assert heads[0][b"link"] == b"</style.css>; rel=preload"
    assert heads[0][b"via"] == heads[1][b"via"] == b"1.1 aiproxy"
    with FrameClient(proxy.port) as c:  # an unsolicited 100, once, as to HTTP/1.1
        c.handshake()
        c.send(c.request(1, "/continue-hints"))
        frames = c.frames_until(lambda f: "END_STREAM" in f.flags and f.stream_id == 1)
    hframes = [f for f in frames if isinstance(f, HeadersFrame)]
    heads = [dict(f.decoded) for f in hframes]
    assert [h[b":status"] for h in heads] == [b"100", b"103", b"200"], heads
    assert not any("END_STREAM" in f.flags for f in hframes[:2])


@pytest.mark.parametrize("mode", ["--http1.1", "--http2-prior-knowledge"])
def test_early_hints_reach_curl(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer], mode: str
) -> None:
    """curl, over HTTP/1.1 and h2c, sees the 103 with its Link field before the 200, and
    none of the 103's hop-by-hop fields (RFC 9110 7.6.1)."""
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port), 'protocols = ["http1", "h2c"]')
    for path in ("/hints", "/hints-hop"):
        r = curl("-v", mode, proxy.url + path, timeout=10)
        assert r.returncode == 0 and r.stdout == b"final", r.stderr.decode()[-2000:]
        heads = [line[2:].strip() for line in r.stderr.decode().splitlines()
                 if line.startswith("< ")]
        statuses = [h.split()[1] for h in heads if h.startswith("HTTP/")]
        assert statuses == ["103", "200"], heads
        final_at = max(i for i, h in enumerate(heads) if h.startswith("HTTP/"))
        hints = [h.lower() for h in heads[1:final_at]]
        assert any(h.startswith("link: </") for h in hints), hints
        assert not any(h.split(":")[0] in ("connection", "x-secret", "keep-alive")
                       for h in hints), hints


def test_unsolicited_100_is_forwarded_once(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    """RFC 9110 15.2: a proxy MUST forward 1xx responses it did not ask for. The upstream
    here sends two 100s and a 103: a client that sent no Expect gets one 100 (a second
    says nothing more) and the 103. A client that sent Expect: 100-continue got the
    proxy's own 100 (Expect is not forwarded) and gets no other; an HTTP/1.0 client
    gets no 1xx at all (RFC 9110 15.2)."""
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with RawConn(proxy.port) as c:
        for _ in range(2):  # and the connection is kept
            c.send(get("/continue-hints"))
            assert c.read_response().status == 100
            hints = c.read_response()
            assert hints.status == 103 and hints.header("link") == "</a>; rel=preload"
            final = c.read_response()
            assert final.status == 200 and final.body == b"final"
    with RawConn(proxy.port) as c:
        c.send(b"POST /continue-hints HTTP/1.1\r\nHost: test\r\nContent-Length: 5\r\n"
               b"Expect: 100-continue\r\n\r\n")
        assert c.read_response().status == 100
        c.send(b"hello")
        assert c.read_response().status == 103
        final = c.read_response()
        assert final.status == 200 and final.body == b"final"
    with RawConn(proxy.port) as c:
        c.send(get("/continue-hints", version="1.0"))
        final = c.read_response()
        assert final.status == 200 and final.body == b"final"


def test_flood_of_informational_responses_is_502(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    """16 Early Hints before a response are passed on; a 17th (a flood the client would
    otherwise be sent until the request timed out) ends the response in a 502."""
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))

    def responses(path: str) -> tuple[int, RawResponse]:
        with RawConn(proxy.port) as c:
            c.send(get(path))
            hints = 0
            while (r := c.read_response()).status == 103:
                hints += 1
            return hints, r

    hints, final = responses("/hints-many/16")
    assert hints == 16 and final.status == 200 and final.body == b"final"
    for n in (17, 5000):
        hints, final = responses(f"/hints-many/{n}")
        assert hints == 16 and final.status == 502, (n, hints, final.status)
    assert json.loads(final.body)["error"]["message"] == \
        "upstream sent too many informational (1xx) responses"



@pytest.mark.parametrize("protocol", ["http1", "h2"])
def test_processing_heartbeat_of_a_long_call_is_not_cut(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer], protocol: str
) -> None:
    """A 102 Processing heartbeat through a long call (here 20, a quarter of a second
    apart) reaches the client and so does the response: the 1xx budget (16 at once)
    refills by one a second. Each 102 is sent once the client has read the one before,
    so however slow the proxy, it sees them at least that far apart."""
    heartbeats = 20
    read = threading.Semaphore(0)  # the client has read a 102

    async def h1_upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          _: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for _ in range(heartbeats):
            writer.write(b"HTTP/1.1 102 Processing\r\n\r\n")
            assert await asyncio.to_thread(read.acquire, timeout=10)
            await asyncio.sleep(0.25)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal")
        await writer.drain()

    def h2_upstream(conn: H2RawConn) -> None:
        conn.handshake()
        sid, _, _ = conn.request()
        for _ in range(heartbeats):
            conn.send(conn.headers(sid, [(b":status", b"102")]))
            assert read.acquire(timeout=10)
            time.sleep(0.25)
        conn.send(conn.headers(sid, [(b":status", b"200"), (b"content-length", b"5")]),
                  conn.data(sid, b"final", True))

    h2_up = None
    if protocol == "h2":
        h2_up = RawUpstream(h2_upstream)
        port = h2_up.port
    else:
        port = serve(h1_upstream).port
    try:
        proxy = start_proxy(simple_config(port, cluster_extra=f'protocol = "{protocol}"'))
        with RawConn(proxy.port) as c:
            c.send(get("/long"))
            for i in range(heartbeats):
                r = c.read_response()
                assert r.status == 102, (i, r.status, r.body)
                read.release()
            final = c.read_response()
            assert final.status == 200 and final.body == b"final"
    finally:
        for _ in range(heartbeats):  # an upstream still waiting for the client ends now
            read.release()
        if h2_up is not None:
            h2_up.stop()
    assert h2_up is None or not h2_up.errors, h2_up.errors

def test_upstream_head_too_large_is_502_that_says_so(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with httpx.Client(timeout=10) as client:
        r = client.get(proxy.url + "/big-head")
        httpx_error(r, 502, "upstream_bad_response")
        assert r.json()["error"]["message"] == "response header section too large"


def test_no_content_length_on_204_or_1xx(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    """RFC 9110 8.6: a 1xx or 204 response carries no Content-Length; one passed on would
    tell a client that trusts it to read into the next response."""
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with RawConn(proxy.port) as c:
        c.send(get("/no-content") + get("/ok"))
        r = c.read_response()
        assert r.status == 204 and r.header("content-length") is None and r.body == b""
        assert c.read_response().status == 200
        c.send(get("/hints-length"))
        hints = c.read_response()
        assert hints.status == 103 and hints.header("content-length") is None
        final = c.read_response()
        assert final.status == 200 and final.body == b"final"


def test_502_for_a_bad_chunked_body_before_anything_was_sent(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    """The response head is held for the first body bytes; when those are malformed, no
    byte of the response has gone out, so the client gets a 502 (and keeps its
    connection) rather than a silent close."""
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with httpx.Client(timeout=10) as client:
        httpx_error(client.get(proxy.url + "/bad-chunked"), 502, "upstream_bad_response")
        assert conn_of(client.get(proxy.url + "/ok").text)[1] == 1  # a fresh upstream


def test_close_delimited_upstream_body_becomes_chunked(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    want = b"".join(b"piece %d;" % i for i in range(5))
    with RawConn(proxy.port) as c:
        for _ in range(2):  # the client connection survives the upstream's close
            c.send(get("/until-close"))
            r = c.read_response()
            assert r.status == 200 and r.body == want
            assert r.header("transfer-encoding") == "chunked"
    with RawConn(proxy.port) as c:
        c.send(get("/until-close", version="1.0"))
        r = c.read_head()
        assert r.header("transfer-encoding") is None and r.header("connection") == "close"
        assert c.read_to_eof() == want


def test_curl_as_forward_proxy_client_absolute_form(
    start_proxy: StartProxy, demo_upstream: int
) -> None:
    # curl -x sends an absolute-form target and Proxy-Connection; the authority becomes
    # Host (port 1 is never contacted: the route sends everything to the cluster).
    proxy = start_proxy(simple_config(demo_upstream))
    out = curl("-x", proxy.url, "http://127.0.0.1:1/echo/abs?x=1")
    assert out.returncode == 0, out.stderr
    echo = json.loads(out.stdout)
    assert (echo["path"], echo["query"]) == ("/echo/abs", "x=1")
    assert echo["headers"]["host"] == "127.0.0.1:1"
    assert "proxy-connection" not in echo["headers"]


def test_half_closed_client_gets_response_with_ignore_client_abort(
        start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream, http="ignore_client_abort = true"))
    with RawConn(proxy.port) as c:
        c.send(get("/echo/half-closed"))
        c.sock.shutdown(socket.SHUT_WR)
        r = c.read_response()
        assert r.status == 200 and r.json()["path"] == "/echo/half-closed"
        assert c.closed_within(5)


def test_half_closed_client_gets_every_pipelined_response_with_ignore_client_abort(
        start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream, http="ignore_client_abort = true"))
    with RawConn(proxy.port) as c:
        c.send(get("/echo/1") + get("/echo/2") + get("/echo/3") + b"GET /echo/4 HTTP/1.1\r\n")
        c.sock.shutdown(socket.SHUT_WR)
        paths = [c.read_response().json()["path"] for _ in range(3)]
        assert paths == ["/echo/1", "/echo/2", "/echo/3"]
        assert c.closed_within(5)  # the unfinished fourth head is dropped with the close


def test_idle_websocket_tunnel_is_closed(start_proxy: StartProxy, demo_upstream: int) -> None:
    """[http] tunnel_idle_timeout_ms: a tunnel with bytes going either way stays; one
    idle that long is closed (found by the gRPC/WebSocket audit: it never was)."""
    proxy = start_proxy(simple_config(demo_upstream, http="tunnel_idle_timeout_ms = 1000"))
    key = base64.b64encode(os.urandom(16))

    def frame(text: bytes) -> bytes:
        mask = os.urandom(4)
        return (bytes([0x81, 0x80 | len(text)]) + mask
                + bytes(b ^ mask[i % 4] for i, b in enumerate(text)))

    with RawConn(proxy.port) as c:
        c.send(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n\r\n")
        assert c.read_head().status == 101
        for i in range(5):  # 2 s of traffic: longer than the idle timeout
            time.sleep(0.5 if i else 0)
            c.send(frame(b"hi"))
            assert c.read_exact(4) == b"\x81\x02hi"
        start = time.monotonic()
        assert c.closed_within(5)
        assert 0.8 < time.monotonic() - start < 3


def test_websocket_client_fin_before_the_101_is_passed_on(
        start_proxy: StartProxy, demo_upstream: int) -> None:
    """A WebSocket client that sends its request, a frame and its FIN in one go gets the
    101 and the echo, and then the end of the tunnel (the FIN went on to the upstream)."""
    proxy = start_proxy(simple_config(demo_upstream))
    key = base64.b64encode(os.urandom(16))
    mask = os.urandom(4)
    frame = bytes([0x81, 0x85]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(b"hello"))
    with RawConn(proxy.port) as c:
        c.send(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n\r\n" + frame)
        c.sock.shutdown(socket.SHUT_WR)
        assert c.read_head().status == 101
        assert c.read_exact(7) == b"\x81\x05hello"
        assert c.closed_within(5)


def test_client_that_closes_while_waiting_cancels_the_upstream(
        start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]) -> None:
    """By default a client's FIN while its response is pending is an abort (nginx's
    proxy_ignore_client_abort off): the upstream connection is closed at once, not when
    the response comes (an LLM would otherwise generate it for no one), and the access
    log says 499."""
    closed = threading.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   conn_id: int) -> None:
        if await read_request(reader) is None:
            return
        if not await reader.read(1):  # nothing comes: this is the proxy letting go
            closed.set()
        writer.close()

    up = serve(slow)
    proxy = start_proxy(simple_config(up.port))
    with RawConn(proxy.port) as c:
        c.send(get("/slow"))
        time.sleep(0.2)
        c.sock.shutdown(socket.SHUT_WR)
        assert c.closed_within(5)
    assert closed.wait(5), "the upstream request was not cancelled"
    assert wait_for(lambda: '"path":"/slow"' in proxy.log() and '"status":499' in proxy.log(),
                    5), proxy.log()[-1500:]


def test_client_abort_mid_download_releases_upstream(
    start_proxy: StartProxy, demo_upstream: int
) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    warm_up(proxy)
    fds = open_fds(proxy.proc.pid)
    with RawConn(proxy.port) as c:
        c.send(get(f"/bytes/{100 * MiB}"))
        assert c.read_head().status == 200
        c.read_exact(MiB)
    assert wait_for(lambda: open_fds(proxy.proc.pid) <= fds, 3), "descriptor leak"
    with httpx.Client(timeout=10) as client:
        assert client.get(proxy.url + "/bytes/1000").content == pattern(1000)


def test_upstream_early_response_reaches_uploading_client(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with RawConn(proxy.port) as c:
        c.send(b"POST /early HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (8 * MiB))
        c.send(b"z" * (256 * KiB))
        r = c.read_response()
        assert r.status == 413 and r.body == b"too big!"
        assert r.header("connection") == "close"
        assert c.closed_within(5)
    with httpx.Client(timeout=10) as client:
        assert client.get(proxy.url + "/ok").status_code == 200


def test_stale_pooled_connection_retried_for_idempotent_only(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with httpx.Client(timeout=10) as client:
        assert client.get(proxy.url + "/drop-next").text == "drop"
        # Pooled connection 1 is closed when the next request arrives: a GET is replayed
        # on a fresh connection, invisibly to the client.
        r = client.get(proxy.url + "/ok")
        assert r.status_code == 200 and conn_of(r.text) == (2, 1)
        # A POST is not replayed (it may have had effects): 502.
        assert client.post(proxy.url + "/drop-next", content=b"x").text == "drop"
        httpx_error(client.post(proxy.url + "/ok", content=b"payload"), 502, "upstream_reset")
        r = client.get(proxy.url + "/ok")
        assert r.status_code == 200


def named_upstream(name: bytes) -> Handler:
    """A keep-alive upstream that answers every request with its name."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      conn_id: int) -> None:
        while (req := await read_request(reader)) is not None:
            await read_body(reader, req[2])
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(name), name))
            await writer.drain()
    return handler


def test_least_request_follows_weights_at_light_load(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    # One request at a time: every endpoint has 0 in flight at each pick, so only the
    # weights can tell them apart; 3:1 must come out near 75%, not near 50%.
    heavy, light = serve(named_upstream(b"heavy")), serve(named_upstream(b"light"))
    proxy = start_proxy(f"""
[server]
workers = 1

[[clusters]]
name = "up"
balancer = "least_request"
endpoints = [{{ address = "127.0.0.1:{heavy.port}", weight = 3 }}, "127.0.0.1:{light.port}"]

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
""")
    n = 400
    with httpx.Client(timeout=10) as client:
        got = collections.Counter(client.get(proxy.url + "/x").text for _ in range(n))
    assert set(got) == {"heavy", "light"}, got
    # Binomial(400, 0.75): sd 8.7; 0.65..0.85 is more than 4 sd either side.
    assert 0.65 < got["heavy"] / n < 0.85, got


# == errors ===================================================================================


def test_404_no_route(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(f"""
[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{demo_upstream}"]

[[routes]]
name = "api"
match = {{ path_prefix = "/api/" }}
cluster = "up"
""")
    with httpx.Client(timeout=10) as client:
        r = client.get(proxy.url + "/echo")
        httpx_error(r, 404, "no_route")
        r2 = client.head(proxy.url + "/nope")
        assert r2.status_code == 404 and r2.content == b""
        assert r2.headers["content-length"] == r.headers["content-length"]
        r3 = client.get(proxy.url + "/api/x")
        assert r3.status_code == 404  # routed: the upstream's own 404
        assert r3.headers["x-upstream"] == "demo-a"
        # A local error on a request without a body keeps the client connection open.
        ports = {x.extensions["network_stream"].get_extra_info("client_addr")[1]
                 for x in (r, r2, r3)}
        assert len(ports) == 1


def test_502_connection_refused(start_proxy: StartProxy) -> None:
    """The client is told what failed, not where: the endpoint's address is for the log
    (as nginx and Envoy keep upstream addresses from clients)."""
    dead = free_port()
    proxy = start_proxy(simple_config(dead))
    with httpx.Client(timeout=10) as client:
        for _ in range(2):
            err = httpx_error(client.get(proxy.url + "/echo"), 502, "upstream_connect_failed")
            assert err["message"] == "connecting to the upstream failed: Connection refused"
    assert f"connect to 127.0.0.1:{dead} failed: Connection refused" in proxy.log()


@pytest.mark.timeout(30)
def test_504_connect_timeout(start_proxy: StartProxy, full_backlog: int) -> None:
    proxy = start_proxy(simple_config(full_backlog, cluster_extra="connect_timeout_ms = 300"))
    with httpx.Client(timeout=10) as client:
        start = time.monotonic()
        r = client.get(proxy.url + "/echo")
        elapsed = time.monotonic() - start
    err = httpx_error(r, 504, "upstream_connect_timeout")
    assert err["message"] == "connecting to the upstream timed out"
    assert 0.25 < elapsed < 3, elapsed


def test_503_cluster_without_endpoints(start_proxy: StartProxy) -> None:
    proxy = start_proxy(simple_config())
    with httpx.Client(timeout=10) as client:
        httpx_error(client.get(proxy.url + "/echo"), 503, "no_healthy_upstream")
        httpx_error(client.post(proxy.url + "/echo", content=b"abc"), 503)


def test_502_garbage_response_and_connection_not_reused(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with httpx.Client(timeout=10) as client:
        assert conn_of(client.get(proxy.url + "/ok").text) == (1, 1)
        httpx_error(client.get(proxy.url + "/garbage"), 502, "upstream_bad_response")
        # Upstream connection 1 (still open on the upstream's side) must not be used again.
        assert conn_of(client.get(proxy.url + "/ok").text) == (2, 1)
        assert conn_of(client.get(proxy.url + "/ok").text) == (2, 2)


def test_excess_response_bytes_connection_not_reused(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with httpx.Client(timeout=10) as client:
        r = client.get(proxy.url + "/extra")
        assert r.status_code == 200 and r.content == b"ok"
        r = client.get(proxy.url + "/ok")
        assert conn_of(r.text) == (2, 1), r.text


def test_502_upstream_reset_mid_headers(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with httpx.Client(timeout=10) as client:
        httpx_error(client.get(proxy.url + "/reset-head"), 502, "upstream_reset")
        assert client.get(proxy.url + "/ok").status_code == 200


def test_504_response_timeout(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port, cluster_extra="request_timeout_ms = 500"))
    with httpx.Client(timeout=10) as client:
        start = time.monotonic()
        r = client.get(proxy.url + "/late")  # a 200 3 s later had the timeout not fired
        elapsed = time.monotonic() - start
        httpx_error(r, 504, "upstream_timeout")
        assert elapsed > 0.4, elapsed  # not before request_timeout_ms
        # The upstream connection still busy with /late is not reused: reusing it would
        # queue the next request behind the late response (and take that as its answer).
        r = client.get(proxy.url + "/ok")
        assert r.status_code == 200 and conn_of(r.text) == (2, 1), r.text


@pytest.mark.timeout(20)
@pytest.mark.parametrize("path", ["/truncate", "/truncate-chunked"])
def test_truncated_response_is_incomplete_not_hung(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer], path: str
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with httpx.Client(timeout=5) as client:
        start = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError):
            client.get(proxy.url + path)
        assert time.monotonic() - start < 3
        r = client.get(proxy.url + "/ok")
        assert r.status_code == 200 and conn_of(r.text) == (2, 1)
    with RawConn(proxy.port, timeout=5) as c:
        c.send(get(path))
        head = c.read_head()
        assert head.status == 200
        rest = c.read_to_eof()  # closed, not hung
        if path == "/truncate":
            assert head.header("content-length") == "1000"
            assert rest == b"x" * 500
        else:
            assert head.header("transfer-encoding") == "chunked"
            assert rest.startswith(b"1f4\r\n" + b"y" * 500)
            assert not rest.endswith(b"0\r\n\r\n"), "truncated body was made to look complete"


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (b"GET /echo HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n", 400, None),
        (b"GET /echo HTTP/1.1\r\n\r\n", 400, None),
        (b"GET /echo HTTP/2.0\r\nHost: t\r\n\r\n", 505, None),
        (b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n", 431, None),
        (b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: t\r\n\r\n", 414, None),
        (b"A" * 10000 + b" /echo HTTP/1.1\r\nHost: t\r\n\r\n", 501, None),
        (b"GET /echo?q=<b> HTTP/1.1\r\nHost: t\r\n\r\n", 400, None),
        (b"GET /a\\b HTTP/1.1\r\nHost: t\r\n\r\n", 400, None),
        (b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"0\r\n" + b"X-T: v\r\n" * 101 + b"\r\n", 431, None),
        (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, None),
        (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2048\r\n\r\n", 413,
         "payload_too_large"),
        (b"GET /echo HTTP/1.1\r\nHost: t\r\nExpect: teapot\r\n\r\n", 417, "expectation_failed"),
        (b"CONNECT 127.0.0.1:443 HTTP/1.1\r\nHost: 127.0.0.1:443\r\n\r\n", 501, None),
    ],
    ids=["bad-header", "no-host", "http2", "header-too-large", "uri-too-long",
         "method-too-long", "target-angle", "target-backslash", "trailer-count", "cl-and-te",
         "body-too-large", "expect-unknown", "connect"],
)
def test_proxy_generated_errors(
    start_proxy: StartProxy, demo_upstream: int, request_bytes: bytes, status: int,
    code: str | None,
) -> None:
    proxy = start_proxy(simple_config(demo_upstream, http="max_body_bytes = 1024"))
    with RawConn(proxy.port) as c:
        c.send(request_bytes)
        r = c.read_response()
        raw_error(r, status, code)
        if r.header("connection") == "close":
            assert c.closed_within(5)
    with httpx.Client(timeout=10) as client:
        assert client.get(proxy.url + "/echo").status_code == 200  # the proxy is fine


def test_target_characters_rfc3986_forbids_are_400_and_close(
    start_proxy: StartProxy, demo_upstream: int
) -> None:
    """RFC 9112 3.2: a request-target with a character RFC 3986 does not allow (in the
    path or the query) makes the request-line invalid: 400, and the connection closes
    cleanly after it (what follows cannot be trusted to start a request). Those real
    clients send unencoded pass (test_target_characters_real_clients_send_unencoded_pass)."""
    proxy = start_proxy(simple_config(demo_upstream))
    for c in b'"<>':
        for target in (b"/a%cb" % c, b"/echo?q=%c" % c):
            with RawConn(proxy.port) as conn:
                conn.send(b"GET " + target + b" HTTP/1.1\r\nHost: t\r\n\r\n")
                r = conn.read_response()
                raw_error(r, 400)
                assert r.header("connection") == "close", target
                assert conn.closed_within(5), target


# == timeouts =================================================================================


def test_header_timeout_408_then_close(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream, http="header_timeout_ms = 500"))
    with RawConn(proxy.port) as c:
        start = time.monotonic()
        c.send(b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Half: ")
        r = c.read_response()
        elapsed = time.monotonic() - start
        raw_error(r, 408, "request_timeout")
        assert r.header("connection") == "close"
        assert 0.4 < elapsed < 3, elapsed
        assert c.closed_within(5)


def test_body_timeout_408(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream, http="body_timeout_ms = 500"))
    with RawConn(proxy.port) as c:
        c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n0123456789")
        start = time.monotonic()
        r = c.read_response()
        # No response has started, so the proxy answers 408 itself, then closes (the rest
        # of the body would otherwise be read as the next request).
        raw_error(r, 408, "request_timeout")
        assert time.monotonic() - start < 3
        assert r.header("connection") == "close"
        assert c.closed_within(5)


def test_idle_keepalive_connection_closed(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream, http="keepalive_timeout_ms = 500"))
    with RawConn(proxy.port) as c:
        c.send(get("/echo"))
        assert c.read_response().status == 200
        start = time.monotonic()
        assert c.closed_within(5)
        elapsed = time.monotonic() - start
        assert 0.3 < elapsed < 3, elapsed
    # Activity resets the idle timer: requests 300 ms apart keep the connection open.
    with RawConn(proxy.port) as c:
        for i in range(4):
            c.send(get(f"/echo/{i}"))
            assert c.read_response().status == 200
            time.sleep(0.3)


def test_max_keepalive_requests_announces_close(
    start_proxy: StartProxy, demo_upstream: int
) -> None:
    proxy = start_proxy(simple_config(demo_upstream, http="max_keepalive_requests = 3"))
    with RawConn(proxy.port) as c:
        for i in range(3):
            c.send(get(f"/echo/{i}"))
            r = c.read_response()
            assert r.status == 200
            if i < 2:
                assert r.header("connection") is None
        # The proxy closes after the third response, so that response must say so: a
        # client that is not told reuses the connection and loses its next request.
        assert r.header("connection") == "close"
        assert c.closed_within(5)
    # The same for the proxy's own responses (503: a cluster without endpoints).
    local = start_proxy(simple_config(http="max_keepalive_requests = 3"))
    with RawConn(local.port) as c:
        for i in range(3):
            c.send(get(f"/local/{i}"))
            r = c.read_response()
            raw_error(r, 503)
            if i < 2:
                assert r.header("connection") is None
        assert r.header("connection") == "close"
        assert c.closed_within(5)


# == slow peers: memory stays bounded =========================================================


@pytest.mark.timeout(60)
def test_slow_client_download_memory_bounded(
    start_proxy: StartProxy, demo_upstream: int
) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    warm_up(proxy)
    total = 64 * MiB
    digest = hashlib.sha256()
    with RssMonitor(proxy.proc.pid) as rss, RawConn(proxy.port, rcvbuf=64 * KiB) as c:
        c.send(get(f"/bytes/{total}?length=1"))
        head = c.read_head()
        assert head.status == 200 and head.header("content-length") == str(total)
        got = len(c.buf)
        digest.update(c.buf)
        c.buf.clear()
        slow_until = time.monotonic() + 3
        while time.monotonic() < slow_until:
            data = c.sock.recv(4096)
            assert data
            digest.update(data)
            got += len(data)
            time.sleep(0.02)
        slow_growth = rss.peak - rss.base
        while got < total:
            data = c.sock.recv(MiB)
            assert data, f"closed after {got} bytes"
            digest.update(data)
            got += len(data)
    assert got == total
    assert digest.hexdigest() == bytes_sha256(total)
    assert slow_growth < RSS_LIMIT_SLOW, f"while the client was slow: {rss.describe()}"
    assert rss.growth < RSS_LIMIT_SLOW, rss.describe()


def test_paused_client_is_held_to_send_timeout_not_the_upstream_read_timeout(
        start_proxy: StartProxy, demo_upstream: int) -> None:
    """A client that stops reading pauses its upstream: the upstream is not then cut at
    its read_timeout_ms (found by fuzzing, with a 5 s one); the client gets
    send_timeout_ms to take data again, then the connection is closed."""
    proxy = start_proxy(simple_config(demo_upstream, http="send_timeout_ms = 2500",
                                      cluster_extra="read_timeout_ms = 500"))
    total = 32 * MiB

    def download(pause: float) -> int:
        with RawConn(proxy.port, rcvbuf=64 * KiB) as c:
            c.send(get(f"/bytes/{total}?length=1"))
            assert c.read_head().status == 200
            got = len(c.buf)
            time.sleep(pause)  # reads nothing: the proxy's output and upstream pause
            while got < total:
                try:
                    data = c.sock.recv(MiB)
                except ConnectionResetError:
                    break
                if not data:
                    break
                got += len(data)
            return got

    assert download(1.5) == total  # three read timeouts long, within send_timeout
    assert download(4.0) < total  # past send_timeout: cut


@pytest.mark.timeout(60)
def test_slow_upstream_upload_memory_bounded(
    start_proxy: StartProxy, serve: Callable[[Handler], ThreadedServer]
) -> None:
    up = serve(scripted_upstream)
    proxy = start_proxy(simple_config(up.port))
    with httpx.Client(timeout=30) as client:  # warm-up
        assert client.post(proxy.url + "/ok", content=b"x" * (256 * KiB)).status_code == 200
    total = 64 * MiB
    block = random_block(MiB, seed=17)
    start = time.monotonic()
    with RssMonitor(proxy.proc.pid) as rss, httpx.Client(timeout=60) as client:
        r = client.post(proxy.url + "/slow-read", content=upload_blocks(total, block),
                        headers={"Content-Length": str(total)})
    assert r.status_code == 200, r.text
    assert r.json() == {"bytes": total, "sha256": upload_sha256(total, block)}
    assert time.monotonic() - start > SLOW_READ_SECONDS  # the upstream really was slow
    assert rss.growth < RSS_LIMIT_SLOW, rss.describe()


# == graceful stop ============================================================================


@pytest.mark.timeout(30)
def test_sigterm_lets_inflight_stream_finish(start_proxy: StartProxy, demo_upstream: int) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    events: list[str] = []
    refused_during_drain = False
    with httpx.Client(timeout=10) as client:
        with client.stream("GET", proxy.url + "/sse?n=6&delay_ms=300") as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 1:
                    proxy.proc.send_signal(signal.SIGTERM)
                    deadline = time.monotonic() + 1.0
                    while time.monotonic() < deadline:
                        try:
                            socket.create_connection(("127.0.0.1", proxy.port), 0.2).close()
                        except ConnectionRefusedError:
                            refused_during_drain = True
                            break
                        time.sleep(0.02)
    assert events == [f"event {i}" for i in range(6)]
    assert refused_during_drain, "the listener still accepted connections while draining"
    assert proxy.proc.wait(timeout=10) == 0, proxy.log()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), 1).close()


def test_sigterm_closes_idle_keepalive_connections(
    start_proxy: StartProxy, demo_upstream: int
) -> None:
    proxy = start_proxy(simple_config(demo_upstream))
    with RawConn(proxy.port) as c:
        c.send(get("/echo"))
        assert c.read_response().status == 200
        proxy.proc.send_signal(signal.SIGTERM)
        assert c.closed_within(5)
    assert proxy.proc.wait(timeout=10) == 0

