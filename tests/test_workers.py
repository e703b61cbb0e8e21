"""Multi-process model: `[server] workers = 2` with a supervising parent (real processes,
real clients, the demo upstream)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import CRASH_MARKERS, Proxy, simple_config
from tests.support import (
    admin_block,
    free_port,
    process_log,
    scrape,
    start_process,
    stop_process,
    wait_port,
)

WORKERS = "[server]\nworkers = 2\ndrain_timeout_ms = 5000\n"
QUIET = '\n[access_log]\npath = "off"\n'  # keeps the log the tests poll small under load


def total(found: dict[tuple, float], name: str) -> float:
    return sum(v for (n, _), v in found.items() if n == name)


def per_worker(found: dict[tuple, float], name: str) -> dict[str, float]:
    return {dict(labels)["worker"]: v for (n, labels), v in found.items() if n == name}


def started(log: str) -> list[tuple[int, int]]:
    """(worker, pid) for each "worker N started (pid P)" line, in order."""
    return [(int(w), int(p)) for w, p in re.findall(r"worker (\d) started \(pid (\d+)\)", log)]


def serving(log: str, pid: int) -> bool:
    return f"(pid {pid}) is serving" in log


def wait_for(predicate, timeout: float = 15, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def workers_proxy(tmp_path: Path) -> Iterator[Callable[[str], tuple[Proxy, int]]]:
    """Like conftest's start_proxy, plus workers = 2 and an admin listener; returns
    (proxy, admin port) once /readyz says every worker serves. A supervisor and its
    forkserver import in parallel, but on a loaded 2-core box that can pass 10 s."""
    started: list[Proxy] = []

    def _start(body: str, server: str = "") -> tuple[Proxy, int]:
        port, admin = free_port(), free_port()
        path = tmp_path / f"aiproxy-{len(started)}.toml"
        path.write_text(f'[[listeners]]\nname = "test"\naddress = "127.0.0.1:{port}"\n'
                        + WORKERS + server + body + admin_block(admin))
        proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(path)])
        proxy = Proxy(proc, port, path)
        started.append(proxy)
        wait_port("127.0.0.1", admin, timeout=60, proc=proc)
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/readyz").status_code == 200,
                 timeout=60, what="all workers ready")
        return proxy, admin

    yield _start
    logs = [stop_process(proxy.proc, timeout=15) for proxy in started]
    crashed = [log for log in logs if any(marker in log for marker in CRASH_MARKERS)]
    if crashed:
        pytest.fail("proxy log shows an escaped exception:\n" + "\n----\n".join(crashed))


def test_load_spreads_over_workers_and_metrics_sum(workers_proxy, demo_upstream):
    proxy, admin = workers_proxy(simple_config(demo_upstream))
    pids = {pid for _, pid in started(proxy.log())}
    assert len(pids) == 2 and proxy.proc.pid not in pids
    sent = 0
    for _ in range(40):  # a new connection each time: SO_REUSEPORT hashes connections
        with httpx.Client(base_url=proxy.url) as client:
            assert client.get("/echo").status_code == 200
            sent += 1
    with httpx.Client(base_url=proxy.url) as client:
        for _ in range(10):
            assert client.post("/echo", content=b"y" * 100).status_code == 200
            sent += 1
        assert client.get("/status/503").status_code == 503
        sent += 1
    found = scrape(admin)
    assert total(found, "aiproxy_requests_total") == sent
    key = ("aiproxy_requests_total", (("cluster", "up"), ("outcome", "complete"), ("route", "all"),
                                      ("status", "200")))
    assert found[key] == sent - 1
    assert found[("aiproxy_request_bytes_total", ())] == 1000
    assert found[("aiproxy_stage_total_seconds_count", ())] == sent
    assert found[('aiproxy_stage_total_seconds_bucket', (("le", "+Inf"),))] == sent
    by_worker = per_worker(found, "aiproxy_worker_requests_total")
    assert sum(by_worker.values()) == sent
    assert set(by_worker) == {"0", "1"} and min(by_worker.values()) > 0, by_worker
    assert per_worker(found, "aiproxy_worker_up") == {"0": 1, "1": 1}
    assert per_worker(found, "aiproxy_worker_restarts_total") == {"0": 0, "1": 0}
    clusters = httpx.get(f"http://127.0.0.1:{admin}/clusters").json()
    assert sorted((c["worker"], c["name"]) for c in clusters) == [(0, "up"), (1, "up")]
    routes = httpx.get(f"http://127.0.0.1:{admin}/config/routes").json()
    assert [r["name"] for r in routes] == ["all"]
    assert httpx.get(f"http://127.0.0.1:{admin}/config").json()["server"]["workers"] == 2


def _run_load(url: str, stop: asyncio.Event, results: list, clients: int = 8,
              path: str = "/delay/5") -> list[asyncio.Task]:
    async def one() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            while not stop.is_set():
                try:
                    r = await client.get(path)
                    results.append((time.monotonic(), r.status_code, r.headers.get("x-upstream")))
                except httpx.HTTPError as exc:
                    results.append((time.monotonic(), repr(exc), None))

    return [asyncio.create_task(one()) for _ in range(clients)]


def test_killed_worker_loses_only_its_requests_and_comes_back(workers_proxy, demo_upstream):
    proxy, admin = workers_proxy(simple_config(demo_upstream) + QUIET)
    (_, victim), = [(w, p) for w, p in started(proxy.log()) if w == 0]
    results: list = []

    async def scenario() -> int:
        stop = asyncio.Event()
        tasks = _run_load(proxy.url, stop, results)
        await asyncio.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        new = None
        deadline = time.monotonic() + 15
        while new is None or not serving(proxy.log(), new):
            assert time.monotonic() < deadline, proxy.log()
            pids = [p for w, p in started(proxy.log()) if w == 0 and p != victim]
            new = pids[0] if pids else None
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*tasks)
        return new

    new = asyncio.run(scenario())
    assert new != victim
    log = proxy.log()
    assert f"worker 0 (pid {victim}) killed by signal SIGKILL" in log
    failed = [r for r in results if not isinstance(r[1], int)]
    ok = [r for r in results if r[1] == 200]
    assert len(results) == len(failed) + len(ok)
    # each of the 8 clients had at most one request in flight on the killed worker
    assert len(failed) <= 8, failed
    assert len(ok) > 50
    # after the worker is back everything succeeds, and it takes new connections again
    snap = scrape(admin)
    before = per_worker(snap, "aiproxy_worker_requests_total")["0"]
    for _ in range(30):
        with httpx.Client(base_url=proxy.url) as client:
            assert client.get("/echo").status_code == 200
    found = scrape(admin)
    assert per_worker(found, "aiproxy_worker_requests_total")["0"] > before
    assert per_worker(found, "aiproxy_worker_restarts_total") == {"0": 1, "1": 0}
    assert per_worker(found, "aiproxy_worker_up") == {"0": 1, "1": 1}
    assert httpx.get(f"http://127.0.0.1:{admin}/readyz").json() == {"ready": True}
    # Counters stay monotonic over the restart: the dead worker's counts as of its last
    # scrape are kept (what it served after that scrape is lost with it), and every
    # request since is counted.
    assert total(found, "aiproxy_requests_total") >= total(snap, "aiproxy_requests_total") + 30


HANG = "worker_hang_timeout_ms = 2000\n"  # pinged every 0.5 s: a loaded 2-core box may stall a loop for well under 2 s


def test_a_hung_worker_is_killed_and_restarted(workers_proxy, demo_upstream):
    # A stopped process answers nothing, as a worker whose loop is stuck in a filter or
    # a blocking call: the connections the kernel hands it hang. Before, the supervisor
    # kept it (and its share of SO_REUSEPORT connections) forever.
    proxy, admin = workers_proxy(simple_config(demo_upstream) + QUIET, HANG)
    (victim,) = [p for w, p in started(proxy.log()) if w == 1]
    os.kill(victim, signal.SIGSTOP)
    wait_for(lambda: any(serving(proxy.log(), p) for w, p in started(proxy.log())
                         if w == 1 and p != victim), what="a new worker 1 serving")
    log = proxy.log()
    assert re.search(rf"worker 1 \(pid {victim}\) has not answered for \d+\.\d s: killing it",
                     log), log
    assert f"worker 1 (pid {victim}) killed by signal SIGKILL" in log
    assert not _alive(victim)
    for _ in range(30):  # new connections: some land on the new worker 1
        with httpx.Client(base_url=proxy.url, timeout=10) as client:
            assert client.get("/echo").status_code == 200
    found = scrape(admin)
    assert per_worker(found, "aiproxy_worker_requests_total")["1"] > 0
    assert per_worker(found, "aiproxy_worker_hangs_total") == {"0": 0, "1": 1}
    assert per_worker(found, "aiproxy_worker_restarts_total") == {"0": 0, "1": 1}
    assert per_worker(found, "aiproxy_worker_up") == {"0": 1, "1": 1}


def test_busy_and_idle_workers_are_not_taken_for_hung(workers_proxy, demo_upstream):
    proxy, admin = workers_proxy(simple_config(demo_upstream) + QUIET, HANG)
    pids = [p for _, p in started(proxy.log())]
    results: list = []

    async def load() -> None:  # 16 clients for 3 s: a dozen ping rounds under load
        stop = asyncio.Event()
        tasks = _run_load(proxy.url, stop, results, clients=16, path="/echo")
        await asyncio.sleep(3)
        stop.set()
        await asyncio.gather(*tasks)

    asyncio.run(load())
    time.sleep(3)  # and a dozen idle
    assert len(results) > 100 and all(r[1] == 200 for r in results), results[:5]
    assert "has not answered" not in proxy.log()
    assert [p for _, p in started(proxy.log())] == pids
    found = scrape(admin)
    assert per_worker(found, "aiproxy_worker_hangs_total") == {"0": 0, "1": 0}
    assert per_worker(found, "aiproxy_worker_restarts_total") == {"0": 0, "1": 0}


def test_a_stopped_supervisor_does_not_blame_its_workers(workers_proxy, demo_upstream):
    # The whole proxy stopped and resumed (SIGSTOP of its cgroup, a paused container)
    # while a ping was unanswered: the supervisor's first act on resuming is its overdue
    # check, before it reads the answer waiting in the socket. The time it did not run
    # itself is not counted against the workers.
    proxy, admin = workers_proxy(simple_config(demo_upstream) + QUIET,
                                 "worker_hang_timeout_ms = 5000\n")  # pinged every 1.25 s
    pids = [p for _, p in started(proxy.log())]
    os.kill(pids[1], signal.SIGSTOP)
    time.sleep(2)  # a ping to it is out (it would be killed 5 s after that)
    os.kill(proxy.proc.pid, signal.SIGSTOP)
    os.kill(pids[0], signal.SIGSTOP)
    time.sleep(6)
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    os.kill(proxy.proc.pid, signal.SIGCONT)
    time.sleep(2)
    assert "has not answered" not in proxy.log(), proxy.log()
    assert [p for _, p in started(proxy.log())] == pids
    for _ in range(10):
        with httpx.Client(base_url=proxy.url, timeout=10) as client:
            assert client.get("/echo").status_code == 200
    assert per_worker(scrape(admin), "aiproxy_worker_hangs_total") == {"0": 0, "1": 0}


@pytest.mark.parametrize("value, expected", [
    ("0", 0),
    ("1000", 1000),
    ("999", "inline.toml:2: server.worker_hang_timeout_ms: must be 0 (off) or >= 1000, "
            "got 999"),
    ("-1", "inline.toml:2: server.worker_hang_timeout_ms: must be >= 0, got -1"),
])
def test_worker_hang_timeout_setting(value, expected):
    from aiproxy.config import ConfigError, load_config_text

    text = (f"[server]\nworker_hang_timeout_ms = {value}\n"
            '[[listeners]]\nname = "l"\naddress = "127.0.0.1:8080"\n')
    if isinstance(expected, int):
        assert load_config_text(text, "inline.toml").server.worker_hang_timeout_ms == expected
    else:
        with pytest.raises(ConfigError) as err:
            load_config_text(text, "inline.toml")
        assert str(err.value) == expected
    assert load_config_text(text.split("\n", 2)[2], "x").server.worker_hang_timeout_ms == 30000


def test_crash_looping_worker_backs_off(workers_proxy, demo_upstream):
    proxy, admin = workers_proxy(simple_config(demo_upstream))
    killed = []
    for _ in range(4):
        wait_for(lambda: any(serving(proxy.log(), p) for w, p in started(proxy.log())
                             if w == 1 and p not in killed), what="worker 1 serving")
        pid = [p for w, p in started(proxy.log()) if w == 1 and p not in killed][0]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    wait_for(lambda: len([1 for w, _ in started(proxy.log()) if w == 1]) == 5,
             what="the fifth worker 1")
    delays = [float(d) for d in re.findall(r"worker 1 \(pid \d+\) killed by signal SIGKILL "
                                           r"after [\d.]+ s; restarting in ([\d.]+) s",
                                           proxy.log())]
    assert delays == [0.2, 0.4, 0.8, 1.6], proxy.log()
    wait_for(lambda: per_worker(scrape(admin), "aiproxy_worker_up") == {"0": 1, "1": 1},
             what="worker 1 up again")
    assert per_worker(scrape(admin), "aiproxy_worker_restarts_total") == {"0": 0, "1": 4}


def test_sigterm_lets_streams_finish_and_refuses_new_connections(workers_proxy, demo_upstream):
    proxy, _ = workers_proxy(simple_config(demo_upstream))
    events = []
    with httpx.Client(base_url=proxy.url, timeout=10) as client, \
            client.stream("GET", "/sse?n=20&delay_ms=100") as response:
        lines = response.iter_lines()
        events.append(next(line for line in lines if line))
        proxy.proc.send_signal(signal.SIGTERM)
        refused_at = None
        deadline = time.monotonic() + 5
        while refused_at is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", proxy.port), timeout=1).close()
                time.sleep(0.02)
            except ConnectionResetError:
                # handshake done in a closing worker's accept queue: reset, not served
                pass
            except ConnectionRefusedError:
                refused_at = time.monotonic()
        assert refused_at is not None, "new connections were still accepted"
        events.extend(line for line in lines if line)
    assert events == [f"data: event {i}" for i in range(20)]
    assert proxy.proc.wait(10) == 0
    assert "killed by signal" not in proxy.log()


def test_sighup_reload_under_load_with_workers(workers_proxy, demo_upstream, demo_upstream_b):
    def config(to_b: bool) -> str:
        return f"""
