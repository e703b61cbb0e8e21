"""What the kernel does per proxied request: TCP segments per hop, pure ACKs, delayed ACKs,
context switches, syscalls and system CPU time, for nginx and aiproxy as reverse proxies.

    sudo python bench/kernel_per_request.py [--proxies nginx,aiproxy] [--trees .,/other]
                                             [--rounds 3] [--duration 8]

Runs in a network namespace of its own (created and removed here, loopback only), so the
SNMP counters (/proc/net/snmp, /proc/net/netstat) count this test's traffic alone. The
backend, the proxies and wrk are bench/e2e.py's (same configs, wrk -t1 -c64 keep-alive,
`--pin` placement: the proxy on the last CPU, wrk and the backend on the others).

Per proxy and round two runs follow a warm-up:
- plain: proxy utime/stime (/proc/PID/stat), voluntary and involuntary context switches
  (all its threads) and the netns SNMP deltas, all divided by wrk's request count;
- traced: `perf stat` counts the proxy's syscalls (raw_syscalls:sys_enter) and, per hop
  and direction, the segments established sockets receive (tcp:tcp_probe, split by
  data_len == 0, i.e. pure ACKs, and data_len > 0). Tracing costs CPU, so this run's
  times are not reported.
Medians over rounds are printed as a table.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import (  # noqa: E402
    ALL_CPUS,
    BASELINE,
    CASES,
    CLK_TCK,
    LAST_CPU,
    OTHER_CPUS,
    WRK_SCRIPT,
    Proc,
    Servers,
    cpu_ticks,
    ensure_tools,
    log,
    pin,
    run_wrk,
)

NETNS_ENV = "AIPROXY_KERNEL_NETNS"
SNMP_KEYS = ("Tcp:InSegs", "Tcp:OutSegs", "TcpExt:DelayedACKs", "TcpExt:TCPPureAcks",
             "TcpExt:TCPHPAcks", "TcpExt:TCPHPHits", "TcpExt:TCPDelivered",
             "TcpExt:TCPAutoCorking", "TcpExt:TCPBacklogCoalesce", "TcpExt:TCPRcvCoalesce",
             "TcpExt:TCPOrigDataSent")


def snmp() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = Path(path).read_text().splitlines()
        for names, values in zip(lines[::2], lines[1::2], strict=True):
            prefix, *keys = names.split()
            for k, v in zip(keys, values.split()[1:], strict=True):
                out[prefix[:-1] + ":" + k] = int(v)
    return out


def minor_faults(pids: list[int]) -> int:
    return sum(int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
               for pid in pids)


def ctx_switches(pids: list[int]) -> tuple[int, int]:
    vol = invol = 0
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            vol += int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", text, re.M).group(1))
            invol += int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", text, re.M).group(1))
    return vol, invol


def probe_events(proxy_port: int, backend_port: int) -> list[tuple[str, str]]:
    """(name, perf filter) for tcp:tcp_probe: sport/dport are the receiving socket's."""
    hops = {"client->proxy": f"sport == {proxy_port}", "proxy->client": f"dport == {proxy_port}",
            "proxy->backend": f"sport == {backend_port}",
            "backend->proxy": f"dport == {backend_port}"}
    events = []
    for hop, cond in hops.items():
        events.append((f"{hop} data", f"{cond} && data_len != 0"))
        events.append((f"{hop} ack", f"{cond} && data_len == 0"))
    return events


