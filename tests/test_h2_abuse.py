"""HTTP/2 protocol abuse against the proxy's h2c listener (RFC 9113 and known CVEs).

Frames are built by hand (tests/h2_support.py FrameClient, hyperframe, hpack) so they
can be wrong in exactly one way. Every case checks the answer RFC 9113 asks for
(GOAWAY or RST_STREAM with the right error code), and that the proxy keeps serving:
a fresh, well-behaved client still gets 200 afterwards."""

from __future__ import annotations

import json
import select
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from h2.errors import ErrorCodes
from hyperframe.frame import (
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from aiproxy.protocols.h2_budgets import CONTROL_BUDGET, UNSENT_ACKS_LIMIT
from aiproxy.protocols.h2_fast import FRAMES_PER_PASS
from aiproxy.protocols.h2_output import SILLY_WINDOW
from aiproxy.protocols.h2_server import RESET_BUDGET
from tests.h2_support import (
    PREFACE,
    FrameClient,
    H2LibClient,
    H2Response,
    H2Upstream,
    ProxyProc,
    RssMonitor,
    h2_get,
    raw_frame,
    wait_for,
)
from tests.support import stops_reading

pytestmark = pytest.mark.timeout(60)

MiB = 1024 * 1024
MAX_STREAMS = 8
MAX_HEADER_BYTES = 4096
# Frame types and flags (RFC 9113 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, END_HEADERS, PADDED = 0x1, 0x4, 0x8

CONFIG = """
[[listeners]]
name = "h2c"
address = "127.0.0.1:{port}"
protocols = ["h2c"]

[http]
h2_max_concurrent_streams = %d
max_header_bytes = %d

[[clusters]]
name = "demo"
endpoints = ["127.0.0.1:%d"]

[[routes]]
name = "all"
cluster = "demo"
"""


@pytest.fixture(scope="module")
def proxy(demo_upstream: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    p = ProxyProc(tmp_path_factory.mktemp("h2-abuse"),
                  CONFIG % (MAX_STREAMS, MAX_HEADER_BYTES, demo_upstream))
    yield p
    p.stop()


@pytest.fixture
def port(proxy: ProxyProc) -> Iterator[int]:
    """The listener's port; after the test, a fresh client must still be served."""
    yield proxy.ports["port"]
    assert proxy.proc.poll() is None, proxy.log()[-5000:]
    resp = h2_get(proxy.ports["port"], "/echo")
    assert resp.status == 200, resp


def block(c: FrameClient, path: str = "/echo", extra: list | None = None) -> bytes:
    return c.encode([(":method", "GET"), (":scheme", "http"), (":path", path),
                     (":authority", "test"), *(extra or [])])


def expect_goaway(c: FrameClient, code: int, timeout: float = 5.0) -> GoAwayFrame:
    frame = c.goaway(timeout)
    assert frame is not None, f"no GOAWAY (eof={c.eof})"
    assert frame.error_code == code, (ErrorCodes(frame.error_code), frame.additional_data)
    assert c.closed_after(3), "connection not closed after GOAWAY"
    return frame


def expect_reset(c: FrameClient, sid: int, codes: tuple[int, ...],
                 timeout: float = 5.0) -> RstStreamFrame:
    frames = c.frames_until(lambda f: f.stream_id == sid and isinstance(f, RstStreamFrame)
                            or isinstance(f, GoAwayFrame), timeout)
    assert frames, f"nothing on stream {sid} (eof={c.eof})"
    last = frames[-1]
    assert isinstance(last, RstStreamFrame), f"expected RST_STREAM on {sid}, got {last}"
    assert last.error_code in codes, ErrorCodes(last.error_code)
    c.stash += [f for f in frames[:-1] if f.stream_id not in (sid, 0)]  # for response()
    return last


# -- connection errors: one bad frame each ---------------------------------------------------


def _settings(*pairs: tuple[int, int]) -> bytes:
    return b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in pairs)


CONNECTION_ERRORS = {
    # name: (frame builder, expected GOAWAY code)
    "data_on_stream_0": (lambda c: raw_frame(DATA, 0, 0, b"x"), ErrorCodes.PROTOCOL_ERROR),
    "data_on_idle_stream": (lambda c: raw_frame(DATA, 0, 1, b"x"), ErrorCodes.PROTOCOL_ERROR),
    "headers_on_stream_0": (lambda c: raw_frame(HEADERS, END_HEADERS | END_STREAM, 0, block(c)),
                            ErrorCodes.PROTOCOL_ERROR),
    "headers_on_even_stream": (lambda c: raw_frame(HEADERS, END_HEADERS | END_STREAM, 2,
                                                   block(c)), ErrorCodes.PROTOCOL_ERROR),
    "headers_bad_padding": (lambda c: raw_frame(HEADERS, END_HEADERS | END_STREAM | PADDED, 1,
                                                bytes([200]) + block(c)),
                            ErrorCodes.PROTOCOL_ERROR),
    "hpack_garbage": (lambda c: raw_frame(HEADERS, END_HEADERS | END_STREAM, 1,
                                          b"\xff\xff\xff\xff\xff\xff"),
                      ErrorCodes.COMPRESSION_ERROR),
    "frame_over_max_frame_size": (lambda c: raw_frame(DATA, 0, 1, b"x" * 16385),
                                  ErrorCodes.FRAME_SIZE_ERROR),
    "settings_on_stream": (lambda c: raw_frame(SETTINGS, 0, 1, b""), ErrorCodes.PROTOCOL_ERROR),
    "settings_bad_length": (lambda c: raw_frame(SETTINGS, 0, 0, b"\x00\x03\x00"),
                            ErrorCodes.FRAME_SIZE_ERROR),
    "settings_ack_with_payload": (lambda c: raw_frame(SETTINGS, 1, 0, _settings((3, 10))),
                                  ErrorCodes.FRAME_SIZE_ERROR),
    "settings_enable_push_2": (lambda c: raw_frame(SETTINGS, 0, 0, _settings((2, 2))),
                               ErrorCodes.PROTOCOL_ERROR),
    "settings_initial_window_over_max": (lambda c: raw_frame(SETTINGS, 0, 0,
                                                             _settings((4, 2**31))),
                                         ErrorCodes.FLOW_CONTROL_ERROR),
    "settings_max_frame_size_too_small": (lambda c: raw_frame(SETTINGS, 0, 0,
                                                              _settings((5, 1000))),
                                          ErrorCodes.PROTOCOL_ERROR),
    "ping_bad_length": (lambda c: raw_frame(PING, 0, 0, b"1234"), ErrorCodes.FRAME_SIZE_ERROR),
    "ping_on_stream": (lambda c: raw_frame(PING, 0, 1, b"12345678"), ErrorCodes.PROTOCOL_ERROR),
    "rst_stream_on_stream_0": (lambda c: raw_frame(RST_STREAM, 0, 0, b"\x00\x00\x00\x08"),
                               ErrorCodes.PROTOCOL_ERROR),
    "rst_stream_on_idle_stream": (lambda c: raw_frame(RST_STREAM, 0, 1, b"\x00\x00\x00\x08"),
                                  ErrorCodes.PROTOCOL_ERROR),
    "rst_stream_bad_length": (lambda c: raw_frame(RST_STREAM, 0, 1, b"\x00\x08"),
                              ErrorCodes.FRAME_SIZE_ERROR),
    "goaway_on_stream": (lambda c: raw_frame(GOAWAY, 0, 1, bytes(8)), ErrorCodes.PROTOCOL_ERROR),
    "window_update_zero_on_connection": (lambda c: raw_frame(WINDOW_UPDATE, 0, 0, bytes(4)),
                                         ErrorCodes.PROTOCOL_ERROR),
    "window_update_overflow_on_connection": (
        lambda c: raw_frame(WINDOW_UPDATE, 0, 0, (2**31 - 1).to_bytes(4, "big")),
        ErrorCodes.FLOW_CONTROL_ERROR),
    "window_update_bad_length": (lambda c: raw_frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"),
                                 ErrorCodes.FRAME_SIZE_ERROR),
    "continuation_without_headers": (lambda c: raw_frame(CONTINUATION, END_HEADERS, 1, block(c)),
                                     ErrorCodes.PROTOCOL_ERROR),
    "push_promise_from_client": (lambda c: raw_frame(PUSH_PROMISE, END_HEADERS, 1,
                                                     (2).to_bytes(4, "big") + block(c)),
                                 ErrorCodes.PROTOCOL_ERROR),
}


# Known deviations of the h2 library, each with the RFC text it breaks.
XFAIL: dict[str, str] = {}


@pytest.mark.parametrize("case", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=XFAIL[name]))
    if name in XFAIL else name
    for name in sorted(CONNECTION_ERRORS)
])
def test_connection_error(port: int, case: str) -> None:
    build, code = CONNECTION_ERRORS[case]
    with FrameClient(port) as c:
        c.handshake()
        c.send(build(c))
        expect_goaway(c, code)


def test_stream_id_going_backwards(port: int) -> None:
    """RFC 9113 5.1.1: a new stream id lower than one already used is a connection error."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(5, "/echo"))
        assert c.response(5).status == 200
        c.send(c.request(3, "/echo"))
        expect_goaway(c, ErrorCodes.PROTOCOL_ERROR)


def test_unknown_frame_types_are_ignored(port: int) -> None:
    """RFC 9113 5.5: unknown frame types (on stream 0 and on a stream) are ignored."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(raw_frame(0xFA, 0xFF, 0, b"whatever"), c.request(1, "/echo", end_stream=False),
               raw_frame(0xFB, 0, 1, b"more"), raw_frame(DATA, END_STREAM, 1, b""))
        assert c.response(1).status == 200