[[clusters]]
name = "a"
endpoints = ["127.0.0.1:{demo_upstream}"]

[[clusters]]
name = "b"
endpoints = ["127.0.0.1:{demo_upstream_b}"]

[[routes]]
name = "x"
match = {{ path_prefix = "/echo/x" }}
cluster = "{"b" if to_b else "a"}"

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "a"
"""

    proxy, admin = workers_proxy(config(False) + QUIET)
    text = proxy.config_path.read_text()
    results: list = []

    async def scenario() -> None:
        stop = asyncio.Event()
        tasks = _run_load(proxy.url, stop, results, path="/echo")
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as probe:
            for i in range(6):
                to_b = i % 2 == 0
                proxy.config_path.write_text(text.replace(config(False), config(to_b)))
                done = proxy.log().count("config reloaded in 2 workers")
                proxy.proc.send_signal(signal.SIGHUP)
                deadline = time.monotonic() + 10
                while proxy.log().count("config reloaded in 2 workers") == done:
                    assert time.monotonic() < deadline, proxy.log()
                    await asyncio.sleep(0.02)
                # both workers run the new config: new connections all see it
                for _ in range(6):
                    probe_conn = httpx.AsyncClient(base_url=proxy.url, timeout=10)
                    async with probe_conn:
                        r = await probe_conn.get("/echo/x")
                    assert r.headers["x-upstream"] == ("demo-b" if to_b else "demo-a")
                r = await probe.get("/echo/x")
                assert r.headers["x-upstream"] == ("demo-b" if to_b else "demo-a")
                await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    failed = [r for r in results if r[1] != 200]
    assert not failed, failed[:3]
    assert len(results) > 100
    found = scrape(admin)
    assert found[("aiproxy_config_reloads_total", ())] == 6
    assert per_worker(found, "aiproxy_worker_restarts_total") == {"0": 0, "1": 0}


def test_broken_reload_is_rejected_in_the_parent(workers_proxy, demo_upstream):
    proxy, admin = workers_proxy(simple_config(demo_upstream))
    good = proxy.config_path.read_text()
    proxy.config_path.write_text(good + '\n[[routes]]\nname = "bad"\ncluster = "nope"\n')
    proxy.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reload rejected" in proxy.log(), what="rejection")
    bad_line = len(good.splitlines()) + 4
    assert f"{proxy.config_path}:{bad_line}: routes[1].cluster: unknown cluster 'nope'" \
        in proxy.log()
    assert "[worker" not in proxy.log().split("reload rejected")[1]  # workers never saw it
    assert httpx.get(proxy.url + "/echo").status_code == 200
    found = scrape(admin)
    assert found[("aiproxy_config_reload_failures_total", ())] == 1
    assert found[("aiproxy_config_last_reload_success", ())] == 0


def test_a_worker_ignores_sighup_only_the_supervisor_reloads(workers_proxy, demo_upstream):
    """A SIGHUP to one worker (or to the process group: kill -HUP -PGID, systemctl kill)
    had that worker re-read the file itself, past the supervisor's check: workers served
    two configs. It is ignored in a worker; the supervisor's reload reaches them all."""
    proxy, admin = workers_proxy(simple_config(demo_upstream))
    wait_for(lambda: len(started(proxy.log())) == 2, what="two workers")
    pids = [pid for _, pid in started(proxy.log())]
    good = proxy.config_path.read_text()
    proxy.config_path.write_text(good.replace(
        'name = "all"\n', 'name = "all"\nresponse_headers_add = { "x-gen" = "2" }\n', 1))
    assert 'x-gen' in proxy.config_path.read_text()
    os.kill(pids[0], signal.SIGHUP)
    time.sleep(1.0)
    for _ in range(20):  # new connections spread over both workers
        r = httpx.get(proxy.url + "/echo")
        assert r.status_code == 200 and "x-gen" not in r.headers, r.headers
    assert all(serving(proxy.log(), p) for p in pids)
    assert "reload" not in proxy.log().split("is serving")[-1], proxy.log()
    proxy.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "config reloaded" in proxy.log(), what="reload")
    for _ in range(20):
        assert httpx.get(proxy.url + "/echo").headers.get("x-gen") == "2"


