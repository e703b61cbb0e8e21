"""Request smuggling and malformed HTTP/1.1 on the wire (RFC 9112).

The proxy runs as a real process in front of a real upstream (`Recorder`, a threaded
socket server) that records every raw byte it receives and frames what it gets the way
an origin server would (Content-Length or chunked), so assertions are about the requests
the upstream actually saw. Clients are raw sockets.

Each rejected request must get the right status with the JSON error body, then a clean
close (the full response, then EOF, no reset), and nothing of it may reach the upstream.
After every rejection a "sentinel" request on a fresh connection proves the proxy still
works and bounds what the upstream saw: everything it received must be the sentinel.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import CRASH_MARKERS, Proxy, simple_config
from tests.support import free_port, process_log, start_process, stop_process, wait_port

pytestmark = pytest.mark.timeout(30)

OK_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
REQUEST_LINE = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+ \S+ HTTP/\d\.\d$")

# Limits of the shared proxy (see the `proxy` fixture).
MAX_HEADER_BYTES = 4096
MAX_HEADERS = 40
MAX_LINE = 1024
MAX_BODY = 1024
HTTP_LIMITS = f"""\
max_header_bytes = {MAX_HEADER_BYTES}
max_headers = {MAX_HEADERS}
max_request_line_bytes = {MAX_LINE}
max_body_bytes = {MAX_BODY}
"""

CODES = {
    400: "bad_request",
    413: "payload_too_large",
    414: "uri_too_long",
    417: "expectation_failed",
    431: "request_header_fields_too_large",
    501: "not_implemented",
    505: "http_version_not_supported",
}

# --------------------------------------------------------------------------------------
# The recording upstream
# --------------------------------------------------------------------------------------


class Malformed(Exception):
    pass


@dataclass
class UpRequest:
    method: bytes
    target: bytes
    version: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    raw: bytes

    def header(self, name: bytes) -> list[bytes]:
        return [v for n, v in self.headers if n == name]


@dataclass
class UpConn:
    ident: int
    raw: bytearray = field(default_factory=bytearray)
    pending: bytearray = field(default_factory=bytearray)
    requests: list[UpRequest] = field(default_factory=list)
    malformed: str | None = None
    closed: bool = False


def _decode_chunked(buf: bytes, pos: int) -> tuple[bytes, int] | None:
    """Strict chunked body at buf[pos:]: (payload, end) or None when incomplete."""
    out = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size_text = buf[pos:eol].split(b";", 1)[0].strip(b" \t")
        if not re.fullmatch(rb"[0-9A-Fa-f]{1,16}", size_text) or b"\n" in buf[pos:eol]:
            raise Malformed(f"bad chunk size line {buf[pos:eol]!r}")
        size = int(size_text, 16)
        pos = eol + 2
        if size == 0:
            while True:  # trailer section
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    return None
                if eol == pos:
                    return bytes(out), eol + 2
                pos = eol + 2
        if len(buf) < pos + size + 2:
            return None
        out += buf[pos:pos + size]
        if buf[pos + size:pos + size + 2] != b"\r\n":
            raise Malformed("chunk data not followed by CRLF")
        pos += size + 2


def parse_upstream_request(buf: bytes) -> tuple[UpRequest, int] | None:
    """One request at the start of buf as an origin server frames it; None if incomplete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = buf[:end].split(b"\r\n")
    if not REQUEST_LINE.match(lines[0]):
        raise Malformed(f"bad request line {lines[0][:100]!r}")
    method, target, version = lines[0].split(b" ")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or b"\n" in line or b"\r" in line:
            raise Malformed(f"bad field line {line[:100]!r}")
        headers.append((name.lower(), value.strip(b" \t")))
    names = [n for n, _ in headers]
    te = [v for n, v in headers if n == b"transfer-encoding"]
    cl = [v for n, v in headers if n == b"content-length"]
    if te and cl:
        raise Malformed("Content-Length and Transfer-Encoding")
    if names.count(b"host") != 1 or len(cl) > 1 or len(te) > 1:
        raise Malformed("duplicate framing or Host fields")
    start = end + 4
    if te:
        if te[0].lower() != b"chunked":
            raise Malformed(f"transfer coding {te[0]!r}")
        decoded = _decode_chunked(buf, start)
        if decoded is None:
            return None
        body, stop = decoded
    elif cl:
        if not cl[0].isdigit():
            raise Malformed(f"Content-Length {cl[0]!r}")
        stop = start + int(cl[0])
        if len(buf) < stop:
            return None
        body = buf[start:stop]
    else:
        body, stop = b"", start
    return UpRequest(method, target, version, headers, body, bytes(buf[:stop])), stop


