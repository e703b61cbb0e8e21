"""Route table: the first matching route in config order wins.

The table is compiled once per config. Routes are indexed by host (an exact-host dict,
a dict of `*.suffix` wildcards, and the routes for any host) and, inside each host
bucket, by their literal path (a dict of exact paths and one dict per distinct
path_prefix length). A lookup probes those dicts and evaluates only the candidate
routes they return, so its cost grows with the number of distinct prefix lengths, not
with the number of routes. Candidate lists are sorted by config index and the lowest
matching index wins, which keeps first-match-in-config-order semantics.
"""

from __future__ import annotations

import zlib
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from itertools import accumulate
from random import random
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes

from aiproxy.config import RouteConfig
from aiproxy.config.safe_regex import fullmatcher

if TYPE_CHECKING:
    from aiproxy._fast.h1 import RequestHead
    from aiproxy.routing.cluster import Cluster


class _AnyName:
    """Equal to every intent (and domain) name: a match with ANY_INTENT finds the route
    some intent could pick, so one that names none shows no intent can matter."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = object.__hash__


ANY_INTENT = (_AnyName(), _AnyName())


def host_without_port(host: bytes) -> bytes:
    if host.startswith(b"["):
        end = host.find(b"]")
        return host[: end + 1].lower() if end > 0 else host.lower()
    colon = host.find(b":")
    name = (host[:colon] if colon >= 0 else host).lower()
    # "example.com." is the same name, fully qualified (RFC 1034 3.1): servers behind
    # the proxy answer it as "example.com", so routes must match it so too.
    return name[:-1] if name.endswith(b".") else name


def _query_values(query: bytes, name: bytes) -> Iterable[bytes | None]:
    """Values of `name` in a query string (None for a bare `name`), percent-decoded."""
    for part in query.split(b"&"):
        key, eq, value = part.partition(b"=")
        if b"%" in key or b"+" in key:
            key = unquote_to_bytes(key.replace(b"+", b" "))
        if key == name:
            if not eq:
                yield None
            elif b"%" in value or b"+" in value:
                yield unquote_to_bytes(value.replace(b"+", b" "))
            else:
                yield value


class Route:
    """One compiled route: what the index does not guarantee is checked in `rest`."""

    __slots__ = ("name", "index", "cfg", "cluster", "clusters", "cum_weights", "total_weight",
                 "sticky_header", "path", "path_prefix", "host", "methods", "headers",
                 "header_rules", "query", "path_regex", "grpc_service", "grpc_method",
                 "intent", "intent_domain",
                 "has_rest", "timeout", "retries", "req_add", "req_remove", "resp_add",
                 "resp_remove", "prefix_rewrite", "model", "has_policy", "retry_statuses",
                 "req_add_lines", "resp_add_lines", "resp_edit", "retry_unavailable",
                 "filters", "direct", "redirect")

    def __init__(self, cfg: RouteConfig, clusters: Cluster | Mapping[str, Cluster],
                 index: int = 0) -> None:
        self.name = cfg.name
        self.index = index
        self.cfg = cfg
        if cfg.split:
            assert isinstance(clusters, Mapping)
            self.clusters = tuple(clusters[t.cluster] for t in cfg.split)
            self.cum_weights = tuple(accumulate(t.weight for t in cfg.split))
            self.total_weight = self.cum_weights[-1]
            self.cluster = self.clusters[0]  # for code that only wants a name
        elif cfg.cluster is None:  # answered by the proxy: direct_response or redirect
            self.cluster = None
            self.clusters = ()
            self.cum_weights = ()
            self.total_weight = 0
        else:
            self.cluster = clusters[cfg.cluster] if isinstance(clusters, Mapping) else clusters
            self.clusters = (self.cluster,)
            self.cum_weights = ()
            self.total_weight = 0
        # Checked once per request in Exchange._dispatch: a C field each.
        self.direct = cfg.direct_response
        self.redirect = cfg.redirect
        self.sticky_header = cfg.sticky_header
        m = cfg.match
        self.path = m.path
        self.path_prefix = m.path_prefix
        self.host = m.host
        self.methods = frozenset(m.method) if m.method else None
        self.headers = m.headers
        rules = []
        for name, kind, value in m.header_rules:
            rules.append((name, kind, fullmatcher(value) if kind == "regex" else None))
        self.header_rules = tuple(rules)
        self.query = m.query
        # RE2 (linear time), never `re`: these run on the client's bytes on the event loop.
        self.path_regex = fullmatcher(m.path_regex) if m.path_regex else None
        self.grpc_service = m.grpc_service
        self.grpc_method = m.grpc_method
        self.intent = m.intent
        self.intent_domain = m.intent_domain
        self.has_rest = bool(self.methods or self.headers or self.header_rules or self.query
                             or self.path_regex or self.grpc_service or self.grpc_method
                             or self.intent or self.intent_domain)
        # Per-route policy (see aiproxy.pipeline.exchange).
        self.timeout = cfg.timeout_ms / 1000 if cfg.timeout_ms else None
        self.retries = cfg.retries
        self.req_add = cfg.request_headers_add
        self.req_remove = frozenset(cfg.request_headers_remove)
        self.resp_add = cfg.response_headers_add
        self.resp_remove = frozenset(cfg.response_headers_remove)
        self.prefix_rewrite = cfg.prefix_rewrite
        self.model = cfg.model
        if self.model is not None:
            self.req_add = ((b"x-model-id", self.model),
                            *((n, v) for n, v in self.req_add if n != b"x-model-id"))
            self.req_remove = self.req_remove | {b"x-model-id"}
        self.has_policy = bool(self.req_add or self.req_remove or self.prefix_rewrite)
        # The filter chain (aiproxy/pipeline/filters.py), set by the Runtime.
        self.filters: tuple = ()
        self.retry_statuses = frozenset(
            int(c) for c in (cfg.retries.on if cfg.retries else ()) if c.isdigit())
        self.retry_unavailable = bool(cfg.retries and "unavailable" in cfg.retries.on)
        self.req_add_lines = b"".join(n + b": " + v + b"\r\n" for n, v in self.req_add)
        self.resp_add_lines = b"".join(n + b": " + v + b"\r\n" for n, v in self.resp_add)
        self.resp_edit = bool(self.resp_add or self.resp_remove)

    # -- matching ---------------------------------------------------------------------

    def matches(self, method: bytes, path: bytes, host: bytes | None, head: RequestHead,
                query: bytes = b"", sem: tuple[str | None, str | None] = (None, None)) -> bool:
        """Every condition, without the index (for tests and the linear reference)."""
        if self.path_prefix is not None and not path.startswith(self.path_prefix):
            return False
        if self.path is not None and path != self.path:
            return False
        if self.host is not None:
            if host is None:
                return False
            h = host_without_port(host)
            if self.host[:2] == b"*.":
                if not (h.endswith(self.host[1:]) and len(h) > len(self.host) - 1):
                    return False
            elif h != self.host:
                return False
        return not self.has_rest or self.rest(method, path, head, query, sem)

    def rest(self, method: bytes, path: bytes, head: RequestHead, query: bytes,
             sem: tuple[str | None, str | None] = (None, None)) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        if self.intent is not None and sem[0] != self.intent:
            return False
        if self.intent_domain is not None and sem[1] != self.intent_domain:
            return False
        if self.path_regex is not None and self.path_regex(path) is None:
            return False
        for name, value in self.headers:
            if head.get(name) != value:
                return False
        for name, kind, fullmatch in self.header_rules:
            got = head.get(name)
            if kind == "present":
                if got is None:
                    return False
            elif kind == "absent":
                if got is not None:
                    return False
            elif got is None or fullmatch(got) is None:
                return False
        for name, want in self.query:
            for got in _query_values(query, name):
                if want is None or got == want:
                    break
            else:
                return False
        if self.grpc_service is not None or self.grpc_method is not None:
            # gRPC paths are /package.Service/Method.
            service, _, gmethod = path[1:].partition(b"/")
            if self.grpc_service is not None and service != self.grpc_service:
                return False
            if self.grpc_method is not None and gmethod != self.grpc_method:
                return False
        return True

    # -- cluster choice ---------------------------------------------------------------

    def pick_cluster(self, head: RequestHead) -> Cluster:
        """A weighted split's cluster: by the sticky header's hash, else at random."""
        if not self.cum_weights:
            return self.cluster
        point = -1
        if self.sticky_header is not None:
            key = head.get(self.sticky_header)
            if key is not None:
                point = zlib.crc32(key) % self.total_weight
        if point < 0:
            point = random() * self.total_weight
        return self.clusters[bisect_right(self.cum_weights, point)]

    def describe(self) -> dict[str, Any]:
        if self.cum_weights:
            return {"split": [{"cluster": c.name, "weight": t.weight}
                              for c, t in zip(self.clusters, self.cfg.split, strict=True)]}
        if self.direct is not None:
            return {"direct_response": self.direct.status}
        if self.redirect is not None:
            return {"redirect": self.redirect.status}
        return {"cluster": self.cluster.name}


# Up to this many distinct path prefixes in a bucket are compared one by one; more are
# looked up in a dict per prefix length. A compare needs no key: slicing the path for a
# dict key costs about as much as sixteen compares.
LINEAR_PREFIXES = 16


class _Bucket:
    """Routes of one host key, indexed by literal path."""

    __slots__ = ("exact", "prefixes", "prefix_list", "prefix_groups", "other")

    def __init__(self) -> None:
        self.exact: dict[bytes, list[Route]] = {}
        self.prefixes: dict[bytes, list[Route]] = {}
        # Set by finish(): ((prefix, routes), ...) when there are few prefixes, else
        # ((length, {prefix: routes}), ...); longest first either way.
        self.prefix_list: tuple = ()
        self.prefix_groups: tuple = ()
        self.other: list[Route] = []

    def add(self, route: Route) -> None:
        if route.path is not None:
            if route.path_prefix is None or route.path.startswith(route.path_prefix):
                self.exact.setdefault(route.path, []).append(route)
            # else the route can never match: leave it out
        elif route.path_prefix is not None:
            self.prefixes.setdefault(route.path_prefix, []).append(route)
        else:
            self.other.append(route)

    def finish(self, linear_prefixes: int) -> None:
        # Longest first: a deep, specific prefix is likely the first match.
        ordered = sorted(self.prefixes.items(), key=lambda kv: len(kv[0]), reverse=True)
        if len(ordered) <= linear_prefixes:
            self.prefix_list = tuple(ordered)
            self.prefix_groups = ()
            return
        groups: dict[int, dict[bytes, list[Route]]] = {}
        for prefix, routes in ordered:
            groups.setdefault(len(prefix), {})[prefix] = routes
        self.prefix_list = ()
        self.prefix_groups = tuple(groups.items())


class RouteTable:
    __slots__ = ("routes", "by_host", "by_suffix", "any_host", "has_suffix", "max_dots",
                 "uses_intent")

    def __init__(self, routes: Iterable[Route], linear_prefixes: int = LINEAR_PREFIXES) -> None:
        self.routes = tuple(routes)
        self.uses_intent = any(r.intent is not None or r.intent_domain is not None
                               for r in self.routes)
        self.by_host: dict[bytes, _Bucket] = {}
        self.by_suffix: dict[bytes, _Bucket] = {}
        self.any_host = _Bucket()
        for index, route in enumerate(self.routes):
            route.index = index
            if route.host is None:
                bucket = self.any_host
            elif route.host[:2] == b"*.":
                bucket = self.by_suffix.setdefault(route.host[1:], _Bucket())
            else:
                bucket = self.by_host.setdefault(route.host, _Bucket())
            bucket.add(route)
        for bucket in (self.any_host, *self.by_host.values(), *self.by_suffix.values()):
            bucket.finish(linear_prefixes)
        self.has_suffix = bool(self.by_suffix)

    def match(self, method: bytes, path: bytes, host: bytes | None,
              head: RequestHead, query: bytes = b"",
              sem: tuple[str | None, str | None] = (None, None)) -> Route | None:
        """`sem` is the request's (intent, intent domain) when the semantic layer ran."""
        best = None
        if host is not None and (self.by_host or self.has_suffix):
            h = host_without_port(host)
            bucket = self.by_host.get(h)
            if bucket is not None:
                best = _scan(bucket, best, method, path, head, query, sem)
            if self.has_suffix:
                suffixes = self.by_suffix
                dot = h.find(b".", 1)
                while dot > 0:
                    bucket = suffixes.get(h[dot:])
                    if bucket is not None:
                        best = _scan(bucket, best, method, path, head, query, sem)
                    dot = h.find(b".", dot + 1)
        return _scan(self.any_host, best, method, path, head, query, sem)


def _first(routes: list[Route], best: Route | None, method: bytes, path: bytes,
           head: RequestHead, query: bytes, sem: tuple) -> Route | None:
    """The first route of `routes` (sorted by index) that matches and beats `best`."""
    limit = best.index if best is not None else 1 << 62
    for route in routes:
        if route.index >= limit:
            return best
        if not route.has_rest or route.rest(method, path, head, query, sem):
            return route
    return best


def _scan(bucket: _Bucket, best: Route | None, method: bytes, path: bytes,
          head: RequestHead, query: bytes, sem: tuple) -> Route | None:
    routes = bucket.exact.get(path) if bucket.exact else None
    if routes is not None:
        best = _first(routes, best, method, path, head, query, sem)
    for prefix, routes in bucket.prefix_list:
        if path.startswith(prefix):
            best = _first(routes, best, method, path, head, query, sem)
    if bucket.prefix_groups:
        n = len(path)
        for length, by_prefix in bucket.prefix_groups:
            if length <= n:
                routes = by_prefix.get(path[:length])
                if routes is not None:
                    best = _first(routes, best, method, path, head, query, sem)
    if bucket.other:
        best = _first(bucket.other, best, method, path, head, query, sem)
    return best
