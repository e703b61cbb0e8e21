"""W3C Trace Context (https://www.w3.org/TR/trace-context/): every proxied request is a
span. A valid incoming `traceparent` is continued (same trace id, this hop's own span
id; the upstream's parent is the span of the attempt that calls it, see below); a
missing or invalid one starts a new trace, and its `tracestate` is dropped with it (the
spec forbids using tracestate without a valid traceparent). A continued trace's
tracestate fields go on as one list, or not at all when the list is invalid
(parse_tracestate); trace flags keep only the bits Level 2 defines. The upstream also
gets `x-trace-id` (and `x-model-id` from a route with `model`, see
aiproxy/routing/table.py); a caller's own x-model-id is kept in its span.

Each upstream attempt (a retry, a failover after a refused connect, a replay after a
stale connection) is a client span of its own, a child of the hop's server span: its id
is the parent the `traceparent` sent to that attempt's upstream names. The Exchange
calls the hop's TraceFilter (ex.tracer, None without [tracing]) when an attempt starts,
gets a response head, and fails.

Lineage: each proxied hop is a server span (trace id, span id, parent span id, model id,
route, cluster, status, timings), each attempt a client span, kept in a bounded
in-memory store (the oldest traces go first). When model services call each other
through aiproxy, passing traceparent on, the spans of one trace form the call graph:
parent span -> child span (hop -> attempt -> the next hop), labelled with the model
called (the SpanID + ModelID fingerprint). GET /lineage/<trace_id> on the admin
listener returns it."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from aiproxy.pipeline.filters import Filter, FilterFactory

if TYPE_CHECKING:
    from aiproxy.config import Config, RouteConfig
    from aiproxy.pipeline.exchange import Exchange

_HEX = frozenset(b"0123456789abcdef")
_ZERO_TRACE = b"0" * 32
_ZERO_SPAN = b"0" * 16


def parse_traceparent(value: bytes | None) -> tuple[bytes, bytes, bytes] | None:
    """(trace id, parent span id, flags) of a valid traceparent, else None. Versions
    after 00 are read by the 00 layout, as the spec asks; ff is invalid."""
    if value is None:
        return None
    value = value.strip(b" \t")
    if len(value) < 55 or value[2:3] != b"-" or value[35:36] != b"-" or value[52:53] != b"-":
        return None
    version = value[:2]
    if not _HEX.issuperset(version) or version == b"ff":
        return None
    if version == b"00" and len(value) != 55:
        return None
    if len(value) > 55 and value[55:56] != b"-":
        return None
    trace, span, flags = value[3:35], value[36:52], value[53:55]
    if not (_HEX.issuperset(trace) and _HEX.issuperset(span) and _HEX.issuperset(flags)):
        return None
    if trace == _ZERO_TRACE or span == _ZERO_SPAN:
        return None
    return trace, span, flags


# Trace flags this hop forwards: sampled (01) and Level 2's random trace-id (02); W3C asks
# that the bits it does not define be sent as zero.
_KNOWN_FLAGS = 0x03
_NEW_TRACE_FLAGS = b"03"  # sampled (every span is kept) and random (16 bytes of urandom)

_LCALPHA = frozenset(b"abcdefghijklmnopqrstuvwxyz")
_LCALNUM = _LCALPHA | frozenset(b"0123456789")
_KEYCHARS = _LCALNUM | frozenset(b"_-*/")
_VALUECHARS = frozenset(range(0x20, 0x7F)) - frozenset(b",=")
MAX_TRACESTATE_MEMBERS = 32


def _tracestate_key(key: bytes) -> bool:
    """W3C Trace Context 1, 3.3.1.3.1: a simple key, or tenant@system."""
    tenant, at, system = key.partition(b"@")
    if not at:
        return 0 < len(key) <= 256 and key[0] in _LCALPHA and _KEYCHARS.issuperset(key)
    return (0 < len(tenant) <= 241 and tenant[0] in _LCALNUM and _KEYCHARS.issuperset(tenant)
            and 0 < len(system) <= 14 and system[0] in _LCALPHA
            and _KEYCHARS.issuperset(system))


def parse_tracestate(values: list[bytes]) -> bytes | None:
    """The tracestate fields (in order) as one list without optional whitespace, or None
    when there is no member or the list is invalid: a member breaking the key/value
    grammar, a key given twice, more than 32 members. The spec lets a vendor discard a
    tracestate it cannot parse, and its test harness expects the whole header gone."""
    members: list[bytes] = []
    keys: set[bytes] = set()
    for field in values:
        for member in field.split(b","):
            member = member.strip(b" \t")  # OWS around members; empty members are allowed
            if not member:
                continue
            key, eq, value = member.partition(b"=")
            if (not eq or key in keys or not _tracestate_key(key)
                    or not 0 < len(value) <= 256 or not _VALUECHARS.issuperset(value)):
                return None
            keys.add(key)
            members.append(member)
    if not members or len(members) > MAX_TRACESTATE_MEMBERS:
        return None
    return b",".join(members)


MAX_TRACES = 10_000
MAX_SPANS = 256  # per trace
# In all: clients choose trace ids, so 10,000 traces of 256 spans (2.5 million, each a
# dict of some hundred bytes) would be theirs to fill.
MAX_STORED_SPANS = 50_000
MAX_PATH = 1024  # characters of a span's path kept (url.path; the query is never kept)
MAX_HOST = 256  # of the Host (server.address and server.port)


class LineageStore:
    """Spans by trace id, bounded: at most MAX_TRACES traces of at most MAX_SPANS spans
    each, and max_spans in all (least recently touched traces dropped first)."""

    def __init__(self, max_traces: int = MAX_TRACES, max_spans: int = MAX_STORED_SPANS) -> None:
        self.max_traces = max_traces
        self.max_spans = max_spans
        self.traces: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self.spans = 0
        self.dropped = 0

    def add(self, span: dict[str, Any]) -> None:
        trace = span["trace_id"]
        spans = self.traces.get(trace)
        if spans is None:
            spans = self.traces[trace] = []
        else:
            self.traces.move_to_end(trace)
        if len(spans) >= MAX_SPANS:
            return
        spans.append(span)
        self.spans += 1
        while len(self.traces) > self.max_traces or self.spans > self.max_spans:
            _, oldest = self.traces.popitem(last=False)
            self.spans -= len(oldest)
            self.dropped += 1

    def graph(self, trace_id: str) -> dict[str, Any] | None:
        spans = self.traces.get(trace_id)
        return None if spans is None else build_graph(trace_id, list(spans))


def build_graph(trace_id: str, spans: list[dict[str, Any]]) -> dict[str, Any]:
    """The call graph of one trace from its spans (of one process or several workers)."""
    ids = {s["span_id"] for s in spans}
    edges = [{"parent": s["parent_id"], "child": s["span_id"], "model": s["model_id"]}
             for s in spans if s["parent_id"] is not None]
    roots = [s["span_id"] for s in spans if s["parent_id"] not in ids]
    return {"trace_id": trace_id, "spans": sorted(spans, key=lambda s: s["start"]),
            "edges": edges, "roots": roots}


def trace_spans(runtime: Any, trace_id: str) -> list[dict[str, Any]] | None:
    """This process's spans of a trace ([] if none); None when [tracing] is off."""
    tracing = runtime.filter_states.get("tracing")
    if tracing is None:
        return None
    return list(tracing.store.traces.get(trace_id) or ())


