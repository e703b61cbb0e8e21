#!/usr/bin/env python3
"""End-to-end comparison: aiproxy beside nginx and haproxy, in front of one nginx backend.

    python bench/e2e.py [--rounds N] [--duration S] [--quick] [--json PATH] ...
    make bench-e2e [E2E_ARGS="--quick"]

Everything runs on 127.0.0.1 free ports, in a temporary directory:

- backend: nginx, 1 worker, access_log off: `/small` is `return 200 "ok"`, `/files/16k.bin`
  and `/files/1m.bin` are static files (16 KiB and 1 MiB).
- nginx as reverse proxy: 1 worker, upstream keepalive 64, proxy_http_version 1.1,
  `Connection ""`, proxy_max_temp_file_size 0 (no temp-file writes for 1 MiB bodies).
- haproxy: nbthread 1, http-reuse always.
- aiproxy: `python -m aiproxy -c` with a generated config, 1 worker,
  max_idle_connections 128, access log off (defaults otherwise: X-Forwarded-* and Via are added).
Keep-alive request limits are lifted on every hop (nginx keepalive_requests, aiproxy
max_keepalive_requests / max_requests_per_connection = 0; haproxy has none), so no proxy
pays for reconnects the others do not.

Each proxy is checked once (status and body length on every path), then driven with wrk
(-t1 -c64, HTTP/1.1 keep-alive) in interleaved rounds: for each round and case, every proxy
runs once, the order rotating from round to round. Per run it records requests/s, MB/s,
p50/p99 latency (from a wrk Lua `done()`), proxy CPU microseconds per request (utime+stime
from /proc/PID/stat over the run) and peak RSS (VmHWM, reset before each run through
/proc/PID/clear_refs). For nginx the measured processes are the master's children (the
worker); for haproxy and aiproxy the process itself. The table shows medians over rounds
and each figure as a ratio to nginx.

The idle case restarts each proxy fresh, warms it up for a second, then opens N (10,000)
keep-alive connections that each send one request and stay idle, and reports the serving
processes' RSS growth (VmRSS after minus before) per connection.

Results are printed as tables and written as JSON (default bench/results/e2e-<date>.json;
`--quick` writes JSON only with --json). nginx, haproxy and wrk are installed through
scripts/bootstrap.sh --test (apt-get) only when one of them is missing. Every process this
script starts is stopped on exit, Ctrl-C or SIGTERM; the children also get SIGTERM if this
script dies without cleaning up (PR_SET_PDEATHSIG).

Exit status: 0 when every proxy answered every check and every run without non-2xx
responses, 1 otherwise, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime as dt
import http.client
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# --pin: the CPUs this script may use, the last for the proxy under test.
ALL_CPUS = os.sched_getaffinity(0)
LAST_CPU = max(ALL_CPUS)
OTHER_CPUS = ALL_CPUS - {LAST_CPU}
PROXIES = ("nginx", "haproxy", "aiproxy")
BASELINE = "aiproxy-base"  # --baseline-tree: a second aiproxy build for A/B runs
IDLE_CONCURRENCY = 256  # idle connections being opened at once

# name -> (path, body bytes, description)
CASES: dict[str, tuple[str, int, str]] = {
    "small": ("/small", 2, 'small responses: GET /small, 2-byte body (nginx `return 200 "ok"`)'),
    "16k": ("/files/16k.bin", 16 * 1024, "16 KiB responses: GET /files/16k.bin (static file)"),
    "1m": ("/files/1m.bin", 1024 * 1024, "1 MiB body download: GET /files/1m.bin"),
}

WRK_SCRIPT = """\
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,"connect_errors":%d,' ..
    '"read_errors":%d,"write_errors":%d,"status_errors":%d,"timeouts":%d,' ..
    '"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.mean, latency.max))
