"""[kernel] under `[server] workers = 2`: one owner of the XDP/TC attachment.

Worker 0 attaches xdp_guard and tc_classify once (the other worker only splices), and
keeps their maps pinned in bpffs under the supervisor's pid. A SIGKILLed worker 0 leaves
its programs attached (they keep filtering with the last deny list); the supervisor
restarts it and the new worker 0 reuses the pinned maps (deny list, counters, rate
buckets) and replaces the programs in place. SIGTERM of the proxy detaches everything
and removes the pins, also when worker 0 is gone at that moment (the supervisor cleans
up after it).

The proxy runs in the srv namespace of a veth pair; clients connect from the cli one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiproxy.kernel.attach import interface_state
from aiproxy.kernel.lifecycle import proxy_pin_dir
from tests.support import process_log, stop_process

from .conftest import VethPair
from .test_server_kernel import config as one_worker_config
from .test_server_kernel import connects, scrape, wait_reloaded


def config(deny: list[str]) -> str:
    return one_worker_config(deny).replace("workers = 1", "workers = 2")


def worker_pid(proc, index: int, after: int | None = None) -> int:
    """The pid of worker `index` from the supervisor's log (the newest one other than
    `after`)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        pids = [int(p) for p in re.findall(rf"worker {index} started \(pid (\d+)\)",
                                           process_log(proc))]
        if pids and pids[-1] != after:
            return pids[-1]
        time.sleep(0.05)
    raise TimeoutError(f"worker {index} did not start\n" + process_log(proc))


