"""CONNECT over HTTP/1.1 is refused (README, Errors: 501), never tunnelled: the proxy is
a reverse proxy, and a CONNECT it carried out would reach any host:port past routing.
A client may send bytes for its tunnel before the answer (optimistic data): they are not
HTTP/1.1 requests (RFC 9110 9.3.6: a non-2xx answer means no tunnel, yet the bytes are
on the way), so the 501 says `Connection: close` and the proxy closes cleanly after it,
never parsing what follows."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

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
    assert upstream.accepted == 0


@pytest.mark.parametrize("early", [
    b"", b"\x16\x03\x01\x00\x05hello",  # a TLS record
    b"GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n"],  # what a tunnel could carry
    ids=["nothing", "tls-record", "http-request"])
def test_connect_refused_then_closed(start_proxy: StartProxy,
                                     serve: Callable[..., ThreadedServer], early: bytes) -> None:
    """The 501 is the last thing on the connection: `Connection: close`, then a clean
    close (FIN, no reset), and the bytes behind the CONNECT are never read as requests."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      conn_id: int) -> None:
        await reader.read(65536)

    upstream = serve(handler)
    proxy = start_proxy(simple_config(upstream.port))
    with RawConn(proxy.port) as c:
        c.send(f"CONNECT 127.0.0.1:{upstream.port} HTTP/1.1\r\nHost: 127.0.0.1:{upstream.port}"
               "\r\n\r\n".encode() + early)
        resp = c.read_response()
        raw_error(resp, 501, "not_implemented")
        assert resp.header("connection") == "close"
        c.send(b"more tunnel bytes, after the answer")
        assert c.read_to_eof() == b""  # no reset: recv() sees a FIN
    assert upstream.accepted == 0
