"""Operator-facing edges of attach/detach: a mistyped namespace, a missing or vanished
interface. Real programs on a veth pair in namespaces made by the fixture; nothing leaves
them.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import uuid

import pytest

from aiproxy.config.schema import KernelConfig
from aiproxy.kernel import attach
from aiproxy.kernel.libbpf import BPFError
from aiproxy.kernel.manager import KernelFastPaths, pin_dir_for, remove_pins

from .conftest import VethPair, run


def _config(tmp_path, interfaces: list[str]) -> str:
    path = tmp_path / "k.toml"
    names = ", ".join(f'"{i}"' for i in interfaces)
    path.write_text(f"""
[[listeners]]
name = "p"
address = "127.0.0.1:46310"

[kernel]
interfaces = [{names}]
xdp_mode = "generic"
deny_cidrs = ["192.0.2.0/24"]
""")
    return str(path)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiproxy", "bpf", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_mistyped_netns_is_an_error_and_not_created(bpf_ok, tmp_path):
    # pyroute2 creates a namespace it cannot find: a typo used to make an empty one
    # (and leave pinned maps for it), reported as "no interface ... in netns TYPO".
    name = f"aipk-nosuch-{uuid.uuid4().hex[:6]}"
    cfg = _config(tmp_path, ["vsrv"])
    try:
        for action in ("status", "attach", "detach"):
            res = _cli(action, "-c", cfg, "--netns", name)
            assert res.returncode == 1, (action, res.stdout, res.stderr)
            assert f"no network namespace {name!r}" in res.stderr, res.stderr
            assert "Traceback" not in res.stderr
            assert not os.path.exists(f"/run/netns/{name}"), f"{action} created {name}"
            assert not os.path.exists(pin_dir_for(name)), f"{action} pinned maps for {name}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        remove_pins(pin_dir_for(name))


def test_reload_after_an_attached_interface_vanished(veth: VethPair):
    # An interface that goes away takes its programs with it; dropping it from the
    # config must then be accepted (it used to fail with "no interface", and every
    # later reload with it, until a restart).
    run("ip", "-n", veth.srv, "link", "add", "bpfaudx0", "type", "veth", "peer", "name",
        "bpfaudx1")
    run("ip", "-n", veth.srv, "link", "set", "bpfaudx0", "up")
    fast = KernelFastPaths(KernelConfig(interfaces=("vsrv", "bpfaudx0"), xdp_mode="generic",
                                        deny_cidrs=("192.0.2.0/24",)), netns=veth.srv)
    fast.start()
    try:
        before = attach.interface_state("vsrv", veth.srv).xdp_prog_id
        assert before is not None
        run("ip", "-n", veth.srv, "link", "del", "bpfaudx0")
        fast.reload(KernelConfig(interfaces=("vsrv",), xdp_mode="generic",
                                 deny_cidrs=("198.51.100.0/24",)))
        assert set(fast.attached) == {"vsrv"}
        assert attach.interface_state("vsrv", veth.srv).xdp_prog_id == before
        assert fast.counters()["xdp"] is not None
        assert len(list(fast.guard.maps["guard_deny_v4"].keys())) == 1
    finally:
        fast.stop()
    assert attach.interface_state("vsrv", veth.srv).xdp_prog_id is None
    assert _prog_fds(before) == []  # the vanished interface's hold went too


def _prog_fds(prog_id: int) -> list[str]:
    """This process's fds on BPF program ``prog_id`` (what keeps it loaded)."""
    found = []
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            info = open(f"/proc/self/fdinfo/{fd}").read()
        except OSError:  # closed meanwhile (the listdir's own fd)
            continue
        if re.search(rf"^prog_id:\s+{prog_id}$", info, re.M):
            found.append(fd)
    return found


@pytest.mark.parametrize("gone", [("link", "del", "bpfaudx0"),
                                  ("link", "set", "dev", "bpfaudx0", "xdpgeneric", "off")])
def test_stop_after_our_xdp_attachment_went_keeps_no_program(veth: VethPair, gone):
    # attach.py keeps a dup of each attached XDP program's fd (for a process without
    # CAP_SYS_ADMIN); an interface that went away took its attachment with it (or an
    # operator detached it), and the stop left that dup open: the program stayed loaded
    # as long as the process lived.
    run("ip", "-n", veth.srv, "link", "add", "bpfaudx0", "type", "veth", "peer", "name",
        "bpfaudx1")
    run("ip", "-n", veth.srv, "link", "set", "bpfaudx0", "up")
    fast = KernelFastPaths(KernelConfig(interfaces=("bpfaudx0",), xdp_mode="generic"),
                           netns=veth.srv)
    fast.start()
    try:
        ours = attach.interface_state("bpfaudx0", veth.srv).xdp_prog_id
        assert ours is not None and _prog_fds(ours)
        run("ip", "-n", veth.srv, *gone)
    finally:
        fast.stop()
    assert _prog_fds(ours) == []


