"""Upgrade (WebSocket) handshakes through the proxy, against upstreams that answer them
wrongly on purpose: an upstream 101 becomes a tunnel only when it is a valid switch to a
protocol the client offered (RFC 9110 7.8, RFC 6455 4.1); anything else is a 502 and
the upstream connection is dropped, so no client byte reaches it raw."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Callable

import pytest

from tests.conftest import Proxy, simple_config
from tests.test_proxy_e2e import (
    RawConn,
    ThreadedServer,
    raw_error,
    read_body,
    read_request,
    serve,
    wait_for,
)

__all__ = ["serve"]  # the fixture, used by the tests below

StartProxy = Callable[..., Proxy]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], object]


def ws_request(path: str = "/ws") -> bytes:
    key = base64.b64encode(os.urandom(16))
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n").encode() + (
        b"Sec-WebSocket-Key: " + key + b"\r\n\r\n")


def switching_upstream(answer: bytes, after: list[bytes]) -> Handler:
    """Answers the first request with `answer`, then records in `after` every byte that
    arrives on that connection until it closes."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      conn_id: int) -> None:
        if await read_request(reader) is None:
            return
        writer.write(answer)
        await writer.drain()
        while data := await reader.read(65536):
            after.append(data)

    return handler


@pytest.mark.parametrize("answer", [
    # RFC 9110 7.8: a sender of Upgrade MUST also send the "upgrade" connection option;
    # RFC 6455 4.1: a client MUST fail the handshake without it. The proxy must not
    # make such a 101 valid by writing its own `Connection: upgrade` in front of it.
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\nConnection: keep-alive\r\nUpgrade: websocket\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n",
], ids=["no-connection", "connection-without-upgrade", "no-upgrade", "other-protocol"])
def test_invalid_101_is_not_a_tunnel(start_proxy: StartProxy,
                                     serve: Callable[..., ThreadedServer],
                                     answer: bytes) -> None:
    after: list[bytes] = []
    upstream = serve(switching_upstream(answer, after))
    proxy = start_proxy(simple_config(upstream.port))
    frame = b"\x81\x85" + b"\x00" * 4 + b"hello"  # a masked text frame
    with RawConn(proxy.port) as c:
        c.send(ws_request())
        raw_error(c.read_response(), 502, "upstream_bad_response")
        c.send(frame)  # now a (bad) HTTP/1.1 request to the proxy, never tunnel bytes
        assert c.read_response().status == 400
    assert wait_for(lambda: upstream.finished == 1, 5), "the upstream connection was kept"
    assert after == [], after