def test_sd_notify_only_from_the_parent(tmp_path: Path, demo_upstream):
    notify_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.settimeout(60)
    port = free_port()
    cfg = tmp_path / "a.toml"
    cfg.write_text(WORKERS + f'[[listeners]]\nname = "l"\naddress = "127.0.0.1:{port}"\n'
                   + simple_config(demo_upstream))
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(cfg)],
                         env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "400000",
                              "WATCHDOG_PID": ""})
    try:
        messages: list[tuple[str, int]] = []

        def expect(prefix: str) -> None:
            while True:
                data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(12))
                pid = next(struct.unpack("3i", payload)[0]
                           for level, kind, payload in ancillary
                           if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS)
                messages.append((data.decode(), pid))
                if data.decode().startswith(prefix):
                    return

        expect("READY=1")
        log = Path(proc.log_path).read_text()  # type: ignore[attr-defined]
        pids = [pid for _, pid in started(log)]
        assert len(pids) == 2 and all(serving(log, p) for p in pids), log
        wait_port("127.0.0.1", port)
        expect("WATCHDOG=1")
        proc.send_signal(signal.SIGHUP)
        expect("RELOADING=1")
        expect("READY=1")
        proc.send_signal(signal.SIGTERM)
        expect("STOPPING=1")
        assert proc.wait(15) == 0
        order = [m.split("\n")[0] for m, _ in messages if not m.startswith("WATCHDOG")]
        assert order == ["READY=1", "RELOADING=1", "READY=1", "STOPPING=1"]
        assert {pid for _, pid in messages} == {proc.pid}
    finally:
        stop_process(proc)
        sock.close()
        os.unlink(notify_path)


