"""One CLIENT span per upstream attempt: a retried request is a SERVER span with a child
span for each try, and each try's upstream gets a traceparent naming its own span. Real
proxy, real upstreams (HTTP/1.1 and HTTP/2), a real OTLP/gRPC receiver."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import h2.errors
import httpx
import pytest

from aiproxy.governance.tracing import parse_traceparent
from tests.h2_support import H2Upstream
from tests.support import free_port, wait_port
from tests.test_routing_e2e import tunable  # noqa: F401 (fixture)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"
SERVER, CLIENT = 2, 3  # opentelemetry.proto Span.SpanKind
STATUS_ERROR = 2


class Collector:
    """An OTLP/gRPC TraceService receiver (opentelemetry-proto's service on grpcio)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        from tests.grpc_support import start_grpc_server

        self.spans: list[Any] = []
        self.lock = threading.Lock()
        collector = self

        class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (the generated name)
                with collector.lock:
                    collector.spans += [s for rs in request.resource_spans
                                        for ss in rs.scope_spans for s in ss.spans]
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server, self.port = start_grpc_server(
            lambda s: trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), s),
            max_workers=2)

    def wait(self, n: int) -> list[Any]:
        deadline = time.monotonic() + 10
        while len(self.spans) < n:
            assert time.monotonic() < deadline, f"{len(self.spans)} spans exported, not {n}"
            time.sleep(0.05)
        time.sleep(0.3)  # a flush period more: nothing beyond n may follow
        with self.lock:
            return list(self.spans)


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.server.stop(0)


