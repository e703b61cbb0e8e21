"""Load a TOML file into a validated :class:`Config`, collecting every problem found."""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
import tomllib
from collections.abc import Collection
from datetime import date, datetime, time
from typing import Any

from aiproxy.pipeline.paths import ESCAPED_SLASHES

from . import llm_sections, safe_regex
from .address import HOSTNAME, is_host, parse_address
from .errors import ConfigError, Problem
from .files import cert_dns_names, file_sha256, tls_problems, writable_file_problem
from .governance import GOVERNANCE_KEYS, governance_sections
from .locate import KeyPath, Locator
from .locate import format_path as _format_path
from .schema import (
    MAX_WORKERS,
    MIN_HANG_TIMEOUT_MS,
    REDIRECT_STATUSES,
    RETRY_ON,
    AccessLogConfig,
    AdminConfig,
    ClusterConfig,
    Config,
    DirectResponse,
    Endpoint,
    HealthCheckConfig,
    HttpConfig,
    KernelConfig,
    ListenerConfig,
    LlmScoreConfig,
    LoadMetricsConfig,
    OutlierConfig,
    Redirect,
    RetryPolicy,
    RouteConfig,
    RouteMatch,
    SemanticConfig,
    ServerConfig,
    SniCertConfig,
    SplitTarget,
    TlsConfig,
    TracingConfig,
    TrafficClass,
    UpstreamTlsConfig,
)

PROTOCOLS = ("http1", "h2c", "h2", "tcp")
UPSTREAM_PROTOCOLS = ("http1", "h2")
BALANCERS = ("round_robin", "least_request", "ring_hash", "maglev", "llm_score")
# ring_hash puts 100 points per unit of weight on its ring (routing/cluster.py RingHash),
# rebuilt on the event loop at start and whenever an endpoint's health changes: about
# 1.2 s per million points. Only the weights' ratios matter, so a larger sum buys nothing.
RING_HASH_MAX_WEIGHT = 10_000

_TOP_KEYS = ("server", "http", "listeners", "admin", "access_log", "clusters", "routes",
             "kernel", "semantic", "tracing", *llm_sections.TOP_KEYS, *GOVERNANCE_KEYS)
_KERNEL_KEYS = tuple(f.name for f in dataclasses.fields(KernelConfig))
_CLASS_KEYS = ("name", "ports", "payload", "dscp", "priority")
XDP_MODES = ("auto", "native", "generic")
PAYLOAD_SIGNATURES = ("h2_preface", "post_v1")
MAX_TRAFFIC_CLASSES = 15  # class ids 1..15 (bpf/include/classify.h: CLASSIFY_MAX_CLASSES - 1)
_IFNAME = re.compile(r"[^\s/:]{1,15}")
_LISTENER_KEYS = ("name", "address", "protocols", "backlog", "tls", "cluster",
                  "idle_timeout_ms", "proxy_protocol")
_TLS_KEYS = ("cert", "key", "ca", "certificates")
_SNI_CERT_KEYS = ("server_names", "cert", "key")
# RFC 1123 host name labels; SNI carries A-labels ("xn--..."), no trailing dot (RFC 6066 3).
_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_ENDPOINT_KEYS = ("address", "weight", "capacity")
_ROUTE_KEYS = ("name", "cluster", "match", "split", "sticky_header", "timeout_ms", "retries",
               "request_headers_add", "request_headers_remove", "response_headers_add",
               "response_headers_remove", "prefix_rewrite", "model", "direct_response",
               "redirect")
_DIRECT_KEYS = ("status", "body", "content_type")
_REDIRECT_KEYS = ("status", "scheme", "host", "port", "path", "prefix_rewrite", "strip_query")
# Route keys that only mean something when the request goes to a cluster.
_UPSTREAM_ROUTE_KEYS = ("sticky_header", "timeout_ms", "retries", "request_headers_add",
                        "request_headers_remove", "prefix_rewrite", "model")
_DIRECT_BODY_LIMIT = 1024 * 1024
_MATCH_KEYS = ("path", "path_prefix", "path_regex", "method", "host", "headers", "query",
               "grpc_service", "grpc_method", "intent", "intent_domain")
_HEADER_RULE_KEYS = ("exact", "regex", "present")
_SPLIT_KEYS = ("cluster", "weight")
_WILDCARD_HOST = re.compile(r"\*\.(.+)")
# Fields the proxy owns on the upstream request; a route may not add or remove them.
_RESERVED_REQUEST_HEADERS = frozenset((
    "host", "content-length", "transfer-encoding", "connection", "upgrade", "te",
    "keep-alive", "proxy-connection", "expect"))
_RESERVED_RESPONSE_HEADERS = frozenset((
    "content-length", "transfer-encoding", "connection", "upgrade", "te", "keep-alive",
    "proxy-connection", "trailer"))

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")
_HEADER_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")
_BRACKETED_V6 = re.compile(r"\[[0-9A-Fa-f:.]+\]")
_HOST_WITH_PORT = re.compile(r".+:[0-9]+")
_SYNTAX_LOOKBACK = 2000  # lines
_SYNTAX_POSITION = re.compile(r"\s*\((?:at line (\d+), column \d+|at end of document)\)\s*$")

_KINDS = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "float"),
    (str, "string"),
    (list, "array"),
    (dict, "table"),
    (datetime, "datetime"),
    (date, "date"),
    (time, "time"),
)


def load_config(path: str | os.PathLike[str]) -> Config:
    filename = os.fspath(path)
    return load_config_text(read_config_text(filename), filename)


def read_config_text(filename: str) -> str:
    """The file's text, or ConfigError naming the file."""
    try:
        with open(filename, "rb") as fh:
            text = fh.read().decode("utf-8-sig")  # a leading byte order mark is skipped
    except OSError as exc:
        raise ConfigError(
            [Problem(filename, 0, "", f"cannot read: {exc.strerror or exc}")]
        ) from None
    except UnicodeDecodeError as exc:
        line = exc.object[:exc.start].count(b"\n") + 1
        raise ConfigError([Problem(filename, line, "",
                                   f"cannot read: not UTF-8 (byte 0x{exc.object[exc.start]:02x})")]
                          ) from None
    return text


def load_config_text(text: str, filename: str) -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([syntax_problem(filename, text, exc)]) from None
    checker = _Checker(filename, Locator(text))
    checker.numbers(data, ())
    config = checker.config(data)
    if checker.problems:
        raise ConfigError(sorted(checker.problems, key=lambda problem: problem.line))
    return config


def syntax_problem(filename: str, text: str, exc: tomllib.TOMLDecodeError) -> Problem:
    """The FILE:LINE problem for a TOML syntax error, at the statement that caused it."""
    message = str(exc)
    position = _SYNTAX_POSITION.search(message)
    lines = text.splitlines(keepends=True)
    if position is None:
        line = 1
    else:
        message = message[: position.start()]
        line = int(position.group(1)) if position.group(1) else len(lines) or 1
    start = _statement_start(lines, line)
    path = Locator(text).statement(start)
    if start < line:
        # An open bracket or quote: tomllib stops where the value finally fails to
        # parse, often at a later table; the mistake is in the statement that opened it.
        message += f" at line {line}: a bracket or quote opened here is not closed"
    return Problem(filename, start, _format_path(path) if path else "", f"syntax: {message}")


def _statement_start(lines: list[str], line: int) -> int:
    """The line where the statement tomllib failed on (at `line`) begins: the first line
    with content after the longest prefix of the document that parses on its own. The
    walk back is bounded (each step parses the prefix); past it, `line` stands."""
    last = min(line, len(lines)) - 1
    for keep in range(last, max(last - _SYNTAX_LOOKBACK, -1), -1):
        try:
            tomllib.loads("".join(lines[:keep]))
        except tomllib.TOMLDecodeError:
            continue
        for n in range(keep, line):
            stripped = lines[n].strip()
            if stripped and not stripped.startswith("#"):
                return n + 1
        return line
    return line


