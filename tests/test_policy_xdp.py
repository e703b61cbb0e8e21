"""[policy] deny rules on source CIDRs alone go into the XDP deny map with
`aiproxy bpf attach` and from the running proxy, following policy file changes (real
xdp_guard in a network namespace pair; skipped with the reason when not root or bpf() is
refused)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from aiproxy.governance.policy import kernel_deny_cidrs, load_policy_files
from aiproxy.kernel.attach import interface_state
from aiproxy.kernel.manager import pin_dir_for, remove_pins
from tests.kernel.conftest import bpf_ok, veth  # noqa: F401 (fixtures)
from tests.kernel.test_netns_e2e import PORT, listen, try_connect
from tests.kernel.test_server_kernel import config as server_config
from tests.kernel.test_server_kernel import connects as server_connects
from tests.kernel.test_server_kernel import proxy_in_netns, scrape, wait_reloaded  # noqa: F401
from tests.support import process_log

POLICY = """
[[rules]]
id = "bad-net"
effect = "deny"
source_cidrs = ["{denied}/32"]

[[rules]]
id = "bad-net-at-night"
effect = "deny"
source_cidrs = ["{allowed}/32"]
time = {{ from = "00:00", to = "00:01" }}

[[rules]]
id = "all"
effect = "allow"
"""


def test_only_unconditional_cidr_denies_go_to_the_kernel(tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY.format(denied="192.0.2.1", allowed="192.0.2.2"))
    assert kernel_deny_cidrs(load_policy_files([str(policy)])) == ("192.0.2.1/32",)


def test_bpf_attach_pushes_policy_denies(veth, tmp_path):  # noqa: F811
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY.format(denied=veth.CLI4_DENIED, allowed=veth.CLI4_ALLOWED))
    cfg = tmp_path / "k.toml"
    cfg.write_text(f"""
[[listeners]]
name = "p"
address = "127.0.0.1:{PORT}"

[kernel]
interfaces = ["vsrv"]
xdp_mode = "generic"

[policy]
files = ["{policy}"]
""")
    res = subprocess.run([sys.executable, "-m", "aiproxy", "bpf", "attach", "-c", str(cfg),
                          "--netns", veth.srv, "--json"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    try:
        srv = listen(veth, socket.AF_INET, veth.SRV4)
        try:
            assert not try_connect(veth, socket.AF_INET, veth.CLI4_DENIED, veth.SRV4, 0.3)
            assert try_connect(veth, socket.AF_INET, veth.CLI4_ALLOWED, veth.SRV4)
        finally:
            srv.close()
    finally:
        subprocess.run([sys.executable, "-m", "aiproxy", "bpf", "detach", "-c", str(cfg),
                        "--netns", veth.srv], capture_output=True, timeout=60)
        remove_pins(pin_dir_for(veth.srv))


ALLOW_ALL = """
[[rules]]
id = "all"
effect = "allow"
"""


def _write(path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # as an editor saves: the watcher never reads half a file


def _until(pair, src: str, reachable: bool) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server_connects(pair, src, 0.3) == reachable:
            return True
    return False


@pytest.mark.timeout(120)
def test_running_proxy_follows_policy_cidr_denies(veth, proxy_in_netns, tmp_path):  # noqa: F811
    """The proxy's own XDP program (in the srv namespace) takes the policy's CIDR-only
    denies: at start, when the policy file changes (no request, no restart) and when a
    SIGHUP switches policy files."""
    policy = tmp_path / "policy.toml"
    _write(policy, POLICY.format(denied=veth.CLI4_DENIED, allowed=veth.CLI4_ALLOWED))
    base = server_config([])
    proc, path = proxy_in_netns(base + f'\n[policy]\nfiles = ["{policy}"]\npoll_ms = 50\n')
    assert proc.poll() is None, process_log(proc)
    prog_id = interface_state("vsrv", veth.srv).xdp_prog_id
    # At start: the unconditional rule is in the map, the time-window one is not.
    assert not server_connects(veth, veth.CLI4_DENIED)
    assert server_connects(veth, veth.CLI4_ALLOWED)

    _write(policy, ALLOW_ALL)
    assert _until(veth, veth.CLI4_DENIED, True), process_log(proc)
    _write(policy, POLICY.format(denied=veth.CLI4_DENIED, allowed=veth.CLI4_ALLOWED))
    assert _until(veth, veth.CLI4_DENIED, False), process_log(proc)
    assert server_connects(veth, veth.CLI4_ALLOWED)
    samples = scrape(veth)
    assert samples[("aiproxy_kernel_xdp_packets_total", (("result", "dropped_deny"),))] >= 1

    # SIGHUP to a config naming another policy file: its denies replace the old ones.
    other = tmp_path / "other.toml"
    _write(other, POLICY.format(denied=veth.CLI4_ALLOWED, allowed=veth.CLI4_DENIED))
    path.write_text(base + f'\n[policy]\nfiles = ["{other}"]\n')
    proc.send_signal(signal.SIGHUP)
    wait_reloaded(veth, "aiproxy_config_reloads_total", 1)
    assert _until(veth, veth.CLI4_ALLOWED, False), process_log(proc)
    assert _until(veth, veth.CLI4_DENIED, True), process_log(proc)
    assert interface_state("vsrv", veth.srv).xdp_prog_id == prog_id  # updated in place
    assert "policy deny CIDRs in the XDP deny map" in process_log(proc)
