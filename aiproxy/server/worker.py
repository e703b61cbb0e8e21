"""One worker process under the supervisor (`[server] workers > 1`).

It binds the listeners itself with SO_REUSEPORT (the kernel spreads new connections
over the workers), runs its own uvloop and answers the supervisor's control channel.
It never talks to systemd: the supervisor is the main PID and notifies for all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import sys

import uvloop

from aiproxy.admin.server import LocalBackend, describe_clusters, describe_routes
from aiproxy.config import Config, ListenerConfig, load_config_text
from aiproxy.governance.tracing import trace_spans
from aiproxy.kernel.lifecycle import proxy_pin_dir
from aiproxy.server.app import ProxyServer, settle_gc, start_server, stop_event, worker_config
from aiproxy.server.channel import Channel
from aiproxy.telemetry.aggregate import snapshot

log = logging.getLogger("aiproxy.server")

# Only the supervisor may speak for the service (NotifyAccess=main).
SYSTEMD_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def main(slot: int, sock: socket.socket, text: str, source: str, log_level: int,
         owner_pid: int | None = None,
         listeners: tuple[ListenerConfig, ...] | None = None) -> None:
    """multiprocessing target; the exit code tells the supervisor how it went
    (0 stopped, 1 cannot bind, 2 bad model). ``owner_pid``: the supervisor's pid, which
    names worker 0's bpffs pins (so its restart finds them). ``listeners``: what to bind
    instead of the text's own (those its siblings serve, after a reload changed them)."""
    for name in SYSTEMD_VARS:
        os.environ.pop(name, None)
    logging.basicConfig(level=log_level, stream=sys.stderr, force=True,
                        format=f"%(asctime)s %(levelname)s %(name)s[worker {slot}]: %(message)s")
    config = load_config_text(text, source)  # the supervisor validated this text
    if listeners is not None:
        config = dataclasses.replace(config, listeners=listeners)
    sys.exit(uvloop.run(serve_worker(config, sock, slot, owner_pid)))


def check_model(text: str, source: str, log_level: int) -> None:
    """multiprocessing target: load the [semantic] model of the text the supervisor is
    about to start workers on, before anything binds; exit 2, naming FILE:LINE:
    semantic.model, when it does not load (a worker would find it only after the
    supervisor bound the admin API)."""
    from aiproxy.config.model_check import load_checked_model

    for name in SYSTEMD_VARS:
        os.environ.pop(name, None)
    logging.basicConfig(level=log_level, stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _, problems, _ = load_checked_model(load_config_text(text, source))
    for problem in problems:
        log.error("%s", problem)
    sys.exit(2 if problems else 0)


async def serve_worker(config: Config, sock: socket.socket, slot: int,
                       owner_pid: int | None = None) -> int:
    loop = asyncio.get_running_loop()

    def setup(server: ProxyServer) -> None:
        server.worker_slot = slot
        server.kernel_attach = slot == 0
        if slot == 0 and owner_pid is not None:
            server.kernel.pin_dir = proxy_pin_dir(owner_pid)

    server = await start_server(worker_config(config, slot), setup, reuse_port=True,
                                serve_admin=False)
    if isinstance(server, int):
        return server
    settle_gc()
    backend = LocalBackend(server)
    # SIGHUP stays ignored (_run): a reload is the supervisor's, which checks the file
    # once and hands every worker the same text. One to the process group reaches it.
    stop = stop_event(server, reloads=False)

    async def reload(text: str) -> dict:
        ok, message = await server.reload(text)
        return {"ok": ok, "message": message}

    async def metrics() -> list:
        return snapshot(backend.registry)

    async def routes() -> list:
        return describe_routes(server)

    async def clusters() -> list:
        return describe_clusters(server)

    async def spans(trace_id: str) -> list | None:
        return trace_spans(server.runtime, trace_id)

    async def ping() -> None:  # the supervisor's liveness check: this loop runs
        return None

    async def hurry() -> None:  # a second stop signal to the supervisor
        server.hurry()

    channel = await Channel.open(sock)
    handlers = {"reload": reload, "metrics": metrics, "routes": routes, "clusters": clusters,
                "spans": spans, "hurry": hurry, "ping": ping}
    serving = loop.create_task(channel.serve(handlers))
    # EOF on the channel means the supervisor is gone: stop rather than serve unsupervised.
    serving.add_done_callback(lambda _: stop.set())
    channel.event("ready", pid=os.getpid())
    await stop.wait()
    drain = server.config.server.drain_timeout_ms
    log.info("stopping: draining for up to %d ms", drain)
    await server.stop(drain / 1000)
    channel.event("final", metrics=snapshot(backend.registry))
    await channel.close()
    serving.cancel()
    return 0
