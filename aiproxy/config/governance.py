"""Config sections of the governance layer: [auth], [policy], [audit], [guard], [redact].

Kept apart from loader.py so the other sections' code stays as it is: the loader's
checker calls governance_sections() and gets the Config fields back. Paths are
resolved against the config file's directory, as the loader does for TLS files.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import safe_regex
from .errors import ConfigError, Problem
from .files import writable_file_problem
from .locate import KeyPath, Locator
from .locate import format_path as _format_path

if TYPE_CHECKING:
    from .loader import _Checker

GOVERNANCE_KEYS = ("auth", "policy", "audit", "guard", "redact")

JWT_ALGORITHMS = ("HS256", "HS384", "HS512", "RS256", "RS384", "RS512", "PS256", "PS384",
                  "PS512", "ES256", "ES384", "ES512", "EdDSA")
# "sha256$<salt hex>$<hex of sha256(salt + key)>", as `aiproxy auth hash-key` prints.
KEY_HASH = re.compile(r"sha256\$([0-9a-f]{16,128})\$([0-9a-f]{64})")
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: str
    subject: str
    salt: bytes
    digest: bytes
    roles: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class JwtConfig:
    jwks_file: str
    algorithms: tuple[str, ...]
    issuer: str | None = None
    audience: tuple[str, ...] = ()
    leeway_s: int = 30
    subject_claim: str = "sub"
    roles_claim: str = "roles"
    require: tuple[str, ...] = ("exp",)
    cache_ttl_s: int = 300  # verified tokens kept (never past their exp); 0: no cache
    cache_size: int = 10_000


@dataclass(frozen=True, slots=True)
class AuthConfig:
    required: bool = True
    realm: str = "aiproxy"
    api_key_header: bytes = b"x-api-key"
    api_keys: tuple[ApiKey, ...] = ()
    key_file: str | None = None
    jwt: JwtConfig | None = None
    mtls: bool = False
    mtls_roles: tuple[str, ...] = ()
    upstream_secret: bytes | None = None  # signs x-aiproxy-identity for the upstream


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    files: tuple[str, ...]
    dry_run: bool = False
    poll_ms: int = 100
    inspect_bytes: int = 1024 * 1024


AUDIT_FSYNC = ("always", "interval", "never")


@dataclass(frozen=True, slots=True)
class AuditConfig:
    path: str
    fsync: str = "interval"
    fsync_interval_ms: int = 100
    rotate_bytes: int = 100 * 1024 * 1024
    rotate_interval_s: int = 0  # 0: no time-based rotation


@dataclass(frozen=True, slots=True)
class GuardRule:
    id: str
    action: str  # "block" | "flag"
    keywords: tuple[str, ...] = ()
    regexes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GuardConfig:
    rules: tuple[GuardRule, ...]
    inspect_bytes: int = 1024 * 1024


REDACT_TYPES = ("email", "phone", "card", "iban", "prc_id", "us_ssn")


@dataclass(frozen=True, slots=True)
class RedactConfig:
    types: tuple[str, ...] = REDACT_TYPES
    # "": a response with no Content-Type (its body tells JSON, an event stream or
    # text). A leak is worse than a rewrite: text/html is text too.
    content_types: tuple[str, ...] = ("application/json", "text/event-stream", "text/plain",
                                      "application/x-ndjson", "application/jsonl",
                                      "text/html", "")


def _dir(checker: _Checker) -> str:
    return os.path.dirname(os.path.abspath(checker.filename))


def _strings(checker: _Checker, data: dict, path: KeyPath, key: str,
             choices: tuple[str, ...] | None = None, empty: bool = False
             ) -> tuple[str, ...] | None:
    if key not in data:
        return None
    out = []
    for item_path, value in checker.string_list(data, path, key):
        if choices is not None and value not in choices:
            checker.error(item_path, f"unknown value '{value}' (one of: {', '.join(choices)})")
        elif value == "" and not empty:
            checker.error(item_path, "must not be empty")
        else:
            out.append(value)
    return tuple(out)


def _file(checker: _Checker, data: dict, path: KeyPath, key: str,
          required: bool = False) -> str | None:
    value = checker.get(data, path, key, "string", required=required)
    if value is None:
        return None
    full = os.path.join(_dir(checker), value)
    if not os.path.isfile(full):
        checker.error(path + (key,), f"no such file '{value}'")
        return None
    return full


def _int(checker: _Checker, data: dict, path: KeyPath, key: str, default: int, lo: int,
         hi: int | None = None) -> int:
    value = checker.get(data, path, key, "integer")
    if value is None:
        return default
    if value < lo or (hi is not None and value > hi):
        checker.error(path + (key,), f"must be between {lo} and {hi}, got {value}"
                      if hi is not None else f"must be >= {lo}, got {value}")
        return default
    return value


def parse_api_key(entry: Any, path: KeyPath, error: Any) -> ApiKey | None:
    """One `{id, subject, hash, roles}` table; problems go to error(path, message)."""
    if not isinstance(entry, dict):
        error(path, "expected table")
        return None
    for key in entry:
        if key not in ("id", "subject", "hash", "roles"):
            error(path + (key,), "unknown key (expected id, subject, hash, roles)")
    ok = True
    for key in ("id", "subject", "hash"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            error(path + (key,), "missing required key" if key not in entry
                  else "expected a non-empty string")
            ok = False
    roles = entry.get("roles", [])
    if not isinstance(roles, list) or not all(isinstance(r, str) and r for r in roles):
        error(path + ("roles",), "expected an array of non-empty strings")
        ok = False
    if not ok:
        return None
    m = KEY_HASH.fullmatch(entry["hash"])
    if m is None:
        error(path + ("hash",), "expected sha256$SALT$HEX (see `aiproxy auth hash-key`)")
        return None
    return ApiKey(entry["id"], entry["subject"], bytes.fromhex(m.group(1)),
                  bytes.fromhex(m.group(2)), tuple(roles))


def load_key_file(path: str) -> tuple[ApiKey, ...]:
    """The `[[keys]]` of an API key file; ConfigError naming FILE:LINE on problems."""
    from .loader import read_config_text, syntax_problem

    text = read_config_text(path)  # ConfigError: FILE: cannot read, or FILE:LINE: not UTF-8
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([syntax_problem(path, text, exc)]) from None
    locator = Locator(text)
    problems: list[Problem] = []

    def error(p: KeyPath, message: str) -> None:
        problems.append(Problem(path, locator.line(p), _format_path(p), message))

    for key in data:
        if key != "keys":
            error((key,), "unknown key (expected [[keys]])")
    entries = data.get("keys", [])
    keys = []
    if not isinstance(entries, list):
        error(("keys",), "expected array of tables")
        entries = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        key = parse_api_key(entry, ("keys", i), error)
        if key is not None:
            if key.id in seen:
                error(("keys", i, "id"), f"duplicate key id '{key.id}'")
            seen.add(key.id)
            keys.append(key)
    if problems:
        raise ConfigError(problems)
    return tuple(keys)


def _auth(checker: _Checker, data: dict, listeners: Any) -> AuthConfig | None:
    table = checker.section(data, "auth", ("required", "realm", "api_key_header", "api_keys",
                                            "key_file", "jwt", "mtls", "upstream_identity"))
    if table is None:
        return None
    path: KeyPath = ("auth",)
    values: dict[str, Any] = {}
    before = len(checker.problems)
    required = checker.get(table, path, "required", "boolean")
    if required is not None:
        values["required"] = required
    realm = checker.get(table, path, "realm", "string")
    if realm is not None:
        if not re.fullmatch(r"[\x20-\x7e]*", realm) or '"' in realm or "\\" in realm:
            checker.error(path + ("realm",), "must be printable ASCII without quotes")
        else:
            values["realm"] = realm
    header = checker.get(table, path, "api_key_header", "string")
    if header is not None:
        if not _HEADER_NAME.fullmatch(header):
            checker.error(path + ("api_key_header",), f"invalid header name '{header}'")
        else:
            values["api_key_header"] = header.lower().encode()
    keys = []
    seen: set[str] = set()
    for item_path, entry in _table_items(checker, table, path, "api_keys"):
        key = parse_api_key(entry, item_path, checker.error)
        if key is not None:
            if key.id in seen:
                checker.error(item_path + ("id",), f"duplicate key id '{key.id}'")
            seen.add(key.id)
            keys.append(key)
    values["api_keys"] = tuple(keys)
    key_file = _file(checker, table, path, "key_file")
    if key_file is not None:
        try:
            load_key_file(key_file)
        except ConfigError as exc:
            checker.problems.extend(exc.problems)
        values["key_file"] = key_file
    if "jwt" in table:
        values["jwt"] = _jwt(checker, table, path)
    if "mtls" in table:
        mtls = checker.get(table, path, "mtls", "table")
        if mtls is not None:
            mpath = path + ("mtls",)
            checker.check_keys(mtls, mpath, ("enabled", "roles"))
            enabled = checker.get(mtls, mpath, "enabled", "boolean")
            values["mtls"] = True if enabled is None else enabled
            values["mtls_roles"] = _strings(checker, mtls, mpath, "roles") or ()
            tls_ca = any(lst.tls is not None and lst.tls.ca for lst in listeners)
            if values["mtls"] and not tls_ca:
                checker.error(mpath, "needs a listener with tls.ca (client certificates)")
    if "upstream_identity" in table:
        up = checker.get(table, path, "upstream_identity", "table")
        if up is not None:
            upath = path + ("upstream_identity",)
            checker.check_keys(up, upath, ("secret", "secret_file"))
            secret = checker.get(up, upath, "secret", "string")
            secret_file = _file(checker, up, upath, "secret_file")
            if secret_file is not None:
                try:
                    with open(secret_file, "rb") as fh:
                        values["upstream_secret"] = fh.read().strip()
                except OSError as exc:
                    checker.error(upath + ("secret_file",),
                                  f"cannot read '{up['secret_file']}': {exc.strerror or exc}")
            elif secret:
                values["upstream_secret"] = secret.encode()
            elif "secret" not in up and "secret_file" not in up:
                checker.error(upath, "needs secret or secret_file")
            elif secret == "":
                checker.error(upath + ("secret",), "must not be empty")
            if values.get("upstream_secret") is not None and len(values["upstream_secret"]) < 16:
                which = "secret_file" if secret_file is not None else "secret"
                checker.error(upath + (which,), "the secret must be at least 16 bytes")
    if (len(checker.problems) == before and not (
            values.get("api_keys") or key_file or values.get("jwt") or values.get("mtls"))):
        # (Not after a problem in the section: a broken method is still meant as one.)
        checker.error(path, "no authentication method (api_keys, key_file, jwt or mtls)")
    return AuthConfig(**values)


def _table_items(checker: _Checker, table: dict, path: KeyPath,
                 key: str) -> list[tuple[KeyPath, Any]]:
    value = table.get(key, [])
    if not isinstance(value, list):
        checker.error(path + (key,), "expected array of tables")
        return []
    return [(path + (key, i), item) for i, item in enumerate(value)]


def _jwt(checker: _Checker, table: dict, path: KeyPath) -> JwtConfig | None:
    jwt = checker.get(table, path, "jwt", "table")
    if jwt is None:
        return None
    path += ("jwt",)
    checker.check_keys(jwt, path, ("jwks_file", "algorithms", "issuer", "audience", "leeway_s",
                                   "subject_claim", "roles_claim", "require", "cache_ttl_s",
                                   "cache_size"))
    jwks = _file(checker, jwt, path, "jwks_file", required=True)
    algorithms = _strings(checker, jwt, path, "algorithms", JWT_ALGORITHMS)
    if not algorithms:
        checker.error(path + ("algorithms",), "required: the algorithms tokens may use "
                      "(an explicit allow-list; 'none' is never accepted)")
    families = {a[:2] for a in algorithms or ()}
    if "HS" in families and len(families) > 1:
        # A shared secret and public keys in one verifier is how key confusion happens.
        checker.error(path + ("algorithms",), "HS* cannot be mixed with public-key algorithms")
    issuer = checker.get(jwt, path, "issuer", "string")
    audience: tuple[str, ...] = ()
    if "audience" in jwt:
        aud = jwt["audience"]
        if isinstance(aud, str) and aud:
            audience = (aud,)
        else:
            audience = _strings(checker, jwt, path, "audience") or ()
    require = _strings(checker, jwt, path, "require")
    for claim in ("subject_claim", "roles_claim"):
        if jwt.get(claim) == "":
            checker.error(path + (claim,), "must not be empty")
    if jwks is not None:
        from aiproxy.governance.auth import read_jwks

        try:
            keys, _, skipped = read_jwks(jwks)
        except (OSError, ValueError) as exc:
            checker.error(path + ("jwks_file",), f"cannot load the JWKS: {exc}")
        else:
            if not keys:
                checker.error(path + ("jwks_file",), "no usable key in the JWKS"
                              + (f" ({'; '.join(skipped)})" if skipped else ""))
    if jwks is None or not algorithms:
        return None
    return JwtConfig(
        jwks_file=jwks, algorithms=algorithms, issuer=issuer, audience=audience,
        leeway_s=_int(checker, jwt, path, "leeway_s", 30, 0, 3600),
        subject_claim=checker.get(jwt, path, "subject_claim", "string") or "sub",
        roles_claim=checker.get(jwt, path, "roles_claim", "string") or "roles",
        require=("exp",) if require is None else require,
        cache_ttl_s=_int(checker, jwt, path, "cache_ttl_s", 300, 0, 86_400),
        cache_size=_int(checker, jwt, path, "cache_size", 10_000, 0, 1_000_000))


def _policy(checker: _Checker, data: dict) -> PolicyConfig | None:
    table = checker.section(data, "policy", ("files", "dry_run", "poll_ms", "inspect_bytes"))
    if table is None:
        return None
    path: KeyPath = ("policy",)
    files = []
    for item_path, name in checker.string_list(table, path, "files"):
        full = os.path.join(_dir(checker), name)
        if not os.path.isfile(full):
            checker.error(item_path, f"no such file '{name}'")
        files.append(full)
    if not files:
        checker.error(path + ("files",), "needs at least one policy file")
    elif all(os.path.isfile(f) for f in files):
        from aiproxy.governance.policy import load_policy_files

        try:
            load_policy_files(files)
        except ConfigError as exc:
            checker.problems.extend(exc.problems)
    dry_run = checker.get(table, path, "dry_run", "boolean")
    return PolicyConfig(files=tuple(files), dry_run=bool(dry_run),
                        poll_ms=_int(checker, table, path, "poll_ms", 100, 10, 10_000),
                        inspect_bytes=_int(checker, table, path, "inspect_bytes", 1024 * 1024,
                                           1024, 64 * 1024 * 1024))


def _audit(checker: _Checker, data: dict) -> AuditConfig | None:
    table = checker.section(data, "audit", ("path", "fsync", "fsync_interval_ms", "rotate_bytes",
                                             "rotate_interval_s"))
    if table is None:
        return None
    path: KeyPath = ("audit",)
    name = checker.get(table, path, "path", "string", required=True)
    fsync = checker.get(table, path, "fsync", "string")
    fsync = "interval" if fsync is None else fsync  # "" is a mistake, not the default
    if fsync not in AUDIT_FSYNC:
        checker.error(path + ("fsync",), f"one of {', '.join(AUDIT_FSYNC)}, got '{fsync}'")
        fsync = "interval"
    full = os.path.join(_dir(checker), name) if name else ""
    if name == "":
        checker.error(path + ("path",), "must not be empty")
    elif name is not None:
        problem = writable_file_problem(full)
        if problem:
            checker.error(path + ("path",), problem)
    return AuditConfig(
        path=full, fsync=fsync,
        fsync_interval_ms=_int(checker, table, path, "fsync_interval_ms", 100, 1, 60_000),
        rotate_bytes=_int(checker, table, path, "rotate_bytes", 100 * 1024 * 1024, 4096),
        rotate_interval_s=_int(checker, table, path, "rotate_interval_s", 0, 0))


def _guard(checker: _Checker, data: dict) -> GuardConfig | None:
    table = checker.section(data, "guard", ("rules", "inspect_bytes"))
    if table is None:
        return None
    path: KeyPath = ("guard",)
    rules = []
    seen: set[str] = set()
    for item_path, entry in _table_items(checker, table, path, "rules"):
        if not isinstance(entry, dict):
            checker.error(item_path, "expected table")
            continue
        checker.check_keys(entry, item_path, ("id", "action", "keywords", "regexes"))
        rid = checker.name(entry, item_path, "id")
        action = checker.get(entry, item_path, "action", "string")
        action = "block" if action is None else action  # "" is a mistake, not the default
        if action not in ("block", "flag"):
            checker.error(item_path + ("action",), f"one of block, flag, got '{action}'")
        keywords = _strings(checker, entry, item_path, "keywords") or ()
        regexes = _strings(checker, entry, item_path, "regexes") or ()
        for i, rx in enumerate(regexes):
            try:
                safe_regex.compile_text(rx)  # as the guard compiles it: RE2, linear time
            except safe_regex.error as exc:
                checker.error(item_path + ("regexes", i),
                              "invalid regex: " + safe_regex.problem(rx, exc))
        if not keywords and not regexes:
            checker.error(item_path, "needs keywords or regexes")
        if rid is not None:
            if rid in seen:
                checker.error(item_path + ("id",), f"duplicate rule id '{rid}'")
            seen.add(rid)
            rules.append(GuardRule(rid, action, keywords, regexes))
    return GuardConfig(tuple(rules), _int(checker, table, path, "inspect_bytes", 1024 * 1024,
                                          1024, 64 * 1024 * 1024))


def _redact(checker: _Checker, data: dict) -> RedactConfig | None:
    table = checker.section(data, "redact", ("types", "content_types"))
    if table is None:
        return None
    path: KeyPath = ("redact",)
    types = _strings(checker, table, path, "types", REDACT_TYPES)
    ctypes = _strings(checker, table, path, "content_types", empty=True)  # "": none sent
    values: dict[str, Any] = {}
    if types is not None:
        values["types"] = types
    if ctypes is not None:
        values["content_types"] = tuple(c.lower() for c in ctypes)
    return RedactConfig(**values)


def governance_sections(checker: _Checker, data: dict, listeners: Any) -> dict[str, Any]:
    """The Config fields of the governance sections (None where not configured)."""
    return {"auth": _auth(checker, data, listeners), "policy": _policy(checker, data),
            "audit": _audit(checker, data), "guard": _guard(checker, data),
            "redact": _redact(checker, data)}