# -- stream errors: the connection survives -------------------------------------------------


@pytest.mark.parametrize("frame,code", [
    # RFC 9113 6.9, 6.3, 5.3.1: stream errors (not the connection's end).
    (raw_frame(WINDOW_UPDATE, 0, 1, bytes(4)), ErrorCodes.PROTOCOL_ERROR),
    (raw_frame(WINDOW_UPDATE, 0, 1, b"\x80\0\0\0"), ErrorCodes.PROTOCOL_ERROR),
    (raw_frame(PRIORITY, 0, 1, b"\0\0\0\0"), ErrorCodes.FRAME_SIZE_ERROR),
    (raw_frame(PRIORITY, 0, 1, b"\0\0\0\0\x10\0"), ErrorCodes.FRAME_SIZE_ERROR),
    (raw_frame(PRIORITY, 0, 1, (1).to_bytes(4, "big") + b"\x10"), ErrorCodes.PROTOCOL_ERROR),
], ids=["window_update_zero", "window_update_zero_reserved_bit", "priority_short",
        "priority_long", "priority_on_itself"])
def test_stream_errors_leave_the_connection_serving(port: int, frame: bytes,
                                                     code: int) -> None:
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/delay/300"), frame)
        expect_reset(c, 1, (code,))
        c.send(c.request(3, "/echo"))
        assert c.response(3).status == 200


def test_headers_depending_on_their_own_stream_is_a_stream_error(port: int) -> None:
    """RFC 9113 5.3.1: a HEADERS frame whose priority makes its stream depend on itself
    is a stream error PROTOCOL_ERROR; the request is not served, the connection is."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/delay/300"))
        self_dependent = c.request(3, "/echo")
        self_dependent.flags.add("PRIORITY")
        self_dependent.depends_on, self_dependent.stream_weight = 3, 16
        c.send(self_dependent)
        expect_reset(c, 3, (ErrorCodes.PROTOCOL_ERROR,))
        assert c.response(1).status == 200
        c.send(c.request(5, "/echo"))
        assert c.response(5).status == 200


def test_stream_error_frames_on_idle_streams_are_dropped(port: int) -> None:
    """RFC 9113 6.4: no RST_STREAM for an idle stream: the frame is dropped."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(raw_frame(PRIORITY, 0, 5, b"\0\0"), raw_frame(PRIORITY, 0, 7, (7).to_bytes(4, "big") + b"\x10"),
               c.request(9, "/echo"))
        resp = c.response(9)
        assert resp.status == 200 and resp.reset is None
        assert not [f for f in c.stash if isinstance(f, (RstStreamFrame, GoAwayFrame))]


def test_window_overflow_on_stream_is_stream_error(port: int) -> None:
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/delay/500"),
               WindowUpdateFrame(1, window_increment=2**31 - 1))
        expect_reset(c, 1, (ErrorCodes.FLOW_CONTROL_ERROR,))
        c.send(c.request(3, "/echo"))
        assert c.response(3).status == 200


MALFORMED = {
    "uppercase_name": [("X-Upper", "1")],
    "connection": [("connection", "keep-alive")],
    "keep_alive": [("keep-alive", "timeout=5")],
    "proxy_connection": [("proxy-connection", "keep-alive")],
    "transfer_encoding": [("transfer-encoding", "chunked")],
    "upgrade": [("upgrade", "websocket")],
    "te_not_trailers": [("te", "gzip")],
    "pseudo_after_regular": [("x-a", "1"), (":path", "/again")],
    "unknown_pseudo": [(":protocol2", "x")],
    "name_with_space": [("x a", "1")],
    "value_with_newline": [("x-a", "1\r\nx-b: 2")],
    "authority_host_mismatch": [("host", "other.example")],
    # Fields HTTP/2 allows but HTTP/1.1 does not: the request goes upstream as HTTP/1.1.
    "name_not_a_token": [("x(a)", "1")],
    "value_with_control_byte": [("x-a", "a\x01b")],
    "value_with_del": [("x-a", "a\x7fb")],
}

# Pseudo-fields that would put something else than a request line and a Host field on
# the wire to an HTTP/1.1 upstream (RFC 9113 8.3.1, RFC 9110 9.1 and 4.2.1).
BAD_PSEUDO = {
    "path_with_space_and_version": {":path": "/x HTTP/1.0"},
    "path_with_tab": {":path": "/a\tb"},
    "path_with_control_byte": {":path": "/a\x01b"},
    "path_with_del": {":path": "/a\x7fb"},
    # Visible ASCII RFC 3986 does not allow in a URI and no browser or httpx sends
    # unencoded: an HTTP/1.1 request line with them is a 400 (RFC 9112 3.2), and the same
    # :path is malformed.
    **{f"path_with_{name}": {":path": f"/a{c}b"} for name, c in (
        ("quote", '"'), ("lt", "<"), ("gt", ">"))},
    "query_with_lt": {":path": "/echo?a=<>"},
    "method_with_tab": {":method": "GE\tT"},
    "method_not_a_token": {":method": "G(T"},
    "authority_with_space": {":authority": "a b"},
    "authority_with_userinfo": {":authority": "user@a"},
    "authority_with_slash": {":authority": "a/b"},
    "authority_empty": {":authority": ""},
    "authority_bad_port": {":authority": "a:8x"},
    "authority_unclosed_ipv6": {":authority": "[::1"},
    "scheme_not_a_scheme": {":scheme": "ht tp"},
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_request_rejected(port: int, demo_upstream: int, case: str) -> None:
    """RFC 9113 8.1.1/8.2: a malformed request is a stream error PROTOCOL_ERROR; it never
    reaches the upstream, and the connection's other streams go on (a connection error
    is allowed by 5.4.1, but would cost every stream the client has in flight)."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/delay/300"))
        c.send(c.headers(3, [(":method", "GET"), (":scheme", "http"), (":path", "/echo"),
                             (":authority", "test"), *MALFORMED[case]]))
        expect_reset(c, 3, (ErrorCodes.PROTOCOL_ERROR,))
        assert c.response(1).status == 200
        c.send(c.request(5, "/echo"))
        assert c.response(5).status == 200


MALFORMED_TRAILERS = {
    "pseudo_field": [(":path", "/x")],
    "connection_field": [("connection", "close")],
    "uppercase_name": [("X-Trailer", "1")],
}


@pytest.mark.parametrize("case", sorted(MALFORMED_TRAILERS))
def test_malformed_trailers_are_a_stream_error(port: int, case: str) -> None:
    """The same for a request whose trailers are malformed: its exchange, already under
    way, is cancelled; the other streams are not."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/delay/300"))
        c.send(c.request(3, "/echo", "POST", end_stream=False),
               raw_frame(DATA, 0, 3, b"abc"),
               c.headers(3, MALFORMED_TRAILERS[case]))
        expect_reset(c, 3, (ErrorCodes.PROTOCOL_ERROR,))
        assert c.response(1).status == 200
        c.send(c.request(5, "/echo"))
        assert c.response(5).status == 200


@pytest.mark.parametrize("case", sorted(MALFORMED_TRAILERS))
def test_malformed_trailers_after_the_response_are_a_stream_error(port: int,
                                                                  case: str) -> None:
    """The same once the response has ended (the upstream answered without reading the
    body: the stream is half-closed on the proxy's side, RFC 9113 8.1): the trailers end
    the stream, malformed, and that is still a stream error (8.1.1), not a GOAWAY taking
    the connection's other streams with it. The stream is closed both ways by then, so no
    RST_STREAM can follow (5.1)."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/delay/500"))
        c.send(c.request(3, "/status/200", "POST", end_stream=False),
               raw_frame(DATA, 0, 3, b"abc"))
        assert c.response(3).status == 200
        c.send(c.headers(3, MALFORMED_TRAILERS[case]))
        other = c.response(1)
        assert (other.goaway, other.reset, other.status) == (None, None, 200), other
        c.send(c.request(5, "/echo"))
        assert c.response(5).status == 200


@pytest.mark.parametrize("case", sorted(BAD_PSEUDO))
def test_request_that_is_not_http11_rejected(port: int, case: str) -> None:
    fields = {":method": "GET", ":scheme": "http", ":path": "/echo", ":authority": "test"}
    fields.update(BAD_PSEUDO[case])
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.headers(1, list(fields.items())))
        expect_reset(c, 1, (ErrorCodes.PROTOCOL_ERROR,))
        c.send(c.request(3, "/echo"))
        assert c.response(3).status == 200


def _echoed(resp: H2Response) -> dict:
    assert resp.status == 200, resp
    return json.loads(resp.body)


@pytest.mark.parametrize("shape", ["headers_end_stream", "data_then_trailers",
                                   "trailers_only"])
def test_body_shorter_than_content_length(port: int, shape: str) -> None:
    """RFC 9113 8.1.1: content-length says 10, the stream ends after fewer bytes.
    Forwarded with Content-Length: 10, the upstream connection would wait for bytes that
    the next request on it (another client's) then supplies: request smuggling."""
    with FrameClient(port) as c:
        c.handshake()
        head = c.request(1, "/echo", "POST", [("content-length", "10")],
                         end_stream=shape == "headers_end_stream")
        frames: list = [head]
        if shape == "data_then_trailers":
            frames.append(raw_frame(DATA, 0, 1, b"12345"))
        if shape != "headers_end_stream":
            frames.append(c.headers(1, [("x-trailer", "1")]))
        c.send(*frames)
        frames = c.frames_until(lambda f: isinstance(f, (RstStreamFrame, GoAwayFrame))
                                or (f.stream_id == 1 and "END_STREAM" in f.flags))
        last = frames[-1] if frames else None
        assert isinstance(last, (RstStreamFrame, GoAwayFrame)), frames
        assert last.error_code == ErrorCodes.PROTOCOL_ERROR
    # Requests after it (on any client connection) reach the upstream whole.
    for _ in range(3):
        echoed = _echoed(h2_get(port, "/echo?after"))
        assert (echoed["method"], echoed["path"], echoed["query"]) == ("GET", "/echo", "after")


def test_underscore_aliases_of_framing_fields_are_not_forwarded(port: int) -> None:
    """content_length, transfer_encoding, x_forwarded_for / _proto are valid names, but
    servers that map '-' and '_' alike (CGI/WSGI environ) read them as the fields the
    proxy frames and sets. They are dropped from an HTTP/1.1 request (h1.pyx); the same
    names over HTTP/2 must not reach the HTTP/1.1 upstream either."""
    aliases = [("transfer_encoding", "chunked"), ("content_length", "0"),
               ("x_forwarded_for", "6.6.6.6"), ("x-forwarded_proto", "https"),
               ("content-length", "5")]
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/echo", "POST", aliases, end_stream=False),
               raw_frame(DATA, END_STREAM, 1, b"hello"))
        echoed = _echoed(c.response(1))
    names = {n.replace("_", "-") for n in echoed["headers"] if "_" in n}
    assert not names, echoed["headers"]
    assert echoed["body_bytes"] == 5
    assert echoed["headers"]["x-forwarded-for"] == "127.0.0.1"


