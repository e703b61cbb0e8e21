"""Keep-alive pool of upstream connections for one endpoint."""

from __future__ import annotations

import asyncio
import re
import ssl
from typing import TYPE_CHECKING, Any

from aiproxy._fast.clock import event_now, monotonic
from aiproxy.config import ClusterConfig, Endpoint, UpstreamTlsConfig
from aiproxy.config.address import split_authority
from aiproxy.protocols.h1_upstream import H1UpstreamConnection
from aiproxy.protocols.h2_upstream import H2UpstreamConnection, H2UpstreamStream
from aiproxy.routing.stats import EndpointStats
from aiproxy.server.tls import IGNORE_UNEXPECTED_EOF

if TYPE_CHECKING:
    from aiproxy.config import HttpConfig
    from aiproxy.pipeline.ends import Upstream



class UpstreamConnectError(Exception):
    """No connection (or stream) for a request: 504 upstream_connect_timeout for a
    timeout, 502 upstream_connect_failed otherwise, unless `status` and `code` say.
    str() is for the log and the trace; `public`, what the client is told, leaves out
    the endpoint's address (as nginx and Envoy keep the upstream's address from clients)."""

    def __init__(self, timeout: bool, message: str, status: int = 0, code: str = "",
                 public: str | None = None) -> None:
        super().__init__(message)
        self.public = message if public is None else public
        self.timeout = timeout
        self.status = status or (504 if timeout else 502)
        self.code = code or ("upstream_connect_timeout" if timeout
                             else "upstream_connect_failed")


def upstream_tls_context(tls: UpstreamTlsConfig, alpn: str) -> ssl.SSLContext:
    """Client TLS for a cluster: TLS 1.2+, ALPN offering only the cluster's protocol."""
    if tls.verify:
        ctx = ssl.create_default_context(cafile=tls.ca)  # the system's CAs without `ca`
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options &= ~IGNORE_UNEXPECTED_EOF  # a bare close must not end a body (RFC 9112 9.8)
    ctx.set_alpn_protocols([alpn])
    return ctx


def tls_connect_args(pool: EndpointPool, alpn: str) -> dict:
    """create_connection() arguments for TLS to the pool's endpoint ({} without TLS)."""
    tls = pool.cluster_cfg.tls
    if tls is None:
        return {}
    key = (id(tls), alpn)
    entry = _TLS_CONTEXTS.get(key)
    if entry is None or entry[0] is not tls:  # made once per config (again after a reload)
        entry = _TLS_CONTEXTS[key] = (tls, upstream_tls_context(tls, alpn))
    return {"ssl": entry[1], "server_hostname": tls.sni or _named_host(pool),
            "ssl_handshake_timeout": pool.cluster_cfg.connect_timeout_ms / 1000}


def _named_host(pool: EndpointPool) -> str:
    """The name TLS asks for and verifies: the cluster's `host` (without its port) when
    set, as the requests will name it, else the endpoint's host."""
    host = pool.cluster_cfg.host
    if host is None:
        return pool.host
    name = split_authority(host)[0].decode("ascii")
    return name[1:-1] if name.startswith("[") else name


# ssl's verify_message for a name mismatch: "... certificate is not valid for '<name>'."
CHECKED_NAME = re.compile(r" for '[^']*'")

_TLS_CONTEXTS: dict[tuple[int, str], tuple[UpstreamTlsConfig, ssl.SSLContext]] = {}


