"""HTTP/1.1 responses from upstream on the wire (RFC 9112 6, 7; RFC 9110 8.6, 7.6.1, 15.2).

A raw upstream (`Scripted`) answers `/c/<case>` (or any path with `?c=<case>`) with the
exact bytes of CASES[case] and keeps its connection open, so a proxy that reused a
connection it should have dropped would send the next request down it: every other
path is answered "conn=<n> req=<k>", k counting requests on that upstream connection.
Clients are raw sockets (exact bytes in and out) and curl.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CRASH_MARKERS, Proxy, simple_config
from tests.support import (
    StreamServerThread,
    free_port,
    process_log,
    start_process,
    stop_process,
    wait_port,
)

pytestmark = pytest.mark.timeout(60)

SMUGGLED = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nSMUGGLED"
OK2 = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"

# Responses the proxy must refuse: the client gets a 502, and the connection is dropped.
REJECTED = {
    "cl-and-te": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"5\r\nhello\r\n0\r\n\r\n",
    "te-and-cl": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 30\r\n\r\n"
                 b"5\r\nhello\r\n0\r\n\r\n",
    "cl-conflict": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\nhello",
    "cl-list-conflict": b"HTTP/1.1 200 OK\r\nContent-Length: 1,2\r\n\r\nxy",
    "cl-plus": b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello",
    "cl-hex": b"HTTP/1.1 200 OK\r\nContent-Length: 0x5\r\n\r\nhello",
    "cl-negative": b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\nhello",
    "cl-huge": b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\nhello",
    "cl-empty": b"HTTP/1.1 200 OK\r\nContent-Length: \r\n\r\nhello",
    "te-chunked-identity": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, identity\r\n\r\n"
                           b"5\r\nhello\r\n0\r\n\r\n",
    "te-identity": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\nhello",
    "te-gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nhello",
    "te-chunked-twice": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n"
                        b"5\r\nhello\r\n0\r\n\r\n",
    "te-in-http10": b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "chunk-bad-hex": CHUNKED + b"5g\r\nhello\r\n0\r\n\r\n",
    "chunk-0x": CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n",
    "chunk-negative": CHUNKED + b"-5\r\nhello\r\n0\r\n\r\n",
    "chunk-huge": CHUNKED + b"ffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
    "chunk-bare-lf-size": CHUNKED + b"5\nhello\r\n0\r\n\r\n",
    "chunk-bare-lf-data": CHUNKED + b"5\r\nhello\n0\r\n\r\n",
    "chunk-bare-lf-end": CHUNKED + b"5\r\nhello\r\n0\r\n\n",
    "chunk-data-longer": CHUNKED + b"3\r\nhello\r\n0\r\n\r\n",
    "chunk-bad-ext": CHUNKED + b"5;\x01\r\nhello\r\n0\r\n\r\n",
    "chunk-17-hex-digits-behind-zeros": CHUNKED + b"0000" + b"1" + b"0" * 16 + b"\r\nhello\r\n",
    "chunk-size-line-of-zeros": CHUNKED + b"0" * 5000 + b"5\r\nhello\r\n0\r\n\r\n",
    # Trailer fields are counted against max_headers (100) as header fields are.
    "too-many-trailer-fields": CHUNKED + b"5\r\nhello\r\n0\r\n" + b"X-T: v\r\n" * 101 + b"\r\n",
    "trailer-folded": CHUNKED + b"5\r\nhello\r\n0\r\nX-A: 1\r\n folded\r\n\r\n",
    "obs-fold": b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 2\r\n\r\nok",
    "nul-in-value": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\nok",
    "cr-in-value": b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\nok",
    "lf-in-value": b"HTTP/1.1 200 OK\r\nX-A: a\nContent-Length: 7\r\nContent-Length: 2\r\n\r\nok",
    "bare-lf-head": b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",
    "space-before-colon": b"HTTP/1.1 200 OK\r\nContent-Length : 5\r\nContent-Length: 2\r\n\r\nok",
    "http-2.0": b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "http-0.9": b"HTTP/0.9 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "status-099": b"HTTP/1.1 099 Odd\r\nContent-Length: 2\r\n\r\nok",
    "status-1000": b"HTTP/1.1 1000 Odd\r\nContent-Length: 2\r\n\r\nok",
    "status-600": b"HTTP/1.1 600 Odd\r\nContent-Length: 2\r\n\r\nok",
    "no-space-after-version": b"HTTP/1.1200 OK\r\nContent-Length: 2\r\n\r\nok",
    "ctl-in-reason": b"HTTP/1.1 200 O\x01K\r\nContent-Length: 2\r\n\r\nok",
    "1xx-with-body": b"HTTP/1.1 103 Early Hints\r\nContent-Length: 5\r\n\r\nhello" + OK2,
    "101-not-asked": b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                     b"Upgrade: websocket\r\n\r\nRAW",
    "head-too-large": b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * 70000 + b"\r\nContent-Length: 2\r\n\r\nok",
    "too-many-fields": b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(300))
                       + b"Content-Length: 2\r\n\r\nok",
}

# Valid (or tolerated) responses: passed on, and the connection is reused.
ACCEPTED = {
    "cl-list-same": (b"HTTP/1.1 200 OK\r\nContent-Length: 1,1\r\n\r\nx", b"x"),
    "cl-repeated-same": (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
                         b"hello"),
    "http-1.2": (b"HTTP/1.2 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok"),
    "no-reason": (b"HTTP/1.1 200\r\nContent-Length: 2\r\n\r\nok", b"ok"),
    "chunk-extensions": (CHUNKED + b"5;a=b;c=\"d e\"\r\nhello\r\n0;z\r\n\r\n", b"hello"),
    # chunk-size = 1*HEXDIG (RFC 9112 7.1): leading zeros past 16 digits are still valid.
    "chunk-leading-zeros": (CHUNKED + b"0" * 20 + b"5\r\nhello\r\n" + b"0" * 21 + b"\r\n\r\n",
                            b"hello"),
    "trailer-framing-fields": (CHUNKED + b"5\r\nhello\r\n0\r\nContent-Length: 50\r\n"
                               b"Transfer-Encoding: chunked\r\nHost: evil\r\n\r\n", b"hello"),
    "te-mixed-case": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: ChUnKeD\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                      b"hello"),
    "1xx-several": (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n"
                    b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK2, b"ok"),
}

# Bytes past the end of the response: the response is passed on, the rest never is.
EXCESS = {
    "past-content-length": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + SMUGGLED, 200),
    "past-zero-length": (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n" + SMUGGLED, 200),
    "past-last-chunk": (CHUNKED + b"5\r\nhello\r\n0\r\n\r\n" + SMUGGLED, 200),
    "204-with-body": (b"HTTP/1.1 204 No Content\r\n\r\n" + SMUGGLED, 204),
    "204-with-length": (b"HTTP/1.1 204 No Content\r\nContent-Length: 8\r\n\r\nSMUGGLED", 204),
    "304-with-body": (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 8\r\n\r\nSMUGGLED", 304),
}

# A 204 response with Content-Length or Transfer-Encoding (RFC 9110 8.6, RFC 9112
# 6.1: MUST NOT) from an upstream that then sends the body it declared, only after the
# proxy sent its next request on that connection: had the connection been reused, those
# bytes would be read as the next request's response (another client's).
LATE = {
    "204-late-length": (b"HTTP/1.1 204 No Content\r\nContent-Length: %d\r\n\r\n"
                        % len(SMUGGLED), SMUGGLED, 204),
    "204-late-chunked": (b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n",
                         b"0\r\n\r\n", 204),
    "103-late-length": (b"HTTP/1.1 103 Early Hints\r\nContent-Length: %d\r\n\r\n"
                        % len(SMUGGLED) + OK2, SMUGGLED, 200),
    "103-late-chunked": (b"HTTP/1.1 103 Early Hints\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + OK2, b"0\r\n\r\n", 200),
}

# Responses cut after their head and first body bytes reached the client: what the
# upstream sends first, then (once the test has read that and calls `go`) what it sends
# next, or None: it closes the connection. The client must be able to tell the response
# is incomplete (RFC 9112 8).
CUT = {
    "cut-bad-chunk": (CHUNKED + b"5\r\nhello\r\n", b"zz\r\nworld\r\n0\r\n\r\n"),
    "cut-close-chunked": (CHUNKED + b"5\r\nhello\r\n", None),
    "cut-close-length": (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello", None),
}

CASES = {**REJECTED, **{k: v for k, (v, _) in ACCEPTED.items()},
         **{k: v for k, (v, _, _) in LATE.items()},
         **{k: v for k, (v, _) in EXCESS.items()},
         **{k: v for k, (v, _) in CUT.items()}}
CASES.update({
    "head-with-body": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello" + SMUGGLED,
    "head-length-list": b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n",
    "head-length-repeated": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
    "304-length-list": b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5,5\r\n\r\n",
    "get-length-list": b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\nhello",
    "hop": (b"HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Secret, x-other\r\nX-Secret: s\r\n"
            b"X-Other: o\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\n"
            b"TE: trailers\r\nUpgrade: h2c\r\nX-Kept: yes\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2\r\n\r\n{}"),
})


class Scripted(StreamServerThread):
    """The raw upstream, an asyncio server in a thread (see the module docstring)."""

    def __init__(self) -> None:
        self.conns = 0
        self.go = threading.Event()  # see CUT
        super().__init__(self._conn)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.conns += 1
        conn, served = self.conns, 0
        late = b""
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if late:
                    writer.write(late)  # see LATE
                    late = b""
                m = re.search(rb"\r\ncontent-length: *(\d+)", head, re.I)
                await reader.readexactly(int(m.group(1)) if m else 0)
                served += 1
                target = head.split(b" ", 2)[1].decode()
                name = target[3:] if target.startswith("/c/") else target.partition("c=")[2]
                if name:
                    self.go.clear()
                    writer.write(CASES[name])
                    if name in LATE:
                        late = LATE[name][1]
                    if name in CUT:
                        await writer.drain()
                        loop = asyncio.get_running_loop()
                        assert await loop.run_in_executor(None, self.go.wait, 10)
                        if CUT[name][1] is None:
                            return
                        writer.write(CUT[name][1])
                else:
                    text = f"conn={conn} req={served}".encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(text), text))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[Scripted]:
    up = Scripted()
    yield up
    up.close()


def _launch(path: Path, body: str) -> Proxy:
    port = free_port()
    path.write_text(f'[[listeners]]\nname = "test"\naddress = "127.0.0.1:{port}"\n'
                    f'protocols = ["http1", "h2c"]\n' + body)
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(path)])
    try:
        wait_port("127.0.0.1", port, proc=proc)
    except BaseException:
        stop_process(proc)
        raise
    return Proxy(proc, port, path)


@pytest.fixture(scope="module")
def proxy(upstream: Scripted, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    p = _launch(tmp_path_factory.mktemp("h1resp") / "aiproxy.toml",
                simple_config(upstream.port) + "\n[server]\nworkers = 1\n")
    yield p
    log = stop_process(p.proc)
    assert not any(m in log for m in CRASH_MARKERS), log


@pytest.fixture(autouse=True)
def alive(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "proxy" in request.fixturenames:
        p = request.getfixturevalue("proxy")
        assert p.proc.poll() is None, process_log(p.proc)
        assert not any(m in process_log(p.proc) for m in CRASH_MARKERS), process_log(p.proc)


class Client:
    """A raw keep-alive client connection that reads exactly one response at a time."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buf = b""

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def _more(self) -> bool:
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        self.buf += data
        return bool(data)

    def request(self, target: str, method: str = "GET") -> None:
        self.sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: t\r\n\r\n".encode())

    def response(self, method: str = "GET") -> tuple[int, dict[bytes, list[bytes]], bytes]:
        """Status, fields (lower-case name -> values) and body of the next final response."""
        while True:
            while b"\r\n\r\n" not in self.buf:
                assert self._more(), f"closed; unparsed {self.buf[:200]!r}"
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            status = int(lines[0].split(b" ")[1])
            fields: dict[bytes, list[bytes]] = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                fields.setdefault(name.lower(), []).append(value.strip())
            if status >= 200:
                break
        if method == "HEAD" or status in (204, 304):
            return status, fields, b""
        if b"transfer-encoding" in fields:
            assert fields[b"transfer-encoding"] == [b"chunked"]
            body = b""
            while True:
                while b"\r\n" not in self.buf:
                    assert self._more()
                size_line, _, self.buf = self.buf.partition(b"\r\n")
                size = int(size_line, 16)
                while len(self.buf) < size + 2:
                    assert self._more()
                body, self.buf = body + self.buf[:size], self.buf[size + 2:]
                if size == 0:
                    return status, fields, body
        length = int(fields[b"content-length"][0])
        while len(self.buf) < length:
            assert self._more()
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, fields, body

    def get(self, target: str, method: str = "GET") -> tuple[int, dict[bytes, list[bytes]], bytes]:
        self.request(target, method)
        return self.response(method)


