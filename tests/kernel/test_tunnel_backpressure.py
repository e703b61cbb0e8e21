"""TunnelSplice hands reading back to the protocols without overriding their flow control.

The splice pauses both transports while it drains; the drain's writes can push a peer's
write buffer past its high-water mark, and the protocols' pause_writing then pauses the
other side (already paused by the splice). When the splice gives the transports back
(it fell back to copying, or was released), a side whose peer is still over its mark
must stay paused until the peer's resume_writing, or a fast sender fills the buffer of a
slow reader without bound. Real uvloop transports on 127.0.0.1, a real ProxyKernel.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvloop

from aiproxy.kernel.tunnel import TunnelSplice

FILL = 32 << 20  # well past what the client's socket buffers absorb


class FlowSide(asyncio.Protocol):
    """One side of a tunnel, with the flow control the proxy's tunnel protocols have:
    over my peer's write buffer's high-water mark, my reading stops."""

    def __init__(self, tunnel: Pair, side: int) -> None:
        self.tunnel, self.side = tunnel, side
        self.transport: asyncio.Transport | None = None
        self.ready = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.ready.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.tunnel.other(self).transport.write(data)

    def pause_writing(self) -> None:
        self.tunnel.other(self).transport.pause_reading()

    def resume_writing(self) -> None:
        other = self.tunnel.other(self)
        splice = self.tunnel.splice
        if splice is not None and splice.holds(other.side):
            return  # the splice has that side's reading (TunnelSplice.holds)
        other.transport.resume_reading()


class Pair:
    def __init__(self) -> None:
        self.down = FlowSide(self, 0)
        self.up = FlowSide(self, 1)
        self.splice: TunnelSplice | None = None

    def other(self, side: FlowSide) -> FlowSide:
        return self.up if side is self.down else self.down


def test_a_side_stays_paused_while_its_peer_is_over_its_mark(kernel):
    upstream = socket.create_server(("127.0.0.1", 0))
    got = {"client": 0}

    async def main() -> dict:
        loop = asyncio.get_running_loop()
        pair = Pair()
        server = await loop.create_server(lambda: pair.down, "127.0.0.1", 0)
        client = socket.create_connection(server.sockets[0].getsockname())
        await pair.down.ready
        await loop.create_connection(lambda: pair.up, *upstream.getsockname())
        conn, _ = upstream.accept()
        down, up = pair.down.transport, pair.up.transport
        try:
            # The client reads nothing yet: the client side's buffer goes over its mark
            # and its pause_writing stops the upstream's reading.
            down.write(b"x" * FILL)
            high = down.get_write_buffer_limits()[1]
            assert down.get_write_buffer_size() > high
            assert not up.is_reading()
            pair.splice = TunnelSplice(kernel, loop, down, up)
            pair.splice.release()  # while draining: both sides are handed back
            seen = {"up_reading": up.is_reading(), "down_reading": down.is_reading()}

            def read_all() -> None:
                while got["client"] < FILL and (chunk := client.recv(1 << 20)):
                    got["client"] += len(chunk)

            reader = threading.Thread(target=read_all, daemon=True)
            reader.start()
            deadline = time.monotonic() + 20
            while not up.is_reading() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            seen["up_reading_after_drain"] = up.is_reading()
            await asyncio.to_thread(reader.join, 20)
            return seen
        finally:
            for t in (down, up):
                t.close()
            client.close()
            conn.close()
            server.close()
            kernel.stop()
            await asyncio.sleep(0)

    seen = uvloop.run(main())
    upstream.close()
    assert seen["down_reading"]  # its peer (the upstream side) has nothing buffered
    assert not seen["up_reading"], "the splice resumed a side whose peer is over its mark"
    assert seen["up_reading_after_drain"]  # resume_writing gave it back
    assert got["client"] == FILL