class Recorder:
    """Upstream on 127.0.0.1 that records raw bytes and answers every request it frames."""

    def __init__(self) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.cond = threading.Condition()
        self.conns: list[UpConn] = []
        self.stopping = False
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with self.cond:
                conn = UpConn(len(self.conns))
                self.conns.append(conn)
                self.socks.append(sock)
            threading.Thread(target=self._serve, args=(sock, conn), daemon=True).start()

    def _serve(self, sock: socket.socket, conn: UpConn) -> None:
        try:
            while True:
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                with self.cond:
                    if not data:
                        conn.closed = True
                        self.cond.notify_all()
                        return
                    conn.raw += data
                    conn.pending += data
                    replies = 0
                    try:
                        while conn.pending:
                            parsed = parse_upstream_request(bytes(conn.pending))
                            if parsed is None:
                                break
                            req, used = parsed
                            conn.requests.append(req)
                            del conn.pending[:used]
                            replies += 1
                    except Malformed as exc:
                        conn.malformed = str(exc)
                    self.cond.notify_all()
                if conn.malformed:
                    sock.close()
                    with self.cond:
                        conn.closed = True
                        self.cond.notify_all()
                    return
                if replies:
                    try:
                        sock.sendall(OK_RESPONSE * replies)
                    except OSError:
                        pass
        finally:
            sock.close()

    # -- what the upstream saw ------------------------------------------------------------

    def reset(self) -> None:
        """Forget what was seen so far (pooled connections stay open)."""
        with self.cond:
            for conn in self.conns:
                conn.raw.clear()
                conn.pending.clear()
                conn.requests.clear()
                conn.malformed = None

    def requests(self) -> list[UpRequest]:
        with self.cond:
            return [r for c in self.conns for r in c.requests]

    def raw(self) -> bytes:
        with self.cond:
            return b"".join(bytes(c.raw) for c in self.conns)

    def touched(self) -> list[UpConn]:
        """Connections that received anything since the last reset."""
        with self.cond:
            return [c for c in self.conns if c.raw]

    def request_lines(self) -> list[bytes]:
        """Minimal view: split the raw stream of each connection on the blank line and
        keep every line that looks like a request line."""
        found = []
        with self.cond:
            for conn in self.conns:
                for part in bytes(conn.raw).split(b"\r\n\r\n"):
                    for line in part.split(b"\r\n"):
                        if REQUEST_LINE.match(line):
                            found.append(line)
        return found

    def wait(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("upstream recorder: condition not reached")
                self.cond.wait(left)

    def wait_raw(self, needle: bytes, timeout: float = 5.0) -> UpConn:
        self.wait(lambda: any(needle in c.raw for c in self.conns), timeout)
        with self.cond:
            return next(c for c in self.conns if needle in c.raw)

    def close(self) -> None:
        self.listener.close()
        with self.cond:
            for sock in self.socks:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


# --------------------------------------------------------------------------------------
# Raw-socket client
# --------------------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json_error(self) -> dict:
        assert self.headers.get(b"content-type") == b"application/json", self.headers
        payload = json.loads(self.body)
        assert set(payload) == {"error"}, payload
        err = payload["error"]
        assert set(err) == {"code", "message"}, payload
        assert isinstance(err["code"], str) and err["code"], payload
        assert isinstance(err["message"], str) and err["message"], payload
        return err


@dataclass
class Outcome:
    responses: list[Response]
    rest: bytes  # bytes after the last complete response
    eof: bool  # the proxy closed with FIN
    reset: bool  # the proxy reset the connection


def parse_responses(data: bytes) -> tuple[list[Response], bytes]:
    out = []
    while True:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return out, data
        lines = data[:end].split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get(b"content-length", b"0"))
        if status < 200:
            data = data[end + 4:]
            continue
        if len(data) < end + 4 + length:
            return out, data
        out.append(Response(status, headers, data[end + 4:end + 4 + length]))
        data = data[end + 4 + length:]


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_close(sock: socket.socket, timeout: float = 5.0) -> Outcome:
    sock.settimeout(timeout)
    data = bytearray()
    eof = reset = False
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            reset = True
            break
        except TimeoutError:
            break
        if not chunk:
            eof = True
            break
        data += chunk
    responses, rest = parse_responses(bytes(data))
    return Outcome(responses, rest, eof, reset)


def read_responses(sock: socket.socket, count: int, timeout: float = 5.0) -> list[Response]:
    """Read exactly `count` complete responses without waiting for the close."""
    sock.settimeout(timeout)
    data = b""
    while True:
        responses, _ = parse_responses(data)
        if len(responses) >= count:
            return responses
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed after {len(responses)} responses: {data!r}")
        data += chunk


def send_and_close(port: int, *parts: bytes, between: Callable[[], None] | None = None) -> Outcome:
    """Send the parts (calling `between` after each but the last), then read to EOF."""
    with connect(port) as sock:
        for i, part in enumerate(parts):
            sock.sendall(part)
            if between is not None and i < len(parts) - 1:
                between()
        return read_until_close(sock)


def assert_rejected(out: Outcome, status: int, responses_before: int = 0) -> Response:
    assert not out.reset, f"connection reset instead of a clean close: {out}"
    assert len(out.responses) == responses_before + 1, out
    resp = out.responses[-1]
    assert resp.status == status, out
    assert resp.headers.get(b"connection") == b"close", resp.headers
    assert resp.json_error()["code"] == CODES[status], resp
    assert out.rest == b"", out
    assert out.eof, f"no EOF after the error response: {out}"
    return resp


# --------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream() -> Iterator[Recorder]:
    rec = Recorder()
    yield rec
    rec.close()


def _launch(path: Path, body: str) -> Proxy:
    """What conftest's start_proxy does, for a proxy shared by the module (speed)."""
    port = free_port()
    path.write_text(f'[[listeners]]\nname = "test"\naddress = "127.0.0.1:{port}"\n' + body)
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(path)])
    try:
        wait_port("127.0.0.1", port, proc=proc)
    except BaseException:
        stop_process(proc)
        raise
    return Proxy(proc, port, path)


