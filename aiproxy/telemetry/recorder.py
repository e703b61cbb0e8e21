"""What happens when an exchange ends: metrics, then the access log line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiproxy._fast.clock import monotonic
from aiproxy.governance.tracing import parse_traceparent
from aiproxy.pipeline.ends import Reporter
from aiproxy.telemetry.access_log import AccessLog, iso_now, ms
from aiproxy.telemetry.metrics import Metrics

if TYPE_CHECKING:
    from aiproxy.pipeline.exchange import Exchange

# nginx's code for "the client closed the connection before the response".
CLIENT_CLOSED = 499
# Before the response, a stream reset for a malformed request is what HTTP/1.1 answers
# 400; a request cut by the drain deadline, the server going away (503).
STREAM_ERROR = 400
DRAINED = 503


def lost_status(ex: Exchange) -> int:
    """The status of an exchange whose client side ended before a response head."""
    if ex.stream_error is not None:
        return STREAM_ERROR
    return DRAINED if ex.drained else CLIENT_CLOSED


def trace_id(traceparents: list[bytes]) -> str | None:
    """The trace-id of the caller's traceparent (without [tracing]) when W3C calls it
    valid, as the tracing filter reads it: one field, no all-zero or upper-case ids."""
    parsed = parse_traceparent(traceparents[0]) if len(traceparents) == 1 else None
    return None if parsed is None else parsed[0].decode()


class Telemetry(Reporter):
    __slots__ = ("metrics", "access_log")

    def __init__(self, metrics: Metrics, access_log: AccessLog | None) -> None:
        self.metrics = metrics
        self.access_log = access_log

    def exchange_done(self, exchange: Exchange) -> None:
        ex = exchange
        route = ex.route
        route_name = route.name if route is not None else ""
        cluster = ex.cluster.name if ex.cluster is not None else ""
        status = ex.status if not (ex.client_lost and not ex.head_sent) else lost_status(ex)
        self.metrics.exchange_stamps(route_name, cluster, status, ex.req_bytes, ex.resp_bytes,
                                     ex, monotonic())
        log = self.access_log
        if log is None:
            return
        timings = ex.timings()
        head = ex.head
        record: dict[str, Any] = {
            "time": iso_now(),
            "client": ex.down.peer.decode(),
            "method": ex.method.decode("latin-1"),
            "path": (ex.path or head.target).decode("latin-1"),
            "protocol": "HTTP/2" if head.version == 20 else f"HTTP/1.{head.version % 10}",
            "status": status,
            "bytes_in": ex.req_bytes,
            "bytes_out": ex.resp_bytes,
            "route": route_name or None,
            "cluster": cluster or None,
            "endpoint": ex.pool.endpoint.address if ex.pool is not None else None,
            "intent": ex.intent,
            "duration_ms": ms(timings["total"]),
            "timings_ms": {k: ms(v) for k, v in timings.items() if k != "total"},
            "trace_id": ex.trace_id or trace_id(head.get_all(b"traceparent")),
        }
        if ex.grpc:  # the HTTP status is 200 for nearly every call: the gRPC one says more
            record["grpc_status"] = ex.grpc_status if ex.grpc_status >= 0 else None
        if ex.no_intent is not None:  # semantic routing made no intent: why
            record["no_intent"] = ex.no_intent
        if ex.client_lost:  # how it ended: the client left, or the proxy cut it
            if ex.stream_error is not None:
                record["stream_error"] = ex.stream_error
            elif ex.drained:
                record["drained"] = True
            else:
                record["client_closed"] = True
        if ex.upstream_error is not None:  # the response was cut off: an error, not a 200
            record["upstream_error"] = ex.upstream_error
        if ex.tunnel:  # an Upgrade tunnel: how it ended
            record["ended"] = ex.tunnel_ended
        if ex.llm is not None:
            record["llm"] = ex.llm.log_fields()
        log.write(record)


    def rejected(self, peer: bytes, status: int, reason: str, bytes_in: int,
                 bytes_out: int, protocol: str = "HTTP/1.1") -> None:
        """An access line for a message refused before it was a request (nginx logs its
        400s too): the fields of one, None where there was no request to read them from,
        and `rejected` saying why."""
        log = self.access_log
        if log is None:
            return
        log.write({
            "time": iso_now(), "client": peer.decode(), "method": None, "path": None,
            "protocol": protocol, "status": status, "bytes_in": bytes_in,
            "bytes_out": bytes_out, "route": None, "cluster": None, "endpoint": None,
            "intent": None, "duration_ms": None, "timings_ms": {}, "trace_id": None,
            "rejected": reason,
        })


def server_timing(ex: Exchange) -> bytes:
    """Server-Timing field value for the stages known when the response head goes out."""
    timings = ex.timings()
    return b", ".join(b"%s;dur=%.3f" % (name.encode(), value * 1000)
                      for name, value in timings.items())
