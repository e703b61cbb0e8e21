"""Helpers shared by tests that run real processes on real ports."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def aiproxy_cli(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    """`python -m aiproxy ARGS` from the repository, output captured as text."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "aiproxy", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO_ROOT, env=env,
                          stdin=subprocess.DEVNULL)


_next_port = [0]


_given: collections.deque[int] = collections.deque(maxlen=512)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (another process may still take it).
    AIPROXY_TEST_PORTS=LOW-HIGH keeps the ports in that range (a shared machine where
    each user has a block of ports); unset, the kernel picks one."""
    span = os.environ.get("AIPROXY_TEST_PORTS")
    if span:
        low, high = (int(x) for x in span.split("-"))
        size = high - low + 1
        if not _next_port[0]:
            _next_port[0] = (os.getpid() * 7) % size
        for _ in range(size):
            port = low + _next_port[0] % size
            _next_port[0] += 1
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
        raise RuntimeError(f"no free port in AIPROXY_TEST_PORTS={span}")
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        # The kernel may hand the same free port to two calls in a row (CI once gave a
        # test's admin port to its listener): not one this process was just given.
        if port not in _given:
            _given.append(port)
            return port


def wait_port(
    host: str, port: int, timeout: float = 10, proc: subprocess.Popen | None = None
) -> None:
    """Block until host:port accepts a TCP connection.

    Raises TimeoutError after ``timeout`` seconds, or RuntimeError at once if ``proc`` (the
    process expected to listen) exits first; both messages include that process's log.
    """
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"process exited with {proc.returncode} before listening on {host}:{port}\n"
                + process_log(proc)
            )
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() >= deadline:
                log = process_log(proc) if proc is not None else ""
                raise TimeoutError(
                    f"nothing listening on {host}:{port} after {timeout}s\n{log}"
                ) from None
            time.sleep(0.05)


def wait_ready(admin_port: int, timeout: float = 20) -> None:
    """Block until the admin port's /readyz answers 200: every worker has told the
    supervisor it serves. A worker binds its listeners before it says so, so a
    listener (or the admin port) taking connections does not mean /metrics has every
    worker's counters yet; a baseline scrape must come after this."""
    import httpx

    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            r = httpx.get(f"http://127.0.0.1:{admin_port}/readyz", timeout=2)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"/readyz on {admin_port} not 200 after {timeout}s: {last}")
        time.sleep(0.05)


# Processes start_process started whose log stop_process has not removed yet, with the
# test that started each (tests/conftest.py stops and reports what a session leaves).
UNSTOPPED: dict[subprocess.Popen, str] = {}


def start_process(
    args: list[str], env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None
) -> subprocess.Popen:
    """Start ``args`` with stdout and stderr going to a temporary log file.

    ``env`` adds to (does not replace) os.environ. The repo root is the default working
    directory and is put first on PYTHONPATH, so ``python -m aiproxy...`` runs the tree.
    The log path is ``proc.log_path``; read it with ``process_log``.
    """
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH")) if p
    )
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    log = tempfile.NamedTemporaryFile(prefix="aiproxy-test-", suffix=".log", delete=False)
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd if cwd is not None else REPO_ROOT,
        )
    except BaseException:
        os.unlink(log.name)
        raise
    finally:
        log.close()  # the child has its own descriptor
    proc.log_path = log.name  # type: ignore[attr-defined]
    UNSTOPPED[proc] = os.environ.get("PYTEST_CURRENT_TEST", "") or " ".join(args)
    return proc


def process_log(proc: subprocess.Popen) -> str:
    """What the process has written to its log so far ('' if the log is gone)."""
    path = getattr(proc, "log_path", None)
    if path is None:
        return ""
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def stop_process(proc: subprocess.Popen, timeout: float = 5) -> str:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; removes the log and returns its text.

    Call it for a process that exited by itself too: it is what removes the log."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log = process_log(proc)
    path = getattr(proc, "log_path", None)
    if path is not None:
        Path(path).unlink(missing_ok=True)
    UNSTOPPED.pop(proc, None)
    return log


