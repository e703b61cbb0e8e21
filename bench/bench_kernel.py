"""Kernel fast paths: xdp_guard per-packet cost and spliced vs copied tunnel throughput.

    python bench/bench_kernel.py            # a report (root; needs the BPF objects)
    python -m pytest bench/bench_kernel.py --benchmark-only

xdp_guard: BPF_PROG_TEST_RUN with `repeat`, the kernel's own per-run average (ns), with
10,000 random IPv4 deny prefixes (/16../32) and 10,000 IPv6 ones loaded. Target: <= 100
ns/packet. "floor" is an ARP frame (no lookups): the harness's own cost per run. The
deny packets are ACKs (the deny path alone); v4-syn-limited is the SYN rate-limit path.
bench/xdp_deny.py measures the deny path over whole prefix mixes (and A/B).

splice: one TCP connection through a relay process (`python -m aiproxy.kernel.splice`)
carrying N MiB each way at once, spliced in the kernel vs copied in user space. Reports
MB/s (both directions together), the relay process's CPU per MB, and the whole machine's
CPU per MB (endpoints and kernel workers included, the same for both modes).
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

PACKETS = ("floor-arp", "v4-ack-miss", "v4-syn-limited", "v4-deny-hit", "v4-deny-hit-32",
           "v4-near-hit", "v6-ack-miss", "v6-deny-hit")


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    try:
        from aiproxy.kernel.libbpf import probe
    except ImportError as exc:
        return str(exc)
    return probe()


# -- xdp_guard ----------------------------------------------------------------------------


def guard_with_prefixes(n4: int = 10_000, n6: int = 10_000, seed: int = 7):
    from aiproxy.config.schema import KernelConfig
    from aiproxy.kernel.libbpf import BpfObject, object_path
    from aiproxy.kernel.maps import GuardMaps

    rnd = random.Random(seed)
    nets4 = {ipaddress.ip_network("192.0.2.0/24")}
    nets6 = {ipaddress.ip_network("2001:db8:bad::/48")}
    while len(nets4) < n4:  # random /16../32, none in 10/8 (the "clean" source below)
        net = ipaddress.ip_network((rnd.getrandbits(32), rnd.choice([16, 20, 24, 28, 32])),
                                   strict=False)
        if not net.overlaps(ipaddress.ip_network("10.0.0.0/8")):
            nets4.add(net)
    while len(nets6) < n6:
        nets6.add(ipaddress.ip_network(((0x2001 << 112) | rnd.getrandbits(112),
                                        rnd.choice([32, 48, 56, 64, 128])), strict=False))
    obj = BpfObject(object_path("xdp_guard"))
    maps = GuardMaps.of(obj)
    maps.sync(KernelConfig(syn_rate_per_source=1_000_000, syn_burst=1_000_000,
                           syn_ports=(443,)))
    maps.set_deny(sorted(nets4, key=str) + sorted(nets6, key=str))
    # A source in a /24 that holds a deny prefix, but outside the prefix: no hit.
    host = next(n for n in sorted(nets4, key=str) if n.prefixlen == 32)
    near_src = str(host.network_address + (1 if int(host.network_address) & 1 == 0 else -1))
    return obj, maps, len(nets4), len(nets6), (near_src, str(host.network_address))


def guard_packets(sources: tuple[str, str]) -> dict[str, bytes]:
    near_src, host_src = sources
    from scapy.layers.inet import IP, TCP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import ARP, Ether

    eth = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    ok4, ok6 = "10.255.255.1", "fd00::1"  # outside every random prefix (fd00::/8, 10/8)
    return {
        "floor-arp": bytes(eth / ARP()),
        "v4-ack-miss": bytes(eth / IP(src=ok4, dst="10.0.0.1") / TCP(dport=443, flags="A")
                             / (b"x" * 64)),
        "v4-syn-limited": bytes(eth / IP(src=ok4, dst="10.0.0.1") / TCP(dport=443, flags="S")),
        "v4-deny-hit": bytes(eth / IP(src="192.0.2.77", dst="10.0.0.1")
                             / TCP(dport=443, flags="A")),
        "v4-deny-hit-32": bytes(eth / IP(src=host_src, dst="10.0.0.1")
                                / TCP(dport=443, flags="A")),
        "v4-near-hit": bytes(eth / IP(src=near_src, dst="10.0.0.1") / TCP(dport=443, flags="A")),
        "v6-ack-miss": bytes(eth / IPv6(src=ok6, dst="fd00::2") / TCP(dport=443, flags="A")),
        "v6-deny-hit": bytes(eth / IPv6(src="2001:db8:bad::1", dst="fd00::2")
                             / TCP(dport=443, flags="A")),
    }


def xdp_report(repeat: int = 200_000, rounds: int = 5) -> dict:
    obj, _maps, n4, n6, near = guard_with_prefixes()
    try:
        prog = obj.program("xdp_guard")
        out = {"deny_v4": n4, "deny_v6": n6, "ns_per_packet": {}}
        for name, pkt in guard_packets(near).items():
            runs = [prog.test_run(pkt, repeat=repeat).duration_ns for _ in range(rounds)]
            out["ns_per_packet"][name] = min(runs)
        return out
    finally:
        obj.close()


# -- splice vs copy ---------------------------------------------------------------------


def _cpu_busy() -> float:
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def tunnel_run(mode: str, mib: int) -> dict:
    size = mib << 20
    upstream = socket.create_server(("127.0.0.1", 0))
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    proc = subprocess.Popen([sys.executable, "-m", "aiproxy.kernel.splice", str(port),
                             str(upstream.getsockname()[1]), mode], stdout=subprocess.PIPE,
                            text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        if "error" in ready:
            raise RuntimeError(ready["error"])
        client = socket.create_connection(("127.0.0.1", port))
        server, _ = upstream.accept()
        chunk = os.urandom(1 << 20)
        digests: dict[str, str] = {}

        def send(sock):
            for _ in range(mib):
                sock.sendall(chunk)
            sock.shutdown(socket.SHUT_WR)

        def recv(sock, key):  # count only: hashing here would swamp the machine CPU
            n, buf = 0, bytearray(1 << 20)
            while got := sock.recv_into(buf):
                n += got
            digests[key] = (n, None)

        threads = [threading.Thread(target=send, args=(client,)),
                   threading.Thread(target=send, args=(server,)),
                   threading.Thread(target=recv, args=(client, "client")),
                   threading.Thread(target=recv, args=(server, "server"))]
        busy0, t0 = _cpu_busy(), time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        busy = _cpu_busy() - busy0
        report = json.loads(proc.stdout.readline())
        # Content is checked by tests/kernel/test_splice.py (sha256); here, the byte counts.
        assert digests["client"][0] == size and digests["server"][0] == size, (digests, report)
        client.close()
        server.close()
        mb = 2 * size / 1e6
        return {"mode": mode, "spliced": report["spliced"], "MB": round(mb, 1),
                "MB_per_s": round(mb / wall, 1),
                "relay_cpu_ms_per_MB": round(1000 * report["cpu_s"] / mb, 4),
                "machine_cpu_ms_per_MB": round(1000 * busy / mb, 3)}
    finally:
        upstream.close()
        proc.kill()
        proc.wait()


# -- pytest-benchmark ----------------------------------------------------------------------

needs_kernel = pytest.mark.skipif(_skip_reason() is not None,
                                  reason=f"kernel fast paths unavailable: {_skip_reason()}")


@pytest.fixture(scope="module")
def guard():
    pytest.importorskip("scapy")
    obj, maps, n4, n6, near = guard_with_prefixes()
    yield obj, guard_packets(near)
    obj.close()


@needs_kernel
@pytest.mark.parametrize("name", PACKETS)
def test_xdp_guard_per_packet(benchmark, guard, name):
    """Wall time of one BPF_PROG_TEST_RUN of 10^6 repeats (ms ~= ns/packet). Each call
    also pays a fixed ~15-20 ms of test-run setup on this kernel, which is why the
    kernel's own per-run average is recorded as extra_info["kernel_ns_per_packet"]."""
    obj, packets = guard
    prog = obj.program("xdp_guard")
    benchmark.group = "xdp_guard: 10^6 runs, 10k+10k deny prefixes"
    result = benchmark.pedantic(prog.test_run, args=(packets[name],),
                                kwargs={"repeat": 1_000_000}, rounds=3, iterations=1)
    benchmark.extra_info["kernel_ns_per_packet"] = result.duration_ns


