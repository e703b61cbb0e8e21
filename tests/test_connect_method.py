"""CONNECT over HTTP/1.1 is refused (README, Errors: 501), never tunnelled: the proxy is
a reverse proxy, and a CONNECT it carried out would reach any host:port past routing.
A client that sent bytes for its tunnel before the answer (optimistic data) gets them
read as HTTP/1.1 requests (RFC 9110 9.3.6: any non-2xx answer means no tunnel)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tests.conftest import Proxy, simple_config
from tests.test_proxy_e2e import RawConn, ThreadedServer, curl, raw_error, serve

__all__ = ["serve"]  # the fixture, used by the tests below

StartProxy = Callable[..., Proxy]


def test_connect_is_refused_not_tunnelled(start_proxy: StartProxy,
                                          serve: Callable[..., ThreadedServer]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      conn_id: int) -> None:
        await reader.read(65536)

    upstream = serve(handler)
    proxy = start_proxy(simple_config(upstream.port))
    # curl -p: CONNECT to the upstream's address through the proxy, as to a forward proxy.
    result = curl("-p", "-x", proxy.url, f"http://127.0.0.1:{upstream.port}/", timeout=10)
    assert result.returncode == 56, result  # CURLE_RECV_ERROR: the CONNECT failed
    assert b"501" in result.stderr, result.stderr
    with RawConn(proxy.port) as c:
        c.send(f"CONNECT 127.0.0.1:{upstream.port} HTTP/1.1\r\nHost: 127.0.0.1:{upstream.port}"
               "\r\n\r\n".encode() + b"\x16\x03\x01\x00\x05hello")  # a TLS record, early
        raw_error(c.read_response(), 501, "not_implemented")
        raw_error(c.read_response(), 400)  # the early bytes, read as a request
        assert c.closed_within(5)
    assert upstream.accepted == 0
