"""GPU memory watermark backpressure: a cluster's backend-reported load scales the
rates its routes admit. Below 50% full rate; 50-80% linearly from 100% down to 30%
(with a bounded wait queue); above 80% a 10% floor, the rest refused."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiproxy.routing.stats import REPORTED_LOAD_TTL

if TYPE_CHECKING:
    from aiproxy.routing.cluster import Cluster

LOW = 50.0
HIGH = 80.0
BAND_FLOOR = 0.3
FLOOR = 0.1


def factor_for(load: float | None) -> float:
    if load is None or load < LOW:
        return 1.0
    if load <= HIGH:
        return 1.0 - (1.0 - BAND_FLOOR) * (load - LOW) / (HIGH - LOW)
    return FLOOR


def cluster_load(cluster: Cluster | None, now: float) -> float | None:
    """Mean of the endpoints' fresh backend-reported loads (percent), None if none."""
    if cluster is None:
        return None
    total, n = 0.0, 0
    for pool in cluster.pools:
        s = pool.stats
        if s.reported_at and now - s.reported_at < REPORTED_LOAD_TTL:
            total += s.reported_load
            n += 1
    return total / n if n else None