def test_connect_answered_501(port: int) -> None:
    """RFC 9113 8.5: a well-formed CONNECT (:method and :authority only) is a request
    like any other; the proxy does not tunnel, so it answers 501, as over HTTP/1.1."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.headers(1, [(":method", "CONNECT"), (":authority", "example.com:443")]))
        assert c.response(1).status == 501
        # With :path and :scheme it is malformed (a connection error is allowed, 5.4.1).
        c.send(c.headers(3, [(":method", "CONNECT"), (":authority", "example.com:443"),
                             (":path", "/"), (":scheme", "http")]))
        frames = c.frames_until(lambda f: isinstance(f, (RstStreamFrame, GoAwayFrame)))
        assert frames and frames[-1].error_code == ErrorCodes.PROTOCOL_ERROR, frames


def test_preface_must_be_followed_by_settings(port: int) -> None:
    """RFC 9113 3.4: the client preface ends with a SETTINGS frame."""
    with FrameClient(port) as c:
        c.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", PingFrame(0, opaque_data=b"12345678"))
        expect_goaway(c, ErrorCodes.PROTOCOL_ERROR)


@pytest.mark.parametrize("data", [b"GET / HTTP/1.1\r\nHost: test\r\n\r\n",
                                  b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\r"])
def test_invalid_preface_gets_goaway(port: int, data: bytes) -> None:
    """RFC 9113 3.4: an invalid client preface is a PROTOCOL_ERROR connection error;
    the GOAWAY (which it MAY omit, it used to) follows the server's SETTINGS."""
    with FrameClient(port) as c:
        c.send(data)
        frames = c.frames_until(lambda f: isinstance(f, GoAwayFrame))
        assert frames and isinstance(frames[0], SettingsFrame), frames
        assert isinstance(frames[-1], GoAwayFrame), f"no GOAWAY: {frames} (eof={c.eof})"
        assert frames[-1].error_code == ErrorCodes.PROTOCOL_ERROR, frames[-1]
        assert frames[-1].last_stream_id == 0, frames[-1]
        assert c.closed_after(3)


def test_window_update_reserved_bit_is_ignored(port: int) -> None:
    """RFC 9113 6.9: the increment is 31 bits; the reserved bit must be ignored."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(raw_frame(WINDOW_UPDATE, 0, 0, (0x80000001).to_bytes(4, "big")),
               c.request(1, "/echo"))
        assert c.response(1).status == 200


def test_no_rfc7540_priorities_must_be_0_or_1(port: int) -> None:
    """RFC 9218 2.1: SETTINGS_NO_RFC7540_PRIORITIES (0x9) other than 0 or 1."""
    with FrameClient(port) as c:
        c.handshake({0x9: 2})
        expect_goaway(c, ErrorCodes.PROTOCOL_ERROR)


@pytest.mark.parametrize("shape", ["short_at_end_stream", "longer_than_declared"])
def test_content_length_mismatch(port: int, shape: str) -> None:
    """RFC 9113 8.1.1: DATA adding up to a different length than content-length: a
    stream error; the connection's other streams go on."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/delay/300"))
        data = (raw_frame(DATA, END_STREAM, 3, b"12345") if shape == "short_at_end_stream"
                else raw_frame(DATA, 0, 3, b"x" * 11))
        c.send(c.request(3, "/echo", "POST", [("content-length", "10")], end_stream=False),
               data)
        expect_reset(c, 3, (ErrorCodes.PROTOCOL_ERROR,))
        assert c.response(1).status == 200
        c.send(c.request(5, "/echo"))
        assert c.response(5).status == 200


def test_http11_limits_on_field_count_and_target_length(demo_upstream: int,
                                                       tmp_path: Path) -> None:
    """[http] max_headers and max_request_line_bytes hold for an HTTP/2 request as for
    an HTTP/1.1 one: 431 and 414, for that stream alone; and a method longer than any
    (33 bytes) is a 501 (RFC 9112 3.1), as over HTTP/1.1."""
    text = (CONFIG % (MAX_STREAMS, 65536, demo_upstream)).replace(
        "max_header_bytes = 65536", "max_header_bytes = 65536\nmax_headers = 10\n"
        "max_request_line_bytes = 100")
    proxy = ProxyProc(tmp_path, text)
    try:
        with FrameClient(proxy.ports["port"]) as c:
            c.handshake()
            c.send(c.request(1, "/echo", extra=[(f"x-f{i}", "v") for i in range(10)]),
                   c.request(3, "/echo", extra=[(f"x-f{i}", "v") for i in range(11)]),
                   c.request(5, "/echo/" + "a" * (100 - len("GET /echo/"))),
                   c.request(7, "/echo/" + "a" * (101 - len("GET /echo/"))))
            assert [c.response(sid).status for sid in (1, 3, 5, 7)] == [200, 431, 200, 414]
            c.send(c.request(9, "/echo", "X" * 32), c.request(11, "/echo", "X" * 33))
            assert c.response(9).status != 501
            assert c.response(11).status == 501
    finally:
        proxy.stop()


def _431(frames: list, sid: int) -> None:
    heads = [f for f in frames if isinstance(f, HeadersFrame) and f.stream_id == sid]
    assert heads and dict(heads[0].decoded)[b":status"] == b"431", frames
    body = b"".join(f.data for f in frames if isinstance(f, DataFrame) and f.stream_id == sid)
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large", body


def test_header_list_over_max_header_bytes(port: int) -> None:
    """A header list larger than SETTINGS_MAX_HEADER_LIST_SIZE (max_header_bytes) but
    decodable: 431 on that stream (RFC 9113 10.5.1), never forwarded."""
    with FrameClient(port) as c:
        c.handshake()
        first = c.recv()
        assert isinstance(first, SettingsFrame)
        assert first.settings[SettingsFrame.MAX_HEADER_LIST_SIZE] == MAX_HEADER_BYTES
        c.send(c.request(1, "/echo", extra=[("x-big", "v" * (MAX_HEADER_BYTES + 100))]))
        _431(c.frames_until(lambda f: isinstance(f, (RstStreamFrame, GoAwayFrame))
                            or (f.stream_id == 1 and "END_STREAM" in f.flags)), 1)


def test_header_list_over_max_header_bytes_with_body_or_grpc(port: int) -> None:
    """The 431 stream's request body is dropped, and the connection serves on; a gRPC
    caller gets a trailers-only RESOURCE_EXHAUSTED instead of a JSON body."""
    big = ("x-big", "v" * (MAX_HEADER_BYTES + 100))
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/echo", "POST", extra=[big], end_stream=False),
               DataFrame(1, b"x" * 1000, flags=["END_STREAM"]))
        resp = c.response(1)
        assert resp.status == 431, resp
        c.send(c.request(3, "/echo", "POST", extra=[("content-type", "application/grpc"),
                                                    ("te", "trailers"), big]))
        resp = c.response(3)
        assert resp.status == 200 and resp.header(b"grpc-status") == b"8", resp
        c.send(c.request(5, "/echo"))
        assert c.response(5).status == 200


def test_trailers_over_max_header_bytes_reset_their_stream(port: int) -> None:
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/echo", "POST", end_stream=False), DataFrame(1, b"x" * 100),
               c.headers(1, [("x-big", "v" * (MAX_HEADER_BYTES + 100))]))
        expect_reset(c, 1, (ErrorCodes.PROTOCOL_ERROR,))
        c.send(c.request(3, "/echo"))
        assert c.response(3).status == 200


def test_header_list_over_limit_in_continuations(port: int) -> None:
    """The same limit across many CONTINUATION frames (each one small)."""
    with FrameClient(port) as c:
        c.handshake()
        big = block(c, "/echo", [(f"x-h{i}", "v" * 200) for i in range(40)])
        pieces = [big[i:i + 500] for i in range(0, len(big), 500)]
        frames = [raw_frame(HEADERS, END_STREAM, 1, pieces[0])]
        for i, piece in enumerate(pieces[1:], 1):
            frames.append(raw_frame(CONTINUATION, END_HEADERS if i == len(pieces) - 1 else 0,
                                    1, piece))
        c.send(*frames)
        _431(c.frames_until(lambda f: isinstance(f, (RstStreamFrame, GoAwayFrame))
                            or (f.stream_id == 1 and "END_STREAM" in f.flags)), 1)


