"""The rate limit filter: admission against token buckets, settlement to real usage.

Each request takes 1 from a requests bucket and reserves its estimated prompt plus its
completion limit (max_tokens, else default_max_tokens) from a tokens bucket before it
goes upstream. A stream that runs past its reservation is charged as it streams; when
the exchange ends the reservation is settled to the real usage (nothing for a cache
hit, a request that got no response or an upstream error response without usage), however it ends: answered, client gone mid-stream,
upstream error or timeout. A Redis take still in flight when the client goes (or timed
out) is voided (aiproxy/ratelimit/redis_store.py). Refusals are 429 with Retry-After,
`x-aiproxy-backpressure: <reason>` and the RateLimit fields of the request buckets it
was checked against (aiproxy/ratelimit/fields.py), which admitted responses get too
with response_headers; between 50% and 80% reported GPU memory load a request may wait
(bounded) for its turn instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from aiproxy.config.address import without_password
from aiproxy.llm.accounting import llm_config, tenant_of
from aiproxy.pipeline.filters import Filter, FilterFactory, LocalReply, ResponseHead
from aiproxy.protocols.fields import F_HOP
from aiproxy.ratelimit.bucket import MemoryStore, Spec
from aiproxy.ratelimit.fields import openai_fields, ratelimit_fields
from aiproxy.ratelimit.watermark import HIGH, LOW, cluster_load, factor_for
from aiproxy.routing.stats import LOAD_HEADERS

if TYPE_CHECKING:
    from aiproxy.config import Config, RouteConfig
    from aiproxy.config.schema import RateLimitConfig
    from aiproxy.pipeline.exchange import Exchange

log = logging.getLogger("aiproxy.ratelimit")
ERROR_LOG_INTERVAL = 5.0


class Limiter:
    """One [[ratelimits]] entry: its buckets' parameters, store and counters."""

    def __init__(self, cfg: RateLimitConfig, store: Any) -> None:
        self.store = store
        self.redis = not isinstance(store, MemoryStore)
        self.admitted = 0
        self.refused: dict[str, int] = {}
        self.queued = 0
        self.waiting = 0
        self.backend_errors = 0
        self.logged_at = -ERROR_LOG_INTERVAL
        self.configure(cfg)

    def configure(self, cfg: RateLimitConfig) -> None:
        self.cfg = cfg
        self.name = cfg.name
        rps = cfg.requests_per_second
        self.req = (rps, float(cfg.burst_requests or max(1.0, rps))) if rps else None
        tpm = cfg.tokens_per_minute
        self.tok = (tpm / 60.0, float(cfg.burst_tokens or tpm)) if tpm else None

    def buckets(self, ex: Exchange, header: bytes | None, apart: bool, factor: float,
                counted: bool = False) -> tuple[list[str], list[Spec], list[str]]:
        """Bucket keys, specs and kinds ("requests"/"tokens") this request takes from;
        `counted`: its request bucket already has this request (a retry from the queue)."""
        llm = ex.llm
        parts = []
        for part in self.cfg.key:
            if part == "tenant":
                parts.append(llm.tenant if llm is not None else tenant_of(ex, header, apart))
            elif part == "route":
                parts.append(ex.route.name)
            else:
                parts.append((llm.model or "") if llm is not None else "")
        key = "\x1f".join(parts)
        keys, specs, kinds = [], [], []
        if self.req is not None and not counted:
            keys.append(f"rl:{self.name}:r:{key}")
            specs.append((self.req[0], self.req[1], 1.0, factor))
            kinds.append("requests")
        need = reservation(ex, self.cfg.default_max_tokens)
        if self.tok is not None and need:
            keys.append(f"rl:{self.name}:t:{key}")
            specs.append((self.tok[0], self.tok[1], float(need), factor))
            kinds.append("tokens")
        return keys, specs, kinds

    def backend_failed(self, exc: BaseException) -> LocalReply | None:
        self.backend_errors += 1
        now = time.monotonic()
        closed = self.cfg.on_backend_error == "closed"
        if now - self.logged_at >= ERROR_LOG_INTERVAL:
            self.logged_at = now
            log.error("rate limit %r: backend %s failed (%s); failing %s", self.name,
                      without_password(self.cfg.redis_url), exc or type(exc).__name__,
                      "closed" if closed else "open")
        if not closed:
            return None
        self.refused["backend_unavailable"] = self.refused.get("backend_unavailable", 0) + 1
        return LocalReply(503, "rate_limit_unavailable",
                          f"rate limit {self.name!r} cannot reach its backend",
                          [(b"retry-after", b"1"),
                           (b"x-aiproxy-backpressure", b"backend_unavailable")])


