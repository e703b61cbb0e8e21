"""An HTTP/2 upstream's GOAWAY, with real sockets: the proxy lets go of the connection."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.conftest import Proxy
from tests.h2_support import H2Upstream, default_handler, raw_frame

GOAWAY = 0x7


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
