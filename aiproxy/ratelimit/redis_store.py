"""Token buckets shared through Redis: the same arithmetic as bucket.py, run as Lua
scripts so an admission across a request's buckets is atomic for every aiproxy
process using the Redis server. Time is the Redis server's (TIME), so hosts with
skewed clocks agree. Every call is bounded by `timeout`; the caller decides what a
failure means (fail open or closed)."""

from __future__ import annotations

import asyncio
import logging
import math

from aiproxy.ratelimit.bucket import Spec

log = logging.getLogger("aiproxy.ratelimit")

# KEYS: one per bucket. ARGV: per bucket rate, cap, need, factor. Returns
# {0, "0"} when every need was taken, else {index (1-based) of the bucket that waits
# longest, seconds as a string} and nothing is taken.
TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local levels = {}
local worst, wait = 0, 0
for i = 1, #KEYS do
  local b = (i - 1) * 4
  local rate, cap = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local need, factor = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  local v = redis.call('HMGET', KEYS[i], 'l', 't')
  local level = tonumber(v[1]) or cap
  local stamp = tonumber(v[2]) or now
  if now > stamp then level = math.min(cap, level + (now - stamp) * rate * factor) end
  levels[i] = level
  local missing = math.min(need, cap * factor) - (level - cap * (1 - factor))
  if missing > 0 then
    local w = missing / (rate * factor)
    if w > wait then worst, wait = i, w end
  end
end
for i = 1, #KEYS do
  local b = (i - 1) * 4
  local level = levels[i]
  if worst == 0 then level = level - tonumber(ARGV[b + 3]) end
  local ttl = math.ceil(tonumber(ARGV[b + 2]) / tonumber(ARGV[b + 1]) * 1000) + 60000
  redis.call('HSET', KEYS[i], 'l', tostring(level), 't', tostring(now))
  redis.call('PEXPIRE', KEYS[i], ttl)
end
return {worst, tostring(wait)}
"""

# KEYS[1]; ARGV rate, cap, factor, amount: refill, then take amount (negative: give back).
CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local factor, amount = tonumber(ARGV[3]), tonumber(ARGV[4])
local v = redis.call('HMGET', KEYS[1], 'l', 't')
local level = tonumber(v[1]) or cap
local stamp = tonumber(v[2]) or now
if now > stamp then level = math.min(cap, level + (now - stamp) * rate * factor) end
level = math.min(cap, level - amount)
redis.call('HSET', KEYS[1], 'l', tostring(level), 't', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(cap / rate * 1000) + 60000)
return 1
"""


class RedisStore:
    def __init__(self, url: str, timeout: float) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.timeout = timeout
        self.client = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout,
            retry_on_timeout=False)
        self._take = self.client.register_script(TAKE)
        self._charge = self.client.register_script(CHARGE)
        self.pending: set[asyncio.Task] = set()

    async def take(self, keys: list[str], specs: list[Spec]) -> tuple[int, float]:
        args: list[float] = []
        for spec in specs:
            args += spec
        worst, wait = await asyncio.wait_for(self._take(keys=keys, args=args),
                                             self.timeout)
        return int(worst) - 1, float(wait)

    def charge(self, key: str, spec: Spec, amount: float) -> None:
        """Fire and forget: a failed settlement is logged, never waited for."""
        if not amount or math.isnan(amount):
            return
        task = asyncio.get_running_loop().create_task(self._charge_now(key, spec, amount))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _charge_now(self, key: str, spec: Spec, amount: float) -> None:
        try:
            await asyncio.wait_for(
                self._charge(keys=[key], args=[spec[0], spec[1], spec[3], amount]),
                self.timeout)
        except Exception as exc:  # the budget drifts; requests go on
            log.warning("rate limit settlement to %s failed: %s", self.url, exc)

    async def close(self) -> None:
        await self.client.aclose()