async def open_connection(pool: Pool | H2Pool, protocol: type) -> asyncio.Protocol:
    cfg = pool.cluster_cfg
    timeout = cfg.connect_timeout_ms / 1000
    address = pool.endpoint.address
    tls = cfg.tls
    alpn = "h2" if cfg.protocol == "h2" else "http/1.1"
    extra = tls_connect_args(pool, alpn)
    made: list[asyncio.Protocol] = []

    def factory() -> asyncio.Protocol:
        made.append(protocol(pool))
        return made[0]

    try:
        try:
            async with asyncio.timeout(timeout):
                transport, conn = await pool.loop.create_connection(
                    factory, pool.host, pool.port, **extra)
        except BaseException:
            if tls is None:  # over TLS the closing handshake reports the loss
                _lost_unreported(made)
            raise
    except TimeoutError:
        raise UpstreamConnectError(True, f"connect to {address} timed out",
                                   public="connecting to the upstream timed out") from None
    except ssl.SSLError as exc:
        text = public = str(getattr(exc, "reason", None) or exc)
        why = getattr(exc, "verify_message", None)
        if why:  # CERTIFICATE_VERIFY_FAILED alone does not say which check failed
            text = f"{text} ({why})"
            # A name mismatch quotes the name checked: the endpoint's host (or its sni).
            public = f"{public} ({CHECKED_NAME.sub(' for the upstream name', why)})"
        if "no application protocol" in text.replace("_", " ").lower():
            raise UpstreamConnectError(
                False, f"{address} did not agree to {alpn} (ALPN)",
                public=f"the upstream did not agree to {alpn} (ALPN)") from None
        raise UpstreamConnectError(False, f"TLS handshake with {address} failed: {text}",
                                   public=f"TLS handshake with the upstream failed: {public}"
                                   ) from None
    except OSError as exc:
        why = exc.strerror or exc
        raise UpstreamConnectError(False, f"connect to {address} failed: {why}",
                                   public=f"connecting to the upstream failed: {why}") from None
    if tls is not None:
        chosen = transport.get_extra_info("ssl_object").selected_alpn_protocol()
        if chosen not in (alpn, None) or (chosen is None and alpn == "h2"):
            transport.abort()
            agreed = f"did not agree to {alpn} (ALPN: {chosen or 'none'})"
            raise UpstreamConnectError(False, f"{address} {agreed}",
                                       public=f"the upstream {agreed}")
    return conn


def _lost_unreported(made: list) -> None:
    """uvloop's create_connection(), cancelled (the request abandoned, or connect_timeout_ms)
    after connection_made() ran but before it returned, closes the socket without ever
    calling connection_lost(): call it, as asyncio's own loop does, or open_count (and the
    max_connections breaker that reads it) keeps a connection that is gone."""
    if not made:
        return
    conn = made[0]
    transport = conn.transport
    if transport is not None and transport.get_protocol() is conn:
        conn.connection_lost(None)
        settings = getattr(conn, "settings_received", None)  # HTTP/2: no one waits for it now
        if settings is not None and settings.done() and not settings.cancelled():
            settings.exception()


class EndpointPool:
    """What every pool of one endpoint carries: where it is, its cluster's settings
    (replaced on reload), counters for /metrics and the balancer's statistics."""

    __slots__ = ("loop", "endpoint", "host", "port", "_cfg", "max_head", "opened",
                 "reused", "closed", "open_count", "stats", "max_idle", "max_requests",
                 "host_line", "authority")

    def __init__(self, loop: asyncio.AbstractEventLoop, endpoint: Endpoint,
                 cluster_cfg: ClusterConfig, http: HttpConfig) -> None:
        self.loop = loop
        self.endpoint = endpoint
        self.host = endpoint.host
        self.port = endpoint.port
        self.cluster_cfg = cluster_cfg
        self.max_head = http.max_header_bytes
        self.opened = 0
        self.reused = 0
        self.open_count = 0
        self.closed = False
        self.stats = EndpointStats()

    @property
    def cluster_cfg(self) -> ClusterConfig:
        return self._cfg

    @cluster_cfg.setter
    def cluster_cfg(self, cfg: ClusterConfig) -> None:
        # Replaced on reload; the limits read per request are kept as C fields.
        self._cfg = cfg
        self.max_idle = cfg.max_idle_connections
        self.max_requests = cfg.max_requests_per_connection
        # The cluster's `host`, sent instead of the client's Host / :authority.
        self.authority = cfg.host
        self.host_line = b"Host: " + cfg.host + b"\r\n" if cfg.host is not None else None

    @property
    def scheme(self) -> bytes:
        """The :scheme of requests to this endpoint (HTTP/2)."""
        return b"https" if self.cluster_cfg.tls is not None else b"http"

    def take(self) -> Upstream | None:
        """A connection (or stream) ready for a request, or None: connect()."""
        raise NotImplementedError

    def release(self, conn: Upstream) -> None:
        raise NotImplementedError


