"""`[policy] files = [...]`: may this identity make this request?

A policy file (TOML) has role permissions (RBAC) and rules with conditions (ABAC):

    default = "deny"                       # when no rule matches (the default)
    [roles]
    analyst = ["route:chat", "model:gpt-4o*", "intent:*"]

    [[rules]]
    id = "no-lab-net"
    effect = "deny"
    source_cidrs = ["10.66.0.0/16"]

    [[rules]]
    id = "rbac"
    effect = "allow"
    rbac = true                            # the roles' permissions cover route/model/intent
    methods = ["POST"]
    time = { days = ["mon", "tue", "wed", "thu", "fri"], from = "08:00", to = "18:00" }
    expires = 2026-12-31T00:00:00Z         # a time-limited grant: void afterwards

Conditions of one rule must all hold: subjects, roles, claims, methods, paths, routes,
models, intents, domains (globs), source_cidrs, body_over/body_max (bytes), time (UTC
days and hours), not_before/expires, rbac. Any matching deny wins over every allow (deny
overrides); with no match the file's default decides. A claim matches a value of its
JSON type (true is not "true"; an array claim, or the scopes of `scope`, by element); a
dotted key is a path into the claims (realm_access.roles), a quoted one a name. JWT claim
`aiproxy_grants` ([{"permission": "model:x", "exp": epoch}]) adds permissions until their
exp.

Files are re-read when they change (checked every poll_ms on the request path); a file
that does not parse is reported with FILE:LINE and the previous policy keeps serving.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import re
import time as _time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime
from datetime import time as _clock
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from aiproxy import wirejson
from aiproxy.config.errors import ConfigError, Problem
from aiproxy.config.loader import syntax_problem
from aiproxy.config.locate import KeyPath, Locator
from aiproxy.config.locate import format_path as _format_path
from aiproxy.governance.auth import AUTH_CHALLENGE, BEARER_CHALLENGE
from aiproxy.governance.watch import FileWatch
from aiproxy.llm.openai import model_text
from aiproxy.pipeline.filters import Filter, FilterFactory, LocalReply

if TYPE_CHECKING:
    from aiproxy.config import Config, RouteConfig
    from aiproxy.pipeline.exchange import Exchange

log = logging.getLogger("aiproxy.policy")

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
GLOB_KEYS = ("subjects", "roles", "methods", "paths", "routes", "models", "intents", "domains")
RULE_KEYS = ("id", "effect", "description", *GLOB_KEYS, "claims", "source_cidrs", "body_over",
             "body_max", "time", "not_before", "expires", "rbac")
MODEL_IN_BODY = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.){1,256})"')
INSPECT_BYTES = 64 * 1024
SCOPE_TOKEN = re.compile(r"[\x21\x23-\x5b\x5d-\x7e]{1,256}")  # RFC 6750 3: 1*NQCHAR
# The registered claims' JSON types (auth refuses exp/nbf/iat of another) and where.
REGISTERED_CLAIMS = {"exp": "number", "nbf": "number", "iat": "number", "iss": "string",
                     "sub": "string", "jti": "string", "aud": "string", "scope": "string"}
REGISTERED_IN = {"scope": "RFC 8693 4.2"}  # the others: RFC 7519 4.1
TYPE_WARNINGS_MAX = 1024
_type_warned: set[tuple[str, str, str]] = set()  # (rule source, claim, its type): logged


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    effect: str
    source: str  # FILE:LINE
    globs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # claim path (names from the token's top level down) -> the values that match
    claims: dict[tuple[str, ...], tuple[str | int | float | bool, ...]] = field(
        default_factory=dict)
    cidrs: tuple[Any, ...] = ()
    body_over: int | None = None
    body_max: int | None = None
    days: tuple[int, ...] | None = None
    minutes: tuple[int, int] | None = None  # [from, to) minutes of the UTC day
    not_before: float | None = None
    expires: float | None = None
    rbac: bool = False


@dataclass(frozen=True, slots=True)
class Policy:
    rules: tuple[Rule, ...]
    roles: dict[str, tuple[str, ...]]
    default: str = "deny"
    uses_model: bool = False
    uses_intent: bool = False  # a rule reads the intent or its domain
    uses_body: bool = False  # a rule has body_over or body_max
    states_default: bool = False  # its file says `default` (several files: the last that does)


@dataclass(slots=True)
class Decision:
    allowed: bool
    rule: str  # the deciding rule's id ("default" when none matched)
    trace: list[tuple[str, str, str]]  # (rule id, effect, "match" or why not)

    @property
    def name(self) -> str:
        return "allow" if self.allowed else "deny"


@dataclass(slots=True)
class Request:
    """What rules look at; built from an Exchange or from `policy explain` JSON."""

    subject: str | None = None
    roles: tuple[str, ...] = ()
    claims: dict[str, Any] = field(default_factory=dict)
    method: str = "GET"
    path: str = "/"
    route: str | None = None
    model: str | None = None
    intent: str | None = None
    domain: str | None = None
    source: str | None = None
    body_bytes: int = 0
    body_known: bool = True  # else body_bytes is what has come of a longer body so far
    now: float = 0.0


# -- loading ---------------------------------------------------------------------------------


def _timestamp(value: Any) -> float | None:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.timestamp()
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=UTC).timestamp()
    return None


def _hhmm(text: Any) -> int | None:
    if not isinstance(text, str):
        return None
    m = re.fullmatch(r"([01]\d|2[0-4]):([0-5]\d)", text)
    if m is None:
        return None
    minutes = int(m.group(1)) * 60 + int(m.group(2))
    return minutes if minutes <= 1440 else None


def json_type(value: Any) -> str | None:
    """"boolean", "number" or "string" for a JSON scalar (None for arrays, objects,
    null). A bool is an int to Python, never a number to JSON."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "string" if isinstance(value, str) else None