def test_oversized_header_list_leaves_other_streams_and_hpack_in_step(port: int) -> None:
    """An h2-library client (its encoder indexes fields): the oversized request gets 431,
    a request on another stream sent right behind it, whose fields refer to the dynamic
    table entries the oversized block made, is served with those fields intact, and so
    is a later one: the connection and its HPACK state survive."""
    with H2LibClient(port) as c:
        big = c.request("/echo", [("x-a", "1"), ("x-big", "v" * (MAX_HEADER_BYTES + 100)),
                                  ("x-after", "after-big"), ("x-b", "2")])
        small = c.request("/echo", [("x-after", "after-big"), ("x-b", "2")])
        resp = c.response(big)
        assert resp.status == 431, resp
        assert json.loads(resp.body)["error"]["code"] == "request_header_fields_too_large"
        resp = c.response(small)
        assert resp.status == 200, resp
        seen = json.loads(resp.body)["headers"]
        assert seen["x-after"] == "after-big" and seen["x-b"] == "2", seen
        assert "x-big" not in seen
        again = c.request("/echo", [("x-after", "after-big")])
        resp = c.response(again)
        assert resp.status == 200 and c.terminated is None and not c.eof, (resp, c.terminated)
        assert json.loads(resp.body)["headers"]["x-after"] == "after-big"


def test_header_list_far_over_limit_is_a_connection_error(port: int) -> None:
    """Many times the limit is abuse, not a large request: GOAWAY(ENHANCE_YOUR_CALM)."""
    with FrameClient(port) as c:
        c.handshake()
        big = block(c, "/echo", [(f"x-h{i}", "v" * 1000) for i in range(40)])
        pieces = [big[i:i + 8000] for i in range(0, len(big), 8000)]
        frames = [raw_frame(HEADERS, END_STREAM, 1, pieces[0])]
        for i, piece in enumerate(pieces[1:], 1):
            frames.append(raw_frame(CONTINUATION, END_HEADERS if i == len(pieces) - 1 else 0,
                                    1, piece))
        c.send(*frames)
        expect_goaway(c, ErrorCodes.ENHANCE_YOUR_CALM)


def test_hpack_bomb_is_a_connection_error(port: int) -> None:
    """A small block that refers to one large dynamic-table entry over and over (an
    HPACK bomb): cut off as the decoded list passes a bound, not decoded to the end."""
    with FrameClient(port) as c:
        c.handshake()
        value = "v" * 3900
        first = c.encode([(":method", "GET"), (":scheme", "http"), (":path", "/echo"),
                          (":authority", "test"), ("x-bomb", value)])
        index = 62  # the newest dynamic-table entry: x-bomb
        c.send(raw_frame(HEADERS, END_STREAM | END_HEADERS, 1,
                         first + bytes([0x80 | index]) * 10000))
        expect_goaway(c, ErrorCodes.ENHANCE_YOUR_CALM)


# -- stream limits, rapid reset -----------------------------------------------------------------


def test_too_many_concurrent_streams_refused_others_served(port: int) -> None:
    """RFC 9113 5.1.2: a stream over SETTINGS_MAX_CONCURRENT_STREAMS gets
    RST_STREAM(REFUSED_STREAM); the connection and the other streams carry on."""
    with FrameClient(port) as c:
        c.handshake()
        sids = [1 + 2 * i for i in range(MAX_STREAMS)]
        c.send(*[c.request(sid, "/delay/800") for sid in sids])
        extra = sids[-1] + 2
        c.send(c.request(extra, "/echo"))
        expect_reset(c, extra, (ErrorCodes.REFUSED_STREAM,))
        for sid in sids:
            resp = c.response(sid)
            assert resp.status == 200 and resp.body == b"ok", (sid, resp)
        c.send(c.request(extra + 2, "/echo"))
        assert c.response(extra + 2).status == 200


def test_rest_of_a_refused_stream_is_dropped_not_a_connection_error(port: int) -> None:
    """A request refused over the concurrency limit may already have its DATA and
    trailers on the wire: they belong to a closed stream (RFC 9113 5.1), not to a new
    one over the limit, and the streams in flight go on."""
    with FrameClient(port) as c:
        c.handshake()
        frames = [c.request(1 + 2 * i, "/delay/300") for i in range(MAX_STREAMS)]
        sid = 1 + 2 * MAX_STREAMS
        frames += [c.request(sid, "/echo", "POST", end_stream=False),
                   raw_frame(DATA, 0, sid, b"abc"), c.headers(sid, [("x-trailer", "1")])]
        c.send(*frames)
        expect_reset(c, sid, (ErrorCodes.REFUSED_STREAM,))
        for i in range(MAX_STREAMS):
            assert c.response(1 + 2 * i).status == 200
        assert not [f for f in c.stash if isinstance(f, GoAwayFrame)]


def test_rapid_reset_gets_enhance_your_calm(port: int) -> None:
    """CVE-2023-44487: streams opened and reset at once, over and over."""
    with FrameClient(port) as c:
        c.handshake()
        frames = []
        for i in range(1000):
            sid = 1 + 2 * i
            frames += [c.request(sid, "/delay/1000"), RstStreamFrame(sid, error_code=8)]
        c.try_send(*frames)
        frame = c.goaway(10)
        assert frame is not None and frame.error_code == ErrorCodes.ENHANCE_YOUR_CALM, frame
        assert c.closed_after(3)


def test_refused_stream_flood_gets_enhance_your_calm(port: int) -> None:
    """The same attack without sending RST_STREAM: keep the limit full with slow streams
    and open more, each refused (RST_STREAM REFUSED_STREAM by the proxy)."""
    with FrameClient(port) as c:
        c.handshake()
        frames = [c.request(1 + 2 * i, "/delay/2000") for i in range(MAX_STREAMS)]
        frames += [c.request(1 + 2 * i, "/echo") for i in range(MAX_STREAMS, 3000)]
        c.try_send(*frames)
        frame = c.goaway(10)
        assert frame is not None and frame.error_code == ErrorCodes.ENHANCE_YOUR_CALM, frame


RESET_BUDGET_SPENT = "reset or overran streams too fast"


def _provoked_reset(c: FrameClient, sid: int, kind: str) -> list:
    """Frames that open stream `sid` (a request the upstream would take a while over)
    and make the proxy reset it, as CVE-2025-8671 (MadeYouReset) does."""
    if kind == "window_update_zero":
        return [c.request(sid, "/delay/1000"), raw_frame(WINDOW_UPDATE, 0, sid, bytes(4))]
    if kind == "priority_on_itself":
        return [c.request(sid, "/delay/1000"),
                raw_frame(PRIORITY, 0, sid, sid.to_bytes(4, "big") + b"\x10")]
    if kind == "malformed_request":
        # Fine by HTTP/2, not by HTTP/1.1: refused by the proxy, not by the h2 library.
        return [c.request(sid, "/delay/1000", extra=[("x(a)", "1")])]
    if kind == "data_past_content_length":
        return [c.request(sid, "/delay/1000", "POST", [("content-length", "1")],
                          end_stream=False), raw_frame(DATA, 0x1, sid, b"12")]
    if kind == "window_update_overflow":
        return [c.request(sid, "/delay/1000"),
                raw_frame(WINDOW_UPDATE, 0, sid, (2**31 - 1).to_bytes(4, "big"))]
    if kind == "data_on_half_closed":
        return [c.request(sid, "/delay/1000"), raw_frame(DATA, 0x1, sid, b"x")]
    if kind == "headers_on_half_closed":
        return [c.request(sid, "/delay/1000"), c.headers(sid, [("x-trailer", "1")])]
    if kind == "priority_wrong_length":
        return [c.request(sid, "/delay/1000"), raw_frame(PRIORITY, 0, sid, bytes(4))]
    assert kind == "short_of_content_length"
    return [c.request(sid, "/delay/1000", "POST", [("content-length", "10")],
                      end_stream=False), raw_frame(DATA, 0, sid, b"1"),
            c.headers(sid, [("x-trailer", "1")])]