def _bind_addresses(host: str) -> set[tuple[int, str]]:
    """(IP version, address) a listening socket on `host` covers; "*" for a wildcard,
    version 0 for a name resolved only at start (compared by name)."""
    host = host.lower().rstrip(".")
    if host == "localhost":  # RFC 6761: always loopback; bound as each address it has
        return {(4, "127.0.0.1"), (6, "::1")}
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return {(0, host)}
    return {(ip.version, "*" if ip.is_unspecified else ip.compressed)}


def _own_listener(endpoint: Endpoint,
                  listeners: tuple[ListenerConfig, ...]) -> ListenerConfig | None:
    """The listener a connection to `endpoint` would reach in this very proxy, as far as
    the config can tell: the same port on the same address, or a loopback (or
    unspecified) endpoint address under a wildcard listener of its IP version. Another
    listener of the proxy (another port) is a legitimate next hop, and a non-loopback
    address may be another host."""
    mine = _bind_addresses(endpoint.host)
    for listener in listeners:
        if listener.port != endpoint.port:
            continue
        theirs = _bind_addresses(listener.host)
        if mine & theirs:
            return listener
        for version, address in mine:
            if version and (version, "*") in theirs and (
                    address == "*" or ipaddress.ip_address(address).is_loopback):
                return listener
    return None


def _bind_overlap(a: set[tuple[int, str]], b: set[tuple[int, str]]) -> bool:
    return any(x == y or (x[0] == y[0] != 0 and "*" in (x[1], y[1])) for x in a for y in b)


def _kind(value: object) -> str:
    for cls, name in _KINDS:
        if isinstance(value, cls):
            return name
    return type(value).__name__


def _unknown_key(key: str, allowed: Collection[str]) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown key '{key}'{hint}"


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(cls))


def _in_range(value: int, bounds: tuple[int, int | None]) -> bool:
    lo, hi = bounds
    return value >= lo and (hi is None or value <= hi)


def _range_message(bounds: tuple[int, int | None], value: int) -> str:
    lo, hi = bounds
    if hi is None:
        return f"must be >= {lo}, got {value}"
    return f"must be between {lo} and {hi}, got {value}"