def _claim_value_problem(name: str, value: Any) -> str | None:
    """Why a rule's claim value can never equal a JWT claim (None when it can)."""
    if isinstance(value, datetime | date | _clock):
        return ("a date-time never matches: a JWT is JSON, which has none (exp/nbf/iat "
                "are numbers of seconds)")
    if isinstance(value, list):
        return "an array in an array never matches (an array claim matches by element)"
    if isinstance(value, dict):
        return "a table in an array never matches"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} never matches: JSON has no nan or inf"
    want = REGISTERED_CLAIMS.get(name)
    if want is not None and json_type(value) != want:
        return (f"{name} is a {want} ({REGISTERED_IN.get(name, 'RFC 7519 4.1')}), never a "
                f"{json_type(value)}")
    if name == "scope" and (not value or " " in value):
        return "a scope is a token, matched among the claim's space-separated scopes: " \
            "it is neither empty nor has a space (RFC 6749 3.3)"
    return None


def _claim_conditions(table: dict, prefix: tuple[str, ...],
                      out: dict[tuple[str, ...], tuple[Any, ...]], bad: Any) -> None:
    """The claim conditions of a `claims` table into `out`, by path: a TOML table (a
    dotted key, `realm_access.roles`) goes into the claim's members; a quoted key is
    one name (`"https://example.com/roles"`)."""
    for name, value in table.items():
        path = prefix + (name,)
        where = ("claims", *path)
        registered = REGISTERED_CLAIMS.get(name) if not prefix else None
        if isinstance(value, dict):
            if not value:
                bad(where, "an empty table names no claim")
            elif registered is not None:
                bad(where, f"{name} is a {registered} "
                    f"({REGISTERED_IN.get(name, 'RFC 7519 4.1')}): it has no members")
            else:
                _claim_conditions(value, path, out, bad)
            continue
        if value == []:
            bad(where, "an empty list never matches")
            continue
        values = value if isinstance(value, list) else [value]
        for j, v in enumerate(values):
            why = _claim_value_problem(name if not prefix else "", v)
            if why is not None:
                bad(where + ((j,) if isinstance(value, list) else ()), why)
        out[path] = tuple(values)