end
"""


def log(msg: str) -> None:
    print(f"e2e: {msg}", file=sys.stderr, flush=True)


# -- processes -----------------------------------------------------------------------------

def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def aiproxy_config(port: int, backend: int) -> str:
    """aiproxy's side of the comparison: one worker, keep-alive both ways, no access log."""
    return f"""\
[server]
workers = 1
drain_timeout_ms = 1000

[http]
keepalive_timeout_ms = 300000
max_keepalive_requests = 0

[[listeners]]
name = "bench"
address = "127.0.0.1:{port}"
backlog = 4096

# nginx's side runs with access_log off too.
[access_log]
path = "off"

[[clusters]]
name = "backend"
endpoints = ["127.0.0.1:{backend}"]
max_idle_connections = 128
max_requests_per_connection = 0
idle_timeout_ms = 300000

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "backend"
"""


class Proc:
    """A started server process, in its own session (a Ctrl-C in the terminal reaches
    only this script, which then stops the servers in order)."""

    registry: list[Proc] = []

    def __init__(self, name: str, args: list[str], logdir: Path,
                 env: dict[str, str] | None = None, cwd: Path = REPO) -> None:
        self.name = name
        self.log_path = logdir / f"{name}-{len(Proc.registry)}.log"
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        with open(self.log_path, "wb") as logf:
            self.popen = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                cwd=cwd, env=full_env, start_new_session=True, preexec_fn=_die_with_parent)
        self.pid = self.popen.pid
        Proc.registry.append(self)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def children(self) -> list[int]:
        return children_of(self.pid)

    def serving_pids(self) -> list[int]:
        """nginx: the master's children (workers); otherwise the process itself."""
        return self.children() or [self.pid]

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 5.0) -> None:
        if self in Proc.registry:
            Proc.registry.remove(self)
        kids = self.children()
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"{self.name} (pid {self.pid}) ignored SIGTERM; killing it")
        # Whatever is left of the session this process leads (workers of a killed master).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in kids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    @classmethod
    def stop_all(cls) -> None:
        for proc in reversed(list(cls.registry)):
            proc.stop()


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return sorted(out)


def cpu_ticks(pids: list[int]) -> tuple[int, int]:
    """(utime, stime) clock ticks of pids, summed."""
    user = system = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        user += int(fields[11])  # utime, stime (fields 14 and 15)
        system += int(fields[12])
    return user, system


def steal_ticks(cpus: set[int]) -> int:
    """Clock ticks the hypervisor gave to others while these CPUs wanted to run (the
    8th value of their /proc/stat lines): noise this machine cannot see otherwise."""
    total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            total += int(values[7])
    return total


def status_kib(pids: list[int], key: str) -> int:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                total += int(line.split()[1])
                break
    return total


def reset_peak_rss(pids: list[int]) -> bool:
    ok = True
    for pid in pids:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            ok = False
    return ok


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: Proc, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before "
                               f"listening on {port}:\n{proc.log_tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} not listening on {port} after {timeout}s:\n"
                                   f"{proc.log_tail()}") from None
            time.sleep(0.05)


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/sbin", "/usr/local/sbin"):
        if os.access(f"{d}/{name}", os.X_OK):
            return f"{d}/{name}"
    return None


def ensure_tools(install: bool) -> dict[str, str]:
    tools = {t: find_tool(t) for t in ("nginx", "haproxy", "wrk")}
    missing = [t for t, p in tools.items() if p is None]
    if missing and install:
        log(f"missing {', '.join(missing)}: running scripts/bootstrap.sh --test")
        subprocess.run([str(REPO / "scripts" / "bootstrap.sh"), "--test"], check=True)
        tools = {t: find_tool(t) for t in tools}
        missing = [t for t, p in tools.items() if p is None]
    if missing:
        raise SystemExit(f"e2e: missing {', '.join(missing)} (install them or drop --no-install)")
    return tools  # type: ignore[return-value]


