"""An HTTP/2 upstream that breaks the protocol, with real sockets: the broken
connection is let go before anything else can be sent on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.conftest import Proxy
from tests.h2_support import H2Upstream, default_handler
from tests.support import raw_exchange


async def garbage_on_demand(proto, sid: int, path: str, head: dict, body: bytes) -> None:
    """As default_handler, but /garbage gets bytes that are no HTTP/2 frame (an
    HTTP/1.1 status line where a frame header belongs): a connection error."""
    if path == "/garbage":
        proto.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n" * 4)
        return
    await default_handler(proto, sid, path, head, body)


@pytest.fixture
def garbler() -> Iterator[H2Upstream]:
    up = H2Upstream(garbage_on_demand, name="garbler")
    yield up
    up.stop()


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_protocol_error_on_a_reused_connection_is_a_502(
    start_proxy: Callable[..., Proxy], garbler: H2Upstream, method: str
) -> None:
    proxy = start_proxy(f"""
[server]
workers = 1

[[clusters]]
name = "up"
protocol = "h2"
endpoints = ["127.0.0.1:{garbler.port}"]

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
""")
    with httpx.Client(timeout=10) as client:
        assert client.get(proxy.url + "/echo").status_code == 200
        # Sent on the pooled connection, which the garbage breaks. A GET may be
        # replayed (nothing of a response arrived), but on a new connection: a stream
        # on the broken one cannot even be opened, and that is no overload (503).
        r = client.request(method, proxy.url + "/garbage", content=b"x")
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "upstream_bad_response"
        assert client.get(proxy.url + "/echo").status_code == 200
    assert garbler.connections == (3 if method == "GET" else 2)


TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def ends_in_headers(proto, sid: int, path: str, head: dict, body: bytes) -> None:
    """Responses that end with their HEADERS frame (END_STREAM), or with trailers and no
    DATA: /empty/N (status N, no content-length), /short-head (content-length 5, ended),
    /short-trailers (content-length 5, then trailers). Else as default_handler."""
    conn = proto.conn
    if path.startswith("/empty/"):
        conn.send_headers(sid, [(b":status", path[7:10].encode()),
                                (b"content-type", b"text/plain")], end_stream=True)
    elif path == "/grpc-trailers-only":
        conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc"),
                                (b"grpc-status", b"14")], end_stream=True)
    elif path == "/framing-trailers":
        conn.send_headers(sid, [(b":status", b"200")])
        conn.send_data(sid, b"abc")
        conn.send_headers(sid, [(b"x-checksum", b"abc"), (b"content-length", b"99"),
                                (b"content-type", b"text/html"), (b"set-cookie", b"a=b"),
                                (b"x-aiproxy-cache", b"hit"), (b"x_aiproxy_route", b"r"),
                                (b"traceparent", TRACEPARENT)],
                          end_stream=True)
    elif path == "/short-head":
        conn.send_headers(sid, [(b":status", b"200"), (b"content-length", b"5")],
                          end_stream=True)
    elif path == "/short-trailers":
        conn.send_headers(sid, [(b":status", b"200"), (b"content-length", b"5")])
        conn.send_headers(sid, [(b"x-checksum", b"abc")], end_stream=True)
    else:
        await default_handler(proto, sid, path, head, body)
        return
    proto.flush()


@pytest.fixture
def header_ender() -> Iterator[H2Upstream]:
    up = H2Upstream(ends_in_headers, name="header-ender")
    yield up
    up.stop()


def _through(start_proxy: Callable[..., Proxy], up: H2Upstream) -> Proxy:
    return start_proxy(f"""
[[clusters]]
name = "up"
protocol = "h2"
endpoints = ["127.0.0.1:{up.port}"]

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
""")


def test_a_response_ended_in_its_headers_is_an_empty_body(
        start_proxy: Callable[..., Proxy], header_ender: H2Upstream) -> None:
    """RFC 9113 8.1: END_STREAM on the HEADERS is a response with no content. An HTTP/1.1
    client got no framing for it (no Content-Length, no chunked, the connection kept):
    a body read to the connection's close, which never came."""
    proxy = _through(start_proxy, header_ender)
    with httpx.Client(timeout=5) as client:
        for path, status in (("/empty/200", 200), ("/empty/404", 404),
                             ("/grpc-trailers-only", 200)):
            r = client.get(proxy.url + path)
            assert r.status_code == status and r.content == b"", (path, r)
            assert r.headers["content-length"] == "0", (path, r.headers)
        # The same connection goes on.
        assert client.get(proxy.url + "/echo").status_code == 200
        # content-length 5 and no DATA: malformed (RFC 9113 8.1.1), a 502, and not five
        # bytes of whatever comes next on the client's connection.
        for path in ("/short-head", "/short-trailers"):
            r = client.get(proxy.url + path)
            assert r.status_code == 502, (path, r, r.content)
            assert r.json()["error"]["code"] == "upstream_bad_response"
            assert "content-length" in r.json()["error"]["message"]
        assert client.get(proxy.url + "/echo").status_code == 200


def test_response_trailers_carry_no_framing_fields(start_proxy: Callable[..., Proxy],
                                                   header_ender: H2Upstream) -> None:
    """RFC 9110 6.5.1: a trailer section carries no framing, content-format or cookie
    fields (an HTTP/2 upstream's content-length trailer was passed on), nor one the proxy
    states on responses; a tracing field is the upstream's to send."""
    proxy = _through(start_proxy, header_ender)
    out = raw_exchange(proxy.port, b"GET /framing-trailers HTTP/1.1\r\nHost: x\r\n"
                       b"TE: trailers\r\nConnection: close\r\n\r\n")
    head, _, body = out.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), out
    assert body == (b"3\r\nabc\r\n0\r\nx-checksum: abc\r\ntraceparent: " + TRACEPARENT
                    + b"\r\n\r\n"), body
