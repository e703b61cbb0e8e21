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
        key = sys.stdin.readline().strip()
        if not key:
            print("no key on stdin", file=sys.stderr)
            return 2
    print(hash_key(key))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    add_auth(sub)


def run(args: argparse.Namespace) -> int:
    if args.command == "auth":
        return run_auth(args)
    return 2
