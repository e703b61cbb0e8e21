"""Fixtures that run the real proxy and real upstreams as processes on 127.0.0.1."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import (
    UNSTOPPED,
    free_port,
    process_log,
    start_demo_upstream,
    start_process,
    stop_process,
    wait_port,
)

REPO = Path(__file__).resolve().parent.parent


def compiled_sources() -> list[Path]:
    """The Python modules compiled by Cython (setup.py: a .py with a .pxd beside it)."""
    return sorted(pxd.with_suffix(".py") for pxd in (REPO / "aiproxy").rglob("*.pxd")
                  if pxd.with_suffix(".py").exists())


def pytest_configure(config: pytest.Config) -> None:
    # An extension module shadows its .py: after an edit the tests would run the old code.
    stale = []
    for py in compiled_sources():
        built = list(py.parent.glob(py.stem + ".*.so"))
        newest = max(py.stat().st_mtime, py.with_suffix(".pxd").stat().st_mtime)
        if not built or max(so.stat().st_mtime for so in built) < newest:
            stale.append(str(py.relative_to(REPO)))
    if stale:
        pytest.exit("compiled modules older than their source (run `python setup.py "
                    "build_ext --inplace` or `make test`): " + ", ".join(stale), returncode=4)


def pytest_sessionfinish(session: pytest.Session) -> None:
    # A process started with start_process and never given to stop_process leaves its log
    # in /tmp (and may still run): stop it here and name the test that started it.
    leaked = list(UNSTOPPED.items())
    for proc, _ in leaked:
        stop_process(proc)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if leaked and reporter is not None:
        reporter.write_line(f"\n{len(leaked)} process(es) not ended with stop_process "
                            "(log removed at session end):", yellow=True)
        for _, started_by in leaked:
            reporter.write_line(f"  started by {started_by}", yellow=True)


CALL_REPORT = pytest.StashKey["pytest.TestReport"]()
LOG_TAIL_LINES = 150


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.when == "call":
        item.stash[CALL_REPORT] = report
    return report


def show_logs_of_failed_test(request: pytest.FixtureRequest, logs: list[str]) -> None:
    """Print the tail of each process log when the test failed: the fixtures delete the
    logs at teardown, and a flake seen once in CI must leave its evidence in the output."""
    report = request.node.stash.get(CALL_REPORT, None)
    if report is None or not report.failed:
        return
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        for i, log in enumerate(logs):
            tail = "\n".join(log.splitlines()[-LOG_TAIL_LINES:])
            sys.stderr.write(f"\n--- {request.node.nodeid}: proxy {i} log "
                             f"(last {LOG_TAIL_LINES} lines) ---\n{tail}\n--- end ---\n")


# Lines that mean the proxy let an exception escape on a request path.
CRASH_MARKERS = ("Traceback (most recent call last)", "Exception in callback", "exception was never retrieved")


@dataclass
class Proxy:
    proc: subprocess.Popen
    port: int
    config_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return process_log(self.proc)

    def workers(self, timeout: float = 10) -> int:
        """How many workers serve, once all of them do (the port opens with the first)."""
        deadline = time.monotonic() + timeout
        while (m := re.search(r"aiproxy ready: (\d+) workers", self.log())) is None:
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.02)
        return int(m.group(1))


@pytest.fixture
def start_proxy(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Proxy]]:
    """start_proxy(body) writes a config with one listener on a free port plus `body`
    (TOML text: [http], [[clusters]], [[routes]] ...), starts `python -m aiproxy -c`
    and waits for the port. At teardown the proxy gets SIGTERM and its log must show
    no escaped exception."""
    started: list[Proxy] = []

    def _start(body: str, listener_extra: str = "") -> Proxy:
        port = free_port()
        path = tmp_path / f"aiproxy-{len(started)}.toml"
        path.write_text(
            f'[[listeners]]\nname = "test"\naddress = "127.0.0.1:{port}"\n{listener_extra}\n'
            + textwrap.dedent(body)
        )
        proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(path)])
        proxy = Proxy(proc, port, path)
        started.append(proxy)
        wait_port("127.0.0.1", port, proc=proc)
        return proxy

    yield _start
    failures = []
    logs = [stop_process(proxy.proc) for proxy in started]
    show_logs_of_failed_test(request, logs)
    for log in logs:
        if any(marker in log for marker in CRASH_MARKERS):
            failures.append(log)
    if failures:
        pytest.fail("proxy log shows an escaped exception:\n" + "\n----\n".join(failures))


@pytest.fixture(scope="module")
def demo_upstream() -> Iterator[int]:
    """A demo upstream (aiohttp) on a free port; yields the port."""
    proc, port = start_demo_upstream("demo-a")
    yield port
    stop_process(proc)


@pytest.fixture(scope="module")
def demo_upstream_b() -> Iterator[int]:
    proc, port = start_demo_upstream("demo-b")
    yield port
    stop_process(proc)


@pytest.fixture(scope="module")
def bank_and_general() -> Iterator[tuple[int, int]]:
    """Two demo upstreams, "bank" and "general", for intent routes: yields their ports."""
    bank, bank_port = start_demo_upstream("bank")
    general, general_port = start_demo_upstream("general")
    yield bank_port, general_port
    stop_process(bank)
    stop_process(general)


def simple_config(*ports: int, http: str = "", cluster_extra: str = "") -> str:
    """One cluster `up` over the given upstream ports and one catch-all route."""
    endpoints = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
    return f"""
[http]
{http}

[[clusters]]
name = "up"
endpoints = [{endpoints}]
{cluster_extra}

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
"""


__all__ = ["Proxy", "simple_config", "wait_port", "free_port"]
