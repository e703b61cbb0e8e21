#!/usr/bin/env python3
"""HTTP/2 and gRPC end to end: aiproxy beside nginx, in front of the same backends.

    python bench/e2e_h2.py [--rounds N] [--requests N] [--cases h2c,grpc] [--baseline DIR]

- h2c: h2load (16 connections x 32 streams) against nginx (`listen ... http2`, h2c prior
  knowledge) and aiproxy (`protocols = ["h2c"]`), both proxying to one nginx HTTP/1.1
  backend (`return 200 "ok"`); 512 streams in flight need 512 upstream HTTP/1.1
  connections, so both keep up to 512 idle (nginx keepalive 512, max_idle_connections).
- gRPC unary: h2load sending the Predict call of proto/aiproxy/testing/v1/inference.proto
  (a fixed, pre-encoded message) against nginx `grpc_pass` and aiproxy (cluster
  `protocol = "h2"`), both in front of one grpcio server (tests/grpc_support.py). The
  Python grpcio server is slower than either proxy, so requests/s mostly measure it: the
  CPU microseconds per request of each proxy are the figure to compare there.

Rounds are interleaved (the order rotates from round to round); the table shows medians
and ratios to nginx. `--baseline DIR` adds "aiproxy-base", the same config run from another
source tree (e.g. `git archive main | tar -x -C DIR` plus its build_ext), interleaved with the
others: the A/B for a change. Everything runs on 127.0.0.1 free ports. Uses bench/e2e.py's process
handling, so every server is stopped on exit.
"""

from __future__ import annotations

import argparse
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import e2e  # bench/e2e.py: process handling and /proc readings

REPO = Path(__file__).resolve().parents[1]


def h2load(url: str, n: int, extra: list[str]) -> tuple[float, int, int]:
    out = subprocess.run(["h2load", "-n", str(n), "-c", "16", "-m", "32", *extra, url],
                         capture_output=True, text=True, timeout=300).stdout
    rps = float(re.search(r"finished in [\d.]+m?s, ([\d.]+) req/s", out).group(1))
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", out)
    return rps, int(done.group(1)), int(done.group(2))


def measure(proc: e2e.Proc, url: str, n: int, extra: list[str]) -> dict:
    pids = proc.serving_pids()
    before = sum(e2e.cpu_ticks(pids))
    rps, done, ok = h2load(url, n, extra)
    ticks = sum(e2e.cpu_ticks(pids)) - before
    return {"rps": rps, "cpu_us_per_req": ticks / e2e.CLK_TCK * 1e6 / max(done, 1),
            "ok": ok, "n": done}


def grpc_body() -> bytes:
    # PredictRequest{model: "m", prompt: "hello"} in protobuf wire format, gRPC-framed.
    msg = b"\x0a\x01m\x12\x05hello"
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=60000)
    ap.add_argument("--grpc-requests", type=int, default=20000)
    ap.add_argument("--cases", default="h2c,grpc", help="comma list of h2c, grpc")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another aiproxy source tree to run beside this one (A/B)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="aiproxy-e2e-h2-"))
    try:
        return run(args, tmp)
    finally:
        e2e.Proc.stop_all()


