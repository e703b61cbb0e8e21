"""How an Upgrade (WebSocket) tunnel ended, in its access log line: `ended` says it as a
tcp listener's tunnel line does (eof, client_lost, upstream_lost, idle_timeout), so a
tunnel the proxy closed for idleness or the upstream cut is not logged like one that
closed cleanly (Envoy's access log flags the same endings: SI, UC, DC)."""

from __future__ import annotations

import asyncio
import signal
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosedError
from websockets.sync.client import connect as ws_connect

from tests.conftest import Proxy
from tests.test_access_log import _lines
from tests.test_proxy_e2e import RawConn, ThreadedServer, read_request, serve

__all__ = ["serve"]  # the fixture, used by the tests below

pytestmark = pytest.mark.timeout(60)

StartProxy = Callable[..., Proxy]


async def reset_after_first_bytes(reader: asyncio.StreamReader,
                                  writer: asyncio.StreamWriter, conn_id: int) -> None:
    """Switches to websocket at once (before any request body), then resets the
    connection (RST) once a byte came."""
    if await read_request(reader) is None:
        return
    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n"
                 b"Upgrade: websocket\r\n\r\n")
    await writer.drain()
    await reader.read(1)
    writer.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def config(demo: int, raw: int, log: Path) -> str:
    return f"""
[http]
tunnel_idle_timeout_ms = 1000

[access_log]
path = "{log}"
flush_interval_ms = 20

[[clusters]]
name = "demo"
endpoints = ["127.0.0.1:{demo}"]

[[clusters]]
name = "raw"
endpoints = ["127.0.0.1:{raw}"]

[[routes]]
name = "raw"
match = {{ path_prefix = "/raw" }}
cluster = "raw"

[[routes]]
name = "demo"
match = {{ path_prefix = "/" }}
cluster = "demo"
"""


UPGRADE = (b"HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")


def test_tunnel_line_says_how_it_ended(start_proxy: StartProxy, demo_upstream: int,
                                       serve: Callable[..., ThreadedServer],
                                       tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    raw = serve(reset_after_first_bytes)
    proxy = start_proxy(config(demo_upstream, raw.port, log))
    url = f"ws://127.0.0.1:{proxy.port}/ws"
    ended = []

    def last_line() -> dict:
        """The line of the tunnel just ended (each is awaited before the next starts)."""
        line = _lines(log, len(ended) + 1)[-1]
        assert line["status"] == 101, line
        ended.append(line.get("ended"))
        return line

    # eof: a close handshake, then both sides end their halves.
    with ws_connect(url, open_timeout=10, close_timeout=5) as ws:
        ws.send("hi")
        assert ws.recv(timeout=10) == "hi"
    last_line()
    # idle_timeout: nothing either way past tunnel_idle_timeout_ms (no pings).
    with ws_connect(url, open_timeout=10, ping_interval=None) as ws:
        ws.send("hi")
        assert ws.recv(timeout=10) == "hi"
        with pytest.raises(ConnectionClosedError):  # closed by the proxy, no close frame
            ws.recv(timeout=10)
    last_line()
    # upstream_lost: the upstream resets the tunnel.
    with RawConn(proxy.port) as c:
        c.send(b"GET /raw " + UPGRADE)
        assert c.read_head().status == 101
        c.send(b"x")
        assert c.read_to_eof() == b""
    assert last_line()["route"] == "raw"
    # client_lost: the client resets it.
    with RawConn(proxy.port) as c:
        c.send(b"GET /ws " + UPGRADE)
        assert c.read_head().status == 101
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    last_line()
    # request_body: a 101 before the request body, whose rest is not valid chunked coding.
    with RawConn(proxy.port) as c:
        c.send(b"POST /raw " + UPGRADE[:-2] + b"Transfer-Encoding: chunked\r\n\r\n")
        assert c.read_head().status == 101
        c.send(b"zz\r\n")
        assert c.read_to_eof() == b""
    assert last_line()["route"] == "raw"
    assert ended == ["eof", "idle_timeout", "upstream_lost", "client_lost", "request_body"]
    # A request that was no tunnel says nothing of the kind.
    with RawConn(proxy.port) as c:
        c.send(b"GET /echo/plain HTTP/1.1\r\nHost: x\r\n\r\n")
        assert c.read_response().status == 200
    assert "ended" not in _lines(log, 6)[-1]



def test_tunnel_cut_by_the_drain_deadline_says_drained(start_proxy: StartProxy,
                                                       demo_upstream: int,
                                                       tmp_path: Path) -> None:
    """A tunnel still open at the drain deadline is cut, and logged as such. Without an
    [admin] port nothing awaited between the cut and closing the access log, so the
    line of every connection cut there (tunnel or request) was lost."""
    log = tmp_path / "access.log"
    proxy = start_proxy(f"""
[server]
workers = 1
drain_timeout_ms = 500

[access_log]
path = "{log}"
flush_interval_ms = 20

[[clusters]]
name = "demo"
endpoints = ["127.0.0.1:{demo_upstream}"]

[[routes]]
name = "demo"
match = {{ path_prefix = "/" }}
cluster = "demo"
""")
    with ws_connect(f"ws://127.0.0.1:{proxy.port}/ws", open_timeout=10, close_timeout=1) as ws:
        ws.send("hi")
        assert ws.recv(timeout=10) == "hi"
        proxy.proc.send_signal(signal.SIGTERM)
        assert proxy.proc.wait(10) == 0
    [line] = _lines(log, 1)
    assert (line["status"], line.get("drained"), line.get("ended")) == (101, True, "drained"), line