def test_sighup_before_the_workers_serve_is_ignored(tmp_path: Path, demo_upstream):
    """README: until the proxy serves, SIGHUP is ignored. The supervisor took it as soon
    as its loop ran: "config reloaded in 0 workers", and RELOADING=1 then READY=1 to
    systemd before any worker served."""
    notify_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.settimeout(60)
    port = free_port()
    cfg = tmp_path / "a.toml"
    cfg.write_text(WORKERS + f'[[listeners]]\nname = "l"\naddress = "127.0.0.1:{port}"\n'
                   + simple_config(demo_upstream))
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(cfg)],
                         env={"NOTIFY_SOCKET": str(notify_path)})
    try:
        log_path = Path(proc.log_path)  # type: ignore[attr-defined]
        wait_for(lambda: started(log_path.read_text()), what="a worker spawned")
        proc.send_signal(signal.SIGHUP)
        data = sock.recv(4096).decode()
        assert data.startswith("READY=1"), data
        log = log_path.read_text()
        assert "config reloaded" not in log and "is serving" in log, log
        assert httpx.get(f"http://127.0.0.1:{port}/echo").status_code == 200
    finally:
        stop_process(proc)
        sock.close()
        os.unlink(notify_path)


def test_port_taken_by_another_process_fails_startup(tmp_path: Path, demo_upstream):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = tmp_path / "a.toml"
        cfg.write_text(WORKERS + f'[[listeners]]\nname = "l"\naddress = "127.0.0.1:{port}"\n'
                       + simple_config(demo_upstream))
        proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(cfg)])
        try:
            assert proc.wait(30) == 1
        finally:
            log = stop_process(proc)
    # Worded as a single process words it (tests/test_cli.py), naming the file.
    assert f"{cfg}: listener 'l': cannot bind 127.0.0.1:{port}: Address already in use" in log
    assert "started (pid" not in log


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_workers_stop_when_the_supervisor_dies(workers_proxy, demo_upstream):
    proxy, _ = workers_proxy(simple_config(demo_upstream))
    pids = [pid for _, pid in started(proxy.log())]
    proxy.proc.kill()
    proxy.proc.wait()
    # no unsupervised workers keep serving: each sees its control channel close and drains
    wait_for(lambda: not any(_alive(p) for p in pids), what="workers to exit")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=1)


