"""Rare request shapes at the HTTP/1.1 edge, each to its RFC: OPTIONS in absolute-form
(RFC 9112 3.2.4), Max-Forwards on OPTIONS and TRACE (RFC 9110 7.6.2), CONNECT and the
PRI method on an HTTP/1.1 connection, chunk sizes with leading zeros (RFC 9112 7.1).

One proxy (a real process) serves the module, in front of a recording HTTP/1.1
upstream (tests/test_wire_rejects.py's Recorder) and an HTTP/2 one (h2_support's
H2Upstream, which echoes what it got as JSON); clients are raw sockets and the h2
library."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.conftest import CRASH_MARKERS
from tests.h2_support import H2LibClient, H2Upstream
from tests.support import free_port, process_log, start_process, stop_process, wait_port
from tests.test_wire_rejects import (
    Recorder,
    assert_rejected,
    connect,
    read_responses,
    send_and_close,
)

pytestmark = pytest.mark.timeout(30)

H = b"Host: example.test\r\n"


@dataclass
class Edge:
    proc: object
    port: int  # HTTP/1.1
    h2c: int  # HTTP/2 with prior knowledge
    rec: Recorder
    h2up: H2Upstream


CONFIG = """
[[listeners]]
name = "h1"
address = "127.0.0.1:{port}"

[[listeners]]
name = "h2c"
address = "127.0.0.1:{h2c}"
protocols = ["h2c"]

