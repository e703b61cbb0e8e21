"""TunnelSplice on a real uvloop loop when a direction's bytes beat the pair into the map.

The client's bytes reach its socket after that socket joined the kernel's map and before
the upstream socket has (JoinRace makes the window certain). The verdict passes them, and
the rest of that direction, to user space; TunnelSplice must copy that direction itself,
in order, to the end, and without waiting for the client's FIN. The two protocols below
do what the proxy's tunnel protocols do: copy while the tunnel is not spliced, and on
EOF half-close the peer once TunnelSplice.after_flush says the kernel is done.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading

import uvloop

from aiproxy.kernel.lifecycle import ProxyKernel
from aiproxy.kernel.tunnel import DOWN_TO_UP, UP_TO_DOWN, TunnelSplice
from tests.kernel.test_splice import JoinRace

SIZE = 4 << 20
WINDOW = b"sent while only the client socket is in the map;"


class Side(asyncio.Protocol):
    def __init__(self, tunnel: Tunnel, direction: int) -> None:
        self.tunnel, self.direction = tunnel, direction
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.tunnel.peer_of(self).write(data)

    def eof_received(self) -> bool:
        self.tunnel.eof(self)
        return True

    def connection_lost(self, exc) -> None:
        self.tunnel.lost(exc)


class Tunnel:
    def __init__(self, loop, kernel: ProxyKernel, upstream_port: int) -> None:
        self.loop, self.kernel, self.upstream_port = loop, kernel, upstream_port
        self.down: Side | None = None
        self.up: Side | None = None
        self.splice: TunnelSplice | None = None
        self.eofs = 0
        self.done = loop.create_future()

    def accepted(self) -> Side:
        self.down = Side(self, DOWN_TO_UP)
        self.loop.create_task(self._connect())
        return self.down

    async def _connect(self) -> None:
        _, self.up = await self.loop.create_connection(
            lambda: Side(self, UP_TO_DOWN), "127.0.0.1", self.upstream_port)
        self.splice = TunnelSplice(self.kernel, self.loop, self.down.transport,
                                   self.up.transport)

    def peer_of(self, side: Side) -> asyncio.Transport:
        return (self.up if side is self.down else self.down).transport

    def eof(self, side: Side) -> None:
        self.splice.after_flush(side.direction, lambda: self._half_close(side))

    def _half_close(self, side: Side) -> None:
        self.peer_of(side).write_eof()
        self.eofs |= side.direction
        if self.eofs == DOWN_TO_UP | UP_TO_DOWN:
            self.splice.release()
            self.down.transport.close()
            self.up.transport.close()
            if not self.done.done():
                self.done.set_result(None)

    def lost(self, exc) -> None:
        if not self.done.done() and exc is not None:
            self.done.set_exception(exc)


def _receive(sock: socket.socket, out: dict, key: str) -> None:
    h, n = hashlib.sha256(), 0
    while chunk := sock.recv(1 << 20):
        h.update(chunk)
        n += len(chunk)
    out[key] = (n, h.hexdigest())


def test_passed_direction_is_copied_in_order(kernel):
    upstream = socket.create_server(("127.0.0.1", 0))
    up_data, down_data = os.urandom(SIZE), os.urandom(SIZE)
    got: dict = {}
    window_sent = threading.Event()

    upstream_has_all = threading.Event()

    def serve() -> None:
        # Everything the client sent must arrive while its side is still open: a copy
        # that waits for the client's FIN would stall a live tunnel.
        conn, _ = upstream.accept()
        conn.settimeout(20)
        h, n = hashlib.sha256(), 0
        while n < len(WINDOW) + SIZE and (chunk := conn.recv(1 << 20)):
            h.update(chunk)
            n += len(chunk)
        got["upstream"] = (n, h.hexdigest())
        upstream_has_all.set()
        conn.sendall(down_data)
        conn.shutdown(socket.SHUT_WR)
        got["upstream_eof"] = conn.recv(1)
        conn.close()

    async def main() -> TunnelSplice:
        loop = asyncio.get_running_loop()
        tunnel = Tunnel(loop, kernel, upstream.getsockname()[1])
        server = await loop.create_server(tunnel.accepted, "127.0.0.1", 0)
        client = socket.create_connection(server.sockets[0].getsockname())
        racer = JoinRace(client, WINDOW)
        racer.after_window = window_sent.set
        kernel.splicer.close()
        kernel.splicer = racer

        def talk() -> None:
            reader = threading.Thread(target=_receive, args=(client, got, "client"))
            reader.start()
            window_sent.wait(10)
            client.sendall(up_data)
            upstream_has_all.wait(20)
            client.shutdown(socket.SHUT_WR)
            reader.join(30)

        threads = [threading.Thread(target=serve), threading.Thread(target=talk)]
        for th in threads:
            th.start()
        try:
            await asyncio.wait_for(tunnel.done, 30)
        finally:
            for th in threads:
                await asyncio.to_thread(th.join, 30)
            client.close()
            server.close()
            kernel.stop()  # closes the racer, and the hang-up watch on this loop
            await asyncio.sleep(0)
        return tunnel.splice

    splice = uvloop.run(main())
    upstream.close()
    sent = WINDOW + up_data
    assert got["upstream"] == (len(sent), hashlib.sha256(sent).hexdigest())
    assert got["client"] == (SIZE, hashlib.sha256(down_data).hexdigest())
    assert got["upstream_eof"] == b""
    assert splice.was_spliced
    # client -> upstream was copied by the tunnel, all of it (the upstream's bytes may
    # have beaten the arming too: its direction is then copied as well, or else the
    # kernel carried it).
    assert splice.copied[0] == len(sent)
    assert splice.moved()[0] == len(sent)