def attrs(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = v.int_value if v.HasField("int_value") else v.string_value
    return out


def config(collector: Collector, endpoints: list[int], retries: str, extra: str = "",
           route_extra: str = "") -> str:
    eps = ", ".join(f'"127.0.0.1:{p}"' for p in endpoints)
    return f"""
[server]
workers = 1

[[clusters]]
name = "c"
endpoints = [{eps}]
outlier_detection = {{ consecutive_failures = 0 }}
{extra}

[[routes]]
name = "r"
match = {{ path_prefix = "/" }}
cluster = "c"
retries = {retries}
{route_extra}

[tracing]
otlp_endpoint = "127.0.0.1:{collector.port}"
"""


def spans_of(collector: Collector, attempts: int) -> tuple[Any, list[Any]]:
    """The SERVER span and the CLIENT spans (by span id) of the request's trace."""
    spans = collector.wait(1 + attempts)
    assert {s.trace_id.hex() for s in spans} == {TRACE}
    (server,) = [s for s in spans if s.kind == SERVER]
    clients = [s for s in spans if s.kind == CLIENT]
    assert len(clients) == attempts, spans
    return server, clients


def check_attempts(server: Any, clients: list[Any], seen: list[str],
                   endpoints: list[str], first: int = 0) -> list[Any]:
    """Each attempt's upstream saw its own span id; the spans are the server span's
    children, in the order tried; the 2nd and later carry http.request.resend_count.
    `first`: the resend count of the first attempt in `seen`."""
    assert server.parent_span_id.hex() == CALLER
    ids = [parse_traceparent(tp.encode())[1].decode() for tp in seen]
    by_id = {c.span_id.hex(): c for c in clients}
    assert len(set(by_id)) == len(clients)
    assert server.span_id.hex() not in by_id
    ordered = [by_id[i] for i in ids]  # a KeyError: an upstream saw no attempt's span
    for n, (span, endpoint) in enumerate(zip(ordered, endpoints, strict=True)):
        a = attrs(span)
        assert span.parent_span_id == server.span_id
        assert a.get("http.request.resend_count") == (n + first or None), (n, a)
        assert a["aiproxy.upstream.address"] == endpoint
        assert a["server.address"] == "127.0.0.1"
        assert a["server.port"] == int(endpoint.rsplit(":", 1)[1])
        assert a["http.request.method"] == "GET"
        assert span.end_time_unix_nano >= span.start_time_unix_nano
    return ordered


class ScriptedH2:
    """An h2c upstream that answers its streams in turn from `plan` (a status, or
    "reset": RST_STREAM(INTERNAL_ERROR)), then 200, keeping each stream's traceparent."""

    def __init__(self, plan: list[Any]) -> None:
        self.plan = list(plan)
        self.seen: list[str] = []
        self.up = H2Upstream(self.handle, name="scripted")
        self.port = self.up.port

    async def handle(self, proto, sid: int, path: str, head: dict, body: bytes) -> None:
        self.seen.append(head.get(b"traceparent", b"").decode())
        step = self.plan.pop(0) if self.plan else 200
        if step == "reset":
            proto.conn.reset_stream(sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
            return
        proto.conn.send_headers(sid, [(b":status", str(step).encode()),
                                      (b"content-length", b"2")])
        await proto.send_data(sid, b"ok", end=True)


@pytest.mark.parametrize("protocol", ["http1", "h2"])
def test_each_attempt_is_a_client_span_with_its_own_traceparent(
        start_proxy, tunable, collector: Collector, protocol: str) -> None:  # noqa: F811
    """A reset, a 503, then a 200: three CLIENT spans under the SERVER span, each upstream
    request carrying its own span's id; the server span has the final status."""
    if protocol == "h2":
        script = ScriptedH2(["reset", 503])
        port, seen, extra = script.port, script.seen, 'protocol = "h2"'
        reset_code = "upstream_stream_error"
    else:
        up = tunable("a")
        up.reset_first, up.fail_first = 1, 1
        port, seen, extra = up.port, up.seen, ""
        reset_code = "upstream_reset"
    try:
        proxy = start_proxy(config(collector, [port], '{ attempts = 2, on = ["reset", "503"], '
                                   "backoff_ms = 1 }", extra))
        r = httpx.get(f"{proxy.url}/v1/x", timeout=10,
                      headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
        assert r.status_code == 200, r.text
        server, clients = spans_of(collector, 3)
    finally:
        if protocol == "h2":
            script.up.stop()
    tps = seen if protocol == "h2" else [h["traceparent"] for h in seen]
    assert len(tps) == 3
    endpoint = f"127.0.0.1:{port}"
    reset, failed, ok = check_attempts(server, clients, tps, [endpoint] * 3)
    a = attrs(reset)
    assert "http.response.status_code" not in a and a["error.type"] == reset_code
    assert reset.status.code == STATUS_ERROR and reset.status.message
    a = attrs(failed)
    assert a["http.response.status_code"] == 503 and a["error.type"] == "503"
    assert failed.status.code == STATUS_ERROR
    a = attrs(ok)
    assert a["http.response.status_code"] == 200 and "error.type" not in a
    assert ok.status.code != STATUS_ERROR
    assert a["network.protocol.version"] == ("2" if protocol == "h2" else "1.1")
    s = attrs(server)
    assert s["http.response.status_code"] == 200 and s["aiproxy.upstream.address"] == endpoint
    assert server.status.code != STATUS_ERROR
    # Attempts follow one another inside the server span (durations are kept to the
    # microsecond, so an end may come out a microsecond late).
    us = 1000
    assert reset.end_time_unix_nano <= failed.start_time_unix_nano + us
    assert failed.end_time_unix_nano <= ok.start_time_unix_nano + us
    assert server.start_time_unix_nano <= reset.start_time_unix_nano
    assert ok.end_time_unix_nano <= server.end_time_unix_nano + us


def test_a_refused_connect_is_an_error_span(start_proxy, tunable,  # noqa: F811
                                             collector: Collector) -> None:
    """The first endpoint (round robin's first pick) has nothing listening: its attempt
    is an error span, and the retry on the other endpoint a span with resend_count 1."""
    closed = free_port()
    up = tunable("b")
    proxy = start_proxy(config(collector, [closed, up.port],
                               '{ attempts = 1, on = ["connect-failure"], backoff_ms = 1 }'))
    r = httpx.get(f"{proxy.url}/v1/x", timeout=10,
                  headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
    assert r.status_code == 200, r.text
    server, clients = spans_of(collector, 2)
    (sent,) = [h["traceparent"] for h in up.seen]
    # The refused attempt's traceparent never reached anyone: order by resend_count.
    first, second = sorted(clients, key=lambda c: attrs(c).get("http.request.resend_count", 0))
    check_attempts(server, [second], [sent], [f"127.0.0.1:{up.port}"], first=1)
    assert attrs(second)["http.response.status_code"] == 200
    a = attrs(first)
    assert first.parent_span_id == server.span_id and first.span_id != second.span_id
    assert "http.request.resend_count" not in a
    assert a["aiproxy.upstream.address"] == f"127.0.0.1:{closed}"
    assert a["error.type"] == "upstream_connect_failed"
    assert "http.response.status_code" not in a
    assert first.status.code == STATUS_ERROR
    assert attrs(server)["http.response.status_code"] == 200


def test_a_timed_out_attempt_is_an_error_span(start_proxy, tunable,  # noqa: F811
                                               collector: Collector) -> None:
    up = tunable("slow", delay_ms=10_000)
    proxy = start_proxy(config(collector, [up.port], '{ attempts = 1, on = ["503"] }',
                               route_extra="timeout_ms = 300"))
    r = httpx.get(f"{proxy.url}/v1/x", timeout=10,
                  headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
    assert r.status_code == 504, r.text
    server, (client,) = spans_of(collector, 1)
    check_attempts(server, [client], [h["traceparent"] for h in up.seen],
                   [f"127.0.0.1:{up.port}"])
    a = attrs(client)
    assert a["error.type"] == "upstream_timeout" and client.status.code == STATUS_ERROR
    assert attrs(server)["http.response.status_code"] == 504


def test_lineage_lists_the_attempts(start_proxy, tunable, collector: Collector) -> None:  # noqa: F811
    """The admin API's lineage graph holds the client spans too: the server span ->
    each attempt, with the endpoint, status or error, and resend count."""
    up = tunable("a")
    up.fail_first = 1
    admin = free_port()
    proxy = start_proxy(config(collector, [up.port], '{ attempts = 1, on = ["503"], '
                               "backoff_ms = 1 }") + f'\n[admin]\naddress = "127.0.0.1:{admin}"\n')
    wait_port("127.0.0.1", admin)
    r = httpx.get(f"{proxy.url}/v1/x", timeout=10,
                  headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
    assert r.status_code == 200
    collector.wait(3)  # recorded by then
    g = httpx.get(f"http://127.0.0.1:{admin}/lineage/{TRACE}", timeout=10).json()
    (server,) = [s for s in g["spans"] if s["kind"] == "server"]
    clients = [s for s in g["spans"] if s["kind"] == "client"]
    ids = [parse_traceparent(h["traceparent"].encode())[1].decode() for h in up.seen]
    assert [c["span_id"] for c in clients] == ids  # by start time: the order tried
    assert [(c["status"], c["error"], c["resend_count"]) for c in clients] == [
        (503, None, 0), (200, None, 1)]
    assert all(c["parent_id"] == server["span_id"] for c in clients)
    assert all(c["endpoint"] == f"127.0.0.1:{up.port}" for c in clients)
    assert g["roots"] == [server["span_id"]]
    assert {(e["parent"], e["child"]) for e in g["edges"]} == {
        (CALLER, server["span_id"]), *((server["span_id"], i) for i in ids)}
