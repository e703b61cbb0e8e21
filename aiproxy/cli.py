"""Command line: `aiproxy -c FILE`, `aiproxy run|check|demo-upstream ...`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from aiproxy import __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiproxy",
        description="AI-native edge reverse proxy. `aiproxy -c FILE` runs in the foreground.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"aiproxy {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run the proxy in the foreground (the default command)",
                         description="Run the proxy in the foreground, logging to stderr.")
    _config_args(run)
    run.add_argument("--log-level", default="info",
                     choices=["debug", "info", "warning", "error"], help="log level (info)")

    check = sub.add_parser("check", help="validate a config file and print a summary",
                           description="Validate a config file. Exit 0 and print a summary, "
                           "or exit 2 with FILE:LINE: key.path: problem lines.")
    _config_args(check)

    bpf = sub.add_parser("bpf", help="kernel fast paths: status, attach, detach (XDP/TC)",
                         description="Kernel fast paths from the config's [kernel] section.")
    from aiproxy.kernel.cli import add_arguments as _bpf_arguments

    _bpf_arguments(bpf)

    from aiproxy.governance import cli as _gov

    _gov.add_commands(sub)

    sub.add_parser("demo-upstream", add_help=False,
                   help="run the bundled OpenAI-style demo upstream (see its --help)")
    sub.add_parser("router", add_help=False,
                   help="train, evaluate and try semantic-routing models (see its --help)")
    return parser


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", required=True, metavar="FILE", help="TOML config file")


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader of stdout went away (`aiproxy check -c F | head -1`): no traceback.
        # stdout goes to /dev/null so the flush at exit cannot raise the same again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo-upstream":
        from aiproxy.demo.upstream import main as demo_main

        return demo_main(argv[1:])
    if argv and argv[0] == "router":
        from aiproxy.semantic.cli import main as router_main

        return router_main(argv[1:])
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "-V", "--version"):
        # `aiproxy -c FILE` is `aiproxy run -c FILE`; a word that is no command (a typo)
        # is left for argparse to name, not taken for an argument of `run`.
        argv.insert(0, "run")
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    if args.command == "check":
        return _check(args.config)
    if args.command == "bpf":
        from aiproxy.kernel.cli import run as bpf_run

        return bpf_run(args)
    if args.command in ("auth", "policy", "audit"):
        from aiproxy.governance import cli as gov_cli

        return gov_cli.run(args)
    return _run(args.config, args.log_level)


def _load(path: str):
    from aiproxy.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return None


def _check(path: str) -> int:
    from aiproxy.config import summary

    cfg = _load(path)
    if cfg is None:
        return 2
    from aiproxy.config.insecure import insecure_settings

    for warning in insecure_settings(cfg):
        print(f"warning: {warning}", file=sys.stderr)
    if cfg.semantic is not None:
        from aiproxy.config.model_check import load_checked_model

        _, problems, warnings = load_checked_model(cfg)
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if problems:
            print("\n".join(map(str, problems)), file=sys.stderr)
            return 2
    print(summary(cfg))
    print(f"{path}: ok")
    return 0


def _run(path: str, level: str) -> int:
    # Until the event loop takes them over, SIGHUP and SIGUSR1 (logrotate) would kill the
    # proxy as it starts: ignored meanwhile, here and in the forkserver and workers, which
    # inherit it. Their config and logs are being read and opened anyway.
    for sig in (signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    # Before numpy is imported (here or in the forkserver): a worker starts no thread it
    # does not need (aiproxy/server/sockets.py), and its vector math is small.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = _load(path)
    if cfg is None:
        return 2
    if cfg.server.workers > 1:
        # the forkserver imports the request path while this process imports the supervisor
        from aiproxy.server.forkserver import prestart

        prestart()
        from aiproxy.server.supervisor import run
    else:
        from aiproxy.server.app import run
    return run(cfg)
