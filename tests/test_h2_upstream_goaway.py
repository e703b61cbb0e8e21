"""An HTTP/2 upstream's GOAWAY, with real sockets: the proxy lets go of the connection."""

from __future__ import annotations

import asyncio
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
