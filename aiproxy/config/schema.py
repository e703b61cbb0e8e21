"""Typed, immutable configuration produced by the loader.

Durations are integer milliseconds and sizes integer bytes. Integer fields that the
loader validates carry their allowed range in ``metadata["range"]`` as ``(min, max)``
(``max`` is None when unbounded). Values the request path compares are stored as bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .address import format_address


def _bounded(default: int, lo: int, hi: int | None = None) -> Any:
    return field(default=default, metadata={"range": (lo, hi)})


MAX_WORKERS = 1024
MIN_HANG_TIMEOUT_MS = 1000


def cpu_count() -> int:
    """CPUs this process may run on (honours taskset/cpusets): `workers = "auto"`."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class ServerConfig:
    # Processes serving the listeners; the loader turns "auto" (the default) into cpu_count().
    workers: int = field(default_factory=cpu_count)
    drain_timeout_ms: int = _bounded(10_000, 0)
    # A worker whose event loop has not answered the supervisor's ping for this long is
    # killed and restarted; 0 = never. The loader also refuses 1..MIN_HANG_TIMEOUT_MS-1.
    worker_hang_timeout_ms: int = _bounded(30_000, 0)


@dataclass(frozen=True, slots=True)
class HttpConfig:
    max_header_bytes: int = _bounded(32_768, 1024, 1_048_576)
    max_headers: int = _bounded(100, 1, 1000)
    max_request_line_bytes: int = _bounded(8192, 64, 65_536)
    max_body_bytes: int = _bounded(1_073_741_824, 0)
    header_timeout_ms: int = _bounded(60_000, 1)
    body_timeout_ms: int = _bounded(60_000, 1)
    send_timeout_ms: int = _bounded(60_000, 1)  # a response the client takes none of
    tunnel_idle_timeout_ms: int = _bounded(300_000, 0)  # an Upgrade tunnel with no bytes; 0 off
    keepalive_timeout_ms: int = _bounded(75_000, 0)
    max_keepalive_requests: int = _bounded(1000, 0)
    x_forwarded: bool = True
    via: bool = True
    h2_max_concurrent_streams: int = _bounded(100, 1, 10_000)
    h2_max_requests: int = _bounded(0, 0)  # streams a client connection opens; 0 no limit
    server_timing: bool = False
    ignore_client_abort: bool = False
    merge_slashes: bool = True
    escaped_slashes: str = "decode"  # %2F in a path: "decode", "keep" or "reject"


@dataclass(frozen=True, slots=True)
class SniCertConfig:
    """A certificate served to clients whose TLS server name (SNI) is one of
    `server_names` (exact, or `*.example.com`: one label)."""

    server_names: tuple[str, ...]
    cert: str
    key: str


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Server certificate and key (PEM files): served when no `certificates` entry names
    the client's SNI; `ca` turns on client-certificate checks."""

    cert: str
    key: str
    ca: str | None = None
    certificates: tuple[SniCertConfig, ...] = ()

    def files(self) -> tuple[str, ...]:
        out = [self.cert, self.key]
        if self.ca:
            out.append(self.ca)
        for entry in self.certificates:
            out += (entry.cert, entry.key)
        return tuple(out)


@dataclass(frozen=True, slots=True)
class UpstreamTlsConfig:
    """TLS to a cluster's endpoints: `ca` (PEM bundle; default: the system's), `sni`
    (default: the endpoint's host), `verify` the certificate and host name.
    `ca_sha256`, of the CA file's bytes when the config was read, makes a reload that
    finds the file changed a change of `tls` (routing.cluster.pool_key)."""

    ca: str | None = None
    sni: str | None = None
    verify: bool = True
    ca_sha256: str = ""


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    name: str
    address: str
    host: str
    port: int
    protocols: tuple[str, ...] = ("http1",)
    backlog: int = _bounded(1024, 1, 65_535)
    tls: TlsConfig | None = None
    cluster: str | None = None  # protocols = ["tcp"]: raw bytes to this cluster
    idle_timeout_ms: int = _bounded(600_000, 0)  # tcp: close a tunnel idle this long; 0 off
    proxy_protocol: bool = False  # each connection opens with a PROXY protocol v1/v2 header


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
class TracingConfig:
    """W3C Trace Context: continue or start a trace per request (aiproxy/governance/tracing.py)."""

    enabled: bool = True
    otlp_endpoint: str | None = None  # HOST:PORT of an OTLP/gRPC collector: spans exported
    service_name: str = "aiproxy"


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    weight: int = _bounded(1, 1)
    capacity: int = _bounded(0, 0)  # concurrent requests it serves well (llm_score load); 0 = unset

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)


