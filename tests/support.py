"""Helpers shared by tests that run real processes on real ports."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
    """SIGTERM, then SIGKILL after ``timeout`` seconds; removes the log and returns its text."""
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
