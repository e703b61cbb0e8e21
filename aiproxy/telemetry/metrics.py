"""Process metrics: plain counters bumped in place, rendered only when scraped.

The request path touches ints and lists; the Prometheus text format is produced
by prometheus_client from a collector at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import CollectorRegistry

from aiproxy._fast.bufpool import POOL
from aiproxy._fast.histogram import Histogram
from aiproxy.protocols.h2_upstream import response_held, write_buffered
from aiproxy.routing.pool import H2Pool
from aiproxy.telemetry.kernel_metrics import kernel_families

if TYPE_CHECKING:
    from aiproxy.server.app import ProxyServer

# Seconds; from 100 us (a local reply) to a minute (a long generation).
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STAGES = ("accept_to_headers", "route_decision", "semantic_classify", "upstream_connect",
          "upstream_ttfb", "total")


STATUS_SLOTS = 600  # statuses 0-599 are counted in a C array; others (none expected) in a dict
# aiproxy_requests_total's `outcome`, as the access log tells them apart: the response
# went out whole (whatever its status), the upstream cut it off after its head
# (`upstream_error`), the client left first (`client_closed`; 499 if before the head),
# the proxy reset the client's HTTP/2 stream for a protocol error (`stream_error`; 400
# if before the head) or cut it at the drain deadline (`drained`; 503 if before); a 101
# started an Upgrade tunnel (`upgraded`, however the tunnel ended: the access log's
# `ended` says how).
COMPLETE = "complete"
UPGRADED = "upgraded"
UPSTREAM_ERROR = "upstream_error"
CLIENT_CLOSED = "client_closed"
STREAM_ERROR = "stream_error"
DRAINED = "drained"
# aiproxy_grpc_calls_total's `grpc_status`: the 17 codes of the gRPC spec, "none" for a
# call that ended without one (cancelled, reset), "other" for a code past the spec's.
GRPC_LABELS = tuple(str(code) for code in range(17))


class StatusCounts:
    """Requests of one route and cluster by outcome and status: complete ones bumped in
    place (no int objects), the rare others in a dict."""

    def __init__(self) -> None:
        self.other: dict[tuple[str, int], int] = {}

    def add(self, status: int) -> None:
        if 0 <= status < STATUS_SLOTS:
            self.slots[status] += 1
        else:
            self.add_outcome(COMPLETE, status)

    def add_outcome(self, outcome: str, status: int) -> None:
        key = (outcome, status)
        self.other[key] = self.other.get(key, 0) + 1

    def items(self) -> list[tuple[str, int, int]]:
        """(outcome, status, count) for every pair seen, in order."""
        found = [(COMPLETE, status, self.slots[status]) for status in range(STATUS_SLOTS)
                 if self.slots[status]]
        return sorted(found + [(o, s, n) for (o, s), n in self.other.items()])


class Metrics:
    """Counters of one process; nothing is formatted here."""

    def __init__(self) -> None:
        # route name -> cluster name -> StatusCounts: two lookups by interned str, no tuple.
        self.requests: dict[str, dict[str, StatusCounts]] = {}
        # gRPC calls by (route, cluster, grpc_status label).
        self.grpc: dict[tuple[str, str, str], int] = {}
        # The last (route, cluster) counted, by identity: most requests repeat it.
        self.last_route: str | None = None
        self.last_cluster: str | None = None
        self.last_counts: StatusCounts | None = None
        self.stages = stages = {name: Histogram(BUCKETS) for name in STAGES}
        self.h_accept = stages["accept_to_headers"]
        self.h_route = stages["route_decision"]
        self.h_classify = stages["semantic_classify"]
        self.h_connect = stages["upstream_connect"]
        self.h_ttfb = stages["upstream_ttfb"]
        self.h_total = stages["total"]
        self.bytes_in = 0
        self.bytes_out = 0
        self.reloads = 0
        self.reload_failures = 0
        self.last_reload_ok = 1
        self.last_reload_time = 0.0

    def exchange_stamps(self, route: str, cluster: str, status: int, bytes_in: int,
                        bytes_out: int, ex: Any, now: float) -> None:
        """Count one finished exchange and observe its stages from the exchange's
        perf_counter stamps (the stages of Exchange.timings), without building the
        timings dict: this runs once per request, access log on or off."""
        counts = self.last_counts
        if route is not self.last_route or cluster is not self.last_cluster:
            by_cluster = self.requests.get(route)
            if by_cluster is None:
                by_cluster = self.requests[route] = {}
            counts = by_cluster.get(cluster)
            if counts is None:
                counts = by_cluster[cluster] = StatusCounts()
            self.last_route = route
            self.last_cluster = cluster
            self.last_counts = counts
        if ex.tunnel:
            counts.add_outcome(UPGRADED, status)
        elif ex.upstream_error is None and not ex.client_lost:
            counts.add(status)
        elif ex.upstream_error is not None:
            counts.add_outcome(UPSTREAM_ERROR, status)
        else:
            counts.add_outcome(STREAM_ERROR if ex.stream_error is not None
                               else DRAINED if ex.drained else CLIENT_CLOSED, status)
        if ex.grpc:
            code = ex.grpc_status
            key = (route, cluster, GRPC_LABELS[code] if 0 <= code <= 16
                   else "none" if code < 0 else "other")
            self.grpc[key] = self.grpc.get(key, 0) + 1
        self.bytes_in += bytes_in
        self.bytes_out += bytes_out
        start = ex.t_start_pc
        parsed = ex.t_parsed
        self.h_accept.observe(parsed - start)
        self.h_total.observe(now - start)
        classify = ex.t_classify
        if ex.t_routed:
            self.h_route.observe(ex.t_routed - parsed - classify)
        if ex.t_first and ex.t_sent:
            self.h_ttfb.observe(ex.t_first - ex.t_sent)
        if classify:
            self.h_classify.observe(classify)
        if ex.t_connected:
            self.h_connect.observe(ex.t_connected - ex.t_connect)


class ProxyCollector:
    """Turns Metrics and live server state into metric families on each scrape."""

    def __init__(self, server: ProxyServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        server = self.server
        m = server.metrics
        requests = CounterMetricFamily(
            "aiproxy_requests", "Requests answered, by route, cluster, status and outcome "
            "(complete, upstream_error: cut off by the upstream, client_closed, "
            "stream_error: HTTP/2 stream reset for a protocol error, drained: cut by the "
            "drain deadline)",
            labels=["route", "cluster", "status", "outcome"])
        for route, by_cluster in sorted(m.requests.items()):
            for cluster, counts in sorted(by_cluster.items()):
                for outcome, status, count in counts.items():
                    requests.add_metric([route, cluster, str(status), outcome], count)
        yield requests
        grpc_calls = CounterMetricFamily(
            "aiproxy_grpc_calls", "gRPC calls by route, cluster and the grpc-status the "
            "client got (none: the call ended without one)",
            labels=["route", "cluster", "grpc_status"])
        for (route, cluster, code), count in sorted(m.grpc.items()):
            grpc_calls.add_metric([route, cluster, code], count)
        yield grpc_calls
        for name, hist in m.stages.items():
            family = HistogramMetricFamily(
                f"aiproxy_stage_{name}_seconds", f"Time spent in stage {name}")
            family.add_metric([], hist.cumulative(), hist.sum)
            yield family
        yield CounterMetricFamily("aiproxy_request_bytes", "Request body bytes received, and client bytes an Upgrade tunnel carried",
                                  value=m.bytes_in)
        yield CounterMetricFamily("aiproxy_response_bytes", "Response body bytes sent, and upstream bytes an Upgrade tunnel carried",
                                  value=m.bytes_out)
        yield GaugeMetricFamily("aiproxy_active_connections", "Open client connections",
                                value=len(server.connections))
        opened = CounterMetricFamily("aiproxy_upstream_connections_opened",
                                     "Upstream connections opened", labels=["cluster", "endpoint"])
        reused = CounterMetricFamily("aiproxy_upstream_connections_reused",
                                     "Requests sent on a reused upstream connection",
                                     labels=["cluster", "endpoint"])
        open_now = GaugeMetricFamily("aiproxy_upstream_connections_open",
                                     "Upstream connections open now",
                                     labels=["cluster", "endpoint"])
        h2_held = GaugeMetricFamily(
            "aiproxy_upstream_h2_response_held_bytes",
            "Response bytes from HTTP/2 upstream streams the proxy holds for clients that "
            "have not taken them yet", labels=["cluster", "endpoint"])
        h2_window = GaugeMetricFamily(
            "aiproxy_upstream_h2_stream_window_bytes",
            "Bytes HTTP/2 upstreams may still send on their open streams (the stream "
            "windows the proxy gave them)", labels=["cluster", "endpoint"])
        h2_buffered = GaugeMetricFamily(
            "aiproxy_upstream_h2_write_buffer_bytes",
            "Bytes written to HTTP/2 upstream connections that their sockets have not "
            "taken yet", labels=["cluster", "endpoint"])
        for cluster in server.runtime.clusters.values():
            for pool in cluster.pools:
                labels = [cluster.name, pool.endpoint.address]
                opened.add_metric(labels, pool.opened)
                reused.add_metric(labels, pool.reused)
                open_now.add_metric(labels, pool.open_count)
                if isinstance(pool, H2Pool):
                    held, window = response_held(pool.conns)
                    h2_held.add_metric(labels, held)
                    h2_window.add_metric(labels, window)
                    h2_buffered.add_metric(labels, write_buffered(pool.conns))
        yield opened
        yield reused
        yield open_now
        yield h2_held
        yield h2_window
        yield h2_buffered
        sem = server.runtime.semantic
        if sem is not None:
            decisions = CounterMetricFamily("aiproxy_semantic_decisions",
                                            "Intent decisions made by the model, by domain",
                                            labels=["intent_domain"])
            for domain, count in sorted(sem.decisions.items()):
                decisions.add_metric([domain], count)
            yield decisions
            yield CounterMetricFamily("aiproxy_semantic_explicit",
                                      "Requests whose intent header skipped the model",
                                      value=sem.explicit)
            yield CounterMetricFamily("aiproxy_semantic_failures",
                                      "Classifications that failed (routed without intent)",
                                      value=sem.failures)
        kernel = getattr(server, "kernel", None)
        if kernel is not None:
            yield from kernel_families(kernel)
        for state in server.runtime.filter_states.values():
            collect = getattr(state, "collect", None)  # filter features' own families
            if collect is not None:
                yield from collect()
        POOL.reclaim()  # parked slabs whose transports have drained by now
        slabs = GaugeMetricFamily("aiproxy_buffer_pool_slabs",
                                  "HTTP/1.1 read buffers (slabs) of this process, by state: "
                                  "in_use (held by a read or a transport still sending), "
                                  "free (kept for reuse), held (waiting for a transport)",
                                  labels=["state"])
        slabs.add_metric(["in_use"], POOL.in_use)
        slabs.add_metric(["free"], POOL.free)
        slabs.add_metric(["held"], POOL.held)
        yield slabs
        yield GaugeMetricFamily("aiproxy_buffer_pool_slab_bytes", "Size of one read buffer",
                                value=POOL.slab_size)
        yield CounterMetricFamily("aiproxy_buffer_pool_gets", "Read buffers handed out",
                                  value=POOL.gets)
        yield CounterMetricFamily("aiproxy_buffer_pool_misses",
                                  "Read buffers allocated because none was free",
                                  value=POOL.misses)
        yield CounterMetricFamily("aiproxy_buffer_pool_parked",
                                  "Read buffers returned while a transport still held views "
                                  "of them (reused only after it sent them)",
                                  value=POOL.parked)
        yield CounterMetricFamily("aiproxy_config_reloads", "Successful config reloads",
                                  value=m.reloads)
        yield CounterMetricFamily("aiproxy_config_reload_failures", "Rejected config reloads",
                                  value=m.reload_failures)
        yield GaugeMetricFamily("aiproxy_config_last_reload_success",
                                "1 if the last reload succeeded (or none happened)",
                                value=m.last_reload_ok)
        # Filter chain features export their own families (aiproxy/pipeline/chain.py).
        for state in server.runtime.filter_states.values():
            families = getattr(state, "metric_families", None)
            if families is not None:
                yield from families()


def registry_for(server: ProxyServer) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProxyCollector(server))
    return registry