@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_request_body_after_an_early_101_keeps_its_framing(
        start_proxy: StartProxy, serve: Callable[..., ThreadedServer], framing: str) -> None:
    """An upstream may send its 101 before the request body has all come; the client
    still sends the rest of the body as HTTP/1.1 (RFC 9110 7.8: it cannot change protocol
    in the middle of a message), so the proxy must carry it in the framing it chose
    upstream, and only the bytes after the body are tunnel bytes."""
    got: dict[str, bytes] = {}

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      conn_id: int) -> None:
        request = await read_request(reader)
        if request is None:
            return
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n"
                     b"Upgrade: websocket\r\n\r\n")
        await writer.drain()
        got["body"] = await read_body(reader, request[2])
        got["tunnel"] = await reader.readexactly(3)
        writer.write(b"echo:" + got["tunnel"])
        await writer.drain()

    upstream = serve(handler)
    proxy = start_proxy(simple_config(upstream.port))
    if framing == "chunked":
        head, first, rest = b"Transfer-Encoding: chunked", b"a\r\nhello", b"world\r\n0\r\n\r\n"
    else:
        head, first, rest = b"Content-Length: 10", b"hello", b"world"
    with RawConn(proxy.port) as c:
        c.send(b"POST /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               + head + b"\r\n\r\n" + first)
        head = c.read_head()
        assert head.status == 101 and head.header("via") == "1.1 aiproxy", head
        c.send(rest + b"RAW")
        assert c.read_exact(8) == b"echo:RAW"
    assert got == {"body": b"helloworld", "tunnel": b"RAW"}


def test_upgrade_in_several_field_lines_is_offered_whole(
        start_proxy: StartProxy, serve: Callable[..., ThreadedServer]) -> None:
    """Upgrade split over two field lines is one list (RFC 9110 5.3): the upstream is
    offered both protocols, and its switch to the first one is a tunnel."""
    heads: list[dict[str, str]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      conn_id: int) -> None:
        request = await read_request(reader)
        if request is None:
            return
        heads.append(request[2])
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n"
                     b"Upgrade: websocket\r\n\r\n")
        await writer.drain()
        writer.write(b"echo:" + await reader.readexactly(3))
        await writer.drain()

    upstream = serve(handler)
    proxy = start_proxy(simple_config(upstream.port))
    with RawConn(proxy.port) as c:
        c.send(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Upgrade: foo/2\r\n\r\n")
        assert c.read_head().status == 101
        c.send(b"RAW")
        assert c.read_exact(8) == b"echo:RAW"
    assert heads[0]["upgrade"] == "websocket, foo/2"


@pytest.mark.parametrize("offer", [b"h2c/1", b"H2C/2.0", b"websocket, h2c/1"])
def test_h2c_with_a_version_is_not_offered_upstream(start_proxy: StartProxy,
                                                     serve: Callable[..., ThreadedServer],
                                                     offer: bytes) -> None:
    """h2c smuggling (Bishop Fox, 2020) with a protocol version on the token: the 101
    check compares protocol names, versions aside, so an `h2c/1` passed on would let an
    upstream's `101 ... Upgrade: h2c` through as a raw HTTP/2 tunnel past routing and
    policy. The proxy terminates HTTP/2 itself: no h2c offer of any version goes on."""
    heads: list[dict[str, str]] = []
    after: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      conn_id: int) -> None:
        request = await read_request(reader)
        if request is None:
            return
        heads.append(request[2])
        await read_body(reader, request[2])
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n"
                     b"Upgrade: h2c\r\n\r\n")
        await writer.drain()
        while data := await reader.read(65536):
            after.append(data)

    upstream = serve(handler)
    proxy = start_proxy(simple_config(upstream.port))
    with RawConn(proxy.port) as c:
        c.send(b"POST /x HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
               b"Upgrade: " + offer + b"\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
               b"Content-Length: 2\r\n\r\nhi")
        raw_error(c.read_response(), 502, "upstream_bad_response")
        c.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # never tunnel bytes: the proxy's 505
        assert c.read_response().status == 505
    assert wait_for(lambda: upstream.finished == 1, 5), "the upstream connection was kept"
    assert after == [], after
    assert "h2c" not in heads[0].get("upgrade", "").lower(), heads


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 426 Upgrade Required\r\nSec-WebSocket-Version: 13\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
], ids=["426", "200"])
def test_upgrade_refused_upstream_keeps_the_connection_http(
        start_proxy: StartProxy, serve: Callable[..., ThreadedServer], answer: bytes) -> None:
    """WebSocket smuggling (the Varnish case): an upstream that answers an Upgrade with
    anything but 101 has not switched, so what the client sends next is HTTP/1.1 to the
    proxy, routed like any request: here to no route (404), never to the upstream."""
    targets: list[str] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      conn_id: int) -> None:
        while (request := await read_request(reader)) is not None:
            targets.append(request[1])
            writer.write(answer)
            await writer.drain()

    upstream = serve(handler)
    proxy = start_proxy(simple_config(upstream.port).replace('path_prefix = "/"',
                                                              'path_prefix = "/ws"'))
    status = int(answer[9:12])
    with RawConn(proxy.port) as c:
        c.send(ws_request())
        assert c.read_response().status == status
        c.send(b"GET /internal HTTP/1.1\r\nHost: x\r\n\r\n")
        raw_error(c.read_response(), 404)
        c.send(ws_request())  # the connection serves on
        assert c.read_response().status == status
    assert targets == ["/ws", "/ws"]