def fresh_upstream_connection(c: Client) -> bool:
    """True if /ok on this client connection is the first request of its upstream
    connection (the one before it was not reused)."""
    status, _, body = c.get("/ok")
    assert status == 200 and body.startswith(b"conn="), body
    return body.endswith(b" req=1")


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_invalid_response_is_502_and_its_connection_is_dropped(proxy: Proxy, case: str) -> None:
    with Client(proxy.port) as c:
        status, fields, body = c.get(f"/c/{case}")
        assert status == 502, body
        assert fields[b"content-type"] == [b"application/json"]
        assert json.loads(body)["error"]["code"] == "upstream_bad_response"
        # The client keeps its connection; the upstream's is never used again.
        assert fresh_upstream_connection(c)


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_valid_response_is_passed_on_and_its_connection_reused(proxy: Proxy, case: str) -> None:
    with Client(proxy.port) as c:
        status, fields, body = c.get(f"/c/{case}")
        assert status == 200 and body == ACCEPTED[case][1]
        # Framing and hop-by-hop fields are the proxy's own: one of each at most.
        assert len(fields.get(b"content-length", [])) + len(fields.get(b"transfer-encoding", [])) == 1
        assert not fresh_upstream_connection(c)


@pytest.mark.parametrize("case", sorted(EXCESS))
def test_bytes_past_the_response_are_never_served(proxy: Proxy, case: str) -> None:
    with Client(proxy.port) as c:
        status, fields, body = c.get(f"/c/{case}")
        assert status == EXCESS[case][1] and b"SMUGGLED" not in body
        if status == 204:
            assert b"content-length" not in fields  # RFC 9110 8.6
        assert fresh_upstream_connection(c)


