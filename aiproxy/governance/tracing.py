"""W3C Trace Context (https://www.w3.org/TR/trace-context/): every proxied request is a
span. A valid incoming `traceparent` is continued (same trace id, this hop's own span
id as the upstream's parent); a missing or invalid one starts a new trace, and its
`tracestate` is dropped with it (the spec forbids using tracestate without a valid
traceparent). The upstream also gets `x-trace-id`."""

from __future__ import annotations

import os
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


class TraceFilter(Filter):
    __slots__ = ("trace_id", "parent_id", "span_id")

    def __init__(self, trace_id: bytes, parent_id: bytes | None, span_id: bytes) -> None:
        self.trace_id = trace_id
        self.parent_id = parent_id
        self.span_id = span_id


class TraceFactory(FilterFactory):
    name = "tracing"

    def start(self, ex: Exchange) -> Filter:
        head = ex.head
        parsed = parse_traceparent(head.get(b"traceparent"))
        span = os.urandom(8).hex().encode()
        if parsed is None:
            trace, parent, flags = os.urandom(16).hex().encode(), None, b"01"
            ex.set_upstream_header(b"tracestate", None)  # drops the client's
        else:
            trace, parent, flags = parsed
        ex.set_upstream_header(b"traceparent", b"00-%s-%s-%s" % (trace, span, flags))
        ex.set_upstream_header(b"x-trace-id", trace)
        ex.trace_id = trace.decode()
        return TraceFilter(trace, parent, span)


def make_state(config: Config, previous: Any) -> Any:
    return TraceFactory() if config.tracing is not None else None


def build(config: Config, route: RouteConfig, state: TraceFactory) -> FilterFactory:
    return state
