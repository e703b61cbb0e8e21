"""An HTTP/2 upstream's GOAWAY, with real sockets: the proxy lets go of the connection."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import httpx
import pytest
from h2.settings import SettingCodes
from hyperframe.frame import DataFrame, HeadersFrame

from tests.conftest import Proxy
from tests.h2_raw_upstream import RawConn, RawUpstream
from tests.h2_support import H2Upstream, default_handler, raw_frame
from tests.test_upstream_keepalive_race import read_response, state_of, tcp_sockets, wait_until

GOAWAY = 0x7
WINDOW_UPDATE = 0x8


async def goaway_when_idle(proto, sid: int, path: str, head: dict, body: bytes) -> None:
    """Answers as default_handler, then (the connection idle) sends GOAWAY naming the
    stream it just answered as the last one, and keeps the connection open: a graceful
    shutdown notice from an upstream that leaves the close to its client."""
    await default_handler(proto, sid, path, head, body)
    proto.flush()
    proto.transport.write(raw_frame(GOAWAY, 0, 0, struct.pack(">II", sid, 0)))


@pytest.fixture
def notifier() -> Iterator[H2Upstream]:
    up = H2Upstream(goaway_when_idle, name="notifier")
    yield up
    up.stop()


def test_idle_connection_closed_after_upstream_goaway(
    start_proxy: Callable[..., Proxy], notifier: H2Upstream
) -> None:
    proxy = start_proxy(f"""
[server]
workers = 1

[[clusters]]
name = "up"
protocol = "h2"
endpoints = ["127.0.0.1:{notifier.port}"]

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
""")
    with httpx.Client(timeout=10) as client:
        r = client.get(proxy.url + "/echo")
        assert r.status_code == 200 and json.loads(r.text)["upstream"] == "notifier"
        # The connection no longer takes streams and has none: the proxy closes it
        # rather than hold the socket (and a max_connections slot) until the upstream
        # happens to close it.
        assert notifier.wait_event("lost", 5) is not None, notifier.events
        # The next request opens a new connection and is answered.
        r = client.get(proxy.url + "/echo")
        assert r.status_code == 200
    assert notifier.connections == 2


IN_FLIGHT = 4


def open_at_most(up: H2Upstream) -> int:
    """The most connections the upstream had open at once (its made/lost events)."""
    n = most = 0
    with up.lock:
        for ev in up.events:
            if ev[1] == "made":
                n += 1
                most = max(most, n)
            elif ev[1] == "lost":
                n -= 1
    return most


@pytest.mark.parametrize(("limit", "answered", "most_open"), [
    # The GOAWAY'd connection is the one allowed: every replay gets 503.
    ("max_connections = 1", 1, 1),
    # One replay opens a connection (and is answered there); the others find it pending.
    ("max_pending = 1", 2, 2),
])
def test_goaway_replays_obey_connection_breakers(
    start_proxy: Callable[..., Proxy], limit: str, answered: int, most_open: int
) -> None:
    """RFC 9113 6.8: streams above the GOAWAY's last_stream_id were not processed and are
    replayed, through the same connection breakers as a first attempt. The GOAWAY'd
    connection still counts as open while it finishes its last stream."""
    held: dict[int, list[int]] = {}

    async def handler(proto, sid: int, path: str, head: dict, body: bytes) -> None:
        if not path.startswith("/burst") or (held and id(proto) not in held):
            return await default_handler(proto, sid, path, head, body)
        sids = held.setdefault(id(proto), [])
        sids.append(sid)
        if len(sids) < IN_FLIGHT:
            return  # answered below, or replayed by the proxy after the GOAWAY
        last = min(sids)
        proto.transport.write(raw_frame(GOAWAY, 0, 0, struct.pack(">II", last, 0)))
        await asyncio.sleep(0.2)  # the replays meet the connection still open
        await default_handler(proto, last, "/echo", head, b"")
        proto.flush()

    up = H2Upstream(handler, name="goaway")
    try:
        proxy = start_proxy(f"""
[server]
workers = 1

