"""Upstream clusters: endpoints, their pools, the balancer, health and circuit breakers.

Per-endpoint state (in-flight, latency EWMA, tokens per minute, health, ejections) lives
in an EndpointStats on the endpoint's pool, so it survives a reload together with the
pool. Balancers see only endpoints that are available (healthy per the active checks and
not ejected by outlier detection); when none is, they fall back to all of them (panic
mode: better to try a possibly sick endpoint than to refuse every request).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import zlib
from bisect import bisect_left
from random import choice, choices, random, sample
from typing import TYPE_CHECKING, Any

from aiproxy.config import ClusterConfig, Endpoint, HttpConfig
from aiproxy.routing.pool import H2Pool, Pool, tls_connect_args
from aiproxy.routing.stats import EndpointStats

if TYPE_CHECKING:
    from aiproxy.pipeline.exchange import Exchange

log = logging.getLogger("aiproxy.cluster")

# Bumped whenever an endpoint's availability changes; balancers that precompute from the
# set of available endpoints (hash rings, maglev tables) rebuild when it moves.
HEALTH_EPOCH = [0]


def pool_key(cfg: ClusterConfig, endpoint: Endpoint) -> tuple:
    """Pools are shared across reloads by cluster, protocol and endpoint address, and by
    what their connections were set up for (`tls`: CA, SNI, verification; `host`: the
    name TLS asked for): a reload that changes those starts a new pool, and the old one
    closes its connections (Runtime.retire)."""
    return (cfg.name, cfg.protocol, endpoint.host, endpoint.port, cfg.tls, cfg.host)


def _set_availability_changed() -> None:
    HEALTH_EPOCH[0] += 1


def _mix32(h: int) -> int:
    """murmur3 fmix32: spreads a crc32 over the ring."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _h32(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "big")


# -- balancers ---------------------------------------------------------------------------

class Balancer:
    __slots__ = ("cluster", "pools", "_epoch", "_avail")

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.pools = cluster.pools
        self._epoch = -1
        self._avail: list[Pool] = []

    def available(self) -> list[Pool]:
        """Available pools (all of them in panic mode), cached per health epoch."""
        if self._epoch != HEALTH_EPOCH[0]:
            self._epoch = HEALTH_EPOCH[0]
            self._avail = [p for p in self.pools if p.stats.available] or list(self.pools)
            self.rebuild()
        return self._avail

    def candidates(self, exclude: tuple) -> list[Pool]:
        """Available pools not in `exclude` (endpoints a retry already tried). Never an
        unavailable one outside panic mode: once every healthy endpoint was tried, the
        caller retries a healthy one again (as Envoy's previous-hosts predicate gives
        way), rather than an endpoint the checks or outlier detection took out."""
        avail = self.available()
        if exclude:
            avail = [p for p in avail if p not in exclude]
        return avail

    def rebuild(self) -> None:
        pass

    def pick(self, ex: Exchange | None, exclude: tuple) -> Pool | None:
        raise NotImplementedError


class RoundRobin(Balancer):
    """Smooth weighted round robin over available endpoints (the nginx algorithm)."""

    __slots__ = ("_current",)

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster)
        self._current = {id(p): 0 for p in self.pools}

    def pick(self, ex: Exchange | None, exclude: tuple) -> Pool | None:
        pools = self.candidates(exclude)
        if len(pools) <= 1:
            return pools[0] if pools else None
        current = self._current
        best = None
        best_w = 0
        total = 0
        for pool in pools:
            w = pool.endpoint.weight
            k = id(pool)
            cw = current[k] + w
            current[k] = cw
            total += w
            if best is None or cw > best_w:
                best = pool
                best_w = cw
        current[id(best)] -= total
        return best


class LeastRequest(Balancer):
    """Power of two choices: of two random endpoints, the one with fewer in flight
    (relative to its weight). With unequal weights the two are drawn in proportion to
    weight: at light load in-flight counts tie (often all 0) and the first drawn wins,
    so the spread still follows the weights (as Envoy's weighted least request does)."""

    __slots__ = ()

    def pick(self, ex: Exchange | None, exclude: tuple) -> Pool | None:
        pools = self.candidates(exclude)
        if len(pools) <= 1:
            return pools[0] if pools else None
        weights = [p.endpoint.weight for p in pools]
        if min(weights) == max(weights):
            a, b = sample(pools, 2)
        else:
            a, b = choices(pools, weights, k=2)
        return a if (a.stats.in_flight / a.endpoint.weight
                     <= b.stats.in_flight / b.endpoint.weight) else b