@pytest.mark.parametrize("case", sorted(LATE))
def test_response_that_declares_a_forbidden_body_ends_its_connection(proxy: Proxy,
                                                                      case: str) -> None:
    """The response ends at its head (RFC 9112 6.3), but its upstream thinks otherwise:
    which bytes come next on that connection is not known, so it is not reused."""
    with Client(proxy.port) as c:
        status, fields, body = c.get(f"/c/{case}")
        assert status == LATE[case][2] and b"SMUGGLED" not in body
        assert fresh_upstream_connection(c)


def test_head_response_with_a_body(proxy: Proxy) -> None:
    with Client(proxy.port) as c:
        status, fields, _ = c.get("/c/head-with-body", "HEAD")
        assert status == 200 and fields[b"content-length"] == [b"5"]
        assert fresh_upstream_connection(c)


@pytest.mark.parametrize(("case", "method", "status"), [
    ("head-length-list", "HEAD", 200),
    ("head-length-repeated", "HEAD", 200),
    ("304-length-list", "GET", 304),
])
def test_no_body_response_content_length_is_one_value(proxy: Proxy, case: str, method: str,
                                                      status: int) -> None:
    """RFC 9110 8.6: a list of identical Content-Length values, or repeated fields, is
    replaced by one valid Content-Length before the message is forwarded; a HEAD or 304
    response keeps its Content-Length (the length the body would have)."""
    with Client(proxy.port) as c:
        got, fields, _ = c.get(f"/c/{case}", method)
        assert got == status and fields[b"content-length"] == [b"5"]
        assert not fresh_upstream_connection(c)


