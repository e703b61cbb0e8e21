"""The cache filter: exact prompt cache, semantic nearest-neighbour cache, and the
embedding cache that lets a prompt seen before skip intent classification.

A 200 response to an OpenAI-style request whose whole JSON body was read is stored
under `pc:<hash>:<variant>` (key.py) as it passes: head fields and the body pieces as they came,
so a cached event stream is replayed with its original event boundaries (one HTTP/1.1
chunk or HTTP/2 DATA frame per stored piece). Never stored: other statuses, responses
with Set-Cookie, Cache-Control no-store, no-cache or private (RFC 9111 5.2.2: this is a
shared cache and does not revalidate) or a Vary
on a request field the key does not hold (`*`, say; key.py says what it holds), bodies
over max_entry_bytes, HTTP/1.x bodies delimited by the connection's close (a cut looks
like an end), requests with Cache-Control no-store. A request with
Cache-Control no-cache is not answered from the cache but refreshes it; one with
only-if-cached that the cache cannot answer gets 504 and never goes upstream. An entry
lives for the response's own lifetime (freshness.py) within ttl_ms, its age counting
the Age it came with. Entries
are per tenant unless `shared = true`, and, for a caller the proxy did not
authenticate, per upstream credentials (fields.REQUEST_CREDENTIALS: Authorization,
the API key fields, Cookie; and OpenAI-Organization/-Project) as well. Shared entries
hold no credentials: an answer to a request whose credentials went upstream is stored
only when the upstream marks it for others (RFC 9111 3.5). Responses carry `x-aiproxy-cache: hit|miss|bypass`.

With [semantic] on, the request's intent decision and embedding go under
`ec:<same hash>` when the response is stored; the Exchange asks for it before running
the model (Runtime.decision_cache). With `semantic_threshold`, a miss is answered by the
stored response whose request embedding has the highest cosine similarity to this one,
if at least the threshold (same route, scope, model and stream mode); counted apart.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator
from email.utils import formatdate
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from aiproxy import wirejson
from aiproxy._fast.h1 import ResponseHead as H1ResponseHead
from aiproxy.cache import freshness
from aiproxy.cache.key import context_hash, embedding_key, prompt_key, request_hash
from aiproxy.cache.redis_store import encode
from aiproxy.cache.store import MemoryCache
from aiproxy.llm.openai import DEFAULT_PATHS, DEFAULT_PREFIXES, ApiPaths
from aiproxy.pipeline.filters import (
    Filter,
    FilterFactory,
    LocalReply,
    ResponseHead,
    StoredResponse,
)
from aiproxy.protocols.fields import F_CONTENT_LENGTH, F_HOP, REQUEST_CREDENTIALS

if TYPE_CHECKING:
    from aiproxy.config import Config, RouteConfig
    from aiproxy.config.schema import CacheConfig
    from aiproxy.pipeline.exchange import Exchange

HIT = (b"x-aiproxy-cache", b"hit")
MISS = (b"x-aiproxy-cache", b"miss")
BYPASS = (b"x-aiproxy-cache", b"bypass")
INDEX_LIMIT = 1024  # embeddings kept per semantic index (oldest replaced)
# Embeddings kept over all indexes (one per route, scope and request context); past
# it the oldest index goes, so clients cannot grow the process with new contexts.
INDEXED_LIMIT = 16384
ENTRY_OVERHEAD = 256  # bytes charged per entry besides its body and fields


class Stored:
    """A cached response: status, fields (lower-case, no framing), body pieces, and the
    version (a Head.version) it was received with, which its Via names. A shared (Redis)
    entry does not carry that: it says 1.1."""

    __slots__ = ("status", "items", "chunks", "created", "version")

    def __init__(self, status: int, items: list[tuple[bytes, bytes]], chunks: list[bytes],
                 created: float, version: int = 11) -> None:
        self.status = status
        self.items = items
        self.chunks = chunks
        self.created = created
        self.version = version

    def response(self, now: float, streamed: bool) -> StoredResponse:
        items = self.items + [HIT, (b"age", b"%d" % max(0, int(now - self.created)))]
        if not streamed:
            items.append((b"content-length", b"%d" % sum(map(len, self.chunks))))
        return StoredResponse(ResponseHead(self.status, items), list(self.chunks),
                              version=self.version)


class SemanticIndex:
    """Unit-length request embeddings and the prompt keys they were stored under."""

    __slots__ = ("vectors", "keys", "next")

    def __init__(self, width: int) -> None:
        self.vectors = np.zeros((0, width), dtype=np.float32)
        self.keys: list[str] = []
        self.next = 0

    def add(self, vector: np.ndarray, key: str) -> None:
        if key in self.keys:
            return
        if len(self.keys) < INDEX_LIMIT:
            self.vectors = np.vstack([self.vectors, vector[None, :]])
            self.keys.append(key)
        else:
            self.vectors[self.next] = vector
            self.keys[self.next] = key
            self.next = (self.next + 1) % INDEX_LIMIT

    def nearest(self, vector: np.ndarray) -> tuple[str, float] | None:
        if not self.keys:
            return None
        sims = self.vectors @ vector
        i = int(np.argmax(sims))
        return self.keys[i], float(sims[i])


def unit(vector: Any) -> np.ndarray | None:
    if vector is None:
        return None
    v = np.asarray(vector, dtype=np.float32).ravel()
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else None


# RFC 9111 5.2: cache-directive = token [ "=" ( token / quoted-string ) ]. A quoted
# argument (`private="set-cookie, x-user"`) may hold commas; what is not a directive is
# skipped up to the next comma.
_DIRECTIVE = re.compile(rb'[\s,]*([^\s,=]+)\s*(?:=\s*("(?:[^"\\]|\\.)*"|[^\s,]*))?[^,]*')
_QUOTED_PAIR = re.compile(rb"\\(.)")


def _directives(head: Any) -> dict[bytes, bytes]:
    """The Cache-Control directives of a head (name -> argument, b"" for none), over
    every field line of it (RFC 9110 5.3: repeated lines are one comma-separated list).
    A request with none and `Pragma: no-cache` means no-cache (RFC 9111 5.4)."""
    out: dict[bytes, bytes] = {}
    for value in head.get_all(b"cache-control"):
        for m in _DIRECTIVE.finditer(value):
            name, arg = m.group(1).lower(), m.group(2) or b""
            if arg[:1] == b'"':  # a quoted-string: its commas are not separators
                arg = _QUOTED_PAIR.sub(rb"\1", arg[1:-1])
            out.setdefault(name, arg)
    if not out and b"no-cache" in (head.get(b"pragma") or b"").lower():
        out[b"no-cache"] = b""
    return out


def _not_stored(mark: tuple[bytes, bytes]) -> LocalReply:
    """The answer to `Cache-Control: only-if-cached` the cache cannot give: 504, the
    request never goes upstream (RFC 9111 5.2.1.7)."""
    return LocalReply(504, "not_cached", "only-if-cached: no stored response to answer with",
                      [mark])


def _max_age(cc: dict[bytes, bytes]) -> float | None:
    """A request's max-age in seconds: the oldest entry it takes (None: any)."""
    arg = cc.get(b"max-age")
    if arg is None:
        return None
    return float(arg) if arg.isdigit() else 0.0  # RFC 9111 4.2.1: invalid is stale


