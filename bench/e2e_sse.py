#!/usr/bin/env python3
"""LLM token streams end to end: server-sent events through aiproxy beside nginx.

    python bench/e2e_sse.py [--rounds N] [--duration S] [--events N] [--gap-ms G]
                            [--connections C] [--baseline DIR] [--pin]

The backend (this script with --backend, uvloop, raw sockets) answers every GET with a
chunked `text/event-stream` of --events OpenAI-style chunks (`data: {"choices":[{"delta":
{"content":"tok"}}]}`), one HTTP chunk each, --gap-ms apart (a model's token pace), then
`data: [DONE]`: each event reaches the proxy as its own read, as a real model's do. nginx
proxies it with `proxy_buffering off` (each chunk passed on as read, as for a streamed
completion) over keep-alive upstream connections; aiproxy with its defaults (one worker,
no access log on either). wrk (-c C, keep-alive) reads the streams; a request is one
whole stream. Rounds are interleaved, order rotating; the table shows medians of the
proxy's CPU per event (utime+stime from /proc over the run, divided by events passed)
and streams/s, each with its ratio to nginx. `--baseline DIR` adds "aiproxy-base", the
same config run from another source tree (A/B for a change). `--pin` puts the proxy
under test alone on the last CPU, wrk and the backend on the others.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import e2e  # bench/e2e.py: process handling, wrk and /proc readings

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def serve_backend(port: int, events: int, gap: float) -> None:
    event, done = chunk(EVENT), chunk(DONE) + b"0\r\n\r\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")  # GETs only: no body
                writer.write(HEAD)
                for _ in range(events):
                    await asyncio.sleep(gap)
                    writer.write(event)
                writer.write(done)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=int, default=8, help="seconds per run")
    ap.add_argument("--events", type=int, default=50, help="events per stream")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="between a stream's events")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another aiproxy source tree to run beside this one (A/B)")
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--backend", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.backend:
        import uvloop

        uvloop.run(serve_backend(args.backend, args.events, args.gap_ms / 1000))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="aiproxy-e2e-sse-"))
    try:
        return run(args, tmp)
    finally:
        e2e.Proc.stop_all()


def run(args: argparse.Namespace, tmp: Path) -> int:
    tools = e2e.ensure_tools(install=False)
    be, ngx, aip, base = (e2e.free_port() for _ in range(4))
    backend = e2e.Proc("backend", [sys.executable, __file__, "--backend", str(be),
                                   "--events", str(args.events), "--gap-ms",
                                   str(args.gap_ms)], tmp)
    e2e.wait_port(be, backend)
    conf = tmp / "nginx.conf"
    conf.write_text(textwrap.dedent(f"""\
        worker_processes 1;
        daemon off;
        pid {tmp}/nginx.pid;
        error_log {tmp}/nginx.err;
        events {{ worker_connections 4096; }}
        http {{
          access_log off;
          keepalive_requests 1000000;
          keepalive_timeout 300s;
          upstream be {{ server 127.0.0.1:{be}; keepalive 128; }}
          server {{
            listen 127.0.0.1:{ngx} backlog=4096;
            location / {{
              proxy_pass http://be;
              proxy_http_version 1.1;
              proxy_set_header Connection "";
              proxy_buffering off;
            }}
          }}
        }}
        """))
    nginx = e2e.Proc("nginx", [tools["nginx"], "-c", str(conf)], tmp)
    e2e.wait_port(ngx, nginx)
    aip_conf = tmp / "aiproxy.toml"
    aip_conf.write_text(e2e.aiproxy_config(aip, be))
    aiproxy = e2e.Proc("aiproxy", [sys.executable, "-m", "aiproxy", "-c", str(aip_conf),
                                   "--log-level", "warning"], tmp)
    e2e.wait_port(aip, aiproxy)
    targets = {"nginx": (nginx, ngx), "aiproxy": (aiproxy, aip)}
    if args.baseline is not None:
        base_conf = tmp / "aiproxy-base.toml"
        base_conf.write_text(e2e.aiproxy_config(base, be))
        root = str(args.baseline.resolve())
        baseline = e2e.Proc("aiproxy-base", [sys.executable, "-m", "aiproxy", "-c",
                                             str(base_conf), "--log-level", "warning"],
                            tmp, env={"PYTHONPATH": root}, cwd=Path(root))
        e2e.wait_port(base, baseline)
        targets["aiproxy-base"] = (baseline, base)
    script = tmp / "report.lua"
    script.write_text(e2e.WRK_SCRIPT)
    if args.pin:
        e2e.pin([backend.pid], e2e.OTHER_CPUS)
    wrk_cpus = e2e.OTHER_CPUS if args.pin else None
    for _proc, port in targets.values():  # warm up: pools, caches
        e2e.run_wrk(tools["wrk"], script, port, "/", 2, args.connections, wrk_cpus)
    runs: dict[str, list[dict]] = {name: [] for name in targets}
    failed = False
    for r in range(args.rounds):
        names = list(targets)
        for name in names[r % len(names):] + names[:r % len(names)]:
            proc, port = targets[name]
            pids = proc.serving_pids()
            if args.pin:
                e2e.pin(pids, {e2e.LAST_CPU})
            cpu0 = e2e.cpu_ticks(pids)
            w = e2e.run_wrk(tools["wrk"], script, port, "/", args.duration,
                            args.connections, wrk_cpus)
            cpu1 = e2e.cpu_ticks(pids)
            if args.pin:
                e2e.pin(pids, e2e.ALL_CPUS)
            errors = sum(w[k] for k in ("connect_errors", "read_errors", "write_errors",
                                        "status_errors", "timeouts"))
            failed = failed or errors > 0 or not proc.alive()
            events = max(w["requests"] * (args.events + 1), 1)
            user = (cpu1[0] - cpu0[0]) / e2e.CLK_TCK
            system = (cpu1[1] - cpu0[1]) / e2e.CLK_TCK
            res = {"streams_s": w["requests"] / (w["duration_us"] / 1e6),
                   "cpu_us_per_event": (user + system) * 1e6 / events,
                   "user_us_per_event": user * 1e6 / events,
                   "sys_us_per_event": system * 1e6 / events,
                   "p50_ms": w["p50_us"] / 1000, "errors": errors}
            runs[name].append(res)
            e2e.log(f"round {r + 1}/{args.rounds} {name:13} {res['streams_s']:8.1f} streams/s "
                    f"{res['cpu_us_per_event']:6.2f} us/event (user "
                    f"{res['user_us_per_event']:.2f}, sys {res['sys_us_per_event']:.2f}) "
                    f"p50 {res['p50_ms']:.1f} ms")
            time.sleep(0.5)
    keys = ("streams_s", "cpu_us_per_event", "user_us_per_event", "sys_us_per_event",
            "p50_ms")
    med = {name: {k: statistics.median(x[k] for x in rs) for k in keys}
           for name, rs in runs.items()}
    ref = med["nginx"]
    print(f"\nSSE token streams: {args.events} events {args.gap_ms:g} ms apart per stream, "
          f"wrk -c{args.connections}, {args.rounds} interleaved rounds x {args.duration} s; "
          "medians (ratio to nginx)\n")
    print("| proxy | streams/s | CPU us/event | user us/event | sys us/event | p50 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, m in med.items():
        cells = [f"{m[k]:.2f} ({m[k] / ref[k]:.2f}x)" if ref[k] else f"{m[k]:.2f}"
                 for k in keys]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, rs in runs.items():
        if name != "nginx":
            per = [a["cpu_us_per_event"] / b["cpu_us_per_event"]
                   for a, b in zip(rs, runs["nginx"], strict=True)]
            print(f"  {name}: CPU/event ratio round by round: median "
                  f"{statistics.median(per):.2f}x ({min(per):.2f}-{max(per):.2f})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
