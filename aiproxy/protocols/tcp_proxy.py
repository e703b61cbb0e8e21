"""Raw TCP listeners (``protocols = ["tcp"]``, ``cluster = "name"``): each accepted
connection is joined to one endpoint of the cluster and bytes go both ways unchanged.

A side that sends before both are connected is paused after its first read and that
read is written to the peer first; then the pair goes to the kernel ([kernel]
splice_tunnels, the same TunnelSplice as Upgrade tunnels, which waits for both write
buffers to drain). On the copy path (no splicing, or it failed) a side stops being
read while its peer's write buffer is above the high-water mark. An EOF one way
half-closes the other side (once the kernel has flushed what it redirected before it);
after both EOFs, or when either side is lost, both are closed.

Endpoint choice: the cluster's balancer; a refused or failed connect tries one other
endpoint, a connect timeout closes the client. Graceful stop leaves tunnels running
until the server's drain timeout aborts them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from aiproxy.kernel.tunnel import BOTH, DOWN_TO_UP, UP_TO_DOWN

if TYPE_CHECKING:
    from aiproxy.routing.cluster import Cluster
    from aiproxy.routing.pool import EndpointPool

log = logging.getLogger("aiproxy.tcp")

CONNECT_ATTEMPTS = 2


class TcpProxyConnection(asyncio.Protocol):
    """The client side of one raw TCP tunnel (owns the tunnel)."""

    __slots__ = ("server", "cluster_name", "loop", "transport", "upstream", "splice",
                 "eofs", "closed", "task", "early", "early_eofs")

    def __init__(self, server: Any, cluster_name: str) -> None:
        self.server = server
        self.cluster_name = cluster_name
        self.loop: asyncio.AbstractEventLoop = server.loop
        self.transport: asyncio.Transport | None = None
        self.upstream: TcpUpstream | None = None
        self.splice: Any = None  # aiproxy.kernel.tunnel.TunnelSplice when spliced
        self.eofs = 0  # DOWN_TO_UP: the client sent EOF; UP_TO_DOWN: the upstream did
        self.closed = False
        self.task: asyncio.Task | None = None
        self.early: list[bytes] = []  # read from the client before the upstream was linked
        self.early_eofs = 0

    # -- client transport callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self.task = self.loop.create_task(self._connect())

    def data_received(self, data: bytes) -> None:
        up = self.upstream
        if up is not None:
            up.transport.write(data)
        else:  # still connecting (uvloop starts reading after connection_made)
            self.early.append(data)
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        if self.upstream is None:
            self.early_eofs |= DOWN_TO_UP
        else:
            self._on_eof(DOWN_TO_UP)
        return True  # keep the other direction open

    def pause_writing(self) -> None:
        up = self.upstream
        if up is not None and up.transport is not None:
            up.transport.pause_reading()

    def resume_writing(self) -> None:
        up = self.upstream
        if up is not None and up.transport is not None and not self.eofs & UP_TO_DOWN:
            up.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.task is not None:
            self.task.cancel()
            self.task = None
        self._close()

    def drain(self) -> None:
        """Graceful stop: a tunnel runs on until the drain timeout aborts it."""

    # -- connecting ------------------------------------------------------------------

    async def _connect(self) -> None:
        try:
            up = await self._open_upstream()
        finally:
            self.task = None
        if up is None:
            self._close()
            return
        if self.closed:
            up.transport.close()
            return
        self.upstream = up
        # What was read before the link goes out first (the splice below waits until
        # both write buffers are empty before the kernel takes over).
        if self.early:
            up.transport.write(b"".join(self.early))
            self.early.clear()
        if up.early:
            self.transport.write(b"".join(up.early))
            up.early.clear()
        eofs = self.early_eofs | up.early_eofs
        kernel = getattr(self.server, "kernel", None)
        if kernel is not None:
            # [kernel] splice_tunnels (counts the tunnel as spliced or copied); the
            # splice resumes both transports itself if it falls back to copying.
            self.splice = kernel.splice_tunnel(self.loop, self.transport, up.transport)
        if self.splice is None:
            for side, t in ((DOWN_TO_UP, self.transport), (UP_TO_DOWN, up.transport)):
                if not eofs & side:
                    t.resume_reading()
        for side in (DOWN_TO_UP, UP_TO_DOWN):
            if eofs & side and not self.closed:
                self._on_eof(side)

    async def _open_upstream(self) -> TcpUpstream | None:
        cluster: Cluster | None = self.server.runtime.clusters.get(self.cluster_name)
        if cluster is None:
            log.warning("tcp: cluster %r is gone; closing the client", self.cluster_name)
            return None
        tried: tuple = ()
        for _ in range(CONNECT_ATTEMPTS):
            pool = cluster.pick(None, tried)
            if pool is None:
                break
            overflow = cluster.connect_overflow()
            if overflow is not None:
                log.info("tcp: %s; closing the client", overflow)
                return None
            tried += (pool,)
            address = pool.endpoint.address
            timeout = pool.cluster_cfg.connect_timeout_ms / 1000
            cluster.pending += 1
            try:
                async with asyncio.timeout(timeout):
                    _, up = await self.loop.create_connection(
                        lambda p=pool: TcpUpstream(self, p), pool.host, pool.port)
            except TimeoutError:
                cluster.record(pool, True)
                log.info("tcp: connect to %s timed out; closing the client", address)
                return None
            except OSError as exc:
                cluster.record(pool, True)
                log.info("tcp: connect to %s failed: %s", address, exc.strerror or exc)
                continue
            finally:
                cluster.pending -= 1
            cluster.record(pool, False)
            return up
        return None

    # -- both sides ------------------------------------------------------------------

    def _on_eof(self, which: int) -> None:
        if self.splice is not None:
            # Half-close only after the kernel has written out what it redirected first.
            self.splice.after_flush(which, lambda: self._half_close(which))
        else:
            self._half_close(which)

    def _half_close(self, which: int) -> None:
        self.eofs |= which
        if self.eofs == BOTH:
            self._close()
            return
        up = self.upstream
        peer = (up.transport if up is not None else None) if which == DOWN_TO_UP \
            else self.transport
        if peer is None or peer.is_closing():
            self._close()
        elif peer.can_write_eof():
            peer.write_eof()
        else:
            self._close()

    def upstream_lost(self) -> None:
        self._close()

    def _close(self) -> None:
        """Both sides done (or one lost): out of the kernel, then close both (close()
        still writes out what is buffered)."""
        if self.closed:
            return
        self.closed = True
        splice, self.splice = self.splice, None
        if splice is not None:
            splice.release()
        up, self.upstream = self.upstream, None
        if up is not None and up.transport is not None:
            up.transport.close()
        if self.transport is not None:
            self.transport.close()


class TcpUpstream(asyncio.Protocol):
    """The upstream side of a raw TCP tunnel; everything is decided by its owner."""

    __slots__ = ("owner", "pool", "transport", "early", "early_eofs")

    def __init__(self, owner: TcpProxyConnection, pool: EndpointPool) -> None:
        self.owner = owner
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.early: list[bytes] = []  # e.g. a server's greeting, read before the link
        self.early_eofs = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.pool.opened += 1
        self.pool.open_count += 1

    def data_received(self, data: bytes) -> None:
        owner = self.owner
        if owner.upstream is self:
            owner.transport.write(data)
        else:
            self.early.append(data)
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        if self.owner.upstream is self:
            self.owner._on_eof(UP_TO_DOWN)
        else:
            self.early_eofs |= UP_TO_DOWN
        return True

    def pause_writing(self) -> None:
        down = self.owner.transport
        if down is not None:
            down.pause_reading()

    def resume_writing(self) -> None:
        down = self.owner.transport
        if down is not None and not self.owner.eofs & DOWN_TO_UP:
            down.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.open_count -= 1
        self.owner.upstream_lost()


__all__ = ["TcpProxyConnection", "TcpUpstream"]
