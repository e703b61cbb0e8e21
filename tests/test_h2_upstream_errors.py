"""An HTTP/2 upstream that breaks the protocol, with real sockets: the broken
connection is let go before anything else can be sent on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.conftest import Proxy
from tests.h2_support import H2Upstream, default_handler


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