def model_id(ex: Exchange) -> str | None:
    """The model a hop called: the LLM filter's reading of the request, the model the
    policy read from the body, or the route's configured model."""
    llm = ex.llm
    model = getattr(llm, "model", None) if llm is not None else None
    if model:
        return str(model)
    model = ex.gov.get("model")
    if model:
        return model
    route = ex.route
    if route is not None and route.model is not None:
        return route.model.decode("latin-1")
    return None


class Attempt:
    """One upstream attempt: its client span id, endpoint, start and end (time.time()),
    the response status it got (None before a head) and the error that ended it."""

    __slots__ = ("span_id", "endpoint", "start", "end", "status", "error", "message")

    def __init__(self, span_id: bytes, endpoint: str) -> None:
        self.span_id = span_id
        self.endpoint = endpoint
        self.start = time.time()
        self.end = 0.0
        self.status: int | None = None
        self.error: str | None = None
        self.message: str | None = None


class TraceFilter(Filter):
    __slots__ = ("trace_id", "parent_id", "span_id", "flags", "factory", "start", "attempts")

    def __init__(self, trace_id: bytes, parent_id: bytes | None, span_id: bytes,
                 flags: bytes, factory: TraceFactory) -> None:
        self.trace_id = trace_id
        self.parent_id = parent_id
        self.span_id = span_id
        self.flags = flags
        self.factory = factory
        self.start = time.time()
        self.attempts: list[Attempt] = []

    def attempt(self, ex: Exchange, pool: Any) -> None:
        """An upstream attempt starts (before its connection is taken or opened): a
        client span, whose id the upstream gets as its parent."""
        # Every way an attempt fails ends it before the next starts; this is a guard.
        self.attempt_end("abandoned", "the proxy started another attempt")
        span = os.urandom(8).hex().encode()
        ex.set_upstream_header(b"traceparent",
                               b"00-%s-%s-%s" % (self.trace_id, span, self.flags))
        self.attempts.append(Attempt(span, pool.endpoint.address))

    def attempt_head(self, status: int) -> None:
        """The attempt's upstream answered with `status` (the attempt goes on until the
        response ends, or attempt_end if it is retried)."""
        if self.attempts:
            self.attempts[-1].status = status

    def attempt_end(self, error: str | None = None, message: str | None = None,
                    now: float = 0.0) -> None:
        """The open attempt (if any) ends (now, unless `now` says when); `error` (a code
        such as upstream_reset) when it failed."""
        if self.attempts:
            a = self.attempts[-1]
            if not a.end:
                a.end = now or time.time()
                a.error = error
                a.message = message

    def done(self, ex: Exchange) -> None:
        route = ex.route
        now = time.time()
        model = model_id(ex)
        trace_id = self.trace_id.decode()
        span_id = self.span_id.decode()
        self.factory.add_span({
            "kind": "server",
            "trace_id": trace_id,
            "span_id": span_id,
            "parent_id": self.parent_id.decode() if self.parent_id is not None else None,
            "model_id": model,
            "caller_model_id": ex.gov.get("caller_model"),
            "route": route.name if route is not None else None,
            "cluster": ex.cluster.name if ex.cluster is not None else None,
            "endpoint": ex.pool.endpoint.address if ex.pool is not None else None,
            "subject": ex.identity.subject if ex.identity is not None else None,
            "method": ex.method.decode("latin-1"),
            "path": ex.path[:MAX_PATH].decode("latin-1"),
            "scheme": ex.down.scheme.decode("latin-1"),
            "protocol": "2" if ex.head.version == 20 else f"1.{ex.head.version % 10}",
            "client": ex.down.peer.decode("latin-1"),
            "host": ((ex.host_line[6:-2] if ex.host_line else ex.head.host) or b""
                     )[:MAX_HOST].decode("latin-1") or None,  # HTTP/1.0 may send none
            "status": ex.status,
            "start": self.start,
            "duration_ms": round((now - self.start) * 1000, 3),
        })
        if not self.attempts:
            return
        # The last attempt is still open if it answered (its response ended with the
        # exchange) or the client left while it ran. One that answered keeps its status
        # as the outcome: the client may leave once it has the whole body, before the
        # upstream's end of stream arrives.
        if ex.client_lost and self.attempts[-1].status is None:
            self.attempt_end("client_lost", "the client went away before a response", now)
        else:
            self.attempt_end(now=now)
        protocol = "2" if ex.cluster.cfg.protocol == "h2" else "1.1"
        method = ex.method.decode("latin-1")
        for n, a in enumerate(self.attempts):
            self.factory.add_span({
                "kind": "client",
                "trace_id": trace_id,
                "span_id": a.span_id.decode(),
                "parent_id": span_id,
                "model_id": model,
                "route": route.name if route is not None else None,
                "cluster": ex.cluster.name,
                "endpoint": a.endpoint,
                "method": method,
                "protocol": protocol,
                "resend_count": n,
                "status": a.status,
                "error": a.error,
                "message": a.message,
                "start": a.start,
                "duration_ms": round((a.end - a.start) * 1000, 3),
            })


