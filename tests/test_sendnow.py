"""Writes that go to the socket at once (aiproxy/_fast/sendnow.pyx), on real uvloop
transports over 127.0.0.1: what goes out at once, what waits in the transport's queue,
and that no byte ever overtakes another."""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import uvloop
from aiproxy._fast.sendnow import Sender

from tests.h2_support import make_pki


class Recorder(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.made = asyncio.get_running_loop().create_future()
        self.lost = asyncio.get_running_loop().create_future()
        self.paused = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.made.set_result(transport)

    def data_received(self, data: bytes) -> None:
        pass

    def pause_writing(self) -> None:
        self.paused += 1

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


def run(body: Callable[[Recorder, socket.socket], Awaitable[None]],
        server_ssl: ssl.SSLContext | None = None,
        client_ssl: ssl.SSLContext | None = None) -> None:
    """body(protocol, client socket) with a uvloop server connection from a plain
    (blocking, or TLS-wrapped) client socket."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        proto = Recorder()
        server = await loop.create_server(lambda: proto, "127.0.0.1", 0, ssl=server_ssl)
        port = server.sockets[0].getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        if client_ssl is not None:
            client.setblocking(False)
            client = client_ssl.wrap_socket(client, do_handshake_on_connect=False)
            while True:
                try:
                    client.do_handshake()
                    break
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    await asyncio.sleep(0.005)
            client.setblocking(True)
        try:
            await asyncio.wait_for(proto.made, 10)
            await body(proto, client)
        finally:
            client.close()
            if proto.transport is not None:
                proto.transport.abort()
            server.close()
            await server.wait_closed()

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


async def read_exactly(sock: socket.socket, n: int) -> bytes:
    """Read n bytes from a blocking socket without blocking the loop for long."""
    loop = asyncio.get_running_loop()
    out = bytearray()
    while len(out) < n:
        chunk = await loop.run_in_executor(None, sock.recv, min(1 << 20, n - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def test_writes_on_plain_tcp_leave_at_once() -> None:
    async def body(proto: Recorder, client: socket.socket) -> None:
        t = proto.transport
        tx = Sender(t)
        assert tx.direct
        slab = bytearray(b"0123456789" * 10)
        tx.write(b"head ")
        assert t.get_write_buffer_size() == 0  # sent, nothing left queued
        tx.write(memoryview(slab)[10:20])
        tx.write(bytearray(b" ba "))
        tx.writelines((b"[", memoryview(slab)[:5], b"", bytearray(b"]")))
        tx.write(b"")
        tx.writelines(())
        assert t.get_write_buffer_size() == 0
        assert (tx.sent_now, tx.sent_queued) == (4, 0)
        want = b"head 0123456789 ba [01234]"
        assert await read_exactly(client, len(want)) == want

    run(body)


def test_nothing_overtakes_bytes_the_transport_holds() -> None:
    """Bytes the transport holds (here: what a 4 KiB send buffer did not take of a
    transport.write()) go out first; Sender's writes queue behind them until the
    transport reports nothing queued, and go at once again after that."""
    big = bytes(range(256)) * 1024  # 256 KiB

    async def body(proto: Recorder, client: socket.socket) -> None:
        t = proto.transport
        t.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        t.write(big)
        assert t.get_write_buffer_size() > 0
        tx = Sender(t)
        tx.write(b"second ")
        tx.writelines((b"third ", b"fourth "))
        assert (tx.sent_now, tx.sent_queued) == (0, 2)
        want = big + b"second third fourth "
        assert await read_exactly(client, len(want)) == want
        for _ in range(1000):  # libuv's write callback runs in a later loop pass
            if t.get_write_buffer_size() == 0:
                break
            await asyncio.sleep(0.001)
        assert t.get_write_buffer_size() == 0
        tx.write(b"fifth")
        assert tx.sent_now == 1
        assert await read_exactly(client, 5) == b"fifth"

    run(body)


def test_bytes_written_through_the_transport_are_not_overtaken() -> None:
    """The Sender asks the transport whether it holds bytes only after bytes went to
    transport.write(): through() is that way for writes that must queue (an error
    response, a 100 Continue). What a 4 KiB send buffer did not take of it goes out
    before the Sender's later writes, which go at once again once it drained."""
    big = bytes(range(256)) * 1024  # 256 KiB

    async def body(proto: Recorder, client: socket.socket) -> None:
        t = proto.transport
        t.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        tx = Sender(t)
        tx.write(b"first ")
        assert (tx.sent_now, tx.sent_queued) == (1, 0)
        tx.through(big)
        assert t.get_write_buffer_size() > 0
        tx.write(b"second ")
        tx.writelines((b"third ", b"fourth "))
        assert (tx.sent_now, tx.sent_queued) == (1, 2)
        want = b"first " + big + b"second third fourth "
        assert await read_exactly(client, len(want)) == want
        for _ in range(1000):  # libuv's write callback runs in a later loop pass
            if t.get_write_buffer_size() == 0:
                break
            await asyncio.sleep(0.001)
        tx.write(b"fifth")
        tx.writelines((b" sixth",))
        assert (tx.sent_now, tx.sent_queued) == (3, 2)
        assert await read_exactly(client, 11) == b"fifth sixth"

    run(body)


@pytest.mark.parametrize("module", ["http1.py", "h1_upstream.py"])
def test_protocols_with_a_sender_write_only_through_it(module: str) -> None:
    """A transport.write() the Sender does not see could leave bytes queued that its
    next direct send would overtake: the protocols that own a Sender write through it."""
    source = (Path(__file__).resolve().parent.parent / "aiproxy" / "protocols" / module)
    text = source.read_text()
    assert "Sender(" in text
    raw = [line for line in text.splitlines()
           if re.search(r"transport\.write(lines)?\b(?!_)", line.split("#", 1)[0])]
    assert raw == []


def test_what_the_kernel_does_not_take_waits_in_order() -> None:
    """A peer that does not read: the kernel takes part of a write, the rest (of a bytes,
    a bytearray view, or a piece in the middle of writelines) waits in the transport,
    flow control sees it, and later writes queue behind it."""
    big = bytes(range(256)) * 4096  # 1 MiB
    slab = bytearray(b"S" * 300_000)

    async def body(proto: Recorder, client: socket.socket) -> None:
        t = proto.transport
        t.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        tx = Sender(t)
        tx.write(big)
        assert tx.sent_queued == 1 and t.get_write_buffer_size() > 0
        assert proto.paused == 1  # over the 64 KiB high-water mark
        tx.writelines((b"<", memoryview(slab), b">"))
        tx.write(b"end")
        assert tx.sent_now == 0 and tx.sent_queued == 3
        want = big + b"<" + bytes(slab) + b">end"
        assert await read_exactly(client, len(want)) == want

    run(body)
    # writelines cut inside its second piece
    async def cut(proto: Recorder, client: socket.socket) -> None:
        t = proto.transport
        t.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        tx = Sender(t)
        tx.writelines((b"a" * 10, memoryview(slab), b"z" * 10))
        assert tx.sent_queued == 1 and 0 < t.get_write_buffer_size() < len(slab) + 20
        want = b"a" * 10 + bytes(slab) + b"z" * 10
        assert await read_exactly(client, len(want)) == want

    run(cut)


def test_many_pieces_go_through_the_transport() -> None:
    async def body(proto: Recorder, client: socket.socket) -> None:
        tx = Sender(proto.transport)
        pieces = [b"%d," % i for i in range(40)]
        tx.writelines(pieces)
        assert tx.sent_queued == 1
        want = b"".join(pieces)
        assert await read_exactly(client, len(want)) == want

    run(body)


def test_after_close_writes_are_dropped_as_the_transport_drops_them() -> None:
    async def body(proto: Recorder, client: socket.socket) -> None:
        t = proto.transport
        tx = Sender(t)
        tx.write(b"before")
        t.close()
        tx.write(b"after")
        assert await asyncio.wait_for(proto.lost, 10) is None
        assert await read_exactly(client, 100) == b"before"

    run(body)


def test_detach_stops_direct_writes() -> None:
    async def body(proto: Recorder, client: socket.socket) -> None:
        tx = Sender(proto.transport)
        tx.detach()
        assert not tx.direct
        tx.write(b"queued")
        assert tx.sent_queued == 1
        assert await read_exactly(client, 6) == b"queued"

    run(body)


def test_a_send_error_closes_the_connection_the_transport_way() -> None:
    """The peer resets the connection: the failed send is handed to the transport,
    which meets the error itself and reports it through connection_lost."""
    async def body(proto: Recorder, client: socket.socket) -> None:
        t = proto.transport
        tx = Sender(t)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # RST
        time.sleep(0.05)  # arrived, and no loop pass has seen it yet
        tx.write(b"x" * 1000)
        assert tx.sent_queued == 1
        exc = await asyncio.wait_for(proto.lost, 10)
        assert isinstance(exc, (ConnectionResetError, BrokenPipeError))

    run(body)


def tls_contexts(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context and a client context that trusts it (no host name check)."""
    pki = make_pki(tmp_path / "pki")
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(pki.cert, pki.key)
    client = ssl.create_default_context(cafile=str(pki.ca))
    client.check_hostname = False
    return server, client


def test_tls_transports_are_never_written_directly(tmp_path: Path) -> None:
    server, client = tls_contexts(tmp_path)

    async def body(proto: Recorder, sock: socket.socket) -> None:
        tx = Sender(proto.transport)
        assert not tx.direct  # the TLS transport has a socket, but bytes must be sealed
        tx.write(b"sealed")
        tx.writelines((b" and ", b"sent"))
        assert tx.sent_now == 0
        assert await read_exactly(sock, 15) == b"sealed and sent"

    run(body, server_ssl=server, client_ssl=client)


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
def test_every_buffer_kind_arrives_whole(kind: str) -> None:
    data = bytes(range(256)) * 64

    async def body(proto: Recorder, client: socket.socket) -> None:
        tx = Sender(proto.transport)
        piece = {"bytes": data, "bytearray": bytearray(data),
                 "memoryview": memoryview(bytearray(data))}[kind]
        tx.write(piece)
        tx.writelines((piece, piece))
        assert await read_exactly(client, 3 * len(data)) == data * 3

    run(body)


def test_writes_to_a_closing_tls_transport_are_dropped_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """uvloop's TLS transport drops what is written once it is closing, and from the
    sixth such write on logs "SSL connection is closed" for each: Sender drops it
    first (a response streamed to a client that left filled the log with them)."""
    server, client = tls_contexts(tmp_path)

    async def body(proto: Recorder, sock: socket.socket) -> None:
        t = proto.transport
        tx = Sender(t)
        tx.write(b"sealed")
        t.close()
        assert t.is_closing()
        for _ in range(20):
            tx.write(b"late")
            tx.writelines((b"late", b"r"))
        assert await read_exactly(sock, 100) == b"sealed"

    with caplog.at_level("WARNING", logger="asyncio"):
        run(body, server_ssl=server, client_ssl=client)
    assert "SSL connection is closed" not in caplog.text