def raise_nofile(want: int) -> int:
    """Raise RLIMIT_NOFILE (inherited by the servers) towards `want`; return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want:
        with contextlib.suppress(ValueError, OSError):  # only root may raise the hard limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# -- servers -------------------------------------------------------------------------------

NGINX_COMMON = """\
daemon off;
master_process on;
worker_processes 1;
worker_rlimit_nofile {nofile};
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections {worker_connections}; }}
"""

NGINX_TEMP = """\
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
"""

# nginx as the reverse proxy under comparison (the http-block part).
NGINX_PROXY = """\
access_log off;
keepalive_timeout 300s;
keepalive_requests 1000000;
upstream backend {{
    server 127.0.0.1:{backend};
    keepalive 64;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
}}
server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
        proxy_pass http://backend;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_max_temp_file_size 0;
    }}
}}
"""


class Servers:
    """The backend and the three proxies, each on its own free port."""

    def __init__(self, tmp: Path, tools: dict[str, str], idle: int, nofile: int,
                 aiproxy_tree: Path, baseline_tree: Path | None = None) -> None:
        self.tmp = tmp
        self.aiproxy_tree = aiproxy_tree
        self.baseline_tree = baseline_tree
        self.tools = tools
        self.nofile = nofile
        self.worker_connections = idle + 2048
        self.backend_port = 0
        self.backend: Proc | None = None
        self.proxies: dict[str, Proc] = {}
        self.ports: dict[str, int] = {}

    def nginx_config(self, name: str, body: str, master: bool = True) -> tuple[Path, int]:
        """Write nginx.conf for `body` (an http-block part) under tmp/name: (its path, port).
        master=False: one process (bench/instr_per_request.py runs it under callgrind)."""
        root = self.tmp / name
        root.mkdir(exist_ok=True)
        port = free_port()
        common = NGINX_COMMON if master else NGINX_COMMON.replace(
            "master_process on;", "master_process off;")
        conf = root / "nginx.conf"
        conf.write_text(
            common.format(root=root, nofile=self.nofile,
                          worker_connections=self.worker_connections)
            + "http {\n" + NGINX_TEMP.format(root=root)
            + textwrap.indent(body.format(port=port, www=self.tmp / "www",
                                          backend=self.backend_port), "    ")
            + "}\n")
        return conf, port

    def _nginx(self, name: str, body: str) -> tuple[Proc, int]:
        conf, port = self.nginx_config(name, body)
        proc = Proc(name, [self.tools["nginx"], "-p", str(conf.parent), "-c", str(conf)],
                    self.tmp)
        wait_port(port, proc)
        return proc, port

    def start_backend(self) -> None:
        www = self.tmp / "www" / "files"
        www.mkdir(parents=True)
        for name, size in (("16k.bin", 16 * 1024), ("1m.bin", 1024 * 1024)):
            (www / name).write_bytes(bytes(i % 251 for i in range(251)) * (size // 251)
                                     + b"x" * (size % 251))
        # nginx workers run as an unprivileged user when started by root.
        for p in (self.tmp, self.tmp / "www", www, *www.iterdir()):
            p.chmod(0o755 if p.is_dir() else 0o644)
        self.backend, self.backend_port = self._nginx("backend", """\
