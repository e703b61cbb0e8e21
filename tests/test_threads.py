"""A worker whose config needs no thread starts none (aiproxy/server/sockets.py says why:
glibc keeps a process that never started a thread on its faster paths). Real proxy
processes, real requests, a real reload; threads are read from /proc."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import simple_config
from tests.support import admin_block, free_port, start_process, stop_process, wait_port
from tests.test_workers import QUIET, started, workers_proxy  # noqa: F401 (fixture)

ONE_PROCESS = "\n[server]\nworkers = 1\n"


def threads(pid: int) -> list[str]:
    """The names of a process's threads."""
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names


def wait_log(proxy, text: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while text not in proxy.log():
        assert time.monotonic() < deadline, proxy.log()
        time.sleep(0.05)


def test_single_process_stays_one_thread_through_requests_admin_and_reload(
        start_proxy, demo_upstream):
    admin = free_port()
    proxy = start_proxy(simple_config(demo_upstream) + ONE_PROCESS + QUIET + admin_block(admin))
    wait_port("127.0.0.1", admin, proc=proxy.proc)
    assert httpx.get(f"{proxy.url}/v1/models").status_code == 200
    assert httpx.get(f"http://127.0.0.1:{admin}/metrics").status_code == 200
    os.kill(proxy.proc.pid, signal.SIGHUP)
    wait_log(proxy, "config reloaded")
    assert httpx.get(f"{proxy.url}/v1/models").status_code == 200
    assert len(threads(proxy.proc.pid)) == 1, threads(proxy.proc.pid)


def test_each_worker_stays_one_thread(workers_proxy, demo_upstream):  # noqa: F811
    proxy, admin = workers_proxy(simple_config(demo_upstream) + QUIET)
    with httpx.Client() as client:
        for _ in range(20):
            assert client.get(f"{proxy.url}/v1/models").status_code == 200
    pids = [pid for _, pid in started(proxy.log())]
    assert len(pids) == 2
    for pid in pids:
        assert len(threads(pid)) == 1, (pid, threads(pid))


def test_access_log_writer_is_the_thread_it_needs(start_proxy, demo_upstream):
    # The access log is on by default.
    proxy = start_proxy(simple_config(demo_upstream) + ONE_PROCESS)
    assert httpx.get(f"{proxy.url}/v1/models").status_code == 200
    assert len(threads(proxy.proc.pid)) == 2, threads(proxy.proc.pid)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return any(info[0] == socket.AF_INET6 for info in socket.getaddrinfo("localhost", 80))


@pytest.mark.skipif(not _ipv6_loopback(), reason="no ::1, or localhost does not resolve to it")
def test_listener_on_a_name_binds_each_of_its_addresses(tmp_path: Path, demo_upstream):
    port = free_port()
    path = tmp_path / "aiproxy.toml"
    path.write_text(f'[[listeners]]\nname = "l"\naddress = "localhost:{port}"\n'
                    + simple_config(demo_upstream) + ONE_PROCESS + QUIET)
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(path)])
    try:
        wait_port("127.0.0.1", port, proc=proc)
        for host in ("127.0.0.1", "[::1]"):
            assert httpx.get(f"http://{host}:{port}/v1/models").status_code == 200, host
        assert len(threads(proc.pid)) == 1
    finally:
        log = stop_process(proc)
    assert "listener l on 127.0.0.1" in log and "listener l on [::1]" in log, log


def test_unknown_listener_host_is_a_clear_startup_error(tmp_path: Path, demo_upstream):
    path = tmp_path / "aiproxy.toml"
    path.write_text('[[listeners]]\nname = "l"\naddress = "no-such-host.invalid:8080"\n'
                    + simple_config(demo_upstream) + ONE_PROCESS + QUIET)
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(path)])
    assert proc.wait(timeout=60) == 1
    log = stop_process(proc)
    assert "listener 'l': cannot bind no-such-host.invalid:8080:" in log, log


def test_bound_sockets_take_every_passive_address_or_none():
    from aiproxy.server.sockets import bound_sockets

    if not socket.has_ipv6 or len(socket.getaddrinfo(None, 0, flags=socket.AI_PASSIVE,
                                                     type=socket.SOCK_STREAM)) < 2:
        pytest.skip("no IPv6: the wildcard resolves to one address")
    port = free_port()
    socks = bound_sockets("", port, reuse_port=True)
    try:
        assert sorted(s.family for s in socks) == [socket.AF_INET, socket.AF_INET6]
        for s in socks:
            assert s.getsockname()[1] == port
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        v6 = next(s for s in socks if s.family == socket.AF_INET6)
        assert v6.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
    finally:
        for s in socks:
            s.close()
    # The IPv6 wildcard taken: the call fails and leaves the IPv4 one it bound free.
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as taken:
        taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        taken.bind(("::", port))
        taken.listen()
        with pytest.raises(OSError):
            bound_sockets("", port)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as again:
            again.bind(("0.0.0.0", port))
