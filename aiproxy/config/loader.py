"""Load a TOML file into a validated :class:`Config`, collecting every problem found."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
from collections.abc import Collection
from datetime import date, datetime, time
from typing import Any

from .address import HOSTNAME, parse_address
from .errors import ConfigError, Problem
from .locate import KeyPath, Locator
from .locate import format_path as _format_path
from .schema import (
    AccessLogConfig,
    AdminConfig,
    ClusterConfig,
    Config,
    Endpoint,
    HttpConfig,
    ListenerConfig,
    RouteConfig,
    RouteMatch,
    SemanticConfig,
    ServerConfig,
    TlsConfig,
)

PROTOCOLS = ("http1", "h2c", "h2")
UPSTREAM_PROTOCOLS = ("http1", "h2")
BALANCERS = ("round_robin",)

_TOP_KEYS = ("server", "http", "listeners", "admin", "access_log", "clusters", "routes",
             "semantic")
_LISTENER_KEYS = ("name", "address", "protocols", "backlog", "tls")
_TLS_KEYS = ("cert", "key", "ca")
_ENDPOINT_KEYS = ("address", "weight")
_ROUTE_KEYS = ("name", "cluster", "match")
_MATCH_KEYS = ("path", "path_prefix", "method", "host", "headers", "grpc_service",
               "grpc_method", "intent", "intent_domain")

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")
_HEADER_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")
_BRACKETED_V6 = re.compile(r"\[[0-9A-Fa-f:.]+\]")
_HOST_WITH_PORT = re.compile(r".+:[0-9]+")
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
    try:
        with open(filename, "rb") as fh:
            text = fh.read().decode("utf-8")
    except OSError as exc:
        raise ConfigError(
            [Problem(filename, 0, "", f"cannot read: {exc.strerror or exc}")]
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([Problem(filename, 0, "", f"cannot read: not UTF-8 ({exc})")]) from None
    return load_config_text(text, filename)


def load_config_text(text: str, filename: str) -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([_syntax_problem(filename, text, exc)]) from None
    checker = _Checker(filename, Locator(text))
    config = checker.config(data)
    if checker.problems:
        raise ConfigError(sorted(checker.problems, key=lambda problem: problem.line))
    return config


def _syntax_problem(filename: str, text: str, exc: tomllib.TOMLDecodeError) -> Problem:
    message = str(exc)
    position = _SYNTAX_POSITION.search(message)
    if position is None:
        line = 1
    else:
        message = message[: position.start()]
        line = int(position.group(1)) if position.group(1) else len(text.splitlines()) or 1
    return Problem(filename, line, "", f"syntax: {message}")


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

    def error(self, path: KeyPath, message: str) -> None:
        line = self.locator.line(path)
        self.problems.append(Problem(self.filename, line, _format_path(path), message))

    # -- generic readers ---------------------------------------------------------------

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
        server = self.section(data, "server", _field_names(ServerConfig))
        http = self.section(data, "http", _field_names(HttpConfig))
        listeners = self.listeners(data)
        clusters, cluster_names = self.clusters(data)
        return Config(
            source=self.filename,
            server=ServerConfig(**self.scalars(ServerConfig, server or {}, ("server",))),
            http=HttpConfig(**self.scalars(HttpConfig, http or {}, ("http",))),
            listeners=listeners,
            admin=self.admin(data, listeners),
            access_log=self.access_log(data),
            semantic=self.semantic(data),
            clusters=clusters,
            routes=self.routes(data, cluster_names),
        )

    def listeners(self, data: dict[str, Any]) -> tuple[ListenerConfig, ...]:
        items = self.table_array(data, "listeners")
        if items is None:
            return ()
        if not data.get("listeners"):
            self.error(("listeners",), "at least one listener is required")
        listeners = []
        names: list[tuple[KeyPath, str]] = []
        bound: dict[tuple[str, int], str] = {}
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
                bound.setdefault(key, name or "?")
            protocols = self.protocols(item, path)
            tls = self.tls(item, path)
            if tls is None and "h2" in protocols:
                self.error(path + ("protocols",), "'h2' needs TLS: add tls = { cert, key }"
                           " (use 'h2c' for cleartext HTTP/2)")
            extra = self.scalars(ListenerConfig, item, path)
            if len(self.problems) == before:
                listeners.append(ListenerConfig(name, *address, protocols=protocols, tls=tls,
                                                **extra))
        self.unique_names(names, "listener")
        return tuple(listeners)

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
            elif value not in result:
                result.append(value)
        return tuple(result)

    def tls(self, data: dict[str, Any], path: KeyPath) -> TlsConfig | None:
        if "tls" not in data:
            return None
        table = self.get(data, path, "tls", "table")
        if table is None:
            return None
        path += ("tls",)
        self.check_keys(table, path, _TLS_KEYS)
        files = {}
        for key in _TLS_KEYS:
            if key not in table:
                if key != "ca":
                    self.error(path + (key,), "missing required key")
                continue
            value = self.get(table, path, key, "string")
            if value is None:
                continue
            full = os.path.join(os.path.dirname(os.path.abspath(self.filename)), value)
            if not os.path.isfile(full):
                self.error(path + (key,), f"no such file '{value}'")
            files[key] = full
        if len(files) < 2 or "cert" not in files or "key" not in files:
            return None
        return TlsConfig(**files)

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
        address = self.address(table, ("admin",))
        if address is None:
            return None
        for listener in listeners:
            if (listener.host.lower(), listener.port) == (address[1].lower(), address[2]):
                self.error(
                    ("admin", "address"),
                    f"address '{address[0]}' is already used by listener '{listener.name}'",
                )
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
        return SemanticConfig(**values)

    def access_log(self, data: dict[str, Any]) -> AccessLogConfig:
        table = self.section(data, "access_log", _field_names(AccessLogConfig))
        if table is None:
            return AccessLogConfig()
        path = self.get(table, ("access_log",), "path", "string")
        extra = self.scalars(AccessLogConfig, table, ("access_log",))
        if path is not None and not path:
            self.error(("access_log", "path"), 'must not be empty (use "-" or "off")')
            path = None
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
            if len(self.problems) == before:
                clusters.append(ClusterConfig(name, endpoints, balancer=balancer,
                                              protocol=protocol, **extra))
        self.unique_names(names, "cluster")
        return tuple(clusters), [name for _, name in names]

    def endpoints(self, data: dict[str, Any], path: KeyPath) -> tuple[Endpoint, ...]:
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
        defined = ", ".join(cluster_names) if cluster_names else "none"
        routes = []
        names: list[tuple[KeyPath, str]] = []
        for path, item in self.table_array(data, "routes") or []:
            before = len(self.problems)
            self.check_keys(item, path, _ROUTE_KEYS)
            name = self.name(item, path)
            if name is not None:
                names.append((path + ("name",), name))
            cluster = self.name(item, path, "cluster")
            if cluster is not None and cluster not in cluster_names:
                self.error(path + ("cluster",), f"unknown cluster '{cluster}' (defined: {defined})")
            match = self.match(item, path)
            if len(self.problems) == before:
                routes.append(RouteConfig(name, cluster, match))
        self.unique_names(names, "route")
        return tuple(routes)

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
        fields = {
            "path": self.match_path(table, path, "path"),
            "path_prefix": self.match_path(table, path, "path_prefix"),
            "method": self.match_methods(table, path),
            "host": self.match_host(table, path),
            "headers": self.match_headers(table, path),
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

    def match_host(self, data: dict[str, Any], path: KeyPath) -> bytes | None:
        value = self.get(data, path, "host", "string")
        if value is None:
            return None
        if not (HOSTNAME.fullmatch(value) or _BRACKETED_V6.fullmatch(value)):
            hint = ": must not include a port" if _HOST_WITH_PORT.fullmatch(value) else ""
            self.error(path + ("host",), f"invalid host '{value}'{hint}")
        return value.lower().encode("ascii", "replace")

    def match_headers(
        self, data: dict[str, Any], path: KeyPath
    ) -> tuple[tuple[bytes, bytes], ...] | None:
        table = self.get(data, path, "headers", "table")
        if table is None:
            return None
        path += ("headers",)
        headers: list[tuple[bytes, bytes]] = []
        for name, value in table.items():
            item_path = path + (name,)
            if not _TOKEN.fullmatch(name):
                self.error(item_path, f"invalid header name '{name}': must be an HTTP token")
                continue
            if not isinstance(value, str):
                self.error(item_path, f"expected string, got {_kind(value)}")
                continue
            if not _HEADER_VALUE.fullmatch(value):
                self.error(item_path, "header value must not contain control characters")
                continue
            key = name.lower().encode("ascii")
            if any(key == existing for existing, _ in headers):
                self.error(item_path, f"duplicate header '{name.lower()}'")
                continue
            headers.append((key, value.strip(" \t").encode("utf-8")))
        return tuple(headers)