@dataclass(frozen=True, slots=True)
class LlmScoreConfig:
    """`[clusters.llm_score]`: score = latency_weight*(1 - min(ttfb/latency_ms, 1))
    + load_weight*(1 - load_pct/100) + tpm_weight*min(tpm/tpm, 1)."""

    latency_weight: float = 0.4
    load_weight: float = 0.3
    tpm_weight: float = 0.3
    latency_ms: int = _bounded(500, 1)  # TTFB that scores 0 on the latency term
    tpm: int = _bounded(2000, 1)  # tokens per minute that scores 1 on the throughput term
    ewma_alpha: float = 0.3  # weight of the newest TTFB sample
    explore_pct: int = _bounded(2, 0, 100)  # requests sent to a random endpoint (keeps scores fresh)


@dataclass(frozen=True, slots=True)
class HealthCheckConfig:
    """`health_check = {...}`: active HTTP/1.1 GET probes of every endpoint."""

    path: bytes = b"/healthz"
    interval_ms: int = _bounded(5000, 10)
    timeout_ms: int = _bounded(1000, 1)
    healthy_threshold: int = _bounded(2, 1, 100)
    unhealthy_threshold: int = _bounded(3, 1, 100)


@dataclass(frozen=True, slots=True)
class LoadMetricsConfig:
    """`load_metrics = {...}`: poll each endpoint's Prometheus text endpoint for a gauge
    that says how loaded it is (e.g. vLLM's vllm:gpu_cache_usage_perc, 0..1)."""

    path: bytes = b"/metrics"
    interval_ms: int = _bounded(2000, 100, 5000)  # a reported load is trusted for 10 s
    timeout_ms: int = _bounded(1000, 1)
    gauge: str = "vllm:gpu_cache_usage_perc"
    full: float = 1.0  # the gauge value that means 100% loaded


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """`outlier_detection = {...}`: passive ejection on consecutive failures."""

    consecutive_failures: int = _bounded(5, 0)  # 5xx responses or connect failures; 0 = off
    base_ejection_ms: int = _bounded(30_000, 1)
    max_ejection_ms: int = _bounded(300_000, 1)
    max_ejection_pct: int = _bounded(50, 0, 100)


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
    # ring_hash / maglev key: "header:<name>" or "client_ip" (stored lower-case)
    hash_key: str = "client_ip"
    llm_score: LlmScoreConfig = field(default_factory=LlmScoreConfig)
    health_check: HealthCheckConfig | None = None
    load_metrics: LoadMetricsConfig | None = None
    outlier_detection: OutlierConfig = field(default_factory=OutlierConfig)
    # Circuit breakers, 0 = unlimited: excess requests get 503 at once.
    max_connections: int = _bounded(0, 0)
    max_pending: int = _bounded(0, 0)
    max_requests: int = _bounded(0, 0)
    tls: UpstreamTlsConfig | None = None
    # The Host (HTTP/2 :authority) sent to the endpoints, "name[:port]"; None: the
    # client's, as it came (Envoy's default; nginx sends its upstream's name).
    host: bytes | None = None


@dataclass(frozen=True, slots=True)
class RouteMatch:
    """All given conditions must hold; an empty match matches every request."""

    path: bytes | None = None
    path_prefix: bytes | None = None
    method: tuple[bytes, ...] = ()
    host: bytes | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()  # exact values
    grpc_service: bytes | None = None
    grpc_method: bytes | None = None
    intent: str | None = None          # a label the [semantic] model predicts
    intent_domain: str | None = None   # or one of its domains
    path_regex: bytes | None = None  # must match the whole path (no query)
    # (name, kind, value): kind "regex" (whole value), "present" or "absent"
    header_rules: tuple[tuple[bytes, str, bytes], ...] = ()
    # (name, value): value None means "present"
    query: tuple[tuple[bytes, bytes | None], ...] = ()