class Pool(EndpointPool):
    """Idle connections are reused most-recent-first so the oldest age out."""

    __slots__ = ("max_headers", "idle", "_sweep")

    def __init__(self, loop: asyncio.AbstractEventLoop, endpoint: Endpoint,
                 cluster_cfg: ClusterConfig, http: HttpConfig) -> None:
        super().__init__(loop, endpoint, cluster_cfg, http)
        self.max_headers = http.max_headers
        self.idle: list[H1UpstreamConnection] = []
        self._sweep: asyncio.TimerHandle | None = None

    def take(self) -> H1UpstreamConnection | None:
        idle = self.idle
        now = event_now()
        while idle:
            c = idle.pop()
            if c.reusable(now):
                self.reused += 1
                return c
            c.close()
        return None

    async def connect(self, cluster: Any = None) -> H1UpstreamConnection:
        conn = await open_connection(self, H1UpstreamConnection)
        self.opened += 1
        return conn

    def release(self, conn: H1UpstreamConnection) -> None:
        c = conn
        if (self.closed or not c.usable() or len(self.idle) >= self.max_idle
                or (self.max_requests and c.requests >= self.max_requests)):
            c.close()
            return
        c.park(event_now())
        self.idle.append(c)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self._cfg.idle_timeout_ms / 1000, self._expire)

    def discard(self, conn: H1UpstreamConnection) -> None:
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    def _expire(self) -> None:
        self._sweep = None
        timeout = self.cluster_cfg.idle_timeout_ms / 1000
        deadline = monotonic() - timeout
        keep = []
        for conn in self.idle:
            if conn.idle_since <= deadline:
                conn.close()
            else:
                keep.append(conn)
        self.idle = keep
        if keep:
            wait = keep[0].idle_since + timeout - monotonic()
            self._sweep = self.loop.call_later(max(wait, 0.001), self._expire)

    def close(self) -> None:
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()