class _Checker:
    def __init__(self, filename: str, locator: Locator) -> None:
        self.filename = filename
        self.locator = locator
        self.problems: list[Problem] = []
        self.bound: tuple[ListenerConfig, ...] = ()  # listeners, once read

    def base_dir(self) -> str:
        """Where relative paths in the file start from: the file's directory."""
        return os.path.dirname(os.path.abspath(self.filename))

    def error(self, path: KeyPath, message: str) -> None:
        line = self.locator.line(path)
        self.problems.append(Problem(self.filename, line, _format_path(path), message))

    # -- generic readers ---------------------------------------------------------------

    def numbers(self, value: Any, path: KeyPath) -> None:
        """Numbers no key can take, wherever they are: nan and inf (TOML has them, no
        setting means them), and integers beyond 64 bits (TOML 1.0: an error)."""
        if isinstance(value, dict):
            for key, item in value.items():
                self.numbers(item, path + (key,))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                self.numbers(item, path + (index,))
        elif isinstance(value, float) and not math.isfinite(value):
            self.error(path, f"must be a finite number, got {value}")
        elif isinstance(value, int) and not isinstance(value, bool) and not (
                -(1 << 63) <= value < 1 << 63):
            self.error(path, "integer beyond TOML's 64-bit range")

    def check_keys(self, data: dict[str, Any], path: KeyPath, allowed: Collection[str]) -> None:
        for key in data:
            if key not in allowed:
                self.error(path + (key,), _unknown_key(key, allowed))

    def get(
        self, data: dict[str, Any], path: KeyPath, key: str, kind: str, *, required: bool = False
    ) -> Any:
        """``data[key]`` if present and of ``kind``; None (after reporting) otherwise."""
        if key not in data:
            if required:
                self.error(path + (key,), "missing required key")
            return None
        value = data[key]
        if _kind(value) != kind:
            self.error(path + (key,), f"expected {kind}, got {_kind(value)}")
            return None
        return value

    def name(self, data: dict[str, Any], path: KeyPath, key: str = "name") -> str | None:
        value = self.get(data, path, key, "string", required=True)
        if value == "":
            self.error(path + (key,), "must not be empty")
            return None
        return value

    def section(
        self, data: dict[str, Any], key: str, allowed: Collection[str]
    ) -> dict[str, Any] | None:
        table = self.get(data, (), key, "table")
        if table is not None:
            self.check_keys(table, (key,), allowed)
        return table

    def table_array(self, data: dict[str, Any], key: str) -> list[tuple[KeyPath, dict]] | None:
        """Elements of ``[[key]]`` with their paths; None if ``key`` has the wrong type."""
        value = data.get(key, [])
        if not isinstance(value, list):
            self.error((key,), f"expected array of tables, got {_kind(value)}")
            return None
        items = []
        for index, item in enumerate(value):
            if isinstance(item, dict):
                items.append(((key, index), item))
            else:
                self.error((key, index), f"expected table, got {_kind(item)}")
        return items

    def scalars(self, cls: type, data: dict[str, Any], path: KeyPath) -> dict[str, Any]:
        """Valid integer (range-checked) and boolean fields of ``cls`` present in ``data``."""
        values = {}
        for field in dataclasses.fields(cls):
            bounds = field.metadata.get("range")
            if bounds is None and not isinstance(field.default, bool):
                continue
            value = self.get(data, path, field.name, "integer" if bounds else "boolean")
            if value is None:
                continue
            if bounds and not _in_range(value, bounds):
                self.error(path + (field.name,), _range_message(bounds, value))
                continue
            values[field.name] = value
        return values

    def address(self, data: dict[str, Any], path: KeyPath) -> tuple[str, str, int] | None:
        text = self.get(data, path, "address", "string", required=True)
        return None if text is None else self.parse_address(text, path + ("address",))

    def parse_address(self, text: str, path: KeyPath) -> tuple[str, str, int] | None:
        try:
            host, port = parse_address(text)
        except ValueError as exc:
            self.error(path, f"invalid address '{text}': {exc}")
            return None
        return text, host, port

    def overlapping_bind(self, address: tuple[str, str, int],
                         others: list[tuple[str, str, int, str]], path: KeyPath,
                         what: str) -> None:
        """Report the first of `others` whose socket would take some of `address`'s
        addresses: the same port on a wildcard of the same family, or "localhost" beside
        a loopback address. A single process then fails to bind, and workers (which bind
        with SO_REUSEPORT) would share the port between the two."""
        mine = _bind_addresses(address[1])
        for text, host, port, name in others:
            if port == address[2] and _bind_overlap(mine, _bind_addresses(host)):
                self.error(path, f"address '{address[0]}' overlaps {what} '{name}' ({text})")
                return

    def unique_names(self, named: list[tuple[KeyPath, str]], what: str) -> None:
        seen: dict[str, KeyPath] = {}
        for path, name in named:
            if name in seen:
                first = self.locator.line(seen[name])
                self.error(path, f"duplicate {what} name '{name}' (first defined at line {first})")
            else:
                seen[name] = path

    # -- sections ----------------------------------------------------------------------

    def config(self, data: dict[str, Any]) -> Config:
        self.data = data
        self.check_keys(data, (), _TOP_KEYS)
        http = self.section(data, "http", _field_names(HttpConfig))
        listeners = self.listeners(data)
        self.bound = listeners  # endpoints that are one of these would loop
        clusters, cluster_names = self.clusters(data)
        self.tcp_listener_clusters(listeners, clusters, cluster_names)
        return Config(
            source=self.filename,
            server=self.server(data),
            http=self.http(http or {}),
            listeners=listeners,
            admin=self.admin(data, listeners),
            access_log=self.access_log(data),
            semantic=self.semantic(data),
            clusters=clusters,
            routes=self.routes(data, cluster_names),
            kernel=self.kernel(data, listeners),
            tracing=self.tracing(data),
            llm=llm_sections.llm(self, data),
            ratelimits=llm_sections.ratelimits(self, data),
            cache=llm_sections.cache(self, data),
            **governance_sections(self, data, listeners),
        )

    def http(self, table: dict[str, Any]) -> HttpConfig:
        values = self.scalars(HttpConfig, table, ("http",))
        if "escaped_slashes" in table:
            values["escaped_slashes"] = self.choice(table, ("http",), "escaped_slashes",
                                                    ESCAPED_SLASHES)
        return HttpConfig(**values)

    def server(self, data: dict[str, Any]) -> ServerConfig:
        table = self.section(data, "server", _field_names(ServerConfig)) or {}
        values = self.scalars(ServerConfig, table, ("server",))
        workers = table.get("workers", "auto")
        path = ("server", "workers")
        if workers == "auto":
            values.pop("workers", None)  # the schema default: one per CPU
        elif isinstance(workers, bool) or not isinstance(workers, int | str):
            self.error(path, f'expected integer or "auto", got {_kind(workers)}')
        elif isinstance(workers, str):
            self.error(path, f'expected integer or "auto", got \'{workers}\'')
        elif not _in_range(workers, (1, MAX_WORKERS)):
            self.error(path, _range_message((1, MAX_WORKERS), workers))
        else:
            values["workers"] = workers
        hang = values.get("worker_hang_timeout_ms")
        if hang and hang < MIN_HANG_TIMEOUT_MS:
            values.pop("worker_hang_timeout_ms")
            self.error(("server", "worker_hang_timeout_ms"),
                       f"must be 0 (off) or >= {MIN_HANG_TIMEOUT_MS}, got {hang}")
        return ServerConfig(**values)

    def listeners(self, data: dict[str, Any]) -> tuple[ListenerConfig, ...]:
        self.listener_paths: list[KeyPath] = []
        items = self.table_array(data, "listeners")
        if items is None:
            return ()
        if not data.get("listeners"):
            self.error(("listeners",), "at least one listener is required")
        listeners = []
        names: list[tuple[KeyPath, str]] = []
        bound: dict[tuple[str, int], str] = {}
        binds: list[tuple[str, str, int, str]] = []  # (address, host, port, listener name)
        for path, item in items:
            before = len(self.problems)
            self.check_keys(item, path, _LISTENER_KEYS)
            name = self.name(item, path)
            if name is not None:
                names.append((path + ("name",), name))
            address = self.address(item, path)
            if address is not None:
                key = (address[1].lower(), address[2])
                if key in bound:
                    self.error(
                        path + ("address",),
                        f"duplicate listener address '{address[0]}' "
                        f"(also used by listener '{bound[key]}')",
                    )
                else:
                    self.overlapping_bind(address, binds, path + ("address",), "listener")
                bound.setdefault(key, name or "?")
                binds.append((*address, name or "?"))
            protocols = self.protocols(item, path)
            tls = self.tls(item, path, load="tcp" not in protocols)  # tcp: no TLS at all
            if tls is None and "h2" in protocols:
                self.error(path + ("protocols",), "'h2' needs TLS: add tls = { cert, key }"
                           " (use 'h2c' for cleartext HTTP/2)")
            if tls is not None and "h2c" in protocols:
                # A TLS listener offers HTTP/2 through ALPN only: 'h2c' would serve nothing.
                self.error(path + ("protocols",), "'h2c' is cleartext HTTP/2: over TLS use"
                           " 'h2'")
            cluster = self.tcp_listener(item, path, protocols, tls)
            extra = self.scalars(ListenerConfig, item, path)
            if len(self.problems) == before:
                listeners.append(ListenerConfig(name, *address, protocols=protocols, tls=tls,
                                                cluster=cluster, **extra))
                self.listener_paths.append(path)
        self.unique_names(names, "listener")
        return tuple(listeners)

    def tcp_listener(self, data: dict[str, Any], path: KeyPath, protocols: tuple[str, ...],
                     tls: TlsConfig | None) -> str | None:
        """A raw TCP listener's `cluster` (checked against the clusters later)."""
        if "tcp" not in protocols:
            if "cluster" in data:
                self.error(path + ("cluster",), "only a tcp listener takes a cluster "
                           "(HTTP listeners pick clusters through [[routes]])")
            if "idle_timeout_ms" in data:
                self.error(path + ("idle_timeout_ms",), "only a tcp listener takes "
                           "idle_timeout_ms (HTTP connections: [http] keepalive_timeout_ms "
                           "and the body/request timeouts)")
            return None
        if len(protocols) > 1:
            self.error(path + ("protocols",), "'tcp' cannot be combined with HTTP protocols")
        if tls is not None:
            self.error(path + ("tls",), "a tcp listener forwards raw bytes: tls is not "
                       "supported on it")
        return self.name(data, path, "cluster")

    def tcp_listener_clusters(self, listeners: tuple[ListenerConfig, ...],
                              clusters: tuple[ClusterConfig, ...],
                              cluster_names: list[str]) -> None:
        by_name = {c.name: c for c in clusters}
        for listener, path in zip(listeners, self.listener_paths, strict=True):
            if listener.cluster is None:
                continue
            self.known_cluster(listener.cluster, path + ("cluster",), cluster_names)
            cluster = by_name.get(listener.cluster)
            if cluster is not None and cluster.tls is not None:
                self.error(path + ("cluster",), f"cluster '{cluster.name}' uses tls; a tcp "
                           "listener forwards raw bytes to plain TCP endpoints")

    def protocols(self, data: dict[str, Any], path: KeyPath) -> tuple[str, ...]:
        if "protocols" not in data:
            return PROTOCOLS[:1]
        values = self.get(data, path, "protocols", "array") or []
        path += ("protocols",)
        if data["protocols"] == []:
            self.error(path, "must not be empty")
        allowed = ", ".join(PROTOCOLS)
        result: list[str] = []
        for index, value in enumerate(values):
            if not isinstance(value, str):
                self.error(path + (index,), f"expected string, got {_kind(value)}")
            elif value not in PROTOCOLS:
                self.error(path + (index,), f"unknown protocol '{value}' (allowed: {allowed})")
            elif value in result:
                self.error(path + (index,), f"duplicate protocol '{value}'")
            else:
                result.append(value)
        return tuple(result)

    def tls(self, data: dict[str, Any], path: KeyPath, load: bool = True) -> TlsConfig | None:
        if "tls" not in data:
            return None
        table = self.get(data, path, "tls", "table")
        if table is None:
            return None
        path += ("tls",)
        self.check_keys(table, path, _TLS_KEYS)
        files = self.pem_files(table, path, ("cert", "key", "ca"), load)
        certificates = self.sni_certificates(table, path, load)
        if "cert" not in files or "key" not in files:
            return None
        return TlsConfig(**files, certificates=certificates)

    def pem_files(self, table: dict[str, Any], path: KeyPath, keys: tuple[str, ...],
                  load: bool) -> dict[str, str]:
        """The files named under `keys` (all but "ca" required), as absolute paths, each
        checked to load (a certificate, its key, a CA bundle) when `load`."""
        files = {}
        for key in keys:
            if key not in table:
                if key != "ca":
                    self.error(path + (key,), "missing required key")
                continue
            value = self.get(table, path, key, "string")
            if value is None:
                continue
            full = os.path.join(self.base_dir(), value)
            if not os.path.isfile(full):
                self.error(path + (key,), f"no such file '{value}'")
            files[key] = full
        if load and "cert" in files and "key" in files and all(
                os.path.isfile(f) for f in files.values()):
            for key, message in tls_problems(files["cert"], files["key"], files.get("ca")):
                self.error(path + (key,), message)
        return files

    def sni_certificates(self, table: dict[str, Any], path: KeyPath,
                         load: bool) -> tuple[SniCertConfig, ...]:
        """`certificates = [{ cert, key, server_names }]`: a certificate per TLS server name;
        server_names defaults to the certificate's DNS names."""
        if "certificates" not in table:
            return ()
        items = self.get(table, path, "certificates", "array")
        if items is None:
            return ()
        path += ("certificates",)
        out = []
        named: dict[str, int] = {}
        for index, item in enumerate(items):
            ipath = path + (index,)
            if not isinstance(item, dict):
                self.error(ipath, f"expected table, got {_kind(item)}")
                continue
            self.check_keys(item, ipath, _SNI_CERT_KEYS)
            files = self.pem_files(item, ipath, ("cert", "key"), load)
            if "server_names" in item:
                names = self.server_names(item, ipath)
            elif "cert" in files and os.path.isfile(files["cert"]):
                names = cert_dns_names(files["cert"])
                if not names:
                    self.error(ipath + ("cert",), "the certificate names no DNS host "
                               "(subjectAltName): add server_names")
            else:
                names = ()
            for name in names:
                if name in named:
                    self.error(ipath + ("server_names",), f"'{name}' is also served by "
                               f"certificates[{named[name]}]")
                named.setdefault(name, index)
            if "cert" in files and "key" in files and names:
                out.append(SniCertConfig(names, files["cert"], files["key"]))
        return tuple(out)

    def server_names(self, item: dict[str, Any], path: KeyPath) -> tuple[str, ...]:
        values = self.get(item, path, "server_names", "array")
        path += ("server_names",)
        if not values:
            if values is not None:
                self.error(path, "must name at least one host")
            return ()
        out = []
        for index, value in enumerate(values):
            if not isinstance(value, str):
                self.error(path + (index,), f"expected string, got {_kind(value)}")
                continue
            name = value.lower()
            labels = (name[2:] if name.startswith("*.") else name).split(".")
            if (not name.isascii() or len(name) > 253
                    or not all(_DNS_LABEL.fullmatch(label) for label in labels)):
                self.error(path + (index,), f"'{value}' is not a host name or *.host name "
                           "(an internationalized name is written as its xn-- A-label)")
                continue
            out.append(name)
        return tuple(dict.fromkeys(out))

    def choice(
        self, data: dict[str, Any], path: KeyPath, key: str, allowed: tuple[str, ...]
    ) -> str:
        """A string from ``allowed`` (default: its first entry)."""
        value = self.get(data, path, key, "string")
        if value is not None and value not in allowed:
            names = ", ".join(allowed)
            self.error(path + (key,), f"unknown {key} '{value}' (allowed: {names})")
        return value if value in allowed else allowed[0]

    def admin(
        self, data: dict[str, Any], listeners: tuple[ListenerConfig, ...]
    ) -> AdminConfig | None:
        table = self.section(data, "admin", ("address", "token"))
        if table is None:
            return None
        token = self.get(table, ("admin",), "token", "string")
        if token == "":
            self.error(("admin", "token"), "must not be empty (leave the key out for no token)")
        elif token is not None and (token != token.rstrip(" \t")
                                    or not _HEADER_VALUE.fullmatch(token)):
            # HTTP drops a field value's trailing whitespace and cannot carry control
            # bytes: no Authorization header could ever match such a token.
            self.error(("admin", "token"), "must not contain control characters or end "
                       "with whitespace (no client could send it)")
        address = self.address(table, ("admin",))
        if address is None:
            return None
        for listener in listeners:
            if (listener.host.lower(), listener.port) == (address[1].lower(), address[2]):
                self.error(
                    ("admin", "address"),
                    f"address '{address[0]}' is already used by listener '{listener.name}'",
                )
                break
        else:
            self.overlapping_bind(address, [(lst.address, lst.host, lst.port, lst.name)
                                            for lst in listeners], ("admin", "address"),
                                  "listener")
        return AdminConfig(*address, token=token or None)

    def semantic(self, data: dict[str, Any]) -> SemanticConfig | None:
        table = self.section(data, "semantic", _field_names(SemanticConfig))
        if table is None:
            return None
        where = ("semantic",)
        values: dict[str, Any] = self.scalars(SemanticConfig, table, where)
        model = self.get(table, where, "model", "string")
        if model is not None:
            if not model.startswith("builtin:"):
                full = os.path.join(os.path.dirname(os.path.abspath(self.filename)), model)
                if not os.path.isfile(full):
                    self.error(where + ("model",), f"no such model file '{model}'")
                model = full
            values["model"] = model
        if "threshold" in table:
            threshold = table["threshold"]
            if isinstance(threshold, bool) or not isinstance(threshold, int | float):
                self.error(where + ("threshold",), f"expected number, got {_kind(threshold)}")
            elif not 0 <= threshold <= 1:
                self.error(where + ("threshold",), "must be between 0 and 1")
            else:
                values["threshold"] = float(threshold)
        fields = self.get(table, where, "json_fields", "array")
        if fields is not None:
            if not all(isinstance(f, str) and f for f in fields):
                self.error(where + ("json_fields",), "expected an array of non-empty strings")
            else:
                values["json_fields"] = tuple(fields)
        header = self.get(table, where, "intent_header", "string")
        if header is not None:
            if not _TOKEN.fullmatch(header):
                self.error(where + ("intent_header",), f"invalid header name '{header}'")
            else:
                values["intent_header"] = header.lower()
        runtime = self.get(table, where, "runtime", "string")
        if runtime is not None:
            if runtime not in ("auto", "onnxruntime"):
                self.error(where + ("runtime",),
                           f"expected \"auto\" or \"onnxruntime\", got '{runtime}'")
            else:
                values["runtime"] = runtime
        return SemanticConfig(**values)

    def tracing(self, data: dict[str, Any]) -> TracingConfig | None:
        table = self.section(data, "tracing", _field_names(TracingConfig))
        if table is None:
            return None
        values: dict[str, Any] = self.scalars(TracingConfig, table, ("tracing",))
        endpoint = self.get(table, ("tracing",), "otlp_endpoint", "string")
        if endpoint is not None and self.parse_address(endpoint, ("tracing", "otlp_endpoint")):
            values["otlp_endpoint"] = endpoint
        name = self.get(table, ("tracing",), "service_name", "string")
        if name == "":
            self.error(("tracing", "service_name"), "must not be empty")
        elif name:
            values["service_name"] = name
        cfg = TracingConfig(**values)
        return cfg if cfg.enabled else None

    def access_log(self, data: dict[str, Any]) -> AccessLogConfig:
        table = self.section(data, "access_log", _field_names(AccessLogConfig))
        if table is None:
            return AccessLogConfig()
        path = self.get(table, ("access_log",), "path", "string")
        extra = self.scalars(AccessLogConfig, table, ("access_log",))
        if path is not None and not path:
            self.error(("access_log", "path"), 'must not be empty (use "-" or "off")')
            path = None
        elif path not in (None, "-", "off"):
            problem = writable_file_problem(os.path.join(self.base_dir(), path))
            if problem:
                self.error(("access_log", "path"), problem)
        return AccessLogConfig(path=path if path is not None else "-", **extra)

    def clusters(self, data: dict[str, Any]) -> tuple[tuple[ClusterConfig, ...], list[str]]:
        """Valid clusters, plus every cluster name given (so routes can refer to broken ones)."""
        clusters = []
        names: list[tuple[KeyPath, str]] = []
        for path, item in self.table_array(data, "clusters") or []:
            before = len(self.problems)
            self.check_keys(item, path, _field_names(ClusterConfig))
            name = self.name(item, path)
            if name is not None:
                names.append((path + ("name",), name))
            endpoints = self.endpoints(item, path)
            balancer = self.choice(item, path, "balancer", BALANCERS)
            protocol = self.choice(item, path, "protocol", UPSTREAM_PROTOCOLS)
            extra = self.scalars(ClusterConfig, item, path)
            hash_key = self.hash_key(item, path)
            llm_score = self.llm_score(item, path)
            health = self.health_check(item, path)
            load_metrics = self.load_metrics(item, path)
            outlier = self.outlier(item, path)
            tls = self.upstream_tls(item, path)
            host = self.upstream_host(item, path)
            if balancer == "ring_hash":
                self.ring_weights(endpoints, path)
            if len(self.problems) == before:
                clusters.append(ClusterConfig(name, endpoints, balancer=balancer,
                                              protocol=protocol, hash_key=hash_key,
                                              llm_score=llm_score, health_check=health,
                                              load_metrics=load_metrics,
                                              outlier_detection=outlier, tls=tls, host=host,
                                              **extra))
        self.unique_names(names, "cluster")
        return tuple(clusters), [name for _, name in names]

    def upstream_host(self, data: dict[str, Any], path: KeyPath) -> bytes | None:
        """A cluster's `host`: "name", "name:port", an IP address or "[v6]:port"."""
        text = self.get(data, path, "host", "string")
        if text is None:
            return None
        if is_host(text, port=True):
            return text.lower().encode("ascii")
        self.error(path + ("host",), f"invalid host '{text}' (name[:port], an IP address, "
                                     "or [IPv6]:port)")
        return None

    def ring_weights(self, endpoints: tuple[Endpoint, ...], path: KeyPath) -> None:
        total = sum(endpoint.weight for endpoint in endpoints)
        if total > RING_HASH_MAX_WEIGHT:
            self.error(path + ("endpoints",),
                       f"ring_hash weights add up to {total}, at most {RING_HASH_MAX_WEIGHT}"
                       " (100 ring points per unit; only their ratios matter: scale them down)")

    def upstream_tls(self, data: dict[str, Any], path: KeyPath) -> UpstreamTlsConfig | None:
        """A cluster's `tls`: true, false, or { ca = "...", sni = "...", verify = true }."""
        if "tls" not in data:
            return None
        value = data["tls"]
        path += ("tls",)
        if isinstance(value, bool):
            return UpstreamTlsConfig() if value else None
        if not isinstance(value, dict):
            self.error(path, "must be true, false or a table { ca, sni, verify }")
            return None
        self.check_keys(value, path, ("ca", "sni", "verify"))
        ca = self.get(value, path, "ca", "string")
        ca_sha256 = ""
        if ca is not None:
            full = os.path.join(os.path.dirname(os.path.abspath(self.filename)), ca)
            if not os.path.isfile(full):
                self.error(path + ("ca",), f"no such file '{ca}'")
            else:
                for key, message in tls_problems(None, None, full):
                    self.error(path + (key,), message)
                ca_sha256 = file_sha256(full)
            ca = full
        sni = self.get(value, path, "sni", "string")
        if sni is not None and not HOSTNAME.fullmatch(sni):
            self.error(path + ("sni",), f"invalid host name '{sni}'")
        verify = self.get(value, path, "verify", "boolean")
        if verify is False and ca is not None:
            self.error(path + ("verify",), "'ca' is only used with verify = true")
        return UpstreamTlsConfig(ca=ca, sni=sni, verify=verify is not False,
                                 ca_sha256=ca_sha256)

    def hash_key(self, data: dict[str, Any], path: KeyPath) -> str:
        value = self.get(data, path, "hash_key", "string")
        if value is None:
            return "client_ip"
        if value == "client_ip":
            return value
        kind, _, name = value.partition(":")
        if kind != "header" or not _TOKEN.fullmatch(name):
            self.error(path + ("hash_key",),
                       f"invalid hash_key '{value}' (use \"header:<name>\" or \"client_ip\")")
            return "client_ip"
        return "header:" + name.lower()

    def subtable(self, data: dict[str, Any], path: KeyPath, key: str,
                 cls: type) -> tuple[dict[str, Any], KeyPath] | None:
        table = self.get(data, path, key, "table")
        if table is None:
            return None
        path += (key,)
        self.check_keys(table, path, _field_names(cls))
        return table, path

    def floats(self, cls: type, data: dict[str, Any], path: KeyPath) -> dict[str, float]:
        values = {}
        for field in dataclasses.fields(cls):
            if not isinstance(field.default, float) or field.name not in data:
                continue
            value = data[field.name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                self.error(path + (field.name,), f"expected number, got {_kind(value)}")
            elif not 0 <= value <= 1:
                self.error(path + (field.name,), f"must be between 0 and 1, got {value}")
            else:
                values[field.name] = float(value)
        return values

    def llm_score(self, data: dict[str, Any], path: KeyPath) -> LlmScoreConfig:
        found = self.subtable(data, path, "llm_score", LlmScoreConfig)
        if found is None:
            return LlmScoreConfig()
        table, path = found
        values = {**self.scalars(LlmScoreConfig, table, path),
                  **self.floats(LlmScoreConfig, table, path)}
        if "ewma_alpha" in values and values["ewma_alpha"] == 0:
            self.error(path + ("ewma_alpha",), "must be greater than 0")
            del values["ewma_alpha"]
        return LlmScoreConfig(**values)

    def health_check(self, data: dict[str, Any], path: KeyPath) -> HealthCheckConfig | None:
        found = self.subtable(data, path, "health_check", HealthCheckConfig)
        if found is None:
            return None
        table, path = found
        values: dict[str, Any] = self.scalars(HealthCheckConfig, table, path)
        probe = self.match_path(table, path, "path")
        if probe is not None:
            values["path"] = probe
        return HealthCheckConfig(**values)

    def load_metrics(self, data: dict[str, Any], path: KeyPath) -> LoadMetricsConfig | None:
        found = self.subtable(data, path, "load_metrics", LoadMetricsConfig)
        if found is None:
            return None
        table, path = found
        values: dict[str, Any] = self.scalars(LoadMetricsConfig, table, path)
        probe = self.match_path(table, path, "path")
        if probe is not None:
            values["path"] = probe
        gauge = self.get(table, path, "gauge", "string")
        if gauge is not None:
            if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", gauge):
                self.error(path + ("gauge",), f"invalid metric name '{gauge}'")
            else:
                values["gauge"] = gauge
        if "full" in table:
            full = table["full"]
            if isinstance(full, bool) or not isinstance(full, int | float) or full <= 0:
                self.error(path + ("full",), "expected a number greater than 0")
            else:
                values["full"] = float(full)
        return LoadMetricsConfig(**values)

    def outlier(self, data: dict[str, Any], path: KeyPath) -> OutlierConfig:
        found = self.subtable(data, path, "outlier_detection", OutlierConfig)
        if found is None:
            return OutlierConfig()
        table, path = found
        return OutlierConfig(**self.scalars(OutlierConfig, table, path))

    def endpoints(self, data: dict[str, Any], path: KeyPath) -> tuple[Endpoint, ...]:
        # An empty list is a drained cluster: its routes answer 503.
        values = self.get(data, path, "endpoints", "array", required=True) or []
        path += ("endpoints",)
        endpoints: list[Endpoint] = []
        seen: set[tuple[str, int]] = set()
        for index, value in enumerate(values):
            endpoint = self.endpoint(value, path + (index,))
            if endpoint is None:
                continue
            key = (endpoint.host.lower(), endpoint.port)
            if key in seen:
                self.error(path + (index,), f"duplicate endpoint '{endpoint.address}'")
            own = _own_listener(endpoint, self.bound)
            if own is not None:
                self.error(path + (index,), f"endpoint '{endpoint.address}' is this proxy's "
                           f"own listener '{own.name}' ({own.address}): requests would loop "
                           "back into it")
            seen.add(key)
            endpoints.append(endpoint)
        return tuple(endpoints)

    def endpoint(self, value: Any, path: KeyPath) -> Endpoint | None:
        if isinstance(value, str):
            address = self.parse_address(value, path)
            return None if address is None else Endpoint(address[1], address[2])
        if not isinstance(value, dict):
            self.error(path, f"expected string or table, got {_kind(value)}")
            return None
        before = len(self.problems)
        self.check_keys(value, path, _ENDPOINT_KEYS)
        address = self.address(value, path)
        extra = self.scalars(Endpoint, value, path)
        if len(self.problems) != before:
            return None
        return Endpoint(address[1], address[2], **extra)

    def routes(self, data: dict[str, Any], cluster_names: list[str]) -> tuple[RouteConfig, ...]:
        routes = []
        names: list[tuple[KeyPath, str]] = []
        for path, item in self.table_array(data, "routes") or []:
            before = len(self.problems)
            self.check_keys(item, path, _ROUTE_KEYS)
            name = self.name(item, path)
            if name is not None:
                names.append((path + ("name",), name))
            cluster = None
            split: tuple[SplitTarget, ...] = ()
            match = self.match(item, path)
            targets = [k for k in ("cluster", "split", "direct_response", "redirect")
                       if k in item]
            local: dict[str, Any] = {}
            if len(targets) > 1:
                self.error(path + (targets[1],), f"give one of cluster, split, "
                           f"direct_response or redirect, not {' and '.join(targets)}")
            if "split" in item:
                split = self.split(item, path, cluster_names)
            elif targets and targets[-1] in ("direct_response", "redirect"):
                for key in _UPSTREAM_ROUTE_KEYS:
                    if key in item:
                        self.error(path + (key,), f"only meaningful for a route to a "
                                   f"cluster, not with {targets[0]}")
                if targets[0] == "redirect":
                    local["redirect"] = self.redirect(item, path, match)
                else:
                    local["direct_response"] = self.direct_response(item, path)
            else:
                cluster = self.name(item, path, "cluster")
                self.known_cluster(cluster, path + ("cluster",), cluster_names)
            policy = self.route_policy(item, path, match)
            if len(self.problems) == before:
                routes.append(RouteConfig(name, cluster, match, split=split, **policy,
                                          **local))
        self.unique_names(names, "route")
        return tuple(routes)

    def direct_response(self, data: dict[str, Any], path: KeyPath) -> DirectResponse | None:
        table = self.get(data, path, "direct_response", "table")
        if table is None:
            return None
        path += ("direct_response",)
        before = len(self.problems)
        self.check_keys(table, path, _DIRECT_KEYS)
        status = self.get(table, path, "status", "integer", required=True)
        if status is not None and not 200 <= status <= 599:
            self.error(path + ("status",), f"must be a final status, 200 to 599, got {status}")
            status = None
        text = self.get(table, path, "body", "string")
        body = b"" if text is None else text.encode("utf-8")
        if len(body) > _DIRECT_BODY_LIMIT:
            self.error(path + ("body",), f"at most {_DIRECT_BODY_LIMIT} bytes")
        if body and status in (204, 205, 304):
            # RFC 9110 15.3.5, 15.3.6, 15.4.5: these responses have no content.
            self.error(path + ("body",), f"a {status} response has no body")
        ctype = self.get(table, path, "content_type", "string")
        if ctype is not None:
            if not ctype or not _HEADER_VALUE.fullmatch(ctype) or not ctype.isascii():
                self.error(path + ("content_type",), "must be a non-empty ASCII field value")
            elif not body:
                self.error(path + ("content_type",), "only sent with a body")
        if status is None or len(self.problems) > before:  # e.g. a non-ASCII content_type
            return None
        content_type = (ctype.encode("ascii") if ctype else b"text/plain; charset=utf-8"
                        ) if body else None
        return DirectResponse(status, body, content_type)

    def redirect(self, data: dict[str, Any], path: KeyPath,
                 match: RouteMatch | None) -> Redirect | None:
        table = self.get(data, path, "redirect", "table")
        if table is None:
            return None
        path += ("redirect",)
        self.check_keys(table, path, _REDIRECT_KEYS)
        values: dict[str, Any] = {}
        status = self.get(table, path, "status", "integer")
        if status is not None:
            if status not in REDIRECT_STATUSES:
                allowed = ", ".join(map(str, REDIRECT_STATUSES))
                self.error(path + ("status",), f"must be one of {allowed}, got {status}")
            values["status"] = status
        scheme = self.get(table, path, "scheme", "string")
        if scheme is not None:
            if scheme not in ("http", "https"):
                self.error(path + ("scheme",), f"must be \"http\" or \"https\", got '{scheme}'")
            values["scheme"] = scheme.encode("ascii", "replace")
        host = self.get(table, path, "host", "string")
        if host is not None:
            if not is_host(host):
                self.error(path + ("host",), f"invalid host name '{host}' (no port: use port)")
            values["host"] = (f"[{host}]" if ":" in host else host).encode("ascii", "replace")
        port = self.get(table, path, "port", "integer")
        if port is not None:
            if not 1 <= port <= 65535:
                self.error(path + ("port",), _range_message((1, 65535), port))
            values["port"] = port
        for key in ("path", "prefix_rewrite"):
            text = self.get(table, path, key, "string")
            if text is None:
                continue
            if not text.startswith("/") or text.startswith("//") or not (
                    _VISIBLE_ASCII.fullmatch(text)):
                self.error(path + (key,), "must start with one '/' and be printable ASCII "
                                          "without spaces")
            values[key] = text.encode("ascii", "replace")
        if "path" in values and "prefix_rewrite" in values:
            self.error(path + ("prefix_rewrite",), "give either path or prefix_rewrite")
        if "prefix_rewrite" in values and match is not None and match.path_prefix is None:
            self.error(path + ("prefix_rewrite",), "needs match.path_prefix")
        if b"?" in values.get("prefix_rewrite", b""):
            self.error(path + ("prefix_rewrite",), "must not hold a query (use path)")
        strip = self.get(table, path, "strip_query", "boolean")
        if strip is not None:
            values["strip_query"] = strip
        return Redirect(**values)

    def known_cluster(self, cluster: str | None, path: KeyPath, cluster_names: list[str]) -> None:
        if cluster is not None and cluster not in cluster_names:
            defined = ", ".join(cluster_names) if cluster_names else "none"
            self.error(path, f"unknown cluster '{cluster}' (defined: {defined})")

    def split(self, data: dict[str, Any], path: KeyPath,
              cluster_names: list[str]) -> tuple[SplitTarget, ...]:
        values = self.get(data, path, "split", "array")
        if values is None:
            return ()
        path += ("split",)
        if not values:
            self.error(path, "must not be empty")
        targets: list[SplitTarget] = []
        for index, value in enumerate(values):
            item_path = path + (index,)
            if not isinstance(value, dict):
                self.error(item_path, f"expected table, got {_kind(value)}")
                continue
            self.check_keys(value, item_path, _SPLIT_KEYS)
            cluster = self.name(value, item_path, "cluster")
            self.known_cluster(cluster, item_path + ("cluster",), cluster_names)
            weight = self.get(value, item_path, "weight", "integer", required=True)
            if weight is not None and not 0 <= weight <= 1_000_000:
                self.error(item_path + ("weight",), _range_message((0, 1_000_000), weight))
                weight = None
            if cluster is not None and any(t.cluster == cluster for t in targets):
                self.error(item_path + ("cluster",), f"duplicate split cluster '{cluster}'")
            elif cluster is not None and weight is not None:
                targets.append(SplitTarget(cluster, weight))
        if targets and not sum(t.weight for t in targets):
            self.error(path, "the weights must not all be 0")
        return tuple(targets)

    def route_policy(self, data: dict[str, Any], path: KeyPath,
                     match: RouteMatch | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        sticky = self.get(data, path, "sticky_header", "string")
        if sticky is not None:
            if not _TOKEN.fullmatch(sticky):
                self.error(path + ("sticky_header",), f"invalid header name '{sticky}'")
            elif "split" not in data:
                self.error(path + ("sticky_header",), "only meaningful with split")
            else:
                out["sticky_header"] = sticky.lower().encode("ascii")
        timeout = self.get(data, path, "timeout_ms", "integer")
        if timeout is not None:
            if timeout < 1:
                self.error(path + ("timeout_ms",), _range_message((1, None), timeout))
            else:
                out["timeout_ms"] = timeout
        retries = self.retries(data, path)
        if retries is not None:
            out["retries"] = retries
        for key, reserved in (("request_headers", _RESERVED_REQUEST_HEADERS),
                              ("response_headers", _RESERVED_RESPONSE_HEADERS)):
            added = self.header_table(data, path, key + "_add", reserved)
            removed = self.header_names(data, path, key + "_remove", reserved)
            if added:
                out[key + "_add"] = added
            if removed:
                out[key + "_remove"] = removed
        rewrite = self.get(data, path, "prefix_rewrite", "string")
        if rewrite is not None:
            if match is not None and match.path_prefix is None:
                self.error(path + ("prefix_rewrite",), "needs match.path_prefix")
            elif not rewrite.startswith("/") or not _VISIBLE_ASCII.fullmatch(rewrite):
                self.error(path + ("prefix_rewrite",),
                           "must start with '/' and be printable ASCII without spaces")
            else:
                out["prefix_rewrite"] = rewrite.encode("ascii")
        model = self.get(data, path, "model", "string")
        if model is not None:
            if not model or not _VISIBLE_ASCII.fullmatch(model):
                self.error(path + ("model",), "must be non-empty printable ASCII without spaces")
            else:
                out["model"] = model.encode("ascii")
        return out

    def retries(self, data: dict[str, Any], path: KeyPath) -> RetryPolicy | None:
        found = self.subtable(data, path, "retries", RetryPolicy)
        if found is None:
            return None
        table, path = found
        values: dict[str, Any] = self.scalars(RetryPolicy, table, path)
        if "on" in table:
            on: list[str] = []
            for item_path, cond in self.string_list(table, path, "on"):
                if cond not in RETRY_ON:
                    self.error(item_path, f"unknown retry condition '{cond}' "
                                          f"(allowed: {', '.join(RETRY_ON)})")
                elif cond not in on:
                    on.append(cond)
            values["on"] = tuple(on)
        return RetryPolicy(**values)

    def header_table(self, data: dict[str, Any], path: KeyPath, key: str,
                     reserved: frozenset[str]) -> tuple[tuple[bytes, bytes], ...]:
        table = self.get(data, path, key, "table")
        if table is None:
            return ()
        path += (key,)
        out = []
        for name, value in table.items():
            item_path = path + (name,)
            if not _TOKEN.fullmatch(name):
                self.error(item_path, f"invalid header name '{name}': must be an HTTP token")
            elif name.lower() in reserved:
                self.error(item_path, f"header '{name.lower()}' is managed by the proxy")
            elif not isinstance(value, str):
                self.error(item_path, f"expected string, got {_kind(value)}")
            elif not _HEADER_VALUE.fullmatch(value) or "\t" in value.strip(" \t"):
                self.error(item_path, "header value must not contain control characters")
            else:
                out.append((name.lower().encode("ascii"), value.strip(" \t").encode("utf-8")))
        return tuple(out)

    def header_names(self, data: dict[str, Any], path: KeyPath, key: str,
                     reserved: frozenset[str]) -> tuple[bytes, ...]:
        out: list[bytes] = []
        for item_path, name in self.string_list(data, path, key):
            if not _TOKEN.fullmatch(name):
                self.error(item_path, f"invalid header name '{name}': must be an HTTP token")
            elif name.lower() in reserved:
                self.error(item_path, f"header '{name.lower()}' is managed by the proxy")
            elif name.lower().encode("ascii") not in out:
                out.append(name.lower().encode("ascii"))
        return tuple(out)

    # -- kernel fast paths -------------------------------------------------------------

    def kernel(self, data: dict[str, Any], listeners: tuple[ListenerConfig, ...]) -> KernelConfig:
        table = self.section(data, "kernel", _KERNEL_KEYS)
        if table is None:
            return KernelConfig()
        path: KeyPath = ("kernel",)
        extra = self.scalars(KernelConfig, table, path)
        syn_ports = self.port_list(table, path, "syn_ports")
        if "syn_ports" not in table and extra.get("syn_rate_per_source"):
            syn_ports = tuple(sorted({listener.port for listener in listeners}))
        return KernelConfig(
            interfaces=self.interfaces(table, path),
            xdp_mode=self.choice(table, path, "xdp_mode", XDP_MODES),
            deny_cidrs=self.cidrs(table, path),
            syn_ports=syn_ports,
            classes=self.traffic_classes(table, path),
            **extra,
        )

    def string_list(self, data: dict[str, Any], path: KeyPath, key: str) -> list[tuple[KeyPath, str]]:
        values = self.get(data, path, key, "array") or []
        items = []
        for index, value in enumerate(values):
            if isinstance(value, str):
                items.append((path + (key, index), value))
            else:
                self.error(path + (key, index), f"expected string, got {_kind(value)}")
        return items

    def interfaces(self, data: dict[str, Any], path: KeyPath) -> tuple[str, ...]:
        names: list[str] = []
        for item_path, name in self.string_list(data, path, "interfaces"):
            if not _IFNAME.fullmatch(name):
                self.error(item_path, f"invalid interface name '{name}'")
            elif name in names:
                self.error(item_path, f"duplicate interface '{name}'")
            else:
                names.append(name)
        return tuple(names)

    def cidrs(self, data: dict[str, Any], path: KeyPath) -> tuple[str, ...]:
        networks: list[str] = []
        for item_path, text in self.string_list(data, path, "deny_cidrs"):
            try:
                network = ipaddress.ip_network(text.strip(), strict=True)
            except ValueError as exc:
                hint = ""
                try:
                    hint = f" (did you mean '{ipaddress.ip_network(text.strip(), strict=False)}'?)"
                except ValueError:
                    pass
                self.error(item_path, f"invalid CIDR '{text}': {exc}{hint}")
                continue
            if str(network) not in networks:
                networks.append(str(network))
        return tuple(networks)

    def port_list(self, data: dict[str, Any], path: KeyPath, key: str) -> tuple[int, ...]:
        values = self.get(data, path, key, "array") or []
        ports: list[int] = []
        for index, value in enumerate(values):
            if not isinstance(value, int) or isinstance(value, bool):
                self.error(path + (key, index), f"expected integer, got {_kind(value)}")
            elif not 1 <= value <= 65535:
                self.error(path + (key, index), f"port must be between 1 and 65535, got {value}")
            elif value not in ports:
                ports.append(value)
        return tuple(ports)

    def traffic_classes(self, data: dict[str, Any], path: KeyPath) -> tuple[TrafficClass, ...]:
        if "classes" not in data:
            return ()
        values = self.get(data, path, "classes", "array")
        if values is None:
            return ()
        path += ("classes",)
        if len(values) > MAX_TRAFFIC_CLASSES:
            self.error(path, f"at most {MAX_TRAFFIC_CLASSES} classes, got {len(values)}")
        classes: list[TrafficClass] = []
        names: list[tuple[KeyPath, str]] = []
        port_owner: dict[int, str] = {}
        sig_owner: dict[str, str] = {}
        for index, item in enumerate(values):
            item_path = path + (index,)
            if not isinstance(item, dict):
                self.error(item_path, f"expected table, got {_kind(item)}")
                continue
            before = len(self.problems)
            self.check_keys(item, item_path, _CLASS_KEYS)
            name = self.name(item, item_path)
            if name is not None:
                names.append((item_path + ("name",), name))
            ports = self.port_list(item, item_path, "ports")
            for port in ports:
                if port in port_owner:
                    self.error(item_path + ("ports",),
                               f"port {port} is already in class '{port_owner[port]}'")
                port_owner.setdefault(port, name or "?")
            payload: list[str] = []
            for sig_path, sig in self.string_list(item, item_path, "payload"):
                if sig not in PAYLOAD_SIGNATURES:
                    allowed = ", ".join(PAYLOAD_SIGNATURES)
                    self.error(sig_path, f"unknown payload signature '{sig}' (allowed: {allowed})")
                elif sig in sig_owner:
                    self.error(sig_path, f"signature '{sig}' is already in class '{sig_owner[sig]}'")
                elif sig not in payload:
                    payload.append(sig)
                    sig_owner[sig] = name or "?"
            dscp = self.optional_int(item, item_path, "dscp", 0, 63)
            priority = self.optional_int(item, item_path, "priority", 0, 0xFFFFFFFF)
            if not ports and not payload and len(self.problems) == before:
                self.error(item_path, "a class needs ports or payload to match anything")
            if dscp is None and priority is None and len(self.problems) == before:
                self.error(item_path, "a class needs dscp or priority to mark anything")
            if len(self.problems) == before:
                classes.append(TrafficClass(name, len(classes) + 1, ports, tuple(payload),
                                            dscp, priority))
        self.unique_names(names, "class")
        return tuple(classes)

    def optional_int(self, data: dict[str, Any], path: KeyPath, key: str, lo: int, hi: int):
        value = self.get(data, path, key, "integer")
        if value is not None and not lo <= value <= hi:
            self.error(path + (key,), _range_message((lo, hi), value))
            return None
        return value

    # -- route matching ----------------------------------------------------------------

    def match(self, data: dict[str, Any], path: KeyPath) -> RouteMatch | None:
        if "match" not in data:
            return RouteMatch()
        table = self.get(data, path, "match", "table")
        if table is None:
            return None
        path += ("match",)
        self.check_keys(table, path, _MATCH_KEYS)
        before = len(self.problems)
        headers = self.match_headers(table, path)
        fields = {
            "path": self.match_path(table, path, "path"),
            "path_prefix": self.match_path(table, path, "path_prefix"),
            "path_regex": self.match_regex(table, path, "path_regex"),
            "method": self.match_methods(table, path),
            "host": self.match_host(table, path),
            "headers": headers and tuple((n, v) for n, kind, v in headers if kind == "exact"),
            "header_rules": headers and tuple(h for h in headers if h[1] != "exact"),
            "query": self.match_query(table, path),
            "grpc_service": self.match_grpc(table, path, "grpc_service"),
            "grpc_method": self.match_grpc(table, path, "grpc_method"),
            "intent": self.match_label(data, table, path, "intent"),
            "intent_domain": self.match_label(data, table, path, "intent_domain"),
        }
        if len(self.problems) != before:
            return None
        return RouteMatch(**{key: value for key, value in fields.items() if value is not None})

    def match_label(self, route: dict[str, Any], data: dict[str, Any], path: KeyPath,
                    key: str) -> str | None:
        value = self.get(data, path, key, "string")
        if value is None:
            return None
        if not value:
            self.error(path + (key,), "must not be empty")
            return None
        if "semantic" not in self.data:
            self.error(path + (key,), f"matching on {key} needs a [semantic] section")
            return None
        return value

    def match_grpc(self, data: dict[str, Any], path: KeyPath, key: str) -> bytes | None:
        value = self.get(data, path, key, "string")
        if value is None:
            return None
        if not value or "/" in value or not _VISIBLE_ASCII.fullmatch(value):
            self.error(path + (key,), f"invalid {key} '{value}'")
            return None
        return value.encode()

    def match_path(self, data: dict[str, Any], path: KeyPath, key: str) -> bytes | None:
        value = self.get(data, path, key, "string")
        if value is None:
            return None
        if not value.startswith("/"):
            self.error(path + (key,), "must start with '/'")
        elif not _VISIBLE_ASCII.fullmatch(value):
            self.error(path + (key,), "must be printable ASCII without spaces (percent-encode)")
        return value.encode("ascii", "replace")

    def match_methods(self, data: dict[str, Any], path: KeyPath) -> tuple[bytes, ...] | None:
        if "method" not in data:
            return None
        value = data["method"]
        path += ("method",)
        if isinstance(value, str):
            items = [(path, value)]
        elif isinstance(value, list):
            if not value:
                self.error(path, "must not be empty")
            items = [(path + (index,), item) for index, item in enumerate(value)]
        else:
            self.error(path, f"expected string or array, got {_kind(value)}")
            return None
        methods: list[bytes] = []
        for item_path, item in items:
            if not isinstance(item, str):
                self.error(item_path, f"expected string, got {_kind(item)}")
            elif not _TOKEN.fullmatch(item):
                self.error(item_path, f"invalid method '{item}': must be an HTTP token")
            elif (method := item.upper().encode("ascii")) not in methods:
                methods.append(method)
        return tuple(methods)

    def match_regex(self, data: dict[str, Any], path: KeyPath, key: str) -> bytes | None:
        value = self.get(data, path, key, "string")
        if value is None:
            return None
        # RE2, as the route table compiles it: linear time on the request's bytes.
        try:
            safe_regex.compile_bytes(value.encode("utf-8"))
        except safe_regex.error as exc:
            self.error(path + (key,), "invalid regular expression: "
                       + safe_regex.problem(value, exc))
            return None
        return value.encode("utf-8")

    def match_query(self, data: dict[str, Any], path: KeyPath
                    ) -> tuple[tuple[bytes, bytes | None], ...] | None:
        table = self.get(data, path, "query", "table")
        if table is None:
            return None
        path += ("query",)
        out = []
        for name, value in table.items():
            item_path = path + (name,)
            if not name or not _VISIBLE_ASCII.fullmatch(name):
                self.error(item_path, f"invalid query parameter name '{name}'")
            elif value is True:
                out.append((name.encode("utf-8"), None))
            elif isinstance(value, str):
                out.append((name.encode("utf-8"), value.encode("utf-8")))
            else:
                self.error(item_path, f"expected string or true, got {_kind(value)}")
        return tuple(out)

    def match_host(self, data: dict[str, Any], path: KeyPath) -> bytes | None:
        value = self.get(data, path, "host", "string")
        if value is None:
            return None
        if value == "*":
            return None
        wild = _WILDCARD_HOST.fullmatch(value)
        # A trailing dot names the same host, fully qualified: requests are matched
        # without theirs (routing/table.py host_without_port), so routes are too.
        if wild is not None and HOSTNAME.fullmatch(wild.group(1)):
            return value.lower().rstrip(".").encode("ascii")
        if not (HOSTNAME.fullmatch(value) or _BRACKETED_V6.fullmatch(value)):
            hint = ": must not include a port" if _HOST_WITH_PORT.fullmatch(value) else ""
            self.error(path + ("host",), f"invalid host '{value}'{hint}")
        return value.lower().removesuffix(".").encode("ascii", "replace")

    def match_headers(
        self, data: dict[str, Any], path: KeyPath
    ) -> tuple[tuple[bytes, str, bytes], ...] | None:
        """(name, kind, value): a string value is exact; a table gives
        {exact = "..."}, {regex = "..."} or {present = true|false}."""
        table = self.get(data, path, "headers", "table")
        if table is None:
            return None
        path += ("headers",)
        headers: list[tuple[bytes, str, bytes]] = []
        for name, value in table.items():
            item_path = path + (name,)
            if not _TOKEN.fullmatch(name):
                self.error(item_path, f"invalid header name '{name}': must be an HTTP token")
                continue
            if isinstance(value, dict):
                rule = self.header_rule(value, item_path)
                if rule is None:
                    continue
                kind, value = rule
            elif isinstance(value, str):
                kind = "exact"
            else:
                self.error(item_path, f"expected string, got {_kind(value)}")
                continue
            if kind == "exact" and not _HEADER_VALUE.fullmatch(value):
                self.error(item_path, "header value must not contain control characters")
                continue
            key = name.lower().encode("ascii")
            if any(key == existing for existing, _, _ in headers):
                self.error(item_path, f"duplicate header '{name.lower()}'")
                continue
            stored = value.strip(" \t") if kind == "exact" else value
            headers.append((key, kind, stored.encode("utf-8")))
        return tuple(headers)

    def header_rule(self, table: dict[str, Any], path: KeyPath) -> tuple[str, str] | None:
        self.check_keys(table, path, _HEADER_RULE_KEYS)
        given = [key for key in _HEADER_RULE_KEYS if key in table]
        if len(given) != 1:
            self.error(path, "give exactly one of exact, regex, present")
            return None
        key = given[0]
        if key == "present":
            value = self.get(table, path, key, "boolean")
            return None if value is None else ("present" if value else "absent", "")
        value = self.get(table, path, key, "string")
        if value is None:
            return None
        if key == "regex" and self.match_regex(table, path, key) is None:
            return None
        return key, value
