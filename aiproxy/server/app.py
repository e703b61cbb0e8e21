"""Process lifecycle: bind listeners, serve, stop gracefully on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

import uvloop

from aiproxy.config import Config
from aiproxy.protocols.http1 import H1Connection
from aiproxy.server.runtime import Runtime

log = logging.getLogger("aiproxy.server")


class ProxyServer:
    def __init__(self, config: Config, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.config = config
        self.runtime = Runtime(config, loop)
        self.connections: set[H1Connection] = set()
        self.draining = False
        self.servers: list[asyncio.Server] = []

    async def start(self) -> None:
        for listener in self.config.listeners:
            server = await self.loop.create_server(
                lambda: H1Connection(self), listener.host, listener.port,
                backlog=listener.backlog, reuse_address=True)
            self.servers.append(server)
            for sock in server.sockets:
                log.info("listener %s on %s", listener.name, _sockname(sock))

    async def stop(self, timeout: float) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then close."""
        self.draining = True
        for server in self.servers:
            server.close()
        for conn in list(self.connections):
            conn.drain()
        deadline = self.loop.time() + timeout
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.connections:
            log.warning("drain timeout: closing %d connections", len(self.connections))
            for conn in list(self.connections):
                if conn.transport is not None:
                    conn.transport.abort()
        self.runtime.close()


def _sockname(sock: socket.socket) -> str:
    name = sock.getsockname()
    host, port = name[0], name[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(config: Config) -> int:
    loop = asyncio.get_running_loop()
    server = ProxyServer(config, loop)
    try:
        await server.start()
    except OSError as exc:
        log.error("cannot bind listener: %s", exc)
        server.runtime.close()
        return 1
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("aiproxy ready (%d routes, %d clusters)", len(config.routes), len(config.clusters))
    await stop.wait()
    log.info("stopping: draining for up to %d ms", config.server.drain_timeout_ms)
    await server.stop(config.server.drain_timeout_ms / 1000)
    log.info("stopped")
    return 0


def run(config: Config) -> int:
    return uvloop.run(serve(config))