# Request fields whose value may change the answer to the same body: the API version
# and beta features chosen (another shape, another tool format), and Origin (a CORS
# answer names the origin it allows, with Vary: Origin).
VARIANT_FIELDS = (b"anthropic-version", b"anthropic-beta", b"openai-beta", b"origin")
# What a response's Vary may name and still be stored: what variant_of keys by.
KEYED = frozenset((b"accept-encoding", *VARIANT_FIELDS))


# Request fields that carry the caller's upstream credentials or choose the account
# they bill to.
CREDENTIALS = (*REQUEST_CREDENTIALS, b"openai-organization", b"openai-project")


KEYED_CREDENTIALS = KEYED | frozenset(CREDENTIALS)

# Response directives that keep a response out (RFC 9111 5.2.2): no-store; no-cache,
# reuse only after revalidation, which this cache does not do; private, as a shared
# cache (a scope is a tenant or a credential, not one user), qualified forms included.
REFUSED = frozenset((b"no-store", b"no-cache", b"private"))
NO_STORE = frozenset((b"no-store",))  # all that is refused with ignore_upstream_cache_control
# Response directives that let a shared cache reuse an answer to a request with
# Authorization for other requests (RFC 9111 3.5); held to every credential field.
AUTHORIZED = frozenset((b"public", b"s-maxage", b"must-revalidate"))


