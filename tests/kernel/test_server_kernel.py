"""The proxy process owns its [kernel] fast paths: attached at start, maps updated in place
on SIGHUP, counters in /metrics, everything detached on SIGTERM; a program the kernel
refuses stops the start with the program's name and the verifier log.

The proxy runs inside the srv namespace of a veth pair (`ip netns exec`); clients connect
from the cli namespace, so XDP on vsrv sees their packets. Nothing leaves the namespaces.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aiproxy.kernel.attach import interface_state
from tests.support import process_log, start_process, stop_process

from .conftest import VethPair, in_netns

PORT = 7090
ADMIN = 9190


def config(deny: list[str], interfaces: tuple[str, ...] = ("vsrv",)) -> str:
    names = ", ".join(f'"{i}"' for i in interfaces)
    cidrs = ", ".join(f'"{c}"' for c in deny)
    # One process: this is the lifecycle of one ProxyKernel (with workers, worker 0
    # attaches and the others only splice).
    return f"""
[server]
workers = 1

[[listeners]]
name = "edge"
address = "0.0.0.0:{PORT}"

[admin]
address = "127.0.0.1:{ADMIN}"

[[clusters]]
name = "up"
endpoints = ["127.0.0.1:9"]

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"

[kernel]
interfaces = [{names}]
deny_cidrs = [{cidrs}]
splice_tunnels = true