@dataclass(frozen=True, slots=True)
class SplitTarget:
    cluster: str
    weight: int


# "unavailable": a gRPC trailers-only answer with grpc-status 14 (UNAVAILABLE).
RETRY_ON = ("connect-failure", "reset", "502", "503", "504", "unavailable")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = _bounded(1, 0, 10)  # retries after the first try
    on: tuple[str, ...] = ("connect-failure", "reset")
    budget_pct: int = _bounded(20, 0, 100)  # retries in flight / requests in flight
    backoff_ms: int = _bounded(25, 0, 60_000)  # base of the jittered exponential backoff
    # "reset" and the status conditions (502/503/504, unavailable) retry a request whose
    # method is not idempotent (POST, PATCH) only when this is set: the upstream may have
    # acted on it (RFC 9110 9.2.2, RFC 9112 9.3.1, as nginx's proxy_next_upstream
    # non_idempotent).
    non_idempotent: bool = False


REDIRECT_STATUSES = (301, 302, 303, 307, 308)


@dataclass(frozen=True, slots=True)
class DirectResponse:
    """A route's own answer (nginx `return CODE TEXT`, Envoy direct_response)."""

    status: int
    body: bytes = b""
    content_type: bytes | None = None  # sent only with a body


@dataclass(frozen=True, slots=True)
class Redirect:
    """A route's redirect: the request's URL with the parts set here replaced."""

    status: int = 301
    scheme: bytes | None = None  # b"http" | b"https"
    host: bytes | None = None
    port: int | None = None
    path: bytes | None = None  # the whole path (a query in it replaces the request's)
    prefix_rewrite: bytes | None = None  # with match.path_prefix: that prefix replaced
    strip_query: bool = False


@dataclass(frozen=True, slots=True)
class RouteConfig:
    name: str
    cluster: str | None  # None: split, direct_response or redirect
    match: RouteMatch = field(default_factory=RouteMatch)
    split: tuple[SplitTarget, ...] = ()  # instead of cluster
    sticky_header: bytes | None = None
    timeout_ms: int | None = None  # overrides the cluster's request_timeout_ms
    retries: RetryPolicy | None = None
    request_headers_add: tuple[tuple[bytes, bytes], ...] = ()
    request_headers_remove: tuple[bytes, ...] = ()
    response_headers_add: tuple[tuple[bytes, bytes], ...] = ()
    response_headers_remove: tuple[bytes, ...] = ()
    prefix_rewrite: bytes | None = None
    model: bytes | None = None  # sent upstream as x-model-id
    direct_response: DirectResponse | None = None
    redirect: Redirect | None = None

    @property
    def clusters(self) -> tuple[str, ...]:
        if self.split:
            return tuple(t.cluster for t in self.split)
        return (self.cluster,) if self.cluster is not None else ()


@dataclass(frozen=True, slots=True)
class TrafficClass:
    """A `[[kernel.classes]]` entry: traffic tc_classify marks (class ids count from 1)."""

    name: str
    id: int
    ports: tuple[int, ...] = ()
    payload: tuple[str, ...] = ()  # payload signatures: "h2_preface", "post_v1"
    dscp: int | None = None  # 0..63
    priority: int | None = None  # skb->priority


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """`[kernel]`: XDP guard, TC classifier and socket splicing. Off unless configured."""

    interfaces: tuple[str, ...] = ()
    xdp_mode: str = "auto"  # "native" | "generic" | "auto" (native, else generic)
    deny_cidrs: tuple[str, ...] = ()  # normalised networks, e.g. "10.0.0.0/8"
    syn_rate_per_source: int = _bounded(0, 0, 1_000_000)  # new connections/s; 0 = off
    syn_burst: int = _bounded(0, 0, 1_000_000)  # 0 = same as syn_rate_per_source
    syn_ports: tuple[int, ...] = ()  # default: every listener's port
    splice_tunnels: bool = False
    classes: tuple[TrafficClass, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.interfaces) or self.splice_tunnels


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
    # "auto": the trainer's own graph runs in C (LinearHead), any other in onnxruntime;
    # "onnxruntime": always the session (same answers; for comparison and debugging)
    runtime: str = "auto"