class TraceFactory(FilterFactory):
    name = "tracing"

    def __init__(self) -> None:
        self.store = LineageStore()
        self.exporter: Any = None  # an OtlpExporter with [tracing] otlp_endpoint

    def start(self, ex: Exchange) -> Filter:
        head = ex.head
        sent = head.get_all(b"traceparent")
        # W3C Trace Context 3.2: more than one traceparent is as good as none.
        parsed = parse_traceparent(sent[0]) if len(sent) == 1 else None
        span = os.urandom(8).hex().encode()
        if parsed is None:
            trace, parent, flags = os.urandom(16).hex().encode(), None, _NEW_TRACE_FLAGS
            ex.set_upstream_header(b"tracestate", None)  # drops the client's
        else:
            trace, parent, flags = parsed
            flags = b"%02x" % (int(flags, 16) & _KNOWN_FLAGS)
            sent = head.get_all(b"tracestate")
            if sent:  # one field, or none when invalid (3.3.1: combined into one)
                ex.set_upstream_header(b"tracestate", parse_tracestate(sent))
        # traceparent goes up per attempt (TraceFilter.attempt), naming its client span.
        ex.set_upstream_header(b"x-trace-id", trace)
        ex.trace_id = trace.decode()
        ex.gov["span_id"] = span.decode()
        caller = head.get(b"x-model-id")
        if caller is not None:
            ex.gov["caller_model"] = caller.decode("latin-1")
        ex.tracer = f = TraceFilter(trace, parent, span, flags, self)
        return f

    def add_span(self, span: dict[str, Any]) -> None:
        self.store.add(span)
        if self.exporter is not None:
            self.exporter.add(span)

    def close(self, wait: bool = True) -> None:
        if self.exporter is not None:
            self.exporter.close(wait)
            self.exporter = None


def make_state(config: Config, previous: Any) -> Any:
    """The span store survives reloads; the exporter follows the config."""
    cfg = config.tracing
    if not isinstance(previous, TraceFactory):
        previous = None
    if cfg is None:
        if previous is not None:
            previous.close(wait=False)  # on the loop: never wait for a slow collector
        return None
    state = previous or TraceFactory()
    old = state.exporter
    if old is None or (old.endpoint, old.service_name) != (cfg.otlp_endpoint, cfg.service_name):
        state.close(wait=False)
        if cfg.otlp_endpoint:
            from aiproxy.governance.otlp import OtlpExporter

            state.exporter = OtlpExporter(cfg.otlp_endpoint, cfg.service_name)
    return state


def build(config: Config, route: RouteConfig, state: TraceFactory) -> FilterFactory:
    return state