[[clusters]]
name = "up"
protocol = "h2"
endpoints = ["127.0.0.1:{up.port}"]
{limit}

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
""")

        async def run() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=IN_FLIGHT)
            async with httpx.AsyncClient(base_url=proxy.url, timeout=10,
                                         limits=limits) as client:
                # The upstream connection, open before the burst shares it.
                assert (await client.get("/echo")).status_code == 200
                burst = await asyncio.gather(*[client.get(f"/burst/{i}")
                                               for i in range(IN_FLIGHT)])
                # Once the GOAWAY'd connection is gone, a new one serves.
                assert up.wait_event("lost", 5) is not None, up.events
                after = await client.get("/echo")
                assert after.status_code == 200, after.text
                return burst

        burst = asyncio.run(run())
    finally:
        up.stop()
    statuses = sorted(r.status_code for r in burst)
    # The stream at last_stream_id is answered; the others are replayed, and those past
    # the limit get the documented 503 upstream_overflow.
    assert statuses == [200] * answered + [503] * (IN_FLIGHT - answered), [
        r.text for r in burst]
    for r in burst:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "upstream_overflow", r.text
    assert open_at_most(up) == most_open, up.events


POSTS = 8
# Replayable (under REPLAY_LIMIT); the 8 bodies together pass FLUSH_NOW.
POST = b"POST /once HTTP/1.1\r\nHost: t\r\nContent-Length: 40960\r\n\r\n" + b"p" * 40960


def epoll_waiting(pid: int) -> bool:
    with open(f"/proc/{pid}/wchan") as f:
        return f.read() == "do_epoll_wait"


def test_goaway_overtaken_by_a_reset_still_replays_streams_past_last_stream_id(
        start_proxy: Callable[..., Proxy]) -> None:
    """An upstream sends GOAWAY and resets the TCP connection (a server that stops with
    unread requests in its socket). A write of the proxy that meets the reset before its
    loop has read the GOAWAY loses the connection with ECONNRESET; the GOAWAY is still
    in the socket, and the streams above its last_stream_id were not processed (RFC 9113
    6.8): they are replayed, POSTs too, not failed with 502.

    The proxy is stopped (SIGSTOP) while the clients' POSTs, then the GOAWAY and the RST,
    reach its sockets: resumed, it reads the POSTs first (epoll reports sockets in the
    order they became readable) and their bodies, past FLUSH_NOW together, are written
    at once, before the upstream's socket is read."""
    go = threading.Event()
    answered: list[int] = []

    def script(conn: RawConn) -> None:
        conn.handshake({SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
        conn.send(raw_frame(WINDOW_UPDATE, 0, 0, (16 << 20).to_bytes(4, "big")))
        first = len(up.conns) == 1
        ok = [(b":status", b"200"), (b"content-length", b"2")]
        while True:
            if first and len(answered) == POSTS:
                break
            f = conn.recv(timeout=10 if first else 30)
            if f is None:
                return
            if "END_STREAM" in f.flags and isinstance(f, HeadersFrame | DataFrame):
                conn.send(conn.headers(f.stream_id, ok), conn.data(f.stream_id, b"ok", True))
                if first:
                    answered.append(f.stream_id)
        assert go.wait(30)
        # Sent at once, not held back by Nagle's algorithm behind the last response
        # (the close discards what the socket has not sent yet).
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.send(raw_frame(GOAWAY, 0, 0, struct.pack(">II", max(answered), 0)))
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.sock.close()

    up = RawUpstream(script)
    try:
        proxy = start_proxy(f"""
[server]
workers = 1

[[clusters]]
name = "up"
protocol = "h2"
endpoints = ["127.0.0.1:{up.port}"]

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
""")
        pid = proxy.proc.pid
        clients = [socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
                   for _ in range(POSTS)]
        readers = [c.makefile("rb") for c in clients]
        try:
            # Every client connection accepted and answered once over the upstream
            # connection: the POSTs below arrive on sockets the proxy already reads.
            for c, r in zip(clients, readers, strict=True):
                c.sendall(b"GET /warm HTTP/1.1\r\nHost: t\r\n\r\n")
                assert read_response(r) == b"HTTP/1.1 200 OK ok"
            assert len(up.conns) == 1
            ports = {c.getsockname()[1] for c in clients}
            # Stopped while waiting in epoll, not in the middle of a loop turn: a socket
            # just read is then no longer on epoll's ready list, where it would keep its
            # place ahead of the POSTs' sockets.
            wait_until(lambda: epoll_waiting(pid), "proxy not idle")
            os.kill(pid, signal.SIGSTOP)
            try:
                wait_until(lambda: state_of(pid) == "T", "proxy not stopped")
                for c in clients:
                    c.sendall(POST)
                wait_until(lambda: sum(rx for lp, rp, _, rx in tcp_sockets()
                                       if lp == proxy.port and rp in ports)
                           == POSTS * len(POST),
                           "the POSTs did not reach the proxy")
                go.set()
                wait_until(lambda: not any(rp == up.port and st == 1
                                           for _, rp, st, _ in tcp_sockets()),
                           "the GOAWAY and RST did not reach the proxy")
            finally:
                os.kill(pid, signal.SIGCONT)
            statuses = [read_response(r) for r in readers]
        finally:
            for r in readers:
                r.close()
            for c in clients:
                c.close()
    finally:
        up.stop()
    assert statuses == [b"HTTP/1.1 200 OK ok"] * POSTS, statuses
    assert not up.errors, up.errors