class _Hashing(Balancer):
    __slots__ = ("header",)

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster)
        key = cluster.cfg.hash_key
        self.header = key[7:].encode() if key.startswith("header:") else None

    def key(self, ex: Exchange | None) -> int:
        if ex is None:
            return int(random() * 0xFFFFFFFF)
        value = ex.head.get(self.header) if self.header is not None else None
        if value is None:
            value = ex.down.peer
        return _mix32(zlib.crc32(value))


class RingHash(_Hashing):
    """Consistent hash ring, 100 points per unit of weight."""

    __slots__ = ("points", "owners")

    def rebuild(self) -> None:
        ring = []
        for pool in self._avail:
            addr = pool.endpoint.address
            for i in range(100 * pool.endpoint.weight):
                ring.append((_h32(f"{addr}_{i}"), pool))
        ring.sort(key=lambda item: item[0])
        self.points = [h for h, _ in ring]
        self.owners = [p for _, p in ring]

    def pick(self, ex: Exchange | None, exclude: tuple) -> Pool | None:
        avail = self.available()
        if not avail:
            return None
        owners = self.owners
        n = len(owners)
        i = bisect_left(self.points, self.key(ex))
        for step in range(n):
            pool = owners[(i + step) % n]
            if pool not in exclude:
                return pool
        return None


MAGLEV_PRIMES = (251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521)


class Maglev(_Hashing):
    """Maglev lookup table (Eisenbud et al. 2016), weighted; size a prime >= 100 x endpoints."""

    __slots__ = ("table",)

    def rebuild(self) -> None:
        pools = self._avail
        n = len(pools)
        size = next((p for p in MAGLEV_PRIMES if p >= 100 * n), MAGLEV_PRIMES[-1])
        table: list[Pool | None] = [None] * size
        perms = []
        for pool in pools:
            addr = pool.endpoint.address
            offset = _h32(addr + "#offset") % size
            skip = _h32(addr + "#skip") % (size - 1) + 1
            perms.append([offset, skip, 0])
        weights = [p.endpoint.weight for p in pools]
        top = max(weights)
        credit = [0.0] * n
        filled = 0
        while filled < size:
            for i in range(n):
                credit[i] += weights[i] / top
                if credit[i] < 1:
                    continue
                credit[i] -= 1
                offset, skip, j = perms[i]
                while True:
                    slot = (offset + skip * j) % size
                    j += 1
                    if table[slot] is None:
                        break
                perms[i][2] = j
                table[slot] = pools[i]
                filled += 1
                if filled == size:
                    break
        self.table = table

    def pick(self, ex: Exchange | None, exclude: tuple) -> Pool | None:
        avail = self.available()
        if not avail:
            return None
        pool = self.table[self.key(ex) % len(self.table)]
        if pool in exclude:
            rest = self.candidates(exclude)
            return choice(rest) if rest else None
        return pool


class LlmScore(Balancer):
    """score = a*(1 - min(ttfb/L, 1)) + b*(1 - load_pct/100) + c*min(tpm/T, 1); best wins,
    with a small random tie-break; explore_pct of picks go to a random endpoint so the
    estimates of endpoints that lost traffic stay fresh."""

    __slots__ = ("cfg", "loop", "explore")

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster)
        self.cfg = cluster.cfg.llm_score
        self.loop = cluster.loop
        self.explore = self.cfg.explore_pct / 100

    def pick(self, ex: Exchange | None, exclude: tuple) -> Pool | None:
        pools = self.candidates(exclude)
        if len(pools) <= 1:
            return pools[0] if pools else None
        if self.explore and random() < self.explore:
            return choice(pools)
        cfg = self.cfg
        lat_w, load_w, tpm_w = cfg.latency_weight, cfg.load_weight, cfg.tpm_weight
        lat_n, tpm_n = float(cfg.latency_ms), float(cfg.tpm)
        now = self.loop.time()
        best = None
        best_score = -1.0
        for pool in pools:
            s = pool.stats
            lat = s.ttfb_ms if s.ttfb_ms > 0 else 0.0
            score = (lat_w * (1.0 - min(lat / lat_n, 1.0))
                     + load_w * (1.0 - s.load_pct(now, pool.endpoint.capacity) / 100.0)
                     + tpm_w * min(s.tpm(now) / tpm_n, 1.0)
                     + random() * 0.01)
            s.score = score
            if score > best_score:
                best = pool
                best_score = score
        return best


