"""Helpers shared by tests that run real processes on real ports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
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
    name: str = "demo", token_delay_ms: float = 0, host: str = "127.0.0.1"
) -> tuple[subprocess.Popen, int]:
    """Start aiproxy.demo.upstream on a free port and wait until it accepts connections."""
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
        ]
    )
    try:
        wait_port(host, port, proc=proc)
    except BaseException:
        stop_process(proc)
        raise
    return proc, port