@pytest.mark.parametrize("value, expected", [
    (None, len(os.sched_getaffinity(0))),
    ('"auto"', len(os.sched_getaffinity(0))),
    ("3", 3),
    ('"many"', 'inline.toml:2: server.workers: expected integer or "auto", got \'many\''),
    ("0", "inline.toml:2: server.workers: must be between 1 and 1024, got 0"),
    ("1.5", 'inline.toml:2: server.workers: expected integer or "auto", got float'),
])
def test_workers_setting(value, expected):
    from aiproxy.config import ConfigError, load_config_text

    text = '[[listeners]]\nname = "l"\naddress = "127.0.0.1:8080"\n'
    if value is not None:
        text = f"[server]\nworkers = {value}\n" + text
    if isinstance(expected, int):
        assert load_config_text(text, "inline.toml").server.workers == expected
    else:
        with pytest.raises(ConfigError) as err:
            load_config_text(text, "inline.toml")
        assert str(err.value) == expected


def test_worker_restarted_after_a_listener_change_binds_what_its_siblings_bind(
        workers_proxy, demo_upstream):
    """Listener changes take effect on restart of the proxy, not of one worker: a worker
    the supervisor replaces after such a reload binds the listeners the others serve (a
    replacement on the new address would split the ports between the workers, and one
    that cannot bind it would crash-loop)."""
    proxy, admin = workers_proxy(simple_config(demo_upstream) + QUIET)
    moved = free_port()
    text = proxy.config_path.read_text()
    proxy.config_path.write_text(text.replace(f"127.0.0.1:{proxy.port}", f"127.0.0.1:{moved}"))
    proxy.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "config reloaded in 2 workers" in proxy.log(), what="the reload")
    assert (f"reload: waiting for a restart; listeners.test: address changed 127.0.0.1:{moved} "
            f"(serving 127.0.0.1:{proxy.port})") in proxy.log()
    (victim,) = [p for w, p in started(proxy.log()) if w == 1]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: any(serving(proxy.log(), p) for w, p in started(proxy.log())
                         if w == 1 and p != victim), what="worker 1 replaced")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", moved), timeout=1)
    before = per_worker(scrape(admin), "aiproxy_worker_requests_total")
    for _ in range(30):  # new connections: SO_REUSEPORT spreads them over both workers
        with httpx.Client(base_url=proxy.url) as client:
            assert client.get("/echo").status_code == 200
    after = per_worker(scrape(admin), "aiproxy_worker_requests_total")
    assert after["1"] > before["1"], (before, after)


