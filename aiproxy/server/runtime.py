"""Everything a request needs from the config, built once and swapped whole."""

from __future__ import annotations

import asyncio
from typing import Any

from aiproxy.config import Config
from aiproxy.routing.cluster import Cluster, pool_key
from aiproxy.routing.table import Route, RouteTable


class Runtime:
    __slots__ = ("config", "http", "clusters", "table", "via_lines", "via_fields", "via_10", "via_11", "via_20",
                 "max_body", "min_timeout",
                 "semantic", "filter_states", "decision_cache", "unrouted_filters",
                 "max_header_bytes", "max_request_line_bytes", "max_headers",
                 "keepalive_timeout_ms", "max_keepalive_requests", "x_forwarded",
                 "server_timing")

    def __init__(self, config: Config, loop: asyncio.AbstractEventLoop,
                 previous: Runtime | None = None, model: Any = None) -> None:
        """`model` is the loaded intent model when config.semantic is set (loading it
        blocks, so the caller does that off the event loop: see load_intent_model)."""
        # Imported here, not at the top: the compiled exchange cimports this module, and
        # the filter chain imports modules that import the exchange's users.
        from aiproxy.pipeline.chain import ANSWERED, BUILDERS, UNROUTED
        from aiproxy.pipeline.filters import prepare_states, route_filters
        from aiproxy.semantic.router import SemanticRouter

        self.config = config
        self.semantic = (SemanticRouter(config.semantic, model)
                         if config.semantic is not None and model is not None else None)
        self.http = config.http
        pools = previous.pools_by_endpoint() if previous is not None else {}
        self.clusters = {c.name: Cluster(c, config.http, loop, pools) for c in config.clusters}
        for cluster in self.clusters.values():
            cluster.start()
        self.table = RouteTable(Route(r, self.clusters, i) for i, r in enumerate(config.routes))
        self.filter_states = prepare_states(
            BUILDERS, config, previous.filter_states if previous is not None else None)
        if self.filter_states:
            for route in self.table.routes:
                # A route the proxy answers itself has no upstream exchange to cache,
                # account tokens of or guard: its chain is identity, policy and limits.
                only = ANSWERED if route.cluster is None and not route.clusters else None
                route.filters = route_filters(BUILDERS, config, route.cfg, self.filter_states,
                                              only)
        self.unrouted_filters = (route_filters(BUILDERS, config, None, self.filter_states,
                                               UNROUTED) if self.filter_states else ())
        # The prompt cache's embedding side (aiproxy/cache/prompt.py), asked before the
        # intent model runs.
        self.decision_cache = (self.filter_states.get("cache")
                               if self.semantic is not None else None)
        # RFC 9110 7.6.3: Via names the protocol of the message received on that hop (the
        # client's request, the upstream's response), by Head.version; empty when off.
        received = {10: b"1.0", 11: b"1.1", 20: b"2"} if config.http.via else {}
        self.via_lines = {v: b"Via: %s aiproxy\r\n" % p for v, p in received.items()}
        self.via_fields = {v: (b"via", p + b" aiproxy") for v, p in received.items()}
        # The same lines as C fields, for via_line() on every HTTP/1.1 message.
        self.via_10 = self.via_lines.get(10)
        self.via_11 = self.via_lines.get(11)
        self.via_20 = self.via_lines.get(20)
        self.max_body = config.http.max_body_bytes
        http = config.http
        # [http] settings read on every request, as C fields (runtime.pxd).
        self.max_header_bytes = http.max_header_bytes
        self.max_request_line_bytes = http.max_request_line_bytes
        self.max_headers = http.max_headers
        self.keepalive_timeout_ms = http.keepalive_timeout_ms
        self.max_keepalive_requests = http.max_keepalive_requests
        self.x_forwarded = http.x_forwarded
        self.server_timing = http.server_timing
        timeouts = [http.header_timeout_ms, http.body_timeout_ms, http.send_timeout_ms]
        if http.keepalive_timeout_ms:
            timeouts.append(http.keepalive_timeout_ms)
        if http.tunnel_idle_timeout_ms:
            timeouts.append(http.tunnel_idle_timeout_ms)
        for c in config.clusters:
            timeouts += (c.request_timeout_ms, c.read_timeout_ms)
        timeouts += [r.timeout_ms for r in config.routes if r.timeout_ms]
        # The connection timer's period: no deadline is shorter than this.
        self.min_timeout = min(timeouts) / 1000

    def via_line(self, version: int) -> bytes | None:
        """via_lines.get(version), read from C fields: no dict lookup per message."""
        if version == 11:
            return self.via_11
        if version == 10:
            return self.via_10
        if version == 20:
            return self.via_20
        return None

    def pools_by_endpoint(self) -> dict[tuple, object]:
        return {pool_key(c.cfg, p.endpoint): p
                for c in self.clusters.values() for p in c.pools}

    def retire(self, successor: Runtime) -> None:
        """Close the pools the successor did not take over (idle connections now, busy
        ones when their exchange releases them)."""
        kept = {id(p) for c in successor.clusters.values() for p in c.pools}
        for cluster in self.clusters.values():
            cluster.stop()
            for pool in cluster.pools:
                if id(pool) not in kept:
                    pool.close()

    def close(self) -> None:
        for cluster in self.clusters.values():
            cluster.close()
        for state in self.filter_states.values():
            close = getattr(state, "close", None)
            if close is not None:
                close()  # e.g. the audit writer: write and sync what is queued


def load_intent_model(config: Config, previous: Runtime | None = None) -> Any:
    """The intent model a config needs (None without [semantic]); reuses the previous
    runtime's when file and threshold are unchanged. Raises ModelError."""
    if config.semantic is None:
        return None
    from aiproxy.semantic.router import load_model

    return load_model(config.semantic, previous.semantic if previous is not None else None)