@pytest.fixture(scope="module")
def wide_proxy(demo_upstream: int,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    """The module's proxy with a concurrency limit a burst of 400 streams cannot reach,
    so no refusal is what spends the reset budget."""
    p = ProxyProc(tmp_path_factory.mktemp("h2-abuse-wide"),
                  CONFIG % (1000, MAX_HEADER_BYTES, demo_upstream))
    yield p
    p.stop()


def _burst_until_goaway(proxy: ProxyProc, frames_for) -> GoAwayFrame | None:
    """400 streams in one burst (frames_for(sid) opens each); the GOAWAY that ends it.
    One burst spends the budget (200) past its refill (100/s) whatever the machine's
    speed; in batches, each answered before the next, a busy machine answered too slowly
    to outrun the refill and the test timed out."""
    with FrameClient(proxy.ports["port"]) as c:
        c.handshake()
        c.try_send(*[f for sid in range(1, 801, 2) for f in frames_for(c, sid)])
        return c.goaway(10)


@pytest.mark.parametrize("kind", ["window_update_zero", "priority_on_itself",
                                  "malformed_request", "data_past_content_length",
                                  "short_of_content_length", "window_update_overflow",
                                  "data_on_half_closed", "headers_on_half_closed",
                                  "priority_wrong_length"])
def test_resets_the_client_provokes_get_enhance_your_calm(wide_proxy: ProxyProc,
                                                          kind: str) -> None:
    """CVE-2025-8671 (MadeYouReset): rapid reset without RST_STREAM from the client; a
    frame the proxy must answer with RST_STREAM does it instead. Those resets are charged
    to the same budget as the client's own."""
    spent = wide_proxy.log().count(RESET_BUDGET_SPENT)
    frame = _burst_until_goaway(wide_proxy, lambda c, sid: _provoked_reset(c, sid, kind))
    assert frame is not None and frame.error_code == ErrorCodes.ENHANCE_YOUR_CALM, frame
    assert wide_proxy.log().count(RESET_BUDGET_SPENT) == spent + 1, "not the reset budget"


def test_oversized_header_lists_are_budgeted(wide_proxy: ProxyProc) -> None:
    """A header list over max_header_bytes is answered 431 (after decoding up to four
    times the limit); many of them are a flood like provoked resets: the same budget,
    then GOAWAY(ENHANCE_YOUR_CALM)."""
    spent = wide_proxy.log().count(RESET_BUDGET_SPENT)
    big = [("x-big", "v" * (MAX_HEADER_BYTES + 100))]
    frame = _burst_until_goaway(wide_proxy, lambda c, sid: [c.request(sid, "/echo", extra=big)])
    assert frame is not None and frame.error_code == ErrorCodes.ENHANCE_YOUR_CALM, frame
    assert wide_proxy.log().count(RESET_BUDGET_SPENT) == spent + 1, "not the reset budget"
    resp = h2_get(wide_proxy.ports["port"], "/echo")
    assert resp.status == 200, resp


def test_a_flood_in_one_read_is_cut_within_the_read(wide_proxy: ProxyProc) -> None:
    """Budgets were charged once per read: 7,000 HEADERS frames with empty blocks (each
    a malformed request the proxy resets), 63,000 bytes in one read, had every stream
    opened, reset and logged before the GOAWAY (7,000 RST_STREAMs and about 60 MiB of
    RSS a connection). The budgets are charged every FRAMES_PER_PASS frames now."""
    port = wide_proxy.ports["port"]
    with FrameClient(port) as c:
        c.handshake()
        c.send(b"".join(raw_frame(HEADERS, END_STREAM | END_HEADERS, sid, b"")
                        for sid in range(1, 14000, 2)))
        frames = c.frames_until(lambda f: isinstance(f, GoAwayFrame), 20)
    assert frames and isinstance(frames[-1], GoAwayFrame), frames[-3:]
    assert frames[-1].error_code == ErrorCodes.ENHANCE_YOUR_CALM, frames[-1]
    resets = sum(isinstance(f, RstStreamFrame) for f in frames)
    assert resets <= RESET_BUDGET + 2 * FRAMES_PER_PASS, resets
    assert h2_get(port, "/echo").status == 200


def _proxy_with(demo_upstream: int, tmp_path: Path, http: str) -> ProxyProc:
    """A proxy of this module's config with more [http] settings."""
    text = (CONFIG % (MAX_STREAMS, MAX_HEADER_BYTES, demo_upstream)).replace(
        "[http]\n", f"[http]\n{http}\n")
    return ProxyProc(tmp_path, text)


def test_h2_max_requests_ends_an_h2_connection(demo_upstream: int,
                                               tmp_path: Path) -> None:
    """[http] h2_max_requests bounds the streams of one HTTP/2 connection, as nginx's
    keepalive_requests does (otherwise it opens streams for ever, each a request the
    upstream starts, however they end). The stream that reaches the limit is served and
    named last by GOAWAY(NO_ERROR) (RFC 9113 6.8); one behind it is refused
    (REFUSED_STREAM: not processed, safe to retry); then the connection closes."""
    proxy = _proxy_with(demo_upstream, tmp_path, "h2_max_requests = 3")
    try:
        with FrameClient(proxy.ports["port"]) as c:
            c.handshake()
            for sid in (1, 3):
                c.send(c.request(sid, "/echo"))
                resp = c.response(sid)
                assert resp.status == 200 and resp.goaway is None, resp
            c.send(c.request(5, "/delay/200"), c.request(7, "/echo"))
            frames = c.frames_until(lambda f: isinstance(f, RstStreamFrame)
                                    and f.stream_id == 7)
            goaway = [f for f in frames if isinstance(f, GoAwayFrame)]
            assert goaway, frames
            assert goaway[0].error_code == ErrorCodes.NO_ERROR
            assert goaway[0].last_stream_id == 5
            assert frames[-1].stream_id == 7 and isinstance(frames[-1], RstStreamFrame), frames
            assert frames[-1].error_code == ErrorCodes.REFUSED_STREAM
            c.stash += [f for f in frames if f.stream_id == 5]
            resp = c.response(5)
            assert resp.status == 200 and resp.body == b"ok" and resp.reset is None, resp
            assert c.closed_after(5)
    finally:
        proxy.stop()


def test_h2_max_requests_client_moves_on(demo_upstream: int, tmp_path: Path) -> None:
    """A real client (httpx) takes the GOAWAY in its stride: every request is served, on
    a new connection after each third."""
    proxy = _proxy_with(demo_upstream, tmp_path, "h2_max_requests = 3")
    try:
        ports = []
        with httpx.Client(http1=False, http2=True, timeout=10) as client:
            for i in range(7):
                url = f"http://127.0.0.1:{proxy.ports['port']}/echo/{i}"
                with client.stream("GET", url) as r:  # open: the connection is still up
                    ports.append(r.extensions["network_stream"].get_extra_info(
                        "client_addr")[1])
                    r.read()
                assert r.status_code == 200 and r.http_version == "HTTP/2", r
        assert [ports.index(p) for p in ports] == [0, 0, 0, 3, 3, 3, 6], ports
    finally:
        proxy.stop()


@pytest.mark.skipif(shutil.which("h2load") is None, reason="needs h2load (nghttp2-client)")
def test_h2_connections_have_no_request_limit_by_default(demo_upstream: int,
                                                          tmp_path: Path) -> None:
    """max_keepalive_requests is HTTP/1.1's: an HTTP/2 connection has no limit unless
    h2_max_requests sets one (as Envoy and Go). h2load, which does not reconnect after a
    GOAWAY, gets every request answered on its one connection."""
    proxy = _proxy_with(demo_upstream, tmp_path, "max_keepalive_requests = 3")
    try:
        res = subprocess.run(["h2load", "-n", "40", "-c", "1", "-m", "4",
                              f"http://127.0.0.1:{proxy.ports['port']}/echo"],
                             capture_output=True, text=True, timeout=60)
        assert "requests: 40 total, 40 started, 40 done, 40 succeeded, 0 failed" in \
            res.stdout, res.stdout + res.stderr
        assert "status codes: 40 2xx" in res.stdout, res.stdout
    finally:
        proxy.stop()


def test_keepalive_off_h2_connection_serves_one_request(demo_upstream: int,
                                                        tmp_path: Path) -> None:
    """[http] keepalive_timeout_ms = 0 turns keep-alive off: an HTTP/1.1 connection closes
    after its response, and waits header_timeout_ms at most for its request. An HTTP/2
    one was kept open for ever instead, idle or not (nothing timed it out). Now, as
    nginx's keepalive_timeout 0, it serves one request and ends with GOAWAY(NO_ERROR);
    one that sends no request is closed after header_timeout_ms, as for HTTP/1.1."""
    proxy = _proxy_with(demo_upstream, tmp_path,
                        "keepalive_timeout_ms = 0\nheader_timeout_ms = 1000")
    try:
        with FrameClient(proxy.ports["port"]) as c:
            c.handshake()
            c.send(c.request(1, "/echo"))
            resp = c.response(1)
            assert resp.status == 200 and resp.reset is None, resp
            goaway = c.goaway(5)
            assert goaway is not None and goaway.error_code == ErrorCodes.NO_ERROR, goaway
            assert goaway.last_stream_id == 1
            assert c.closed_after(5)
        with FrameClient(proxy.ports["port"]) as c:
            c.handshake()
            goaway = c.goaway(10)
            assert goaway is not None and goaway.error_code == ErrorCodes.NO_ERROR, goaway
            assert goaway.last_stream_id == 0
            assert c.closed_after(5)
    finally:
        proxy.stop()


@pytest.mark.parametrize("part", ["frame_header", "header_block", "preface"])
def test_part_of_a_frame_waits_header_timeout_ms_at_most(demo_upstream: int, tmp_path: Path,
                                                         part: str) -> None:
    """A frame (or header block, or preface) begun and never finished is a request head
    on its way: closed after header_timeout_ms, as an HTTP/1.1 head is and as nginx's
    client_header_timeout does. It was held for keepalive_timeout_ms (a slowloris on
    HTTP/2). An idle connection with nothing begun still gets keepalive_timeout_ms."""
    proxy = _proxy_with(demo_upstream, tmp_path,
                        "keepalive_timeout_ms = 60000\nheader_timeout_ms = 1000")
    try:
        with FrameClient(proxy.ports["port"]) as c:
            if part == "preface":
                c.send(PREFACE[:10])
            else:
                c.handshake()
                # Both SETTINGS acknowledged first: the client sends nothing after the part.
                acked = c.frames_until(lambda f: isinstance(f, SettingsFrame)
                                       and "ACK" in f.flags)
                assert acked, "no SETTINGS ACK"
                block = c.encode([(":method", "GET"), (":scheme", "http"),
                                  (":path", "/echo"), (":authority", "test")])
                if part == "frame_header":  # the header of a HEADERS frame, no payload
                    c.send(raw_frame(HEADERS, END_STREAM | END_HEADERS, 1, block)[:9])
                else:  # HEADERS without END_HEADERS: CONTINUATION to come
                    c.send(raw_frame(HEADERS, END_STREAM, 1, block))
            deadline = time.monotonic() + 15
            while not c.eof and time.monotonic() < deadline:
                c.recv(deadline - time.monotonic(), auto_ack=False)
            assert c.eof
        assert "sent part of a frame and not the rest" in proxy.log()
        with FrameClient(proxy.ports["port"]) as c:
            c.handshake()
            assert not c.closed_after(3)  # idle, not begun: keep-alive applies
    finally:
        proxy.stop()


def test_settings_never_acknowledged_gets_settings_timeout(demo_upstream: int,
                                                          tmp_path: Path) -> None:
    """RFC 9113 6.5.3: a client that never acknowledges the proxy's SETTINGS gets
    GOAWAY(SETTINGS_TIMEOUT) (within header_timeout_ms, 10 s at most) instead of being
    held until keep-alive runs out; one that acknowledges keeps its connection."""
    proxy = _proxy_with(demo_upstream, tmp_path,
                        "keepalive_timeout_ms = 60000\nheader_timeout_ms = 500")
    try:
        with FrameClient(proxy.ports["port"]) as c:
            c.handshake()
            c.send(c.request(1, "/echo"))
            frames: list = []
            while not c.eof and not any(isinstance(f, GoAwayFrame) for f in frames):
                frame = c.recv(10, auto_ack=False)
                if frame is None:
                    break
                frames.append(frame)
            goaway = frames[-1] if frames else None
            assert isinstance(goaway, GoAwayFrame), f"no GOAWAY: {frames} (eof={c.eof})"
            assert goaway.error_code == ErrorCodes.SETTINGS_TIMEOUT, goaway
            assert goaway.last_stream_id == 1, goaway
            assert any(f.stream_id == 1 and "END_STREAM" in f.flags for f in frames), frames
            assert c.closed_after(3)
        with FrameClient(proxy.ports["port"]) as c:
            c.handshake()
            assert not c.closed_after(3)  # acknowledged: keep-alive applies
    finally:
        proxy.stop()


# -- floods from a client that does not read -----------------------------------------------------


def flood(c: FrameClient, unit: bytes, limit: int, seconds: float) -> tuple[int, bool]:
    """Write `unit` over and over without reading, until the proxy cuts the connection
    (send fails or the socket reports EOF/reset), `limit` bytes or `seconds` pass.
    Returns (bytes sent, cut off)."""
    batch = unit * max(1, 16384 // len(unit))
    sent = 0
    deadline = time.monotonic() + seconds
    c.sock.setblocking(False)
    try:
        while sent < limit and time.monotonic() < deadline:
            _, writable, _ = select.select([], [c.sock], [], 0.2)
            if not writable:
                # The proxy stopped reading: see whether it has closed the connection.
                if c.sock.recv(1, socket.MSG_PEEK) == b"":
                    return sent, True
                continue
            try:
                sent += c.sock.send(batch)
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                return sent, True
    except (BlockingIOError, InterruptedError):
        pass
    except (ConnectionResetError, BrokenPipeError):
        return sent, True
    finally:
        c.sock.setblocking(True)
    return sent, False


def _peek_closed(c: FrameClient, timeout: float) -> bool:
    """Whether the proxy closed the socket (EOF or RST), without reading what is queued
    beyond what the kernel must drop to tell."""
    deadline = time.monotonic() + timeout
    c.sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            data = c.sock.recv(1 << 20)
        except TimeoutError:
            continue
        except (ConnectionResetError, OSError):
            return True
        if not data:
            return True
    return False


@pytest.mark.parametrize("kind", ["ping", "settings"])
def test_control_frame_flood_from_client_that_never_reads(proxy: ProxyProc, port: int,
                                                          kind: str) -> None:
    """CVE-2019-9512 (ping flood) / CVE-2019-9515 (settings flood): every frame asks for
    an ACK the client never reads. The proxy must cut the connection off while its
    memory stays bounded, instead of queueing ACKs forever."""
    unit = (PingFrame(0, opaque_data=b"12345678") if kind == "ping" else SettingsFrame(0))
    with RssMonitor(proxy.pid) as rss, FrameClient(port, rcvbuf=4096) as c:
        c.handshake()
        sent, cut = flood(c, unit.serialize(), 256 * MiB, 20)
        if not cut:
            cut = _peek_closed(c, 5)
    assert cut, f"still connected after sending {sent / MiB:.1f} MiB of {kind} frames"
    assert rss.growth < 32 * MiB, rss.describe()


def test_acks_a_client_does_not_read_are_capped(proxy: ProxyProc, port: int) -> None:
    """CVE-2019-9512/9515 under the PING/SETTINGS budget: a client that does not read
    (here a download fills the socket) and sends fewer PINGs than the budget allows
    still cannot have their ACKs queue up without bound: past UNSENT_ACKS_LIMIT of them
    waiting in the proxy's output it gets GOAWAY(ENHANCE_YOUR_CALM). The ACKs used to
    pile up until the 8 MiB write buffer bound, for as long as it kept a stream open."""
    ping = PingFrame(0, opaque_data=b"12345678").serialize()
    sent, cut = 0, False
    with FrameClient(port, rcvbuf=4096) as c:
        c.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: 2**31 - 1}, window=2**31 - 1 - 65535)
        c.send(c.request(1, "/bytes/2147483648"))
        # Paced, and below CONTROL_BUDGET in all: the rate budget never runs out.
        while sent + 16 <= CONTROL_BUDGET - 100 and not cut:
            cut = not c.try_send(ping * 16)
            sent += 16
            time.sleep(0.05)
        cut = cut or _peek_closed(c, 5)
    assert cut, f"still connected after {sent} PINGs it did not read the ACKs of"
    assert sent > UNSENT_ACKS_LIMIT
    assert "does not read the ACKs" in proxy.log()