def test_reload_one_worker_rejects_is_undone_in_the_others(workers_proxy, demo_upstream,
                                                          demo_upstream_b):
    """A reload is all or nothing over the workers: when one rejects the validated text
    (here worker 0, the one that attaches [kernel] interfaces), those that had taken it
    go back to the running config, as the rejection in the log says."""
    proxy, admin = workers_proxy(simple_config(demo_upstream) + QUIET)
    good = proxy.config_path.read_text()
    proxy.config_path.write_text(
        good.replace(f"127.0.0.1:{demo_upstream}", f"127.0.0.1:{demo_upstream_b}")
        + '\n[kernel]\ninterfaces = ["nosuchif0"]\n')
    proxy.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "aiproxy.server: reload rejected" in proxy.log(), what="the rejection")
    assert "no interface 'nosuchif0'" in proxy.log().split("aiproxy.server: reload rejected")[1]
    endpoints = {c["worker"]: [e["address"] for e in c["endpoints"]]
                 for c in httpx.get(f"http://127.0.0.1:{admin}/clusters").json()}
    assert endpoints == {0: [f"127.0.0.1:{demo_upstream}"],
                         1: [f"127.0.0.1:{demo_upstream}"]}, endpoints
    for _ in range(20):
        with httpx.Client(base_url=proxy.url) as client:
            assert client.get("/echo").headers["x-upstream"] == "demo-a"
    found = scrape(admin)
    assert found[("aiproxy_config_reload_failures_total", ())] == 1
    assert found[("aiproxy_config_reloads_total", ())] == 0
    # the same file fixed is taken by both
    proxy.config_path.write_text(
        good.replace(f"127.0.0.1:{demo_upstream}", f"127.0.0.1:{demo_upstream_b}"))
    proxy.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "config reloaded in 2 workers" in proxy.log(), what="the good reload")
    for _ in range(20):
        with httpx.Client(base_url=proxy.url) as client:
            assert client.get("/echo").headers["x-upstream"] == "demo-b"


