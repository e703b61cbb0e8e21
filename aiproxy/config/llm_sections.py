"""Loader for the LLM traffic sections: [llm], [[ratelimits]] and [cache].

Kept apart from loader.py; the functions take its checker (`_Checker`) and report
problems through it with FILE:LINE: key like every other section."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from aiproxy.ratelimit.fields import PRINTABLE

from .schema import RATELIMIT_KEYS, CacheConfig, LlmConfig, RateLimitConfig

if TYPE_CHECKING:
    from .loader import _Checker
    from .locate import KeyPath

TOP_KEYS = ("llm", "ratelimits", "cache")
BACKENDS = ("memory", "redis")
BACKEND_ERRORS = ("open", "closed")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_PATH_TEXT = re.compile(r"[!-~]+")
_FIELDS = {cls: tuple(f for f in cls.__dataclass_fields__) for cls in
           (LlmConfig, RateLimitConfig, CacheConfig)}


def _route_names(data: dict[str, Any]) -> set[str]:
    routes = data.get("routes")
    if not isinstance(routes, list):
        return set()
    return {r["name"] for r in routes if isinstance(r, dict) and isinstance(r.get("name"), str)}


def _routes(ck: _Checker, table: dict[str, Any], path: KeyPath,
            known: set[str]) -> tuple[str, ...]:
    out = []
    for item_path, name in ck.string_list(table, path, "routes"):
        if name not in known:
            ck.error(item_path, f"unknown route '{name}'")
        elif name not in out:
            out.append(name)
    return tuple(out)


def _choice(ck: _Checker, table: dict[str, Any], path: KeyPath, key: str,
            allowed: tuple[str, ...]) -> str | None:
    value = ck.get(table, path, key, "string")
    if value is not None and value not in allowed:
        ck.error(path + (key,), f"must be one of {', '.join(allowed)}, got '{value}'")
        return None
    return value


def _redis_url(ck: _Checker, table: dict[str, Any], path: KeyPath) -> str | None:
    url = ck.get(table, path, "redis_url", "string")
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        ck.error(path + ("redis_url",), "must start with redis://, rediss:// or unix://")
        return None
    return url


def llm(ck: _Checker, data: dict[str, Any]) -> LlmConfig | None:
    table = ck.section(data, "llm", _FIELDS[LlmConfig])
    if table is None:
        return None
    path: KeyPath = ("llm",)
    values: dict[str, Any] = ck.scalars(LlmConfig, table, path)
    header = ck.get(table, path, "tenant_header", "string")
    if header is not None:
        if not _TOKEN.fullmatch(header):
            ck.error(path + ("tenant_header",), f"invalid header name '{header}'")
        else:
            values["tenant_header"] = header.lower().encode("ascii")
    values["routes"] = _routes(ck, table, path, _route_names(data))
    if "api_prefixes" in table:
        values["api_prefixes"] = _api_prefixes(ck, table, path)
    return LlmConfig(**values)


def _api_prefixes(ck: _Checker, table: dict[str, Any], path: KeyPath) -> tuple[str, ...]:
    out: list[str] = []
    items = ck.string_list(table, path, "api_prefixes")
    for item_path, prefix in items:
        if not (prefix.startswith("/") and prefix.endswith("/")):
            ck.error(item_path, f"must start and end with '/', got '{prefix}'")
        elif not _PATH_TEXT.fullmatch(prefix):
            ck.error(item_path, f"must be printable ASCII without spaces (percent-encode "
                                f"others), got {prefix!r}")
        elif "?" in prefix or "#" in prefix:
            ck.error(item_path, f"a path prefix has no query or fragment, got '{prefix}'")
        elif any("*" in s and s != "*" for s in prefix.split("/")):
            ck.error(item_path, f"'*' stands only for a whole path segment, got '{prefix}'")
        elif prefix not in out:
            out.append(prefix)
    if table["api_prefixes"] == []:
        ck.error(path + ("api_prefixes",), "give at least one prefix (default [\"/v1/\"])")
    return tuple(out)


def ratelimits(ck: _Checker, data: dict[str, Any]) -> tuple[RateLimitConfig, ...]:
    known = _route_names(data)
    out = []
    names: list[tuple[KeyPath, str]] = []
    for path, item in ck.table_array(data, "ratelimits") or []:
        before = len(ck.problems)
        ck.check_keys(item, path, _FIELDS[RateLimitConfig])
        name = ck.name(item, path)
        if name is not None and not PRINTABLE.fullmatch(name):
            # It is a String in the RateLimit fields (RFC 9651 3.3.3): ASCII only.
            ck.error(path + ("name",), f"must be printable ASCII, got {name!r}")
            name = None
        if name is not None:
            names.append((path + ("name",), name))
        values: dict[str, Any] = ck.scalars(RateLimitConfig, item, path)
        values["routes"] = _routes(ck, item, path, known)
        if "key" in item:
            key = []
            for item_path, part in ck.string_list(item, path, "key"):
                if part not in RATELIMIT_KEYS:
                    ck.error(item_path, f"unknown key part '{part}' "
                                        f"(allowed: {', '.join(RATELIMIT_KEYS)})")
                elif part not in key:
                    key.append(part)
            values["key"] = tuple(key)
        if "requests_per_second" in item:
            rps = item["requests_per_second"]
            if isinstance(rps, bool) or not isinstance(rps, int | float) or rps < 0:
                ck.error(path + ("requests_per_second",), "expected a number >= 0")
            else:
                values["requests_per_second"] = float(rps)
        for key, allowed in (("backend", BACKENDS), ("on_backend_error", BACKEND_ERRORS)):
            value = _choice(ck, item, path, key, allowed)
            if value is not None:
                values[key] = value
        url = _redis_url(ck, item, path)
        if url is not None:
            values["redis_url"] = url
        if not values.get("requests_per_second") and not values.get("tokens_per_minute"):
            if "requests_per_second" not in item and "tokens_per_minute" not in item:
                ck.error(path, "give requests_per_second or tokens_per_minute (or both)")
            elif len(ck.problems) == before:
                ck.error(path, "requests_per_second and tokens_per_minute cannot both be 0")
        if len(ck.problems) == before and name is not None:
            out.append(RateLimitConfig(name=name, **values))
    ck.unique_names(names, "ratelimit")
    return tuple(out)


def cache(ck: _Checker, data: dict[str, Any]) -> CacheConfig | None:
    table = ck.section(data, "cache", _FIELDS[CacheConfig])
    if table is None:
        return None
    path: KeyPath = ("cache",)
    values: dict[str, Any] = ck.scalars(CacheConfig, table, path)
    values["routes"] = _routes(ck, table, path, _route_names(data))
    if "semantic_threshold" in table:
        t = table["semantic_threshold"]
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= 1:
            ck.error(path + ("semantic_threshold",), "expected a number in (0, 1]")
        elif "semantic" not in data:
            # the threshold compares the [semantic] model's embeddings: without it the
            # setting would do nothing (as matching on an intent needs the model)
            ck.error(path + ("semantic_threshold",), "needs a [semantic] section")
        else:
            values["semantic_threshold"] = float(t)
    backend = _choice(ck, table, path, "backend", BACKENDS)
    if backend is not None:
        values["backend"] = backend
    url = _redis_url(ck, table, path)
    if url is not None:
        values["redis_url"] = url
    return CacheConfig(**values)
