"""The per-request filter chain: identity, policy, guards, rate limits, caches, tracing.

Like Envoy's HTTP filters, each feature that looks at a request is a factory built once
per config (a FilterFactory, shared by every request on the routes it applies to) that
starts a small per-request Filter. The Exchange runs the chain at fixed points:

  request(ex)            after the route (and cluster) is chosen, before an upstream is
                         picked. Returns None to go on, a LocalReply to answer instead
                         (401/403/429 ...), a StoredResponse to answer with a complete
                         response (a cache hit), or an awaitable giving one of those
                         (a Redis round trip, a bounded wait queue). Filters run in
                         chain order; the first answer stops the chain.
  response_head(ex, r)   the response head about to go to the client; return it or a
                         replacement (e.g. ResponseHead.without_length(r) before a
                         filter changes the body's length), or raise ResponseRefused
                         to answer with a local reply instead (the upstream's response
                         is dropped unseen).
  response_body(ex, b)   body bytes on their way to the client; return what to send
                         (b"" holds them back).
  response_end(ex)       the upstream finished; return held-back bytes to send last.
  finishing(ex)          the response is complete and about to be released to the
                         client (its last bytes, end of stream or trailers, or a whole
                         local reply): return an awaitable to hold that release until
                         it is done (the audit log's fsync = "always"); if it fails
                         the response is aborted instead of completed.
  done(ex)               the exchange ended (answered, failed or abandoned): settle
                         reservations, write audit records. Runs before metrics/logs.

An exchange that takes no route (404, or a 400/417/501 before routing) runs the
Runtime's `unrouted_filters` instead (tracing and audit, built with route None): they
start just before its local reply (or at its end, if it ends unanswered before a route
was chosen) and only see the response and done hooks.

Response hooks run in reverse chain order (the filter nearest the upstream first), and
for an answer from filter i only filters before i see it: a cached response is still
redacted by a filter in front of the cache.

Request body: a factory that sets `inspect_bytes` gets `ex.request_body()` holding the
first inspect_bytes of the body (or all of it, `ex.req_done`) when request() runs; the
bytes wait in the exchange and go upstream untouched afterwards.

Shared per-request facts (Exchange attributes): ex.trace_id (tracing), ex.identity (an
Identity, set by the auth filter), ex.llm (what the LLM filter read of an OpenAI-style
request and response: model, stream, token usage), ex.intent/intent_domain (semantic),
ex.gov (a dict of governance facts for the audit record: "policy" -> (decision, rule id),
"guard" -> flagged rule ids, "redactions" -> counts per type).

Upstream request headers: `ex.set_upstream_header(name, value)` adds a field to the
request sent upstream, replacing any the client sent under that name.

Filter state that must survive a config reload (token buckets, caches) lives in the
object `states` hands each builder; see Runtime.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from aiproxy.protocols.fields import F_CONTENT_LENGTH, F_HOP, FieldsHead

if TYPE_CHECKING:
    from aiproxy.config import Config, RouteConfig
    from aiproxy.pipeline.exchange import Exchange


class Identity:
    """Who sent a request, as the auth filter established it. `subject` is the key
    rate limits, policy and logs use; `kind` is "api_key", "jwt" or "mtls"; `claims`
    the verified JWT claims (or key/cert attributes); `roles` for RBAC."""

    __slots__ = ("subject", "kind", "claims", "roles")

    def __init__(self, subject: str, kind: str, claims: dict[str, Any] | None = None,
                 roles: tuple[str, ...] = ()) -> None:
        self.subject = subject
        self.kind = kind
        self.claims = claims or {}
        self.roles = roles

    def __repr__(self) -> str:
        return f"Identity({self.kind}:{self.subject})"


class LocalReply:
    """An answer from the proxy itself: a JSON error body (a trailers-only response with
    the matching grpc-status for gRPC callers) plus extra response fields."""

    __slots__ = ("status", "code", "message", "headers")

    def __init__(self, status: int, code: str, message: str,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or []


class ResponseRefused(Exception):
    """Raised by a response_head hook: this response must not reach the client (a filter
    that cannot do its job on it fails closed); the client gets `reply` instead."""

    def __init__(self, reply: LocalReply) -> None:
        super().__init__(reply.message)
        self.reply = reply


class UpstreamBodyError(Exception):
    """Raised by a response_body/response_end hook that cannot read the upstream's body
    (a content coding that does not decode): the upstream failed, not the filter. The
    client gets 502 upstream_bad_response if none of the response has gone out, a cut
    response otherwise; the proxy logs a warning, not a traceback."""


class ResponseHead(FieldsHead):
    """A response head built by a filter (a cached response) or derived from the
    upstream's (fields changed), with the interface of the protocol heads."""

    __slots__ = ("status", "reason")

    def __init__(self, status: int, items: list[tuple[bytes, bytes]]) -> None:
        super().__init__(items)
        self.status = status
        try:
            self.reason = HTTPStatus(status).phrase.encode()
        except ValueError:
            self.reason = b"Unknown"

    @classmethod
    def derived(cls, resp: Any, drop: int = 0,
                extra: tuple[tuple[bytes, bytes], ...] = ()) -> ResponseHead:
        """resp's end-to-end fields (less those `drop` flags), then `extra`. Hop-by-hop
        fields are left out here: a head rebuilt from a field list flags fields by name
        only, so those the upstream's Connection field named (RFC 9110 7.6.1) would
        otherwise reach the client."""
        return cls(resp.status, [*resp.fields(F_HOP | drop), *extra])

    @classmethod
    def without_length(cls, resp: Any) -> ResponseHead:
        """resp without Content-Length: for a body a filter will change the length of
        (HTTP/1.1 clients then get it chunked)."""
        return cls.derived(resp, F_CONTENT_LENGTH)


