#!/usr/bin/env python3
"""End to end: proxy CPU per request with LLM accounting, rate limiting and the prompt
cache each on and off, and the cache-hit latency against the upstream path.

    python bench/llm_e2e.py [--requests N] [--rounds R]

One demo upstream (aiohttp, no token delay) and one aiproxy per case, all on 127.0.0.1.
Per round every case runs once (order rotating): N sequential keep-alive POSTs of a small
chat completion from httpx; the proxy's CPU (utime+stime from /proc/PID/stat) over the
run divided by N, and the median request latency. Prints medians over rounds and each
case's difference to "off".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support import free_port, start_demo_upstream, start_process, stop_process, wait_port  # noqa: E402

CASES = {
    "off": "",
    "accounting": "[llm]\n",
    "accounting+ratelimit": "[[ratelimits]]\nname = \"b\"\nrequests_per_second = 1e9\n"
                            "burst_requests = 1000000000\ntokens_per_minute = 1000000000000\n",
    "cache-miss": "[cache]\n",
    "cache-hit": "[cache]\n",
}
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def run(port: int, pid: int, n: int, unique: bool) -> tuple[float, float]:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    lat = []
    with httpx.Client() as c:
        c.post(url, json=body(0 if not unique else -1))  # warm (and fill the cache)
        before = cpu_seconds(pid)
        for i in range(n):
            t0 = time.perf_counter()
            r = c.post(url, json=body(i if unique else 0))
            lat.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        cpu = cpu_seconds(pid) - before
    return cpu / n * 1e6, statistics.median(lat) * 1e6


def body(i: int) -> dict:
    return {"model": "demo-model", "max_tokens": 16,
            "messages": [{"role": "user", "content": f"question number {i} about the sea"}]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    up, up_port = start_demo_upstream("bench")
    procs = {}
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    try:
        for name, extra in CASES.items():
            port = free_port()
            cfg = tmp / f"llm-e2e-{name}-{os.getpid()}.toml"
            cfg.write_text(f"""
[[listeners]]
name = "l"
address = "127.0.0.1:{port}"
[access_log]
path = "off"
[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{up_port}"]
[[routes]]
name = "all"
cluster = "up"
{extra}""")
            proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(cfg)])
            wait_port("127.0.0.1", port, proc=proc)
            procs[name] = (proc, port)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
        names = list(CASES)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                proc, port = procs[name]
                results[name].append(run(port, proc.pid, args.requests, name == "cache-miss"))
        base_cpu = statistics.median(c for c, _ in results["off"])
        base_lat = statistics.median(lat for _, lat in results["off"])
        print(f"{'case':24} {'cpu us/req':>11} {'+cpu us':>8} {'p50 us':>8} {'lat ratio':>9}")
        for name in names:
            cpu = statistics.median(c for c, _ in results[name])
            lat = statistics.median(x for _, x in results[name])
            print(f"{name:24} {cpu:11.1f} {cpu - base_cpu:8.1f} {lat:8.0f} "
                  f"{lat / base_lat:9.2f}")
    finally:
        for proc, _ in procs.values():
            stop_process(proc)
        stop_process(up)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