def parse_policy(text: str, filename: str, ids: dict[str, str] | None = None
                 ) -> tuple[Policy, list[Problem]]:
    """`ids`: rule id -> FILE:LINE of the rules already read (other files); this file's
    rules are added to it."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return Policy((), {}), [syntax_problem(filename, text, exc)]
    locator = Locator(text)
    problems: list[Problem] = []

    def error(path: KeyPath, message: str) -> None:
        problems.append(Problem(filename, locator.line(path), _format_path(path), message))

    for key in data:
        if key not in ("default", "roles", "rules"):
            error((key,), "unknown key (expected default, roles, rules)")
    default = data.get("default", "deny")
    if default not in ("allow", "deny"):
        error(("default",), f"expected \"allow\" or \"deny\", got {default!r}")
        default = "deny"
    roles: dict[str, tuple[str, ...]] = {}
    raw_roles = data.get("roles", {})
    if not isinstance(raw_roles, dict):
        error(("roles",), "expected table of role = [permissions]")
        raw_roles = {}
    for name, perms in raw_roles.items():
        if not isinstance(perms, list) or not all(isinstance(p, str) for p in perms):
            error(("roles", name), "expected an array of permission strings")
            continue
        for i, p in enumerate(perms):
            if p != "*" and p.split(":", 1)[0] not in ("route", "model", "intent", "domain"):
                error(("roles", name, i), f"permission '{p}' is not route:, model:, intent:, "
                      "domain: or *")
        roles[name] = tuple(perms)
    rules = []
    raw_rules = data.get("rules", [])
    if not isinstance(raw_rules, list):
        error(("rules",), "expected array of tables")
        raw_rules = []
    seen = {} if ids is None else ids
    for i, raw in enumerate(raw_rules):
        path: KeyPath = ("rules", i)
        if not isinstance(raw, dict):
            error(path, "expected table")
            continue
        rule = _rule(raw, path, error, f"{filename}:{locator.line(path)}")
        if rule is not None:
            if rule.id in seen:
                error(path + ("id",), f"duplicate rule id '{rule.id}' "
                                      f"(first at {seen[rule.id]})")
            seen.setdefault(rule.id, f"{filename}:{locator.line(path + ('id',))}")
            rules.append(rule)
    return _policy(rules, roles, default, "default" in data), problems


def _policy(rules: list[Rule], roles: Any, default: Any, states_default: bool = False
            ) -> Policy:
    """The Policy, with what its rules read of a request (the model, the intent)."""
    return Policy(tuple(rules), roles, default, states_default=states_default,
                  uses_model=any("models" in r.globs or r.rbac for r in rules),
                  uses_intent=any("intents" in r.globs or "domains" in r.globs or r.rbac
                                  for r in rules),
                  uses_body=any(r.body_over is not None or r.body_max is not None
                                for r in rules))


def _rule(raw: dict, path: KeyPath, error: Any, source: str) -> Rule | None:
    ok = True

    def bad(key: str | KeyPath, message: str) -> None:
        nonlocal ok
        ok = False
        error(path + (key if isinstance(key, tuple) else (key,)), message)

    for key in raw:
        if key not in RULE_KEYS:
            bad(key, f"unknown key (one of: {', '.join(RULE_KEYS)})")
    rid = raw.get("id")
    if not isinstance(rid, str) or not rid:
        bad("id", "missing required key" if "id" not in raw else "expected a non-empty string")
    effect = raw.get("effect")
    if effect not in ("allow", "deny"):
        bad("effect", f"expected \"allow\" or \"deny\", got {effect!r}")
    globs = {}
    for key in GLOB_KEYS:
        if key in raw:
            value = raw[key]
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                bad(key, "expected an array of non-empty strings")
            else:
                globs[key] = tuple(v.upper() for v in value) if key == "methods" else tuple(value)
    claims: dict[tuple[str, ...], tuple[Any, ...]] = {}
    if "claims" in raw:
        if not isinstance(raw["claims"], dict):
            bad("claims", "expected table of claim = value or [values]")
        else:
            _claim_conditions(raw["claims"], (), claims, bad)
    cidrs = []
    for j, text in enumerate(raw.get("source_cidrs", [])):
        try:
            cidrs.append(ipaddress.ip_network(str(text), strict=False))
        except ValueError as exc:
            error(path + ("source_cidrs", j), f"invalid CIDR '{text}': {exc}")
            ok = False
    sizes = {}
    for key in ("body_over", "body_max"):
        if key in raw:
            if not isinstance(raw[key], int) or isinstance(raw[key], bool) or raw[key] < 0:
                bad(key, "expected a non-negative integer (bytes)")
            else:
                sizes[key] = raw[key]
    days = minutes = None
    if "time" in raw:
        t = raw["time"]
        if not isinstance(t, dict) or set(t) - {"days", "from", "to"}:
            bad("time", "expected { days = [...], from = \"HH:MM\", to = \"HH:MM\" } (UTC)")
        else:
            if "days" in t:
                if not isinstance(t["days"], list) or not all(d in DAYS for d in t["days"]):
                    bad("time", f"days are {', '.join(DAYS)}")
                else:
                    days = tuple(DAYS.index(d) for d in t["days"])
            if "from" in t or "to" in t:
                lo, hi = _hhmm(t.get("from", "00:00")), _hhmm(t.get("to", "24:00"))
                if lo is None or hi is None:
                    bad("time", "from/to are \"HH:MM\" (UTC)")
                else:
                    minutes = (lo, hi)
    stamps = {}
    for key in ("not_before", "expires"):
        if key in raw:
            stamp = _timestamp(raw[key])
            if stamp is None:
                bad(key, "expected a TOML date-time (e.g. 2026-12-31T00:00:00Z)")
            stamps[key] = stamp
    rbac = raw.get("rbac", False)
    if not isinstance(rbac, bool):
        bad("rbac", "expected boolean")
    if not ok:
        return None
    return Rule(rid, effect, source, globs, claims, tuple(cidrs), sizes.get("body_over"),
                sizes.get("body_max"), days, minutes, stamps.get("not_before"),
                stamps.get("expires"), rbac)


def load_policy_files(paths: tuple[str, ...] | list[str]) -> Policy:
    """One policy from several files (rules in order, roles merged, the last default);
    ConfigError with FILE:LINE problems when any file is broken."""
    rules: list[Rule] = []
    roles: dict[str, tuple[str, ...]] = {}
    default = "deny"
    problems: list[Problem] = []
    ids: dict[str, str] = {}
    for path in dict.fromkeys(paths):  # a file listed twice is read once
        try:
            with open(path, "rb") as fh:
                text = fh.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(Problem(path, 0, "", f"cannot read policy file: {exc}"))
            continue
        policy, found = parse_policy(text, path, ids)
        problems += found
        rules += policy.rules
        for name, perms in policy.roles.items():
            roles[name] = roles.get(name, ()) + perms
        if policy.states_default:
            default = policy.default
    if problems:
        raise ConfigError(problems)
    return _policy(rules, roles, default)


def kernel_deny_cidrs(policy: Policy) -> tuple[str, ...]:
    """Networks of the deny rules that say nothing but source_cidrs (no expiry, no other
    condition): those can be dropped by XDP before a connection exists. Rules with
    more conditions stay in the proxy."""
    out: list[str] = []
    for r in policy.rules:
        if (r.effect == "deny" and r.cidrs and not r.globs and not r.claims and not r.rbac
                and r.body_over is None and r.body_max is None and r.days is None
                and r.minutes is None and r.not_before is None and r.expires is None):
            out += (str(n) for n in r.cidrs if str(n) not in out)
    return tuple(out)


# -- evaluation -------------------------------------------------------------------------------


def _any_glob(patterns: tuple[str, ...], value: str | None) -> bool:
    return value is not None and any(fnmatchcase(value, p) for p in patterns)


def _permitted(perms: list[str], kind: str, value: str | None) -> bool:
    if value is None:
        return True  # nothing to check on this dimension (no model in the request, ...)
    return any(p == "*" or (p.startswith(kind + ":") and fnmatchcase(value, p[len(kind) + 1:]))
               for p in perms)


def _claim_matches(have: Any, allowed: tuple[Any, ...]) -> bool:
    """A claim (an array: one of its elements) equal to one of the values, in JSON type
    too: true is not "true", 1 is 1.0 (JSON has one number type)."""
    for h in have if isinstance(have, list) else (have,):
        kind = json_type(h)
        if kind is not None and any(kind == json_type(a) and h == a for a in allowed):
            return True
    return False


def _warn_type(rule: Rule, name: str, have: Any, allowed: tuple[Any, ...]) -> None:
    """Log (once) a claim none of whose values has a JSON type of the rule's values: a
    deny rule that can never match it (`suspended = "true"` for `"suspended": true`)
    must not go unnoticed. The claims' types cannot be known from the file."""
    kinds = {json_type(h) for h in (have if isinstance(have, list) else (have,))}
    wanted = sorted({json_type(a) for a in allowed})
    if kinds & set(wanted):
        return
    what = ("a JSON array" if isinstance(have, list) else "a JSON object"
            if isinstance(have, dict) else f"a JSON {json_type(have)}")
    key = (rule.source, name, what)
    if key in _type_warned or len(_type_warned) >= TYPE_WARNINGS_MAX:
        return
    _type_warned.add(key)
    log.warning("policy rule %s (%s): claim %s is %s, the rule's values are %s: no match",
                rule.id, rule.source, name, what, " or ".join(f"{k}s" for k in wanted))