BALANCER_TYPES = {"round_robin": RoundRobin, "least_request": LeastRequest,
                  "ring_hash": RingHash, "maglev": Maglev, "llm_score": LlmScore}


# -- the cluster ---------------------------------------------------------------------------

class Cluster:
    __slots__ = ("name", "cfg", "pools", "loop", "balancer", "active", "pending",
                 "retries_active", "overflows", "checker", "track_tokens", "score_alpha",
                 "limits_connections", "poller", "max_requests", "request_timeout")

    def __init__(self, cfg: ClusterConfig, http: HttpConfig, loop: asyncio.AbstractEventLoop,
                 reuse: dict[tuple, Pool | H2Pool] | None = None) -> None:
        self.name = cfg.name
        self.cfg = cfg
        self.loop = loop
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
        if cfg.health_check is None:
            for pool in self.pools:
                if not pool.stats.healthy:
                    pool.stats.healthy = True  # no checks any more: trust it again
                    _set_availability_changed()
        self.active = 0  # requests in flight on this cluster (circuit breaker, retry budget)
        self.pending = 0  # requests waiting for a new upstream connection
        self.retries_active = 0
        self.overflows = 0  # requests refused by a circuit breaker
        self.limits_connections = bool(cfg.max_pending or cfg.max_connections)
        self.max_requests = cfg.max_requests  # circuit breaker; 0: none
        self.request_timeout = cfg.request_timeout_ms / 1000
        self.track_tokens = cfg.balancer == "llm_score"
        self.score_alpha = cfg.llm_score.ewma_alpha
        self.balancer: Balancer = BALANCER_TYPES[cfg.balancer](self)
        self.checker: HealthChecker | None = None
        self.poller: LoadPoller | None = None

    def start(self) -> None:
        if self.cfg.health_check is not None and self.pools and self.checker is None:
            self.checker = HealthChecker(self)
        if self.cfg.load_metrics is not None and self.pools and self.poller is None:
            self.poller = LoadPoller(self)

    def pick(self, ex: Exchange | None = None, exclude: tuple = ()) -> Pool | None:
        pools = self.pools
        if len(pools) == 1:  # the common case: nothing to balance
            return pools[0] if not exclude or pools[0] not in exclude else None
        if not pools:
            return None
        return self.balancer.pick(ex, exclude)

    # -- circuit breakers ---------------------------------------------------------------

    def overflow(self) -> str | None:
        """Why a new request may not start now (None: it may)."""
        cfg = self.cfg
        if cfg.max_requests and self.active >= cfg.max_requests:
            self.overflows += 1
            return f"cluster {self.name!r} is at max_requests ({cfg.max_requests})"
        return None

    def connect_overflow(self, pool: Any = None) -> str | None:
        """Why a request may not wait for a new upstream connection of `pool` now (None:
        it may). HTTP/1.1: each waiting request opens a connection of its own, so the
        waiting requests count as connections being opened. HTTP/2: requests share one
        attempt per endpoint, and wait on it; only an attempt to start is a connection."""
        cfg = self.cfg
        if cfg.max_pending and self.pending >= cfg.max_pending:
            self.overflows += 1
            return f"cluster {self.name!r} is at max_pending ({cfg.max_pending})"
        if cfg.max_connections:
            if cfg.protocol == "h2":
                if pool is not None and pool.connecting is not None:
                    return None  # it waits for the attempt under way
                return self.h2_connect_overflow()
            total = self.pending
            for p in self.pools:
                total += p.open_count
            if total >= cfg.max_connections:
                self.overflows += 1
                return f"cluster {self.name!r} is at max_connections ({cfg.max_connections})"
        return None

    def h2_connect_overflow(self) -> str | None:
        """Why another HTTP/2 connection may not be opened now (None: it may): the
        cluster's connections open or being opened are at max_connections."""
        limit = self.cfg.max_connections
        if not limit:
            return None
        total = 0
        for p in self.pools:
            # A connection counts from its attempt (connecting) until it is lost
            # (open_count), once in between (open_count rises at the TCP connect).
            total += max(p.open_count, len(p.conns) + (p.connecting is not None))
        if total >= limit:
            self.overflows += 1
            return f"cluster {self.name!r} is at max_connections ({limit})"
        return None

    # -- outlier detection ----------------------------------------------------------------

    def record(self, pool: Pool, failed: bool) -> None:
        s = pool.stats
        s.requests += 1
        if not failed:
            s.consecutive_failures = 0
            return
        s.failures += 1
        s.consecutive_failures += 1
        od = self.cfg.outlier_detection
        if (od.consecutive_failures and s.consecutive_failures >= od.consecutive_failures
                and not s.ejected):
            # Capped: after this ejection at most max_ejection_pct are out.
            ejected = sum(1 for p in self.pools if p.stats.ejected) + 1
            if ejected * 100 <= od.max_ejection_pct * len(self.pools):
                self._eject(pool)

    def _eject(self, pool: Pool) -> None:
        s = pool.stats
        od = self.cfg.outlier_detection
        s.times_ejected += 1
        s.ejected = True
        s.consecutive_failures = 0
        ms = min(od.base_ejection_ms * s.times_ejected, od.max_ejection_ms)
        s.ejected_until = self.loop.time() + ms / 1000
        s.eject_timer = self.loop.call_later(ms / 1000, _uneject, s)
        _set_availability_changed()
        log.warning("cluster %s: ejected %s for %d ms", self.name, pool.endpoint.address, ms)

    def describe(self) -> dict[str, Any]:
        now = self.loop.time()
        cfg = self.cfg
        return {
            "name": self.name, "protocol": cfg.protocol, "balancer": cfg.balancer,
            "in_flight": self.active, "pending": self.pending,
            "retries_in_flight": self.retries_active, "overflows": self.overflows,
            "circuit_breakers": {"max_connections": cfg.max_connections,
                                 "max_pending": cfg.max_pending,
                                 "max_requests": cfg.max_requests},
            "endpoints": [{"address": p.endpoint.address, "weight": p.endpoint.weight,
                           "capacity": p.endpoint.capacity,
                           "connections_open": p.open_count, "opened": p.opened,
                           "reused": p.reused, "available": p.stats.available,
                           "score": round(p.stats.score, 4)
                           if cfg.balancer == "llm_score" else None,
                           **p.stats.describe(now)} for p in self.pools],
        }

    def close(self) -> None:
        self.stop()
        for pool in self.pools:
            pool.close()

    def stop(self) -> None:
        if self.checker is not None:
            self.checker.stop()
            self.checker = None
        if self.poller is not None:
            self.poller.stop()
            self.poller = None