def start_demo_upstream(
    name: str = "demo", token_delay_ms: float = 0, host: str = "127.0.0.1",
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, int]:
    """Start aiproxy.demo.upstream on a free port and wait until it accepts connections;
    `extra`: more command-line arguments (e.g. ("--report-load", "60"))."""
    port = free_port(host)
    proc = start_process(
        [
            sys.executable,
            "-m",
            "aiproxy.demo.upstream",
            "--listen",
            f"{host}:{port}",
            "--name",
            name,
            "--token-delay-ms",
            str(token_delay_ms),
            *extra,
        ]
    )
    try:
        wait_port(host, port, proc=proc)
    except BaseException:
        stop_process(proc)
        raise
    return proc, port


async def read_request(reader: asyncio.StreamReader
                       ) -> tuple[str, str, dict[str, str], bytes] | None:
    """One request (a Content-Length body or none) for a scripted upstream: (method,
    target, fields by lower-cased name, body), or None when the connection ended."""
    line = await reader.readline()
    if not line:
        return None
    method, target, _ = line.decode().split(" ", 2)
    headers: dict[str, str] = {}
    while (h := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = h.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return method, target, headers, body


def wait_redis_keys(db: Any, n: int) -> None:
    """Until the Redis database `db` (a redis.Redis) holds n keys: the proxy sends its
    cache stores after the response, so a test waits for them (2 s at most)."""
    for _ in range(100):
        if db.dbsize() >= n:
            break
        time.sleep(0.02)
    assert db.dbsize() == n


def start_redis_server(workdir: str | os.PathLike) -> tuple[subprocess.Popen, int]:
    """A redis-server (Debian package) of the caller's own on a free loopback port, no
    persistence; stop it with stop_process."""
    port = free_port()
    proc = start_process(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                          "--save", "", "--appendonly", "no", "--dir", str(workdir)])
    try:
        wait_port("127.0.0.1", port, proc=proc)
    except BaseException:
        stop_process(proc)
        raise
    return proc, port


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def descendants(pid: int) -> list[int]:
    """pid and every process below it (a supervisor's workers sit under its forkserver)."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
    return out


def tree_rss_bytes(pid: int) -> int:
    """RSS of pid and its descendants: the whole proxy whether one process serves or a
    supervisor with workers does."""
    total = 0
    for member in descendants(pid):
        with contextlib.suppress(OSError, RuntimeError):
            total += rss_bytes(member)
    return total


def bytes_read(pid: int) -> int:
    """What the proxy (its processes) has read so far: rchar of /proc/PID/io, which
    counts the read() calls uvloop makes on sockets."""
    total = 0
    for member in descendants(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{member}/io").read_text().splitlines():
                if line.startswith("rchar:"):
                    total += int(line.split()[1])
    return total


def stops_reading(pid: int, timeout: float = 60) -> bool:
    """Waits until the proxy reads nothing more for half a second: with upstreams that
    have far more to send than it takes, it has paused every one of them (what it holds
    is then what it will hold). False if it still reads after `timeout` (a hang guard)."""
    last = -1
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = bytes_read(pid)
        if now == last:
            return True
        last = now
        time.sleep(0.5)
    return False


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime (/proc/PID/stat fields 14 and 15) of pid and its live descendants:
    a supervisor's workers do the proxying, and their time is not in the supervisor's
    until they exit."""
    ticks = 0
    for member in descendants(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


class RssMonitor:
    """Samples the RSS of a process and its descendants every few milliseconds; `growth`
    is peak minus baseline."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, RuntimeError):
                self.peak = max(self.peak, tree_rss_bytes(self.pid))
            self._stop.wait(0.005)

    def __enter__(self) -> RssMonitor:
        self.base = self.peak = tree_rss_bytes(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)
        with contextlib.suppress(OSError, RuntimeError):
            self.peak = max(self.peak, tree_rss_bytes(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.base

    def describe(self) -> str:
        return f"proxy RSS {self.base / 2**20:.1f} MiB -> peak {self.peak / 2**20:.1f} MiB"


# -- raw sockets ---------------------------------------------------------------------------


class StreamServerThread:
    """asyncio.start_server(handler) on 127.0.0.1 (`port`) with an event loop in a thread
    of its own: for upstreams a test scripts byte by byte. close() cancels what is still
    running there and stops it."""

    def __init__(self, handler: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(
                asyncio.start_server(handler, "127.0.0.1", self.port))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10), "the scripted upstream did not start"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _shutdown(self) -> None:
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def raw_exchange(port: int, request: bytes, until: bytes | None = None,
                 timeout: float = 10) -> bytes:
    """Send `request` as is to 127.0.0.1:port and read until EOF, or until `until` has
    been read (e.g. b"\\r\\n\\r\\n": a response head)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        out = bytearray()
        while until is None or until not in out:
            data = s.recv(1 << 20)
            if not data:
                break
            out += data
        return bytes(out)


def recv_exact(sock: socket.socket, n: int, timeout: float | None = None) -> bytes:
    """n bytes from sock, or fewer if it reaches EOF first (`timeout`: set on sock)."""
    if timeout is not None:
        sock.settimeout(timeout)
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            break
        buf += data
    return bytes(buf)


# -- upstream servers ----------------------------------------------------------------------


@contextlib.contextmanager
def serve_aiohttp(app: Any, port: int | None = None) -> Iterator[int]:
    """Run an aiohttp Application on 127.0.0.1 in a thread of its own (own event loop);
    yields its port."""
    import asyncio

    from aiohttp import web

    port = port or free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_port("127.0.0.1", port)
        yield port
    finally:
        if loop.is_running():
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@contextlib.contextmanager
def run_nginx(workdir: Path, server: str, connections: int = 256,
              http_extra: str = "", listen_extra: str = "") -> Iterator[int]:
    """nginx (Debian package) in the foreground on a free loopback port with one
    `server { listen ... <listen_extra>; <server> }` block (listen_extra "http2": h2c
    with prior knowledge); yields the port. Skips the test if nginx is not installed."""
    import shutil

    import pytest

    if shutil.which("nginx") is None:
        pytest.skip("nginx is not installed")
    port = free_port()
    root = workdir / "nginx"
    (root / "logs").mkdir(parents=True)
    conf = root / "nginx.conf"
    temp = "\n".join(f"    {kind}_temp_path {root}/{kind.split('_')[-1]};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    conf.write_text(f"""
daemon off;
master_process off;
worker_processes 1;
pid {root}/nginx.pid;
error_log stderr warn;
events {{ worker_connections {connections}; }}
http {{
    access_log off;
{temp}
    keepalive_requests 10000;
{http_extra}
    server {{
        listen 127.0.0.1:{port} {listen_extra};
{server}
    }}
}}
""")
    proc = start_process(["nginx", "-p", str(root), "-c", str(conf)])
    try:
        wait_port("127.0.0.1", port, proc=proc)
        yield port
    finally:
        stop_process(proc)


# -- the admin API -------------------------------------------------------------------------


def admin_block(port: int, token: str | None = None) -> str:
    """An [admin] section on 127.0.0.1:port (with a bearer token if given)."""
    line = f'token = "{token}"\n' if token else ""
    return f'\n[admin]\naddress = "127.0.0.1:{port}"\n{line}'


def scrape(port: int, token: str | None = None) -> dict[tuple, float]:
    """GET /metrics from the admin API: {(sample name, sorted labels): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=headers).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


# -- configs -------------------------------------------------------------------------------


def intent_routes_config(bank: int, general: int, semantic: str) -> str:
    """Clusters `bank` and `general` with routes: /echo with intent_domain banking to bank,
    the rest to general; `semantic`: the [semantic] section's lines."""
    return f"""
[semantic]
{semantic}

[[clusters]]
name = "bank"
endpoints = ["127.0.0.1:{bank}"]

[[clusters]]
name = "general"
endpoints = ["127.0.0.1:{general}"]

[[routes]]
name = "banking"
match = {{ path_prefix = "/echo", intent_domain = "banking" }}
cluster = "bank"

[[routes]]
name = "rest"
match = {{ path_prefix = "/" }}
cluster = "general"
"""