def run(args: argparse.Namespace, tmp: Path) -> int:
    be, ngx, aip, grpc_port, ngx_g, aip_g, base, base_g = (e2e.free_port() for _ in range(8))
    head = textwrap.dedent(f"""\
        worker_processes 1;
        daemon off;
        error_log {tmp}/nginx.err;
        events {{ worker_connections 4096; }}
        """)
    # The HTTP backend runs in its own nginx so the proxy's CPU is measured alone.
    backend_conf = tmp / "backend.conf"
    backend_conf.write_text(head + f"pid {tmp}/backend.pid;\n" + textwrap.dedent(f"""\
        http {{
          access_log off;
          keepalive_requests 1000000;
          server {{ listen 127.0.0.1:{be}; location / {{ return 200 "ok"; }} }}
        }}
        """))
    proxy_conf = tmp / "proxy.conf"
    proxy_conf.write_text(head + f"pid {tmp}/proxy.pid;\n" + textwrap.dedent(f"""\
        http {{
          access_log off;
          keepalive_requests 1000000;
          http2_max_requests 1000000;
          upstream be {{ server 127.0.0.1:{be}; keepalive 512; }}
          upstream grpcbe {{ server 127.0.0.1:{grpc_port}; keepalive 16; }}
          server {{
            listen 127.0.0.1:{ngx} http2;
            location / {{ proxy_pass http://be; proxy_http_version 1.1;
                          proxy_set_header Connection ""; }}
          }}
          server {{
            listen 127.0.0.1:{ngx_g} http2;
            location / {{ grpc_pass grpc://grpcbe; }}
          }}
        }}
        """))
    def aiproxy_conf(aip: int, aip_g: int) -> str:
        return textwrap.dedent(f"""\
        [server]
        workers = 1
        [http]
        max_keepalive_requests = 0
        h2_max_concurrent_streams = 128
        [access_log]
        path = "off"
        [[listeners]]
        name = "h2c"
        address = "127.0.0.1:{aip}"
        protocols = ["h2c"]
        [[listeners]]
        name = "grpc"
        address = "127.0.0.1:{aip_g}"
        protocols = ["h2c"]
        [[clusters]]
        name = "be"
        endpoints = ["127.0.0.1:{be}"]
        max_idle_connections = 512
        max_requests_per_connection = 0
        [[clusters]]
        name = "grpc"
        protocol = "h2"
        endpoints = ["127.0.0.1:{grpc_port}"]
        [[routes]]
        name = "grpc"
        match = {{ grpc_service = "aiproxy.testing.v1.Predictor" }}
        cluster = "grpc"
        [[routes]]
        name = "all"
        cluster = "be"
        """)
    aip_conf = tmp / "aiproxy.toml"
    aip_conf.write_text(aiproxy_conf(aip, aip_g))
    backend = e2e.Proc("backend", ["nginx", "-c", str(backend_conf)], tmp)
    e2e.wait_port(be, backend)
    grpc_server = e2e.Proc("grpc", [sys.executable, "-m", "tests.grpc_support", "--gen",
                                    str(tmp / "gen"), "--port", str(grpc_port)], tmp)
    e2e.wait_port(grpc_port, grpc_server, timeout=60)
    nginx = e2e.Proc("nginx", ["nginx", "-c", str(proxy_conf)], tmp)
    e2e.wait_port(ngx, nginx)
    aiproxy = e2e.Proc("aiproxy", [sys.executable, "-m", "aiproxy", "-c", str(aip_conf),
                                   "--log-level", "warning"], tmp)
    e2e.wait_port(aip, aiproxy)
    baseline = None
    if args.baseline is not None:
        base_conf = tmp / "aiproxy-base.toml"
        base_conf.write_text(aiproxy_conf(base, base_g))
        root = str(args.baseline.resolve())
        baseline = e2e.Proc("aiproxy-base", [sys.executable, "-m", "aiproxy", "-c",
                                             str(base_conf), "--log-level", "warning"],
                            tmp, env={"PYTHONPATH": root}, cwd=Path(root))
        e2e.wait_port(base, baseline)
    body = tmp / "predict.bin"
    body.write_bytes(grpc_body())
    grpc_args = ["-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers"]
    predict = "/aiproxy.testing.v1.Predictor/Predict"
    h2c_targets = {"nginx": (nginx, f"http://127.0.0.1:{ngx}/"),
                   "aiproxy": (aiproxy, f"http://127.0.0.1:{aip}/")}
    grpc_targets = {"nginx": (nginx, f"http://127.0.0.1:{ngx_g}{predict}"),
                    "aiproxy": (aiproxy, f"http://127.0.0.1:{aip_g}{predict}")}
    if baseline is not None:
        h2c_targets["aiproxy-base"] = (baseline, f"http://127.0.0.1:{base}/")
        grpc_targets["aiproxy-base"] = (baseline, f"http://127.0.0.1:{base_g}{predict}")
    wanted = set(args.cases.split(","))
    cases = {}
    if "h2c" in wanted:
        cases["h2c small"] = (h2c_targets, args.requests, [])
    if "grpc" in wanted:
        cases["grpc unary"] = (grpc_targets, args.grpc_requests, grpc_args)
    failed = False
    for case, (targets, n, extra) in cases.items():
        for _proc, url in targets.values():  # warm up
            h2load(url, 2000, extra)
        runs: dict[str, list[dict]] = {name: [] for name in targets}
        for r in range(args.rounds):
            names = list(targets)
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                proc, url = targets[name]
                res = measure(proc, url, n, extra)
                runs[name].append(res)
                if res["ok"] != res["n"]:
                    failed = True
                time.sleep(0.5)
        med = {name: {k: statistics.median(x[k] for x in rs) for k in ("rps", "cpu_us_per_req")}
               for name, rs in runs.items()}
        base = med["nginx"]
        print(f"\n{case} ({args.rounds} rounds, medians; ratio to nginx)")
        print(f"{'proxy':13} {'req/s':>10} {'ratio':>7} {'CPU us/req':>11} {'ratio':>7}")
        for name, m in med.items():
            print(f"{name:13} {m['rps']:10.0f} {m['rps'] / base['rps']:7.2f} "
                  f"{m['cpu_us_per_req']:11.1f} "
                  f"{m['cpu_us_per_req'] / base['cpu_us_per_req']:7.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
