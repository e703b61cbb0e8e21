"""An HTTP/2 upstream that breaks RFC 9113 in ways the `h2` library would never send,
played frame by frame by tests/h2_raw_upstream.py, with the proxy in front of it driven
by real clients (httpx, aiohttp)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest
from hyperframe.frame import GoAwayFrame

from tests.conftest import Proxy
from tests.h2_raw_upstream import RawConn, RawUpstream

pytestmark = pytest.mark.timeout(60)

OK = [(b":status", b"200"), (b"content-type", b"text/plain")]


def config(port: int) -> str:
    return f"""
[server]
workers = 1

[[clusters]]
name = "up"
protocol = "h2"
endpoints = ["127.0.0.1:{port}"]

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
"""


# -- RFC 9113 8.1.1: a malformed response is a stream error ------------------------------------

MALFORMED = {
    # a complete response in one HEADERS frame (END_STREAM) with a connection-specific field
    "head_with_end_stream": lambda c, sid: c.send(
        c.headers(sid, OK + [(b"connection", b"close")], end=True)),
    "pseudo_field_in_trailers": lambda c, sid: c.send(
        c.headers(sid, OK), c.data(sid, b"body"), c.headers(sid, [(b":status", b"200")], end=True)),
    "connection_field_in_trailers": lambda c, sid: c.send(
        c.headers(sid, OK), c.data(sid, b"body"), c.headers(sid, [(b"keep-alive", b"1")], end=True)),
    "uppercase_name_in_trailers": lambda c, sid: c.send(
        c.headers(sid, OK), c.data(sid, b"body"), c.headers(sid, [(b"X-Trailer", b"1")], end=True)),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_response_fails_its_own_stream_only(
    start_proxy: Callable[..., Proxy], case: str
) -> None:
    """RFC 9113 8.1.1: a malformed response is a stream error (PROTOCOL_ERROR), as
    nghttp2 (Envoy) treats one: the other clients' requests sharing the upstream
    connection go on. A field block ending the stream (END_STREAM: a whole response in
    one HEADERS frame, or trailers) must not be made a connection error that fails them."""
    first_in, done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def script(c: RawConn) -> None:
        c.handshake()
        other, _, _ = c.request()
        first_in.set()
        bad, _, _ = c.request()
        MALFORMED[case](c, bad)
        c.send(c.headers(other, OK + [(b"content-length", b"5")]), c.data(other, b"other", True))
        sid, _, _ = c.request()  # the connection is still in use
        c.send(c.headers(sid, OK + [(b"content-length", b"5")]), c.data(sid, b"third", True))
        seen["goaway"] = c.until(lambda f: isinstance(f, GoAwayFrame), 0.5)
        done.set()

    up = RawUpstream(script)
    try:
        proxy = start_proxy(config(up.port))
        result: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: result.setdefault(
            "other", httpx.post(proxy.url + "/other", content=b"x", timeout=10)))
        t.start()
        assert first_in.wait(10)
        # POST: not replayed, so the outcome of this very response is what the client sees.
        with httpx.Client(timeout=10) as client:
            try:
                r = client.post(proxy.url + "/bad", content=b"y")
            except httpx.RemoteProtocolError:
                pass  # the head went out: the body is cut short, never ended cleanly
            else:
                assert r.status_code == 502, (r.status_code, r.content)
                assert r.json()["error"]["code"] == "upstream_bad_response", r.text
        t.join(15)
        other = result["other"]
        assert other.status_code == 200 and other.content == b"other", other.content
        third = httpx.get(proxy.url + "/third", timeout=10)
        assert third.status_code == 200 and third.content == b"third"
        assert done.wait(10) and len(up.conns) == 1
        assert seen["goaway"] is None, seen
        assert not up.errors, up.errors
    finally:
        up.stop()
