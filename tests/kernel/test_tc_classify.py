"""tc_classify on crafted packets through BPF_PROG_TEST_RUN (sched_cls)."""

from __future__ import annotations

import struct

import pytest

pytest.importorskip("scapy")
from scapy.layers.inet import IP, TCP, UDP  # noqa: E402
from scapy.layers.inet6 import IPv6  # noqa: E402
from scapy.layers.l2 import Dot1Q, Ether  # noqa: E402

from aiproxy.config.schema import TrafficClass  # noqa: E402
from aiproxy.kernel.maps import ClassifyMaps  # noqa: E402

from .conftest import load  # noqa: E402

TC_ACT_OK = 0
SKB_SIZE, SKB_PRIORITY = 192, 32  # sizeof(struct __sk_buff), offsetof(.., priority)
ETH = dict(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
CLASSES = (
    TrafficClass("chat", 1, ports=(8080,), payload=("post_v1",), dscp=46, priority=6),
    TrafficClass("grpc", 2, ports=(50051,), payload=("h2_preface",), dscp=34),
    TrafficClass("bulk", 3, ports=(9000,), priority=1),
)


@pytest.fixture
def tc(bpf_ok):
    obj = load("tc_classify")
    maps = ClassifyMaps.of(obj)
    maps.sync(CLASSES)
    yield obj, maps
    obj.close()


def run(obj, pkt) -> tuple[int, bytes, int]:
    """(retval, packet out, skb->priority out)"""
    res = obj.program("tc_classify").test_run(bytes(pkt), ctx=bytes(SKB_SIZE),
                                              ctx_out_size=SKB_SIZE)
    priority = struct.unpack_from("=I", res.ctx, SKB_PRIORITY)[0]
    return res.retval, res.data, priority


def v4(dport, sport=40000, payload=b"", tos=0, proto=TCP):
    return Ether(**ETH) / IP(src="10.0.0.2", dst="10.0.0.1", tos=tos) / proto(
        sport=sport, dport=dport) / payload


def checksum_ok(frame: bytes) -> bool:
    ip = Ether(frame)[IP]
    sent = ip.chksum
    del ip.chksum
    return IP(bytes(ip))[IP].chksum == sent


def test_port_class_sets_dscp_priority_and_checksum(tc):
    obj, maps = tc
    rc, out, prio = run(obj, v4(8080, tos=0x01))  # ECN bit set: must be kept
    assert rc == TC_ACT_OK and prio == 6
    assert Ether(out)[IP].tos == (46 << 2) | 0x01
    assert checksum_ok(out)
    assert maps.stats()["chat"] == {"packets": 1, "bytes": len(bytes(v4(8080)))}


def test_source_port_classifies_replies(tc):
    obj, _ = tc
    _, out, prio = run(obj, v4(40000, sport=50051))
    assert Ether(out)[IP].tos >> 2 == 34 and prio == 0  # grpc sets no priority
    assert checksum_ok(out)


def test_priority_only_class_leaves_packet_alone(tc):
    obj, _ = tc
    pkt = bytes(v4(9000, tos=0x20))
    _, out, prio = run(obj, pkt)
    assert prio == 1 and out == pkt


def test_udp_ports(tc):
    obj, _ = tc
    _, out, _ = run(obj, v4(8080, proto=UDP))
    assert Ether(out)[IP].tos >> 2 == 46 and checksum_ok(out)


def test_unclassified_untouched_and_counted(tc):
    obj, maps = tc
    pkt = bytes(v4(22, payload=b"SSH-2.0"))
    rc, out, prio = run(obj, pkt)
    assert (rc, out, prio) == (TC_ACT_OK, pkt, 0)
    assert maps.stats()["unclassified"]["packets"] == 1


@pytest.mark.parametrize("payload,cls,dscp", [
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "grpc", 34),
    (b"POST /v1/chat/completions HTTP/1.1\r\n", "chat", 46),
    (b"POST /v1/", "chat", 46),  # exactly 9 bytes
])
def test_payload_signatures(tc, payload, cls, dscp):
    obj, maps = tc
    _, out, _ = run(obj, v4(12345, payload=payload))  # port says nothing
    assert Ether(out)[IP].tos >> 2 == dscp
    assert checksum_ok(out)
    assert maps.stats()[cls]["packets"] == 1


@pytest.mark.parametrize("payload", [b"POST /v2/x", b"GET /v1/models", b"PRI * HTTP/1.1\r\n", b"POST /v1"])
def test_payload_near_misses(tc, payload):
    obj, _ = tc
    pkt = bytes(v4(12345, payload=payload))
    _, out, prio = run(obj, pkt)
    assert out == pkt and prio == 0


def test_payload_signature_off_by_config(tc):
    obj, maps = tc
    maps.sync((TrafficClass("chat", 1, ports=(8080,), dscp=46),))
    pkt = bytes(v4(12345, payload=b"POST /v1/chat"))
    assert run(obj, pkt)[1] == pkt


def test_ipv6_traffic_class(tc):
    obj, _ = tc
    pkt = Ether(**ETH) / IPv6(src="fd00::2", dst="fd00::1", tc=0x02, fl=0xABCDE) / TCP(
        sport=1234, dport=8080)
    _, out, prio = run(obj, pkt)
    ip6 = Ether(out)[IPv6]
    assert ip6.tc == (46 << 2) | 0x02 and ip6.fl == 0xABCDE and ip6.version == 6
    assert prio == 6


def test_vlan_tagged(tc):
    obj, _ = tc
    pkt = Ether(**ETH) / Dot1Q(vlan=7) / IP(src="10.0.0.2", dst="10.0.0.1") / TCP(dport=8080)
    _, out, prio = run(obj, pkt)
    assert Ether(out)[IP].tos >> 2 == 46 and prio == 6 and checksum_ok(out)


def _tagged(dport):
    return Ether(**ETH) / Dot1Q(vlan=7) / IP(src="10.0.0.2", dst="10.0.0.1") / TCP(dport=dport)


# (The kernel's test harness itself rejects an untagged IPv4 frame shorter than an IP
# header, so the cut-IP-header case goes through a VLAN tag.)
@pytest.mark.parametrize("pkt", [bytes(v4(8080))[:14 + 20 + 6], bytes(_tagged(8080))[:18 + 10],
                                 bytes(_tagged(8080))[:18 + 20 + 12]],
                         ids=["tcp-cut", "ip-cut-tagged", "tcp-cut-tagged"])
def test_short_packets_pass_untouched(tc, pkt):
    obj, _ = tc
    rc, out, prio = run(obj, pkt)
    assert rc == TC_ACT_OK and out == pkt and prio == 0


def test_reload_changes_marks_in_place(tc):
    obj, maps = tc
    maps.sync((TrafficClass("chat", 1, ports=(8080,), dscp=10),))
    _, out, prio = run(obj, v4(8080))
    assert Ether(out)[IP].tos >> 2 == 10 and prio == 0
    _, out, _ = run(obj, v4(9000))  # class 3 is gone
    assert Ether(out)[IP].tos == 0