# Far above any model's limits, and small enough that a bucket's level in a double (or
# Redis's 14-digit numbers) keeps fractions of a token: reserving 2**60 took the level
# where settling to the real usage rounded it away.
MAX_RESERVATION = 1 << 30


def reservation(ex: Exchange, default_max: int) -> int:
    """Tokens reserved up front: estimated prompt + completion limit."""
    llm = ex.llm
    if llm is None:
        return 0
    if llm.endpoint == "embeddings":
        return min(MAX_RESERVATION, max(1, llm.prompt_tokens))
    completion = llm.max_tokens if llm.max_tokens is not None else default_max
    return min(MAX_RESERVATION, max(1, llm.prompt_tokens + completion))


class Grant:
    """Tokens a request holds in one tokens bucket."""

    __slots__ = ("limiter", "key", "spec", "taken")

    def __init__(self, limiter: Limiter, key: str, spec: Spec) -> None:
        self.limiter = limiter
        self.key = key
        self.spec = spec
        self.taken = spec[2]


# Retry-After at most a day: a rate configured near 0 makes the wait overflow to inf.
MAX_RETRY_AFTER = 86_400


# A limiter's request bucket as a request's take left it: (spec, level)
Snap = tuple[Spec, float]


def refusal(limiter: Limiter, reason: str, wait: float, message: str,
            snaps: dict[Limiter, Snap] | None = None,
            tok_snaps: dict[Limiter, Snap] | None = None) -> LocalReply:
    limiter.refused[reason] = limiter.refused.get(reason, 0) + 1
    wait = wait if wait < MAX_RETRY_AFTER else MAX_RETRY_AFTER  # inf and nan too
    after = max(1, math.ceil(wait))
    headers = [(b"retry-after", str(after).encode()),
               (b"x-aiproxy-backpressure", reason.encode())]
    if snaps:
        headers += ratelimit_fields(((lim.name, spec, level)
                                     for lim, (spec, level) in snaps.items()), after)
    headers += openai_fields(_kind_snaps(snaps, tok_snaps), after)
    return LocalReply(429, "rate_limited", message, headers)


def _kind_snaps(snaps: dict[Limiter, Snap] | None, tok_snaps: dict[Limiter, Snap] | None
                ) -> Iterator[tuple[str, Spec, float]]:
    """The buckets of the limiters with openai_headers, as (kind, spec, level)."""
    for kind, taken in (("requests", snaps), ("tokens", tok_snaps)):
        for lim, (spec, level) in (taken or {}).items():
            if lim.cfg.openai_headers:
                yield kind, spec, level