def curl_h2(port: int, target: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "-i", "--http2-prior-knowledge", "--max-time", "5",
                           *args, f"http://127.0.0.1:{port}{target}"],
                          capture_output=True, timeout=15)


@pytest.mark.parametrize(("case", "args", "body"), [
    ("get-length-list", (), b"hello"),
    ("cl-repeated-same", (), b"hello"),
    ("head-length-list", ("-I",), b""),
    ("head-length-repeated", ("-I",), b""),
    ("304-length-list", (), b""),
])
def test_http2_client_gets_one_content_length(proxy: Proxy, case: str, args: tuple[str, ...],
                                              body: bytes) -> None:
    """An HTTP/1.1 upstream's `Content-Length: 5, 5` (or two fields) reaches an HTTP/2
    client as one content-length: a list is malformed in HTTP/2 (curl resets the
    stream with PROTOCOL_ERROR)."""
    r = curl_h2(proxy.port, f"/c/{case}", *args)
    assert r.returncode == 0, r.stderr
    head, _, got = r.stdout.partition(b"\r\n\r\n")
    assert re.findall(rb"(?im)^content-length: *(.*?)\r?$", head) == [b"5"], head
    assert got == body


def test_hop_by_hop_fields_are_not_passed_on(proxy: Proxy) -> None:
    with Client(proxy.port) as c:
        _, fields, body = c.get("/c/hop")
        assert body == b"{}" and fields[b"x-kept"] == [b"yes"]
        for name in (b"connection", b"x-secret", b"x-other", b"keep-alive",
                     b"proxy-connection", b"te", b"upgrade"):
            assert name not in fields, name


