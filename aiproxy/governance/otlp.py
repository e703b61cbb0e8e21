"""OTLP/gRPC export of the spans tracing records (`[tracing] otlp_endpoint`).

A thread batches spans (up to MAX_BATCH, or what arrived within FLUSH_S) into one
ExportTraceServiceRequest and calls the collector's TraceService/Export. The queue is
bounded: when the collector is slow or down, spans are dropped and counted, never
held against the request path. Needs grpcio and opentelemetry-proto (the "otlp" extra).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

log = logging.getLogger("aiproxy.otlp")

MAX_QUEUE = 10_000
MAX_BATCH = 512
FLUSH_S = 0.2
REPORT_EVERY = 60  # seconds between warnings of failed exports
SPAN_KIND_SERVER = 2
SPAN_KIND_CLIENT = 3
STATUS_ERROR = 2


def _attr(key: str, value: Any) -> Any:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    if isinstance(value, bool):
        v = AnyValue(bool_value=value)
    elif isinstance(value, int):
        v = AnyValue(int_value=value)
    else:
        v = AnyValue(string_value=str(value))
    return KeyValue(key=key, value=v)


# OpenTelemetry's HTTP server span attributes (semantic conventions 1.26+): server.* is
# the proxy as the client addressed it (the Host), not the upstream, which is aiproxy's own.
ATTRIBUTES = (("method", "http.request.method"), ("path", "url.path"),
              ("scheme", "url.scheme"), ("protocol", "network.protocol.version"),
              ("client", "client.address"),
              ("status", "http.response.status_code"), ("route", "aiproxy.route"),
              ("cluster", "aiproxy.cluster"), ("endpoint", "aiproxy.upstream.address"),
              ("model_id", "gen_ai.request.model"), ("caller_model_id", "aiproxy.caller_model"),
              ("subject", "enduser.id"))


def host_attributes(host: str | None) -> list[tuple[str, str | int]]:
    """server.address and server.port of a Host value ("example.com:8443", "[::1]")."""
    if not host:
        return []
    name, port = host, ""
    if host.startswith("["):
        end = host.find("]")
        if end > 0:
            name, port = host[1:end], host[end + 2:] if host[end + 1:end + 2] == ":" else ""
    elif host.count(":") == 1:
        name, _, port = host.partition(":")
    out: list[tuple[str, str | int]] = [("server.address", name)]
    if port.isdigit() and 0 < int(port) < 65536:
        out.append(("server.port", int(port)))
    return out


def to_proto(span: dict[str, Any]) -> Any:
    from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

    client = span.get("kind") == "client"
    start = int(span["start"] * 1e9)
    if client:
        attributes = client_attributes(span)
    else:
        attributes = ([_attr(name, span[k]) for k, name in ATTRIBUTES if span.get(k) is not None]
                      + [_attr(name, value) for name, value in host_attributes(span.get("host"))])
    out = Span(
        trace_id=bytes.fromhex(span["trace_id"]), span_id=bytes.fromhex(span["span_id"]),
        name=f"{span['method']} {span['route'] or span['path']}",
        kind=SPAN_KIND_CLIENT if client else SPAN_KIND_SERVER,
        start_time_unix_nano=start,
        end_time_unix_nano=start + int(span["duration_ms"] * 1e6),
        attributes=attributes)
    if span["parent_id"]:
        out.parent_span_id = bytes.fromhex(span["parent_id"])
    status = span["status"]
    if client:
        # OpenTelemetry's HTTP client spans: an error, or a 4xx/5xx, is an error status.
        if span["error"] is not None or status is None or status >= 400:
            out.status.CopyFrom(Status(code=STATUS_ERROR, message=span["message"] or ""))
    elif status >= 500 or not status:
        out.status.CopyFrom(Status(code=STATUS_ERROR))
    return out


# An upstream attempt's CLIENT span: server.* is the endpoint it went to.
CLIENT_ATTRIBUTES = (("method", "http.request.method"), ("protocol", "network.protocol.version"),
                     ("status", "http.response.status_code"), ("route", "aiproxy.route"),
                     ("cluster", "aiproxy.cluster"), ("endpoint", "aiproxy.upstream.address"),
                     ("model_id", "gen_ai.request.model"))


def client_attributes(span: dict[str, Any]) -> list[Any]:
    out = [_attr(name, span[k]) for k, name in CLIENT_ATTRIBUTES if span.get(k) is not None]
    out += [_attr(name, value) for name, value in host_attributes(span["endpoint"])]
    if span["resend_count"]:  # semantic conventions: only on the 2nd and later attempts
        out.append(_attr("http.request.resend_count", span["resend_count"]))
    error = span["error"] or (str(span["status"]) if (span["status"] or 0) >= 400 else None)
    if error is not None:
        out.append(_attr("error.type", error))
    return out


class OtlpExporter:
    def __init__(self, endpoint: str, service_name: str) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        self.endpoint = endpoint
        self.service_name = service_name
        self.channel = grpc.insecure_channel(endpoint)
        self.stub = trace_service_pb2_grpc.TraceServiceStub(self.channel)
        self.queue: deque[dict[str, Any]] = deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.exported = self.dropped = self.failed = 0
        self.reported_at = -REPORT_EVERY
        self.unreported = 0
        self.thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self.thread.start()

    def add(self, span: dict[str, Any]) -> None:
        if len(self.queue) >= MAX_QUEUE:
            self.dropped += 1
            return
        self.queue.append(span)
        if len(self.queue) >= MAX_BATCH:
            with self.cond:
                self.cond.notify()

    def _request(self, spans: list[dict[str, Any]]) -> Any:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
        from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
        from opentelemetry.proto.resource.v1.resource_pb2 import Resource
        from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans

        return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
            resource=Resource(attributes=[_attr("service.name", self.service_name)]),
            scope_spans=[ScopeSpans(scope=InstrumentationScope(name="aiproxy"),
                                    spans=[to_proto(s) for s in spans])])])

    def _run(self) -> None:
        while True:
            with self.cond:
                if not self.queue and not self.stopping:
                    self.cond.wait(FLUSH_S)
                stopping = self.stopping
            while self.queue:
                batch = []
                while self.queue and len(batch) < MAX_BATCH:
                    batch.append(self.queue.popleft())
                try:
                    self.stub.Export(self._request(batch), timeout=5)
                    self.exported += len(batch)
                except Exception as exc:  # the collector's problem must not stop export
                    self.failed += len(batch)
                    self._report(len(batch), exc)
                    break
            if stopping:
                self.channel.close()
                return

    def _report(self, lost: int, exc: Exception) -> None:
        """One warning a REPORT_EVERY at most: a collector that is down fails every
        flush (five a second), each with grpc's multi-line error text."""
        self.unreported += lost
        now = time.monotonic()
        if now - self.reported_at < REPORT_EVERY:
            return
        code = getattr(exc, "code", None)
        why = (f"{code().name}: {exc.details()}" if callable(code)  # a grpc.RpcError
               else str(exc) or type(exc).__name__)
        log.warning("OTLP export to %s failed, %d spans dropped since the last report "
                    "(reported at most every %d s): %s", self.endpoint, self.unreported,
                    REPORT_EVERY, " ".join(why.split()))
        self.reported_at = now
        self.unreported = 0

    def close(self, wait: bool = True) -> None:
        """Stop after sending what is queued; `wait` (at shutdown) up to 10 s for that.
        A reload does not wait: it runs on the event loop, and an export in flight to a
        slow collector may take its whole timeout."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if wait:
            self.thread.join(timeout=10)
