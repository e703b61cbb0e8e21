#!/usr/bin/env python3
"""Tunnel throughput through the proxy: spliced in the kernel vs copied in user space.

    python bench/e2e_tunnel.py [--rounds N] [--mib M] [--tcp] [--json PATH]  (root: "spliced")

Two aiproxy processes (`python -m aiproxy -c`) in front of the same upstream, one with
`[kernel] splice_tunnels = true`, one with `false`. The upstream (in this process, raw
sockets) answers an `Upgrade: raw-bench` request with a 101, then sends M MiB while it
reads the client's M MiB until EOF; the client does the same. With --tcp the proxies
have a raw TCP listener (`protocols = ["tcp"]`) instead and there is no 101. Each run is one tunnel
carrying M MiB each way at once (loopback); the modes alternate, order rotating per round.

Per run: MB/s (both directions together), the proxy's CPU per MB (utime+stime from
/proc/PID/stat, the supervisor and its workers) and the whole machine's CPU per MB (/proc/stat busy time: the endpoints
here, the proxy, and the kernel workers that carry spliced bytes). The endpoints count
bytes without hashing (tests/kernel/test_tunnel_splice.py checks content). The table
shows medians over rounds and spliced/copied ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import (  # noqa: E402
    free_port,
    start_process,
    stop_process,
    tree_cpu_seconds,
    wait_port,
)

BLOCK = os.urandom(1 << 20)


def machine_busy() -> float:
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def pump(sock: socket.socket, mib: int, counts: dict, key: str) -> list[threading.Thread]:
    def send() -> None:
        try:
            for _ in range(mib):
                sock.sendall(BLOCK)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # wait_port's probe of a tcp listener; a real run checks the counts

    def recv() -> None:
        n, buf = 0, bytearray(1 << 20)
        while got := sock.recv_into(buf):
            n += got
        counts[key] = n

    return [threading.Thread(target=send), threading.Thread(target=recv)]


class Upstream:
    """Accepts tunnels: 101, then M MiB out and everything in until EOF."""

    def __init__(self, mib: int, tcp: bool) -> None:
        self.mib = mib
        self.tcp = tcp
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.counts: dict[str, int] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        if not self.tcp:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n"
                         b"Upgrade: raw-bench\r\n\r\n")
        threads = pump(conn, self.mib, self.counts, "upstream")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        conn.close()


def start_proxy(tmp: Path, name: str, upstream: int, splice: bool, tcp: bool):
    port = free_port()
    path = tmp / f"{name}.toml"
    listener = 'protocols = ["tcp"]\ncluster = "up"' if tcp else ""
    path.write_text(f"""
[[listeners]]
name = "bench"
address = "127.0.0.1:{port}"
{listener}

[access_log]
path = "off"

[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{upstream}"]

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"

[kernel]
splice_tunnels = {"true" if splice else "false"}
""")
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(path)])
    wait_port("127.0.0.1", port, proc=proc)
    return proc, port


def one_run(proc, port: int, upstream: Upstream, mib: int) -> dict:
    c = socket.create_connection(("127.0.0.1", port))
    if not upstream.tcp:
        c.sendall(b"GET /t HTTP/1.1\r\nHost: b\r\nConnection: Upgrade\r\n"
                  b"Upgrade: raw-bench\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += c.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head
    upstream.counts.clear()
    counts: dict[str, int] = {}
    threads = pump(c, mib, counts, "client")
    cpu0, busy0, t0 = tree_cpu_seconds(proc.pid), machine_busy(), time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 30
    while "upstream" not in upstream.counts and time.monotonic() < deadline:
        time.sleep(0.001)
    wall = time.monotonic() - t0
    cpu, busy = tree_cpu_seconds(proc.pid) - cpu0, machine_busy() - busy0
    c.close()
    size = mib << 20
    if counts.get("client") != size or upstream.counts.get("upstream") != size:
        raise RuntimeError(f"short tunnel: client {counts}, upstream {upstream.counts}")
    mb = 2 * size / 1e6
    return {"MB_per_s": mb / wall, "proxy_cpu_ms_per_MB": 1000 * cpu / mb,
            "machine_cpu_ms_per_MB": 1000 * busy / mb, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=256, help="MiB each way per run")
    ap.add_argument("--tcp", action="store_true", help="raw TCP listeners, no Upgrade")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    upstream = Upstream(args.mib, args.tcp)
    procs = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for mode in ("spliced", "copied"):
                procs[mode] = start_proxy(Path(tmp), mode, upstream.port, mode == "spliced",
                                          args.tcp)
            runs: dict[str, list[dict]] = {"spliced": [], "copied": []}
            order = ["spliced", "copied"]
            for r in range(args.rounds):
                for mode in order if r % 2 == 0 else order[::-1]:
                    proc, port = procs[mode]
                    runs[mode].append(one_run(proc, port, upstream, args.mib))
            spliced_log = Path(procs["spliced"][0].log_path).read_text()
        finally:
            for proc, _ in procs.values():
                stop_process(proc)
    if "unavailable" in spliced_log:
        print("note: the spliced proxy could not use the kernel path:", file=sys.stderr)
        print(spliced_log, file=sys.stderr)
    keys = ("MB_per_s", "proxy_cpu_ms_per_MB", "machine_cpu_ms_per_MB")
    med = {mode: {k: statistics.median(run[k] for run in rs) for k in keys}
           for mode, rs in runs.items()}
    kind = "raw TCP tunnel" if args.tcp else "tunnel"
    print(f"{kind} through aiproxy, {args.mib} MiB each way, {args.rounds} rounds, medians")
    print(f"{'mode':8s} {'MB/s':>9s} {'proxy CPU ms/MB':>16s} {'machine CPU ms/MB':>18s}")
    for mode in ("spliced", "copied"):
        m = med[mode]
        print(f"{mode:8s} {m['MB_per_s']:9.1f} {m['proxy_cpu_ms_per_MB']:16.4f} "
              f"{m['machine_cpu_ms_per_MB']:18.3f}")
    ratio = {k: med["spliced"][k] / med["copied"][k] if med["copied"][k] else None
             for k in keys}
    print("spliced/copied: " + ", ".join(
        f"{k} {v:.2f}x" if v is not None else f"{k} n/a" for k, v in ratio.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"mib": args.mib, "rounds": args.rounds,
                                               "runs": runs, "medians": med}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