class RateLimitFilter(Filter):
    __slots__ = ("factory", "grants", "counted", "ended", "snaps", "tok_snaps", "admitted")
    reads_body_only = True  # response_body charges an LLM response's tokens, nothing more

    def __init__(self, factory: RateLimitFactory) -> None:
        self.factory = factory
        self.grants: list[Grant] = []
        self.counted: list[Limiter] = []  # limiters whose request bucket has this request
        self.ended = False  # done() has run: a grant arriving now is given back at once
        # Request buckets as this request's takes left them, for the RateLimit fields (a
        # retry from the queue does not take from them again: the first take's stays).
        self.snaps: dict[Limiter, Snap] | None = None
        # Token buckets likewise, kept for limiters with openai_headers only.
        self.tok_snaps: dict[Limiter, Snap] | None = None
        self.admitted = False  # every limiter let the request through

    def request(self, ex: Exchange) -> Any:
        factory = self.factory
        load = cluster_load(ex.cluster, ex.loop.time()) if factory.watermark else None
        if factory.redis:
            return self._admit_async(ex, load)
        failed = self._take(ex, load)
        if failed is None:
            self.admitted = True
            return None
        return self._refuse_or_wait(ex, load, *failed)

    def _take(self, ex: Exchange, load: float | None) -> tuple[Limiter, str, float] | None:
        """Take from every in-process limiter, or from none: the first refusal."""
        factor = factor_for(load)
        header, apart = self.factory.header, self.factory.apart
        now = ex.loop.time()
        for lim in self.factory.limiters:
            f = factor if lim.cfg.watermark else 1.0
            keys, specs, kinds = lim.buckets(ex, header, apart, f, lim in self.counted)
            levels: list[float] = []
            worst, wait = lim.store.take(keys, specs, now, levels)
            self._snap(lim, specs, kinds, levels)
            if worst >= 0:
                self._give_back(now)
                return lim, _reason(kinds[worst], f), wait
            self._granted(lim, keys, specs, kinds)
        return None

    def _snap(self, lim: Limiter, specs: list[Spec], kinds: list[str],
              levels: list[float]) -> None:
        if levels and kinds[0] == "requests":  # a request bucket comes first
            if self.snaps is None:
                self.snaps = {}
            self.snaps[lim] = (specs[0], levels[0])
        if (lim.cfg.openai_headers and levels and len(levels) == len(kinds)
                and kinds[-1] == "tokens"):
            if self.tok_snaps is None:
                self.tok_snaps = {}
            self.tok_snaps[lim] = (specs[-1], levels[-1])

    def _granted(self, lim: Limiter, keys: list[str], specs: list[Spec],
                 kinds: list[str]) -> None:
        if lim not in self.counted:
            lim.admitted += 1
            self.counted.append(lim)
        if kinds and kinds[-1] == "tokens":
            self.grants.append(Grant(lim, keys[-1], specs[-1]))

    def _give_back(self, now: float) -> None:
        """Return what earlier limiters granted this request (a later one refused);
        its request-bucket unit stays taken, as the request was made (and is not taken
        again if it waits in the queue and retries)."""
        for g in self.grants:
            self._charge(g, -g.taken, now)
        self.grants = []

    @staticmethod
    def _charge(g: Grant, amount: float, now: float) -> None:
        store = g.limiter.store
        if g.limiter.redis:
            store.charge(g.key, g.spec, amount)
        else:
            store.charge(g.key, g.spec, amount, now)

    def _refuse_or_wait(self, ex: Exchange, load: float | None, lim: Limiter, reason: str,
                        wait: float) -> Any:
        cfg = lim.cfg
        in_band = load is not None and LOW <= load <= HIGH and cfg.watermark
        if in_band and cfg.max_wait_ms and wait * 1000 <= cfg.max_wait_ms:
            if lim.waiting >= cfg.max_queue:
                return refusal(lim, "queue_full", wait, "rate limit wait queue is full",
                               self.snaps, self.tok_snaps)
            return self._queue(ex, lim, time.monotonic() + cfg.max_wait_ms / 1000, wait)
        return refusal(lim, reason, wait, f"rate limit {lim.name!r} exceeded ({reason})",
                       self.snaps, self.tok_snaps)

    async def _queue(self, ex: Exchange, lim: Limiter, deadline: float,
                     wait: float) -> LocalReply | None:
        lim.waiting += 1
        lim.queued += 1
        try:
            while True:
                await asyncio.sleep(max(0.001, min(wait, deadline - time.monotonic())))
                load = cluster_load(ex.cluster, ex.loop.time())
                failed = await self._take_any(ex, load)
                if failed is None:
                    self.admitted = True
                    return None
                if isinstance(failed, LocalReply):
                    return failed
                lim2, reason, wait = failed
                left = deadline - time.monotonic()
                if left <= 0 or wait > left or load is None or not LOW <= load <= HIGH:
                    return refusal(lim2, reason, wait,
                                   f"rate limit {lim2.name!r} exceeded ({reason})",
                                   self.snaps, self.tok_snaps)
        finally:
            lim.waiting -= 1

    async def _take_any(self, ex: Exchange, load: float | None
                        ) -> tuple[Limiter, str, float] | None:
        if not self.factory.redis:
            return self._take(ex, load)
        return await self._take_shared(ex, load)

    async def _take_shared(self, ex: Exchange, load: float | None) -> Any:
        """_take with Redis-backed limiters among them; a backend failure answers
        per on_backend_error (the LocalReply is returned as the "refusal")."""
        factor = factor_for(load)
        header, apart = self.factory.header, self.factory.apart
        for lim in self.factory.limiters:
            f = factor if lim.cfg.watermark else 1.0
            keys, specs, kinds = lim.buckets(ex, header, apart, f, lim in self.counted)
            if not keys:
                continue
            now = ex.loop.time()
            levels: list[float] = []
            if lim.redis:
                try:
                    worst, wait = await lim.store.take(keys, specs, levels)
                except Exception as exc:
                    answer = lim.backend_failed(exc)
                    if answer is not None:
                        self._give_back(ex.loop.time())
                        return answer
                    continue  # failing open: this limiter admits
            else:
                worst, wait = lim.store.take(keys, specs, now, levels)
            self._snap(lim, specs, kinds, levels)
            if worst >= 0:
                self._give_back(ex.loop.time())
                return lim, _reason(kinds[worst], f), wait
            self._granted(lim, keys, specs, kinds)
            if self.ended:
                # The exchange ended while the take was answered (and nothing cancelled
                # this coroutine in between): settle what it holds now, nothing used.
                self._give_back(ex.loop.time())
                return None
        return None

    async def _admit_async(self, ex: Exchange, load: float | None) -> LocalReply | None:
        failed = await self._take_shared(ex, load)
        if failed is None:
            self.admitted = True
            return None
        if isinstance(failed, LocalReply):
            return failed
        result = self._refuse_or_wait(ex, load, *failed)
        if asyncio.iscoroutine(result):
            return await result
        return result

    def response_head(self, ex: Exchange, resp: Any) -> Any:
        pool = ex.pool
        if self.factory.watermark and pool is not None and not ex.cluster.track_tokens:
            # llm_score clusters read these in the Exchange already.
            for name in LOAD_HEADERS:
                value = resp.get(name)
                if value is not None:
                    try:
                        pool.stats.reported_load = min(100.0, max(0.0, float(value)))
                        pool.stats.reported_at = ex.loop.time()
                    except ValueError:
                        pass
                    break
        extra, ours = self._fields()
        if ours:
            # The upstream's own figures (an OpenAI key's, shared by every tenant)
            # give way to this tenant's for the kinds reported here.
            names = {name for name, _ in ours}
            kept = [f for f in resp.fields(F_HOP) if f[0].lower() not in names]
            return ResponseHead(resp.status, [*kept, *extra, *ours])
        if extra:
            resp = ResponseHead.derived(resp, extra=tuple(extra))
        return resp

    def _fields(self) -> tuple[list[tuple[bytes, bytes]], list[tuple[bytes, bytes]]]:
        """The RateLimit fields (of limiters with response_headers) and the OpenAI ones
        (of those with openai_headers), as of the request's admission."""
        extra: list[tuple[bytes, bytes]] = []
        if self.snaps and self.factory.show:
            extra = ratelimit_fields((lim.name, spec, level)
                                     for lim, (spec, level) in self.snaps.items()
                                     if lim.cfg.response_headers)
        ours = openai_fields(_kind_snaps(self.snaps, self.tok_snaps)) if self.factory.openai else []
        return extra, ours

    def reply_fields(self, ex: Exchange) -> list[tuple[bytes, bytes]]:
        """An admitted request the proxy answers itself (a 502/503/504, a later filter's
        refusal) still tells the client its budget; a refusal (429) carries its own."""
        if not self.admitted:
            return []
        extra, ours = self._fields()
        return [*extra, *ours]

    def response_body(self, ex: Exchange, data: bytes) -> bytes:
        llm = ex.llm
        if llm is not None and self.grants:
            used = llm.prompt_tokens + llm.completion_tokens
            for g in self.grants:
                over = used - g.taken
                if over > 0:  # the stream ran past its reservation: charge as it goes
                    self._charge(g, over, ex.loop.time())
                    g.taken = used
        return data

    def done(self, ex: Exchange) -> None:
        self.ended = True
        if not self.grants:
            return
        llm = ex.llm
        # What an upstream spent: nothing for a cache hit, a request that got no
        # response, or an upstream error response that reports no usage.
        used = llm.spent_tokens if llm is not None else 0
        now = ex.loop.time()
        for g in self.grants:
            if used != g.taken:
                self._charge(g, used - g.taken, now)
        self.grants = []


