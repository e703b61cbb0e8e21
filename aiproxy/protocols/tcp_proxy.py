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

Idle timeout (the listener's `idle_timeout_ms`, like nginx's proxy_timeout): a tunnel
that carried no byte either way for that long is closed. Activity is sampled every
quarter of the timeout from the byte counts, the kernel's for a spliced tunnel (the
splice map counts what it redirects), so a spliced tunnel times out like a copied one,
up to a quarter of the timeout late. Each tunnel writes one access log line when it
closes (see `log_record`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from aiproxy.kernel.tunnel import BOTH, DOWN_TO_UP, UP_TO_DOWN
from aiproxy.telemetry.access_log import iso_now, ms

if TYPE_CHECKING:
    from aiproxy.config.schema import ListenerConfig
    from aiproxy.routing.cluster import Cluster
    from aiproxy.routing.pool import EndpointPool

log = logging.getLogger("aiproxy.tcp")

CONNECT_ATTEMPTS = 2


class TcpProxyConnection(asyncio.Protocol):
    """The client side of one raw TCP tunnel (owns the tunnel)."""

    __slots__ = ("server", "listener", "cluster_name", "loop", "transport", "upstream",
                 "splice", "eofs", "closed", "task", "early", "early_eofs", "started",
                 "copied_up", "copied_down", "moved", "endpoint", "ended", "idle_timer",
                 "idle_seen", "idle_since", "spliced", "peer")

    def __init__(self, server: Any, listener: ListenerConfig) -> None:
        self.server = server
        self.listener = listener
        self.cluster_name = listener.cluster
        self.loop: asyncio.AbstractEventLoop = server.loop
        self.transport: asyncio.Transport | None = None
        self.upstream: TcpUpstream | None = None
        self.splice: Any = None  # aiproxy.kernel.tunnel.TunnelSplice when spliced
        self.eofs = 0  # DOWN_TO_UP: the client sent EOF; UP_TO_DOWN: the upstream did
        self.closed = False
        self.task: asyncio.Task | None = None
        self.early: list[bytes] = []  # read from the client before the upstream was linked
        self.early_eofs = 0
        self.started = self.loop.time()
        self.copied_up = 0  # bytes through the transports, client -> upstream
        self.copied_down = 0
        self.moved = (0, 0)  # bytes the splice carried (final, once released)
        self.endpoint: str | None = None
        self.ended = ""  # how the tunnel ended (the access log's "ended")
        self.idle_timer: asyncio.TimerHandle | None = None
        self.idle_seen: tuple[int, ...] = ()
        self.idle_since = 0.0
        self.spliced = False  # the kernel carried the tunnel (after what was read first)
        self.peer = b""  # from a PROXY protocol header, or b"": the socket's peer

    # -- client transport callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self.task = self.loop.create_task(self._connect())

    def data_received(self, data: bytes) -> None:
        self.copied_up += len(data)
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
        if self.splice is not None and self.splice.holds(1):
            return  # the splice has the upstream's reading (TunnelSplice.holds)
        if up is not None and up.transport is not None and not self.eofs & UP_TO_DOWN:
            up.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.task is not None:
            self.task.cancel()
            self.task = None
        self._close("drained" if self.server.drain_expired else "client_lost")

    def drain(self, idle_grace: float = 0.0) -> None:
        """Graceful stop: a tunnel runs on until the drain timeout aborts it."""

    # -- connecting ------------------------------------------------------------------

    async def _connect(self) -> None:
        try:
            up = await self._open_upstream()
        finally:
            self.task = None
        if up is None:
            self._close("connect_failed")
            return
        if self.closed:
            up.transport.close()
            return
        self.upstream = up
        self.endpoint = up.pool.endpoint.address
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
        timeout = self.listener.idle_timeout_ms / 1000
        if timeout and not self.closed:
            self.idle_since = self.loop.time()
            self.idle_timer = self.loop.call_later(timeout / 4, self._check_idle)

    def _activity(self) -> tuple[int, ...]:
        splice = self.splice
        moved = splice.moved() if splice is not None else (0, 0)
        return self.copied_up, self.copied_down, *moved

    def _check_idle(self) -> None:
        self.idle_timer = None
        if self.closed:
            return
        now = self.loop.time()
        seen = self._activity()
        if seen != self.idle_seen:
            self.idle_seen = seen
            self.idle_since = now
        timeout = self.listener.idle_timeout_ms / 1000
        if now - self.idle_since >= timeout:
            log.info("tcp: tunnel from %s idle for %.0f s: closing", self._peer(), timeout)
            self._close("idle_timeout")
            return
        self.idle_timer = self.loop.call_later(timeout / 4, self._check_idle)

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
            self._close("eof")
            return
        up = self.upstream
        peer = (up.transport if up is not None else None) if which == DOWN_TO_UP \
            else self.transport
        if peer is None or peer.is_closing():
            self._close("eof")
        elif peer.can_write_eof():
            peer.write_eof()
        else:
            self._close("eof")

    def upstream_lost(self) -> None:
        self._close("upstream_lost")

    def _close(self, why: str) -> None:
        """Both sides done (or one lost): out of the kernel, then close both (close()
        still writes out what is buffered), and log the tunnel."""
        if self.closed:
            return
        self.closed = True
        self.ended = why
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        splice, self.splice = self.splice, None
        if splice is not None:
            splice.release()
            self.moved = splice.moved()
            self.spliced = splice.was_spliced
        up, self.upstream = self.upstream, None
        if up is not None and up.transport is not None:
            up.transport.close()
        if self.transport is not None:
            self.transport.close()
        access_log = self.server.telemetry.access_log
        if access_log is not None:
            access_log.write(self.log_record())

    def _peer(self) -> str:
        if self.peer:
            return self.peer.decode()
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return peer[0] if peer else ""

    def log_record(self) -> dict[str, Any]:
        """The tunnel's access log line: bytes_in is client -> upstream; path "spliced"
        if the kernel carried it (after what was read before), else "copied"; ended:
        eof (both sides done), client_lost, upstream_lost, idle_timeout, connect_failed,
        drained (cut by the drain deadline)."""
        return {
            "time": iso_now(),
            "client": self._peer(),
            "listener": self.listener.name,
            "protocol": "tcp",
            "cluster": self.cluster_name,
            "endpoint": self.endpoint,
            "bytes_in": self.copied_up + self.moved[0],
            "bytes_out": self.copied_down + self.moved[1],
            "duration_ms": ms(self.loop.time() - self.started),
            "ended": self.ended,
            "path": "spliced" if self.spliced else "copied",
        }


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
        owner.copied_down += len(data)
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
        splice = self.owner.splice
        if splice is not None and splice.holds(0):
            return  # the splice has the client's reading (TunnelSplice.holds)
        if down is not None and not self.owner.eofs & DOWN_TO_UP:
            down.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.open_count -= 1
        self.owner.upstream_lost()


__all__ = ["TcpProxyConnection", "TcpUpstream"]