def one_run(servers: Servers, name: str, path: str, wrk: str, script: Path, duration: int,
            connections: int, traced: bool, tmp: Path) -> dict[str, float]:
    pids = servers.proxies[name].serving_pids()
    pin(pids, {LAST_CPU})
    perfs: list[subprocess.Popen] = []
    events = probe_events(servers.ports[name], servers.backend_port)
    if traced:
        window = ["--", "sleep", str(duration + 2)]
        probes = ["perf", "stat", "-x,", "-o", str(tmp / "probes.csv"), "-a"]
        for _, flt in events:
            probes += ["-e", "tcp:tcp_probe", "--filter", flt]
        calls = ["perf", "stat", "-x,", "-o", str(tmp / "calls.csv"), "-e",
                 "raw_syscalls:sys_enter", "-p", ",".join(map(str, pids))]
        perfs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for cmd in (probes + window, calls)]
        time.sleep(0.5)
    s0, c0, x0, f0 = snmp(), cpu_ticks(pids), ctx_switches(pids), minor_faults(pids)
    w = run_wrk(wrk, script, servers.ports[name], path, duration, connections, OTHER_CPUS)
    s1, c1, x1, f1 = snmp(), cpu_ticks(pids), ctx_switches(pids), minor_faults(pids)
    pin(pids, ALL_CPUS)
    n = max(w["requests"], 1)
    res: dict[str, float] = {"requests": w["requests"], "rps": w["requests"] / w["duration_us"] * 1e6}
    if not traced:
        res["user us"] = (c1[0] - c0[0]) / CLK_TCK * 1e6 / n
        res["sys us"] = (c1[1] - c0[1]) / CLK_TCK * 1e6 / n
        res["vol cs"] = (x1[0] - x0[0]) / n
        res["invol cs"] = (x1[1] - x0[1]) / n
        res["minor faults"] = (f1 - f0) / n
        for k in SNMP_KEYS:
            res[k] = (s1.get(k, 0) - s0.get(k, 0)) / n
    else:
        perfs[0].wait()
        perfs[1].send_signal(signal.SIGINT)
        perfs[1].wait()
        # The perf window covers the wrk run plus idle time around it, when the keep-alive
        # connections are idle: the counts are the run's (plus wrk's connects and closes).
        def counts(f: str) -> list[int]:
            return [int(line.split(",")[0]) for line in (tmp / f).read_text().splitlines()
                    if line and line[0].isdigit()]
        res["syscalls"] = counts("calls.csv")[0] / n
        for (ev, _), c in zip(events, counts("probes.csv"), strict=True):
            res[ev] = c / n
    return res


def in_netns(argv: list[str]) -> int:
    """Re-run this script inside a fresh network namespace; remove it afterwards."""
    ns = f"aiproxy-kern-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        env = dict(os.environ, **{NETNS_ENV: ns})
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, __file__, *argv],
                              env=env).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--proxies", default="nginx,aiproxy")
    p.add_argument("--trees", default=".", help="aiproxy tree; a second one runs as "
                   f"{BASELINE} (A/B)")
    p.add_argument("--case", default="small", choices=sorted(CASES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=int, default=8)
    p.add_argument("--connections", type=int, default=64)
    args = p.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("perf") is None or len(ALL_CPUS) < 2:
        log("needs root, perf and 2 CPUs")
        return 1
    if NETNS_ENV not in os.environ:
        return in_netns(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    names = args.proxies.split(",") + ([BASELINE] if len(trees) > 1 else [])
    tools = ensure_tools(install=False)
    tmp = Path(tempfile.mkdtemp(prefix="aiproxy-kern-"))
    results: dict[str, list[dict[str, float]]] = {}
    try:
        servers = Servers(tmp, tools, 0, 4096, trees[0], trees[1] if len(trees) > 1 else None)
        servers.start_backend()
        assert servers.backend is not None
        pin(servers.backend.serving_pids(), OTHER_CPUS)
        script = tmp / "wrk.lua"
        script.write_text(WRK_SCRIPT)
        for name in names:
            servers.start(name)
        path = CASES[args.case][0]
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                run_wrk(tools["wrk"], script, servers.ports[name], path, 2, args.connections,
                        OTHER_CPUS)
                plain = one_run(servers, name, path, tools["wrk"], script, args.duration,
                                args.connections, False, tmp)
                traced = one_run(servers, name, path, tools["wrk"], script, args.duration,
                                 args.connections, True, tmp)
                results.setdefault(name, []).append({**traced, **plain})
                log(f"round {r + 1} {name}: {plain['rps']:,.0f} req/s, sys "
                    f"{plain['sys us']:.1f} us, {traced['syscalls']:.2f} syscalls/req")
        keys = [k for k in results[names[0]][0] if k not in ("requests", "rps")]
        print("| per request (median) | " + " | ".join(names) + " |")
        print("|---|" + "---:|" * len(names))
        print("| req/s | " + " | ".join(
            f"{statistics.median(x['rps'] for x in results[n]):,.0f}" for n in names) + " |")
        for k in keys:
            print(f"| {k} | " + " | ".join(
                f"{statistics.median(x[k] for x in results[n]):.3f}" for n in names) + " |")
        return 0
    finally:
        Proc.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