def _reason(kind: str, factor: float) -> str:
    return "gpu_watermark" if factor < 1.0 else kind


class RateLimitFactory(FilterFactory):
    name = "ratelimit"

    def __init__(self, limiters: tuple[Limiter, ...], header: bytes | None,
                 apart: bool = False) -> None:
        self.limiters = limiters
        self.header = header
        self.apart = apart  # tenant_of's
        self.redis = any(lim.redis for lim in limiters)
        self.watermark = any(lim.cfg.watermark for lim in limiters)
        self.show = any(lim.cfg.response_headers for lim in limiters)
        self.openai = any(lim.cfg.openai_headers for lim in limiters)

    def start(self, ex: Exchange) -> Filter:
        return RateLimitFilter(self)


class RateLimitState:
    """The limiters of a config; buckets survive reloads under the same name/backend."""

    def __init__(self) -> None:
        self.limiters: dict[str, Limiter] = {}
        self.header: bytes | None = None
        self.apart = False

    def update(self, config: Config) -> None:
        llm = llm_config(config)
        self.header = llm.tenant_header if llm is not None else None
        self.apart = config.auth is not None
        old = self.limiters
        self.limiters = {}
        for cfg in config.ratelimits:
            prev = old.get(cfg.name)
            if prev is not None and _same_backend(prev.cfg, cfg):
                prev.configure(cfg)
                self.limiters[cfg.name] = prev
            else:
                self.limiters[cfg.name] = Limiter(cfg, _store(cfg))

    def collect(self) -> Iterator[Any]:
        admitted = CounterMetricFamily("aiproxy_ratelimit_admitted", "Requests admitted",
                                       labels=["ratelimit"])
        refused = CounterMetricFamily("aiproxy_ratelimit_refused",
                                      "Requests refused, by reason", labels=["ratelimit", "reason"])
        queued = CounterMetricFamily("aiproxy_ratelimit_queued",
                                     "Requests that waited in the watermark queue",
                                     labels=["ratelimit"])
        waiting = GaugeMetricFamily("aiproxy_ratelimit_waiting", "Requests waiting now",
                                    labels=["ratelimit"])
        errors = CounterMetricFamily("aiproxy_ratelimit_backend_errors",
                                     "Failed calls to the shared (Redis) backend",
                                     labels=["ratelimit"])
        for name, lim in sorted(self.limiters.items()):
            admitted.add_metric([name], lim.admitted)
            for reason, n in sorted(lim.refused.items()):
                refused.add_metric([name, reason], n)
            queued.add_metric([name], lim.queued)
            waiting.add_metric([name], lim.waiting)
            errors.add_metric([name], lim.backend_errors)
        yield from (admitted, refused, queued, waiting, errors)


def _same_backend(a: RateLimitConfig, b: RateLimitConfig) -> bool:
    return (a.backend, a.redis_url, a.redis_timeout_ms, a.max_keys) == (
        b.backend, b.redis_url, b.redis_timeout_ms, b.max_keys)


def _store(cfg: RateLimitConfig) -> Any:
    if cfg.backend == "redis":
        from aiproxy.ratelimit.redis_store import RedisStore

        return RedisStore(cfg.redis_url, cfg.redis_timeout_ms / 1000)
    return MemoryStore(cfg.max_keys)


def make_state(config: Config, previous: RateLimitState | None) -> RateLimitState | None:
    if not config.ratelimits:
        return None
    state = previous if previous is not None else RateLimitState()
    state.update(config)
    return state


def build(config: Config, route: RouteConfig, state: RateLimitState) -> FilterFactory | None:
    limiters = tuple(lim for lim in state.limiters.values()
                     if not lim.cfg.routes or route.name in lim.cfg.routes)
    return RateLimitFactory(limiters, state.header, state.apart) if limiters else None
