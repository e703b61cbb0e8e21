"""Route table: first matching route wins."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from aiproxy.config import RouteConfig

if TYPE_CHECKING:
    from aiproxy._fast.h1 import RequestHead
    from aiproxy.routing.cluster import Cluster


def host_without_port(host: bytes) -> bytes:
    if host.startswith(b"["):
        end = host.find(b"]")
        return host[: end + 1].lower() if end > 0 else host.lower()
    colon = host.find(b":")
    return (host[:colon] if colon >= 0 else host).lower()


class Route:
    __slots__ = ("name", "cluster", "path", "path_prefix", "methods", "host", "headers",
                 "grpc_service", "grpc_method", "intent", "intent_domain")

    def __init__(self, cfg: RouteConfig, cluster: Cluster) -> None:
        self.name = cfg.name
        self.cluster = cluster
        m = cfg.match
        self.path = m.path
        self.path_prefix = m.path_prefix
        self.methods = frozenset(m.method) if m.method else None
        self.host = m.host
        self.headers = m.headers
        self.grpc_service = m.grpc_service
        self.grpc_method = m.grpc_method
        self.intent = m.intent
        self.intent_domain = m.intent_domain

    def matches(self, method: bytes, path: bytes, host: bytes | None, head: RequestHead,
                intent: str | None = None, domain: str | None = None) -> bool:
        if self.path_prefix is not None and not path.startswith(self.path_prefix):
            return False
        if self.path is not None and path != self.path:
            return False
        if self.methods is not None and method not in self.methods:
            return False
        if self.host is not None and (host is None or host_without_port(host) != self.host):
            return False
        for name, value in self.headers:
            if head.get(name) != value:
                return False
        if self.intent is not None and intent != self.intent:
            return False
        if self.intent_domain is not None and domain != self.intent_domain:
            return False
        if self.grpc_service is not None or self.grpc_method is not None:
            # gRPC paths are /package.Service/Method.
            service, _, method = path[1:].partition(b"/")
            if self.grpc_service is not None and service != self.grpc_service:
                return False
            if self.grpc_method is not None and method != self.grpc_method:
                return False
        return True


class RouteTable:
    __slots__ = ("routes", "uses_intent")

    def __init__(self, routes: Iterable[Route]) -> None:
        self.routes = tuple(routes)
        self.uses_intent = any(r.intent is not None or r.intent_domain is not None
                               for r in self.routes)

    def match(self, method: bytes, path: bytes, host: bytes | None, head: RequestHead,
              intent: str | None = None, domain: str | None = None) -> Route | None:
        for route in self.routes:
            if route.matches(method, path, host, head, intent, domain):
                return route
        return None