def test_cli_attach_rerun_with_missing_interface_keeps_the_last_attach(veth, tmp_path):
    # `aiproxy bpf attach` again after an edit that names a missing interface: an error
    # naming [kernel] interfaces, and what the last run attached (programs and deny
    # list) stays as it was. It used to sync the maps to the bad config and then detach
    # the interfaces that were fine.
    cfg = _config(tmp_path, ["vsrv"])
    try:
        res = _cli("attach", "-c", cfg, "--netns", veth.srv)
        assert res.returncode == 0, res.stderr
        prog = attach.interface_state("vsrv", veth.srv).xdp_prog_id
        assert prog is not None
        bad = tmp_path / "bad.toml"
        bad.write_text(open(cfg).read().replace('["vsrv"]', '["vsrv", "nosuchif0"]')
                       .replace("192.0.2.0/24", "198.51.100.0/24"))
        res = _cli("attach", "-c", str(bad), "--netns", veth.srv)
        assert res.returncode == 1, (res.stdout, res.stderr)
        state = attach.interface_state("vsrv", veth.srv)
        assert state.xdp_prog_id == prog, "the earlier attachment was undone"
        assert "nosuchif0" in res.stderr and "[kernel] interfaces" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
        res = _cli("status", "-c", cfg, "--netns", veth.srv, "--json")
        assert res.returncode == 0, res.stderr
        assert '"v4": 1' in res.stdout
        from aiproxy.kernel.libbpf import Map
        trie = Map.from_pin(f"{pin_dir_for(veth.srv)}/xdp_guard/guard_deny_v4")
        try:
            keys = list(trie.keys())
        finally:
            trie.close()
        assert keys == [bytes([24, 0, 0, 0, 192, 0, 2, 0])], keys
    finally:
        _cli("detach", "-c", cfg, "--netns", veth.srv)
        remove_pins(pin_dir_for(veth.srv))


# -- somebody else's XDP program ----------------------------------------------------------

FOREIGN_C = """
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
SEC("xdp") int ddos_filter(struct xdp_md *ctx) { return XDP_PASS; }
char _license[] SEC("license") = "GPL";
"""


@pytest.fixture
def foreign_obj(tmp_path) -> str:
    """A tiny XDP program that is not aiproxy's (as a DDoS filter would be), built with
    clang and attached with iproute2 like an operator would."""
    if shutil.which("clang") is None or not os.path.exists("/usr/include/bpf/bpf_helpers.h"):
        pytest.skip("clang and libbpf headers are needed to build a foreign XDP program")
    src, obj = tmp_path / "foreign.c", tmp_path / "foreign.o"
    src.write_text(FOREIGN_C)
    arch = f"/usr/include/{platform.machine()}-linux-gnu"
    run("clang", "-target", "bpf", "-O2", *(["-I", arch] if os.path.isdir(arch) else []),
        "-c", str(src), "-o", str(obj))
    return str(obj)


def _attach_foreign(veth: VethPair, obj: str, force: bool = False) -> int:
    run("ip", *(["-force"] if force else []), "-n", veth.srv, "link", "set", "dev", "vsrv",
        "xdpgeneric", "obj", obj, "sec", "xdp")
    prog = _xdp_on_vsrv(veth)
    assert prog is not None and prog[1] == "ddos_filter", prog
    return prog[0]


def _xdp_on_vsrv(veth: VethPair) -> tuple[int, str] | None:
    """(id, name) of the XDP program on vsrv as iproute2 shows it."""
    out = run("ip", "-n", veth.srv, "-d", "link", "show", "vsrv")
    m = re.search(r"prog/xdp id (\d+) name (\S+)", out)
    return (int(m[1]), m[2]) if m else None


def test_cli_attach_and_detach_leave_a_foreign_xdp_program(veth, foreign_obj, tmp_path):
    # `aiproxy bpf attach` used to replace any XDP program on the interface, and
    # `detach` to remove whatever was there: another tool's filter was lost.
    foreign = _attach_foreign(veth, foreign_obj)
    cfg = _config(tmp_path, ["vsrv"])
    try:
        res = _cli("attach", "-c", cfg, "--netns", veth.srv)
        assert res.returncode == 1, (res.stdout, res.stderr)
        assert "not aiproxy's" in res.stderr and "ddos_filter" in res.stderr, res.stderr
        assert "xdpgeneric off" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
        assert _xdp_on_vsrv(veth) == (foreign, "ddos_filter")
        assert not os.path.exists(pin_dir_for(veth.srv)), "pinned maps for a refused attach"

        res = _cli("detach", "-c", cfg, "--netns", veth.srv, "--json")
        assert res.returncode == 0, (res.stdout, res.stderr)  # aiproxy is off it: done
        assert "not aiproxy's; left attached" in res.stderr, res.stderr
        assert '"xdp": false' in res.stdout and '"name": "ddos_filter"' in res.stdout, res.stdout
        assert _xdp_on_vsrv(veth) == (foreign, "ddos_filter")
    finally:
        _cli("detach", "-c", cfg, "--netns", veth.srv)
        remove_pins(pin_dir_for(veth.srv))


def test_stop_leaves_a_program_that_replaced_ours(veth, foreign_obj):
    # The proxy's own detach (stop, reload dropping the interface, the supervisor's
    # clean-up) removes only xdp_guard: one that another tool put in its place stays,
    # and a reload does not silently take the interface back.
    fast = KernelFastPaths(KernelConfig(interfaces=("vsrv",), xdp_mode="generic",
                                        deny_cidrs=("192.0.2.0/24",)), netns=veth.srv)
    fast.start()
    try:
        assert _xdp_on_vsrv(veth)[1] == "xdp_guard"
        foreign = _attach_foreign(veth, foreign_obj, force=True)
        with pytest.raises(BPFError, match="not aiproxy's"):
            fast.reload(KernelConfig(interfaces=("vsrv",), xdp_mode="generic",
                                     deny_cidrs=("198.51.100.0/24",)))
        assert _xdp_on_vsrv(veth) == (foreign, "ddos_filter")
    finally:
        fast.stop()
    assert _xdp_on_vsrv(veth) == (foreign, "ddos_filter")
    assert attach.detach_xdp("vsrv", veth.srv).id == foreign
    assert _xdp_on_vsrv(veth) == (foreign, "ddos_filter")