def test_continuation_flood(proxy: ProxyProc, port: int) -> None:
    """CVE-2024-27316 style: HEADERS without END_HEADERS, then CONTINUATION frames that
    never end. The proxy must close the connection after a bounded amount."""
    with RssMonitor(proxy.pid) as rss, FrameClient(port) as c:
        c.handshake()
        c.send(raw_frame(HEADERS, END_STREAM, 1, block(c)))
        # Literal header fields without indexing, new names: valid HPACK, endless list.
        field = b"\x00\x05x-pad\x7f\x81\x7f" + b"a" * 16000
        unit = raw_frame(CONTINUATION, 0, 1, field[:16000])
        sent, cut = flood(c, unit, 64 * MiB, 20)
        if not cut:
            cut = _peek_closed(c, 5)
    assert cut, f"still connected after {sent / MiB:.1f} MiB of CONTINUATION frames"
    assert sent < 16 * MiB, f"accepted {sent / MiB:.1f} MiB of one header block"
    assert rss.growth < 32 * MiB, rss.describe()


def test_header_block_cut_as_it_passes_the_hard_limit(port: int) -> None:
    """CVE-2024-27316: a header block still waiting for its END_HEADERS is cut as soon
    as it is longer than the decoder would take (HEADER_LIST_HARD_FACTOR times
    max_header_bytes), not after h2's 64 CONTINUATION frames (1 MiB held for each
    connection at the default frame size)."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(PingFrame(0, opaque_data=b"settled!"))  # the server's SETTINGS ACKed first:
        c.frames_until(lambda f: isinstance(f, PingFrame) and "ACK" in f.flags)  # no frame
        c.send(raw_frame(HEADERS, END_STREAM, 1, block(c)),  # may come inside the block
               *[raw_frame(CONTINUATION, 0, 1, b"\x00\x05x-pad\x7f\x81\x3e" + b"a" * 8000)] * 3)
        expect_goaway(c, ErrorCodes.ENHANCE_YOUR_CALM)


def test_empty_continuation_flood(port: int) -> None:
    with FrameClient(port) as c:
        c.handshake()
        c.send(raw_frame(HEADERS, END_STREAM, 1, block(c)))
        sent, cut = flood(c, raw_frame(CONTINUATION, 0, 1, b""), 64 * MiB, 20)
        if not cut:
            cut = _peek_closed(c, 5)
    assert cut, f"still connected after {sent / MiB:.1f} MiB of empty CONTINUATION frames"


def _idle_flood_unit(c: FrameClient, kind: str) -> bytes:
    """Open what the flood needs, and return one frame of it."""
    if kind in ("empty_data", "one_byte_data"):  # CVE-2019-9518, and its 1-byte variant
        c.send(c.request(1, "/echo", "POST", end_stream=False))
        return raw_frame(DATA, 0, 1, b"" if kind == "empty_data" else b"x")
    if kind == "priority":  # CVE-2019-9513
        return raw_frame(PRIORITY, 0, 3, (1).to_bytes(4, "big") + b"\x10")
    if kind == "unknown":
        return raw_frame(0xFA, 0, 0, b"")
    if kind == "window_update":
        return raw_frame(WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big"))
    if kind == "settings_ack":  # unasked for: nothing to answer, nothing to do
        return raw_frame(SETTINGS, 0x1, 0, b"")
    if kind == "ping_ack":
        return raw_frame(PING, 0x1, 0, b"12345678")
    if kind == "goaway":  # repeated, while a response is still pending
        c.send(c.request(1, "/delay/30000"))
        return raw_frame(GOAWAY, 0, 0, (1).to_bytes(4, "big") + (0).to_bytes(4, "big"))
    if kind == "data_on_reset_stream":  # CVE-2019-9514: each answered with RST_STREAM
        c.send(c.request(1, "/echo", "POST", end_stream=False),
               raw_frame(RST_STREAM, 0, 1, (8).to_bytes(4, "big")))
        return raw_frame(DATA, 0, 1, b"x")
    if kind == "data_on_stream_the_proxy_reset":  # ignored (RFC 9113 5.1), still work
        c.send(c.request(1, "/echo", "POST", [("x-A", "1")], end_stream=False))
        expect_reset(c, 1, (ErrorCodes.PROTOCOL_ERROR,))
        return raw_frame(DATA, 0, 1, b"x")
    # Frames on a finished stream that h2 drops without an event (DATA there is a
    # connection error STREAM_CLOSED, RFC 9113 5.1).
    c.send(c.request(1, "/echo"))
    assert c.response(1).status == 200
    if kind == "rst_on_closed_stream":
        return raw_frame(RST_STREAM, 0, 1, (8).to_bytes(4, "big"))
    assert kind == "window_update_on_closed_stream", kind
    return raw_frame(WINDOW_UPDATE, 0, 1, (1).to_bytes(4, "big"))


@pytest.mark.parametrize("kind", ["empty_data", "one_byte_data", "priority", "unknown",
                                  "window_update", "data_on_reset_stream",
                                  "data_on_stream_the_proxy_reset", "settings_ack",
                                  "ping_ack", "goaway", "rst_on_closed_stream",
                                  "window_update_on_closed_stream"])
def test_flood_of_frames_that_carry_no_request(proxy: ProxyProc, port: int, kind: str) -> None:
    """Cheap frames that cost the proxy work and move no request along: the connection is
    cut (GOAWAY ENHANCE_YOUR_CALM) instead of holding the worker busy for as long as the
    client keeps sending. The proxy says so in its log: the cut is the budget's, not a
    side effect (an output buffer limit, say)."""
    said = "floods frames that carry no request"
    before = proxy.log().count(said)
    with FrameClient(port) as c:
        c.handshake()
        unit = _idle_flood_unit(c, kind)
        sent, cut = flood(c, unit, 256 * MiB, 20)
        if not cut:
            cut = _peek_closed(c, 5)
    assert cut, f"still connected after {sent / MiB:.1f} MiB of {kind} frames"
    assert sent < 32 * MiB, f"took {sent / MiB:.1f} MiB of {kind} frames"
    assert wait_for(lambda: proxy.log().count(said) > before, 5), proxy.log()[-2000:]


@pytest.mark.parametrize("padded", [False, True])
def test_an_upload_in_small_data_frames_is_not_a_flood(port: int, padded: bool) -> None:
    """A client that streams its body in many small frames (gRPC messages of 64 bytes
    and up, say) is sending a body, not flooding: 192 KiB (within the stream's window)
    in 64-byte DATA frames. Padding counts as what the frame carries (RFC 9113 10.7: it
    costs the client's window as data does): 3,072 frames of 8 bytes padded to 64 were
    charged as nearly empty ones, and the upload was cut off."""
    piece = 8 if padded else 64
    body = bytes(range(64)) * (3072 * piece // 64)
    with FrameClient(port) as c:
        c.handshake(window=3072 * 64)
        frames: list = [c.request(1, "/echo", "POST", end_stream=False)]
        for i in range(0, len(body), piece):
            chunk = body[i:i + piece]
            if padded:
                frames.append(raw_frame(DATA, PADDED, 1, bytes([63 - piece]) + chunk
                                        + bytes(63 - piece)))
            else:
                frames.append(raw_frame(DATA, 0, 1, chunk))
        frames.append(raw_frame(DATA, END_STREAM, 1, b""))
        c.send(*frames)
        resp = c.response(1, timeout=30)
        assert resp.status == 200 and resp.reset is None, resp
        assert json.loads(resp.body)["body_bytes"] == len(body)


def test_window_updates_for_a_long_download_are_not_a_flood(port: int) -> None:
    """A client with a 1 KiB stream window that answers every DATA frame with two
    WINDOW_UPDATEs (stream and connection) gets its whole response."""
    with FrameClient(port) as c:
        c.handshake({0x4: 1024})
        c.send(c.request(1, "/bytes/2000000"))
        resp = c.response(1, timeout=30)
        assert resp.goaway is None, f"GOAWAY {resp.goaway.error_code}"
        assert resp.status == 200 and len(resp.body) == 2_000_000 and resp.reset is None


def test_a_window_opened_by_a_few_bytes_waits_for_more(port: int) -> None:
    """The upstream's reads do not line up with a 1 KiB window: sending whatever the
    window let through cut it into a small and a large piece for good, each answered by
    a WINDOW_UPDATE of its size, so about every other DATA frame carried a few bytes
    (and was charged as a data dribble, below). A window narrower than SILLY_WINDOW and
    than half the widest one granted now waits for the client's next update."""
    size = 1_000_000
    with FrameClient(port) as c:
        c.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: 1024})
        c.send(c.request(1, f"/bytes/{size}"))
        resp = c.response(1, timeout=60)
    assert resp.goaway is None and resp.reset is None and len(resp.body) == size, resp.status
    sizes = [n for n in resp.data_sizes if n]
    small = [n for n in sizes if n < 512]
    assert len(small) < len(sizes) // 10, f"{len(small)} of {len(sizes)} frames under 512 bytes"


