"""End to end on a veth pair between two network namespaces (srv <-> cli).

xdp_guard and tc_classify are attached to the srv side (vsrv) with pyroute2, through
KernelFastPaths and through the `aiproxy bpf` CLI. Traffic: real TCP connects and UDP
datagrams from sockets made inside the namespaces, plus frames written with AF_PACKET
on vcli. Nothing leaves the two namespaces.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time

import pytest

pytest.importorskip("scapy")
from scapy.layers.inet import IP, TCP, UDP  # noqa: E402
from scapy.layers.l2 import Ether  # noqa: E402

from aiproxy.config.schema import KernelConfig, TrafficClass  # noqa: E402
from aiproxy.kernel.manager import KernelFastPaths, pin_dir_for, remove_pins  # noqa: E402

from .conftest import VethPair, in_netns  # noqa: E402

PORT = 7080  # the "proxy" port on srv
IP_RECVTOS, IP_TOS = 13, 1
IPV6_RECVTCLASS, IPV6_TCLASS = 66, 67


@pytest.fixture
def fast(veth: VethPair):
    started: list[KernelFastPaths] = []

    def _start(cfg: KernelConfig) -> KernelFastPaths:
        f = KernelFastPaths(cfg, netns=veth.srv)
        started.append(f)
        f.start()
        return f

    yield _start
    for f in started:
        f.stop()


def listen(veth: VethPair, family: int, addr: str, port: int = PORT) -> socket.socket:
    with in_netns(veth.srv):
        s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(64)
    return s


def try_connect(veth: VethPair, family: int, src: str, dst: str, timeout=0.5) -> bool:
    with in_netns(veth.cli):
        s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((src, 0))
        s.settimeout(timeout)
        s.connect((dst, PORT))
        return True
    except (TimeoutError, OSError):
        return False
    finally:
        s.close()


def raw_sender(veth: VethPair) -> socket.socket:
    with in_netns(veth.cli):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    s.bind(("vcli", 0))
    return s


def test_deny_list_and_live_update(veth, fast):
    cfg = KernelConfig(interfaces=("vsrv",), xdp_mode="native",
                       deny_cidrs=(f"{veth.CLI4_DENIED}/32", f"{veth.CLI6_DENIED}/128"))
    f = fast(cfg)
    assert f.attached["vsrv"]["xdp"] == "native"
    srv4 = listen(veth, socket.AF_INET, veth.SRV4)
    srv6 = listen(veth, socket.AF_INET6, veth.SRV6)
    try:
        assert try_connect(veth, socket.AF_INET, veth.CLI4_ALLOWED, veth.SRV4)
        assert try_connect(veth, socket.AF_INET6, veth.CLI6_ALLOWED, veth.SRV6)
        assert not try_connect(veth, socket.AF_INET, veth.CLI4_DENIED, veth.SRV4)
        assert not try_connect(veth, socket.AF_INET6, veth.CLI6_DENIED, veth.SRV6)
        assert f.counters()["xdp"]["dropped_deny"] >= 2  # SYN + retransmits

        # Swap the list at run time: takes effect on the next packet, no re-attach.
        prog_id = _xdp_prog_id(veth)
        f.reload(KernelConfig(interfaces=("vsrv",), xdp_mode="native",
                              deny_cidrs=(f"{veth.CLI4_ALLOWED}/32",)))
        assert _xdp_prog_id(veth) == prog_id
        assert try_connect(veth, socket.AF_INET, veth.CLI4_DENIED, veth.SRV4)
        assert try_connect(veth, socket.AF_INET6, veth.CLI6_DENIED, veth.SRV6)
        assert not try_connect(veth, socket.AF_INET, veth.CLI4_ALLOWED, veth.SRV4)
    finally:
        srv4.close()
        srv6.close()


def _xdp_prog_id(veth: VethPair) -> int | None:
    from aiproxy.kernel.attach import xdp_state

    return xdp_state("vsrv", veth.srv)["prog_id"]


def test_counters_match_what_was_sent(veth, fast):
    f = fast(KernelConfig(interfaces=("vsrv",), xdp_mode="generic",
                          deny_cidrs=(f"{veth.CLI4_DENIED}/32",),
                          syn_rate_per_source=1, syn_burst=2, syn_ports=(PORT,)))
    assert f.attached["vsrv"]["xdp"] == "generic"
    f.guard.reset_counters()
    tx = raw_sender(veth)
    try:
        def frame(src, l4):
            return bytes(Ether(src=veth.cli_mac, dst=veth.srv_mac) / IP(src=src, dst=veth.SRV4)
                         / l4)

        for i in range(20):
            tx.send(frame(veth.CLI4_DENIED, UDP(sport=5000 + i, dport=9) / b"x"))
        for i in range(30):
            tx.send(frame(veth.CLI4_ALLOWED, UDP(sport=5000 + i, dport=9) / b"x"))
        for i in range(10):  # 10 new connections from one source, 2 allowed by the bucket
            tx.send(frame(veth.CLI4_ALLOWED, TCP(sport=6000 + i, dport=PORT, flags="S")))
        time.sleep(0.2)
    finally:
        tx.close()
    c = f.counters()["xdp"]
    assert c["dropped_deny"] == 20
    assert c["dropped_ratelimit"] == 8
    # 30 datagrams + 2 SYNs, plus the RSTs cli's kernel sends back for the SYN-ACKs.
    assert 32 <= c["passed"] <= 40
    assert c["malformed"] == 0


def _recv_tos(sock: socket.socket, level: int, ctype: int) -> tuple[bytes, int]:
    sock.settimeout(3)
    data, anc, _flags, _addr = sock.recvmsg(256, socket.CMSG_SPACE(4))
    for lvl, typ, value in anc:
        if lvl == level and typ == ctype:
            return data, value[0] if len(value) == 1 else struct.unpack("=i", value)[0]
    raise AssertionError(f"no TOS/TCLASS ancillary data: {anc}")


def test_tc_marks_classified_packets(veth, fast):
    classes = (TrafficClass("ai", 1, ports=(PORT,), dscp=46, priority=5),
               TrafficClass("openai", 2, payload=("post_v1",), dscp=10))
    f = fast(KernelConfig(interfaces=("vsrv",), classes=classes))
    assert f.attached["vsrv"]["tc"]
    with in_netns(veth.cli):
        rx4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    with in_netns(veth.srv):
        tx4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tx6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    try:
        rx4.bind((veth.CLI4_ALLOWED, 0))
        rx4.setsockopt(socket.IPPROTO_IP, IP_RECVTOS, 1)
        rx6.bind((veth.CLI6_ALLOWED, 0))
        rx6.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVTCLASS, 1)
        tx4.bind((veth.SRV4, PORT))  # egress from the class port
        tx6.bind((veth.SRV6, PORT))
        tx4.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 0x01)  # ECN bits survive
        tx4.sendto(b"classified", rx4.getsockname())
        data, tos = _recv_tos(rx4, socket.IPPROTO_IP, IP_TOS)
        assert data == b"classified" and tos == (46 << 2) | 0x01
        tx6.sendto(b"classified6", rx6.getsockname()[:2])
        data, tclass = _recv_tos(rx6, socket.IPPROTO_IPV6, IPV6_TCLASS)
        assert data == b"classified6" and tclass >> 2 == 46
        # An unclassified port keeps TOS 0.
        with in_netns(veth.srv):
            other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        other.bind((veth.SRV4, PORT + 1))
        other.sendto(b"plain", rx4.getsockname())
        assert _recv_tos(rx4, socket.IPPROTO_IP, IP_TOS) == (b"plain", 0)
        other.close()
    finally:
        for s in (rx4, rx6, tx4, tx6):
            s.close()

    # Payload classification on ingress: a TCP request starting "POST /v1/" to a port
    # no class names.
    srv = listen(veth, socket.AF_INET, veth.SRV4, PORT + 2)
    try:
        with in_netns(veth.cli):
            c = socket.socket()
        c.settimeout(3)
        c.connect((veth.SRV4, PORT + 2))
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n")
        conn, _ = srv.accept()
        conn.settimeout(3)
        assert conn.recv(9) == b"POST /v1/"
        conn.close()
        c.close()
    finally:
        srv.close()
    stats = f.counters()["tc"]
    assert stats["openai"]["packets"] >= 1
    assert stats["ai"]["packets"] >= 2


def test_cli_attach_status_detach(veth, tmp_path):
    cfg = tmp_path / "k.toml"
    cfg.write_text(f"""