def permissions(policy: Policy, req: Request) -> list[str]:
    perms = [p for role in req.roles for p in policy.roles.get(role, ())]
    grants = req.claims.get("aiproxy_grants")
    if isinstance(grants, list):
        for g in grants:
            if (isinstance(g, dict) and isinstance(g.get("permission"), str)
                    and isinstance(g.get("exp"), int | float) and g["exp"] > req.now):
                perms.append(g["permission"])
    return perms


def why_not(policy: Policy, rule: Rule, req: Request, model: bool = True,
            body: bool = True) -> str | None:
    """None when the rule's conditions all hold, else the first one that does not.
    With model (body) False, what the rule asks of the model (the body's size) is taken
    to hold."""
    now = req.now
    if rule.expires is not None and now >= rule.expires:
        return "expired"
    if rule.not_before is not None and now < rule.not_before:
        return "not yet valid"
    g = rule.globs
    values = {"subjects": req.subject, "methods": req.method, "paths": req.path,
              "routes": req.route, "models": req.model, "intents": req.intent,
              "domains": req.domain}
    for key, patterns in g.items():
        if key == "models" and not model:
            continue
        if key == "roles":
            if not any(_any_glob(patterns, r) for r in req.roles):
                return "roles"
        elif not _any_glob(patterns, values[key]):
            return key
    for path, allowed in rule.claims.items():
        have: Any = req.claims
        for name in path:
            have = have.get(name) if isinstance(have, dict) else None
        if path == ("scope",) and isinstance(have, str):
            have = have.split(" ")  # RFC 8693 4.2: space-separated scopes
        if not _claim_matches(have, allowed):
            name = _format_path(("claims", *path))
            if have is not None:
                _warn_type(rule, name[len("claims."):], have, allowed)
            return name
    if rule.cidrs:
        try:
            addr = ipaddress.ip_address(req.source or "")
        except ValueError:
            return "source_cidrs"
        if not any(addr in net for net in rule.cidrs if net.version == addr.version):
            return "source_cidrs"
    if body and rule.body_over is not None and not req.body_bytes > rule.body_over:
        return "body_over"
    if body and rule.body_max is not None and req.body_bytes > rule.body_max:
        return "body_max"
    if rule.days is not None or rule.minutes is not None:
        t = datetime.fromtimestamp(now, UTC)
        if rule.days is not None and t.weekday() not in rule.days:
            return "time.days"
        if rule.minutes is not None:
            m = t.hour * 60 + t.minute
            lo, hi = rule.minutes
            inside = lo <= m < hi if lo <= hi else (m >= lo or m < hi)  # a window over 0:00
            if not inside:
                return "time"
    if rule.rbac:
        perms = permissions(policy, req)
        for kind, value in (("route", req.route), ("model", req.model),
                            ("intent", req.intent), ("domain", req.domain)):
            if kind == "model" and not model:
                continue
            if not _permitted(perms, kind, value):
                return f"rbac.{kind}"
    return None


