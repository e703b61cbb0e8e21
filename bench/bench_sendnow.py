"""Writes to a client: sendnow.Sender beside uvloop's own transport.write()/writelines().

Both run on a real uvloop TCP transport over 127.0.0.1 with nothing queued, the state
a keep-alive connection is in when its response goes out; each round also reads what
was sent on the peer socket, so the kernel's part is in both figures alike. The write
sizes are a small proxied response (head and body in one buffer) and a 16 KiB one
(head, then a view of the read slab).
"""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop
from aiproxy._fast.sendnow import Sender

HEAD = (b"HTTP/1.1 200 OK\r\nServer: nginx\r\nDate: Wed, 02 Dec 2026 01:00:00 GMT\r\n"
        b"Content-Type: text/plain\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n")
SLAB = bytearray(b"x" * 65536)


@pytest.fixture(scope="module")
def tcp_pair():
    """(uvloop TCP transport, the blocking peer socket that reads what it sends)."""
    loop = uvloop.new_event_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(listener.getsockname())
    ours, _ = listener.accept()
    listener.close()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)

    async def connect() -> asyncio.Transport:
        transport, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
        return transport

    transport = loop.run_until_complete(connect())
    yield transport, peer
    transport.close()
    loop.run_until_complete(asyncio.sleep(0))
    peer.close()
    loop.close()


def drain(peer: socket.socket, n: int, buf: bytearray) -> None:
    view = memoryview(buf)
    while n:
        n -= peer.recv_into(view[:n])


@pytest.mark.parametrize("writer", ["sender", "transport"])
def test_write_small_response(benchmark, tcp_pair, writer: str) -> None:
    transport, peer = tcp_pair
    write = Sender(transport).write if writer == "sender" else transport.write
    data = HEAD + b"ok"
    buf = bytearray(65536)

    def cycle() -> None:
        write(data)
        drain(peer, len(data), buf)

    benchmark(cycle)
    assert transport.get_write_buffer_size() == 0


@pytest.mark.parametrize("writer", ["sender", "transport"])
def test_writelines_16k_response(benchmark, tcp_pair, writer: str) -> None:
    transport, peer = tcp_pair
    writelines = Sender(transport).writelines if writer == "sender" else transport.writelines
    body = memoryview(SLAB)[:16384]
    n = len(HEAD) + len(body)
    buf = bytearray(65536)

    def cycle() -> None:
        writelines((HEAD, body))
        drain(peer, n, buf)

    benchmark(cycle)
    assert transport.get_write_buffer_size() == 0