def test_hop_by_hop_fields_are_not_passed_on_when_a_filter_rebuilds_the_head(
    upstream: Scripted, start_proxy: Callable[..., Proxy]
) -> None:
    """Filters that add a field (guard flags, cache status) rebuild the response head
    from its field list: the fields the upstream's Connection named must still be
    dropped (RFC 9110 7.6.1)."""
    p = start_proxy(simple_config(upstream.port) + """
[cache]

[guard]
[[guard.rules]]
id = "flagme"
action = "flag"
keywords = ["flagme"]
""")
    target = "/v1/chat/completions?c=hop"
    for prompt in ("flagme", "hello"):  # a guard flag; a cache miss
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]})
        with socket.create_connection(("127.0.0.1", p.port), timeout=5) as s:
            s.sendall(f"POST {target} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head = data.partition(b"\r\n\r\n")[0].lower()
        assert b"\r\nx-kept: yes" in head, head
        assert (b"x-aiproxy-guard-flags: flagme" in head) == (prompt == "flagme"), head
        for name in (b"x-secret", b"x-other", b"keep-alive", b"proxy-connection", b"upgrade"):
            assert b"\r\n" + name + b":" not in head, (name, head)


def read_until_closed(sock: socket.socket) -> tuple[bytes, bool]:
    """What sock receives until the peer closes, and whether it closed with a reset."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, False
        data += chunk


@pytest.mark.parametrize("version", ["1.0", "1.1"])
@pytest.mark.parametrize("case", sorted(CUT))
def test_response_cut_after_its_head_is_seen_as_incomplete(
        proxy: Proxy, upstream: Scripted, case: str, version: str) -> None:
    """After the response head went out, an upstream failure can only cut the client's
    connection, and the client must be able to tell (RFC 9112 8): a Content-Length it
    did not get, a missing last chunk, or, for a body that ends with the connection (an
    HTTP/1.0 client's), a reset: a clean close would say the body is whole."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(f"GET /c/{case} HTTP/{version}\r\nHost: t\r\n\r\n".encode())
        got = b""
        while not got.endswith(b"hello\r\n" if b"chunked" in got else b"hello"):
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        upstream.go.set()
        rest, reset = read_until_closed(sock)
    head, _, body = (got + rest).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    fields = head.lower()
    if b"\r\ncontent-length: 10" in fields:
        assert len(body) < 10
    elif b"\r\ntransfer-encoding: chunked" in fields:
        assert not body.endswith(b"0\r\n\r\n"), body
    else:
        assert version == "1.0" and body == b"hello"
        assert reset, "a cut body that ends with the connection looks whole"


@pytest.mark.parametrize("case", ["cut-bad-chunk", "cut-close-chunked"])
def test_curl_http10_sees_a_cut_body_as_an_error(proxy: Proxy, upstream: Scripted,
                                                 case: str) -> None:
    curl = subprocess.Popen(["curl", "-sS", "-0", "-N", "--max-time", "10",
                             f"http://127.0.0.1:{proxy.port}/c/{case}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert curl.stdout.read(5) == b"hello"
        upstream.go.set()
        out, err = curl.communicate(timeout=15)
    finally:
        if curl.poll() is None:
            curl.kill()
            curl.wait()
    assert out == b""
    assert curl.returncode == 56, err  # CURLE_RECV_ERROR: "Connection reset by peer"


@pytest.mark.parametrize("n", [0, 2, 1023, 1024, 4096, 10**12])
def test_content_length_line_each_size_range(n):
    # Below 1024 from a table made at import, above it from the bounded cache or made.
    from aiproxy.protocols.http1 import content_length_line
    assert content_length_line(n) == b"Content-Length: %d\r\n" % n
    assert content_length_line(n) == b"Content-Length: %d\r\n" % n  # a cached one too
