"""xdp_guard deny-list cost per packet for realistic prefix mixes (BPF_PROG_TEST_RUN).

    python bench/xdp_deny.py                         # this tree's program
    python bench/xdp_deny.py --baseline DIR          # A/B against another build

DIR holds a baseline `xdp_guard.bpf.o` and the `maps.py` that fills its maps (a
module with GuardMaps). Both are loaded side by side with the same prefixes and the
same packets, runs interleaved; figures are medians over rounds and over sources.

Mixes (10,000 prefixes each unless said):
  empty        no deny prefixes at all
  v4-uniform   IPv4 /8../32, lengths uniform (most of the space ends up denied)
  v4-real      IPv4 mostly /32 and /24, some /16../31, a few /8../15
  v6-spread    IPv6 /32../128 uniform lengths, spread over 2001::/16
  v6-one32     IPv6 /33../128 all inside 2001:db8::/32 (one crowded /32)
  v6-crowd     the same, none inside another (the worst case: nothing shorter covers
               the longer ones, every source is searched through all the lengths)
Sources per mix: `hit` (inside a random prefix), `miss` (random, inside no prefix),
`near` (in the same /24 or /32 as a prefix, inside none).
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

N = 10_000
SAMPLES = 12


def mix(name: str, rnd: random.Random) -> list:
    nets: set = set()
    if name == "empty":
        return []
    if name == "v6-crowd":
        return crowd(rnd)
    while len(nets) < N:
        if name == "v4-uniform":
            plen = rnd.randint(8, 32)
        elif name == "v4-real":
            r = rnd.random()
            plen = (32 if r < 0.5 else 24 if r < 0.7 else rnd.randint(25, 31) if r < 0.85
                    else rnd.randint(16, 23) if r < 0.995 else rnd.randint(8, 15))
        elif name == "v6-spread":
            plen = rnd.randint(32, 128)
        else:
            plen = rnd.randint(33, 128)
        if name.startswith("v4"):
            addr = rnd.getrandbits(32)
        elif name == "v6-spread":
            addr = (0x2001 << 112) | rnd.getrandbits(112)
        else:
            addr = (0x20010db8 << 96) | rnd.getrandbits(96)
        nets.add(ipaddress.ip_network((addr, plen), strict=False))
    return sorted(nets, key=lambda n: (n.version, n.network_address, n.prefixlen))


def crowd(rnd: random.Random) -> list:
    """N disjoint prefixes /33../128 in 2001:db8::/32, lengths uniform until the
    short ones no longer fit."""
    import bisect

    starts: list[int] = []
    ends: list[int] = []
    while len(starts) < N:
        plen = rnd.randint(33, 128)
        n = ipaddress.ip_network(((0x20010db8 << 96) | rnd.getrandbits(96), plen), strict=False)
        first, last = int(n.network_address), int(n.broadcast_address)
        i = bisect.bisect_left(starts, first)
        if (i < len(starts) and starts[i] <= last) or (i and ends[i - 1] >= first):
            continue
        starts.insert(i, first)
        ends.insert(i, last)
    return [ipaddress.ip_network((a, 128 - (e - a + 1).bit_length() + 1))
            for a, e in zip(starts, ends, strict=True)]


def sources(nets: list, version: int, rnd: random.Random) -> dict[str, list[str]]:
    bits = 32 if version == 4 else 128
    index = {(int(n.network_address) >> (bits - n.prefixlen), n.prefixlen)
             for n in nets if n.version == version}
    lens = sorted({plen for _, plen in index})

    def inside(addr) -> bool:
        return any((int(addr) >> (bits - plen), plen) in index for plen in lens)

    out: dict[str, list[str]] = {"hit": [], "miss": [], "near": []}
    cls = ipaddress.IPv4Address if version == 4 else ipaddress.IPv6Address
    nets = [n for n in nets if n.version == version]
    while nets and len(out["hit"]) < SAMPLES:
        n = rnd.choice(nets)
        out["hit"].append(str(n.network_address + rnd.randrange(n.num_addresses)))
    tries = 0
    while len(out["miss"]) < SAMPLES and tries < 100_000:
        tries += 1
        addr = (cls(rnd.getrandbits(bits)) if version == 4 else
                cls((0x2001 << 112) | rnd.getrandbits(112)))
        if not inside(addr):
            out["miss"].append(str(addr))
    tries = 0
    while nets and len(out["near"]) < SAMPLES and tries < 100_000:
        tries += 1
        n = rnd.choice(nets)
        keep = 24 if version == 4 else 32
        if n.prefixlen <= keep:
            continue
        base = int(n.network_address) >> (bits - keep) << (bits - keep)
        addr = cls(base | rnd.getrandbits(bits - keep))
        if not inside(addr):
            out["near"].append(str(addr))
    return {k: v for k, v in out.items() if v}


def packet(src: str) -> bytes:
    from scapy.layers.inet import IP, TCP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    eth = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    ip = IP(src=src, dst="10.0.0.1") if ":" not in src else IPv6(src=src, dst="fd00::2")
    return bytes(eth / ip / TCP(dport=443, flags="A") / (b"x" * 64))


def load(obj_dir: str | None, maps_py: str | None):
    from aiproxy.kernel.libbpf import BpfObject, object_path

    if obj_dir is None:
        from aiproxy.kernel.maps import GuardMaps
        return BpfObject(object_path("xdp_guard")), GuardMaps
    spec = importlib.util.spec_from_file_location("baseline_maps", maps_py)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return BpfObject(os.path.join(obj_dir, "xdp_guard.bpf.o")), mod.GuardMaps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="dir with xdp_guard.bpf.o and maps.py")
    ap.add_argument("--repeat", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mixes", default="empty,v4-uniform,v4-real,v6-spread,v6-one32,v6-crowd")
    args = ap.parse_args()
    variants = {"new": (None, None)}
    if args.baseline:
        variants = {"base": (args.baseline, os.path.join(args.baseline, "maps.py")),
                    **variants}
    rnd = random.Random(7)
    print(f"{'mix':12s} {'source':6s} " + " ".join(f"{v + ' med':>9s} {v + ' max':>9s}"
                                                  for v in variants))
    for name in args.mixes.split(","):
        nets = mix(name, rnd)
        loaded = {}
        for v, (d, m) in variants.items():
            obj, cls = load(d, m)
            cls.of(obj).set_deny(nets)
            loaded[v] = obj
        versions = [6] if name.startswith("v6") else [4] if name.startswith("v4") else [4, 6]
        for version in versions:
            for kind, srcs in sources(nets, version, rnd).items():
                per: dict[str, list[int]] = {v: [] for v in variants}
                for src in srcs:
                    pkt = packet(src)
                    runs: dict[str, list[int]] = {v: [] for v in variants}
                    for _ in range(args.rounds):
                        for v, obj in loaded.items():
                            r = obj.program("xdp_guard").test_run(pkt, repeat=args.repeat)
                            runs[v].append(r.duration_ns)
                    for v in variants:
                        per[v].append(statistics.median(runs[v]))
                label = f"{name}{'' if name != 'empty' else '-v' + str(version)}"
                print(f"{label:12s} {kind:6s} " + " ".join(
                    f"{statistics.median(per[v]):9.0f} {max(per[v]):9.0f}" for v in variants),
                    flush=True)
        for obj in loaded.values():
            obj.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