@pytest.fixture(scope="module")
def proxy(upstream: Recorder, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """One proxy for the table-driven cases, with small limits."""
    cfg = simple_config(upstream.port, http=HTTP_LIMITS)
    p = _launch(tmp_path_factory.mktemp("wire") / "aiproxy.toml", cfg)
    yield p
    log = stop_process(p.proc)
    assert not any(m in log for m in CRASH_MARKERS), log


@pytest.fixture
def rec(upstream: Recorder, proxy: Proxy) -> Iterator[Recorder]:
    """The recorder, emptied; after the test the shared proxy's log must show no crash."""
    upstream.reset()
    yield upstream
    log = process_log(proxy.proc)
    assert proxy.proc.poll() is None, f"proxy exited\n{log}"
    assert not any(m in log for m in CRASH_MARKERS), log


_sentinels = iter(range(1_000_000))


def sentinel(port: int, rec: Recorder) -> UpRequest:
    """A valid request on a fresh connection: the proxy still works, and the upstream
    saw it (the proxy answers only after the upstream did)."""
    target = b"/__sentinel/%d" % next(_sentinels)
    with connect(port) as sock:
        sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: sentinel\r\nConnection: close\r\n\r\n")
        out = read_until_close(sock)
    assert [r.status for r in out.responses] == [200], out
    assert out.responses[0].body == b"ok"
    matches = [r for r in rec.requests() if r.target == target]
    assert len(matches) == 1
    return matches[0]


def assert_upstream_saw_only_sentinels(rec: Recorder) -> None:
    """Nothing but sentinel requests reached the upstream: zero bytes of anything else."""
    reqs = rec.requests()
    others = [r for r in reqs if not r.target.startswith(b"/__sentinel/")]
    assert others == [], others
    assert len(rec.raw()) == sum(len(r.raw) for r in reqs), rec.raw()
    assert all(c.malformed is None for c in rec.touched())


def assert_nothing_smuggled(rec: Recorder, smuggled: bytes = b"/admin") -> None:
    """For requests bad only in the body: the upstream may have the head, but never a
    complete request other than the sentinels, and never the hidden request."""
    others = [r for r in rec.requests() if not r.target.startswith(b"/__sentinel/")]
    assert others == [], others
    assert smuggled not in rec.raw()
    assert not any(smuggled in line for line in rec.request_lines()), rec.request_lines()
    # A connection that got part of the rejected request is closed, not reused.
    partial = [c for c in rec.touched() if c.pending]
    rec.wait(lambda: all(c.closed for c in partial))


# --------------------------------------------------------------------------------------
# Requests rejected on their head: nothing reaches the upstream
# --------------------------------------------------------------------------------------

H = b"Host: example.test\r\n"
SMUGGLED = b"GET /admin HTTP/1.1\r\nHost: example.test\r\n\r\n"


def _post(fields: bytes, body: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return b"POST /submit " + version + b"\r\n" + H + fields + b"\r\n" + body


HEAD_REJECTS = {
    # -- Content-Length and Transfer-Encoding together (RFC 9112 6.1, 6.3) --
    "cl-then-te": (
        400, _post(b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\nG")),
    "te-then-cl": (
        400, _post(b"Transfer-Encoding: chunked\r\nContent-Length: 6\r\n", b"0\r\n\r\nG")),
    "te-odd-case-with-cl": (
        400, _post(b"Content-Length: 6\r\nTransfer-Encoding: ChUnKeD\r\n", b"0\r\n\r\nG")),
    "te-leading-space-with-cl": (
        400, _post(b"Content-Length: 6\r\nTransfer-Encoding:   chunked\r\n", b"0\r\n\r\nG")),
    "te-tab-with-cl": (
        400, _post(b"Content-Length: 6\r\nTransfer-Encoding:\tchunked\r\n", b"0\r\n\r\nG")),
    "cl-te-second-te-field": (
        400, _post(b"Content-Length: 6\r\nTransfer-Encoding: identity\r\n"
                   b"Transfer-Encoding: chunked\r\n", b"0\r\n\r\nG")),
    # -- Content-Length values (RFC 9110 8.6) --
    "cl-duplicate-differing": (
        400, _post(b"Content-Length: 5\r\nContent-Length: 6\r\n", b"hello!")),
    "cl-list-differing": (400, _post(b"Content-Length: 5, 6\r\n", b"hello!")),
    "cl-plus-sign": (400, _post(b"Content-Length: +5\r\n", b"hello")),
    "cl-minus-sign": (400, _post(b"Content-Length: -5\r\n", b"hello")),
    "cl-hex": (400, _post(b"Content-Length: 0x5\r\n", b"hello")),
    "cl-space-inside": (400, _post(b"Content-Length: 1 5\r\n", b"hello")),
    "cl-empty": (400, _post(b"Content-Length: \r\n", b"hello")),
    "cl-overflows-int64": (400, _post(b"Content-Length: 99999999999999999999\r\n", b"hello")),
    # -- Transfer-Encoding values (RFC 9112 6.1, 6.3) --
    "te-chunked-then-identity": (
        400, _post(b"Transfer-Encoding: chunked, identity\r\n", b"0\r\n\r\n")),
    "te-identity-alone": (400, _post(b"Transfer-Encoding: identity\r\n", b"hello")),
    "te-chunked-twice": (400, _post(b"Transfer-Encoding: chunked, chunked\r\n", b"0\r\n\r\n")),
    "te-xchunked": (400, _post(b"Transfer-Encoding: xchunked\r\n", b"0\r\n\r\n")),
    "te-chunked-then-cow-field": (
        400, _post(b"Transfer-Encoding: chunked\r\nTransfer-Encoding: cow\r\n", b"0\r\n\r\n")),
    "te-empty": (400, _post(b"Transfer-Encoding: \r\n", b"0\r\n\r\n")),
    "te-gzip-chunked": (501, _post(b"Transfer-Encoding: gzip, chunked\r\n", b"0\r\n\r\n")),
    "te-chunked-in-http10": (
        400, _post(b"Transfer-Encoding: chunked\r\n", b"0\r\n\r\n", b"HTTP/1.0")),
    # -- field syntax (RFC 9112 5) --
    "obs-fold": (400, b"GET / HTTP/1.1\r\n" + H + b"X-Long: a\r\n  b\r\n\r\n"),
    "obs-fold-tab-te": (
        400, _post(b"Transfer-Encoding: identity\r\n\tchunked\r\n", b"0\r\n\r\n")),
    "space-before-colon": (400, b"GET / HTTP/1.1\r\nHost : example.test\r\n\r\n"),
    "space-before-colon-te": (400, _post(b"Transfer-Encoding : chunked\r\n", b"0\r\n\r\n")),
    "tab-before-colon-cl": (400, _post(b"Content-Length\t: 5\r\n", b"hello")),
    "space-in-name": (400, b"GET / HTTP/1.1\r\n" + H + b"X Forwarded: a\r\n\r\n"),
    "leading-space-first-field": (400, b"GET / HTTP/1.1\r\n Host: example.test\r\n\r\n"),
    "empty-name": (400, b"GET / HTTP/1.1\r\n" + H + b": value\r\n\r\n"),
    "nul-in-value": (400, b"GET / HTTP/1.1\r\n" + H + b"X-A: a\x00b\r\n\r\n"),
    "cr-in-value": (400, b"GET / HTTP/1.1\r\n" + H + b"X-A: a\rb\r\n\r\n"),
    "del-in-value": (400, b"GET / HTTP/1.1\r\n" + H + b"X-A: a\x7fb\r\n\r\n"),
    "ctl-in-value": (400, b"GET / HTTP/1.1\r\n" + H + b"X-A: a\x0bb\r\n\r\n"),
    "bare-lf-everywhere": (400, b"GET / HTTP/1.1\nHost: example.test\n\n"),
    "bare-lf-after-field": (400, b"GET / HTTP/1.1\r\nHost: example.test\nX-A: b\r\n\r\n"),
    "bare-lf-ends-head": (400, b"GET / HTTP/1.1\r\nHost: example.test\r\n\n"),
    "bare-cr-ends-line": (400, b"GET / HTTP/1.1\r\nHost: example.test\rX-A: b\r\n\r\n"),
    "bare-cr-ends-head": (400, b"GET / HTTP/1.1\r\nHost: example.test\r\n\rX"),
    "bare-cr-request-line": (400, b"GET / HTTP/1.1\rHost: example.test\r\n\r\n"),
    # -- Host (RFC 9112 3.2) --
    "missing-host": (400, b"GET / HTTP/1.1\r\nX-A: b\r\n\r\n"),
    "duplicate-host": (400, b"GET / HTTP/1.1\r\n" + H + b"Host: other.test\r\n\r\n"),
    "duplicate-host-same": (400, b"GET / HTTP/1.1\r\n" + H + H + b"\r\n"),
    "host-with-space": (400, b"GET / HTTP/1.1\r\nHost: exa mple.test\r\n\r\n"),
    "host-with-slash": (400, b"GET / HTTP/1.1\r\nHost: example.test/admin\r\n\r\n"),
    "host-with-userinfo": (400, b"GET / HTTP/1.1\r\nHost: user@example.test\r\n\r\n"),
    # Host = uri-host [ ":" port ] (RFC 9112 3.2, RFC 3986 3.2.2): not just its characters.
    "host-port-not-digits": (400, b"GET / HTTP/1.1\r\nHost: example.test:8x\r\n\r\n"),
    "host-two-ports": (400, b"GET / HTTP/1.1\r\nHost: example.test:1:2\r\n\r\n"),
    "host-port-only": (400, b"GET / HTTP/1.1\r\nHost: :80\r\n\r\n"),
    "host-unclosed-ipv6": (400, b"GET / HTTP/1.1\r\nHost: [::1\r\n\r\n"),
    "host-ipv6-without-brackets-closed": (400, b"GET / HTTP/1.1\r\nHost: a]b[\r\n\r\n"),
    "host-bad-percent": (400, b"GET / HTTP/1.1\r\nHost: %zz\r\n\r\n"),
    "absolute-target-port-not-digits": (
        400, b"GET http://example.test:xx/ HTTP/1.1\r\n" + H + b"\r\n"),
    "absolute-target-unclosed-ipv6": (400, b"GET http://[::1/ HTTP/1.1\r\n" + H + b"\r\n"),
    # -- request line (RFC 9112 3) --
    "trailing-space-request-line": (400, b"GET / HTTP/1.1 \r\n" + H + b"\r\n"),
    "fragment-in-target": (400, b"GET /page#frag HTTP/1.1\r\n" + H + b"\r\n"),
    "fragment-in-absolute-target": (
        400, b"GET http://example.test/page#frag HTTP/1.1\r\n" + H + b"\r\n"),
    "absolute-target-with-userinfo": (
        400, b"GET http://user@example.test/ HTTP/1.1\r\n" + H + b"\r\n"),
    # The authority of an absolute-form target replaces Host, so it gets Host's checks.
    "absolute-target-empty-authority": (400, b"GET http:///path HTTP/1.1\r\n" + H + b"\r\n"),
    "absolute-target-backslash": (
        400, b"GET http://good.test\\evil.test/ HTTP/1.1\r\n" + H + b"\r\n"),
    "absolute-target-quote": (400, b"GET http://bad\"host/ HTTP/1.1\r\n" + H + b"\r\n"),
    "absolute-target-braces": (400, b"GET http://{bad}/ HTTP/1.1\r\n" + H + b"\r\n"),
    "absolute-target-with-invalid-host-field": (
        400, b"GET http://good.test/ HTTP/1.1\r\nHost: bad host\r\n\r\n"),
    "target-not-origin-or-absolute": (400, b"GET admin HTTP/1.1\r\n" + H + b"\r\n"),
    "ctl-in-target": (400, b"GET /a\x01b HTTP/1.1\r\n" + H + b"\r\n"),
    "method-with-paren": (400, b"G(T / HTTP/1.1\r\n" + H + b"\r\n"),
    "method-with-nul": (400, b"G\x00T / HTTP/1.1\r\n" + H + b"\r\n"),
    "method-tab-separator": (400, b"GET\t/ HTTP/1.1\r\n" + H + b"\r\n"),
    "double-space-in-request-line": (400, b"GET  / HTTP/1.1\r\n" + H + b"\r\n"),
    "http09-request-line": (400, b"GET /\r\n\r\n"),
    "lowercase-version": (400, b"GET / http/1.1\r\n" + H + b"\r\n"),
    "http2-request-line": (505, b"GET / HTTP/2.0\r\n" + H + b"\r\n"),
    "h2-preface": (505, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    "http3-request-line": (505, b"GET / HTTP/3.0\r\n" + H + b"\r\n"),
    "request-line-too-long": (414, b"GET /" + b"a" * (MAX_LINE + 10) + b" HTTP/1.1\r\n" + H + b"\r\n"),
    # -- limits --
    "header-section-too-large": (
        431, b"GET / HTTP/1.1\r\n" + H
        + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"v" * 200) for i in range(25)) + b"\r\n"),
    "one-field-too-large": (
        431, b"GET / HTTP/1.1\r\n" + H + b"X-Big: " + b"v" * MAX_HEADER_BYTES + b"\r\n\r\n"),
    "too-many-fields": (
        431, b"GET / HTTP/1.1\r\n" + H
        + b"".join(b"X-F%d: 1\r\n" % i for i in range(MAX_HEADERS)) + b"\r\n"),
    "content-length-over-max-body": (
        413, _post(b"Content-Length: %d\r\n" % (MAX_BODY + 1), b"x" * (MAX_BODY + 1))),
    "content-length-huge": (413, _post(b"Content-Length: 99999999999\r\n", b"x" * 100)),
    # -- expectations (RFC 9110 10.1.1) --
    "expect-unknown": (417, b"GET / HTTP/1.1\r\n" + H + b"Expect: something-else\r\n\r\n"),
    "expect-unknown-with-body": (
        417, _post(b"Expect: 100-continue-please\r\nContent-Length: 5\r\n", b"hello")),
    # -- classic smuggling payloads: all carry both framings, so all are rejected --
    "smuggle-cl-te": (
        400, _post(b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n"
                   % len(b"0\r\n\r\n" + SMUGGLED), b"0\r\n\r\n" + SMUGGLED)),
    "smuggle-te-cl": (
        400, _post(b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
                   b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED))),
    "smuggle-te-te-obfuscated": (
        400, _post(b"Transfer-Encoding: chunked\r\nTransfer-encoding: x\r\nContent-Length: 4\r\n",
                   b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED))),
    "smuggle-cl-cl": (
        400, _post(b"Content-Length: 0\r\nContent-Length: %d\r\n" % len(SMUGGLED), SMUGGLED)),
}


@pytest.mark.parametrize("status,payload", HEAD_REJECTS.values(), ids=HEAD_REJECTS.keys())
def test_head_rejected_and_nothing_forwarded(proxy: Proxy, rec: Recorder, status: int,
                                             payload: bytes) -> None:
    out = send_and_close(proxy.port, payload)
    assert_rejected(out, status)
    sentinel(proxy.port, rec)
    assert_upstream_saw_only_sentinels(rec)
    assert not any(b"/admin" in line for line in rec.request_lines())


@pytest.mark.parametrize("status,payload", HEAD_REJECTS.values(), ids=HEAD_REJECTS.keys())
def test_head_rejected_when_split_across_reads(proxy: Proxy, rec: Recorder, status: int,
                                               payload: bytes) -> None:
    """The same shapes arriving in two TCP reads (the parser sees a prefix first)."""
    mid = len(payload) // 2
    out = send_and_close(proxy.port, payload[:mid], payload[mid:],
                         between=lambda: time.sleep(0.02))
    assert_rejected(out, status)
    sentinel(proxy.port, rec)
    assert_upstream_saw_only_sentinels(rec)


@pytest.mark.parametrize(
    "status,prefix,filler",
    [(414, b"GET /", b"a"), (431, b"GET / HTTP/1.1\r\n" + H + b"X-Endless: ", b"v"),
     (431, b"GET / HTTP/1.1\r\n" + H + b"X-Endless-Name", b"n")],
    ids=["request-line", "field-value", "field-name"],
)
def test_limit_enforced_before_the_line_ends(proxy: Proxy, rec: Recorder, status: int,
                                             prefix: bytes, filler: bytes) -> None:
    """A line that never ends is rejected once it passes the limit, not buffered forever."""
    with connect(proxy.port) as sock:
        sock.sendall(prefix)
        for _ in range(6):
            time.sleep(0.01)
            try:
                sock.sendall(filler * 1000)
            except OSError:
                break
        out = read_until_close(sock, timeout=3)
    assert_rejected(out, status)
    sentinel(proxy.port, rec)
    assert_upstream_saw_only_sentinels(rec)


@pytest.mark.parametrize(
    "status,head",
    [(413, _post(b"Content-Length: 1048576\r\n")),
     (400, _post(b"Content-Length: 1048576\r\nTransfer-Encoding: chunked\r\n")),
     (431, b"GET / HTTP/1.1\r\n" + H + b"X-Big: " + b"v" * MAX_HEADER_BYTES)],
    ids=["content-length-over-max-body", "cl-te", "header-too-large"],
)
def test_rejected_while_client_still_sends(proxy: Proxy, rec: Recorder, status: int,
                                           head: bytes) -> None:
    """The client keeps sending after the proxy has decided: the error response must
    survive (the proxy drains instead of closing with unread input, which sends RST)."""
    with connect(proxy.port) as sock:
        sock.sendall(head)
        time.sleep(0.05)  # the proxy has answered by now; this is all unread input
        sock.sendall(b"x" * 1048576)
        out = read_until_close(sock)
    assert_rejected(out, status)
    sentinel(proxy.port, rec)
    assert_upstream_saw_only_sentinels(rec)


def test_expect_unknown_in_earlier_field(proxy: Proxy, rec: Recorder) -> None:
    out = send_and_close(proxy.port, b"GET / HTTP/1.1\r\n" + H + b"Expect: something-else\r\n"
                         b"Expect: 100-continue\r\nConnection: close\r\n\r\n")
    assert_rejected(out, 417)
    sentinel(proxy.port, rec)
    assert_upstream_saw_only_sentinels(rec)


def test_expect_unknown_in_list(proxy: Proxy, rec: Recorder) -> None:
    out = send_and_close(proxy.port, b"GET / HTTP/1.1\r\n" + H
                         + b"Expect: something-else, 100-continue\r\n\r\n")
    assert_rejected(out, 417)
    sentinel(proxy.port, rec)
    assert_upstream_saw_only_sentinels(rec)


@pytest.mark.parametrize("value", [b"100-continue, 100-continue", b"100-continue,",
                                   b", 100-continue", b"100-Continue ,,"])
def test_expect_100_continue_as_a_list(proxy: Proxy, rec: Recorder, value: bytes) -> None:
    """Expect is a list (RFC 9110 10.1.1, #expectation): a recipient must ignore empty
    elements (5.6.1), and the same expectation twice is still only 100-continue, so the
    client gets its 100 (Continue), not a 417."""
    with connect(proxy.port) as sock:
        sock.sendall(_post(b"Expect: " + value + b"\r\nContent-Length: 5\r\n", b""))
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(b"hello")
        [resp] = read_responses(sock, 1)
    assert (resp.status, resp.body) == (200, b"ok")
    [req] = rec.requests()
    assert req.body == b"hello" and req.header(b"expect") == []


def test_header_limits_are_exact(proxy: Proxy, rec: Recorder) -> None:
    """max_headers fields pass (431 is only for more); so does a line at max length."""
    fields = b"".join(b"X-F%d: 1\r\n" % i for i in range(MAX_HEADERS - 1))
    with connect(proxy.port) as sock:
        sock.sendall(b"GET /many HTTP/1.1\r\n" + H + fields + b"\r\n")
        [resp] = read_responses(sock, 1)
    assert resp.status == 200
    [req] = rec.requests()
    assert req.target == b"/many"
    assert len(req.header(b"x-f0")) == 1


# --------------------------------------------------------------------------------------
# Requests bad only in the chunked body: the head may reach the upstream, a request never
# --------------------------------------------------------------------------------------


def _chunked(body: bytes) -> bytes:
    return b"POST /upload HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n" + body


BODY_REJECTS = {
    "chunk-size-zz": (400, b"zz\r\n" + SMUGGLED + b"\r\n0\r\n\r\n"),
    "chunk-size-negative": (400, b"-1\r\n" + SMUGGLED + b"\r\n0\r\n\r\n"),
    "chunk-size-17-hex-digits": (400, b"1" + b"0" * 16 + b"\r\n" + SMUGGLED + b"\r\n0\r\n\r\n"),
    "chunk-size-zeros-then-17-hex-digits": (
        400, b"0" * 8 + b"1" + b"0" * 16 + b"\r\n" + SMUGGLED + b"\r\n0\r\n\r\n"),
    "chunk-size-line-of-zeros": (400, b"0" * 5000 + b"5\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    "chunk-size-0x-prefix": (400, b"0x5\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    "chunk-size-space-then-junk": (400, b"5 x\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    "chunk-size-empty": (400, b"\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    "chunk-data-longer-than-size": (400, b"3\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    "chunk-data-missing-crlf": (400, b"5\r\nhello0\r\n\r\n" + SMUGGLED),
    "chunk-size-bare-lf": (400, b"5\nhello\r\n0\r\n\r\n" + SMUGGLED),
    "chunk-data-bare-lf": (400, b"5\r\nhello\n0\r\n\r\n" + SMUGGLED),
    "last-chunk-bare-lf": (400, b"5\r\nhello\r\n0\n\n" + SMUGGLED),
    "last-chunk-bare-cr": (400, b"5\r\nhello\r\n0\r\r\n\r\n" + SMUGGLED),
    "chunk-ext-with-ctl": (400, b"5;a=\x01\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    # chunk-ext grammar (RFC 9112 7.1.1): ";" ext-name [ "=" token / quoted-string ]
    "chunk-ext-unterminated-quote": (400, b'5;a="open\r\nhello\r\n0\r\n\r\n' + SMUGGLED),
    "chunk-ext-empty-names": (400, b"5;;;\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    "chunk-ext-only-semicolon": (400, b"5 ;\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    "chunk-ext-no-name": (400, b"5; =v\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    "chunk-ext-no-value": (400, b"5;a=\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    "chunk-ext-space-in-value": (400, b"5;a=b c\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    "chunk-ext-junk-after-quote": (400, b'5;a="b"c\r\nhello\r\n0\r\n\r\n' + SMUGGLED),
    "trailer-obs-fold": (400, b"5\r\nhello\r\n0\r\nX-T: a\r\n b\r\n\r\n" + SMUGGLED),
    "chunk-size-plus-sign": (400, b"+5\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    # Bounded like a head: a size line or trailer section never buffered without end.
    "chunk-ext-too-long": (400, b"5;a=" + b"x" * 5000 + b"\r\nhello\r\n0\r\n\r\n" + SMUGGLED),
    "trailer-section-too-large": (
        431, b"5\r\nhello\r\n0\r\n"
        + b"".join(b"X-T%d: %s\r\n" % (i, b"v" * 100) for i in range(50)) + b"\r\n" + SMUGGLED),
}


@pytest.mark.parametrize("status,body", BODY_REJECTS.values(), ids=BODY_REJECTS.keys())
def test_chunked_body_rejected_in_one_write(proxy: Proxy, rec: Recorder, status: int,
                                            body: bytes) -> None:
    out = send_and_close(proxy.port, _chunked(body))
    assert_rejected(out, status)
    sentinel(proxy.port, rec)
    assert_nothing_smuggled(rec)


@pytest.mark.parametrize("status,body", BODY_REJECTS.values(), ids=BODY_REJECTS.keys())
def test_chunked_body_rejected_after_head_forwarded(proxy: Proxy, rec: Recorder, status: int,
                                                    body: bytes) -> None:
    """The head reaches the upstream first; the bad body arrives afterwards."""
    out = send_and_close(proxy.port, _chunked(b""), body,
                         between=lambda: rec.wait_raw(b"POST /upload "))
    assert_rejected(out, status)
    sentinel(proxy.port, rec)
    assert_nothing_smuggled(rec)


@pytest.mark.parametrize(
    "body",
    [b"5 ;e\r\nhello\r\n0\r\n\r\n", b"5 ;ext=1\r\nhello\r\n0\r\n\r\n",
     b"5;a=b;c=\"d e\"\r\nhello\r\n0\r\n\r\n", b"5\t;x\r\nhello\r\n0\r\nX-Trailer: t\r\n\r\n",
     b"00000000000005\r\nhello\r\n0\r\n\r\n", b"5 ; a = b ; c\r\nhello\r\n0\r\n\r\n",
     b'5;q="a\\"b\\\\c"\r\nhello\r\n0\r\n\r\n',
     b"000000000000000000005\r\nhello\r\n" + b"0" * 21 + b"\r\n\r\n"],
    ids=["ws-then-semicolon", "ws-then-extension", "extensions", "tab-ext-and-trailer",
         "leading-zeros", "bws-around-ext", "quoted-pairs", "leading-zeros-past-16"],
)
def test_chunked_body_accepted(proxy: Proxy, rec: Recorder, body: bytes) -> None:
    with connect(proxy.port) as sock:
        sock.sendall(_chunked(body))
        [resp] = read_responses(sock, 1)
    assert (resp.status, resp.body) == (200, b"ok")
    [req] = rec.requests()
    assert (req.method, req.target, req.body) == (b"POST", b"/upload", b"hello")
    assert req.header(b"transfer-encoding") == [b"chunked"]
    assert req.header(b"content-length") == []


def test_chunked_body_over_max_body(start_proxy: Callable[..., Proxy]) -> None:
    """A chunked body that grows past max_body_bytes after its head was forwarded: 413,
    the upstream connection is dropped (never reused), the rest never forwarded."""
    up = Recorder()
    try:
        p = start_proxy(simple_config(up.port, http=f"max_body_bytes = {MAX_BODY}"))
        first = b"200\r\n" + b"a" * 0x200 + b"\r\n"
        second = b"300\r\n" + b"b" * 0x300 + b"\r\n0\r\n\r\n" + SMUGGLED
        out = send_and_close(p.port, _chunked(first), second,
                             between=lambda: up.wait_raw(b"a" * 0x200))
        assert_rejected(out, 413)
        victim = next(c for c in up.touched() if b"POST /upload " in c.raw)
        up.wait(lambda: victim.closed)
        assert victim.requests == []
        assert b"b" * 16 not in up.raw()
        req = sentinel(p.port, up)
        served = [c for c in up.touched() if req in c.requests]
        assert [c.ident for c in served] != [victim.ident]  # not the dropped connection
        assert_nothing_smuggled(up)
    finally:
        up.close()


def test_chunked_body_over_max_body_in_one_write(proxy: Proxy, rec: Recorder) -> None:
    body = b"".join(b"100\r\n" + b"c" * 0x100 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n"
    out = send_and_close(proxy.port, _chunked(body + SMUGGLED))
    assert_rejected(out, 413)
    sentinel(proxy.port, rec)
    assert_nothing_smuggled(rec)


@pytest.mark.parametrize("size", [b"ffffffffffffffff", b"%x" % (MAX_BODY + 1)])
def test_chunk_larger_than_max_body_refused_at_its_size_line(proxy: Proxy, rec: Recorder,
                                                             size: bytes) -> None:
    """A chunk whose size line alone takes the body past max_body_bytes: 413 at the
    line (as nginx), not once max_body_bytes of it have been read and forwarded."""
    out = send_and_close(proxy.port, _chunked(size + b"\r\n0123456789"))
    assert_rejected(out, 413)
    assert b"0123456789" not in rec.raw()
    sentinel(proxy.port, rec)


def test_chunk_of_exactly_max_body_accepted(proxy: Proxy, rec: Recorder) -> None:
    with connect(proxy.port) as sock:
        sock.sendall(_chunked(b"%x\r\n" % MAX_BODY + b"x" * MAX_BODY + b"\r\n0\r\n\r\n"))
        [resp] = read_responses(sock, 1)
    assert resp.status == 200
    [req] = rec.requests()
    assert req.body == b"x" * MAX_BODY


# --------------------------------------------------------------------------------------
# Accepted shapes: framed and forwarded correctly
# --------------------------------------------------------------------------------------


def test_absolute_form_host_comes_from_target(proxy: Proxy, rec: Recorder) -> None:
    with connect(proxy.port) as sock:
        sock.sendall(b"GET http://other.test:8080/path?q=1 HTTP/1.1\r\n"
                     b"Host: wrong.test\r\n\r\n")
        [resp] = read_responses(sock, 1)
    assert (resp.status, resp.body) == (200, b"ok")
    [req] = rec.requests()
    assert req.target == b"/path?q=1"
    assert req.header(b"host") == [b"other.test:8080"]
    assert b"wrong.test" not in req.raw


@pytest.mark.parametrize("host", [
    b"example.test", b"example.test:8080", b"example.test:", b"127.0.0.1:80", b"[::1]",
    b"[::1]:8443", b"[v1.fe]", b"ex%41mple.test", b"a-b_c~d!$&'()*+,;=", b""])
def test_valid_host_forms_are_forwarded(proxy: Proxy, rec: Recorder, host: bytes) -> None:
    """Every form of RFC 3986 host [":" port] passes as it came, and so does an empty
    Host (RFC 9112 3.2: what a client sends when the target has no authority)."""
    with connect(proxy.port) as sock:
        sock.sendall(b"GET /h HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        [resp] = read_responses(sock, 1)
    assert (resp.status, resp.body) == (200, b"ok")
    [req] = rec.requests()
    assert req.header(b"host") == [host]


@pytest.mark.parametrize(
    "fields",
    [b"Content-Length: 5\r\nContent-Length: 5\r\n", b"Content-Length: 5, 5\r\n",
     b"Content-Length: 005\r\n", b"Content-Length: 0000000000000000000000005\r\n"],
    ids=["duplicate-identical", "list-identical", "leading-zeros", "many-leading-zeros"],
)
def test_content_length_forwarded_once(proxy: Proxy, rec: Recorder, fields: bytes) -> None:
    """Equivalent Content-Length forms are accepted and reach the upstream as exactly one
    canonical field, followed by a request that stays separate."""
    with connect(proxy.port) as sock:
        sock.sendall(_post(fields, b"hello") + b"GET /after HTTP/1.1\r\n" + H + b"\r\n")
        responses = read_responses(sock, 2)
    assert [(r.status, r.body) for r in responses] == [(200, b"ok"), (200, b"ok")]
    reqs = rec.requests()
    assert [(r.target, r.body) for r in reqs] == [(b"/submit", b"hello"), (b"/after", b"")]
    assert reqs[0].header(b"content-length") == [b"5"]


def test_connection_content_length_trick(proxy: Proxy, rec: Recorder) -> None:
    """`Connection: content-length` must not strip the framing field: the body stays the
    body, and what follows it is the next request."""
    with connect(proxy.port) as sock:
        sock.sendall(b"POST /cl-trick HTTP/1.1\r\n" + H + b"Connection: content-length\r\n"
                     b"Content-Length: 5\r\n\r\nhello"
                     b"GET /after HTTP/1.1\r\n" + H + b"\r\n")
        responses = read_responses(sock, 2)
    assert [(r.status, r.body) for r in responses] == [(200, b"ok"), (200, b"ok")]
    reqs = rec.requests()
    assert [(r.method, r.target) for r in reqs] == [(b"POST", b"/cl-trick"), (b"GET", b"/after")]
    assert reqs[0].header(b"content-length") == [b"5"]
    assert reqs[0].body == b"hello"
    assert reqs[0].header(b"connection") == []


def test_connection_host_trick(proxy: Proxy, rec: Recorder) -> None:
    with connect(proxy.port) as sock:
        sock.sendall(b"GET /host-trick HTTP/1.1\r\n" + H + b"Connection: host, x-drop\r\n"
                     b"X-Drop: 1\r\nX-Keep: 2\r\n\r\n")
        [resp] = read_responses(sock, 1)
    assert resp.status == 200
    [req] = rec.requests()
    assert req.header(b"host") == [b"example.test"]
    assert req.header(b"x-drop") == []  # named by Connection: hop-by-hop
    assert req.header(b"x-keep") == [b"2"]


def test_connection_transfer_encoding_trick(proxy: Proxy, rec: Recorder) -> None:
    with connect(proxy.port) as sock:
        sock.sendall(b"POST /te-trick HTTP/1.1\r\n" + H + b"Connection: transfer-encoding\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                     b"GET /after HTTP/1.1\r\n" + H + b"\r\n")
        responses = read_responses(sock, 2)
    assert [r.status for r in responses] == [200, 200]
    reqs = rec.requests()
    assert [(r.target, r.body) for r in reqs] == [(b"/te-trick", b"hello"), (b"/after", b"")]


def test_valid_pipeline_is_two_requests(proxy: Proxy, rec: Recorder) -> None:
    """A request after a complete chunked body is a real pipelined request, forwarded as
    its own request (not smuggled inside the first)."""
    with connect(proxy.port) as sock:
        sock.sendall(_chunked(b"5\r\nhello\r\n0\r\n\r\n") + b"GET /next HTTP/1.1\r\n" + H
                     + b"\r\n")
        responses = read_responses(sock, 2)
    assert [r.status for r in responses] == [200, 200]
    assert [(r.target, r.body) for r in rec.requests()] == [(b"/upload", b"hello"),
                                                              (b"/next", b"")]


# --------------------------------------------------------------------------------------
# Keep-alive: a good request, then a bad one on the same connection
# --------------------------------------------------------------------------------------

BAD_SECOND = {
    "duplicate-host": b"GET /second HTTP/1.1\r\n" + H + b"Host: other.test\r\n\r\n",
    "cl-te": _post(b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n"),
    "bare-lf": b"GET /second HTTP/1.1\nHost: example.test\n\n",
    "http2": b"GET /second HTTP/2.0\r\n" + H + b"\r\n",
}


@pytest.mark.parametrize("bad", BAD_SECOND.values(), ids=BAD_SECOND.keys())
def test_bad_request_after_good_on_keepalive(proxy: Proxy, rec: Recorder, bad: bytes) -> None:
    status = 505 if b"HTTP/2.0" in bad else 400
    with connect(proxy.port) as sock:
        sock.sendall(b"GET /first HTTP/1.1\r\n" + H + b"\r\n")
        [first] = read_responses(sock, 1)
        assert (first.status, first.body) == (200, b"ok")
        assert first.headers.get(b"connection") != b"close"
        sock.sendall(bad)
        out = read_until_close(sock)
    assert_rejected(out, status)
    last = sentinel(proxy.port, rec)
    # sorted: with workers the sentinel may reach the upstream through another process
    assert sorted(r.target for r in rec.requests()) == sorted([b"/first", last.target])
    assert b"/second" not in rec.raw() and b"/submit" not in rec.raw()


@pytest.mark.parametrize("bad", BAD_SECOND.values(), ids=BAD_SECOND.keys())
def test_bad_request_pipelined_after_good(proxy: Proxy, rec: Recorder, bad: bytes) -> None:
    status = 505 if b"HTTP/2.0" in bad else 400
    out = send_and_close(proxy.port, b"GET /first HTTP/1.1\r\n" + H + b"\r\n" + bad)
    assert_rejected(out, status, responses_before=1)
    assert (out.responses[0].status, out.responses[0].body) == (200, b"ok")
    assert [r.target for r in rec.requests()] == [b"/first"]
    assert b"/second" not in rec.raw() and b"/submit" not in rec.raw()


# --------------------------------------------------------------------------------------
# A local answer before the body: the body is never read as the next request
# --------------------------------------------------------------------------------------

API_ONLY = """
[http]
max_body_bytes = 1024

[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{port}"]

[[routes]]
name = "api"
match = {{ path_prefix = "/api" }}
cluster = "up"
"""

SMUGGLED_API = b"GET /api/admin HTTP/1.1\r\nHost: example.test\r\n\r\n"


def _raw_until_close(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("parts", [
    [b"POST /other HTTP/1.1\r\n" + H + b"Content-Length: %d\r\n\r\n" % len(SMUGGLED_API)
     + SMUGGLED_API],
    [b"POST /other HTTP/1.1\r\n" + H + b"Content-Length: %d\r\n\r\n" % len(SMUGGLED_API),
     SMUGGLED_API],
    [b"POST /other HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n",
     b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMUGGLED_API), SMUGGLED_API)],
    [b"POST /other HTTP/1.1\r\n" + H + b"Expect: 100-continue\r\n"
     b"Content-Length: %d\r\n\r\n" % len(SMUGGLED_API), SMUGGLED_API],
], ids=["length-one-write", "length-later", "chunked-later", "expect-100-continue"])
def test_local_answer_before_the_body_closes(start_proxy: Callable[..., Proxy],
                                             parts: list[bytes]) -> None:
    """A 404 (no route) answered from the head alone: the body, unread, holds what looks
    like a request for a routed path. It must not be taken as the next request: one
    response with `Connection: close`, then EOF, and nothing reaches the upstream. With
    `Expect: 100-continue` no 100 goes out first (RFC 9110 10.1.1: the final answer
    instead of it)."""
    up = Recorder()
    try:
        p = start_proxy(API_ONLY.format(port=up.port))
        with connect(p.port) as sock:
            for part in parts:
                sock.sendall(part)
                time.sleep(0.05)  # the second part, if any, comes after the answer
            data = _raw_until_close(sock)
        assert data.startswith(b"HTTP/1.1 404 "), data
        responses, rest = parse_responses(data)
        assert [r.status for r in responses] == [404] and rest == b"", data
        assert responses[0].headers.get(b"connection") == b"close"
        assert responses[0].json_error()["code"] == "no_route"
        assert up.raw() == b""
    finally:
        up.close()