def decide(policy: Policy, req: Request, explain: bool = False) -> Decision:
    allow = deny = None
    trace: list[tuple[str, str, str]] = []
    for rule in policy.rules:
        if not explain and rule.effect == "allow" and allow is not None:
            continue
        miss = why_not(policy, rule, req)
        if explain:
            trace.append((rule.id, rule.effect, "match" if miss is None else f"no: {miss}"))
        if miss is None:
            if rule.effect == "deny":
                if deny is None:
                    deny = rule.id
                if not explain:
                    break
            elif allow is None:
                allow = rule.id
    if deny is not None:
        return Decision(False, deny, trace)
    if allow is not None:
        return Decision(True, allow, trace)
    return Decision(policy.default == "allow", "default", trace)


def identity_could_allow(policy: Policy, req: Request, decision: Decision) -> bool:
    """Could some identity lift this denial: no rule but the default denied, and an
    allow rule holds but for what it asks of the identity (subjects, roles, claims,
    rbac)? A deny rule that matched a request without identity matches with one too."""
    if decision.allowed or decision.rule != "default":
        return False
    for r in policy.rules:
        if r.effect == "allow" and (r.claims or r.rbac or "subjects" in r.globs
                                    or "roles" in r.globs):
            anyone = replace(r, claims={}, rbac=False, globs={
                k: v for k, v in r.globs.items() if k not in ("subjects", "roles")})
            if why_not(policy, anyone, req) is None:
                return True
    return False


