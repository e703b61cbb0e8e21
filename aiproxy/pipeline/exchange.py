"""One proxied request/response: routing, upstream selection, retries and deadlines.

An Exchange sits between a downstream (the client side: an HTTP/1.1 connection,
or one HTTP/2 stream) and an upstream (an HTTP/1.1 connection or one HTTP/2
stream). It speaks to both through small interfaces, so every combination of
protocols shares this code:

downstream: loop, server, peer, scheme, pause_mask, writing_paused,
    pause(reason)/resume(reason), send_continue(), send_informational(resp),
    send_response(ex, resp, mode) -> keep_alive, send_body(data), flush(),
    send_end(trailers), send_error(ex, status, message, code, headers) -> keep_alive,
    abort_response(), exchange_done(ex, keep_alive), and for Upgrade tunnels
    start_tunnel(), tunnel_write(data), tunnel_eof(), close().
upstream: start(ex), send_body(pieces), end_body(), pause()/resume(),
    usable(), received, abort(), close(), and for tunnels tunnel_write(data),
    tunnel_eof().

Bodies stream in both directions. The only buffering is body bytes that arrive
while an upstream connection is being opened (bounded: reading pauses) and a
small copy of the request body kept so it can be replayed on another endpoint
after a connect failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from functools import partial
from random import random
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from aiproxy import wirejson
from aiproxy._fast.clock import event_now, monotonic
from aiproxy._fast.freelist import install as install_freelist
from aiproxy._fast.h1 import (
    MAX_METHOD_BYTES,
    ChunkedDecoder,
    ParseError,
    ResponseHead,
    find_query,
    valid_authority,
)
from aiproxy.kernel.tunnel import BOTH, DOWN_TO_UP, UP_TO_DOWN
from aiproxy.pipeline.ends import BODY_LENGTH, BODY_NONE, BODY_TUNNEL, ExchangeBase, forwarded_lines
from aiproxy.pipeline.filters import (
    Filter,
    FilterFactory,
    LocalReply,
    ResponseRefused,
    StoredResponse,
    UpstreamBodyError,
)
from aiproxy.pipeline.filters import ResponseHead as OwnResponseHead
from aiproxy.pipeline.paths import BadPath, needs_normalizing, normalize_path
from aiproxy.pipeline.redirect import location
from aiproxy.protocols.fields import trailer_fields
from aiproxy.protocols.replies import error_body, grpc_status_for, grpc_status_value
from aiproxy.routing.pool import UpstreamConnectError
from aiproxy.routing.stats import LOAD_HEADERS
from aiproxy.routing.table import ANY_INTENT, Route

if TYPE_CHECKING:
    from aiproxy.config import RetryPolicy
    from aiproxy.routing.pool import Pool

log = logging.getLogger("aiproxy.exchange")

# Header flags from aiproxy/_fast/h1.pxd.
F_HOP = 1
F_CONTENT_LENGTH = 2
F_HOST = 8
F_XFF = 128
F_XFP = 256
# The fields the proxy states its decisions in upstream (identity, intent, guard flags,
# cache, policy, backpressure) are named x-aiproxy-*: a client's own are dropped, and so
# are x_aiproxy_* ones, which CGI-style servers read as the same names.
F_OWN = 1024

P_UPSTREAM = 1  # reasons the downstream stops reading the request body
P_PENDING = 2

REQ_NONE = 0
REQ_LENGTH = 1   # HTTP/1.1 Content-Length body, framed here
REQ_CHUNKED = 2  # HTTP/1.1 chunked body, decoded here
REQ_STREAM = 3   # body pieces handed in by the downstream (HTTP/2 DATA frames)

INSPECT_SEMANTIC = 1  # what waits for the first body bytes: intent classification
INSPECT_FILTERS = 2   # or the filter chain's request hooks

PENDING_LIMIT = 256 * 1024
REPLAY_LIMIT = 64 * 1024
CRLF = b"\r\n"
INFINITY = float("inf")
NO_INTENT = (None, None)  # the route table's `sem` for a request without an intent
# 1xx responses one request may get at once before its final response; one more is a
# 502. Go's client stops at 5; 103 Early Hints come one or two to a response. Without a
# cap an upstream could send 1xx until the request times out, each passed to the client.
# The budget refills by one each INFORMATIONAL_REFILL_S, so a 102 Processing heartbeat
# through a long call (one every few seconds) is never cut, and a flood still is.
MAX_INFORMATIONAL = 16
INFORMATIONAL_REFILL_S = 1.0
# Failures of a request the upstream never got: an HTTP/2 stream refused or past a
# GOAWAY's last stream id (RFC 9113 8.7, 6.8), or an HTTP/1.1 request whose first
# write found the connection already reset.
NEVER_PROCESSED = frozenset(("upstream_refused_stream", "upstream_goaway", "upstream_not_sent"))
IDEMPOTENT = frozenset((b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"))
# Methods start() looks at before anything else; a plain request pays one set lookup.
RARE_METHODS = frozenset((b"CONNECT", b"OPTIONS", b"TRACE", b"PRI"))
# What an OPTIONS the proxy answers itself (Max-Forwards: 0) lists: the methods it
# forwards (any other token goes on too, but cannot be listed; never CONNECT).
ALLOW = b"GET, HEAD, POST, PUT, DELETE, OPTIONS, TRACE, PATCH"
ALLOW_NO_TRACE = b"GET, HEAD, POST, PUT, DELETE, OPTIONS, PATCH"
MAX_FORWARDS_LIMIT = 2**31 - 1  # the largest Max-Forwards sent on (RFC 9110 7.6.2)
# Fields a TRACE answered here leaves out of its echo (RFC 9110 9.3.8): credentials.
TRACE_HIDDEN = frozenset((b"authorization", b"proxy-authorization", b"cookie", b"x-api-key"))
# OpenAI-style usage in a JSON body or the final SSE event (llm_score token accounting).
USAGE_TOTAL = re.compile(rb'"total_tokens"\s*:\s*(\d{1,9})')
TOKEN_TAIL = 4096  # bytes of the response end searched for usage
GRPC_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def forwarded_upgrade(value: bytes | None) -> bytes | None:
    """The Upgrade field for an HTTP/1.1 upstream: the client's, without h2c. The proxy
    terminates HTTP/2 itself; passing h2c on and tunnelling the upstream's 101 would
    hand the client a raw HTTP/2 connection to the upstream, past routing and policy
    ("h2c smuggling"). A version on the token (`h2c/1`) does not make it another
    protocol: the 101 is checked by protocol name. None when nothing is left."""
    if value is None or b"h2c" not in value.lower():
        return value
    tokens = [t.strip() for t in value.split(b",")]
    return b", ".join(t for t in tokens
                      if t and t.split(b"/", 1)[0].strip().lower() != b"h2c") or None


def upgrade_protocols(value: bytes) -> set[bytes]:
    """The protocol names of an Upgrade field (versions aside), lower case."""
    return {t.strip().split(b"/", 1)[0].lower() for t in value.split(b",") if t.strip()}


def grpc_timeout_value(seconds: float) -> bytes:
    """A grpc-timeout value for what is left of a deadline: whole milliseconds (rounded
    down, at least 1), in a larger unit when 8 digits do not hold them."""
    ms = max(1, int(seconds * 1000))
    if ms < 100_000_000:
        return b"%dm" % ms
    return b"%dS" % min(ms // 1000, 99_999_999)


def grpc_timeout(value: bytes | None) -> float | None:
    """Seconds from a grpc-timeout value ("100m", "5S", ...), None if absent or invalid."""
    if not value or len(value) > 9 or not value[:-1].isdigit():
        return None
    unit = GRPC_TIMEOUT_UNITS.get(value[-1:])
    return int(value[:-1]) * unit if unit is not None else None


def body_untouched(filters: tuple) -> bool:
    """No filter holds back or replaces response body bytes (tracing, policy, rate
    limits): a gRPC call cut mid-response can end with its status in trailers straight
    away."""
    for f in filters:
        t = type(f)
        if ((t.response_body is not Filter.response_body and not t.reads_body_only)
                or t.response_end is not Filter.response_end
                or t.finishing is not Filter.finishing):
            return False
    return True


class Exchange(ExchangeBase):
    __slots__ = (
        "loop", "rt", "head", "route", "pool", "upstream", "connect_task",
        "reading_body", "req_done", "req_mode", "req_remaining", "decoder", "req_bytes",
        "pending", "pending_size", "pending_end", "replay", "replay_size", "tried", "reused",
        "path", "up_target", "host_line", "head_sent", "finished", "keep_alive",
        "status", "resp_bytes", "activity", "body_activity", "req_done_at", "tunnel",
        "tunnel_up_eof", "t_start", "grpc", "deadline_at",
        "t_parsed", "t_routed", "t_connect", "t_connected", "t_sent", "t_first", "reported",
        "client_lost", "t_start_pc", "inspecting", "intent", "intent_domain", "intent_conf",
        "t_classify", "cluster", "counted", "pending_conn", "attempts",
        "is_retry", "retry_handle", "req_timeout", "tok_tail", "hold", "body_len",
        "replayed", "filters", "up_headers", "inspect_limit", "gate_task", "continued",
        "trace_id", "identity", "llm", "done_filters", "splice", "intent_decision", "gov",
        "info_used", "info_at", "upstream_error", "no_intent", "grpc_status",
        "stream_error", "drained", "tunnel_ended", "close_after", "tracer",
    )

    def __init__(self, down: Any, head: Any, now: float) -> None:
        self.setup(down, head, now)

    def setup(self, down: Any, head: Any, now: float) -> None:
        """What __init__ does; HTTP/1.1 calls it on Exchange.__new__(Exchange), a C call
        without the argument tuple of a constructor call.

        Only what differs from a new object's fields is set: the rest start as None,
        0, 0.0 or False (exchange.pxd declares them all). Among those: route, pool,
        cluster, upstream, connect_task, decoder, pending (made when body bytes must
        wait), splice (a kernel.tunnel.TunnelSplice), the stage stamps t_routed ..
        t_first and t_classify, trace_id (set by the tracing filter), identity (the
        auth filter), llm (what the LLM filter read), _gov (the gov property makes
        it), intent/intent_domain/intent_decision, retry_handle, hold (the pool to
        use once a held body is rewritten), upstream_error (why the upstream failed
        after the response head went out: the client got a cut-off response), no_intent
        (why a request semantic routing looked at got no intent: see _classify),
        stream_error (why the proxy reset the client's HTTP/2 stream, RFC 9113 8.1.1);
        drained (the client was cut by the drain deadline: see on_client_lost);
        tunnel_ended (how an Upgrade tunnel ended: see _tunnel_end); close_after (an
        HTTP/1.1 connection must end after this response: what follows on it is not
        requests); tracer (the tracing filter, told of each upstream attempt)."""
        # Read back through the typed fields: struct reads, not attribute lookups.
        self.down = down
        self.loop = self.down.loop
        self.rt = self.down.server.runtime
        self.head = head
        self.method = self.head.method
        # Body bytes kept for a retry: a tuple until the first ones arrive (no list
        # per request), None once there are too many to keep.
        self.replay = ()
        self.tried = ()
        self.reused = False
        self.path = b""
        self.up_target = b""
        self.host_line = b""
        self.activity = now
        self.body_activity = now
        self.req_done_at = now
        self.t_start = now
        self.deadline_at = INFINITY
        # Stage stamps use the fine clock (_fast/clock.pyx); `now`, when the head began to
        # arrive, is on the same clock, at millisecond steps where it is a loop.time().
        # The head is parsed as of the read that completed it: that read's event stamp.
        self.t_parsed = event_now()
        self.t_start_pc = now if now < self.t_parsed else self.t_parsed
        self.filters = ()
        self.body_len = -1  # Content-Length of a rewritten body
        self.grpc_status = -1  # a gRPC call's grpc-status as the client got it; -1: none

    @property
    def gov(self) -> dict[str, Any]:
        """Governance facts for the audit record (filters.py), made on first use."""
        if self._gov is None:
            self._gov = {}
        return self._gov

    # -- request side -------------------------------------------------------------

    def refuse(self, status: int, message: str) -> None:
        """Answer `status` instead of starting: for a request the downstream could not
        take in whole (an HTTP/2 header list over max_header_bytes, decoded only to keep
        the connection's HPACK state in step), whose head holds only what the reply
        needs (pseudo-fields, content-type: a gRPC caller gets a trailers-only reply)."""
        ctype = self.head.get(b"content-type")
        if ctype is not None and ctype[:16].lower() == b"application/grpc":
            self.grpc = True
        if self._framing():  # else it has answered (413)
            self.local_reply(status, message)

    def start(self) -> None:
        head = self.head
        method = self.method
        target = head.target
        ctype = head.get(b"content-type")
        if ctype is not None and ctype[:16].lower() == b"application/grpc":
            self.grpc = True
            timeout = grpc_timeout(head.get(b"grpc-timeout"))
            if timeout is not None:
                self.deadline_at = self.t_start + timeout
        rare = method in RARE_METHODS
        if rare and method == b"CONNECT":
            self._framing()
            # What follows a CONNECT on the connection may be tunnel bytes sent ahead of
            # the answer (RFC 9110 9.3.6), never requests: the connection ends here.
            self.close_after = True
            return self.local_reply(501, "CONNECT is not supported by this listener")
        if rare and method == b"PRI":
            # RFC 9113 3.4, 11.6: the start of an HTTP/2 connection preface, never a
            # request; over HTTP/1.1 what follows it is HTTP/2 frames.
            self._framing()
            self.close_after = True
            return self.local_reply(
                400, "the PRI method is reserved for the HTTP/2 connection preface")
        if head.version == 20:
            # The limits the HTTP/1.1 parser applies to a request line and field count
            # (the header list's size is SETTINGS_MAX_HEADER_LIST_SIZE's).
            rt = self.rt
            if len(method) > MAX_METHOD_BYTES:  # as the HTTP/1.1 parser (h1.pyx)
                self._framing()
                return self.local_reply(501, "request method too long")
            if len(method) + 1 + len(target) > rt.max_request_line_bytes:
                self._framing()
                return self.local_reply(414, "request target too long")
            if head.header_count > rt.max_headers:
                self._framing()
                return self.local_reply(431, "too many header fields")
        if head.target_plain:
            # The parser found an origin-form target with nothing to check or normalize.
            q = head.query_at
            self.path = target if q < 0 else target[:q]
            self.up_target = target
        elif target[:1] == b"/":
            if target.find(b"#") >= 0:  # not `in`: see needs_normalizing()
                return self.local_reply(400, "fragment in request target")
            q = find_query(target)
            self.path = target if q < 0 else target[:q]
            self.up_target = target
        elif target == b"*" and method == b"OPTIONS":
            self.path = self.up_target = b"*"
        elif not self._absolute_form(target):
            return self.local_reply(400, "invalid request target")
        if not head.target_plain and needs_normalizing(self.path):
            http = self.rt.http
            try:
                path = normalize_path(self.path, http.merge_slashes, http.escaped_slashes)
            except BadPath as exc:
                return self.local_reply(400, str(exc))
            self.up_target = path + self.up_target[len(self.path):]
            self.path = path
        if head.expect_unknown:
            return self.local_reply(417, "unsupported expectation")
        if not self._framing():
            return
        if rare and self._max_forwards():
            return
        sem = self.rt.semantic
        if sem is not None and self.rt.table.uses_intent:
            explicit = head.get(sem.header)
            if explicit:  # an empty field names no intent: the model reads the request
                # UTF-8, as the config's intent names are: it matches a route written
                # in the same characters and goes upstream as the same bytes.
                try:
                    self.intent = explicit.decode()
                except UnicodeDecodeError:
                    return self.local_reply(
                        400, f"{sem.header.decode()} is not UTF-8")
                self.intent_domain = sem.domain_of(self.intent)
                self.intent_conf = 1.0
                sem.explicit += 1
            elif self.reading_body and sem.inspect_bytes:
                length = head.content_length
                if (length < 0 or length > sem.inspect_bytes) and not self._intent_may_route():
                    # A streamed or large body to a route no intent can change: it is not
                    # held (an upload streams, a gRPC call does not wait on its first
                    # message); the request is classified by what is known without it.
                    self.no_intent = "not_held"
                    return self._classify(b"")
                # Route once inspect_bytes of the body (or all of it) has arrived; the
                # bytes wait in `pending` and go upstream untouched afterwards.
                return self._inspect(INSPECT_SEMANTIC, sem.inspect_bytes)
            else:
                if self.reading_body:  # inspect_bytes = 0
                    self.no_intent = "not_held"
                return self._classify(b"")
        self._route()

    def _max_forwards(self) -> bool:
        """RFC 9110 7.6.2 for OPTIONS and TRACE: at 0 the proxy is the final recipient
        and answers; above, the request goes on with one less. True when answered."""
        values = self.head.get_all(b"max-forwards")
        if not values:
            return False
        value = values[0]
        if len(values) > 1 or not value.isdigit():
            # Neither "is this the last hop" nor the value to forward can be told.
            self.local_reply(400, "invalid Max-Forwards (one field of digits expected)")
            return True
        value = value.lstrip(b"0")
        if value:
            left = int(value) - 1 if len(value) <= 10 else MAX_FORWARDS_LIMIT
            self.set_upstream_header(b"max-forwards", b"%d" % min(left, MAX_FORWARDS_LIMIT))
            return False
        if self.method == b"OPTIONS":
            self._answer_here([(b"allow", ALLOW)], b"")
        else:
            self._answer_here([(b"content-type", b"message/http")], self._trace_echo())
        return True

    def _trace_echo(self) -> bytes:
        """The request head as received (RFC 9110 9.3.8), less the fields that may hold
        credentials; an HTTP/2 request as the HTTP/1.1-style head it amounts to."""
        head = self.head
        hidden = TRACE_HIDDEN
        auth = self.rt.config.auth
        if auth is not None:
            hidden = hidden | {auth.api_key_header}
        if head.version == 20:
            out = [head.method, b" ", head.target, b" HTTP/2.0\r\n"]
            if head.host is not None:
                out += (b"Host: ", head.host, CRLF)
        else:
            raw = head.raw
            out = [raw[:raw.find(CRLF) + 2]]
        for name, value in head.headers():
            if name.lower() not in hidden:
                out += (name, b": ", value, CRLF)
        out.append(CRLF)
        return b"".join(out)

    def _answer_here(self, fields: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A 200 of the proxy's own (not a forwarded response: no Via), before routing:
        the unrouted filters (tracing, audit) see it as they see a local reply."""
        if self.rt.unrouted_filters:
            self._start_unrouted()
        fields.append((b"content-length", b"%d" % len(body)))
        self._answer(StoredResponse(OwnResponseHead(200, fields), [body] if body else [],
                                    version=0), len(self.filters))

    def _intent_may_route(self) -> bool:
        """Whether some intent could pick another route than no intent would."""
        route = self._match(ANY_INTENT)
        return route is not None and (route.intent is not None
                                      or route.intent_domain is not None)

    def _match(self, intent: tuple) -> Route | None:
        """The route table's match for this request, with `intent` as (intent, domain)."""
        up_target = self.up_target
        q = find_query(up_target)
        return self.rt.table.match(
            self.method, self.path, self.head.host if not self.host_line else self.host_line[6:-2],
            self.head, up_target[q + 1:] if q >= 0 else b"", intent)

    def _inspect(self, kind: int, limit: int) -> None:
        """Wait for `limit` body bytes (or the whole body) before going on with `kind`."""
        # Every field and list member: `identity` first must not hide a `gzip` after it.
        coded = False
        for coding in b",".join(self.head.get_all(b"content-encoding")).lower().split(b","):
            if coding.strip() not in (b"", b"identity"):
                coded = True
        if coded:
            if kind == INSPECT_SEMANTIC:
                self.no_intent = "compressed"
                return self._classify(b"")  # routed on what can be read: no body
            # What the filters read decides (guard, policy, token limits): a coded body
            # would pass unread. RFC 9110 15.5.16: 415, naming what is accepted.
            return self.local_reply(
                415, "a request body the proxy inspects must not have a Content-Encoding",
                "unsupported_content_encoding", [(b"accept-encoding", b"identity")])
        self.inspecting = kind
        self.inspect_limit = limit
        if self.req_done or self._inspect_enough():
            return self._inspected()
        self._send_continue()

    def _inspect_enough(self) -> bool:
        """Whether the body bytes held are enough to inspect: inspect_limit of them, or
        for gRPC the first message whole. A streaming call's client may wait for an
        answer to its first message before it sends more (bidi ping-pong)."""
        if self.pending_size >= self.inspect_limit:
            return True
        if self.grpc and self.pending_size >= 5:
            first = b"".join(self.pending)
            return len(first) >= 5 + int.from_bytes(first[1:5], "big")
        return False

    def _inspected(self) -> None:
        kind = self.inspecting
        self.inspecting = 0
        if kind == INSPECT_SEMANTIC:
            body = b"".join(self.pending or ())
            self._classify(body[:self.rt.semantic.inspect_bytes])
        else:
            self._gate(0)

    def _send_continue(self) -> None:
        if self.head.expect_continue and self.reading_body and not self.continued:
            self.continued = True
            self.down.send_continue()

    def request_body(self) -> bytes:
        """The request body read so far (filters with inspect_bytes; nothing of it has
        gone upstream yet). Complete when self.req_done."""
        return b"".join(self.pending or ())

    def request_body_whole(self, body: bytes) -> bool:
        """Whether `body` (what request_body() gave) is all of the request body: the
        body ended, or a content-length says it is all here."""
        return self.req_done or 0 <= self.head.content_length <= len(body)

    def cap_body(self, limit: int, why: str) -> None:
        """Refuse the body (413, `why`) once more than `limit` bytes of it have come: for
        a filter that judged a body of unknown length (chunked, or HTTP/2 without
        content-length) by its start."""
        if not self.body_cap or limit < self.body_cap:
            self.body_cap = limit
            self.body_cap_why = why

    def set_upstream_header(self, name: bytes, value: bytes | None) -> None:
        """Add a field (lower-case name) to the upstream request, replacing the
        client's fields of that name (value None: just remove them)."""
        headers = self.up_headers
        if headers is None:
            self.up_headers = [(name, value)]
        else:
            self.up_headers = [h for h in headers if h[0] != name]
            self.up_headers.append((name, value))

    def _classify(self, body: bytes) -> None:
        """Classify the request's text (of `body`, at most inspect_bytes of the body,
        and the query). Without an intent, no_intent says why: "not_held" or
        "compressed" (set before: the body was not read), "no_text" (nothing readable),
        "no_words" (text without a word), "error" (extraction or the model failed)."""
        sem = self.rt.semantic
        t0 = monotonic()
        try:
            text, why = sem.read_text(self.head, body, self.up_target)
        except Exception:  # never fail a request on its content: route without an intent
            log.exception("semantic extraction failed")
            sem.failures += 1
            text, why = "", "error"
        if not text:
            if self.no_intent is None or why == "error":
                self.no_intent = why
            self.t_classify = monotonic() - t0
            return self._route()
        self.no_intent = None  # the query had text: classified
        cache = self.rt.decision_cache
        if cache is not None:  # the embedding cache: a prompt seen before skips the model
            decision = cache.decision_for(self, body)
            if decision is not None:
                return self._decided(decision, t0)
        if sem.batcher is not None:
            task = self.loop.create_task(sem.batcher.classify(text))
            task.add_done_callback(partial(self._classified, t0=t0))
            return
        native = sem.native
        try:
            if native is not None:  # the C head, called directly (no Python frame)
                decision = native.classify(text, sem.top_k, sem.threshold)
            else:
                decision = sem.model.classify(text)
        except Exception:
            log.exception("intent classification failed; routing without it")
            sem.failures += 1
            decision = None
        self._decided(decision, t0)

    def _classified(self, task: asyncio.Task, t0: float) -> None:
        if self.finished:
            return
        decision = None
        if not task.cancelled() and task.exception() is None:
            decision = task.result()
        else:
            self.rt.semantic.failures += 1
        self._decided(decision, t0)

    def _decided(self, decision: Any, t0: float) -> None:
        if decision is not None:
            self.intent_decision = decision
            self.intent = decision.label
            self.intent_domain = decision.domain or None
            self.intent_conf = decision.confidence
            decisions = self.rt.semantic.decisions  # by domain, for /metrics
            domain = decision.domain or "none"
            decisions[domain] = decisions.get(domain, 0) + 1
        else:
            self.no_intent = "error"
        self.t_classify = monotonic() - t0
        self._route()

    def _route(self) -> None:
        intent = self.intent
        route = self._match(NO_INTENT if intent is None else (intent, self.intent_domain))
        if route is None:
            return self.local_reply(404, "no route matches the request", "no_route")
        self.route = route
        self.cluster = route.pick_cluster(self.head) if route.cum_weights else route.cluster
        factories = route.filters
        if factories:
            return self._start_filters(factories)
        self._dispatch()

    # -- filter chain (aiproxy/pipeline/filters.py) -----------------------------------

    def _start_filters(self, factories: tuple[FilterFactory, ...]) -> None:
        started = []
        need = 0  # body bytes the filters that run want to see (not the route's maximum)
        for factory in factories:
            try:
                f = factory.start(self)
            except Exception:
                log.exception("filter %s failed to start", factory.name)
                return self.local_reply(500, f"filter {factory.name} failed", "filter_error")
            if f is not None:
                started.append(f)
                if factory.inspect_bytes > need:
                    need = factory.inspect_bytes
        self.filters = tuple(started)
        if need and self.reading_body:
            return self._inspect(INSPECT_FILTERS, need)
        self._gate(0)

    def _gate(self, i: int) -> None:
        """Run filters[i:]'s request hooks; dispatch upstream when none answered."""
        filters = self.filters
        while i < len(filters):
            f = filters[i]
            try:
                result = f.request(self)
            except Exception:
                log.exception("filter %s failed", type(f).__name__)
                return self.local_reply(500, "request filter failed", "filter_error")
            if result is not None:
                if isinstance(result, LocalReply | StoredResponse):
                    return self._answer(result, i)
                fut = asyncio.ensure_future(result)
                self.gate_task = fut
                fut.add_done_callback(lambda t, i=i: self._gated(t, i))
                return
            i += 1
        self._dispatch()

    def _gated(self, fut: asyncio.Future, i: int) -> None:
        self.gate_task = None
        if self.finished:
            return
        if fut.cancelled() or fut.exception() is not None:
            if not fut.cancelled():
                log.error("filter %s failed", type(self.filters[i]).__name__,
                          exc_info=fut.exception())
            return self.local_reply(500, "request filter failed", "filter_error")
        result = fut.result()
        if result is not None:
            return self._answer(result, i)
        self._gate(i + 1)

    def _answer(self, result: LocalReply | StoredResponse, i: int) -> None:
        """Filter i answered: earlier filters still see the response on its way out;
        later ones never started. Filter i's done() still runs."""
        self.done_filters = self.filters[:i + 1]
        self.filters = self.filters[:i]
        if isinstance(result, LocalReply):
            return self.local_reply(result.status, result.message, result.code,
                                    result.headers)
        self.reading_body = False
        self.status = result.head.status
        self.resp_version = result.version  # what its Via names
        self.head_sent = True
        self.t_first = monotonic()
        resp = self._filter_head(result.head)
        if resp is None:
            return
        mode = BODY_NONE if self.method == b"HEAD" or self.status in (204, 304) else BODY_LENGTH
        self.keep_alive = self.down.send_response(self, resp, mode)
        if mode != BODY_NONE:
            for chunk in result.chunks:
                self.on_upstream_body(chunk)
                if self.finished:
                    return
        tail = self._filter_end()
        if tail is None:
            return
        self.resp_bytes += len(tail)
        self._drop_upstream()
        gate = self._finishing()
        if gate is not None:
            gate.add_done_callback(lambda g: self._release_end(g, tail, result.trailers))
            return
        if tail:
            self.down.send_body(tail)
        self.down.send_end(result.trailers)
        self._finish(self.keep_alive and self.req_done)

    # A response hook that raises ends the response (a redaction filter must fail closed:
    # nothing it has not seen may reach the client); None tells the caller to stop.

    def _filter_head(self, resp: Any) -> Any:
        try:
            for f in reversed(self.filters):
                resp = f.response_head(self, resp)
        except ResponseRefused as exc:
            log.warning("response refused by filter %s: %s", type(f).__name__, exc)
            self._drop_upstream()
            reply = exc.reply
            return self.local_reply(reply.status, reply.message, reply.code, reply.headers)
        except Exception:
            return self._filter_failed(f)
        return resp

    def _filter_body(self, data: bytes) -> bytes | None:
        try:
            for f in reversed(self.filters):
                data = f.response_body(self, data)
        except UpstreamBodyError as exc:
            return self._upstream_body_failed(f, exc)
        except Exception:
            return self._filter_failed(f)
        return data

    def _filter_end(self) -> bytes | None:
        out = b""
        try:
            for f in reversed(self.filters):
                if out:
                    out = f.response_body(self, out)
                out += f.response_end(self)
        except UpstreamBodyError as exc:
            return self._upstream_body_failed(f, exc)
        except Exception:
            return self._filter_failed(f)
        return out

    def _upstream_body_failed(self, f: Filter, exc: Exception) -> None:
        # The upstream sent a body its filter cannot read (bad gzip): an upstream
        # failure, answered as one (a 502 while the head can still be taken back).
        log.warning("upstream response body refused by filter %s: %s", type(f).__name__, exc)
        if self.done_filters is None:
            self.done_filters = self.filters
        self.filters = ()
        self._drop_upstream()
        self.on_upstream_failed(502, "upstream_bad_response", str(exc))

    def _filter_failed(self, f: Filter) -> None:
        log.exception("response filter %s failed; ending the response", type(f).__name__)
        if self.done_filters is None:
            self.done_filters = self.filters
        self.filters = ()
        self._abort()

    def _dispatch(self) -> None:
        """Pick an endpoint of the chosen cluster and send the request there."""
        head = self.head
        route = self.route
        if route.direct is not None or route.redirect is not None:
            return self._answer_route()
        cluster = self.cluster
        if head.upgrade is not None and cluster.cfg.protocol == "h2":
            offered = forwarded_upgrade(head.upgrade)
            if offered is not None:
                # HTTP/2 has no Upgrade (RFC 9113 8.6) and extended CONNECT (RFC 8441)
                # upstream is not implemented: refused, never sent on as a plain request.
                return self.local_reply(
                    501, f"cannot carry Upgrade: {offered.decode('latin-1')} to cluster "
                    f"{cluster.name!r}, whose upstreams speak HTTP/2", "upgrade_not_supported")
        if route.has_policy and self.method == b"TRACE" and route.cfg.request_headers_add:
            # The fields a route adds may be the upstream's credentials (an API key the
            # proxy injects), and an upstream that implements TRACE echoes them back.
            return self.local_reply(
                405, "TRACE is not forwarded on a route that adds request fields",
                "method_not_allowed", [(b"allow", ALLOW_NO_TRACE)])
        if cluster.max_requests:
            why = cluster.overflow()
            if why is not None:
                return self.local_reply(503, why, "upstream_overflow")
        pool = cluster.pick(self)
        if pool is None:
            return self.local_reply(503, f"cluster {cluster.name!r} has no endpoints",
                                    "no_healthy_upstream")
        cluster.active += 1
        self.counted = True
        timeout = route.timeout
        self.req_timeout = timeout if timeout is not None else cluster.request_timeout
        if route.prefix_rewrite is not None:
            self.up_target = route.prefix_rewrite + self.up_target[len(route.path_prefix):]
        self.t_routed = monotonic()
        if self.reading_body:
            self._send_continue()
        if route.model is not None and self._model_body(head):
            if not self.req_done:
                self.hold = pool  # connect once the whole (small JSON) body is here
                return
            self._rewrite_model()
        self._use(pool)

    def _answer_route(self) -> None:
        """The route's own answer (direct_response, redirect), once its filters (auth,
        policy, rate limits) let the request through. The request's body is not read:
        a connection with body bytes still to come closes after the answer."""
        route = self.route
        d = route.direct
        fields: list[tuple[bytes, bytes]] = []
        if d is not None:
            status, body = d.status, d.body
            if body:
                fields.append((b"content-type", d.content_type))
        else:
            r = route.redirect
            q = find_query(self.up_target)
            loc = location(r, self.down.scheme,
                           self.host_line[6:-2] if self.host_line else self.head.host,
                           self.path, self.up_target[q + 1:] if q >= 0 else b"",
                           route.path_prefix)
            if loc is None:
                return self.local_reply(
                    400, "the request names no host to redirect to", "no_host")
            status, body = r.status, b""
            fields.append((b"location", loc))
        if status not in (204, 304):
            fields.append((b"content-length", b"%d" % len(body)))
        self._answer(StoredResponse(OwnResponseHead(status, fields), [body] if body else [],
                                    version=0), len(self.filters))

    def _model_body(self, head: Any) -> bool:
        """Whether to hold the body to rewrite its JSON `model` field: only a JSON body of
        known length that fits in the replay buffer (it is kept whole anyway)."""
        if self.replay is None or not 0 < head.content_length <= REPLAY_LIMIT:
            return False
        ctype = head.get(b"content-type")
        return ctype is not None and ctype[:16].lower() == b"application/json"

    def _rewrite_model(self) -> None:
        body = b"".join(self.pending or ())
        try:
            data = wirejson.loads(body)
        except ValueError:
            return  # not JSON after all: forward it untouched
        if not isinstance(data, dict):
            return
        data["model"] = self.route.model.decode("ascii")
        try:
            body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
        except UnicodeEncodeError:  # a lone surrogate (\ud800): sent as its escape
            body = json.dumps(data, separators=(",", ":")).encode()
        self.pending = [body]
        self.pending_size = len(body)
        self.replay = [body]
        self.replay_size = len(body)
        self.body_len = len(body)

    def _absolute_form(self, target: bytes) -> bool:
        lower = target[:8].lower()
        if lower.startswith(b"http://"):
            rest = target[7:]
        elif lower.startswith(b"https://"):
            rest = target[8:]
        else:
            return False
        end = len(rest)
        for sep in (b"/", b"?"):
            i = rest.find(sep)
            if 0 <= i < end:
                end = i
        authority = rest[:end]
        # It becomes the upstream Host field: the head parser's check of a Host field
        # (which also rules out userinfo, RFC 9112 3.2.1).
        if not valid_authority(authority) or b"#" in rest:
            return False
        path = rest[end:]
        if not path:
            # RFC 9112 3.2.4: an OPTIONS for the server itself (no path, no query) goes to
            # the origin in asterisk-form, and is routed as `OPTIONS *` is.
            path = b"*" if self.method == b"OPTIONS" else b"/"
        elif path[:1] == b"?":
            path = b"/" + path
        self.up_target = path
        q = path.find(b"?")
        self.path = path if q < 0 else path[:q]
        # RFC 9112 3.2.2: the target's authority replaces the Host field.
        self.host_line = b"Host: " + authority + CRLF
        return True

    def _framing(self) -> bool:
        head = self.head
        max_body = self.rt.max_body
        if head.content_length > 0 and max_body and head.content_length > max_body:
            self.local_reply(413, "request body larger than max_body_bytes")
            return False
        if head.chunked:
            self.req_mode = REQ_CHUNKED
            self.decoder = ChunkedDecoder(self.rt.max_header_bytes, self.rt.max_headers)
            self.reading_body = True
            self.up_chunked = True
        elif head.version == 20 and head.body_streamed:  # HTTP/2 DATA frames follow
            self.req_mode = REQ_STREAM
            self.reading_body = True
            self.up_chunked = head.content_length < 0
        elif head.content_length > 0:
            self.req_mode = REQ_LENGTH
            self.req_remaining = head.content_length
            self.reading_body = True
        else:
            self.req_done = True
        return True

    def h1_request_head(self, pool: Pool) -> bytes:
        """The request head for an HTTP/1.1 upstream."""
        head = self.head
        rt = self.rt
        drop = F_HOP | F_CONTENT_LENGTH | F_OWN
        # The added field lines, one slot each (None: not sent): see Head.compose.
        host = fwd = decision = framing = upgrade_lines = added = None
        ep = pool  # typed in exchange.pxd: a C field read
        if ep.host_line is not None:  # the cluster's `host`
            drop |= F_HOST
            host = ep.host_line
        elif self.host_line:
            drop |= F_HOST
            host = self.host_line
        elif head.version == 20 and head.host is not None:
            # RFC 9113 8.3.1: :authority becomes the Host field of an HTTP/1.1 request.
            drop |= F_HOST
            host = b"Host: " + head.host + CRLF
        elif head.host is None:
            host = b"Host: " + pool.endpoint.address.encode() + CRLF
        if rt.x_forwarded:
            drop |= F_XFF | F_XFP
            if head.has_xff:
                fwd = forwarded_lines(self._xff(), self.down.scheme)
            else:
                fwd = self.down.forwarded  # forwarded_lines() of the connection
        if self.intent is not None:  # only set where rt.semantic is
            decision = rt.semantic.decision_lines(self.intent, self.intent_domain,
                                                  self.intent_conf)
        if self.up_chunked:
            framing = b"Transfer-Encoding: chunked\r\n"
        elif self.body_len >= 0:
            framing = b"Content-Length: %d\r\n" % self.body_len
        elif head.content_length >= 0:
            framing = b"Content-Length: %d\r\n" % head.content_length
        if head.upgrade is not None:
            upgrade = forwarded_upgrade(head.upgrade)
            if upgrade is not None:
                upgrade_lines = b"Connection: upgrade\r\nUpgrade: " + upgrade + CRLF
        route = self.route
        remove = None
        if route.has_policy:
            if route.req_add_lines:
                added = route.req_add_lines
            remove = route.req_remove
        up_headers = self.up_headers
        if up_headers:
            set_lines = b"".join([b"%s: %s\r\n" % h for h in up_headers if h[1] is not None])
            added = set_lines if added is None else added + set_lines
            names = frozenset([n for n, _ in up_headers])
            remove = remove | names if remove else names
        extra = (host, fwd, rt.via_line(head.version), decision, framing, upgrade_lines, added)
        if remove:
            start_line = self.method + b" " + self.up_target + b" HTTP/1.1\r\n"
            return serialize_without(head, start_line, joined(extra), drop, remove)
        return head.compose(self.method, self.up_target, extra, drop)

    def h2_request_headers(self, pool: Pool) -> list[tuple[bytes, bytes]]:
        """The request fields for an HTTP/2 upstream (RFC 9113 8.3.1 pseudo-fields first)."""
        head = self.head
        authority = pool.authority
        if authority is None:
            authority = self.host_line[6:-2] if self.host_line else head.host
        if not authority:
            authority = pool.endpoint.address.encode()
        fields = [(b":method", self.method), (b":scheme", pool.scheme),
                  (b":path", self.up_target), (b":authority", authority)]
        # One content-length with one value (RFC 9113 8.1.1, RFC 9110 8.6), as for an
        # HTTP/1.1 upstream: the client's may be a list ("5, 5") or repeated.
        drop = F_HOP | F_HOST | F_OWN | F_CONTENT_LENGTH
        length = self.body_len if self.body_len >= 0 else head.content_length
        if length >= 0:
            fields.append((b"content-length", b"%d" % length))
        rt = self.rt
        if rt.x_forwarded:
            drop |= F_XFF | F_XFP
        route = self.route
        remove = route.req_remove
        up_headers = self.up_headers
        if up_headers:
            names = frozenset(n for n, _ in up_headers)
            remove = remove | names if remove else names
        if remove:
            fields += [f for f in head.fields(drop) if f[0] not in remove]
        else:
            fields += head.fields(drop)
        if route.req_add:
            fields += route.req_add
        if up_headers:
            fields += [h for h in up_headers if h[1] is not None]
        if rt.x_forwarded:
            fields.append((b"x-forwarded-for", self._xff()))
            fields.append((b"x-forwarded-proto", self.down.scheme))
        via = rt.via_fields.get(head.version)
        if via is not None:
            fields.append(via)
        if self.intent is not None:
            fields += rt.semantic.decision_fields(self.intent, self.intent_domain,
                                                  self.intent_conf)
        if self.grpc or head.get(b"te") == b"trailers":
            fields.append((b"te", b"trailers"))
        if self.deadline_at < INFINITY:
            # The upstream gets the time left, not the client's whole budget.
            fields = [f for f in fields if f[0] != b"grpc-timeout"]
            fields.append((b"grpc-timeout",
                           grpc_timeout_value(self.deadline_at - monotonic())))
        return fields

    def request_trailers(self) -> list[tuple[bytes, bytes]]:
        """The trailer fields that ended the client's request body (HTTP/2) that an
        HTTP/2 upstream gets: trailer_fields' and none the proxy sets or removes on this
        request (the route's, the identity's, the API key field)."""
        fields = getattr(self.down, "request_trailers", None)
        if not fields:
            return []
        route = self.route
        owned = set(route.req_remove)
        owned.update([n for n, _ in route.req_add])
        if self.up_headers:
            owned.update([n for n, _ in self.up_headers])
        auth = self.rt.config.auth
        if auth is not None:
            owned.add(auth.api_key_header)
        return trailer_fields(fields, frozenset(owned))

    def _xff(self) -> bytes:
        peer = self.down.peer
        if self.head.has_xff:
            return b", ".join([*self.head.get_all(b"x-forwarded-for"), peer])
        return peer

    def feed_body(self, data: bytes | memoryview) -> int:
        """HTTP/1.1: take request body bytes from data; returns how many were body.
        data may be a view of the connection's read buffer (see _forward)."""
        self.body_activity = monotonic()
        if self.req_mode == REQ_LENGTH:
            n = len(data)
            rem = self.req_remaining
            if n > rem:
                data = data[:rem]
                n = rem
            self.req_remaining = rem - n
            self.req_bytes += n
            self._forward((data,))
            if self.req_remaining == 0:
                self._request_complete()
            return n
        decoder = self.decoder
        try:
            pieces = decoder.feed(data)
        except ParseError as exc:
            self._request_body_error(exc.status, exc.message)
            return len(data)
        for piece in pieces:
            self.req_bytes += len(piece)
        max_body = self.rt.max_body
        # A chunk's size line says what is coming: refused there, as nginx does, not
        # after max_body_bytes of it have been read and forwarded.
        if max_body and (self.req_bytes > max_body
                         or decoder.remaining > max_body - self.req_bytes):
            self._request_body_error(413, "request body larger than max_body_bytes")
            return len(data)
        if self.body_cap and (self.req_bytes > self.body_cap
                              or decoder.remaining > self.body_cap - self.req_bytes):
            self._request_body_error(413, self.body_cap_why)
            return len(data)
        if pieces:
            self._forward(pieces)
        if decoder.done:
            self._request_complete()
            return decoder.tail
        return len(data)

    def body_data(self, data: bytes) -> None:
        """HTTP/2: one DATA frame's payload."""
        self.body_activity = monotonic()
        self.req_bytes += len(data)
        max_body = self.rt.max_body
        if max_body and self.req_bytes > max_body:
            self._request_body_error(413, "request body larger than max_body_bytes")
            return
        if self.body_cap and self.req_bytes > self.body_cap:
            self._request_body_error(413, self.body_cap_why)
            return
        if data:
            self._forward((data,))

    def body_end(self) -> None:
        """HTTP/2: END_STREAM from the client."""
        if self.reading_body:
            self._request_complete()

    def _forward(self, parts: tuple[bytes, ...] | list[bytes]) -> None:
        # parts may be views of the downstream's read buffer, valid during this call
        # only: what is kept is copied (bytes() of bytes is the same object).
        if self.replay is not None:
            self.replay_size += sum(map(len, parts))
            if self.replay_size > REPLAY_LIMIT:
                self.replay = None
            else:
                if type(self.replay) is tuple:
                    self.replay = []
                self.replay.extend(map(bytes, parts))
        up = self.upstream
        if up is not None:
            up.send_body(parts)
        elif not self.finished:
            if self.pending is None:
                self.pending = []
            if len(parts) == 1:  # the usual case: no map objects
                self.pending.append(bytes(parts[0]))
                self.pending_size += len(parts[0])
            else:
                self.pending.extend(map(bytes, parts))
                self.pending_size += sum(map(len, parts))
            if self.inspecting:
                # Read on up to the inspection limit (a guard's may pass PENDING_LIMIT):
                # pausing short of it would wait for bytes that can no longer come.
                if not self._inspect_enough():
                    return
                self._inspected()
            if self.pending_size > PENDING_LIMIT and not self.finished and (
                    self.upstream is None and self.pending is not None):
                self.down.pause(P_PENDING)

    def _request_complete(self) -> None:
        self.reading_body = False
        self.req_done = True
        self.req_done_at = monotonic()
        pool = self.hold
        if pool is not None and not self.finished:
            self.hold = None
            self._rewrite_model()
            self.pending_end = True
            self._use(pool)
            return
        up = self.upstream
        if up is not None:
            up.end_body()
        elif not self.finished:
            self.pending_end = True
            if self.inspecting:
                self._inspected()

    def _request_body_error(self, status: int, message: str) -> None:
        self.reading_body = False
        if self.tunnel:  # a 101 came before the whole body, and the rest went wrong
            self._tunnel_end("request_body")
        if self.head_sent:
            self._abort()
        else:
            self.local_reply(status, message)

    def upload_left(self, now: float, body_timeout: float) -> float | None:
        """While reading the client is paused: seconds until the upstream counts as
        having stopped taking the body (read_timeout_ms after it last did), or None when
        it has, and the exchange ended with a 504."""
        cluster = self.cluster
        if cluster is None:  # no upstream chosen yet: nothing of it to time
            return body_timeout
        left = self.body_activity + cluster.cfg.read_timeout_ms / 1000 - now
        if left <= 0:
            self._request_body_error(504, "upstream stopped reading the request body")
            return None
        return left

    def client_body_timeout(self) -> None:
        self._request_body_error(408, "timed out reading the request body")

    # -- upstream selection -------------------------------------------------------

    def _use(self, pool: Pool) -> None:
        if self.tracer is not None:
            self.tracer.attempt(self, pool)
        old = self.pool
        if old is not None:
            old.stats.in_flight -= 1
        self.pool = pool
        pool.stats.in_flight += 1
        up = pool.take()
        if up is not None:
            self._attach(up, True)
        else:
            self._connect_within_limits(pool)

    def _connect_within_limits(self, pool: Pool) -> None:
        """A new connection within the cluster's max_pending/max_connections, else 503
        upstream_overflow."""
        cluster = self.cluster
        if cluster.limits_connections:
            why = cluster.connect_overflow(pool)
            if why is not None:
                return self.fail(503, "upstream_overflow", why)
        self._new_connection(pool)

    def _new_connection(self, pool: Pool) -> None:
        self.t_connect = monotonic()
        if not self.pending_conn:
            self.pending_conn = True
            self.cluster.pending += 1
        self.connect_task = self.loop.create_task(self._connect(pool))

    def _replay_connection(self, pool: Pool) -> None:
        """Where a replay goes: a new HTTP/1.1 connection (another idle one may be just
        as stale), or for HTTP/2 a stream on a live connection with room; a new
        connection within the cluster's max_pending/max_connections as for a first
        attempt, else 503 upstream_overflow."""
        if self.tracer is not None:
            self.tracer.attempt(self, pool)
        if self.cluster.cfg.protocol == "h2":
            up = pool.take()
            if up is not None:
                return self._attach(up, True)
        self._connect_within_limits(pool)

    def _unpend(self) -> None:
        if self.pending_conn:
            self.pending_conn = False
            self.cluster.pending -= 1

    async def _connect(self, pool: Pool) -> None:
        try:
            up = await pool.connect(self.cluster)
        except UpstreamConnectError as exc:
            self.connect_task = None
            self._unpend()
            if not self.finished:
                self._connect_failed(pool, exc)
            return
        self.connect_task = None
        self._unpend()
        self.t_connected = monotonic()
        if self.finished:
            pool.release(up)
            return
        self._attach(up, False)

    def _connect_failed(self, pool: Pool, exc: UpstreamConnectError) -> None:
        if self.tracer is not None:
            self.tracer.attempt_end(exc.code, str(exc))
        if exc.code == "upstream_overflow":  # a breaker said no: not the endpoint's doing
            return self.fail(exc.status, exc.code, exc.public, str(exc))
        self.tried += (pool,)
        cluster = self.cluster
        cluster.record(pool, True)
        policy = self.route.retries
        if policy is not None:
            if "connect-failure" in policy.on and self._may_retry(policy):
                log.info("retrying after connect failure: %s", exc)
                self._retry(policy)
                return
        elif self.replay is not None:
            # No retry policy: still try each other endpoint once, right away.
            nxt = cluster.pick(self, self.tried)
            if nxt is not None:
                log.info("retrying on %s: %s", nxt.endpoint.address, exc)
                self._replay_pending()
                self._use(nxt)
                return
        self.fail(exc.status, exc.code, exc.public, str(exc))

    def _may_retry(self, policy: RetryPolicy) -> bool:
        """Another attempt is allowed: attempts left, the body can be replayed (an
        idempotent request, or one whose whole body is still held), and the cluster's
        retry budget (retries in flight vs requests in flight, at least 3) has room."""
        if self.attempts >= policy.attempts or self.replay is None or self.finished:
            return False
        if self.method not in IDEMPOTENT and not self.req_done:
            return False
        cluster = self.cluster
        budget = cluster.active * policy.budget_pct / 100
        return self.is_retry or cluster.retries_active < max(3.0, budget)

    def _retry(self, policy: RetryPolicy) -> None:
        """Replay on another endpoint (the same one if every one was tried) after a
        jittered exponential backoff."""
        self.attempts += 1
        if not self.is_retry:
            self.is_retry = True
            self.cluster.retries_active += 1
        self._replay_pending()
        delay = policy.backoff_ms * (1 << (self.attempts - 1)) * (0.5 + random()) / 1000
        self.retry_handle = self.loop.call_later(min(delay, policy.backoff_ms / 100),
                                                 self._retry_now)

    def _retry_now(self) -> None:
        self.retry_handle = None
        if self.finished:
            return
        cluster = self.cluster
        pool = cluster.pick(self, self.tried) or cluster.pick(self)
        if pool is None:
            return self.fail(503, "no_healthy_upstream",
                             f"cluster {cluster.name!r} has no endpoints")
        self._use(pool)

    def _replay_pending(self) -> None:
        self.pending = list(self.replay)
        self.pending_size = self.replay_size
        self.pending_end = self.req_done
        # A pause the failed upstream's full write buffer put on the client goes with
        # it: the next connection may never fill its buffer, so never resume it. Until
        # that connection is there, body bytes wait in `pending` (bounded: P_PENDING).
        self.down.resume(P_UPSTREAM)

    def _attach(self, up: Any, reused: bool) -> None:
        self.upstream = up
        self.reused = reused
        self.t_sent = monotonic()
        up.start(self)
        if self.pending:
            up.send_body(self.pending)
            self.pending = None
            self.pending_size = 0
            self.down.resume(P_PENDING)
        if self.pending_end or (self.req_done and self.req_mode == REQ_NONE):
            self.pending_end = False
            up.end_body()
        if self.down.output_paused():
            up.pause()

    # -- deadlines (checked by the downstream's timer) ------------------------------------

    def check_deadline(self, now: float, body_timeout: float) -> float | None:
        """Seconds until this exchange's current deadline, or None if it just ended it."""
        if self.finished:
            return INFINITY
        if self.tunnel:
            limit = self.rt.http.tunnel_idle_timeout_ms
            if not limit or self.splice is not None:  # spliced: the kernel moves the bytes
                return INFINITY
            left = self.activity + limit / 1000 - now
            if left <= 0:
                log.info("closing a tunnel idle for %d ms on route %s", limit, self.route.name)
                self._tunnel_end("idle_timeout")
                self._close_tunnel()
                return None
            return left
        if now >= self.deadline_at:
            if self.tracer is not None:
                self.tracer.attempt_end("deadline_exceeded", "grpc-timeout expired")
            if self.head_sent and self.grpc and self.head.version == 20 and body_untouched(self.filters):
                # A gRPC call's deadline is a status, also after its response headers
                # (grpc-status 4 trailers): a reset would read as INTERNAL to a client
                # without a deadline timer of its own.
                self._drop_upstream()
                self._end_grpc(504, "deadline_exceeded", "grpc-timeout expired")
            elif self.head_sent:
                self._abort()
            else:
                self.fail(504, "deadline_exceeded", "grpc-timeout expired")
            return None
        if self.reading_body:
            if self.down.pause_mask:
                # The time left, not a whole timer period: the connection's timer re-arms
                # for min(this, min_timeout), and answering body_timeout here made it
                # look again a full period later, so the 504 came up to min_timeout late
                # (read_timeout_ms 1500 as the shortest timeout: at about 3 s).
                left = self.upload_left(now, body_timeout)
                if left is None:
                    return None
                return min(left, self.deadline_at - now)
            left = self.body_activity + body_timeout - now
            if left <= 0:
                self.client_body_timeout()
                return None
            return min(left, self.deadline_at - now)
        cfg = self.cluster.cfg
        if not self.head_sent:
            left = self.req_done_at + self.req_timeout - now
            if left <= 0:
                if self.upstream is not None or self.connect_task is not None:
                    # The endpoint holds the request (or its connect) unanswered: a
                    # failure for outlier detection, as nginx's max_fails counts a
                    # timeout and Envoy a locally made 504.
                    self.cluster.record(self.pool, True)
                self.fail(504, "upstream_timeout", "upstream sent no response head within "
                          f"{round(self.req_timeout * 1000)} ms")
                return None
            return min(left, self.deadline_at - now)
        if self.down.output_paused():
            # The client is not taking the response (its upstream is paused for it): the
            # wait is the client's, bounded by send_timeout, not the upstream's read
            # timeout. activity is when the pause began (or the last resume).
            limit = self.rt.http.send_timeout_ms
            left = self.activity + limit / 1000 - now
            if left <= 0:
                log.info("client took no response data for %d ms on route %s", limit,
                         self.route.name)
                self._abort()
                return None
            return min(left, self.deadline_at - now)
        left = self.activity + cfg.read_timeout_ms / 1000 - now
        if left <= 0:
            log.warning("upstream read timeout on route %s", self.route.name)
            self.upstream_error = (f"upstream sent nothing for {cfg.read_timeout_ms} ms "
                                   "(read_timeout_ms)")
            if self.tracer is not None:
                self.tracer.attempt_end("upstream_timeout", self.upstream_error)
            if self.grpc and self.head.version == 20 and body_untouched(self.filters):
                # As for the deadline: a status in trailers, not a reset read as INTERNAL.
                self._drop_upstream()
                self._end_grpc(504, "upstream_timeout", self.upstream_error)
            else:
                self._abort()
            return None
        return min(left, self.deadline_at - now)

    # -- upstream callbacks ---------------------------------------------------------

    def on_upstream_informational(self, resp: Any) -> None:
        """A 1xx (not 101) before the final response: passed on (RFC 9110 15.2; the
        downstream leaves out HTTP/1.0 clients). A 100 goes to a client that has not had
        one: the proxy answers an Expect: 100-continue itself (Expect is not forwarded),
        and a second 100 would tell the client nothing."""
        now = event_now()
        used = self.info_used - (now - self.info_at) / INFORMATIONAL_REFILL_S
        used = (used if used > 0.0 else 0.0) + 1.0
        if used > MAX_INFORMATIONAL:
            log.warning("upstream sent informational responses past the budget (%d at "
                        "once, one a second after) on route %s", MAX_INFORMATIONAL,
                        self.route.name)
            self.cluster.record(self.pool, True)  # as a garbled head would be
            self._drop_upstream()
            self.fail(502, "upstream_bad_response",
                      "upstream sent too many informational (1xx) responses")
            return
        self.info_used = used
        self.info_at = now
        if resp.status == 100:
            if self.continued:
                return
            self.continued = True  # no 100 of the proxy's own after this one
        self.down.send_informational(resp)

    def on_upstream_head(self, resp: Any, mode: int) -> None:
        if type(resp) is ResponseHead:  # from an HTTP/1.1 upstream: read in C
            r = resp
            status = r.status
            version = r.version
        else:
            status = resp.status
            version = 20  # an HTTP/2 upstream's
        t_first = event_now()
        cluster = self.cluster
        pool = self.pool
        stats = pool.stats
        if status < 500:
            stats.requests += 1
            stats.consecutive_failures = 0
        else:
            cluster.record(pool, True)
        if self.t_sent:
            stats.observe_ttfb((t_first - self.t_sent) * 1000, cluster.score_alpha)
        if self.tracer is not None:
            self.tracer.attempt_head(status)
        if cluster.track_tokens:
            if self.llm is None:  # else the LLM accounting filter counts the tokens
                self.tok_tail = b""
            for name in LOAD_HEADERS:
                value = resp.get(name)
                if value is not None:
                    try:
                        stats.reported_load = min(100.0, max(0.0, float(value)))
                        stats.reported_at = self.loop.time()
                    except ValueError:
                        pass
                    break
        route = self.route
        # A request with a non-idempotent method (POST, PATCH) got this far: the upstream
        # may have acted on it before answering 5xx (a 504 from a gateway in front of
        # the origin, say), so it goes again only with non_idempotent (RFC 9110 9.2.2).
        if (((route.retry_statuses and status in route.retry_statuses)
             or (route.retry_unavailable and self.grpc and resp.get(b"grpc-status") == b"14"))
                and (self.method in IDEMPOTENT or route.retries.non_idempotent)
                and self._may_retry(route.retries)):
            up = self.upstream
            self.upstream = None
            self.tried += (pool,)
            if up is not None:
                up.abort()  # the error body is not needed; the connection is not reusable
            if self.tracer is not None:
                self.tracer.attempt_end()
            log.info("retrying after upstream status %d", status)
            self._retry(route.retries)
            return
        self.status = status
        self.resp_version = version  # for the Via the client gets
        self.head_sent = True
        self.activity = self.t_first = t_first  # one clock read: microseconds apart
        if self.grpc:  # a trailers-only response carries it in its head
            self.grpc_status = grpc_status_value(resp.get(b"grpc-status"))
        if mode == BODY_TUNNEL:
            return self._start_tunnel(resp)
        if self.filters:
            resp = self._filter_head(resp)
            if resp is None:
                return
        self.keep_alive = self.down.send_response(self, resp, mode)

    def on_upstream_body(self, data: bytes) -> None:
        if self.filters:
            # Filters may keep what they see; a read slab's view lives only for this call.
            data = self._filter_body(bytes(data))
            if not data:
                return
        self.resp_bytes += len(data)
        if self.tok_tail is not None:
            self.tok_tail = (self.tok_tail + data)[-TOKEN_TAIL:]
        self.activity = event_now()
        self.down.send_body(data)

    def flush(self) -> None:
        self.down.flush()

    def on_upstream_end(self, trailers: list[tuple[bytes, bytes]] | None = None) -> None:
        up = self.upstream
        self.upstream = None
        if up is not None:
            if self.req_done:
                self.pool.release(up)
            else:
                up.close()
        if self.grpc and trailers:
            for name, value in trailers:
                if name == b"grpc-status":
                    self.grpc_status = grpc_status_value(value)
        if self.filters:
            self._end_filtered(trailers)
            return
        self.down.send_end(trailers)
        self._finish(self.keep_alive and self.req_done)

    def _end_filtered(self, trailers: list[tuple[bytes, bytes]] | None) -> None:
        tail = self._filter_end()
        if tail is None:
            return
        self.resp_bytes += len(tail)
        gate = self._finishing()
        if gate is not None:
            gate.add_done_callback(lambda g: self._release_end(g, tail, trailers))
            return
        if tail:
            self.down.send_body(tail)
        self.down.send_end(trailers)
        self._finish(self.keep_alive and self.req_done)

    def _finishing(self) -> asyncio.Future | None:
        """What the filters' finishing hooks want the end of the response to wait for."""
        waits = []
        for f in self.done_filters or self.filters:
            try:
                w = f.finishing(self)
            except Exception:
                log.exception("filter %s failed finishing the response", type(f).__name__)
                w = self.loop.create_future()
                w.set_exception(RuntimeError("finishing failed"))
            if w is not None:
                waits.append(w)
        if not waits:
            return None
        return asyncio.ensure_future(waits[0]) if len(waits) == 1 else asyncio.gather(*waits)

    def _release_end(self, gate: asyncio.Future, tail: bytes,
                     trailers: list[tuple[bytes, bytes]] | None) -> None:
        if self.finished:
            return
        if gate.cancelled() or gate.exception() is not None:
            log.error("response not completed: a filter could not finish it (%s)",
                      "cancelled" if gate.cancelled() else gate.exception())
            return self._abort()
        if tail:
            self.down.send_body(tail)
        self.down.send_end(trailers)
        self._finish(self.keep_alive and self.req_done)

    def on_upstream_failed(self, status: int, code: str, message: str) -> None:
        up = self.upstream
        self.upstream = None
        if self.finished:
            return
        if self.tracer is not None:
            self.tracer.attempt_end(code, message)
        if self.head_sent:
            if not self.down.take_back_response():
                log.warning("upstream failed mid-response on route %s: %s",
                            self.route.name, message)
                self.upstream_error = message
                if self.grpc and self.head.version == 20 and body_untouched(self.filters):
                    # A gRPC call ends with a status, as the upstream's reset or loss
                    # maps to one (PROTOCOL-HTTP2.md): an RST_STREAM(INTERNAL_ERROR) of
                    # ours would read as INTERNAL whatever happened.
                    self._end_grpc(status, code, message)
                    return
                self._abort()
                return
            # Nothing of the response has reached the client (e.g. a malformed chunked
            # body in the same read as the head): it gets a 502, or a retry, instead.
            self.head_sent = False
        # Never processed (a refused or GOAWAY'd stream, RFC 9113 8.7; an HTTP/1.1
        # request none of which was sent): always safe.
        never_processed = code in NEVER_PROCESSED
        if self.replay is not None and not self.replayed and (never_processed or (
                self.reused and up is not None and not up.received
                and (self.method in IDEMPOTENT or status == 503))):
            # A pooled connection the upstream had already closed (or an HTTP/2 stream
            # it refused before processing): replay once on a fresh connection.
            self.reused = False
            self.replayed = True
            self._replay_pending()
            self._replay_connection(self.pool)
            return
        pool = self.pool
        if pool is not None:
            self.cluster.record(pool, True)
            policy = self.route.retries
            if (policy is not None and "reset" in policy.on
                    and (self.method in IDEMPOTENT or policy.non_idempotent)
                    and self._may_retry(policy)):
                self.tried += (pool,)
                log.info("retrying after %s", message)
                self._retry(policy)
                return
        self.fail(status, code, message)

    def _end_grpc(self, status: int, code: str, message: str) -> None:
        """End a gRPC call whose response headers went out: its status in trailers."""
        self.status = status
        self.grpc_status = grpc_status_for(status, code)
        self.down.send_end([(b"grpc-status", b"%d" % self.grpc_status),
                            (b"grpc-message", quote(message).encode())])
        self._finish(False)

    def on_upstream_pause_writing(self) -> None:
        self.down.pause(P_UPSTREAM)

    def on_upstream_resume_writing(self) -> None:
        self.body_activity = monotonic()
        splice = self.splice
        if splice is not None and splice.holds(0):
            # The splice keeps the client from reading and resumes it itself.
            self.down.pause_mask &= ~P_UPSTREAM
            return
        self.down.resume(P_UPSTREAM)

    # -- downstream callbacks -------------------------------------------------------

    def on_client_pause_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.pause()

    def on_client_resume_writing(self) -> None:
        self.activity = monotonic()
        up = self.upstream
        if up is not None:
            splice = self.splice
            if splice is not None and splice.holds(1):
                up.reading_paused = False  # the splice resumes the H1 upstream itself
                return
            up.resume()

    def on_client_lost(self) -> None:
        if self.finished:
            return
        self.client_lost = True
        self.drained = self.down.server.drain_expired  # the proxy cut it, not the client
        if self.tunnel:
            self._tunnel_end("drained" if self.drained else "client_lost")
        self.finished = True
        self._unsplice()
        self._drop_upstream()
        self._report()

    # -- tunnel (Upgrade) -------------------------------------------------------------

    def _start_tunnel(self, resp: Any) -> None:
        # resp.upgrade: the Upgrade field of a 101 whose Connection names "upgrade", as
        # its sender MUST (RFC 9110 7.8; RFC 6455 4.1 has the client fail without it).
        upgrade = resp.upgrade
        offered = forwarded_upgrade(self.head.upgrade)
        if (offered is None or upgrade is None
                or not upgrade_protocols(upgrade) <= upgrade_protocols(offered)):
            # RFC 9110 7.8: a 101 switches to a protocol the client asked for, or the
            # client's next bytes would reach the upstream raw, past routing and policy.
            # Nothing has gone to the client yet: answer 502, and drop the connection
            # the upstream has switched to another protocol.
            self.head_sent = False
            up = self.upstream
            self.upstream = None
            if up is not None:
                up.close()
            self.fail(502, "upstream_bad_response", "unexpected 101 response")
            return
        self.tunnel = True
        self.down.start_tunnel(resp, upgrade)
        kernel = getattr(self.down.server, "kernel", None)
        up = self.upstream
        if kernel is not None and up is not None and up.transport is not None:
            # [kernel] splice_tunnels: bytes flow socket to socket in the kernel from here
            # (after what was read in user space has been written); None: copied below.
            self.splice = kernel.splice_tunnel(self.loop, self.down.transport, up.transport)

    # A tunnel's bytes count in req_bytes / resp_bytes (the access log's bytes_in and
    # bytes_out), as Envoy counts an upgraded stream's: copied here, or added from the
    # splice's counts when it is released.

    def tunnel_from_client(self, data: bytes) -> None:
        self.activity = monotonic()
        self.req_bytes += len(data)
        up = self.upstream
        if up is not None:
            up.tunnel_write(data)

    def on_upstream_tunnel_data(self, data: bytes) -> None:
        self.activity = monotonic()
        self.resp_bytes += len(data)
        self.down.tunnel_write(data)

    # A spliced tunnel acts on an EOF only once the kernel has written out what it
    # redirected before it (a half-close or close earlier would cut the stream short).

    def on_upstream_tunnel_eof(self) -> None:
        if self.splice is not None:
            self.splice.after_flush(UP_TO_DOWN, self._upstream_tunnel_eof)
        else:
            self._upstream_tunnel_eof()

    def _upstream_tunnel_eof(self) -> None:
        self.tunnel_up_eof = True
        if not self.down.tunnel_eof():
            self._tunnel_end("eof")
            self._close_tunnel()  # both directions are done

    def tunnel_client_eof(self) -> None:
        if self.splice is not None:
            self.splice.after_flush(DOWN_TO_UP, self._client_tunnel_eof)
        else:
            self._client_tunnel_eof()

    def _client_tunnel_eof(self) -> None:
        up = self.upstream
        if self.tunnel_up_eof or up is None or not up.tunnel_eof():
            self._tunnel_end("eof")
            self._close_tunnel()  # both directions are done

    def _tunnel_end(self, why: str) -> None:
        """The access log's `ended`, as a tcp listener's tunnel line has it: eof (both
        sides done), client_lost, upstream_lost, idle_timeout, drained; and
        request_body (see _request_body_error). The first cause counts: closing the
        tunnel loses the other side afterwards."""
        if self.tunnel_ended is None:
            self.tunnel_ended = why

    def _close_tunnel(self) -> None:
        if self.splice is not None:
            self.splice.after_flush(BOTH, self._close_tunnel_now)
        else:
            self._close_tunnel_now()

    def _close_tunnel_now(self) -> None:
        # After EOF both ways nothing else closes the sockets (eof_received returned True
        # to keep each half open), so close both here; close() still flushes queued bytes.
        self._unsplice()
        up = self.upstream
        self.upstream = None
        self.finished = True
        self._report()
        if up is not None:
            up.close()
        self.down.close()

    def on_upstream_tunnel_closed(self) -> None:
        self._tunnel_end("upstream_lost")
        self._unsplice()
        self.upstream = None
        self.finished = True
        self._report()
        self.down.close()

    def _unsplice(self) -> None:
        """Take a spliced tunnel's sockets out of the kernel maps (either side is done)."""
        splice = self.splice
        if splice is not None:
            self.splice = None
            splice.release()
            to_up, to_down = splice.moved()
            self.req_bytes += to_up
            self.resp_bytes += to_down

    # -- endings --------------------------------------------------------------------

    def fail(self, status: int, code: str, message: str, detail: str | None = None) -> None:
        """The proxy's error reply: `message` for the client; `detail` (default: the
        message) for the log and the trace, e.g. with the endpoint's address."""
        detail = message if detail is None else detail
        log.info("%d %s: %s", status, code, detail)
        if self.tracer is not None:  # the attempt in flight (if any) ends with the exchange
            self.tracer.attempt_end(code, detail)
        self.local_reply(status, message, code)

    def local_reply(self, status: int, message: str, code: str | None = None,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """Answer with the proxy's own error; the connection stays open only if safe.
        `headers`: extra response fields (lower-case names), e.g. retry-after."""
        self.reading_body = False
        self.status = status
        self.head_sent = True
        # What the client gets of it, for the access log and the audit record (written
        # before the reply when a filter gates it): the JSON body; none for HEAD, and
        # none for gRPC, answered with trailers only.
        self.resp_bytes = (0 if self.method == b"HEAD" or self.grpc
                           else len(error_body(status, code, message)))
        if not self.filters and self.done_filters is None and self.rt.unrouted_filters:
            self._start_unrouted()
        if self.filters:
            headers = self._reply_fields(headers)
        if self.filters or self.done_filters:
            gate = self._finishing()
            if gate is not None:
                self._drop_upstream()
                gate.add_done_callback(
                    lambda g: self._release_reply(g, status, message, code, headers))
                return
        keep = self.down.send_error(self, status, message, code, headers)
        self._drop_upstream()
        self._finish(keep)

    def _reply_fields(self, headers: list[tuple[bytes, bytes]] | None
                      ) -> list[tuple[bytes, bytes]] | None:
        """headers plus what the filters that let the request through add to an error
        reply (the rate limiter's budget fields)."""
        for f in self.filters:
            try:
                extra = f.reply_fields(self)
            except Exception:
                log.exception("filter %s failed", type(f).__name__)
                continue
            if extra:
                headers = [*(headers or ()), *extra]
        return headers

    def _start_unrouted(self) -> None:
        """No route's chain started (no route matched, the request was refused before
        routing, or the route's chain failed to start): the unrouted chain (tracing,
        audit) still gives the exchange its trace id and audit record."""
        started = []
        for factory in self.rt.unrouted_filters:
            try:
                f = factory.start(self)
            except Exception:
                log.exception("filter %s failed to start", factory.name)
                continue
            if f is not None:
                started.append(f)
        self.filters = tuple(started)

    def _release_reply(self, gate: asyncio.Future, status: int, message: str,
                       code: str | None, headers: list[tuple[bytes, bytes]] | None) -> None:
        if self.finished:
            return
        if gate.cancelled() or gate.exception() is not None:
            log.error("reply not sent: a filter could not finish it")
            return self._abort()
        self._finish(self.down.send_error(self, status, message, code, headers))

    def _drop_upstream(self) -> None:
        gate = self.gate_task
        if gate is not None:
            self.gate_task = None
            gate.cancel()
        task = self.connect_task
        if task is not None:
            self.connect_task = None
            task.cancel()
            self._unpend()
        handle = self.retry_handle
        if handle is not None:
            self.retry_handle = None
            handle.cancel()
        up = self.upstream
        if up is not None:
            self.upstream = None
            up.abort()

    def _finish(self, keep_alive: bool) -> None:
        if self.finished:
            return
        self.finished = True
        self._report()
        self.down.exchange_done(self, keep_alive)

    def _abort(self) -> None:
        if self.finished:
            return
        self.finished = True
        self._report()
        self._drop_upstream()
        self.down.abort_response()

    def timings(self) -> dict[str, float]:
        """Seconds per stage, for metrics, the access log and Server-Timing."""
        out = {"accept_to_headers": self.t_parsed - self.t_start_pc,
               "total": monotonic() - self.t_start_pc}
        if self.t_routed:
            out["route_decision"] = self.t_routed - self.t_parsed - self.t_classify
        if self.t_classify:
            out["semantic_classify"] = self.t_classify
        if self.t_connected:
            out["upstream_connect"] = self.t_connected - self.t_connect
        if self.t_first and self.t_sent:
            out["upstream_ttfb"] = self.t_first - self.t_sent
        return out

    def _report(self) -> None:
        if not self.reported:
            self.reported = True
            if (self.route is None and not self.filters and self.done_filters is None
                    and self.rt.unrouted_filters):
                self._start_unrouted()  # ended (client gone) before a route was chosen
            if self.counted:
                self._release_cluster()
            for f in self.done_filters or self.filters:
                try:
                    f.done(self)
                except Exception:
                    log.exception("filter %s failed at the end of the exchange",
                                  type(f).__name__)
            self.down.server.telemetry.exchange_done(self)

    def _release_cluster(self) -> None:
        self.counted = False
        cluster = self.cluster
        cluster.active -= 1
        if self.is_retry:
            cluster.retries_active -= 1
        pool = self.pool
        if pool is not None:
            pool.stats.in_flight -= 1
            tail = self.tok_tail
            # With LLM accounting on (ex.llm), its filter feeds the TPM in done().
            if tail is not None and self.t_first and self.llm is None:
                m = USAGE_TOTAL.search(tail)
                tokens = int(m.group(1)) if m is not None else self.resp_bytes // 4
                pool.stats.add_tokens(tokens, self.loop.time())


# One Exchange per request, past pymalloc's size limit: its memory is kept for the next
# (only once nothing refers to it: _fast/freelist.pyx).
install_freelist(Exchange, 32)


def joined(pieces: tuple) -> bytes:
    """The field-line pieces of a Head.compose() tuple as one bytes (None skipped)."""
    return b"".join([p for p in pieces if p is not None])


def serialize_without(head: Any, start_line: bytes, extra: bytes, drop: int,
                      remove: frozenset[bytes]) -> bytes:
    """An HTTP/1.1 head like head.serialize() but without the fields named in remove."""
    out = [start_line]
    for name, value in head.fields(drop):
        if name not in remove:
            out += (name, b": ", value, CRLF)
    out += (extra, CRLF)
    return b"".join(out)
