"""Metric families for the kernel fast paths ([kernel]): XDP guard, TC classes, splicing.

Read from the BPF maps at scrape time (per-CPU counters summed); nothing is kept here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from aiproxy.kernel.lifecycle import ProxyKernel

XDP_RESULTS = ("passed", "dropped_deny", "dropped_ratelimit", "dropped_malformed")


def kernel_families(kernel: ProxyKernel) -> Iterator[Any]:
    attached = kernel.attached()
    if attached:
        progs = GaugeMetricFamily("aiproxy_kernel_programs_attached",
                                  "BPF programs this process attached, by interface and hook",
                                  labels=["interface", "hook"])
        for ifname, what in sorted(attached.items()):
            progs.add_metric([ifname, "xdp"], 1 if what.get("xdp") else 0)
            progs.add_metric([ifname, "tc"], 1 if what.get("tc") else 0)
        yield progs
    counters = kernel.counters()
    xdp = counters.get("xdp")
    if xdp is not None:
        packets = CounterMetricFamily("aiproxy_kernel_xdp_packets",
                                      "Packets xdp_guard saw, by what it did with them",
                                      labels=["result"])
        for result in XDP_RESULTS:
            packets.add_metric([result], xdp.get(result, 0))
        yield packets
        yield CounterMetricFamily("aiproxy_kernel_xdp_malformed_packets",
                                  "Packets xdp_guard found malformed (passed unless "
                                  "configured to drop)", value=xdp.get("malformed", 0))
    tc = counters.get("tc")
    if tc is not None:
        packets = CounterMetricFamily("aiproxy_kernel_tc_packets",
                                      "Packets tc_classify counted, by traffic class",
                                      labels=["class"])
        size = CounterMetricFamily("aiproxy_kernel_tc_bytes",
                                   "Bytes tc_classify counted, by traffic class",
                                   labels=["class"])
        for name, stats in sorted(tc.items()):
            packets.add_metric([name], stats["packets"])
            size.add_metric([name], stats["bytes"])
        yield packets
        yield size
    splice = kernel.splice_stats()
    tunnels = CounterMetricFamily("aiproxy_kernel_tunnels",
                                  "Upgrade tunnels, by how their bytes were carried",
                                  labels=["path"])
    tunnels.add_metric(["spliced"], splice["spliced"])
    tunnels.add_metric(["copied"], splice["copied"])
    yield tunnels
    yield CounterMetricFamily("aiproxy_kernel_spliced_bytes",
                              "Bytes the kernel carried between spliced sockets",
                              value=splice["bytes"])
    yield GaugeMetricFamily("aiproxy_kernel_spliced_tunnels_active",
                            "Tunnels whose sockets are in the splice map now",
                            value=splice["active"])