def test_data_dribble_gets_enhance_your_calm(proxy: ProxyProc, port: int) -> None:
    """CVE-2019-9511: a client with a 1-byte stream window that opens it a byte at a
    time has the proxy send a DATA frame for each byte; each WINDOW_UPDATE answers a
    DATA frame sent, so it was never charged, and the client kept the worker busy for as
    long as it liked. Frames its window cuts that small are charged now: GOAWAY
    (ENHANCE_YOUR_CALM) well before 20,000 of them. Other connections are served."""
    updates = 0
    with FrameClient(port) as c:
        c.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: 1})
        c.send(c.request(1, "/bytes/100000000"))
        goaway = None
        while goaway is None and updates < 20000:
            # One byte, one frame; the proxy may have closed the connection just now.
            if not c.try_send(WindowUpdateFrame(1, window_increment=1)):
                break
            updates += 1
            frame = c.recv(5)
            while frame is not None and not isinstance(frame, (DataFrame, GoAwayFrame)):
                frame = c.recv(5)
            if frame is None:
                break
            if isinstance(frame, GoAwayFrame):
                goaway = frame
        goaway = goaway or c.goaway(5)
        assert goaway is not None, f"no GOAWAY after {updates} 1-byte window updates"
        assert goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM, goaway
    assert updates < 20000
    assert "floods frames that carry no request" in proxy.log()
    resp = h2_get(port, "/bytes/100000", timeout=30)
    assert resp.status == 200 and len(resp.body) == 100000


TOKENS = 5000  # DATA frames of a token stream: more than the idle budget's burst


async def _token_stream(proto, sid: int, path: str, head: dict, body: bytes) -> None:
    """TOKENS DATA frames of 8 bytes each, written at once."""
    proto.conn.send_headers(sid, [(b":status", b"200")])
    for i in range(TOKENS):
        proto.conn.send_data(sid, b"t%07d" % i)
    proto.conn.end_stream(sid)
    proto.flush()
    proto.server.record("sent_all")


def test_window_updates_for_data_sent_in_a_burst_are_not_a_flood(tmp_path: Path) -> None:
    """A token stream of 5000 small DATA frames reaches the client before it reads any;
    it then answers every frame with two WINDOW_UPDATEs (stream and connection), as in
    the test above. The proxy counted what its DATA frames earned against a budget that
    was already full, so the credit was lost, and the 10000 WINDOW_UPDATEs that followed
    got GOAWAY(ENHANCE_YOUR_CALM): under load, the same happened with larger frames
    waiting in the socket buffers (test_h2_output_bound). Now up to two WINDOW_UPDATEs
    a DATA frame sent are answers, not idle frames, whenever they come."""
    up = H2Upstream(_token_stream)
    endpoint = f'endpoints = ["127.0.0.1:{up.port}"]'
    config = (CONFIG % (MAX_STREAMS, MAX_HEADER_BYTES, up.port)).replace(
        endpoint, endpoint + '\nprotocol = "h2"')
    p = ProxyProc(tmp_path, config)
    try:
        with FrameClient(p.ports["port"]) as c:
            c.handshake()
            c.send(c.request(1, "/tokens"))
            assert up.wait_event("sent_all", 10), "the upstream never sent its stream"
            assert stops_reading(p.pid), "the proxy never took the whole stream"
            resp = c.response(1, timeout=30)
            c.send(c.request(3, "/tokens"))  # the connection still serves
            again = c.response(3, timeout=30)
    finally:
        log = p.stop()
        up.stop()
    tokens = b"".join(b"t%07d" % i for i in range(TOKENS))
    for got in (resp, again):
        assert got.goaway is None, f"GOAWAY {got.goaway.error_code}"
        assert got.status == 200 and got.reset is None, got
        assert got.body == tokens
    assert "floods" not in log


# -- flow-control stalls ------------------------------------------------------------------------


def _served_meanwhile(proxy: ProxyProc, port: int) -> None:
    """Once the proxy has paused the stalled stream's upstream (it reads nothing more),
    another connection is still served (h2_get's timeout is a hang guard only)."""
    assert stops_reading(proxy.pid, 20), "the proxy never paused the upstream"
    resp = h2_get(port, "/bytes/100000", timeout=30)
    assert resp.status == 200 and len(resp.body) == 100000