def _uneject(s: EndpointStats) -> None:
    s.eject_timer = None
    if s.ejected:
        s.ejected = False
        _set_availability_changed()


# -- active health checks ---------------------------------------------------------------------

# Checker tasks stopped while a request was in flight, left to finish it (finish_checks).
_FINISHING: set[asyncio.Task] = set()


class _PerPool:
    """One task per endpoint that makes a request each interval (health checks, load
    polls). stop() cancels a task waiting for its turn; a task with a request in flight
    finishes it (within the request's timeout) and then ends: cancelling a TLS connect
    midway leaves uvloop to report the handshake's outcome on a future nobody awaits
    ("Future exception was never retrieved" in the log)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.stopping = False
        self.busy: set[asyncio.Task] = set()
        self.tasks = [cluster.loop.create_task(self._run(pool)) for pool in cluster.pools]

    def stop(self) -> None:
        self.stopping = True
        for task in self.tasks:
            if task in self.busy:
                _FINISHING.add(task)
                task.add_done_callback(_FINISHING.discard)
            else:
                task.cancel()
        self.tasks = []

    async def _request(self, coro: Any) -> Any:
        task = asyncio.current_task()
        self.busy.add(task)
        try:
            return await coro
        finally:
            self.busy.discard(task)

    async def _run(self, pool: Pool) -> None:
        raise NotImplementedError


async def finish_checks(timeout: float) -> None:
    """Wait (up to `timeout`) for stopped checks to finish their last request."""
    if _FINISHING:
        await asyncio.wait(list(_FINISHING), timeout=timeout)


class HealthChecker(_PerPool):
    """HTTP/1.1 GET <path> to every endpoint each interval; 2xx is a pass."""

    def __init__(self, cluster: Cluster) -> None:
        self.cfg = cluster.cfg.health_check
        super().__init__(cluster)

    async def _run(self, pool: Pool) -> None:
        cfg = self.cfg
        s = pool.stats
        while not self.stopping:
            try:
                ok, detail = await self._request(self.probe(pool))
            except Exception as exc:  # a check must never die: report it as a failure
                ok, detail = False, f"check failed: {exc!r}"
            if self.stopping:
                return
            s.hc_last = detail
            if ok:
                s.hc_fail = 0
                s.hc_ok += 1
                if not s.healthy and s.hc_ok >= cfg.healthy_threshold:
                    s.healthy = True
                    # Passing active checks again also ends an outlier ejection.
                    if s.ejected:
                        s.ejected = False
                        if s.eject_timer is not None:
                            s.eject_timer.cancel()
                            s.eject_timer = None
                    _set_availability_changed()
                    log.warning("cluster %s: %s is healthy", self.cluster.name,
                                pool.endpoint.address)
            else:
                s.hc_ok = 0
                s.hc_fail += 1
                if s.healthy and s.hc_fail >= cfg.unhealthy_threshold:
                    s.healthy = False
                    _set_availability_changed()
                    log.warning("cluster %s: %s is unhealthy (%s)", self.cluster.name,
                                pool.endpoint.address, detail)
            await asyncio.sleep(cfg.interval_ms / 1000)

    async def probe(self, pool: Pool) -> tuple[bool, str]:
        cfg = self.cfg
        try:
            status, _ = await http_get(pool, cfg.path, cfg.timeout_ms / 1000, False)
        except TimeoutError:
            return False, "timeout"
        except OSError as exc:
            return False, f"connect failed: {exc.strerror or exc}"
        except ValueError:
            return False, "bad response"
        return 200 <= status < 300, f"HTTP {status}"


async def http_get(pool: Pool, path: bytes, timeout: float, body: bool,
                   limit: int = 1 << 20) -> tuple[int, bytes]:
    """A one-off HTTP/1.1 GET (control path: health checks, load polling); the body (up
    to `limit` bytes, read until close) only if asked for."""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                pool.host, pool.port, **tls_connect_args(pool, "http/1.1"))
            host = pool.authority or pool.endpoint.address.encode()
            writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: " + host
                         + b"\r\nUser-Agent: aiproxy\r\nConnection: close\r\n\r\n")
            line = await reader.readline()
            parts = line.split(None, 2)
            if len(parts) < 2 or not parts[1].isdigit():
                raise ValueError("bad response")
            if not body:
                return int(parts[1]), b""
            data = await reader.read(limit)
            while len(data) < limit:
                more = await reader.read(limit - len(data))
                if not more:
                    break
                data += more
            head, _, rest = data.partition(b"\r\n\r\n")
            if b"chunked" in head.lower():
                raise ValueError("chunked metrics are not supported")
            return int(parts[1]), rest
    finally:
        if writer is not None:
            writer.close()


def gauge_value(text: bytes, name: bytes) -> float | None:
    """The largest sample of gauge `name` in Prometheus text (any labels)."""
    best = None
    n = len(name)
    for line in text.split(b"\n"):
        if line.startswith(name) and line[n:n + 1] in (b" ", b"{"):
            rest = line.rsplit(b"}", 1)[-1] if line[n:n + 1] == b"{" else line[n:]
            try:
                value = float(rest.split()[0])
            except (ValueError, IndexError):
                continue
            best = value if best is None else max(best, value)
    return best


class LoadPoller(_PerPool):
    """Polls every endpoint's metrics for the configured gauge; the value becomes the
    endpoint's reported load (llm_score), like an x-backend-load response header."""

    def __init__(self, cluster: Cluster) -> None:
        self.cfg = cluster.cfg.load_metrics
        super().__init__(cluster)

    async def _run(self, pool: Pool) -> None:
        cfg = self.cfg
        name = cfg.gauge.encode()
        loop = self.cluster.loop
        while not self.stopping:
            try:
                status, text = await self._request(
                    http_get(pool, cfg.path, cfg.timeout_ms / 1000, True))
            except Exception as exc:  # keep polling whatever went wrong
                log.debug("load poll of %s failed: %r", pool.endpoint.address, exc)
                status, text = 0, b""
            if self.stopping:
                return  # stopped during the poll: no sleep before the task ends
            value = gauge_value(text, name) if status == 200 else None
            if value is not None:
                s = pool.stats
                s.reported_load = min(100.0, max(0.0, value / cfg.full * 100))
                s.reported_at = loop.time()
            await asyncio.sleep(cfg.interval_ms / 1000)