def needed_scope(policy: Policy, req: Request, decision: Decision) -> str | None:
    """The permissions a denied request lacks, as an RFC 6750 3 scope ("model:gpt-4o
    route:chat"), when an rbac rule would have allowed it with them; None when no
    permission would help (a deny rule decided) or a value is no scope-token."""
    if decision.allowed or decision.rule != "default":
        return None
    if not any(r.effect == "allow" and r.rbac
               and (why_not(policy, r, req) or "").startswith("rbac.") for r in policy.rules):
        return None
    perms = permissions(policy, req)
    missing = [f"{kind}:{value}" for kind, value in (
        ("route", req.route), ("model", req.model), ("intent", req.intent),
        ("domain", req.domain)) if not _permitted(perms, kind, value)]
    if not missing or not all(SCOPE_TOKEN.fullmatch(m) for m in missing):
        return None  # the model is the client's text: never echoed unless it is a token
    return " ".join(missing)


# -- the filter --------------------------------------------------------------------------------


def model_of(ex: Exchange, whole: bool = True) -> str | None:
    """The LLM filter's model, else the JSON body's `model`, else the route's. Not read
    from part of a body (`whole` false): a later "model" key is the one an upstream's
    JSON parser keeps, so the start of a body is no evidence of it."""
    llm = ex.llm
    model = (getattr(llm, "model", None)
             if llm is not None and not llm.request_truncated else None)
    if model:
        return model
    body = ex.request_body()
    if body and whole:
        try:
            doc = wirejson.loads(body)
            if isinstance(doc, dict) and isinstance(doc.get("model"), str):
                return doc["model"]
            return None
        except ValueError:
            pass
        m = MODEL_IN_BODY.search(body)  # not JSON: what it seems to name
        if m is not None:
            try:
                return json.loads(b'"' + m.group(1) + b'"')
            except ValueError:
                return None
    route_model = ex.route.cfg.model if ex.route is not None else None
    return route_model.decode("latin-1") if route_model else None


def request_of(ex: Exchange, uses_model: bool, uses_intent: bool = False,
               whole: bool = True) -> Request:
    """What the rules look at; `whole`: the body read (ex.request_body()) is all of it."""
    ident = ex.identity
    head = ex.head
    length = head.content_length
    known = length is not None and length >= 0
    body_bytes = length if known else ex.pending_size
    intent, domain = ex.intent, ex.intent_domain
    sem = ex.rt.semantic
    if uses_intent and sem is not None and (intent is None
                                            or head.get(sem.header) is not None):
        # A rule on intents or domains judges what the request says: the model's reading
        # of it, also where routing needed none or the client named its intent (the
        # header routes by it, but is only its sender's claim).
        intent, domain = _model_intent(ex, sem)
    return Request(
        subject=ident.subject if ident is not None else None,
        roles=ident.roles if ident is not None else (),
        claims=ident.claims if ident is not None else {},
        method=ex.method.decode("latin-1").upper(), path=ex.path.decode("latin-1"),
        route=ex.route.name if ex.route is not None else None,
        model=model_of(ex, whole) if uses_model else None,
        intent=intent, domain=domain, source=ex.down.peer.decode("latin-1"),
        body_bytes=body_bytes, body_known=known or whole, now=_time.time())


