"""Admin HTTP API on its own listener (loopback by default), served by aiohttp.

GET /healthz, /readyz, /metrics (Prometheus text), /config (secrets redacted),
/config/routes, /clusters, /lineage/<trace_id>; POST /config/reload. With [admin] token set, every
endpoint but /healthz and /readyz wants `Authorization: Bearer <token>`.
A request that changes state (any method but GET and HEAD) from a browser page of another
origin is refused (403): see _same_origin.

What the endpoints show comes from an AdminBackend: LocalBackend for a proxy that
serves in this process (`workers = 1`), the Supervisor when worker processes do.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import re
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urlsplit

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from aiproxy.config import Config, Problem, read_config_text
from aiproxy.config.address import loopback_name, without_password
from aiproxy.config.locate import Locator
from aiproxy.governance.tracing import build_graph, trace_spans
from aiproxy.protocols import fields
from aiproxy.server.pending import pending_restart, served_config
from aiproxy.server.sockets import bound_sockets
from aiproxy.telemetry.metrics import registry_for

if TYPE_CHECKING:
    from aiproxy.server.app import ProxyServer

log = logging.getLogger("aiproxy.admin")

OPEN_PATHS = {"/healthz", "/readyz"}
SAFE_METHODS = frozenset(("GET", "HEAD", "OPTIONS"))


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("latin-1")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# Names (config keys, header fields, query parameters) whose values are secrets: the
# known ones, and any that looks like one ("-" read as "_").
SECRET_KEYS = frozenset(("token", "upstream_secret", "salt", "digest", "password", "secret"))
# A signature (X-Amz-Signature, X-Goog-Signature, an Azure SAS's sig) signs a URL for
# whoever holds it: a credential as a token is.
SECRET_NAME = re.compile(r"passw(?:or)?d|secret|credential|private|api_?key|token(?!s)|_key$"
                         r"|signature|(?:^|_)sig(?:_|$)")
# Config keys that look like secrets and are not: what a balancer hashes on, and the
# header an API key is read from.
NOT_SECRET = frozenset(("hash_key", "api_key_header"))
# Names that say their value is about a secret, not the secret: where it is (a file, a
# path, the header it comes in) or a duration or size (token_ttl, private_key_file).
ABOUT_A_SECRET = re.compile(r"_(?:file|path|dir|header|ttl|ms|s|seconds|bytes|size|len"
                            r"|length)$")
# The same for a header field or query parameter name, less the config keys' own
# conventions (timeout_s, timeout_ms, api_key_header): a field X-Api-Key-S or
# X-Api-Key-Header may well carry the key.
ABOUT_A_SECRET_FIELD = re.compile(r"_(?:file|path|dir|ttl|seconds|bytes|size|len|length)$")
# A query's name=value pairs, in a path or URL the config holds (a redirect's path, a
# health check's path, ...).
QUERY_PARAM = re.compile(r"([?&])([^=&#\s]+)=([^&#\s]*)")
# Lists of [name, value] (or [name, op, value]) entries: a route that adds a credential
# field (an upstream API key) or matches on one (or on a query parameter like api_key)
# holds a secret in the entry's value.
NAMED_LISTS = frozenset(("headers", "header_rules", "request_headers_add",
                         "response_headers_add", "query"))
CREDENTIAL_FIELDS = frozenset(name.decode() for name in fields.CREDENTIAL_FIELDS)


def secret_name(name: str, field: bool = False) -> bool:
    """Whether a config key (or, `field`, a header field or query parameter name) holds
    a secret."""
    name = name.lower()
    if name in SECRET_KEYS or name in CREDENTIAL_FIELDS:
        return True
    name = name.replace("-", "_")
    if field:
        # A bare "key" is an API key (Google's ?key=); as a config key, a TLS key file.
        return name == "key" or (ABOUT_A_SECRET_FIELD.search(name) is None
                                 and SECRET_NAME.search(name) is not None)
    return (name not in NOT_SECRET and ABOUT_A_SECRET.search(name) is None
            and SECRET_NAME.search(name) is not None)


def _named_entry(entry: Any) -> Any:
    if (isinstance(entry, list) and len(entry) > 1 and entry[-1] is not None
            and secret_name(str(entry[0]), field=True)):
        return [*entry[:-1], "<redacted>"]
    return _redacted(entry)


def _query_param(m: re.Match[str]) -> str:
    if secret_name(unquote(m[2]), field=True):
        return f"{m[1]}{m[2]}=<redacted>"
    return m[0]


def _text(value: str) -> str:
    """A config string without the password of any URL in it, nor the value of a
    secret query parameter (?X-Amz-Signature=...)."""
    value = without_password(value)
    q = value.find("?")
    if q < 0:
        return value
    return value[:q] + QUERY_PARAM.sub(_query_param, value[q:])


def _secret(value: Any) -> Any:
    """The value of a secret name: its text hidden; tables in it (API key entries)
    still show what is not secret in them."""
    if isinstance(value, dict):
        return _redacted(value)
    if isinstance(value, list):
        return [_secret(v) for v in value]
    if not value or isinstance(value, bool):
        return value
    return "<redacted>"


def _redacted(value: Any) -> Any:
    """Secrets out of a config tree: values of names that look like secrets (config
    keys, header fields, query parameters), and the password of any URL
    (redis://:PASSWORD@host) and secret query parameters wherever they are."""
    if isinstance(value, dict):
        return {k: _secret(v) if secret_name(k)
                else [_named_entry(e) for e in v] if k in NAMED_LISTS and isinstance(v, list)
                else _redacted(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    if isinstance(value, str):
        return _text(value)
    return value


def effective_config(config: Config) -> dict[str, Any]:
    return _redacted(_plain(dataclasses.asdict(config)))


def describe_routes(server: ProxyServer) -> list[dict[str, Any]]:
    rt = server.runtime
    return [{"name": r.name, **r.describe(),
             "match": _redacted(_plain(dataclasses.asdict(cfg.match)))}
            for r, cfg in zip(rt.table.routes, rt.config.routes, strict=True)]


def describe_clusters(server: ProxyServer) -> list[dict[str, Any]]:
    return [cluster.describe() for cluster in server.runtime.clusters.values()]


class AdminBackend(Protocol):
    """What the admin API reads and drives."""

    config: Config
    served: Config  # what is served of what only a restart changes (server/pending.py)
    registry: CollectorRegistry

    def problems(self) -> list[str]:
        """Why the proxy is not ready; empty when it is."""

    async def refresh_metrics(self) -> None:
        """Bring what `registry` renders up to date (called before each scrape)."""

    async def routes(self) -> list[dict[str, Any]]: ...

    async def clusters(self) -> list[dict[str, Any]]: ...

    async def reload(self) -> tuple[bool, str]: ...

    async def spans(self, trace_id: str) -> list[dict[str, Any]] | None:
        """The spans of a trace; None when [tracing] is off."""


class LocalBackend:
    """The admin view of a ProxyServer in this process."""

    def __init__(self, server: ProxyServer) -> None:
        self.server = server
        self.registry = registry_for(server)

    @property
    def config(self) -> Config:
        return self.server.config

    @property
    def served(self) -> Config:
        return self.server.served

    def problems(self) -> list[str]:
        server = self.server
        problems = []
        if not server.servers or server.draining:
            problems.append("listeners not bound" if not server.servers else "draining")
        for cluster in server.runtime.clusters.values():
            if not cluster.pools:
                problems.append(f"cluster {cluster.name} has no endpoints")
        return problems

    async def refresh_metrics(self) -> None:
        pass  # the collector reads the live counters

    async def routes(self) -> list[dict[str, Any]]:
        return describe_routes(self.server)

    async def clusters(self) -> list[dict[str, Any]]:
        return describe_clusters(self.server)

    async def reload(self) -> tuple[bool, str]:
        return await self.server.reload()

    async def spans(self, trace_id: str) -> list[dict[str, Any]] | None:
        return trace_spans(self.server.runtime, trace_id)


def cross_origin(request: web.Request) -> bool:
    """Whether a browser sent this request from a page of another origin. Browsers say
    so in Sec-Fetch-Site, or failing that (before 2023) in Origin, which they send on
    every cross-origin POST; a client that sends neither (curl, a script) is no browser.
    The check of Go's net/http CrossOriginProtection."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None:
        return site not in ("same-origin", "none")
    origin = request.headers.get("Origin")
    if origin is None:
        return False
    try:
        host = urlsplit(origin).netloc
    except ValueError:
        return True
    return not host or host.lower() != request.host.lower()


@web.middleware
async def _same_origin(request: web.Request, handler: Any) -> web.StreamResponse:
    # Without a token, a page the operator visits could make the browser POST to the
    # admin port (a form or a text/plain body needs no CORS preflight). Reads need no
    # check: the same-origin policy keeps their answers from the page.
    if request.method not in SAFE_METHODS and cross_origin(request):
        return web.json_response(
            {"error": {"code": "cross_origin",
                       "message": "cross-origin browser request refused"}}, status=403)
    return await handler(request)


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    # aiohttp answers an unknown path or method in plain text; the admin API's other
    # errors are JSON {"error": {"code", "message"}}.
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return web.json_response(
            {"error": {"code": "method_not_allowed",
                       "message": f"{request.method} is not allowed here (allowed: "
                                  f"{allowed})"}},
            status=405, headers={"Allow": allowed})
    except web.HTTPNotFound:
        return web.json_response(
            {"error": {"code": "not_found", "message": "no such admin endpoint"}},
            status=404)


def _known_host(loopback: bool) -> Any:
    @web.middleware
    async def known_host(request: web.Request, handler: Any) -> web.StreamResponse:
        # DNS rebinding: a page on attacker.example whose name is made to resolve to
        # 127.0.0.1 is same-origin with an admin port on loopback, so the browser lets
        # it read /config and POST /config/reload. Its requests carry its own name in
        # Host; on loopback, only loopback names are answered (a request without Host,
        # HTTP/1.0, is no browser's).
        host = request.headers.get("Host")
        if loopback and host is not None and not loopback_name(host):
            return web.json_response(
                {"error": {"code": "unknown_host",
                           "message": "the admin API on loopback answers loopback host "
                                      "names only (127.0.0.1, [::1], localhost)"}},
                status=403)
        return await handler(request)

    return known_host


class _HandlerLog(logging.LoggerAdapter):
    """The logger aiohttp's request handler writes to. It logs each request its parser
    refuses (answered 400) with logger.exception: a traceback per malformed request,
    which anyone who reaches the port can fill the log with. Those are the client's
    error and get one line, as the listeners log theirs; a handler's own exception (a
    500, our bug) keeps its traceback."""

    def exception(self, msg: object, *args: object, exc_info: Any = True,
                  **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            reason = " ".join(part.strip() for part in str(exc_info.message).splitlines()
                              if part.strip().strip("^"))
            reason = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in reason)
            remote = args[0] if args else "?"
            log.info("bad request from %s: %d %s", remote, exc_info.code, reason[:200])
            return
        self.logger.error(msg, *args, exc_info=exc_info, **kwargs)


def bind_problem(config: Config, exc: OSError) -> Problem:
    """Why the admin API's address cannot be bound, naming the file, line and key."""
    admin = config.admin
    address = admin.address if admin is not None else "?"
    try:
        line = Locator(read_config_text(config.source)).line(("admin", "address"))
    except Exception:  # noqa: BLE001 - a config given as text: no lines to name
        line = 0
    why = exc.strerror or str(exc)
    return Problem(config.source, line, "admin.address",
                   f"cannot bind the admin API ([admin] address) on {address}: {why}")


class AdminServer:
    def __init__(self, backend: AdminBackend) -> None:
        self.backend = backend
        self.runner: web.AppRunner | None = None
        admin = backend.config.admin
        loopback = admin is not None and loopback_name(admin.host)
        app = web.Application(middlewares=[_known_host(loopback), _same_origin, self._auth,
                                          _json_errors])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/config", self.config)
        app.router.add_get("/config/routes", self.routes)
        app.router.add_get("/clusters", self.clusters)
        app.router.add_get("/lineage/{trace_id}", self.lineage)
        app.router.add_post("/config/reload", self.reload)
        self.app = app

    async def start(self, host: str, port: int) -> None:
        self.runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                    logger=_HandlerLog(logging.getLogger("aiohttp.server")))
        await self.runner.setup()
        # Bound here, not by TCPSite(host, port): see aiproxy/server/sockets.py.
        for sock in bound_sockets(host, port):
            await web.SockSite(self.runner, sock).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        # [admin] removed by a reload: the API serves until a restart, with its token
        admin = self.backend.config.admin or self.backend.served.admin
        token = admin.token if admin is not None else None
        if token and request.path not in OPEN_PATHS:
            # aiohttp keeps bytes that are not UTF-8 as lone surrogates: surrogatepass
            # encodes any str, and never to the bytes of a (valid UTF-8) token.
            # The scheme name is case-insensitive (RFC 9110 11.1): "bearer" is "Bearer".
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            given_token = given.lstrip(" ").encode("utf-8", "surrogatepass")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given_token,
                                                                      token.encode()):
                return web.json_response(
                    {"error": {"code": "unauthorized", "message": "bearer token required"}},
                    status=401, headers={"WWW-Authenticate": 'Bearer realm="aiproxy-admin"'})
        return await handler(request)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(self, request: web.Request) -> web.Response:
        problems = self.backend.problems()
        if problems:
            return web.json_response({"ready": False, "problems": problems}, status=503)
        return web.json_response({"ready": True})

    async def metrics(self, request: web.Request) -> web.Response:
        await self.backend.refresh_metrics()
        body = generate_latest(self.backend.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def config(self, request: web.Request) -> web.Response:
        backend = self.backend
        view = effective_config(served_config(backend.served, backend.config))
        view["pending_restart"] = pending_restart(backend.served, backend.config)
        return web.json_response(view)

    async def routes(self, request: web.Request) -> web.Response:
        return web.json_response(await self.backend.routes())

    async def clusters(self, request: web.Request) -> web.Response:
        return web.json_response(await self.backend.clusters())

    async def lineage(self, request: web.Request) -> web.Response:
        trace_id = request.match_info["trace_id"]
        spans = await self.backend.spans(trace_id)
        if spans is None:
            return web.json_response(
                {"error": {"code": "tracing_off", "message": "no [tracing] section"}},
                status=404)
        if not spans:
            return web.json_response(
                {"error": {"code": "unknown_trace", "message": "no spans for this trace"}},
                status=404)
        return web.json_response(build_graph(trace_id, spans))

    async def reload(self, request: web.Request) -> web.Response:
        ok, message = await self.backend.reload()
        if ok:
            return web.json_response({"reloaded": True, "message": message})
        return web.json_response(
            {"reloaded": False, "error": {"code": "invalid_config", "message": message}},
            status=400)