class StoredResponse:
    """A complete response a filter answers with (a cache hit): the body as a list of
    pieces sent in order, so a stored event stream keeps its event boundaries.
    `version`: the protocol (a Head.version) the response was received with, which the
    Via field names (RFC 9110 7.6.3); 0 for the proxy's own response (no Via)."""

    __slots__ = ("head", "chunks", "trailers", "version")

    def __init__(self, head: ResponseHead, chunks: list[bytes],
                 trailers: list[tuple[bytes, bytes]] | None = None, version: int = 11) -> None:
        self.head = head
        self.chunks = chunks
        self.trailers = trailers
        self.version = version


RequestResult = LocalReply | StoredResponse | None


class Filter:
    """One request's filter. Subclasses override what they need."""

    __slots__ = ()
    # True for a filter whose response_body only reads the bytes and returns them all
    # (no response_end or finishing either): a gRPC call cut mid-response can still end
    # with its status in trailers (Exchange.body_untouched).
    reads_body_only = False

    def request(self, ex: Exchange) -> RequestResult | Awaitable[RequestResult]:
        return None

    def response_head(self, ex: Exchange, resp: Any) -> Any:
        return resp

    def response_body(self, ex: Exchange, data: bytes) -> bytes:
        return data

    def response_end(self, ex: Exchange) -> bytes:
        return b""

    def finishing(self, ex: Exchange) -> Awaitable[None] | None:
        return None

    def reply_fields(self, ex: Exchange) -> list[tuple[bytes, bytes]]:
        """Fields for the proxy's own reply (an error) to a request this filter let
        through; a filter that answered the request itself is not asked."""
        return []

    def done(self, ex: Exchange) -> None:
        return None


class FilterFactory:
    """Built once per config for the routes it applies to; starts one Filter per request
    (or None when this request needs nothing from it)."""

    name = "filter"
    inspect_bytes = 0

    def start(self, ex: Exchange) -> Filter | None:
        raise NotImplementedError


# One entry of the chain's builder list (aiproxy/pipeline/chain.py):
#   name        the feature ("auth", "ratelimit", ...)
#   make_state  (config, previous state or None) -> state kept across reloads (token
#               buckets, caches), or None when the config does not use the feature
#   build       (config, route config, state) -> the route's FilterFactory, or None
MakeState = Callable[["Config", Any], Any]
Build = Callable[["Config", "RouteConfig", Any], "FilterFactory | None"]
BuilderEntry = tuple[str, MakeState, Build]


def prepare_states(builders: list[BuilderEntry], config: Config,
                   previous: dict[str, Any] | None) -> dict[str, Any]:
    """Each feature's state for a new config, from the previous runtime's."""
    old = previous or {}
    states = {}
    for name, make_state, _ in builders:
        state = make_state(config, old.get(name))
        if state is not None:
            states[name] = state
    return states


def route_filters(builders: list[BuilderEntry], config: Config, route: RouteConfig | None,
                  states: dict[str, Any],
                  only: tuple[str, ...] | None = None) -> tuple[FilterFactory, ...]:
    """The chain for one route, in builder order; features without state are off.
    route None with `only`: the chain of exchanges that took no route."""
    chain = []
    for name, _, build in builders:
        if only is not None and name not in only:
            continue
        state = states.get(name)
        if state is not None:
            factory = build(config, route, state)
            if factory is not None:
                chain.append(factory)
    return tuple(chain)