# The spliced relay has rarely delivered a stream with one or two 65,483-byte loopback
# skbs twice (tests/kernel/conftest.py SPLICE_DAMAGE; README `splice_tunnels`): 2 of 120
# runs here once, on a busy machine.
SPLICE_DAMAGE = pytest.mark.xfail(strict=False, raises=AssertionError,
                                  reason="the kernel splice path rarely damages a stream")


@needs_kernel
@pytest.mark.parametrize("mode", [pytest.param("splice", marks=SPLICE_DAMAGE), "copy"])
def test_tunnel_64mib(benchmark, mode):
    benchmark.group = "tunnel: 64 MiB each way through a relay process"
    out = benchmark.pedantic(tunnel_run, args=(mode, 64), rounds=1, iterations=1)
    benchmark.extra_info.update(out)


def main() -> int:
    reason = _skip_reason()
    if reason:
        print(f"bench_kernel: kernel fast paths unavailable: {reason}", file=sys.stderr)
        return 1
    xdp = xdp_report()
    print(f"xdp_guard, {xdp['deny_v4']} IPv4 + {xdp['deny_v6']} IPv6 deny prefixes "
          "(BPF_PROG_TEST_RUN, min of 5 x 200k repeats):")
    for name, ns in xdp["ns_per_packet"].items():
        print(f"  {name:16s} {ns:5d} ns/packet")
    mib = int(os.environ.get("BENCH_TUNNEL_MIB", "256"))
    print(f"tunnel, {mib} MiB each way through one relay process:")
    for mode in ("splice", "copy"):
        r = tunnel_run(mode, mib)
        print(f"  {mode:6s} {r['MB_per_s']:8.1f} MB/s  relay CPU {r['relay_cpu_ms_per_MB']:.4f} "
              f"ms/MB  machine CPU {r['machine_cpu_ms_per_MB']:.3f} ms/MB")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