def model_matters(policy: Policy, req: Request) -> bool:
    """Whether a rule that reads the model holds in all else for `req`."""
    return any(("models" in r.globs or r.rbac) and why_not(policy, r, req, model=False) is None
               for r in policy.rules)


def body_cap(policy: Policy, req: Request, decision: Decision) -> tuple[int, str] | None:
    """For a request allowed on the start of a body of unknown length: the size past
    which a deny rule's body_over would hold, or the allowing rule's body_max would not
    (the least of them, with that rule's id)."""
    cap = None
    for r in policy.rules:
        if r.effect == "deny" and r.body_over is not None:
            limit = r.body_over
        elif r.id == decision.rule and r.effect == "allow" and r.body_max is not None:
            limit = r.body_max
        else:
            continue
        if (cap is None or limit < cap[0]) and why_not(policy, r, req, body=False) is None:
            cap = (limit, r.id)
    return cap


def _model_intent(ex: Exchange, sem: Any) -> tuple[str | None, str | None]:
    """The model's intent and domain for the request body (None, None: no text)."""
    try:
        text = sem.request_text(ex.head, ex.request_body(), ex.up_target)
        if not text:
            return None, None
        decision = sem.model.classify(text)
    except Exception:  # as routing does: judged without an intent rather than failed
        log.exception("intent classification for the policy failed")
        return None, None
    return decision.label, decision.domain or None


