"""Typed, immutable configuration produced by the loader.

Durations are integer milliseconds and sizes integer bytes. Integer fields that the
loader validates carry their allowed range in ``metadata["range"]`` as ``(min, max)``
(``max`` is None when unbounded). Values the request path compares are stored as bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .address import format_address


def _bounded(default: int, lo: int, hi: int | None = None) -> Any:
    return field(default=default, metadata={"range": (lo, hi)})


@dataclass(frozen=True, slots=True)
class ServerConfig:
    workers: int = _bounded(1, 1)
    drain_timeout_ms: int = _bounded(10_000, 0)


@dataclass(frozen=True, slots=True)
class HttpConfig:
    max_header_bytes: int = _bounded(32_768, 1024, 1_048_576)
    max_headers: int = _bounded(100, 1, 1000)
    max_request_line_bytes: int = _bounded(8192, 64, 65_536)
    max_body_bytes: int = _bounded(1_073_741_824, 0)
    header_timeout_ms: int = _bounded(60_000, 1)
    body_timeout_ms: int = _bounded(60_000, 1)
    keepalive_timeout_ms: int = _bounded(75_000, 0)
    max_keepalive_requests: int = _bounded(1000, 0)
    x_forwarded: bool = True
    via: bool = True
    h2_max_concurrent_streams: int = _bounded(100, 1, 10_000)
    server_timing: bool = False


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Server certificate and key (PEM files); `ca` turns on client-certificate checks."""

    cert: str
    key: str
    ca: str | None = None


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    name: str
    address: str
    host: str
    port: int
    protocols: tuple[str, ...] = ("http1",)
    backlog: int = _bounded(1024, 1)
    tls: TlsConfig | None = None


@dataclass(frozen=True, slots=True)
class AdminConfig:
    address: str
    host: str
    port: int
    token: str | None = None  # bearer token the admin API asks for (redacted in GET /config)


@dataclass(frozen=True, slots=True)
class AccessLogConfig:
    """One JSON line per request: path "-" is stderr, "off" turns it off."""

    path: str = "-"
    flush_interval_ms: int = _bounded(200, 10, 60_000)


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    weight: int = _bounded(1, 1)

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    name: str
    endpoints: tuple[Endpoint, ...]
    connect_timeout_ms: int = _bounded(1000, 1)
    request_timeout_ms: int = _bounded(30_000, 1)
    read_timeout_ms: int = _bounded(60_000, 1)
    balancer: str = "round_robin"
    protocol: str = "http1"
    max_idle_connections: int = _bounded(32, 0)
    idle_timeout_ms: int = _bounded(60_000, 1)
    max_requests_per_connection: int = _bounded(1000, 0)


@dataclass(frozen=True, slots=True)
class RouteMatch:
    """All given conditions must hold; an empty match matches every request."""

    path: bytes | None = None
    path_prefix: bytes | None = None
    method: tuple[bytes, ...] = ()
    host: bytes | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()
    grpc_service: bytes | None = None
    grpc_method: bytes | None = None
    intent: str | None = None          # a label the [semantic] model predicts
    intent_domain: str | None = None   # or one of its domains


@dataclass(frozen=True, slots=True)
class RouteConfig:
    name: str
    cluster: str
    match: RouteMatch = field(default_factory=RouteMatch)


@dataclass(frozen=True, slots=True)
class SemanticConfig:
    """Intent classification of requests for routes that match on intent/domain."""

    model: str = "builtin:clinc150"       # "builtin:NAME" or a path (relative to the config)
    inspect_bytes: int = _bounded(65_536, 0, 16 * 1024 * 1024)
    threshold: float | None = None        # below it the label is "oos"; None: the model's own
    json_fields: tuple[str, ...] = ()     # extra JSON string fields to read
    intent_header: str = "x-model-intent"  # an explicit intent skips the model
    max_batch: int = _bounded(16, 1, 1024)
    max_wait_us: int = _bounded(0, 0, 100_000)  # >0: micro-batch concurrent requests


@dataclass(frozen=True, slots=True)
class Config:
    source: str
    server: ServerConfig = field(default_factory=ServerConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    listeners: tuple[ListenerConfig, ...] = ()
    admin: AdminConfig | None = None
    access_log: AccessLogConfig = field(default_factory=AccessLogConfig)
    semantic: SemanticConfig | None = None
    clusters: tuple[ClusterConfig, ...] = ()
    routes: tuple[RouteConfig, ...] = ()

    def cluster_by_name(self, name: str) -> ClusterConfig:
        for cluster in self.clusters:
            if cluster.name == name:
                return cluster
        raise KeyError(name)