[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{up}"]

[[clusters]]
name = "h2up"
endpoints = ["127.0.0.1:{h2up}"]
protocol = "h2"

[[routes]]
name = "h2up"
match = {{ host = "h2.test" }}
cluster = "h2up"

[[routes]]
name = "all"
cluster = "up"
"""


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    rec = Recorder()
    h2up = H2Upstream(name="h2-edge")
    port, h2c = free_port(), free_port()
    path = tmp_path_factory.mktemp("edges") / "aiproxy.toml"
    path.write_text(CONFIG.format(port=port, h2c=h2c, up=rec.port, h2up=h2up.port))
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(path)])
    try:
        wait_port("127.0.0.1", port, proc=proc)
        wait_port("127.0.0.1", h2c, proc=proc)
        yield Edge(proc, port, h2c, rec, h2up)
    finally:
        log = stop_process(proc)
        rec.close()
        h2up.stop()
    assert not any(m in log for m in CRASH_MARKERS), log


@pytest.fixture
def e(edge: Edge) -> Iterator[Edge]:
    """The shared proxy with the recorder emptied; afterwards its log shows no crash."""
    edge.rec.reset()
    yield edge
    log = process_log(edge.proc)
    assert edge.proc.poll() is None, f"proxy exited\n{log}"
    assert not any(m in log for m in CRASH_MARKERS), log


def exchange(port: int, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    with connect(port) as sock:
        sock.sendall(request)
        [resp] = read_responses(sock, 1)
    return resp.status, resp.headers, resp.body


# -- RFC 9112 3.2.4: OPTIONS in absolute-form with an empty path -------------------------


@pytest.mark.parametrize("target,sent", [
    (b"http://example.test:8080", b"*"),
    (b"HTTP://example.test", b"*"),
    (b"http://example.test:8080/", b"/"),
    (b"http://example.test?x=1", b"/?x=1"),
    (b"http://example.test/p", b"/p"),
], ids=["empty-path", "empty-path-upper-scheme", "slash", "query", "path"])
def test_options_absolute_form_target_upstream(e: Edge, target: bytes, sent: bytes) -> None:
    """An empty path with no query goes on as `*` (the server itself), anything else as
    its origin-form; the authority becomes Host either way."""
    status, _, body = exchange(e.port, b"OPTIONS " + target + b" HTTP/1.1\r\n" + H + b"\r\n")
    assert (status, body) == (200, b"ok")
    [req] = e.rec.requests()
    assert (req.method, req.target) == (b"OPTIONS", sent)
    authority = target.split(b"//", 1)[1].split(b"/", 1)[0].split(b"?", 1)[0]
    assert req.header(b"host") == [authority]


def test_get_absolute_form_empty_path_stays_slash(e: Edge) -> None:
    status, _, _ = exchange(e.port, b"GET http://example.test:8080 HTTP/1.1\r\n" + H + b"\r\n")
    assert status == 200
    [req] = e.rec.requests()
    assert req.target == b"/"


def test_options_absolute_form_empty_path_to_h2_upstream(e: Edge) -> None:
    status, _, body = exchange(e.port, b"OPTIONS http://h2.test HTTP/1.1\r\nHost: h2.test\r\n\r\n")
    assert status == 200, body
    doc = json.loads(body)
    assert (doc["method"], doc["path"], doc["authority"]) == ("OPTIONS", "*", "h2.test")


def test_options_asterisk_to_h2_upstream(e: Edge) -> None:
    status, _, body = exchange(e.port, b"OPTIONS * HTTP/1.1\r\nHost: h2.test\r\n\r\n")
    assert status == 200, body
    assert json.loads(body)["path"] == "*"


# -- RFC 9110 7.6.2: Max-Forwards on OPTIONS and TRACE -----------------------------------

ALLOWED = {b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"TRACE", b"PATCH"}


def test_options_max_forwards_zero_answered_by_the_proxy(e: Edge) -> None:
    """The proxy is the final recipient: 200 with Allow, no body, nothing upstream, and
    the connection goes on."""
    with connect(e.port) as sock:
        sock.sendall(b"OPTIONS * HTTP/1.1\r\n" + H + b"Max-Forwards: 0\r\n\r\n"
                     b"OPTIONS /p HTTP/1.1\r\n" + H + b"Max-Forwards: 00\r\n\r\n"
                     b"GET /after HTTP/1.1\r\n" + H + b"\r\n")
        responses = read_responses(sock, 3)
    for resp in responses[:2]:
        assert (resp.status, resp.body) == (200, b""), resp
        assert resp.headers[b"content-length"] == b"0"
        assert {m.strip() for m in resp.headers[b"allow"].split(b",")} == ALLOWED
        assert b"via" not in resp.headers  # its own answer, not a forwarded one
        assert b"connection" not in resp.headers
    assert (responses[2].status, responses[2].body) == (200, b"ok")
    assert [r.target for r in e.rec.requests()] == [b"/after"]


def test_trace_max_forwards_zero_echoes_the_head_without_credentials(e: Edge) -> None:
    head = (b"TRACE /t?q=1 HTTP/1.1\r\n" + H + b"Max-Forwards: 0\r\n"
            b"Authorization: Bearer secret-1\r\nX-Keep: one\r\n"
            b"Proxy-Authorization: Basic secret-2\r\nCookie: session=secret-3\r\n"
            b"X-Api-Key: secret-4\r\nX-Other: two\r\n\r\n")
    status, headers, body = exchange(e.port, head)
    assert status == 200
    assert headers[b"content-type"] == b"message/http"
    assert body == (b"TRACE /t?q=1 HTTP/1.1\r\n" + H + b"Max-Forwards: 0\r\n"
                    b"X-Keep: one\r\nX-Other: two\r\n\r\n")
    assert e.rec.requests() == []


@pytest.mark.parametrize("method", [b"OPTIONS", b"TRACE"])
@pytest.mark.parametrize("value,sent", [
    (b"5", b"4"), (b"1", b"0"), (b"007", b"6"),
    (b"99999999999999999999999999", b"2147483647")])
def test_max_forwards_decremented_upstream(e: Edge, method: bytes, value: bytes,
                                           sent: bytes) -> None:
    status, _, _ = exchange(e.port, method + b" /mf HTTP/1.1\r\n" + H
                            + b"Max-Forwards: " + value + b"\r\n\r\n")
    assert status == 200
    [req] = e.rec.requests()
    assert (req.method, req.target) == (method, b"/mf")
    assert req.header(b"max-forwards") == [sent]


@pytest.mark.parametrize("method", [b"GET", b"POST", b"DELETE"])
def test_max_forwards_of_other_methods_untouched(e: Edge, method: bytes) -> None:
    status, _, _ = exchange(e.port, method + b" /mf HTTP/1.1\r\n" + H
                            + b"Content-Length: 0\r\nMax-Forwards: 0\r\n\r\n")
    assert status == 200
    [req] = e.rec.requests()
    assert req.header(b"max-forwards") == [b"0"]


@pytest.mark.parametrize("fields", [
    b"Max-Forwards: x\r\n", b"Max-Forwards: -1\r\n", b"Max-Forwards: 1.5\r\n",
    b"Max-Forwards: \r\n", b"Max-Forwards: 1, 1\r\n", b"Max-Forwards: 0x1\r\n",
    b"Max-Forwards: 1\r\nMax-Forwards: 1\r\n"],
    ids=["letters", "negative", "decimal-point", "empty", "list", "hex", "twice"])
@pytest.mark.parametrize("method", [b"OPTIONS", b"TRACE"])
def test_invalid_max_forwards_is_refused(e: Edge, method: bytes, fields: bytes) -> None:
    """Not 1*DIGIT: the proxy can neither tell whether it is the last hop nor forward
    an updated value (RFC 9110 7.6.2), so the request is refused, not passed on."""
    status, headers, body = exchange(e.port, method + b" /mf HTTP/1.1\r\n" + H + fields
                                     + b"\r\n")
    assert status == 400
    assert b"Max-Forwards" in body
    assert e.rec.requests() == []


def test_max_forwards_over_http2(e: Edge) -> None:
    with H2LibClient(e.h2c) as c:
        options = c.response(c.request("/o", [("max-forwards", "0")], method="OPTIONS"))
        trace = c.response(c.request("/t", [("max-forwards", "0"), ("cookie", "a=secret"),
                                            ("x-keep", "1")], method="TRACE"))
        forwarded = c.response(c.request("/f", [("max-forwards", "3")], method="OPTIONS"))
    assert options.status == 200 and options.body == b""
    assert {m.strip() for m in options.header(b"allow").split(b",")} == ALLOWED
    assert trace.status == 200
    assert trace.header(b"content-type") == b"message/http"
    assert trace.body == b"TRACE /t HTTP/2.0\r\nHost: test\r\nmax-forwards: 0\r\nx-keep: 1\r\n\r\n"
    assert forwarded.status == 200
    [req] = e.rec.requests()
    assert (req.method, req.target) == (b"OPTIONS", b"/f")
    assert req.header(b"max-forwards") == [b"2"]


# -- RFC 9113 3.4, 11.6: PRI is the HTTP/2 preface, not a request method -------------------


@pytest.mark.parametrize("request_bytes", [
    b"PRI / HTTP/1.1\r\n" + H + b"\r\n",
    b"PRI * HTTP/1.1\r\n" + H + b"\r\n",
    b"PRI * HTTP/1.0\r\n\r\nSM\r\n\r\n",
    b"PRI /x HTTP/1.1\r\n" + H + b"\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00",
], ids=["origin-form", "asterisk", "http10-preface-shape", "frames-behind"])
def test_pri_method_refused_and_closed(e: Edge, request_bytes: bytes) -> None:
    out = send_and_close(e.port, request_bytes)
    resp = assert_rejected(out, 400)  # Connection: close, JSON error, then a clean FIN
    assert "PRI" in resp.json_error()["message"]
    assert e.rec.requests() == [] and e.rec.raw() == b""


def test_pri_method_refused_over_http2(e: Edge) -> None:
    with H2LibClient(e.h2c) as c:
        resp = c.response(c.request("/x", method="PRI"))
        after = c.response(c.request("/after"))
    assert resp.status == 400
    assert b"PRI" in resp.body
    assert after.status == 200  # a stream error: the connection goes on
    assert [r.target for r in e.rec.requests()] == [b"/after"]


# -- TRACE on a route that adds request fields ----------------------------------------------


def test_trace_not_forwarded_where_the_route_adds_request_fields(start_proxy) -> None:
    """A route's request_headers_add may hold the upstream's credential (an API key the
    proxy injects): an upstream that implements TRACE would echo it to the client. Such
    a route answers TRACE 405 itself; other methods, and TRACE on other routes, go on."""
    rec = Recorder()
    try:
        proxy = start_proxy(f"""
[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{rec.port}"]

[[routes]]
name = "keyed"
match = {{ path_prefix = "/keyed" }}
cluster = "up"
request_headers_add = {{ authorization = "Bearer upstream-secret" }}

[[routes]]
name = "plain"
cluster = "up"
""")
        status, headers, body = exchange(proxy.port, b"TRACE /keyed/x HTTP/1.1\r\n" + H + b"\r\n")
        assert status == 405, body
        assert b"TRACE" not in headers[b"allow"] and b"GET" in headers[b"allow"]
        assert b"upstream-secret" not in body
        assert rec.requests() == []
        assert exchange(proxy.port, b"GET /keyed/x HTTP/1.1\r\n" + H + b"\r\n")[0] == 200
        assert exchange(proxy.port, b"TRACE /other HTTP/1.1\r\n" + H + b"\r\n")[0] == 200
        assert [(r.method, r.target) for r in rec.requests()] == [(b"GET", b"/keyed/x"),
                                                                  (b"TRACE", b"/other")]
        assert rec.requests()[0].header(b"authorization") == [b"Bearer upstream-secret"]
    finally:
        rec.close()
