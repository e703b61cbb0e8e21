"""Keep-alive pool of upstream connections for one endpoint."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiproxy.config import ClusterConfig, Endpoint
from aiproxy.protocols.h1_upstream import H1UpstreamConnection

if TYPE_CHECKING:
    from aiproxy.config import HttpConfig


class UpstreamConnectError(Exception):
    def __init__(self, timeout: bool, message: str) -> None:
        super().__init__(message)
        self.timeout = timeout


class Pool:
    """Idle connections are reused most-recent-first so the oldest age out."""

    __slots__ = ("loop", "endpoint", "host", "port", "cluster_cfg", "max_head", "max_headers",
                 "idle", "_sweep", "opened", "reused", "closed")

    def __init__(self, loop: asyncio.AbstractEventLoop, endpoint: Endpoint,
                 cluster_cfg: ClusterConfig, http: HttpConfig) -> None:
        self.loop = loop
        self.endpoint = endpoint
        self.host = endpoint.host
        self.port = endpoint.port
        self.cluster_cfg = cluster_cfg
        self.max_head = http.max_header_bytes
        self.max_headers = http.max_headers
        self.idle: list[H1UpstreamConnection] = []
        self._sweep: asyncio.TimerHandle | None = None
        self.opened = 0
        self.reused = 0
        self.closed = False

    def take(self) -> H1UpstreamConnection | None:
        idle = self.idle
        while idle:
            conn = idle.pop()
            if conn.usable():
                self.reused += 1
                return conn
            conn.close()
        return None

    async def connect(self) -> H1UpstreamConnection:
        timeout = self.cluster_cfg.connect_timeout_ms / 1000
        try:
            async with asyncio.timeout(timeout):
                _, conn = await self.loop.create_connection(
                    lambda: H1UpstreamConnection(self), self.host, self.port)
        except TimeoutError:
            raise UpstreamConnectError(True, f"connect to {self.endpoint.address} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(
                False, f"connect to {self.endpoint.address} failed: {exc.strerror or exc}") from None
        self.opened += 1
        return conn

    def release(self, conn: H1UpstreamConnection) -> None:
        cfg = self.cluster_cfg
        if (self.closed or not conn.usable() or len(self.idle) >= cfg.max_idle_connections
                or (cfg.max_requests_per_connection
                    and conn.requests >= cfg.max_requests_per_connection)):
            conn.close()
            return
        conn.park(self.loop.time())
        self.idle.append(conn)
        if self._sweep is None:
            self._sweep = self.loop.call_later(cfg.idle_timeout_ms / 1000, self._expire)

    def discard(self, conn: H1UpstreamConnection) -> None:
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    def _expire(self) -> None:
        self._sweep = None
        timeout = self.cluster_cfg.idle_timeout_ms / 1000
        deadline = self.loop.time() - timeout
        keep = []
        for conn in self.idle:
            if conn.idle_since <= deadline:
                conn.close()
            else:
                keep.append(conn)
        self.idle = keep
        if keep:
            wait = keep[0].idle_since + timeout - self.loop.time()
            self._sweep = self.loop.call_later(max(wait, 0.001), self._expire)

    def close(self) -> None:
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()
