"""xdp_guard on crafted packets through BPF_PROG_TEST_RUN."""

from __future__ import annotations

import ipaddress

import pytest

pytest.importorskip("scapy")
from scapy.layers.inet import ICMP, IP, TCP, UDP, fragment  # noqa: E402
from scapy.layers.inet6 import (  # noqa: E402
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
    IPv6ExtHdrHopByHop,
    IPv6ExtHdrRouting,
)
from scapy.layers.l2 import ARP, Dot1AD, Dot1Q, Ether  # noqa: E402

from aiproxy.config.schema import KernelConfig  # noqa: E402
from aiproxy.kernel.maps import GuardMaps  # noqa: E402

from .conftest import load  # noqa: E402

XDP_DROP, XDP_PASS = 1, 2
DENY = ("192.0.2.0/24", "198.51.100.7/32", "2001:db8:bad::/48")
ETH = dict(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")


@pytest.fixture
def guard(bpf_ok):
    obj = load("xdp_guard")
    maps = GuardMaps.of(obj)
    maps.sync(KernelConfig(deny_cidrs=DENY, syn_rate_per_source=1, syn_burst=3,
                           syn_ports=(443, 8080)))
    yield obj, maps
    obj.close()


def run(obj, pkt) -> int:
    return obj.program("xdp_guard").test_run(bytes(pkt)).retval


def v4(src="203.0.113.9", dst="10.0.0.1", **kw):
    return Ether(**ETH) / IP(src=src, dst=dst, **kw)


def v6(src="2001:db8:1::9", dst="2001:db8:2::1"):
    return Ether(**ETH) / IPv6(src=src, dst=dst)


def test_pass_ordinary_traffic(guard):
    obj, maps = guard
    assert run(obj, v4() / TCP(dport=443, flags="A") / b"hello") == XDP_PASS
    assert run(obj, v4() / UDP(dport=53) / b"q") == XDP_PASS
    assert run(obj, v6() / TCP(dport=443, flags="PA") / b"x") == XDP_PASS
    assert run(obj, Ether(**ETH) / ARP()) == XDP_PASS
    assert maps.counters()["passed"] == 4


@pytest.mark.parametrize("src", ["192.0.2.1", "192.0.2.255", "198.51.100.7"])
def test_deny_v4(guard, src):
    obj, maps = guard
    assert run(obj, v4(src=src) / TCP(dport=22, flags="A")) == XDP_DROP
    assert run(obj, v4(src=src) / ICMP()) == XDP_DROP
    assert maps.counters()["dropped_deny"] == 2


@pytest.mark.parametrize("src", ["192.0.3.1", "198.51.100.8", "191.0.2.1"])
def test_near_misses_pass_v4(guard, src):
    obj, _ = guard
    assert run(obj, v4(src=src) / TCP(dport=22, flags="A")) == XDP_PASS


def test_deny_v6(guard):
    obj, maps = guard
    assert run(obj, v6(src="2001:db8:bad::1") / TCP(dport=443, flags="S")) == XDP_DROP
    assert run(obj, v6(src="2001:db8:bad:ffff::1") / UDP()) == XDP_DROP
    assert run(obj, v6(src="2001:db8:bae::1") / UDP()) == XDP_PASS
    assert maps.counters()["dropped_deny"] == 2


def test_deny_list_updates_in_place(guard):
    obj, maps = guard
    pkt = v4(src="203.0.113.50") / TCP(dport=80, flags="A")
    assert run(obj, pkt) == XDP_PASS
    maps.set_deny([ipaddress.ip_network("203.0.113.0/25")])
    assert run(obj, pkt) == XDP_DROP
    assert run(obj, v4(src="192.0.2.1") / UDP()) == XDP_PASS  # dropped from the list
    maps.set_deny([])
    assert run(obj, pkt) == XDP_PASS


def test_deny_changes_between_short_and_long_prefixes(guard):
    """The /24 bitmaps in front of the trie follow every kind of change."""
    obj, maps = guard
    inside, other = v4(src="100.64.1.1") / UDP(), v4(src="100.64.200.9") / UDP()
    net = ipaddress.ip_network
    maps.set_deny([net("100.64.0.0/16")])  # whole /24s: denied by the "full" bitmap
    assert (run(obj, inside), run(obj, other)) == (XDP_DROP, XDP_DROP)
    maps.set_deny([net("100.64.1.1/32")])  # same /24, now partial: the trie decides
    assert (run(obj, inside), run(obj, other)) == (XDP_DROP, XDP_PASS)
    assert run(obj, v4(src="100.64.1.2") / UDP()) == XDP_PASS
    maps.set_deny([net("100.64.1.0/24"), net("100.64.1.1/32")])
    assert run(obj, v4(src="100.64.1.2") / UDP()) == XDP_DROP
    maps.set_deny([net("100.0.0.0/8")])
    assert run(obj, v4(src="100.200.3.4") / UDP()) == XDP_DROP
    maps.set_deny([])
    assert (run(obj, inside), run(obj, other)) == (XDP_PASS, XDP_PASS)
    assert all(_u64(v) == 0 for name in ("guard_v4_summary", "guard_v4_full")
               for v in _words(obj.map(name)))


# -- the deny structures (aiproxy/kernel/deny.py) against a reference ----------------

net = ipaddress.ip_network


def _verdicts(obj, sources):
    out = {}
    for src in sources:
        pkt = (v4(src=src) if ":" not in src else v6(src=src)) / UDP(dport=9)
        out[src] = run(obj, pkt) == XDP_DROP
    return out


def _expected(nets, sources):
    return {src: any(ipaddress.ip_address(src) in n for n in nets) for src in sources}


def _probe_sources(nets, rnd):
    """Per prefix: its first and last address and the ones just outside it."""
    out = set()
    for n in nets:
        first, last = int(n.network_address), int(n.broadcast_address)
        top = (1 << n.max_prefixlen) - 1
        for a in (first, last, first - 1, last + 1,
                  first + rnd.randrange(n.num_addresses)):
            if 0 <= a <= top:
                out.add(str(ipaddress.ip_address(a) if n.version == 4
                            else ipaddress.IPv6Address(a)))
    return sorted(out)


def _held(obj, name):
    return set(obj.map(name).keys())


def _assert_exact(obj, maps, nets):
    """Program verdicts match CIDR membership, and the hash maps hold exactly what a
    fresh layout of `nets` would (a removal leaves nothing behind)."""
    from aiproxy.kernel import deny

    rnd = __import__("random").Random(len(nets))
    sources = _probe_sources(nets, rnd) + ["203.0.113.254", "2001:db8:ffff::1", "fd00::7"]
    assert _verdicts(obj, sources) == _expected(nets, sources)
    lay = deny.layout(nets)
    assert {int.from_bytes(k, "little") for k in _held(obj, "guard_v4_hosts")} == set(lay.hosts)
    assert _held(obj, "guard_v6_top") == set(lay.v6_top)
    exact = obj.map("guard_v6_exact")
    assert {k: exact.lookup(k) for k in exact.keys()} == lay.v6_exact
    assert _held(obj, "guard_deny_v6_short") == lay.v6_short
    assert _held(obj, "guard_deny_v4") | _held(obj, "guard_deny_v6") == lay.trie4 | lay.trie6
    # Slots: every slot this object was ever asked to fill holds its value or nothing.
    for name, want in (("guard_v4_slots", lay.v4_slots), ("guard_v6_slots", lay.v6_slots),
                       ("guard_v6_eslots", lay.v6_eslots)):
        m = obj.map(name)
        seen = _slots_seen.setdefault((id(obj), name), set())
        seen.update(want)
        busy = {i: raw for i in seen if any(raw := m.lookup(i.to_bytes(4, "little")))}
        assert busy == want, name


_slots_seen: dict[tuple[int, str], set[int]] = {}


def _clash(key: int, step: int = 1) -> int:
    """Another u32 key in the same slot as `key`."""
    from aiproxy.kernel.deny import slot_of

    other = key + step
    while slot_of(other) != slot_of(key):
        other += step
    return other


V4_OVERLAP = [net("10.1.0.0/16"), net("10.1.2.0/24"), net("10.1.2.128/25"), net("10.1.2.7/32"),
              net("10.2.3.64/26"), net("10.2.3.70/31"), net("10.2.3.200/32"),
              net("10.2.3.0/24")]
V6_FORMS = [net(text, strict=False) for text in (
    "2001:a01:1::/48",                                 # one prefix: inline
    "2001:a02::/64", "2001:a02:0:1:8000::/65",         # two: inline
    "2001:a03:1::/48", "2001:a03:2::/64", "2001:a03:3::/56", "2001:a03:4::/56",
    "2001:a03::1/128",                                 # five, four lengths: probed
    *(f"2001:a04:{i:x}00::/{40 + 8 * i}" for i in range(10)),  # ten lengths: search
    "2001:a05::/32", "2001:a05:5::/48",                # the /32 itself: all
    "2400::/12", "2400:cafe::/48",                     # shorter than /32, one inside
    "2a00::/20",                                       # shorter than /32 alone
)]


def test_deny_overlapping_v4(guard):
    obj, maps = guard
    maps.set_deny(V4_OVERLAP)
    _assert_exact(obj, maps, V4_OVERLAP)
    # Remove the covering /24 and /16: the longer ones inside them still hold.
    rest = [n for n in V4_OVERLAP if n.prefixlen > 24]
    maps.set_deny(rest)
    _assert_exact(obj, maps, rest)
    assert _verdicts(obj, ["10.2.3.1", "10.2.3.70", "10.1.9.9"]) == {
        "10.2.3.1": False, "10.2.3.70": True, "10.1.9.9": False}


def test_deny_v6_every_form(guard):
    obj, maps = guard
    from aiproxy.kernel import deny
    from aiproxy.kernel.structs import GUARD_V6_ALL, GUARD_V6_INLINE, GUARD_V6_SEARCH

    flags = {key.hex(): value[1] for key, value in deny.layout(V6_FORMS).v6_top.items()}
    assert flags == {"20010a01": GUARD_V6_INLINE, "20010a02": GUARD_V6_INLINE,
                     "20010a03": 0, "20010a04": GUARD_V6_SEARCH, "20010a05": GUARD_V6_ALL,
                     "2400cafe": GUARD_V6_ALL}
    maps.set_deny(V6_FORMS)
    _assert_exact(obj, maps, V6_FORMS)
    # The same prefixes crowded into one /32 (the search form), then back, then none.
    low = (1 << 80) - 1
    crowded = [net(((0x20010DB8 << 96) | ((int(n.network_address) >> 96) & 0xFFFF) << 80
                    | int(n.network_address) & low, n.prefixlen), strict=False)
               for n in V6_FORMS if n.prefixlen >= 48 and str(n).startswith("2001:a0")]
    assert len({n.prefixlen for n in crowded}) > 6
    maps.set_deny(crowded)
    _assert_exact(obj, maps, crowded)
    maps.set_deny(V6_FORMS)
    _assert_exact(obj, maps, V6_FORMS)
    maps.set_deny([])
    _assert_exact(obj, maps, [])


def test_deny_slot_clashes(guard):
    """Keys sharing a slot go through the hash maps (MULTI); when one goes, the other is
    answered from the slot again."""
    obj, maps = guard
    a4 = int(ipaddress.IPv4Address("10.9.8.0")) >> 8
    b4 = _clash(a4)
    a6 = 0x20010B01
    b6 = _clash(a6)
    v4a, v4b = (net((k << 8 | 5, 32)) for k in (a4, b4))
    # guard_v6_top keys are the first 4 address bytes read as a little-endian u32
    v6a, v6b = (net((int.from_bytes(k.to_bytes(4, "little"), "big") << 96 | 1 << 80, 48))
                for k in (a6, b6))
    both = [v4a, v4b, v6a, v6b]
    maps.set_deny(both)
    _assert_exact(obj, maps, both)
    from aiproxy.kernel.deny import layout
    from aiproxy.kernel.structs import GUARD_SLOT_MULTI

    lay = layout(both)
    assert [v[4] for v in lay.v4_slots.values()] == [GUARD_SLOT_MULTI]
    assert [v[4] for v in lay.v6_slots.values()] == [GUARD_SLOT_MULTI]
    maps.set_deny([v4a, v6b])
    _assert_exact(obj, maps, [v4a, v6b])
    maps.set_deny([v4b, v6a])
    _assert_exact(obj, maps, [v4b, v6a])


def test_deny_sync_fills_maps_the_record_does_not_know(guard):
    """Pinned record tries next to fresh maps (pins from another version): a sync with
    the same prefixes fills what the program looks at, not just the difference."""
    obj, maps = guard
    nets = V4_OVERLAP + V6_FORMS
    maps.set_deny(nets)
    lay = __import__("aiproxy.kernel.deny", fromlist=["layout"]).layout(nets)
    for name, idx in (("guard_v4_summary", lay.summary), ("guard_v4_full", lay.full),
                      ("guard_v4_slots", lay.v4_slots), ("guard_v6_slots", lay.v6_slots),
                      ("guard_v6_eslots", lay.v6_eslots)):
        m = obj.map(name)
        for i in idx:
            m.update(i.to_bytes(4, "little"), bytes(m.value_size))
    for name in ("guard_v4_hosts", "guard_v6_top", "guard_v6_exact"):
        obj.map(name).clear()
    assert run(obj, v4(src="10.1.2.7") / UDP()) == XDP_PASS  # the program lost them
    maps.set_deny(nets)
    _assert_exact(obj, maps, nets)


def test_deny_random_mix_and_changes(guard):
    """Random v4 /8../32 and v6 /20../128 prefixes, then a change that keeps half, drops
    half and adds new ones: the program agrees with CIDR membership after each."""
    import random

    obj, maps = guard
    rnd = random.Random(11)

    def some(n):
        out = set()
        while len(out) < n:
            if rnd.random() < 0.5:
                out.add(net((rnd.getrandbits(32), rnd.randint(8, 32)), strict=False))
            else:  # a few shared /32s so every IPv6 form shows up
                base = (0x2001 << 112) | (rnd.randrange(8) << 96) | rnd.getrandbits(96)
                out.add(net((base, rnd.randint(20, 128)), strict=False))
        return sorted(out, key=str)

    first = some(120)
    maps.set_deny(first)
    _assert_exact(obj, maps, first)
    second = first[::2] + some(60)
    maps.set_deny(second)
    _assert_exact(obj, maps, second)


def _words(m):
    return [m.lookup(i.to_bytes(4, "little")) for i in range(0, m.max_entries, 997)]


def _u64(raw: bytes) -> int:
    return int.from_bytes(raw, "little")


def test_syn_rate_limit_per_source(guard):
    obj, maps = guard
    syn = v4(src="203.0.113.77") / TCP(sport=40000, dport=443, flags="S")
    results = [run(obj, syn) for _ in range(6)]
    assert results == [XDP_PASS] * 3 + [XDP_DROP] * 3  # burst 3, 1/s refill
    # Another source has its own bucket; SYN-ACKs, ACKs and other ports are untouched.
    assert run(obj, v4(src="203.0.113.78") / TCP(dport=443, flags="S")) == XDP_PASS
    assert run(obj, v4(src="203.0.113.77") / TCP(dport=443, flags="SA")) == XDP_PASS
    assert run(obj, v4(src="203.0.113.77") / TCP(dport=443, flags="A")) == XDP_PASS
    assert run(obj, v4(src="203.0.113.77") / TCP(dport=22, flags="S")) == XDP_PASS
    assert maps.counters()["dropped_ratelimit"] == 3


@pytest.mark.parametrize("clock", ["jiffies", "ktime"])
def test_syn_rate_limit_refills_with_time(guard, clock):
    """The bucket refills from the kernel clock: jiffies * jiffy_ns (what sync sets) or,
    with jiffy_ns = 0, bpf_ktime_get_coarse_ns()."""
    import time

    from aiproxy.kernel.maps import jiffy_ns
    from aiproxy.kernel.structs import GuardSettings

    obj, maps = guard
    step = jiffy_ns() if clock == "jiffies" else 0
    if clock == "jiffies" and not step:
        pytest.skip("this kernel's HZ is unknown: the program uses ktime")
    maps.maps["guard_settings"].update((0).to_bytes(4, "little"), bytes(GuardSettings(10, 1, step)))
    syn = v4(src="203.0.113.90") / TCP(dport=443, flags="S")
    assert [run(obj, syn) for _ in range(3)] == [XDP_PASS, XDP_DROP, XDP_DROP]
    time.sleep(0.25)  # 10/s: 2.5 tokens, capped at the burst of 1
    assert [run(obj, syn) for _ in range(2)] == [XDP_PASS, XDP_DROP]


def test_syn_rate_limit_v6_and_off(guard):
    obj, maps = guard
    syn = v6(src="2001:db8:1::77") / TCP(dport=8080, flags="S")
    assert [run(obj, syn) for _ in range(4)] == [XDP_PASS] * 3 + [XDP_DROP]
    maps.set_syn_limit(0, 0, ())  # turned off at run time
    assert run(obj, syn) == XDP_PASS


def test_vlan_tagged(guard):
    obj, _ = guard
    one = Ether(**ETH) / Dot1Q(vlan=10) / IP(src="192.0.2.9", dst="10.0.0.1") / UDP()
    two = Ether(**ETH) / Dot1AD(vlan=20) / Dot1Q(vlan=10) / IP(src="192.0.2.9") / UDP()
    ok = Ether(**ETH) / Dot1Q(vlan=10) / IP(src="203.0.113.1") / UDP()
    v6_tagged = Ether(**ETH) / Dot1Q(vlan=5) / IPv6(src="2001:db8:bad::5") / UDP()
    assert run(obj, one) == XDP_DROP
    assert run(obj, two) == XDP_DROP
    assert run(obj, ok) == XDP_PASS
    assert run(obj, v6_tagged) == XDP_DROP
    syn = Ether(**ETH) / Dot1Q(vlan=10) / IP(src="203.0.113.88") / TCP(dport=443, flags="S")
    assert [run(obj, syn) for _ in range(4)] == [XDP_PASS] * 3 + [XDP_DROP]


def test_ipv4_options(guard):
    obj, _ = guard
    opts = b"\x01" * 4 + b"\x44\x04\x05\x00"  # NOPs + a timestamp option header, 8 bytes
    pkt = v4(src="203.0.113.99", options=[]) / TCP(dport=443, flags="S")
    raw = bytearray(bytes(pkt))
    # ihl 5 -> 7: splice 8 option bytes in after the 20-byte header, fix length/checksum
    ip = IP(bytes(raw[14:]))
    ip.options = opts
    del ip.ihl, ip.len, ip.chksum
    with_opts = Ether(**ETH) / IP(bytes(ip))
    assert with_opts[IP].ihl == 7
    assert [run(obj, with_opts) for _ in range(4)] == [XDP_PASS] * 3 + [XDP_DROP]
    denied = Ether(**ETH) / IP(src="192.0.2.4", options=opts) / TCP(dport=80)
    assert run(obj, denied) == XDP_DROP


def test_fragments(guard):
    obj, _ = guard
    big = IP(src="203.0.113.120", dst="10.0.0.1") / TCP(dport=443, flags="S") / (b"z" * 2000)
    frags = fragment(big, fragsize=512)
    assert len(frags) >= 3
    # Non-first fragments never count as SYNs (their "L4 header" is payload).
    tail = [Ether(**ETH) / f for f in frags[1:]]
    for _ in range(5):
        assert all(run(obj, f) == XDP_PASS for f in tail)
    # A non-first fragment whose payload looks like a SYN to a limited port: still passes.
    fake = v4(src="203.0.113.121", frag=100, flags="MF") / bytes(TCP(dport=443, flags="S"))
    assert [run(obj, fake) for _ in range(5)] == [XDP_PASS] * 5
    # The first fragment carries the TCP header: it is rate limited like any SYN.
    head = Ether(**ETH) / frags[0]
    assert [run(obj, head) for _ in range(4)] == [XDP_PASS] * 3 + [XDP_DROP]
    # Fragments of a denied source are dropped, first or not.
    bad = fragment(IP(src="192.0.2.8", dst="10.0.0.1") / UDP() / (b"y" * 1500), fragsize=512)
    assert all(run(obj, Ether(**ETH) / f) == XDP_DROP for f in bad)


def test_ipv6_extension_headers_and_fragments(guard):
    obj, _ = guard
    src = "2001:db8:1::300"
    chain = (v6(src=src) / IPv6ExtHdrHopByHop() / IPv6ExtHdrDestOpt() / IPv6ExtHdrRouting()
             / TCP(dport=443, flags="S"))
    assert [run(obj, chain) for _ in range(4)] == [XDP_PASS] * 3 + [XDP_DROP]
    nonfirst = v6(src="2001:db8:1::301") / IPv6ExtHdrFragment(offset=10, m=1, nh=6) / bytes(
        TCP(dport=443, flags="S"))
    assert [run(obj, nonfirst) for _ in range(5)] == [XDP_PASS] * 5
    first = v6(src="2001:db8:1::302") / IPv6ExtHdrFragment(offset=0, m=1) / TCP(
        dport=443, flags="S")
    assert [run(obj, first) for _ in range(4)] == [XDP_PASS] * 3 + [XDP_DROP]
    deep = v6(src="2001:db8:bad::9")
    for _ in range(8):  # more headers than the program walks: still denied by source
        deep = deep / IPv6ExtHdrDestOpt()
    assert run(obj, deep / UDP()) == XDP_DROP


def _truncated_frames():
    syn = bytes(v4(src="203.0.113.200") / TCP(dport=443, flags="S"))
    syn6 = bytes(v6(src="2001:db8:1::200") / TCP(dport=443, flags="S"))
    return {
        "ip-header-cut": syn[:14 + 12],
        "tcp-header-cut": syn[:14 + 20 + 10],
        "ihl-below-5": syn[:14] + bytes([0x44]) + syn[15:],
        "ihl-past-end": syn[:14] + bytes([0x4F]) + syn[15:14 + 40],
        "bad-version": syn[:14] + bytes([0x65]) + syn[15:],
        "ipv6-cut": syn6[:14 + 30],
        "tcp6-cut": syn6[:14 + 40 + 8],
        "vlan-cut": bytes(Ether(**ETH) / Dot1Q(vlan=1))[:16],
        "three-tags": bytes(Ether(**ETH) / Dot1Q() / Dot1Q() / Dot1Q() / IP() / UDP()),
    }


@pytest.mark.parametrize("name", sorted(_truncated_frames()))
def test_malformed_pass_by_default(guard, name):
    obj, maps = guard
    frame = _truncated_frames()[name]
    for _ in range(5):  # never mistaken for SYNs to rate limit
        assert run(obj, frame) == XDP_PASS
    counters = maps.counters()
    assert counters["malformed"] == 5 and counters["passed"] == 5


def test_malformed_dropped_when_configured(bpf_ok):
    obj = load("xdp_guard", rodata={"cfg_drop_malformed": 1})
    try:
        maps = GuardMaps.of(obj)
        frame = _truncated_frames()["tcp-header-cut"]
        assert run(obj, frame) == XDP_DROP
        assert run(obj, v4() / UDP()) == XDP_PASS
        c = maps.counters()
        assert (c["dropped_malformed"], c["malformed"], c["passed"]) == (1, 1, 1)
    finally:
        obj.close()


def test_denied_source_with_truncated_l4_is_still_denied(guard):
    obj, _ = guard
    frame = bytes(v4(src="192.0.2.77") / TCP(dport=443, flags="S"))[:14 + 20 + 4]
    assert run(obj, frame) == XDP_DROP


def test_v6_bucket_per_prefix(bpf_ok):
    obj = load("xdp_guard", rodata={"cfg_v6_bucket_bytes": 8})
    try:
        GuardMaps.of(obj).sync(KernelConfig(syn_rate_per_source=1, syn_burst=2, syn_ports=(443,)))
        a = v6(src="2001:db8:1:2::1") / TCP(dport=443, flags="S")
        b = v6(src="2001:db8:1:2::ffff") / TCP(dport=443, flags="S")  # same /64
        assert [run(obj, a), run(obj, b), run(obj, a)] == [XDP_PASS, XDP_PASS, XDP_DROP]
    finally:
        obj.close()


def _crowded(rnd, tops, per_top, lens=range(33, 129)):
    """Prefixes of many lengths crowded into a few /32s, some nested in others."""
    out = set()
    lens = list(lens)
    while len(out) < tops * per_top:
        top = 0x20010C00 + rnd.randrange(tops)
        plen = rnd.choice(lens)
        if out and rnd.random() < 0.3:  # inside (or around) one already there
            addr = int(rnd.choice(sorted(out, key=str)).network_address)
            addr |= rnd.getrandbits(96) & ((1 << (128 - plen)) - 1)
        else:
            addr = top << 96 | rnd.getrandbits(96)
        out.add(net((addr, plen), strict=False))
    return sorted(out, key=str)


def test_deny_crowded_v6_length_search(guard):
    """/32s holding dozens of lengths (the binary search on the length with markers) agree
    with CIDR membership, through changes that keep, drop and add prefixes, move a /32
    between the search and the probed forms and cover one with a shorter prefix."""
    import random

    from aiproxy.kernel import deny
    from aiproxy.kernel.structs import GUARD_V6_SEARCH

    obj, maps = guard
    rnd = random.Random(23)
    first = _crowded(rnd, 3, 60)
    lay = deny.layout(first)
    assert {v[1] for v in lay.v6_top.values()} == {GUARD_V6_SEARCH}
    assert any(v == deny.MARKER for v in lay.v6_exact.values())  # markers, not only prefixes
    maps.set_deny(first)
    _assert_exact(obj, maps, first)
    second = first[::2] + _crowded(rnd, 4, 40)
    maps.set_deny(second)
    _assert_exact(obj, maps, second)
    # One /32 down to three lengths (probed), another covered by a /30.
    few = [n for n in second if int(n.network_address) >> 96 != 0x20010C01]
    few += [net("2001:c01::/40"), net("2001:c01:1::/48"), net("2001:c01:1:2::/64")]
    third = few + [net("2001:c00::/30")]
    maps.set_deny(third)
    _assert_exact(obj, maps, third)
    maps.set_deny(second)
    _assert_exact(obj, maps, second)
    every = [net((0x20010C05 << 96 | rnd.getrandbits(96), plen), strict=False)
             for plen in range(33, 129)]  # all 96 lengths in one /32
    maps.set_deny(every)
    _assert_exact(obj, maps, every)


def test_search_markers_reach_every_length():
    from aiproxy.kernel.deny import search_markers
    from aiproxy.kernel.structs import GUARD_V6_SEARCH_STEPS

    for plen in range(33, 129):
        path = search_markers(plen)
        assert len(path) < GUARD_V6_SEARCH_STEPS and all(m < plen for m in path)


class _Watched:
    """A map whose every write is followed by a check of the program's verdicts."""

    def __init__(self, m, check):
        self._m, self._check = m, check

    def __getattr__(self, name):
        return getattr(self._m, name)

    def update(self, *args, **kw):
        self._m.update(*args, **kw)
        self._check()

    def delete(self, *args, **kw):
        out = self._m.delete(*args, **kw)
        self._check()
        return out


def test_deny_update_never_lets_a_kept_prefix_through(guard):
    """After every map write of an update, each source inside a prefix both the
    old and the new list hold is still dropped (union first, then shrink), also for
    crowded /32s whose markers are rewritten."""
    import random

    from aiproxy.kernel import deny

    obj, maps = guard
    rnd = random.Random(5)
    old = _crowded(rnd, 2, 25)
    maps.set_deny(old)
    for new in (old[::2] + _crowded(rnd, 3, 12),
                [n for n in old if n.prefixlen > 80] + [net("2001:c00::/30")],
                old[1::3] + [net("2001:c01:1::/48"), net("2001:c01:2::/56")]):
        kept = [n for n in set(old) & set(new)]
        probes = [s for s in _probe_sources(kept, rnd)
                  if any(ipaddress.ip_address(s) in n for n in kept)]
        probes = rnd.sample(probes, min(len(probes), 24))

        def check(probes=probes):
            assert all(_verdicts(obj, probes).values())

        deny.apply({name: _Watched(m, check) for name, m in maps.maps.items()}, new)
        _assert_exact(obj, maps, new)
        old = new