class H2Pool(EndpointPool):
    """HTTP/2 endpoint: requests share connections as streams; a new connection is
    opened only when every open one is at the peer's concurrent stream limit."""

    __slots__ = ("conns", "connecting", "capacity")

    def __init__(self, loop: asyncio.AbstractEventLoop, endpoint: Endpoint,
                 cluster_cfg: ClusterConfig, http: HttpConfig) -> None:
        super().__init__(loop, endpoint, cluster_cfg, http)
        self.conns: list[H2UpstreamConnection] = []
        self.connecting: asyncio.Task | None = None
        # Set by connect()'s waiters on a connection that allows no streams.
        self.capacity: asyncio.Future | None = None

    def take(self) -> H2UpstreamStream | None:
        for conn in reversed(self.conns):
            stream = conn.open_stream()
            if stream is not None:
                self.reused += 1
                return stream
        return None

    async def connect(self, cluster: Any = None) -> H2UpstreamStream:
        # Waiters share one connection attempt at a time; those left without a stream
        # (the peer's limit is smaller than the crowd) start the next one.
        #
        # A peer whose SETTINGS_MAX_CONCURRENT_STREAMS is 0 (RFC 9113 6.5.2: it takes no
        # new streams, maybe for a while) gets no stream, and no second connection
        # either: the same endpoint would most likely say 0 again, and opening one
        # connection after another until connect_timeout_ms is what an overloaded
        # upstream needs least. As an Envoy pool does with a connection whose stream
        # capacity is used up, the connection is kept and requests wait on it, here
        # until connect_timeout_ms, for a SETTINGS frame that raises the limit (or for
        # the connection to go, after which one new connection is tried); then they
        # fail with 503 upstream_no_streams (a JSON error, retried on another endpoint
        # under a connect-failure retry policy, and counted as an endpoint failure).
        deadline = self.loop.time() + self.cluster_cfg.connect_timeout_ms / 1000
        while True:
            stream = self.take()
            if stream is None and self._closed_for_streams() is None:
                task = self.connecting
                if task is None:
                    # Another connection (the open ones are full): within the cluster's
                    # max_connections, as the first attempt was (Exchange).
                    why = cluster.h2_connect_overflow() if cluster is not None else None
                    if why is not None:
                        raise UpstreamConnectError(False, why, 503, "upstream_overflow")
                    task = self.connecting = self.loop.create_task(self._open())
                try:
                    conn = await asyncio.shield(task)
                finally:
                    if self.connecting is task and task.done():
                        self.connecting = None
                stream = conn.open_stream() or self.take()
            if stream is not None:
                return stream
            left = deadline - self.loop.time()
            stalled = self._closed_for_streams()
            if left <= 0:
                if stalled is not None:
                    why = "allows no HTTP/2 streams (SETTINGS_MAX_CONCURRENT_STREAMS = 0)"
                    raise UpstreamConnectError(
                        False, f"{self.endpoint.address} {why}", 503, "upstream_no_streams",
                        public=f"the upstream {why}")
                raise UpstreamConnectError(
                    True, f"{self.endpoint.address}: no HTTP/2 stream capacity",
                    public="no HTTP/2 stream capacity on the upstream")
            if stalled is not None:
                waiter = self.capacity
                if waiter is None:
                    waiter = self.capacity = self.loop.create_future()
                try:
                    async with asyncio.timeout(left):
                        await asyncio.shield(waiter)
                except TimeoutError:
                    pass

    def _closed_for_streams(self) -> H2UpstreamConnection | None:
        """An open connection whose peer allows no concurrent streams at all."""
        for conn in self.conns:
            if conn.max_streams == 0 and not conn.closed and not conn.goaway:
                return conn
        return None

    def capacity_changed(self) -> None:
        """A connection's stream limit changed or it went: wake connect()'s waiters."""
        waiter = self.capacity
        if waiter is not None:
            self.capacity = None
            if not waiter.done():
                waiter.set_result(None)

    async def _open(self) -> H2UpstreamConnection:
        conn = await open_connection(self, H2UpstreamConnection)
        self.opened += 1
        # Streams wait for the peer's SETTINGS: until then its concurrent stream limit is
        # unknown, and a peer that counts streams over its limit as a connection error
        # would take every stream on the connection down with the extra one.
        try:
            async with asyncio.timeout(self.cluster_cfg.connect_timeout_ms / 1000):
                await conn.settings_received
        except TimeoutError:
            conn.close()
            raise UpstreamConnectError(
                True, f"{self.endpoint.address} sent no HTTP/2 SETTINGS",
                public="the upstream sent no HTTP/2 SETTINGS") from None
        except ConnectionError as exc:
            raise UpstreamConnectError(False, f"{self.endpoint.address}: {exc}",
                                       public=f"the upstream connection failed: {exc}"
                                       ) from None
        if self.closed:
            conn.close()
            raise UpstreamConnectError(False, "cluster closed")
        self.conns.append(conn)
        return conn

    def release(self, stream: H2UpstreamStream) -> None:
        pass  # the stream is done; its connection stays in self.conns

    def discard(self, conn: H2UpstreamConnection) -> None:
        try:
            self.conns.remove(conn)
        except ValueError:
            pass
        self.capacity_changed()

    def close(self) -> None:
        self.closed = True
        conns, self.conns = self.conns, []
        for conn in conns:
            conn.close()