def test_stream_window_never_opened(proxy: ProxyProc, port: int) -> None:
    """A client that asks for 1 GiB and never sends WINDOW_UPDATE: the proxy sends the
    65535-byte initial window (less what a last upstream read leaves to a window too
    narrow to be worth a frame, SILLY_WINDOW) and holds the rest in the upstream (RSS
    bounded), and serves other connections meanwhile."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/bytes/1073741824"))
        got = 0
        deadline = time.monotonic() + 5
        while got <= 65535 - SILLY_WINDOW and time.monotonic() < deadline:
            f = c.recv(1)
            if isinstance(f, DataFrame):
                got += len(f.data)
        for f in c.frames_until(lambda f: False, 0.5):
            if isinstance(f, DataFrame):
                got += len(f.data)
        assert 65535 - SILLY_WINDOW < got <= 65535
        with RssMonitor(proxy.pid) as rss:
            _served_meanwhile(proxy, port)
        assert rss.growth < 16 * MiB, rss.describe()
        # Nothing beyond the window arrived.
        more = c.frames_until(lambda f: isinstance(f, DataFrame), 0.5)
        assert not [f for f in more if isinstance(f, DataFrame) and f.data]


def test_response_the_client_takes_none_of_is_reset(demo_upstream: int,
                                                    tmp_path: Path) -> None:
    """Found by fuzzing: a response whose client never opens its window again waited
    for ever once the upstream had finished. [http] send_timeout_ms resets it."""
    text = (CONFIG % (MAX_STREAMS, MAX_HEADER_BYTES, demo_upstream)).replace(
        "max_header_bytes = 4096", "max_header_bytes = 4096\nsend_timeout_ms = 1000")
    proxy = ProxyProc(tmp_path, text)
    try:
        with FrameClient(proxy.ports["port"]) as c:
            c.handshake()
            c.send(c.request(1, "/bytes/200000"))  # more than the 65,535-byte window
            start = time.monotonic()
            expect_reset(c, 1, (ErrorCodes.CANCEL,), timeout=10)
            assert time.monotonic() - start >= 0.9
    finally:
        log = proxy.stop()
    assert "client took no response data for 1000 ms" in log


def test_client_never_reads_socket(proxy: ProxyProc, port: int) -> None:
    """A client that grants a 2 GiB window and then never reads its socket: only TCP
    back-pressure stops the data. The proxy must stop reading the upstream (RSS bounded)
    and keep serving others."""
    with FrameClient(port, rcvbuf=8192) as c:
        c.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: 2**31 - 1,
                     SettingsFrame.MAX_FRAME_SIZE: 2**24 - 1}, window=2**31 - 1 - 65535)
        c.send(c.request(1, "/bytes/2147483648"))
        time.sleep(0.5)
        with RssMonitor(proxy.pid) as rss:
            _served_meanwhile(proxy, port)
        assert rss.growth < 32 * MiB, rss.describe()


# -- graceful shutdown ------------------------------------------------------------------------------


def test_sigterm_goaway_inflight_stream_finishes(demo_upstream: int, tmp_path: Path) -> None:
    proxy = ProxyProc(tmp_path, CONFIG % (MAX_STREAMS, MAX_HEADER_BYTES, demo_upstream))
    try:
        with FrameClient(proxy.ports["port"]) as c:
            c.handshake()
            c.send(c.request(1, "/sse?n=8&delay_ms=200"))
            first = c.frames_until(lambda f: isinstance(f, DataFrame) and f.data)
            assert first and isinstance(first[-1], DataFrame)
            body = first[-1].data
            proxy.proc.send_signal(signal.SIGTERM)
            frames = c.frames_until(lambda f: isinstance(f, GoAwayFrame))
            goaway = frames[-1]
            assert isinstance(goaway, GoAwayFrame), frames
            assert goaway.error_code == ErrorCodes.NO_ERROR and goaway.last_stream_id >= 1
            body += b"".join(f.data for f in frames if isinstance(f, DataFrame))
            # A stream opened after GOAWAY is refused; the one in flight finishes.
            c.send(c.request(3, "/echo"))
            resp = c.response(1, timeout=10)
            body += resp.body
            assert body == b"".join(f"data: event {i}\n\n".encode() for i in range(8))
            assert c.closed_after(5)
        assert proxy.proc.wait(10) == 0
    finally:
        proxy.stop()


def test_client_goaway_lets_inflight_stream_finish(port: int) -> None:
    """RFC 9113 6.8: a client's GOAWAY(NO_ERROR) stops new streams; the response in flight
    still completes, and the proxy's own GOAWAY, naming that stream, comes before the
    close (it used to close without one when a stream was in flight)."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/sse?n=4&delay_ms=150"))
        first = c.frames_until(lambda f: isinstance(f, DataFrame) and f.data)
        body = first[-1].data
        c.send(GoAwayFrame(0, last_stream_id=0, error_code=0))
        resp = c.response(1, timeout=10)
        assert resp.reset is None, resp
        body += resp.body
        assert body == b"".join(f"data: event {i}\n\n".encode() for i in range(4))
        goaways = [resp.goaway] if resp.goaway else []
        goaways += [f for f in c.frames_until(lambda f: False, 5) if isinstance(f, GoAwayFrame)]
        assert c.eof
        assert len(goaways) == 1, goaways
        assert goaways[0].error_code == 0 and goaways[0].last_stream_id == 1, goaways[0]


def test_stream_reset_behind_its_headers_after_client_goaway(port: int) -> None:
    """Found by fuzzing: after the client's GOAWAY, a new stream is refused with
    RST_STREAM; when the client's own RST_STREAM for it came in the same read, h2 had
    closed it already and the refusal raised, aborting the connection."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/delay/300"), GoAwayFrame(0, last_stream_id=0, error_code=0),
               c.request(3, "/echo"), raw_frame(RST_STREAM, 0, 3, (8).to_bytes(4, "big")))
        assert c.response(1).status == 200


def test_client_goaway_names_no_stream_it_drops(port: int) -> None:
    """RFC 9113 6.8: the last stream id of a GOAWAY is the highest the proxy may act on.
    A request behind the client's GOAWAY in the same read is dropped as the connection
    closes: the GOAWAY named it (h2's highest stream id), so the client could not know
    it was never processed (nor safely retry it)."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(GoAwayFrame(0, last_stream_id=0, error_code=0), c.request(1, "/echo"))
        frames = c.frames_until(lambda f: False, 5)
        assert c.eof
        goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
        answered = [f for f in frames if f.stream_id == 1]
        assert len(goaways) == 1 and goaways[0].error_code == 0, goaways
        assert answered or goaways[0].last_stream_id == 0, frames


def test_connection_error_names_the_last_stream_taken(port: int) -> None:
    """RFC 9113 6.8: a GOAWAY for a connection error h2 raises names the last stream
    the proxy took, not h2's highest: a request in the same read as the bad frame is
    dropped unanswered, and the GOAWAY used to name it (the client could not retry)."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/echo"))
        assert c.response(1).status == 200
        c.send(c.request(3, "/echo"), raw_frame(DATA, 0, 0, b"x"))  # DATA on stream 0
        frames = c.frames_until(lambda f: False, 5)
        assert c.eof
        goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
        answered = [f for f in frames if f.stream_id == 3]
        assert len(goaways) == 1, frames
        assert goaways[0].error_code == ErrorCodes.PROTOCOL_ERROR, goaways
        assert goaways[0].last_stream_id == (3 if answered else 1), frames


def test_client_goaway_with_a_stream_in_flight_names_no_stream_it_refuses(port: int) -> None:
    """RFC 9113 6.8, as above with a stream in flight (the GOAWAY that lets it finish):
    a request behind the client's GOAWAY in the same read is refused, and the GOAWAY
    used to name it all the same (h2's highest stream id)."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(c.request(1, "/delay/300"))
        c.send(GoAwayFrame(0, last_stream_id=0, error_code=0), c.request(3, "/echo"))
        frames = c.frames_until(lambda f: False, 5)
        assert c.eof
        goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
        refused = [f for f in frames if isinstance(f, RstStreamFrame) and f.stream_id == 3]
        assert any(f.stream_id == 1 and "END_STREAM" in f.flags for f in frames), frames
        assert len(goaways) == 1 and goaways[0].error_code == 0, goaways
        assert goaways[0].last_stream_id == (1 if refused else 3), frames


@pytest.mark.parametrize("kind,flags", [(PING, 0), (DATA, 0), (HEADERS, 0x4)])
def test_frame_longer_than_max_frame_size_refused_at_its_header(port: int, kind: int,
                                                                 flags: int) -> None:
    """RFC 9113 4.2: FRAME_SIZE_ERROR on a frame over SETTINGS_MAX_FRAME_SIZE (16384
    here), at once: not after buffering the 16 MiB its length field may announce."""
    with FrameClient(port) as c:
        c.handshake()
        c.send(raw_frame(kind, flags, 0 if kind == PING else 1, b"", length=(1 << 24) - 1))
        expect_goaway(c, ErrorCodes.FRAME_SIZE_ERROR)


def test_sigterm_idle_h2_connection_gets_goaway(demo_upstream: int, tmp_path: Path) -> None:
    proxy = ProxyProc(tmp_path, CONFIG % (MAX_STREAMS, MAX_HEADER_BYTES, demo_upstream))
    try:
        with FrameClient(proxy.ports["port"]) as c:
            c.handshake()
            c.send(c.request(1, "/echo"))
            assert c.response(1).status == 200
            proxy.proc.send_signal(signal.SIGTERM)
            # RFC 9113 6.8: GOAWAY(2^31-1) + PING, then (after the ACK c sends) the last id
            first, last = c.goaway(5), c.goaway(5)
            assert first is not None and first.error_code == ErrorCodes.NO_ERROR
            assert first.last_stream_id == 2**31 - 1
            assert last is not None and last.error_code == ErrorCodes.NO_ERROR
            assert last.last_stream_id == 1
            assert c.closed_after(5)
        assert proxy.proc.wait(10) == 0
    finally:
        proxy.stop()

