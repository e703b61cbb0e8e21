"""Connection breakers on an HTTP/2 cluster, with real sockets: requests share a
connection as streams, so max_connections bounds connections, not waiting requests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from tests.conftest import Proxy
from tests.h2_support import H2Upstream, default_handler


def config(port: int, limits: str) -> str:
    return f"""
[server]
workers = 1

[[clusters]]
name = "up"
protocol = "h2"
endpoints = ["127.0.0.1:{port}"]
{limits}

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
"""


def burst(proxy: Proxy, n: int) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10, limits=limits) as c:
            return await asyncio.gather(*[c.get(f"/echo?{i}") for i in range(n)])
    return asyncio.run(run())


@pytest.mark.parametrize("limits", ["max_connections = 1", "max_connections = 2"])
def test_a_cold_burst_shares_the_connection_being_opened(
    start_proxy: Callable[..., Proxy], limits: str
) -> None:
    """Eight requests arrive before the first connection is up: each waits for a stream
    on it (Envoy counts them as pending requests). They are not connections: with
    max_connections = 1 every one is answered, over one upstream connection."""
    # Its SETTINGS come late, so that every request arrives while the connection is
    # still being opened.
    up = H2Upstream(default_handler, name="h2", settings_delay=0.5)
    try:
        proxy = start_proxy(config(up.port, limits))
        answers = burst(proxy, 8)
        assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
        assert up.connections == 1
    finally:
        up.stop()


def test_max_connections_bounds_connections_past_the_stream_limit(
    start_proxy: Callable[..., Proxy]
) -> None:
    """An upstream that takes one stream at a time: past that, a request needs another
    connection, and max_connections = 2 lets two be open; the rest wait for a stream
    until connect_timeout_ms, or get 503 upstream_overflow. Never a third connection."""
    async def slow(proto, sid: int, path: str, head: dict, body: bytes) -> None:
        await asyncio.sleep(0.3)
        await default_handler(proto, sid, path, head, body)

    up = H2Upstream(slow, name="one-stream", max_streams=1)
    try:
        proxy = start_proxy(config(up.port, "max_connections = 2\nconnect_timeout_ms = 5000"))
        answers = burst(proxy, 6)
        codes = sorted(r.status_code for r in answers)
        assert set(codes) <= {200, 503}, [r.text for r in answers]
        assert codes.count(200) >= 2, codes
        for r in answers:
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "upstream_overflow", r.text
        assert up.connections <= 2, up.connections
    finally:
        up.stop()
