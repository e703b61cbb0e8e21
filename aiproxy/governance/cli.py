"""`aiproxy auth|policy|audit ...`: the governance layer's command line helpers."""

from __future__ import annotations

import argparse
import sys


def add_auth(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("auth", help="API key helpers (hash-key)",
                       description="Helpers for the [auth] section.")
    cmds = p.add_subparsers(dest="auth_command", metavar="SUBCOMMAND", required=True)
    h = cmds.add_parser("hash-key", help="print the stored form (sha256$SALT$HEX) of an API key",
                        description="Print the salted hash to put in [[auth.api_keys]] hash "
                        "or a key file. The key is read from stdin (one line) unless "
                        "--generate makes a new random one (printed to stderr).")
    h.add_argument("--generate", action="store_true", help="generate a new random key")


def run_auth(args: argparse.Namespace) -> int:
    from aiproxy.governance.auth import hash_key, new_key

    if args.generate:
        key = new_key()
        print(f"key: {key}", file=sys.stderr)
    else:
        # The proxy reads a presented key's header bytes as Latin-1 (one character a
        # byte) before hashing: so is the key here, whatever its bytes.
        key = sys.stdin.buffer.readline().decode("latin-1").strip()
        if not key:
            print("no key on stdin", file=sys.stderr)
            return 2
    print(hash_key(key))
    return 0


def add_policy(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policy", help="explain policy decisions",
                       description="Helpers for the [policy] section.")
    cmds = p.add_subparsers(dest="policy_command", metavar="SUBCOMMAND", required=True)
    e = cmds.add_parser(
        "explain", help="print the decision for a request and the rules that made it",
        description="Evaluate the config's policy files for one request given as JSON: "
        '{"subject": "alice", "roles": ["analyst"], "claims": {...}, "method": "POST", '
        '"path": "/v1/chat/completions", "route": "chat", "model": "gpt-4o", "intent": "...", '
        '"domain": "...", "source": "10.0.0.1", "body_bytes": 1200, '
        '"time": "2026-01-05T10:00:00Z"}. Exit 0 when allowed, 1 when denied.')
    e.add_argument("-c", "--config", required=True, metavar="FILE", help="TOML config file")
    e.add_argument("--request", required=True, metavar="JSON", help="the request attributes")


def run_policy(args: argparse.Namespace) -> int:
    from aiproxy.config import ConfigError, load_config
    from aiproxy.governance.policy import decide

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if cfg.policy is None:
        print(f"{args.config}: no [policy] section", file=sys.stderr)
        return 2
    try:
        req = _request(args.request)
    except ValueError as exc:
        print(f"--request: {exc}", file=sys.stderr)
        return 2
    from aiproxy.governance.policy import load_policy_files

    policy = load_policy_files(cfg.policy.files)
    decision = decide(policy, req, explain=True)
    sources = {r.id: r.source for r in policy.rules}
    print(f"decision: {decision.name} (rule {decision.rule})"
          + (" [dry-run: would only be logged]" if cfg.policy.dry_run and not decision.allowed
             else ""))
    for rid, effect, outcome in decision.trace:
        print(f"  {effect:5} {rid:30} {outcome:20} {sources[rid]}")
    if decision.rule == "default":
        print(f"  no rule matched: default {policy.default}")
    return 0 if decision.allowed else 1


REQUEST_TEXT = ("subject", "method", "path", "route", "model", "intent", "domain")
REQUEST_FIELDS = ("subject", "roles", "claims", "method", "path", "route", "model", "intent",
                  "domain", "source", "body_bytes", "time")


def _request(text: str):
    """The `policy explain --request` JSON as a policy Request; ValueError naming the
    field that is not of its type (a wrong type would be another request, or a crash)."""
    import ipaddress
    import json
    import time
    from datetime import UTC, datetime

    from aiproxy.governance.policy import Request

    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("expected a JSON object")

    def bad(name: str, what: str) -> ValueError:
        return ValueError(f"{name}: expected {what}, not {json.dumps(doc[name])}")

    for name in doc:
        if name not in REQUEST_FIELDS:
            raise ValueError(f"unknown field '{name}' (known: {', '.join(REQUEST_FIELDS)})")
    for name in REQUEST_TEXT:
        if name in doc and not isinstance(doc[name], str) and (
                doc[name] is not None or name in ("method", "path")):
            raise bad(name, "a string")
    roles = doc.get("roles", [])
    if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
        raise bad("roles", "a list of strings")
    if not isinstance(doc.get("claims", {}), dict):
        raise bad("claims", "a JSON object")
    if doc.get("source") is not None:
        try:
            ipaddress.ip_address(doc["source"])
        except ValueError:
            raise bad("source", "an IP address") from None
    size = doc.get("body_bytes", 0)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise bad("body_bytes", "a whole number of bytes")
    now = time.time()
    if doc.get("time") is not None:
        try:
            when = datetime.fromisoformat(doc["time"].replace("Z", "+00:00"))
        except (AttributeError, ValueError):
            raise bad("time", "an ISO 8601 time such as 2026-01-05T10:00:00Z") from None
        now = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()  # rules: UTC
    fields = {k: v for k, v in doc.items() if k != "time"}
    fields["roles"] = tuple(roles)
    return Request(**fields, now=now)


def add_audit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="verify and query audit log files",
                       description="Tools for the [audit] log.")
    cmds = p.add_subparsers(dest="audit_command", metavar="SUBCOMMAND", required=True)
    v = cmds.add_parser("verify", help="check the hash chain across files",
                        description="Exit 0 when every record chains to the one before it; "
                        "print each edited, removed or reordered record and exit 1.")
    v.add_argument("files", nargs="+", metavar="FILE",
                   help="a log and its rotated files; several workers' PATH.wN files are "
                   "checked as separate chains")
    v.add_argument("--partial", action="store_true",
                   help="accept a chain whose first records are not given (archived)")
    v.add_argument("--anchor", action="append", default=[], metavar="HASH",
                   help="a head hash printed by an earlier verify and kept elsewhere: fail "
                   "unless that record is still in the chain (catches a truncated log; "
                   "repeatable)")
    q = cmds.add_parser(
        "query", help="filter and group records (schema-on-read)",
        description="Fields are dotted names of the JSON records (identity.sub, "
        "timings_ms.total); missing fields are null; a field seen with several types "
        "is compared as a string.")
    q.add_argument("files", nargs="+", metavar="FILE")
    q.add_argument("--where", action="append", default=[], metavar="COND",
                   help="FIELD=VALUE, != > < >= <=, or FIELD~REGEX (repeatable, all must hold)")
    q.add_argument("--group-by", action="append", default=[], metavar="FIELD",
                   help="count records per value (repeatable or comma-separated)")
    q.add_argument("--since", metavar="DURATION|TIME", help="e.g. 15m, 1h, 2d or an ISO time")
    q.add_argument("--fields", metavar="F1,F2", help="columns to print (without --group-by)")
    q.add_argument("--format", choices=["table", "json"], default="table",
                   help="table (aligned columns), or json: one JSON object a row or group, "
                   "one a line (JSON Lines)")


def run_audit(args: argparse.Namespace) -> int:
    from aiproxy.governance import audit_tools

    try:
        if args.audit_command == "verify":
            return audit_tools.verify(args.files, partial=args.partial, anchors=args.anchor)
        group_by = [g for item in args.group_by for g in item.split(",") if g]
        fields = [f for f in args.fields.split(",") if f] if args.fields else None
        return audit_tools.query(args.files, args.where, group_by, args.since, fields,
                                 args.format)
    except (OSError, ValueError) as exc:
        print(f"aiproxy audit: {exc}", file=sys.stderr)
        return 2


def add_commands(sub: argparse._SubParsersAction) -> None:
    add_auth(sub)
    add_policy(sub)
    add_audit(sub)


def run(args: argparse.Namespace) -> int:
    if args.command == "auth":
        return run_auth(args)
    if args.command == "policy":
        return run_policy(args)
    if args.command == "audit":
        return run_audit(args)
    return 2