def test_worker_ready_during_a_reload_gets_the_new_config(workers_proxy, demo_upstream,
                                                          demo_upstream_b):
    """A worker the supervisor restarts while a reload is under way (here: worker 0 is
    stopped, so the reload waits for it) comes up on the text it was started with; it
    must end on the new config like its sibling, not serve the old one until the next
    reload."""
    proxy, admin = workers_proxy(simple_config(demo_upstream) + QUIET)
    pids = dict(started(proxy.log()))
    os.kill(pids[0], signal.SIGSTOP)
    try:
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: f"(pid {pids[1]}) killed by signal SIGKILL" in proxy.log(),
                 what="worker 1 reaped")
        proxy.config_path.write_text(proxy.config_path.read_text().replace(
            f"127.0.0.1:{demo_upstream}", f"127.0.0.1:{demo_upstream_b}"))
        proxy.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: any(serving(proxy.log(), p) for w, p in started(proxy.log())
                             if w == 1 and p != pids[1]), what="worker 1 replaced")
    finally:
        os.kill(pids[0], signal.SIGCONT)
    wait_for(lambda: "config reloaded in" in proxy.log(), what="the reload")

    def endpoints() -> dict:
        return {c["worker"]: [e["address"] for e in c["endpoints"]]
                for c in httpx.get(f"http://127.0.0.1:{admin}/clusters").json()}

    new = [f"127.0.0.1:{demo_upstream_b}"]
    wait_for(lambda: endpoints() == {0: new, 1: new}, what="both on the new config")
    for _ in range(20):
        with httpx.Client(base_url=proxy.url) as client:
            assert client.get("/echo").headers["x-upstream"] == "demo-b"