def scope_of(ex: Exchange, tenant: str) -> str:
    """Whose entries a request may read and write (unless `shared`): the tenant, and,
    when the proxy did not authenticate the caller itself, the credentials it sends
    upstream. Without that, a caller whose key the upstream would reject (or a second
    key of the same client address / tenant header) read the answers another key paid
    for: a hit never reaches the upstream that checks the key."""
    if ex.identity is not None:
        # Marked: a subject named like a client address is not that address's callers.
        return f"{tenant}\x1fauthenticated"
    head = ex.head
    # Named: `x-api-key: K` and `authorization: K` are not the same credentials.
    creds = [b"%s:%s" % (name, value) for name in CREDENTIALS for value in head.get_all(name)]
    if not creds:
        return tenant
    digest = hashlib.blake2b(b"\x00".join(creds), digest_size=16).hexdigest()
    return f"{tenant}\x1fcredentials:{digest}"


def variant_of(ex: Exchange, route_part: str) -> str:
    """What besides the body and the caller decides the answer: the route (route_part:
    its name and what it changes in the upstream request), the cluster it chose (a
    split's side), the target the upstream is sent, path and query (Azure's
    api-version) as sent: the request hash keys by the endpoint's kind, which two paths
    may share (a trailing slash, another API version's prefix), the codings the
    client accepts (an entry stored gzip-coded is for a client that takes gzip) and
    VARIANT_FIELDS."""
    head = ex.head
    codings = b",".join(head.get_all(b"accept-encoding")).lower().replace(b" ", b"")
    versions = b"\x1e".join(b",".join(head.get_all(name)) for name in VARIANT_FIELDS)
    return "\x1f".join((route_part, ex.cluster.name, ex.up_target.decode("latin-1"),
                        codings.decode("latin-1"), versions.decode("latin-1")))


def _sends_credentials(ex: Exchange) -> bool:
    """Whether any of the caller's own credential fields (REQUEST_CREDENTIALS) goes
    upstream: not one the proxy took ([auth] removes it: the proxy authorized the
    request) or the route removes."""
    head = ex.head
    up = ex.up_headers
    remove = ex.route.req_remove
    for name in REQUEST_CREDENTIALS:
        if (head.get(name) is not None and name not in remove
                and not (up and any(n == name for n, _ in up))):
            return True
    return False


def _ends_with_connection(resp: Any) -> bool:
    """Whether the body is delimited by the upstream closing (an HTTP/1.x response with
    neither Content-Length nor chunked: RFC 9112 6.3). A cut there looks like an end, so
    nothing shows such a body is whole. (HTTP/2 bodies end with END_STREAM.)"""
    return type(resp) is H1ResponseHead and not resp.chunked and resp.content_length < 0


def _varies_beyond_key(resp: Any, keyed: frozenset[bytes]) -> bool:
    """Whether the response's Vary (RFC 9110 12.5.5) names a request field the key does
    not hold, or is `*`: stored anyway, the entry would answer a request the upstream
    might have answered otherwise (RFC 9111 4.1)."""
    for value in resp.get_all(b"vary"):
        for name in value.split(b","):
            name = name.strip().lower()
            if name and name not in keyed:
                return True
    return False