[[listeners]]
name = "p"
address = "127.0.0.1:{PORT}"

[kernel]
interfaces = ["vsrv"]
xdp_mode = "generic"
deny_cidrs = ["{veth.CLI4_DENIED}/32"]
syn_rate_per_source = 100
classes = [{{ name = "ai", ports = [{PORT}], dscp = 46 }}]
""")

    def cli(*args):
        res = subprocess.run([sys.executable, "-m", "aiproxy", "bpf", *args, "-c", str(cfg),
                              "--netns", veth.srv, "--json"], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    try:
        out = cli("attach")
        assert out["attached"]["vsrv"] == {"xdp": "generic", "tc": True}
        assert not try_connect(veth, socket.AF_INET, veth.CLI4_DENIED, veth.SRV4, 0.3)
        status = cli("status")
        assert status["interfaces"]["vsrv"]["xdp"] == "generic"
        assert status["interfaces"]["vsrv"]["tc_ingress"] is True
        assert status["counters"]["xdp"]["dropped_deny"] >= 1
        # attach again after an edit: maps updated in place, counters kept (pinned maps)
        cfg.write_text(cfg.read_text().replace(f'"{veth.CLI4_DENIED}/32"', ""))
        cli("attach")
        srv = listen(veth, socket.AF_INET, veth.SRV4)
        try:
            assert try_connect(veth, socket.AF_INET, veth.CLI4_DENIED, veth.SRV4)
        finally:
            srv.close()
        assert cli("status")["counters"]["xdp"]["dropped_deny"] >= 1
        out = cli("detach")
        assert out["detached"]["vsrv"] == {"xdp": True, "tc": ["ingress", "egress"]}
        status = cli("status")
        assert status["interfaces"]["vsrv"]["xdp"] is None
        assert status["counters"] == {}
    finally:
        remove_pins(pin_dir_for(veth.srv))
