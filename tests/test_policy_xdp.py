"""[policy] deny rules on source CIDRs alone go into the XDP deny map with
`aiproxy bpf attach` (real xdp_guard in a network namespace pair)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile

from aiproxy.governance.policy import kernel_deny_cidrs, load_policy_files
from aiproxy.kernel.manager import pin_dir_for, remove_pins
from tests.kernel.conftest import bpf_ok, veth  # noqa: F401 (fixtures)
from tests.kernel.test_netns_e2e import PORT, listen, try_connect

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


def test_only_unconditional_cidr_denies_go_to_the_kernel():
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as fh:
        fh.write(POLICY.format(denied="192.0.2.1", allowed="192.0.2.2"))
    assert kernel_deny_cidrs(load_policy_files([fh.name])) == ("192.0.2.1/32",)


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