[[kernel.classes]]
name = "edge"
ports = [{PORT}]
dscp = 10
"""


def connects(veth: VethPair, src: str, timeout: float = 0.5) -> bool:
    with in_netns(veth.cli):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((src, 0))
        s.settimeout(timeout)
        s.connect((veth.SRV4, PORT))
        return True
    except OSError:
        return False
    finally:
        s.close()


def scrape(veth: VethPair) -> dict[tuple, float]:
    with in_netns(veth.srv):
        text = httpx.get(f"http://127.0.0.1:{ADMIN}/metrics", timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def start_in_netns(veth: VethPair, path: Path, env: dict | None = None):
    proc = start_process(["ip", "netns", "exec", veth.srv, sys.executable, "-m", "aiproxy",
                          "-c", str(path)], env=env)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc
        if connects(veth, veth.CLI4_ALLOWED, 0.2):
            try:
                scrape(veth)
                return proc
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    raise TimeoutError("proxy did not come up in the namespace\n" + process_log(proc))


def wait_reloaded(veth: VethPair, key: str, n: int) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        samples = scrape(veth)
        if samples.get((key, ())) == n:
            return samples
        time.sleep(0.05)
    raise TimeoutError(f"{key} never reached {n}")


@pytest.fixture
def proxy_in_netns(veth: VethPair, tmp_path: Path):
    procs: list[subprocess.Popen] = []

    def _start(text: str, env: dict | None = None):
        path = tmp_path / "aiproxy.toml"
        path.write_text(text)
        proc = start_in_netns(veth, path, env)
        procs.append(proc)
        return proc, path

    yield _start
    for proc in procs:
        stop_process(proc)  # also for one that exited: it removes the log


@pytest.mark.timeout(90)
def test_start_reload_stop(veth, proxy_in_netns):
    proc, path = proxy_in_netns(config([f"{veth.CLI4_DENIED}/32"]))
    assert proc.poll() is None, process_log(proc)
    state = interface_state("vsrv", veth.srv)
    assert state.xdp_prog_id and state.tc_ingress and state.tc_egress, state
    prog_id = state.xdp_prog_id

    assert connects(veth, veth.CLI4_ALLOWED)
    assert not connects(veth, veth.CLI4_DENIED)
    samples = scrape(veth)
    assert samples[("aiproxy_kernel_xdp_packets_total", (("result", "dropped_deny"),))] >= 1
    assert samples[("aiproxy_kernel_xdp_packets_total", (("result", "passed"),))] >= 1
    assert samples[("aiproxy_kernel_tc_packets_total", (("class", "edge"),))] >= 1
    assert samples[("aiproxy_kernel_tc_bytes_total", (("class", "edge"),))] > 0
    assert samples[("aiproxy_kernel_programs_attached", (("hook", "xdp"),
                                                         ("interface", "vsrv")))] == 1

    # SIGHUP with the allowed source on the deny list: denied as soon as the reload is
    # done, by the same program (no detach, no gap).
    path.write_text(config([f"{veth.CLI4_DENIED}/32", f"{veth.CLI4_ALLOWED}/32"]))
    proc.send_signal(signal.SIGHUP)
    wait_reloaded(veth, "aiproxy_config_reloads_total", 1)
    assert not connects(veth, veth.CLI4_ALLOWED)
    assert interface_state("vsrv", veth.srv).xdp_prog_id == prog_id

    # A [kernel] that cannot be applied is rejected as a whole: old maps, same program.
    path.write_text(config([], interfaces=("vsrv", "nosuchif0")))
    proc.send_signal(signal.SIGHUP)
    wait_reloaded(veth, "aiproxy_config_reload_failures_total", 1)
    assert interface_state("vsrv", veth.srv).xdp_prog_id == prog_id
    assert not connects(veth, veth.CLI4_ALLOWED)
    assert "nosuchif0" in process_log(proc)

    # Back to the first list: the allowed source passes again.
    path.write_text(config([f"{veth.CLI4_DENIED}/32"]))
    proc.send_signal(signal.SIGHUP)
    wait_reloaded(veth, "aiproxy_config_reloads_total", 2)
    assert connects(veth, veth.CLI4_ALLOWED)
    assert interface_state("vsrv", veth.srv).xdp_prog_id == prog_id

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0, process_log(proc)
    state = interface_state("vsrv", veth.srv)
    assert state.xdp_prog_id is None and not state.tc_ingress and not state.tc_egress, state
    assert connects(veth, veth.CLI4_DENIED) is False  # nothing listens; nothing filters
    out = subprocess.run(["ip", "-n", veth.srv, "-d", "link", "show", "vsrv"],
                         capture_output=True, text=True).stdout
    assert "xdp" not in out, out


@pytest.mark.timeout(90)
def test_reload_attaches_again_to_a_recreated_interface(veth, proxy_in_netns):
    # An interface deleted and made again under its name has lost the programs (they
    # went with the old one). A SIGHUP used to leave it unprotected, as the proxy only
    # attached interfaces new to the config; now it attaches again what is missing.
    proc, path = proxy_in_netns(config([f"{veth.CLI4_DENIED}/32"]))
    assert proc.poll() is None, process_log(proc)
    assert interface_state("vsrv", veth.srv).xdp_prog_id
    assert not connects(veth, veth.CLI4_DENIED)

    veth.recreate()
    state = interface_state("vsrv", veth.srv)
    assert state.xdp_prog_id is None and not state.tc_ingress, state
    assert connects(veth, veth.CLI4_DENIED)  # the deny list no longer holds

    proc.send_signal(signal.SIGHUP)
    wait_reloaded(veth, "aiproxy_config_reloads_total", 1)
    state = interface_state("vsrv", veth.srv)
    assert state.xdp_prog_id and state.tc_ingress and state.tc_egress, (
        state, process_log(proc))
    assert not connects(veth, veth.CLI4_DENIED)
    assert connects(veth, veth.CLI4_ALLOWED)
    assert "attaching again" in process_log(proc)
    prog_id = state.xdp_prog_id

    # A reload with nothing missing leaves the program as it is.
    proc.send_signal(signal.SIGHUP)
    wait_reloaded(veth, "aiproxy_config_reloads_total", 2)
    assert interface_state("vsrv", veth.srv).xdp_prog_id == prog_id

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0, process_log(proc)
    assert interface_state("vsrv", veth.srv).xdp_prog_id is None


@pytest.mark.timeout(60)
def test_missing_interface_fails_start(veth, proxy_in_netns):
    proc, _ = proxy_in_netns(config([], interfaces=("nosuchif0",)))
    assert proc.wait(15) == 2
    log = process_log(proc)
    assert "[kernel]" in log and "nosuchif0" in log, log


BAD_XDP = r"""
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
SEC("xdp")
int xdp_guard(struct xdp_md *ctx)
{
	/* reads the packet without a bounds check: the verifier says no */
	return *(int *)(long)ctx->data;
}
char _license[] SEC("license") = "GPL";
"""


@pytest.mark.timeout(60)
def test_verifier_rejection_names_program_and_log(veth, proxy_in_netns, tmp_path):
    if shutil.which("clang") is None:
        pytest.skip("clang not installed")
    objects = tmp_path / "objects"
    objects.mkdir()
    src = tmp_path / "bad.c"
    src.write_text(BAD_XDP)
    arch = next(Path("/usr/include").glob("*-linux-gnu"), None)
    subprocess.run(["clang", "-target", "bpf", "-O2", "-g", *(["-I", str(arch)] if arch else []),
                    "-c", str(src), "-o", str(objects / "xdp_guard.bpf.o")], check=True)
    proc, _ = proxy_in_netns(config([]), env={"AIPROXY_BPF_OBJECTS": str(objects)})
    assert proc.wait(15) == 2
    log = process_log(proc)
    assert "'xdp_guard'" in log and "verifier log" in log, log
    assert "invalid access to packet" in log, log
    state = interface_state("vsrv", veth.srv)
    assert state.xdp_prog_id is None and not state.tc_ingress, state


@pytest.mark.timeout(60)
def test_reload_leaves_xdp_mode_to_a_restart(veth, proxy_in_netns):
    """An interface stays attached in the xdp_mode it was attached in: a reload that
    changes xdp_mode does not move it, and /config says so (the mode served, and the
    change in pending_restart)."""
    proc, path = proxy_in_netns(config([]).replace("[kernel]\n", '[kernel]\nxdp_mode = "native"\n'))
    assert proc.poll() is None, process_log(proc)
    before = interface_state("vsrv", veth.srv)
    assert before.xdp_prog_id, before
    path.write_text(config([]).replace("[kernel]\n", '[kernel]\nxdp_mode = "generic"\n'))
    proc.send_signal(signal.SIGHUP)
    wait_reloaded(veth, "aiproxy_config_reloads_total", 1)
    after = interface_state("vsrv", veth.srv)
    assert (after.xdp_prog_id, after.xdp_mode) == (before.xdp_prog_id, before.xdp_mode), after
    with in_netns(veth.srv):
        view = httpx.get(f"http://127.0.0.1:{ADMIN}/config", timeout=5).json()
    assert view["kernel"]["xdp_mode"] == "native", view["kernel"]
    assert view["pending_restart"] == ["kernel.xdp_mode: generic (vsrv attached with native)"]
