"""aiproxy_requests_total tells a response cut off by its upstream (or left by its
client) apart from a complete one, as the access log does (`upstream_error`,
`client_closed`): the `outcome` label."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import simple_config
from tests.support import admin_block, free_port, scrape, wait_port

pytestmark = pytest.mark.timeout(60)

CUT_LENGTH = (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
              b"Content-Length: 100\r\n\r\n" + b"x" * 10)
CUT_SSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n"
           b"d\r\ndata: alpha\n\n\r\n")
WHOLE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
STALL = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"y" * 10


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """/cut-length and /cut-sse: part of a response, then close; /stall: part of a
    response, then nothing; anything else: a whole response (keep-alive)."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1]
            if path == b"/cut-length" or path == b"/cut-sse":
                writer.write(CUT_LENGTH if path == b"/cut-length" else CUT_SSE)
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.close()
                return
            if path == b"/stall":
                writer.write(STALL)
                await writer.drain()
                await reader.read()  # until the proxy gives up on it
                writer.close()
                return
            writer.write(WHOLE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


@pytest.fixture
def cutting_upstream() -> Iterator[int]:
    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(asyncio.start_server(_handle, "127.0.0.1", port))
        started.set()
        loop.run_forever()
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(10)
    wait_port("127.0.0.1", port)
    yield port
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _key(status: str, outcome: str) -> tuple:
    return ("aiproxy_requests_total", (("cluster", "up"), ("outcome", outcome),
                                       ("route", "all"), ("status", status)))


def test_cut_off_responses_are_not_counted_as_plain_200s(start_proxy,
                                                          cutting_upstream: int) -> None:
    admin = free_port()
    proxy = start_proxy(simple_config(cutting_upstream) + admin_block(admin),
                        listener_extra='protocols = ["http1", "h2c"]')
    wait_port("127.0.0.1", admin)
    for http2 in (False, True):
        with httpx.Client(base_url=proxy.url, http1=not http2, http2=http2) as client:
            assert client.get("/whole").status_code == 200
            for path in ("/cut-length", "/cut-sse"):
                with pytest.raises(httpx.HTTPError):
                    client.get(path)
    # A client that leaves mid-body: the access log's client_closed.
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"GET /stall HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(admin)
        if samples.get(_key("200", "client_closed")) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert samples.get(_key("200", "complete")) == 2, samples
    assert samples.get(_key("200", "upstream_error")) == 4, samples
    assert samples.get(_key("200", "client_closed")) == 1, samples
    requests = {k: v for k, v in samples.items() if k[0] == "aiproxy_requests_total"}
    assert sum(requests.values()) == 7, requests


def test_upgrade_tunnels_are_counted_as_upgraded(start_proxy, demo_upstream: int) -> None:
    """A 101 is no whole response but the start of a tunnel: `upgraded`, however the
    tunnel ended (the access log's `ended` says how), never `complete` or
    `client_closed`."""
    from websockets.sync.client import connect as ws_connect

    admin = free_port()
    proxy = start_proxy(simple_config(demo_upstream) + admin_block(admin))
    wait_port("127.0.0.1", admin)
    with ws_connect(f"ws://127.0.0.1:{proxy.port}/ws", open_timeout=10, close_timeout=5) as ws:
        ws.send("hi")
        assert ws.recv(timeout=10) == "hi"
    # A client that resets its tunnel.
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 101 ")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(admin)
        requests = {k: v for k, v in samples.items() if k[0] == "aiproxy_requests_total"}
        if sum(requests.values()) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert requests == {_key("101", "upgraded"): 2}, requests
