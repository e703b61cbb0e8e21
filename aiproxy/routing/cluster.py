"""Upstream clusters: endpoints, their pools and the balancer."""

from __future__ import annotations

import asyncio

from aiproxy.config import ClusterConfig, Endpoint, HttpConfig
from aiproxy.routing.pool import H2Pool, Pool


def pool_key(cfg: ClusterConfig, endpoint: Endpoint) -> tuple:
    """Pools are shared across reloads by cluster, protocol and endpoint address."""
    return (cfg.name, cfg.protocol, endpoint.host, endpoint.port)


class Cluster:
    """Smooth weighted round robin over endpoints (the nginx algorithm)."""

    __slots__ = ("name", "cfg", "pools", "_weights", "_current", "_total")

    def __init__(self, cfg: ClusterConfig, http: HttpConfig, loop: asyncio.AbstractEventLoop,
                 reuse: dict[tuple, Pool | H2Pool] | None = None) -> None:
        self.name = cfg.name
        self.cfg = cfg
        pool_type = H2Pool if cfg.protocol == "h2" else Pool
        self.pools = []
        for ep in cfg.endpoints:
            pool = (reuse or {}).pop(pool_key(cfg, ep), None)
            if pool is None:
                pool = pool_type(loop, ep, cfg, http)
            else:
                pool.cluster_cfg = cfg  # timeouts and limits follow the new config
                pool.endpoint = ep
            self.pools.append(pool)
        self._weights = [ep.weight for ep in cfg.endpoints]
        self._current = [0] * len(self.pools)
        self._total = sum(self._weights)

    def pick(self, exclude: tuple[Pool, ...] = ()) -> Pool | None:
        pools = self.pools
        if len(pools) == 1:
            return pools[0] if not exclude else None
        best = -1
        current = self._current
        weights = self._weights
        total = 0
        for i, pool in enumerate(pools):
            if pool in exclude:
                continue
            current[i] += weights[i]
            total += weights[i]
            if best < 0 or current[i] > current[best]:
                best = i
        if best < 0:
            return None
        current[best] -= total
        return pools[best]

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
