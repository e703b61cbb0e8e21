"""An HTTP/1.1 Upgrade (WebSocket) request routed to a `protocol = "h2"` cluster.

HTTP/2 has no Upgrade (RFC 9113 8.6) and the proxy does not speak RFC 8441's extended
CONNECT to upstreams, so the upgrade cannot be carried: it is refused with 501 and a
JSON body that says why, and never goes upstream as a plain GET. `Upgrade: h2c` is
the proxy's own to take or ignore, and does not count."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from tests.h2_support import H2Upstream
from tests.support import free_port, raw_exchange

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def h2up() -> Iterator[H2Upstream]:
    up = H2Upstream(name="h2-upgrade")
    yield up
    up.stop()


def _records(log: Path, n: int) -> list[dict]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        if len(lines) >= n:
            return [json.loads(x) for x in lines]
        time.sleep(0.02)
    raise AssertionError(f"expected {n} access log lines")


def test_websocket_to_h2_cluster_is_refused_not_downgraded(start_proxy, h2up: H2Upstream,
                                                           tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    admin = free_port()
    proxy = start_proxy(f"""
        [[clusters]]
        name = "h2up"
        endpoints = ["127.0.0.1:{h2up.port}"]
        protocol = "h2"

        [[routes]]
        name = "ws"
        cluster = "h2up"

        [admin]
        address = "127.0.0.1:{admin}"

        [access_log]
        path = "{log}"
        flush_interval_ms = 20
        """)

    async def ws() -> int:
        with pytest.raises(InvalidStatus) as info:
            async with websockets.connect(f"ws://127.0.0.1:{proxy.port}/ws", open_timeout=10):
                pass
        return info.value.response.status_code

    assert asyncio.run(ws()) == 501
    raw = raw_exchange(proxy.port, b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                       b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                       b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
                       b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 501 "), raw
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    error = json.loads(rest[:length])["error"]
    assert error["code"] == "upgrade_not_supported", error
    assert "HTTP/2" in error["message"] and "websocket" in error["message"], error
    # The connection serves on: the request behind it went upstream, as a plain GET.
    assert rest[length:].startswith(b"HTTP/1.1 200 "), rest
    # Upgrade: h2c (what curl --http2 sends) is not an upgrade the upstream is asked for.
    raw = raw_exchange(proxy.port, b"GET /echo HTTP/1.1\r\nHost: x\r\n"
                       b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                       b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nConnection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 200 "), raw

    paths = [dict(ev[3])[b":path"] for ev in h2up.events if ev[1] == "request"]
    assert paths == [b"/echo", b"/echo"], paths  # no /ws ever reached the upstream
    recs = _records(log, 4)
    # By path, not in log order: the websockets client's record is written when its
    # connection goes, which under load can come after the raw connection's.
    assert sorted((r["path"], r["status"]) for r in recs) == [
        ("/echo", 200), ("/echo", 200), ("/ws", 501), ("/ws", 501)], recs
    assert all(r["cluster"] == "h2up" for r in recs)
    metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
    assert ('aiproxy_requests_total{cluster="h2up",outcome="complete",route="ws",status="501"} 2.0'
            in metrics), metrics