def test_sigusr1_while_workers_start_does_not_kill_them(tmp_path: Path, demo_upstream):
    """The supervisor passes SIGUSR1 (log reopen, e.g. from logrotate) on to every worker,
    starting ones too: a worker that cannot act on it yet ignores it, rather than dying
    of it (its default action) and failing the start."""
    port, admin = free_port(), free_port()
    cfg = tmp_path / "a.toml"
    cfg.write_text(WORKERS + f'[[listeners]]\nname = "l"\naddress = "127.0.0.1:{port}"\n'
                   + simple_config(demo_upstream) + admin_block(admin))
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(cfg)])
    try:
        # the supervisor has its own handlers once it serves the admin API
        wait_port("127.0.0.1", admin, timeout=60, proc=proc)
        while "aiproxy ready: 2 workers" not in process_log(proc):
            assert proc.poll() is None, process_log(proc)
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.005)
        assert httpx.get(f"http://127.0.0.1:{port}/echo").status_code == 200
    finally:
        log = stop_process(proc, timeout=15)
    assert "killed by signal" not in log, log


def test_failed_start_stops_the_other_workers_without_a_false_sigkill(tmp_path: Path,
                                                                      demo_upstream):
    """Worker 0 cannot attach [kernel] (no such interface), worker 1 starts fine: the
    supervisor stops worker 1 with SIGTERM and waits for it, rather than logging a
    SIGKILL "after 0.0 s" while the worker is already stopping."""
    port = free_port()
    cfg = tmp_path / "a.toml"
    cfg.write_text(WORKERS + f'[[listeners]]\nname = "l"\naddress = "127.0.0.1:{port}"\n'
                   + simple_config(demo_upstream) + '\n[kernel]\ninterfaces = ["nosuchif0"]\n')
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(cfg)])
    try:
        assert proc.wait(60) == 2
    finally:
        log = stop_process(proc)
    assert "a worker failed to start; stopping" in log, log
    assert "SIGKILL" not in log, log
    pid = dict(started(log))[1]
    assert (f"worker 1 (pid {pid}) exited with code 0" in log
            or f"worker 1 (pid {pid}) killed by signal SIGTERM" in log), log
