"""User-space instructions per proxied request, counted by valgrind (callgrind).

On a shared 2-core machine wall-clock and CPU-time A/B runs swing by 10-20% with what
else is running; an instruction count does not. This starts the e2e backend (nginx,
bench/e2e.py), runs aiproxy from each given tree under callgrind with the same config
as bench/e2e.py, drives it with wrk (keep-alive), and divides the instructions counted
during the measured run by the requests wrk completed. Kernel time (the syscalls) is not
counted: this measures the proxy's own per-request work, which is what Python costs.

    python bench/instr_per_request.py --trees /work/main,. --cases small,16k

--nginx counts nginx the same way, as a proxy with bench/e2e.py's config run as one
process (master_process off): the ratio to it does not move with the machine's speed.

--sim adds callgrind's cache and branch simulation and prints, per request, L1/LL
misses and mispredicted branches: when instructions are at parity but CPU time is not,
this is where the cost per instruction shows (the VM has no hardware counters).

Runs under valgrind are ~50x slower: the request counts are small, and the figures are
for comparing trees on one machine, not absolute speed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import (  # noqa: E402
    CASES,
    NGINX_PROXY,
    Proc,
    Servers,
    aiproxy_config,
    ensure_tools,
    free_port,
    log,
)


def get(port: int, path: str) -> int:
    out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                          f"http://127.0.0.1:{port}{path}"], capture_output=True, text=True)
    return int(out.stdout or 0)


def aiproxy_command(tree: Path, backend: int, tmp: Path) -> tuple[list[str], dict, Path, int]:
    """aiproxy from `tree` with bench/e2e.py's config: (command, env, cwd, port)."""
    port = free_port()
    conf = tmp / f"aiproxy-{port}.toml"
    conf.write_text(aiproxy_config(port, backend))
    return [sys.executable, "-m", "aiproxy", "-c", str(conf)], {"PYTHONPATH": str(tree)}, tree, port


def nginx_command(servers: Servers) -> tuple[list[str], dict, Path, int]:
    """nginx with bench/e2e.py's proxy config, as one process (no master to fork a
    worker under valgrind): (command, env, cwd, port)."""
    conf, port = servers.nginx_config("nginx-callgrind", NGINX_PROXY, master=False)
    return [servers.tools["nginx"], "-p", str(conf.parent), "-c", str(conf)], {}, conf.parent, port


SIM = ("--cache-sim=yes", "--branch-sim=yes")
# Derived per-request figures from callgrind's events (with --sim).
SIM_FIGURES = {
    "L1 miss": ("I1mr", "D1mr", "D1mw"),
    "LL miss": ("ILmr", "DLmr", "DLmw"),
    "branch mispredict": ("Bcm", "Bim"),
}


def measure(name: str, command: tuple[list[str], dict, Path, int], path: str, tmp: Path,
            wrk: str, connections: int, duration: int,
            sim: bool = False) -> tuple[int, dict[str, float]]:
    """Per-request event counts (Ir, and with `sim` the cache/branch events)."""
    args, env, cwd, port = command
    out = tmp / f"callgrind-{port}.out"
    proc = Proc(f"{name}-callgrind", [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
        *(SIM if sim else ()), *args], tmp, env, cwd=cwd)
    try:
        deadline = time.monotonic() + 300
        while get(port, path) != 200:
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{proc.log_tail()}")
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port}{path}"
        control = ["callgrind_control"]
        subprocess.run([*control, "-i", "on", str(proc.pid)], capture_output=True, check=True)
        # Warm up (specialized bytecode, pooled connections), then count from zero.
        subprocess.run([wrk, "-t1", f"-c{connections}", "-d3s", url], capture_output=True)
        subprocess.run([*control, "-z", str(proc.pid)], capture_output=True, check=True)
        text = subprocess.run([wrk, "-t1", f"-c{connections}", f"-d{duration}s", url],
                              capture_output=True, text=True).stdout
        subprocess.run([*control, "-d", str(proc.pid)], capture_output=True, check=True)
        requests = int(re.search(r"(\d+) requests in", text).group(1))
    finally:
        proc.stop()
    for dump in tmp.glob(f"callgrind-{port}.out*"):
        body = dump.read_text(errors="replace")
        if "Trigger: dump" in body:
            log(f"{name}: callgrind dump {dump}")
            events = re.search(r"^events: (.+)$", body, re.M).group(1).split()
            totals = re.search(r"^(?:summary|totals): ([\d ]+)$", body, re.M).group(1).split()
            return requests, {e: int(v) / requests for e, v in zip(events, totals, strict=False)}
    raise RuntimeError("no callgrind dump found")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", default=".",
                        help="comma-separated aiproxy source trees, extensions built in place")
    parser.add_argument("--cases", default="small", help="comma-separated of small,16k")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (1)")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--duration", type=int, default=10, help="seconds per run (10)")
    parser.add_argument("--nginx", action="store_true",
                        help="count nginx as a proxy too (one process, e2e.py's config)")
    parser.add_argument("--sim", action="store_true",
                        help="also simulate caches and branches (slower): misses per request")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep the callgrind dumps in DIR (for callgrind_annotate)")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        log("valgrind is needed (apt-get install valgrind)")
        return 1
    tools = ensure_tools(install=False)
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    if args.keep:
        tmp = Path(args.keep).resolve()
        tmp.mkdir(parents=True, exist_ok=True)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="aiproxy-instr-"))
    try:
        servers = Servers(tmp, tools, 0, 4096, trees[0])
        servers.start_backend()
        results: dict[tuple[str, Path | str], list[dict[str, float]]] = {}
        subjects: list[Path | str] = [*trees, *(["nginx"] if args.nginx else [])]
        for r in range(args.rounds):
            for case in args.cases.split(","):
                for subject in subjects:
                    if subject == "nginx":
                        command = nginx_command(servers)
                    else:
                        command = aiproxy_command(subject, servers.backend_port, tmp)
                    requests, per = measure(str(subject), command, CASES[case][0], tmp,
                                            tools["wrk"], args.connections, args.duration,
                                            args.sim)
                    results.setdefault((case, subject), []).append(per)
                    log(f"round {r + 1} {case:5s} {subject}: {per['Ir'] / 1000:.1f} K "
                        f"instructions per request ({requests} requests)")
        print(textwrap.dedent("""
            | case | tree | K instructions/request (median) | vs first tree |
            |------|------|---:|---:|"""))
        def median(case: str, subject: Path | str, events: tuple[str, ...]) -> float:
            vals = sorted(sum(per.get(e, 0) for e in events) for per in results[(case, subject)])
            return vals[len(vals) // 2]

        for case in args.cases.split(","):
            base = median(case, trees[0], ("Ir",))
            for subject in subjects:
                med = median(case, subject, ("Ir",))
                print(f"| {case} | {subject} | {med / 1000:.1f} | {med / base:.3f}x |")
        if args.sim:
            print("\n| case | tree | " + " | ".join(f"{f} /request" for f in SIM_FIGURES)
                  + " |\n|------|------|" + "---:|" * len(SIM_FIGURES))
            for case in args.cases.split(","):
                for subject in subjects:
                    cells = " | ".join(f"{median(case, subject, ev):.0f}"
                                       for ev in SIM_FIGURES.values())
                    print(f"| {case} | {subject} | {cells} |")
        return 0
    finally:
        Proc.stop_all()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
