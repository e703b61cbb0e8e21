"""What clients see while the proxy drains on SIGTERM: keep-alive connections, HTTP/2
connections and requests cut at the drain deadline."""

from __future__ import annotations

import asyncio
import collections
import signal
import socket
import threading
import time

import pytest
from hyperframe.frame import GoAwayFrame

from tests.conftest import simple_config
from tests.h2_support import FrameClient
from tests.support import StreamServerThread

DRAIN = "[server]\nworkers = {workers}\ndrain_timeout_ms = 3000\n"
REQUEST = b"GET /delay/1 HTTP/1.1\r\nHost: x\r\n\r\n"


async def _keepalive_client(port: int, stats: collections.Counter,
                            stop: asyncio.Event, request: bytes) -> None:
    """One keep-alive connection sending requests back to back, counting how each ends."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        stats["connect failed"] += 1
        return
    try:
        while not stop.is_set():
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:-2])
            await reader.readexactly(int(fields[b"content-length"]))
            stats["ok"] += 1
            if fields.get(b"connection") == b"close":
                stats["closed after response"] += 1
                return
    except asyncio.IncompleteReadError:
        stats["lost request (EOF)"] += 1
    except ConnectionResetError:
        stats["lost request (RST)"] += 1
    finally:
        writer.close()


@pytest.mark.parametrize(("workers", "sig"), [(1, signal.SIGTERM), (2, signal.SIGTERM),
                                           (1, signal.SIGQUIT), (2, signal.SIGQUIT)],
                         ids=["1-TERM", "2-TERM", "1-QUIT", "2-QUIT"])
def test_keepalive_load_sees_connection_close_not_lost_requests(start_proxy, demo_upstream,
                                                                workers, sig):
    """Connections busy with back-to-back requests when SIGTERM (or SIGQUIT, nginx's
    graceful stop) comes each end with a
    response saying `Connection: close`: none has its next request cut off by a close
    (EOF) or a reset. The proxy answers these (404, no route) itself: quick answers
    leave each connection idle, between a response and the next request, most often."""
    proxy = start_proxy(DRAIN.format(workers=workers) + simple_config(demo_upstream)
                        .replace('path_prefix = "/"', 'path_prefix = "/up/"'))
    if workers > 1:
        proxy.workers()
    stats: collections.Counter = collections.Counter()

    async def scenario() -> None:
        stop = asyncio.Event()
        clients = [asyncio.create_task(
            _keepalive_client(proxy.port, stats, stop, b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n"))
                   for _ in range(16)]
        while stats["ok"] < 200:
            await asyncio.sleep(0.05)
        proxy.proc.send_signal(sig)
        done, _ = await asyncio.wait(clients, timeout=5)
        stop.set()
        assert len(done) == len(clients)

    asyncio.run(scenario())
    assert stats["closed after response"] == 16, dict(stats)
    assert proxy.proc.wait(10) == 0


def test_idle_keepalive_connection_gets_its_next_request_answered(start_proxy, demo_upstream):
    """A keep-alive connection idle when SIGTERM comes may have its next request on the
    way: a request sent shortly after is answered, with `Connection: close`."""
    proxy = start_proxy(DRAIN.format(workers=1) + simple_config(demo_upstream))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(REQUEST)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        proxy.proc.send_signal(signal.SIGTERM)
        _wait_refused(proxy.port)
        sock.sendall(REQUEST)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply
    assert b"\r\nconnection: close\r\n" in reply.lower()
    assert proxy.proc.wait(10) == 0


def _wait_refused(port: int) -> None:
    """Until the proxy has closed its listener (it drains)."""
    for _ in range(500):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return
        time.sleep(0.01)
    raise AssertionError("the listener is still open")


def test_h2_stream_crossing_the_drain_goaway_is_served(start_proxy, demo_upstream):
    """RFC 9113 6.8: GOAWAY(2^31-1) and a PING first, the GOAWAY naming the last stream
    after the PING's ACK. A stream the client sent before it read the first GOAWAY is
    served rather than refused; the connection closes after it."""
    proxy = start_proxy(DRAIN.format(workers=1) + simple_config(demo_upstream),
                        'protocols = ["http1", "h2c"]')
    with FrameClient(proxy.port) as client:
        client.handshake()
        client.send(client.request(1, "/delay/1"))
        assert client.response(1).status == 200
        proxy.proc.send_signal(signal.SIGTERM)
        _wait_refused(proxy.port)
        client.send(client.request(3, "/delay/1"))  # has not read the GOAWAY yet
        response = client.response(3)  # answers the PING on the way
        rest = client.frames_until(lambda frame: False, timeout=5)
    assert response.status == 200, response
    goaways = [response.goaway] + [f for f in rest if isinstance(f, GoAwayFrame)]
    assert [(g.last_stream_id, g.error_code) for g in goaways if g is not None] == [
        (2**31 - 1, 0), (3, 0)]
    assert client.eof
    assert proxy.proc.wait(10) == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_second_sigterm_ends_the_drain_at_once(start_proxy, workers):
    """SIGTERM drains (here for up to 10 minutes, a request held by its upstream); a
    second SIGTERM while draining cuts what is left and exits (nginx's fast stop). With
    workers the supervisor passes it on: a worker does not take its own second signal
    for one, as it also gets the group's SIGINT or systemd's SIGTERM."""
    arrived = threading.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        arrived.set()
        await asyncio.sleep(3600)  # never answers

    upstream = StreamServerThread(silent)
    try:
        proxy = start_proxy(
            f"[server]\nworkers = {workers}\ndrain_timeout_ms = 600000\n"
            + simple_config(upstream.port).replace('cluster = "up"',
                                                   'cluster = "up"\ntimeout_ms = 600000'))
        if workers > 1:
            wait_for_log(proxy, "aiproxy ready")
        client = socket.create_connection(("127.0.0.1", proxy.port))
        client.sendall(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
        assert arrived.wait(30), "the request did not reach the upstream"
        proxy.proc.send_signal(signal.SIGTERM)
        wait_for_log(proxy, "stopping:")
        proxy.proc.send_signal(signal.SIGTERM)
        assert proxy.proc.wait(120) == 0  # the drain alone would last 10 minutes
        log = proxy.log()
        assert "asked again to stop" in log, log
        assert "stopping now: closing 1 connections" in log, log
        client.close()
    finally:
        upstream.close()


def wait_for_log(proxy, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in proxy.log():
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{proxy.log()}"
        time.sleep(0.05)
