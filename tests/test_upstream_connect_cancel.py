"""An upstream connect abandoned just as it completes must not leave a phantom in the
pool's open_count (the upstream_connections_open gauge and the max_connections breaker).

uvloop's create_connection(), cancelled after the protocol's connection_made() ran but
before it returned, closes the socket without calling connection_lost(). In the proxy the
cancel comes from a client that goes away (RST_STREAM, FIN) or from connect_timeout_ms;
the soak probe saw the gauge stuck at 28 with no upstream socket open. Here the cancel
is sent from connection_made() itself, so it lands in that window every time."""

from __future__ import annotations

import asyncio
import gc
import os

import pytest
import uvloop

from aiproxy.config.schema import ClusterConfig, Endpoint, HttpConfig
from aiproxy.protocols.h1_upstream import H1UpstreamConnection
from aiproxy.protocols.h2_upstream import H2UpstreamConnection
from aiproxy.routing.pool import H2Pool, Pool, open_connection

N = 20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("protocol", ["http1", "h2"])
def test_connect_cancelled_after_connection_made_leaves_no_open_count(
        protocol: str, caplog: pytest.LogCaptureFixture) -> None:
    pool_type, conn_type = {"http1": (Pool, H1UpstreamConnection),
                            "h2": (H2Pool, H2UpstreamConnection)}[protocol]

    async def main() -> tuple[int, int, int, int]:
        accepted: list[asyncio.StreamWriter] = []
        server = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        endpoint = Endpoint("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        cfg = ClusterConfig(name="up", endpoints=(endpoint,), protocol=protocol)
        pool = pool_type(loop, endpoint, cfg, HttpConfig())
        made = 0
        task: asyncio.Task | None = None

        class AbandonedOnConnect(conn_type):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                nonlocal made
                super().connection_made(transport)
                made += 1
                task.cancel()  # the request goes away as the TCP connect completes

        fds_before = open_fds()
        for _ in range(N):
            task = asyncio.ensure_future(open_connection(pool, AbandonedOnConnect))
            with pytest.raises(asyncio.CancelledError):
                await task
        for w in accepted:  # the server's ends (same process)
            w.close()
        for _ in range(3):  # let the closes and any connection_lost() scheduled run
            await asyncio.sleep(0)
        fds_after = open_fds()
        server.close()
        await server.wait_closed()
        return made, pool.open_count, fds_before, fds_after

    made, open_count, fds_before, fds_after = uvloop.run(main())
    gc.collect()  # an exception set on a future no one awaits is logged when it is freed
    assert made == N  # each connect did complete: the cancel came after connection_made
    assert fds_after == fds_before  # the sockets are closed either way...
    assert open_count == 0  # ...and the pool counts none of them as open
    assert "never retrieved" not in caplog.text