class CacheState:
    """The caches and their counters; kept across reloads (the config may change)."""

    def __init__(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self.store = MemoryCache(cfg.max_bytes)
        self.shared: Any = None  # a RedisCache with backend = "redis"
        self.decisions = MemoryCache(max(1024, cfg.max_bytes // 16))
        self.indexes: dict[tuple, SemanticIndex] = {}
        self.indexed = 0  # embeddings over all indexes
        self.exact_hits = 0
        self.semantic_hits = 0
        self.misses = 0
        self.bypass = 0
        self.stored = 0
        self.ec_hits = 0
        self.ec_misses = 0
        self.paths = DEFAULT_PATHS  # make_state: [llm] api_prefixes

    def index(self, where: tuple, vector: np.ndarray, key: str) -> None:
        """Add a stored request's embedding to the semantic index `where`."""
        index = self.indexes.pop(where, None)  # re-inserted last: the most recent
        if index is None or index.vectors.shape[1] != vector.shape[0]:
            if index is not None:
                self.indexed -= len(index.keys)
            index = SemanticIndex(vector.shape[0])
        self.indexes[where] = index
        before = len(index.keys)
        index.add(vector, key)
        self.indexed += len(index.keys) - before
        while self.indexed > INDEXED_LIMIT and len(self.indexes) > 1:
            oldest = next(iter(self.indexes))
            self.indexed -= len(self.indexes.pop(oldest).keys)

    def configure(self, cfg: CacheConfig) -> None:
        old = self.cfg
        self.cfg = cfg
        self.store.max_bytes = cfg.max_bytes
        self.store.trim()
        same = (old.backend, old.redis_url, old.redis_timeout_ms) == (
            cfg.backend, cfg.redis_url, cfg.redis_timeout_ms)
        if cfg.backend == "redis" and (self.shared is None or not same):
            from aiproxy.cache.redis_store import RedisCache

            self.shared = RedisCache(cfg.redis_url, cfg.redis_timeout_ms / 1000)
        elif cfg.backend != "redis":
            self.shared = None

    # -- embedding cache (asked by the Exchange before classifying) --------------------

    def decision_for(self, ex: Exchange, body: bytes) -> Any:
        """The stored intent decision for this request's body, if any."""
        kind = self.paths.kind(ex.path)
        if kind is None or ex.method != b"POST":
            return None
        try:
            data = wirejson.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        decision = self.decisions.get(embedding_key(request_hash(kind, data)),
                                      ex.loop.time())
        if decision is None:
            self.ec_misses += 1
        else:
            self.ec_hits += 1
        return decision

    def collect(self) -> Iterator[Any]:
        lookups = CounterMetricFamily("aiproxy_cache_lookups",
                                      "Prompt cache lookups by result",
                                      labels=["cache", "result"])
        lookups.add_metric(["prompt", "hit"], self.exact_hits)
        lookups.add_metric(["prompt", "miss"], self.misses)
        lookups.add_metric(["prompt", "bypass"], self.bypass)
        lookups.add_metric(["semantic", "hit"], self.semantic_hits)
        lookups.add_metric(["embedding", "hit"], self.ec_hits)
        lookups.add_metric(["embedding", "miss"], self.ec_misses)
        yield lookups
        ratio = GaugeMetricFamily("aiproxy_cache_hit_ratio",
                                  "Hits / lookups since start (joint: exact or semantic)",
                                  labels=["cache"])
        answered = self.exact_hits + self.semantic_hits + self.misses
        ratio.add_metric(["prompt"], self.exact_hits / answered if answered else 0.0)
        ratio.add_metric(["semantic"], self.semantic_hits / answered if answered else 0.0)
        ratio.add_metric(["joint"], (self.exact_hits + self.semantic_hits) / answered
                         if answered else 0.0)
        ec = self.ec_hits + self.ec_misses
        ratio.add_metric(["embedding"], self.ec_hits / ec if ec else 0.0)
        yield ratio
        if self.shared is not None:
            yield CounterMetricFamily("aiproxy_cache_backend_errors",
                                      "Failed calls to the shared (Redis) cache",
                                      value=self.shared.errors)
        yield GaugeMetricFamily("aiproxy_cache_bytes", "Bytes held by the prompt cache",
                                value=self.store.size)
        yield GaugeMetricFamily("aiproxy_cache_entries", "Entries in the prompt cache",
                                value=len(self.store.entries))


class CacheFilter(Filter):
    __slots__ = ("state", "route_part", "hash", "key", "mark", "items", "chunks", "size",
                 "status", "index_key", "max_age", "lifetime", "age", "only_if_cached",
                 "version")

    def __init__(self, state: CacheState, route_part: str) -> None:
        self.state = state
        self.route_part = route_part
        self.hash: str | None = None
        self.key: str | None = None  # where the response will be stored; None: not
        self.mark = MISS
        self.items: list[tuple[bytes, bytes]] | None = None
        self.chunks: list[bytes] | None = None
        self.size = 0
        self.status = 0
        self.version = 11  # of the response being stored
        self.index_key: tuple | None = None
        self.max_age: float | None = None
        self.lifetime = 0.0  # seconds the response being stored is fresh for
        self.age = 0.0  # the Age it came with
        self.only_if_cached = False

    def request(self, ex: Exchange) -> StoredResponse | LocalReply | None:
        state = self.state
        llm = ex.llm
        cc = _directives(ex.head)
        self.only_if_cached = b"only-if-cached" in cc
        if llm.body is None or b"no-store" in cc:
            self.mark = BYPASS
            state.bypass += 1
            return _not_stored(BYPASS) if self.only_if_cached else None
        cfg = state.cfg
        h = self.hash = request_hash(llm.endpoint, llm.body)
        scope = None if cfg.shared else scope_of(ex, llm.tenant)
        variant = variant_of(ex, self.route_part)
        self.key = prompt_key(h, variant, scope)
        if ex.intent is not None or cfg.semantic_threshold is not None:
            # Nearest neighbours only among requests equal but for their question.
            self.index_key = (variant, scope, context_hash(llm.endpoint, llm.body))
        max_age = _max_age(cc)
        if b"no-cache" in cc or max_age == 0:
            state.misses += 1
            # Refresh the entry with the upstream's answer (no revalidation here).
            return _not_stored(MISS) if self.only_if_cached else None
        self.max_age = max_age
        if state.shared is not None:
            return self._lookup_shared(ex)
        now = ex.loop.time()
        stored = state.store.get(self.key, now)
        if stored is not None and self._fresh(stored, now):
            return self._hit(ex, stored, now, False)
        near = self._nearest(ex)
        if near is not None:
            stored = state.store.get(near, now)
            if stored is not None and self._fresh(stored, now):
                return self._hit(ex, stored, now, True)
        state.misses += 1
        return _not_stored(MISS) if self.only_if_cached else None

    def _fresh(self, stored: Stored, now: float) -> bool:
        """Young enough for the ttl (a reload may have shortened it since the entry was
        stored) and for the request's max-age (when it gave one)."""
        age = now - stored.created
        if age * 1000 >= self.state.cfg.ttl_ms:
            return False
        return self.max_age is None or age <= self.max_age

    def _nearest(self, ex: Exchange) -> str | None:
        """The prompt key of the most similar stored request, if similar enough."""
        threshold = self.state.cfg.semantic_threshold
        decision = ex.intent_decision
        if threshold is None or decision is None:
            return None
        vector = unit(decision.embedding)
        index = self.state.indexes.get(self.index_key)
        if vector is None or index is None:
            return None
        found = index.nearest(vector)
        return found[0] if found is not None and found[1] >= threshold else None

    def _hit(self, ex: Exchange, stored: Stored, now: float, semantic: bool
             ) -> StoredResponse:
        if semantic:
            self.state.semantic_hits += 1
        else:
            self.state.exact_hits += 1
        ex.llm.cached = True
        return stored.response(now, ex.llm.stream)

    async def _lookup_shared(self, ex: Exchange) -> StoredResponse | LocalReply | None:
        shared = self.state.shared
        for key, semantic in ((self.key, False), (self._nearest(ex), True)):
            if key is None:
                continue
            found = await shared.get(key)
            if found is not None:
                status, created, items, chunks = found
                wall = time.time()
                stored = Stored(status, items, chunks, created)
                if self._fresh(stored, wall):
                    return self._hit(ex, stored, wall, semantic)
        self.state.misses += 1
        return _not_stored(MISS) if self.only_if_cached else None

    def response_head(self, ex: Exchange, resp: Any) -> Any:
        if self.key is not None and resp.status == 200:
            cc = _directives(resp)
            shared = self.state.cfg.shared
            # Unless shared, a caller the proxy did not authenticate is keyed by the
            # credentials it sends (scope_of): a Vary on those is held by the key.
            keyed = KEYED if shared or ex.identity is not None else KEYED_CREDENTIALS
            # The response's own lifetime (s-maxage, max-age, Expires) within ttl_ms; one
            # that arrives with an Age past it is stale already (RFC 9111 4.2).
            received = time.time()
            ttl = self.state.cfg.ttl_ms / 1000
            if self.state.cfg.ignore_upstream_cache_control:
                given, refused = None, NO_STORE
            else:
                given, refused = freshness.lifetime(resp, cc, received), REFUSED
            self.lifetime = ttl if given is None else min(given, ttl)
            self.age = freshness.initial_age(resp)
            # Shared entries do not hold the credentials: an answer the upstream gave one
            # caller's Authorization (or API key, or cookie) is for the others, and for
            # callers with none or a key it would refuse, only if it says so (RFC 9111
            # 3.5).
            if (self.age < self.lifetime and not cc.keys() & refused
                    and not (shared and _sends_credentials(ex)
                             and not cc.keys() & AUTHORIZED)
                    and resp.get(b"set-cookie") is None
                    and not _varies_beyond_key(resp, keyed)
                    and not _ends_with_connection(resp)):
                # Date is kept (RFC 9111 3.1), or added (RFC 9110 6.6.1); Age is the hit's.
                self.items = [(n, v) for n, v in resp.fields(F_HOP | F_CONTENT_LENGTH)
                              if n not in (b"age", b"x-aiproxy-cache")]
                if resp.get(b"date") is None:
                    self.items.append((b"date", formatdate(received, usegmt=True).encode()))
                self.chunks = []
                self.size = sum(len(n) + len(v) for n, v in self.items) + ENTRY_OVERHEAD
                self.status = resp.status
                self.version = ex.resp_version
        return ResponseHead.derived(resp, extra=(self.mark,))

    def response_body(self, ex: Exchange, data: bytes) -> bytes:
        chunks = self.chunks
        if chunks is not None:
            self.size += len(data)
            if self.size > self.state.cfg.max_entry_bytes:
                self.chunks = None  # too big to keep
            else:
                chunks.append(data)
        return data

    def response_end(self, ex: Exchange) -> bytes:
        chunks = self.chunks
        if chunks is None or self.key is None:
            return b""
        self.chunks = None
        state = self.state
        now = ex.loop.time()
        # Created back-dated by the Age it came with: a hit's Age counts it, and so do
        # the lifetime and a request's max-age.
        left = self.lifetime - self.age
        if state.shared is not None:  # entries carry wall-clock time: Age across hosts
            created = time.time() - self.age
            left_ms = int(left * 1000)
            if left_ms < 1:
                return b""
            state.shared.put(self.key, encode(self.status, created, self.items, chunks),
                             left_ms)
        else:
            state.store.put(self.key, Stored(self.status, self.items, chunks, now - self.age,
                                             self.version), self.size, now + left)
        state.stored += 1
        decision = ex.intent_decision
        if decision is not None:  # co-warm the embedding cache under the same hash
            expires = now + state.cfg.ttl_ms / 1000
            state.decisions.put(embedding_key(self.hash), decision, 4 * 1024, expires)
            vector = unit(decision.embedding)
            if vector is not None and state.cfg.semantic_threshold is not None:
                state.index(self.index_key, vector, self.key)
        return b""


class CacheFactory(FilterFactory):
    name = "cache"

    def __init__(self, state: CacheState, route_part: str) -> None:
        self.state = state
        self.route_part = route_part

    def start(self, ex: Exchange) -> Filter | None:
        if ex.llm is None:
            return None
        return CacheFilter(self.state, self.route_part)


def make_state(config: Config, previous: CacheState | None) -> CacheState | None:
    cfg = config.cache
    if cfg is None:
        return None
    state = previous if previous is not None else CacheState(cfg)
    state.configure(cfg)
    # The embedding cache is asked before routing: [llm]'s prefixes, no prefix_rewrite.
    state.paths = ApiPaths(config.llm.api_prefixes if config.llm is not None
                           else DEFAULT_PREFIXES)
    return state


def build(config: Config, route: RouteConfig, state: CacheState) -> FilterFactory | None:
    routes = state.cfg.routes
    if routes and route.name not in routes:
        return None
    # A route's entries are its own, and a reload that changes what the route sends
    # upstream starts new ones.
    part = repr((route.name, route.model, route.prefix_rewrite, route.request_headers_add,
                 route.request_headers_remove))
    return CacheFactory(state, part)