@dataclass(frozen=True, slots=True)
class LlmConfig:
    """`[llm]`: OpenAI-style request/response accounting (aiproxy/llm). On for every route
    (or `routes`) when present, and wherever a rate limit or the cache needs it."""

    inspect_bytes: int = _bounded(65_536, 256, 16 * 1024 * 1024)  # request body read
    tenant_header: bytes | None = None  # tenant when no auth identity (else client IP)
    max_tenants: int = _bounded(100, 1, 100_000)  # tenant labels in /metrics; more: "other"
    max_models: int = _bounded(50, 1, 10_000)
    routes: tuple[str, ...] = ()  # empty: every route
    # where the endpoints are served ("*": one whole path segment, Azure's deployment)
    api_prefixes: tuple[str, ...] = ("/v1/",)


RATELIMIT_KEYS = ("tenant", "route", "model")


@dataclass(frozen=True, slots=True)
class RateLimitConfig:
    """A `[[ratelimits]]` entry: token buckets keyed per tenant (and route/model)."""

    name: str
    routes: tuple[str, ...] = ()  # empty: every route
    key: tuple[str, ...] = ("tenant",)
    requests_per_second: float = 0.0  # 0: no request bucket
    burst_requests: int = _bounded(0, 0)  # bucket size; 0: one second's worth (at least 1)
    tokens_per_minute: int = _bounded(0, 0)  # 0: no token bucket
    burst_tokens: int = _bounded(0, 0)  # 0: one minute's worth
    default_max_tokens: int = _bounded(256, 0)  # completion reserved when none is asked
    watermark: bool = True  # scale by the cluster's backend-reported GPU memory load
    max_wait_ms: int = _bounded(0, 0, 60_000)  # queueing between 50% and 80% load
    max_queue: int = _bounded(1000, 0, 1_000_000)
    backend: str = "memory"  # or "redis"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_timeout_ms: int = _bounded(250, 1, 60_000)
    on_backend_error: str = "open"  # or "closed"
    max_keys: int = _bounded(100_000, 1)  # in-process buckets kept (least recently used go)
    # RateLimit-Policy/RateLimit on admitted responses too (429s always have them)
    response_headers: bool = False
    # x-ratelimit-{limit,remaining,reset}-{requests,tokens}, as OpenAI's API sends them
    openai_headers: bool = False


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """`[cache]`: exact prompt cache (and embedding/semantic caches) for `routes`."""

    routes: tuple[str, ...] = ()  # empty: every route
    ttl_ms: int = _bounded(300_000, 1)
    max_bytes: int = _bounded(64 * 1024 * 1024, 1024)
    max_entry_bytes: int = _bounded(1024 * 1024, 1)
    shared: bool = False  # entries shared across identities (else scoped per tenant)
    # nginx's `proxy_ignore_headers Cache-Control Expires`: the upstream's lifetime and
    # no-cache/private are not read (no-store still is); entries live ttl_ms.
    ignore_upstream_cache_control: bool = False
    semantic_threshold: float | None = None  # cosine similarity for a semantic hit
    backend: str = "memory"  # or "redis"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_timeout_ms: int = _bounded(250, 1, 60_000)


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
    kernel: KernelConfig = field(default_factory=KernelConfig)
    tracing: TracingConfig | None = None
    llm: LlmConfig | None = None
    ratelimits: tuple[RateLimitConfig, ...] = ()
    cache: CacheConfig | None = None
    # Governance sections (aiproxy/config/governance.py): None when not configured.
    auth: Any = None
    policy: Any = None
    audit: Any = None
    guard: Any = None
    redact: Any = None

    def cluster_by_name(self, name: str) -> ClusterConfig:
        for cluster in self.clusters:
            if cluster.name == name:
                return cluster
        raise KeyError(name)
