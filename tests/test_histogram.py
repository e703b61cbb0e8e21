"""aiproxy/_fast/histogram.pyx against the reference it replaced (bisect_left over the
bucket bounds), and the per-status request counters of telemetry/metrics.py."""

from __future__ import annotations

import math
import random
from bisect import bisect_left

import pytest
from aiproxy._fast.histogram import Histogram

from aiproxy.pipeline.exchange import Exchange
from aiproxy.telemetry.metrics import BUCKETS, Metrics, StatusCounts


def test_same_buckets_as_bisect() -> None:
    rng = random.Random(7)
    values = [rng.expovariate(50) for _ in range(20000)]
    values += list(BUCKETS) + [b * (1 + 1e-12) for b in BUCKETS] + [0.0, -1.0, 1e9, math.inf]
    hist = Histogram(BUCKETS)
    ref = [0] * (len(BUCKETS) + 1)
    for v in values:
        hist.observe(v)
        ref[bisect_left(BUCKETS, v)] += 1
    assert hist.counts == ref
    assert hist.sum == pytest.approx(math.fsum(values[:-1]) + math.inf)


def test_cumulative() -> None:
    hist = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0, 3.0):
        hist.observe(v)
    assert hist.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 5)]
    assert hist.sum == pytest.approx(5.65)


def test_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        Histogram(())
    with pytest.raises(ValueError):
        Histogram((1.0, 0.5))
    with pytest.raises(ValueError):
        Histogram(tuple(float(i) for i in range(65)))


def test_status_counts_in_order_with_odd_statuses() -> None:
    counts = StatusCounts()
    for status in (200, 200, 499, 101, 0, 599, 600, 999, -1, 200):
        counts.add(status)
    counts.add_outcome("upstream_error", 200)
    assert counts.items() == [("complete", s, n) for s, n in (
        (-1, 1), (0, 1), (101, 1), (200, 3), (499, 1), (599, 1), (600, 1), (999, 1))] + [
        ("upstream_error", 200, 1)]
    assert StatusCounts().items() == []


def test_requests_counted_per_route_and_cluster_across_names() -> None:
    """exchange_stamps keeps the last (route, cluster) by identity: switching names, and
    equal names in new str objects (a reload's config), must land in the same counts."""
    m = Metrics()
    ex = Exchange.__new__(Exchange)
    a, b = "route-a", "route-b"
    a_again = "".join(["route-", "a"])  # equal to a, another object
    assert a_again == a and a_again is not a
    for route, cluster, status in ((a, "c1", 200), (a, "c1", 200), (b, "c1", 200),
                                   (a, "c2", 503), (a_again, "c1", 404), (a, "c1", 200)):
        m.exchange_stamps(route, cluster, status, 0, 0, ex, 0.0)
    assert {r: {c: counts.items() for c, counts in by.items()}
            for r, by in m.requests.items()} == {
        "route-a": {"c1": [("complete", 200, 3), ("complete", 404, 1)],
                    "c2": [("complete", 503, 1)]},
        "route-b": {"c1": [("complete", 200, 1)]},
    }