access_log off;
sendfile on;
keepalive_timeout 300s;
keepalive_requests 1000000;
server {{
    listen 127.0.0.1:{port} backlog=4096;
    location = /small {{ default_type text/plain; return 200 "ok"; }}
    location /files/ {{ root {www}; }}
}}
""")

    def start(self, name: str) -> None:
        if name == BASELINE:
            self._start_aiproxy(BASELINE, self.baseline_tree)
        else:
            getattr(self, f"_start_{name}")()

    def restart(self, name: str) -> None:
        self.proxies.pop(name).stop()
        self.start(name)

    def _start_nginx(self) -> None:
        self.proxies["nginx"], self.ports["nginx"] = self._nginx("nginx", NGINX_PROXY)

    def _start_haproxy(self) -> None:
        port = free_port()
        conf = self.tmp / "haproxy.cfg"
        conf.write_text(textwrap.dedent(f"""\
            global
                nbthread 1
                maxconn {self.worker_connections}
                # haproxy wants 2 descriptors per maxconn; without CAP_SYS_RESOURCE the
                # hard RLIMIT_NOFILE may be lower, which is only a warning this way.
                no strict-limits
            defaults
                mode http
                timeout connect 5s
                timeout client 300s
                timeout server 300s
                timeout http-keep-alive 300s
                http-reuse always
            frontend fe
                bind 127.0.0.1:{port}
                maxconn {self.worker_connections}
                default_backend be
            backend be
                server backend 127.0.0.1:{self.backend_port}
            """))
        proc = Proc("haproxy", [self.tools["haproxy"], "-db", "-f", str(conf)], self.tmp)
        wait_port(port, proc)
        self.proxies["haproxy"], self.ports["haproxy"] = proc, port

    def _start_aiproxy(self, name: str = "aiproxy", tree: Path | None = None) -> None:
        port = free_port()
        conf = self.tmp / f"{name}.toml"
        conf.write_text(aiproxy_config(port, self.backend_port))
        tree = tree or self.aiproxy_tree
        env = {"PYTHONPATH": os.pathsep.join(
            p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)}
        proc = Proc(name, [sys.executable, "-m", "aiproxy", "-c", str(conf)], self.tmp, env,
                    cwd=tree)
        wait_port(port, proc)
        self.proxies[name], self.ports[name] = proc, port

    def check(self, name: str) -> list[str]:
        """Every path answers 200 with the right body length; returns the problems."""
        port = self.ports[name] if name in self.ports else self.backend_port
        problems = []
        for path, size, _ in CASES.values():
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("GET", path)
                resp = conn.getresponse()
                body = resp.read()
                conn.close()
            except (OSError, http.client.HTTPException) as exc:
                problems.append(f"{name} GET {path}: {exc!r}")
                continue
            if resp.status != 200 or len(body) != size:
                problems.append(f"{name} GET {path}: status {resp.status}, {len(body)} bytes, "
                                f"expected 200 and {size}")
        return problems


# -- load ----------------------------------------------------------------------------------

def pin(pids: list[int], cpus: set[int]) -> None:
    """Every thread of these processes onto `cpus` (sched_setaffinity is per thread)."""
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except FileNotFoundError:
            continue
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, cpus)


def run_wrk(wrk: str, script: Path, port: int, path: str, duration: int,
            connections: int, cpus: set[int] | None = None) -> dict:
    args = [wrk, "-t1", f"-c{connections}", f"-d{duration}s", "--timeout", "5s",
            "-s", str(script), f"http://127.0.0.1:{port}{path}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=duration + 60,
                         preexec_fn=None if cpus is None else
                         (lambda: os.sched_setaffinity(0, cpus)))
    for line in out.stdout.splitlines():
        if line.startswith("WRKJSON "):
            return json.loads(line[8:])
    raise RuntimeError(f"wrk printed no summary (exit {out.returncode}):\n"
                       f"{out.stdout}\n{out.stderr}")


def measure_run(servers: Servers, name: str, case: str, duration: int, connections: int,
                wrk: str, script: Path, pinned: bool = False) -> dict:
    proc = servers.proxies[name]
    pids = proc.serving_pids()
    if pinned:  # the proxy alone on the last CPU; wrk (and the backend) on the others
        pin(pids, {LAST_CPU})
    peak_reset = reset_peak_rss(pids)
    watched = {LAST_CPU} if pinned else ALL_CPUS
    steal0 = steal_ticks(watched)
    cpu0 = cpu_ticks(pids)
    w = run_wrk(wrk, script, servers.ports[name], CASES[case][0], duration, connections,
                OTHER_CPUS if pinned else None)
    cpu1 = cpu_ticks(pids)
    steal1 = steal_ticks(watched)
    if pinned:
        pin(pids, ALL_CPUS)
    if not proc.alive():
        raise RuntimeError(f"{name} exited during the run:\n{proc.log_tail()}")
    seconds = w["duration_us"] / 1e6
    user_s = (cpu1[0] - cpu0[0]) / CLK_TCK
    sys_s = (cpu1[1] - cpu0[1]) / CLK_TCK
    cpu_s = user_s + sys_s
    n = max(w["requests"], 1)
    return {
        "requests": w["requests"],
        "rps": w["requests"] / seconds,
        "mb_s": w["bytes"] / seconds / 1e6,
        "p50_ms": w["p50_us"] / 1000,
        "p99_ms": w["p99_us"] / 1000,
        "cpu_us_per_req": cpu_s * 1e6 / n,
        "user_us_per_req": user_s * 1e6 / n,
        "sys_us_per_req": sys_s * 1e6 / n,
        "cpu_util": cpu_s / seconds,
        # of the proxy's CPU when pinned, else of all CPUs on average
        "steal_pct": (steal1 - steal0) / CLK_TCK / seconds / len(watched) * 100,
        "peak_rss_mib": status_kib(pids, "VmHWM") / 1024,
        "peak_since_start": not peak_reset,
        "errors": {k: w[k] for k in ("connect_errors", "read_errors", "write_errors",
                                     "status_errors", "timeouts")},
    }


class IdleClient(asyncio.Protocol):
    """Sends one request, reads the response, then stays connected and silent."""

    def __init__(self, request: bytes, done: asyncio.Future) -> None:
        self.request = request
        self.done = done
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].lower()
        length = 0
        for line in head.split(b"\r\n")[1:]:
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        if len(self.buf) >= end + 4 + length:
            status = int(self.buf[9:12])
            self.buf = b""
            self.done.set_result(status)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.done.done():
            self.done.set_result(0)  # closed before the response (a result, not an exception:
            # nobody may be waiting any more when the run is being interrupted)


async def open_idle(port: int, count: int) -> tuple[list[IdleClient], list[str]]:
    loop = asyncio.get_running_loop()
    request = b"GET /small HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    sem = asyncio.Semaphore(IDLE_CONCURRENCY)
    clients: list[IdleClient] = []
    problems: list[str] = []

    async def one() -> None:
        async with sem:
            done = loop.create_future()
            try:
                async with asyncio.timeout(30):
                    _, client = await loop.create_connection(
                        lambda: IdleClient(request, done), "127.0.0.1", port)
                    clients.append(client)
                    status = await done
                if status != 200:
                    problems.append(f"status {status}" if status else "closed before the response")
            except (OSError, TimeoutError) as exc:
                problems.append(repr(exc))

    await asyncio.gather(*(one() for _ in range(count)))
    return clients, problems


async def idle_case(servers: Servers, name: str, count: int) -> dict:
    proc = servers.proxies[name]
    pids = proc.serving_pids()
    before = status_kib(pids, "VmRSS")
    clients, problems = await open_idle(servers.ports[name], count)
    await asyncio.sleep(1.0)  # let the proxy settle (buffers freed, timers armed)
    after = status_kib(pids, "VmRSS")
    alive = sum(1 for c in clients if not c.lost)
    for c in clients:
        if c.transport is not None:
            c.transport.close()
    await asyncio.sleep(0.2)
    if not proc.alive():
        problems.append(f"{name} exited:\n{proc.log_tail()}")
    growth = (after - before) / 1024
    return {
        "connections": count,
        "open_at_end": alive,
        "rss_before_mib": before / 1024,
        "rss_after_mib": after / 1024,
        "growth_mib": growth,
        "kib_per_conn": (after - before) / max(alive, 1),
        "problems": problems[:5],
        "failed": len(problems),
    }


# -- report --------------------------------------------------------------------------------

def medians(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    med["errors"] = {k: sum(r["errors"][k] for r in runs) for k in runs[0]["errors"]}
    return med


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i else ("-" * (w + 2))
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


THROUGHPUT_COLUMNS = [  # (header, key, format)
    ("req/s", "rps", "{:,.0f}"),
    ("p50 ms", "p50_ms", "{:.2f}"),
    ("p99 ms", "p99_ms", "{:.2f}"),
    ("CPU us/req", "cpu_us_per_req", "{:.1f}"),
    ("user us/req", "user_us_per_req", "{:.1f}"),
    ("sys us/req", "sys_us_per_req", "{:.1f}"),
    ("peak RSS MiB", "peak_rss_mib", "{:.1f}"),
]


def case_table(case: str, result: dict[str, dict]) -> str:
    cols = list(THROUGHPUT_COLUMNS)
    if case == "1m":
        cols.insert(0, ("MB/s", "mb_s", "{:,.0f}"))
    base = result.get("nginx", {}).get("median", {})
    rows = []
    for name, res in result.items():
        med = res["median"]
        row = [name]
        for _, key, fmt in cols:
            row.append(f"{fmt.format(med[key])} ({ratio(med[key], base.get(key, 0))})")
        row.append(f"{med['cpu_util'] * 100:.0f}%")
        row.append(f"{med.get('steal_pct', 0):.1f}%")
        errors = sum(med["errors"].values())
        row.append(str(errors) if errors else "0")
        rows.append(row)
    headers = ["proxy", *(h for h, _, _ in cols), "CPU busy", "steal", "errors"]
    return table(headers, rows)


def paired(result: dict[str, dict]) -> dict[str, dict[str, list[float]]]:
    """Each proxy's figures over nginx's from the same round (runs next to each other, so
    a slow spell of the machine mostly hits both): per key, the sorted ratios."""
    if "nginx" not in result:
        return {}
    base = result["nginx"]["rounds"]
    out: dict[str, dict[str, list[float]]] = {}
    for name, res in result.items():
        if name == "nginx":
            continue
        out[name] = {key: sorted(r[key] / b[key] for r, b in zip(res["rounds"], base, strict=True)
                                 if b[key])
                     for key in ("rps", "cpu_us_per_req", "user_us_per_req")}
    return out


def paired_lines(result: dict[str, dict]) -> str:
    lines = []
    for name, ratios in paired(result).items():
        cells = []
        for label, key in (("req/s", "rps"), ("CPU/req", "cpu_us_per_req"),
                           ("user/req", "user_us_per_req")):
            vals = ratios[key]
            if vals:
                cells.append(f"{label} {statistics.median(vals):.2f}x "
                             f"({vals[0]:.2f}-{vals[-1]:.2f})")
        lines.append(f"  {name}: " + ", ".join(cells))
    if not lines:
        return ""
    return ("\nratio to nginx in the same round, median of rounds (lowest-highest):\n"
            + "\n".join(lines))


def idle_table(result: dict[str, dict]) -> str:
    base = result.get("nginx", {}).get("median", {})
    rows = []
    for name, res in result.items():
        med = res["median"]
        rows.append([
            name, f"{med['open_at_end']:,.0f}", f"{med['rss_before_mib']:.1f}",
            f"{med['rss_after_mib']:.1f}",
            f"{med['growth_mib']:.1f} ({ratio(med['growth_mib'], base.get('growth_mib', 0))})",
            f"{med['kib_per_conn']:.2f} ({ratio(med['kib_per_conn'], base.get('kib_per_conn', 0))})",
            str(res["failed"]),
        ])
    return table(["proxy", "open conns", "RSS before MiB", "RSS after MiB", "growth MiB",
                  "KiB/conn", "failed"], rows)


def version_of(args: list[str]) -> str:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0].strip() if text else "?"


def host_info(tools: dict[str, str], tree: Path) -> dict:
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    commit = version_of(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"])
    # Changed or new files in what the proxy runs (the package and its build).
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "aiproxy",
                            "setup.py"], capture_output=True, text=True).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "nginx": version_of([tools["nginx"], "-v"]),
        "haproxy": version_of([tools["haproxy"], "-v"]),
        "wrk": version_of([tools["wrk"], "-v"]),
        "aiproxy_tree": str(tree),
        "aiproxy_commit": commit + ("-dirty" if dirty else ""),
    }


# -- main ----------------------------------------------------------------------------------

def rotated(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, help="interleaved rounds (3; --quick: 1)")
    p.add_argument("--duration", type=int, help="seconds per wrk run (8; --quick: 3)")
    p.add_argument("--quick", action="store_true",
                   help="1 round x 3 s, 1,000 idle connections: a functional pass")
    p.add_argument("--connections", type=int, default=64, help="wrk connections (64)")
    p.add_argument("--idle", type=int, help="idle keep-alive connections (10000; --quick: 1000)")
    p.add_argument("--cases", default="small,16k,1m,idle",
                   help="comma-separated subset of small,16k,1m,idle (all)")
    p.add_argument("--proxies", default=",".join(PROXIES),
                   help="comma-separated subset of nginx,haproxy,aiproxy (all)")
    p.add_argument("--json", metavar="PATH",
                   help="where to write results (bench/results/e2e-<date>.json; "
                        "--quick: none unless given)")
    p.add_argument("--no-install", action="store_true",
                   help="fail instead of running scripts/bootstrap.sh when a tool is missing")
    p.add_argument("--keep-tmp", action="store_true", help="keep configs and logs")
    p.add_argument("--aiproxy-tree", type=Path, default=REPO, metavar="DIR",
                   help="run aiproxy from this source tree, with its extensions built in place "
                        "(this repository); e.g. a clone at a fixed commit while the working "
                        "tree is being edited")
    p.add_argument("--pin", action="store_true",
                   help="during each measured run, the proxy under test alone on the last "
                        "CPU, wrk and the backend on the others (steadier rounds; needs 2+ "
                        "CPUs)")
    p.add_argument("--baseline-tree", type=Path, metavar="DIR",
                   help="also run aiproxy from this tree as 'aiproxy-base', interleaved with "
                        "the others (A/B of two builds in one run)")
    a = p.parse_args(argv)
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.duration = a.duration or (3 if a.quick else 8)
    a.idle = a.idle if a.idle is not None else (1000 if a.quick else 10_000)
    a.warmup = 1 if a.quick else 2
    a.cases = [c for c in a.cases.split(",") if c]
    a.proxies = [x for x in a.proxies.split(",") if x]
    a.aiproxy_tree = a.aiproxy_tree.resolve()
    if a.baseline_tree is not None:
        a.baseline_tree = a.baseline_tree.resolve()
        a.proxies.append(BASELINE)
    if "aiproxy" in a.proxies and not list((a.aiproxy_tree / "aiproxy" / "_fast").glob("h1.*.so")):
        p.error(f"no compiled aiproxy/_fast/h1 in {a.aiproxy_tree}: run scripts/bootstrap.sh "
                "there, or `python setup.py build_ext --inplace`")
    for c in a.cases:
        if c not in CASES and c != "idle":
            p.error(f"unknown case {c!r}")
    for x in a.proxies:
        if x not in PROXIES and x != BASELINE:
            p.error(f"unknown proxy {x!r}")
    if a.pin and len(ALL_CPUS) < 2:
        p.error("--pin needs at least 2 CPUs")
    return a


def run(args: argparse.Namespace, tmp: Path) -> int:
    tools = ensure_tools(not args.no_install)
    nofile = raise_nofile(2 * args.idle + 4096)
    if "idle" in args.cases and nofile < args.idle + 1024:
        log(f"RLIMIT_NOFILE is {nofile}: idle case reduced to {nofile - 1024} connections")
        args.idle = nofile - 1024
    script = tmp / "report.lua"
    script.write_text(WRK_SCRIPT)
    started = dt.datetime.now(dt.UTC)
    info = host_info(tools, args.aiproxy_tree)
    if args.baseline_tree is not None:
        info["baseline_tree"] = str(args.baseline_tree)
        info["baseline_commit"] = version_of(
            ["git", "-C", str(args.baseline_tree), "rev-parse", "--short", "HEAD"])
    load_start = round(os.getloadavg()[0], 2)
    if (info["cpus"] or 1) < 3:
        log(f"{info['cpus']} CPUs: wrk, the backend and the proxy share them; read ratios, "
            "not absolute numbers")
    servers = Servers(tmp, tools, args.idle, nofile, args.aiproxy_tree, args.baseline_tree)
    servers.start_backend()
    if args.pin:
        pin(servers.backend.serving_pids(), OTHER_CPUS)
        info["pinned"] = f"proxy under test on CPU {LAST_CPU}, wrk and backend on the others"
    problems = servers.check("backend")
    for name in args.proxies:
        servers.start(name)
        problems += servers.check(name)
    if problems:
        for prob in problems:
            log(prob)
        return 1

    load_cases = [c for c in args.cases if c in CASES]
    results: dict[str, dict[str, dict]] = {c: {} for c in load_cases}
    runs: dict[str, dict[str, list]] = {c: {n: [] for n in args.proxies} for c in load_cases}
    for case in load_cases:
        for name in args.proxies:
            run_wrk(tools["wrk"], script, servers.ports[name], CASES[case][0], args.warmup,
                    args.connections)
    for rnd in range(args.rounds):
        for case in load_cases:
            for name in rotated(args.proxies, rnd):
                r = measure_run(servers, name, case, args.duration, args.connections,
                                tools["wrk"], script, args.pin)
                runs[case][name].append(r)
                log(f"round {rnd + 1}/{args.rounds} {case:5} {name:12} {r['rps']:>10,.0f} req/s "
                    f"{r['cpu_us_per_req']:6.1f} us/req (user {r['user_us_per_req']:.1f}, "
                    f"sys {r['sys_us_per_req']:.1f})  p99 {r['p99_ms']:.2f} ms")
                time.sleep(0.3)
    for case in load_cases:
        for name in args.proxies:
            results[case][name] = {"median": medians(runs[case][name]),
                                   "rounds": runs[case][name]}

    idle: dict[str, dict] = {}
    if "idle" in args.cases:
        idle_runs: dict[str, list] = {n: [] for n in args.proxies}
        for rnd in range(args.rounds):
            for name in rotated(args.proxies, rnd):
                servers.restart(name)
                run_wrk(tools["wrk"], script, servers.ports[name], "/small", 1,
                        args.connections)
                time.sleep(0.5)
                r = asyncio.run(idle_case(servers, name, args.idle))
                idle_runs[name].append(r)
                log(f"round {rnd + 1}/{args.rounds} idle  {name:8} {r['open_at_end']:,} open, "
                    f"+{r['growth_mib']:.1f} MiB, {r['kib_per_conn']:.2f} KiB/conn, "
                    f"{r['failed']} failed")
        for name, rs in idle_runs.items():
            keys = ["open_at_end", "rss_before_mib", "rss_after_mib", "growth_mib", "kib_per_conn"]
            idle[name] = {"median": {k: statistics.median(r[k] for r in rs) for k in keys},
                          "failed": sum(r["failed"] for r in rs), "rounds": rs}

    # -- output
    print(f"\naiproxy end-to-end comparison, {started:%Y-%m-%d %H:%M} UTC, "
          f"{info['cpus']} CPUs ({info['cpu_model']}), commit {info['aiproxy_commit']}")
    print(f"wrk -t1 -c{args.connections}, HTTP/1.1 keep-alive, {args.rounds} interleaved round(s) "
          f"x {args.duration} s; medians, (ratio to nginx); 1-minute load average "
          f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    if args.pin:
        print(f"pinned: {info['pinned']}")
    for case in load_cases:
        print(f"\n{CASES[case][2]}\n")
        print(case_table(case, results[case]))
        print(paired_lines(results[case]))
    if idle:
        print(f"\n{args.idle:,} idle keep-alive connections (one request each, then idle; "
              "RSS of the serving processes)\n")
        print(idle_table(idle))

    ok = True
    for case in load_cases:
        for name, res in results[case].items():
            if any(r["requests"] == 0 or r["errors"]["status_errors"] for r in res["rounds"]):
                log(f"{name} {case}: a run had no requests or non-2xx responses")
                ok = False
    for name, res in idle.items():
        if res["failed"]:
            log(f"{name} idle: {res['failed']} connections failed: {res['rounds'][0]['problems']}")
            ok = False

    out_path = args.json
    if out_path is None and not args.quick:
        out_path = RESULTS_DIR / f"e2e-{started:%Y-%m-%d}.json"
    if out_path:
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "date": started.isoformat(timespec="seconds"),
            "command": " ".join(["python", "bench/e2e.py", *sys.argv[1:]]),
            "host": info,
            "loadavg_1m": {"start": load_start, "end": round(os.getloadavg()[0], 2)},
            "settings": {"rounds": args.rounds, "duration_s": args.duration,
                         "connections": args.connections, "idle_connections": args.idle,
                         "wrk_threads": 1},
            "cases": results,
            "paired_ratios": {c: paired(results[c]) for c in load_cases},
            "idle": idle,
            "ok": ok,
        }
        out_path.write_text(json.dumps(_round_floats(doc), indent=1) + "\n")
        log(f"results written to {out_path}")
    return 0 if ok else 1


def _round_floats(obj: object) -> object:
    if isinstance(obj, float):
        return round(obj, 3)
    if isinstance(obj, dict):
        return {k: _round_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_round_floats(v) for v in obj]
    return obj


@contextlib.contextmanager
def _terminate_on_signals() -> Iterator[None]:
    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old: dict[int, Callable | int | None] = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="aiproxy-e2e-"))
    try:
        with _terminate_on_signals():
            return run(args, tmp)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except RuntimeError as exc:
        log(str(exc))
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut cleanup
        Proc.stop_all()
        if args.keep_tmp:
            log(f"configs and logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