def wait_serving(proc, index: int, pid: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if f"worker {index} (pid {pid}) is serving" in process_log(proc):
            return
        time.sleep(0.05)
    raise TimeoutError(f"worker {index} (pid {pid}) never served\n" + process_log(proc))


def tc_filters(veth: VethPair, direction: str) -> int:
    out = subprocess.run(["tc", "-n", veth.srv, "filter", "show", "dev", "vsrv", direction],
                         capture_output=True, text=True).stdout
    return out.count(" aiproxy_tc ")


def _bpftool(*args: str) -> dict:
    out = subprocess.run(["bpftool", "-j", *args], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def prog_maps(prog_id: int) -> dict[str, int]:
    """Map name -> id of a program's own maps (not the per-load .rodata)."""
    out = {}
    for map_id in _bpftool("prog", "show", "id", str(prog_id))["map_ids"]:
        name = _bpftool("map", "show", "id", str(map_id))["name"]
        if "." not in name:
            out[name] = map_id
    return out


def attach_logs(proc) -> int:
    return process_log(proc).count("kernel: vsrv: xdp_guard")


class MountNs:
    """The proxy's mount namespace (`ip netns exec` gives it its own /sys, so its bpffs
    pins are only visible in there), held open so it can be looked into after exit."""

    def __init__(self, pid: int) -> None:
        self.fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)

    def exists(self, path: str) -> bool:
        return subprocess.run(["nsenter", f"--mount=/proc/{os.getpid()}/fd/{self.fd}",
                               "test", "-e", path]).returncode == 0

    def close(self) -> None:
        os.close(self.fd)


def assert_clean(veth: VethPair, pins: str, mnt: MountNs) -> None:
    state = interface_state("vsrv", veth.srv)
    assert state.xdp_prog_id is None and not state.tc_ingress and not state.tc_egress, state
    out = subprocess.run(["ip", "-n", veth.srv, "-d", "link", "show", "vsrv"],
                         capture_output=True, text=True).stdout
    assert "xdp" not in out, out
    assert tc_filters(veth, "ingress") == 0 and tc_filters(veth, "egress") == 0
    assert not mnt.exists(pins), pins


@pytest.fixture
def mount_ns():
    held: list[MountNs] = []

    def _open(pid: int) -> MountNs:
        held.append(MountNs(pid))
        return held[-1]

    yield _open
    for mnt in held:
        mnt.close()


@pytest.mark.timeout(150)
def test_workers_one_owner_restart_and_clean_stop(veth, tmp_path: Path, mount_ns):
    from .test_server_kernel import start_in_netns

    path = tmp_path / "aiproxy.toml"
    path.write_text(config([f"{veth.CLI4_DENIED}/32"]))
    proc = start_in_netns(veth, path)
    try:
        pins, mnt = proxy_pin_dir(proc.pid), mount_ns(proc.pid)
        w0 = worker_pid(proc, 0)
        w1 = worker_pid(proc, 1)
        wait_serving(proc, 0, w0)
        wait_serving(proc, 1, w1)

        # Attached once: one XDP program, one TC filter per direction, one attach log.
        state = interface_state("vsrv", veth.srv)
        assert state.xdp_prog_id and state.tc_ingress and state.tc_egress, state
        assert tc_filters(veth, "ingress") == 1 and tc_filters(veth, "egress") == 1
        assert attach_logs(proc) == 1, process_log(proc)
        assert mnt.exists(os.path.join(pins, "xdp_guard", "guard_deny_v4")), pins
        prog_id = state.xdp_prog_id
        maps_before = prog_maps(prog_id)
        assert "guard_v4_hosts" in maps_before and "guard_counters" in maps_before

        assert connects(veth, veth.CLI4_ALLOWED)
        assert not connects(veth, veth.CLI4_DENIED)

        # A deny list change (SIGHUP to the supervisor) reaches the attached program.
        path.write_text(config([f"{veth.CLI4_DENIED}/32", f"{veth.CLI4_ALLOWED}/32"]))
        proc.send_signal(signal.SIGHUP)
        wait_reloaded(veth, "aiproxy_config_reloads_total", 1)
        assert not connects(veth, veth.CLI4_ALLOWED)
        assert interface_state("vsrv", veth.srv).xdp_prog_id == prog_id
        dropped = scrape(veth)[("aiproxy_kernel_xdp_packets_total",
                                (("result", "dropped_deny"),))]
        assert dropped >= 2

        # SIGKILL worker 0: its programs stay attached and keep denying meanwhile; the
        # supervisor restarts it and the new worker 0 takes the same maps over.
        os.kill(w0, signal.SIGKILL)
        assert not connects(veth, veth.CLI4_ALLOWED)
        w0b = worker_pid(proc, 0, after=w0)
        wait_serving(proc, 0, w0b)
        state = interface_state("vsrv", veth.srv)
        assert state.xdp_prog_id and state.tc_ingress and state.tc_egress, state
        assert tc_filters(veth, "ingress") == 1 and tc_filters(veth, "egress") == 1
        assert prog_maps(state.xdp_prog_id) == maps_before  # pinned maps reused
        assert not connects(veth, veth.CLI4_ALLOWED)

        # The restarted owner applies deny list changes too.
        path.write_text(config([f"{veth.CLI4_DENIED}/32"]))
        proc.send_signal(signal.SIGHUP)
        wait_reloaded(veth, "aiproxy_config_reloads_total", 2)
        assert connects(veth, veth.CLI4_ALLOWED)
        assert not connects(veth, veth.CLI4_DENIED)

        # SIGTERM of the whole proxy: nothing stays attached, no pins left.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, process_log(proc)
        assert_clean(veth, pins, mnt)
    finally:
        stop_process(proc)


@pytest.mark.timeout(90)
def test_workers_stop_while_worker0_is_dead(veth, tmp_path: Path, mount_ns):
    """Worker 0 SIGKILLed and the proxy told to stop before its restart: the supervisor
    detaches what the dead worker left attached and removes its pins."""
    from .test_server_kernel import start_in_netns

    path = tmp_path / "aiproxy.toml"
    path.write_text(config([f"{veth.CLI4_DENIED}/32"]))
    proc = start_in_netns(veth, path)
    try:
        pins, mnt = proxy_pin_dir(proc.pid), mount_ns(proc.pid)
        w0 = worker_pid(proc, 0)
        wait_serving(proc, 0, w0)
        assert interface_state("vsrv", veth.srv).xdp_prog_id
        os.kill(w0, signal.SIGKILL)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, process_log(proc)
        assert_clean(veth, pins, mnt)
    finally:
        stop_process(proc)


def bpf_status(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiproxy", "bpf", "status", "-c", str(path),
                           "--json", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
def test_bpf_status_reads_a_running_proxys_pins(veth, tmp_path: Path):
    """`aiproxy bpf status` finds the maps worker 0 pinned for its supervisor (inside the
    private /sys `ip netns exec` gives the proxy) and shows their counters and deny list."""
    from .test_server_kernel import start_in_netns

    path = tmp_path / "aiproxy.toml"
    path.write_text(config([f"{veth.CLI4_DENIED}/32", "2001:db8:bad::/48", "198.51.100.0/24"]))
    proc = start_in_netns(veth, path)
    try:
        wait_serving(proc, 0, worker_pid(proc, 0))
        for _ in range(3):
            assert not connects(veth, veth.CLI4_DENIED, 0.3)
        assert connects(veth, veth.CLI4_ALLOWED)

        res = bpf_status(path, "--netns", veth.srv)
        assert res.returncode == 0, res.stderr
        status = json.loads(res.stdout)
        assert status["counters"] == {}  # no `aiproxy bpf attach` pins of its own
        assert status["interfaces"]["vsrv"]["xdp_prog_id"]
        mine = status["proxies"][str(proc.pid)]
        assert mine["pin_dir"] == proxy_pin_dir(proc.pid)
        assert mine["counters"]["deny"] == {"v4": 2, "v6": 1}
        xdp = mine["counters"]["xdp"]
        assert xdp["dropped_deny"] >= 3 and xdp["passed"] >= 1
        assert xdp["dropped_deny"] <= scrape(veth)[("aiproxy_kernel_xdp_packets_total",
                                                    (("result", "dropped_deny"),))]
        assert mine["counters"]["tc"]["edge"]["packets"] >= 1

        # --pid picks it; a pid that is no proxy is an error.
        res = bpf_status(path, "--netns", veth.srv, "--pid", str(proc.pid))
        assert res.returncode == 0, res.stderr
        assert list(json.loads(res.stdout)["proxies"]) == [str(proc.pid)]
        res = bpf_status(path, "--netns", veth.srv, "--pid", str(os.getpid()))
        assert res.returncode == 1 and "no running proxy" in res.stderr
        # Text output names the proxy and its deny list.
        res = subprocess.run([sys.executable, "-m", "aiproxy", "bpf", "status", "-c",
                              str(path), "--netns", veth.srv], capture_output=True, text=True,
                             timeout=60)
        assert f"proxy pid {proc.pid}" in res.stdout
        assert "deny list: 2 IPv4, 1 IPv6 prefixes" in res.stdout

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, process_log(proc)
        res = bpf_status(path, "--netns", veth.srv)
        assert res.returncode == 0 and json.loads(res.stdout)["proxies"] == {}
    finally:
        stop_process(proc)