class PolicyState:
    """The current policy; re-read when its files change (kept across config reloads
    while the file list is the same)."""

    def __init__(self, files: tuple[str, ...], dry_run: bool, poll_ms: int,
                 inspect_bytes: int) -> None:
        self.files = files
        self.dry_run = dry_run
        self.inspect_bytes = inspect_bytes
        # Stamp before reading: a file replaced while it is read then looks changed at
        # the next poll. The other order keeps the old rules under the new stamp.
        self.watch = FileWatch(files, poll_ms / 1000)
        self.policy = load_policy_files(files)
        self.reloads = 0
        self.reload_errors = 0
        self.decisions: dict[tuple[str, str], int] = {}  # (result, rule) -> count
        # Called (on the event loop) after the files were re-read: the server pushes
        # the policy's source-CIDR denies into the XDP deny map.
        self.on_reload: Callable[[PolicyState], None] | None = None

    def count(self, result: str, rule: str) -> None:
        key = (result, rule)
        self.decisions[key] = self.decisions.get(key, 0) + 1

    def metric_families(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        fam = CounterMetricFamily("aiproxy_policy_decisions", "Policy decisions by rule",
                                  labels=["result", "rule"])
        for (result, rule), n in sorted(self.decisions.items()):
            fam.add_metric([result, rule], n)
        yield fam
        yield CounterMetricFamily("aiproxy_policy_reloads", "Policy files reloaded",
                                  value=self.reloads)
        yield CounterMetricFamily("aiproxy_policy_reload_failures",
                                  "Policy changes rejected (the previous policy kept serving)",
                                  value=self.reload_errors)

    def current(self) -> Policy:
        if self.watch.changed():
            try:
                self.policy = load_policy_files(self.files)
                self.reloads += 1
                log.info("policy reloaded from %s (%d rules)", ", ".join(self.files),
                         len(self.policy.rules))
            except ConfigError as exc:
                self.reload_errors += 1
                log.error("policy not reloaded, the previous policy stays:\n%s", exc)
            else:
                if self.on_reload is not None:
                    try:
                        self.on_reload(self)
                    except Exception:
                        log.exception("policy reload hook failed")
        return self.policy


class PolicyFilter(Filter):
    __slots__ = ("state",)

    def __init__(self, state: PolicyState) -> None:
        self.state = state

    def request(self, ex: Exchange) -> LocalReply | None:
        state = self.state
        policy = state.current()
        body = ex.request_body()
        whole = ex.request_body_whole(body)
        req = request_of(ex, policy.uses_model, policy.uses_intent, whole)
        if req.model is not None:  # for the audit record, also of a request denied here
            ex.gov["model"] = model_text(req.model)
        if (not whole and policy.uses_model and not ex.grpc and not state.dry_run
                and model_matters(policy, req)):
            # Read past the limit, the model would be a guess the client controls.
            return LocalReply(413, "policy_body_too_large", "the policy reads the model "
                              f"from at most {state.inspect_bytes} bytes of a request body "
                              "([policy] inspect_bytes)")
        decision = decide(policy, req)
        if decision.allowed:
            ex.gov["policy"] = ("allow", decision.rule)
            state.count("allow", decision.rule)
            if not req.body_known and policy.uses_body and not state.dry_run:
                cap = body_cap(policy, req, decision)
                if cap is not None:
                    ex.cap_body(cap[0], f"request body larger than policy rule {cap[1]} "
                                "allows")
            return None
        subject = ex.identity.subject if ex.identity is not None else "-"
        if state.dry_run:
            ex.gov["policy"] = ("would_deny", decision.rule)
            state.count("would_deny", decision.rule)
            log.warning("dry-run: would deny %s %s for %s (rule %s)", ex.method.decode(),
                        ex.path.decode("latin-1"), subject, decision.rule)
            return None
        ex.gov["policy"] = ("deny", decision.rule)
        state.count("deny", decision.rule)
        headers = [(b"x-aiproxy-policy-rule", decision.rule.encode("latin-1"))]
        anonymous = ex.gov.get(AUTH_CHALLENGE)
        if anonymous is not None and identity_could_allow(policy, req, decision):
            # RFC 9110 15.5.2: no credentials, where some could make the request succeed,
            # is 401 with the challenge; with no error code, as RFC 6750 3.1 has it for a
            # request that lacks any authentication information.
            headers.append((b"www-authenticate", anonymous))
            return LocalReply(401, "unauthorized",
                              f"credentials required by policy rule {decision.rule}", headers)
        challenge = ex.gov.get(BEARER_CHALLENGE)
        if challenge is not None:
            # RFC 6750 3.1: a bearer token without the privileges the request needs.
            challenge += b', error="insufficient_scope"'
            scope = needed_scope(policy, req, decision)
            if scope is not None:
                challenge += b', scope="%s"' % scope.encode()
            headers.append((b"www-authenticate", challenge))
        return LocalReply(403, "forbidden", f"denied by policy rule {decision.rule}", headers)


class PolicyFactory(FilterFactory):
    name = "policy"

    def __init__(self, state: PolicyState, classifies: bool) -> None:
        self.state = state
        self.classifies = classifies

    @property
    def inspect_bytes(self) -> int:  # type: ignore[override]
        """Read per request: the policy files may change what their rules read."""
        policy = self.state.policy
        if policy.uses_model or policy.uses_body:
            return self.state.inspect_bytes
        # Intent rules read the body only through a [semantic] model (request_of).
        return INSPECT_BYTES if policy.uses_intent and self.classifies else 0

    def start(self, ex: Exchange) -> Filter:
        return PolicyFilter(self.state)


def make_state(config: Config, previous: Any) -> Any:
    cfg = config.policy
    if cfg is None:
        return None
    if (isinstance(previous, PolicyState) and previous.files == cfg.files):
        previous.dry_run = cfg.dry_run
        previous.inspect_bytes = cfg.inspect_bytes
        previous.watch.interval = cfg.poll_ms / 1000
        previous.current()
        return previous
    return PolicyState(cfg.files, cfg.dry_run, cfg.poll_ms, cfg.inspect_bytes)


def build(config: Config, route: RouteConfig, state: PolicyState) -> FilterFactory:
    return PolicyFactory(state, config.semantic is not None)
