"""Stopping health checks while one is in flight (reload, shutdown): the check waiting for
its turn is cancelled, the one mid-request finishes (within its timeout) and ends, and
nothing is left for the loop to complain about. Real sockets on 127.0.0.1: a TLS
endpoint that answers its handshake late with a certificate the check does not trust."""

from __future__ import annotations

import asyncio
import gc
import socket
import ssl
import threading
import time
from pathlib import Path

import uvloop

from aiproxy.config import Config, load_config_text
from aiproxy.routing import cluster as cluster_mod
from aiproxy.routing.cluster import Cluster, finish_checks
from tests.h2_support import make_pki


def serve_late(delay: float, handle) -> socket.socket:
    """A listener on 127.0.0.1 that takes one connection at a time and calls
    handle(conn) `delay` s after accepting it, in a thread of its own."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            time.sleep(delay)
            handle(conn)

    threading.Thread(target=serve, daemon=True).start()
    return listener


def late_tls_server(pki, delay: float) -> tuple[int, threading.Event]:
    """Waits `delay` s before its side of the TLS handshake. Its certificate is signed
    by a CA the check is not given."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki.cert, pki.key)
    handshakes = threading.Event()

    def handshake(conn: socket.socket) -> None:
        try:
            with ctx.wrap_socket(conn, server_side=True):
                pass
        except (OSError, ssl.SSLError):
            pass  # the client rejects the certificate: expected
        handshakes.set()

    return serve_late(delay, handshake).getsockname()[1], handshakes


def checked_cluster(port: int) -> Config:
    """One TLS cluster on `port` (no CA given: the default trust store) with health
    checks a minute apart, so a test sees exactly one."""
    return load_config_text(f"""
[[listeners]]
name = "l"
address = "127.0.0.1:1"
[[clusters]]
name = "c"
endpoints = ["127.0.0.1:{port}"]
tls = true
health_check = {{ path = "/", interval_ms = 60000, timeout_ms = 5000 }}
""", "t.toml")


async def in_flight(checks) -> asyncio.Task:
    """The one task of `checks` (a cluster's checker or poller) once its request is in
    flight."""
    deadline = time.monotonic() + 5
    while not checks.busy and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    (task,) = checks.busy
    return task


def test_stop_lets_a_tls_check_in_flight_finish(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    port, handshakes = late_tls_server(pki, delay=0.3)
    cfg = checked_cluster(port)
    loop = uvloop.new_event_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))

    async def main() -> None:
        c = Cluster(cfg.clusters[0], cfg.http, loop)
        c.start()
        task = await in_flight(c.checker)  # the check is waiting for the handshake
        c.close()
        assert c.checker is None and not task.cancelled()
        await finish_checks(10)
        assert task.done() and not task.cancelled()
        assert not cluster_mod._FINISHING
        # It ran until the endpoint's late handshake, and recorded nothing once stopped.
        assert handshakes.wait(5)
        assert c.pools[0].stats.hc_last == ""

    try:
        loop.run_until_complete(main())
        gc.collect()  # a future nobody retrieved is reported when it is collected
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    assert reported == [], reported


def test_stop_cancels_a_check_waiting_for_its_turn(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    port, _ = late_tls_server(pki, delay=0)
    cfg = checked_cluster(port)
    loop = uvloop.new_event_loop()

    async def main() -> None:
        c = Cluster(cfg.clusters[0], cfg.http, loop)
        c.start()
        checker = c.checker
        (task,) = checker.tasks
        deadline = time.monotonic() + 5
        while not c.pools[0].stats.hc_last and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert "connect failed" in c.pools[0].stats.hc_last  # first check done: sleeping
        c.close()
        await asyncio.sleep(0)
        assert task.cancelled()
        assert not cluster_mod._FINISHING

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_a_load_poll_stopped_midway_ends_without_waiting_its_interval() -> None:
    """The endpoint closes the poll's connection without an answer; the poller, stopped
    meanwhile, ends then rather than sleeping out interval_ms first (shutdown waits
    for it)."""
    listener = serve_late(0.3, socket.socket.close)
    cfg = load_config_text(f"""
[[listeners]]
name = "l"
address = "127.0.0.1:1"
[[clusters]]
name = "c"
endpoints = ["127.0.0.1:{listener.getsockname()[1]}"]
balancer = "llm_score"
load_metrics = {{ path = "/metrics", interval_ms = 5000, timeout_ms = 2000, gauge = "load" }}
""", "t.toml")
    loop = uvloop.new_event_loop()

    async def main() -> None:
        c = Cluster(cfg.clusters[0], cfg.http, loop)
        c.start()
        task = await in_flight(c.poller)
        c.close()
        await finish_checks(3)  # less than interval_ms
        assert task.done() and not task.cancelled()
        assert not cluster_mod._FINISHING

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        listener.close()
