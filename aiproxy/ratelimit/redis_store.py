"""Token buckets shared through Redis: the same arithmetic as bucket.py, run as Lua
scripts so an admission across a request's buckets is atomic for every aiproxy
process using the Redis server. Time is the Redis server's (TIME), so hosts with
skewed clocks agree. Every call is bounded by `timeout`; the caller decides what a
failure means (fail open or closed).

A take whose answer the proxy never sees (the client went away while it was in flight,
or it timed out) may still have run, or may run later once a stuck server resumes. So
each take names a reservation key, which it marks when it takes, and such a take is
voided: a VOID (retried for a while) refunds it if it ran, and otherwise marks the key
so that the take does nothing if it runs after all. Either order ends with nothing
taken. Reservation keys live RESERVATION_TTL_MS (a server stuck for longer than that
can still leak a take)."""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from typing import Any

from aiproxy.config.address import without_password
from aiproxy.ratelimit.bucket import Spec

log = logging.getLogger("aiproxy.ratelimit")

RESERVATION_TTL_MS = 60_000
VOID_ATTEMPTS = 8  # with VOID_BACKOFF doubling: retried for ~25 s (< RESERVATION_TTL_MS)
VOID_BACKOFF = 0.1

# Shared by the scripts: Redis server time, a bucket's level refilled up to now, and
# storing a level (kept until the bucket would be full again at the current factor,
# plus a minute).
BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level_of(key, rate, cap, factor)
  local v = redis.call('HMGET', key, 'l', 't')
  local level = tonumber(v[1]) or cap
  local stamp = tonumber(v[2]) or now
  if now > stamp then level = math.min(cap, level + (now - stamp) * rate * factor) end
  return level
end
local function store(key, level, rate, cap, factor)
  redis.call('HSET', key, 'l', tostring(level), 't', tostring(now))
  -- Until it would be full again (a missing key reads as full), debt included; at most
  -- 1e13 ms, which Lua still prints as an integer for PEXPIRE.
  local refill = math.max(0, cap - level) / (rate * factor)
  redis.call('PEXPIRE', key, math.min(math.ceil(refill * 1000) + 60000, 1e13))
end
"""

# KEYS: one per bucket, then the reservation key. ARGV: per bucket rate, cap, need,
# factor; then the reservation key's TTL (ms). Returns {0, "0", levels...} when every
# need was taken (and marks the reservation "1"), else {index (1-based) of the bucket
# that waits longest, seconds as a string, levels...} and nothing is taken; nothing
# either (and no levels) if the reservation was voided before this ran. The levels, as
# strings, are each bucket's after the script, as MemoryStore.take gives them.
TAKE = BUCKET + """
local res = KEYS[#KEYS]
if redis.call('EXISTS', res) == 1 then return {-1, '0'} end
local levels = {}
local worst, wait = 0, 0
local out = {0, '0'}
local n = #KEYS - 1
for i = 1, n do
  local b = (i - 1) * 4
  local rate, cap = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local need, factor = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  local level = level_of(KEYS[i], rate, cap, factor)
  levels[i] = level
  local missing = math.min(need, cap * factor) - (level - cap * (1 - factor))
  if missing > 0 then
    local w = missing / (rate * factor)
    if w > wait then worst, wait = i, w end
  end
end
for i = 1, n do
  local b = (i - 1) * 4
  local level = levels[i]
  if worst == 0 then level = level - tonumber(ARGV[b + 3]) end
  store(KEYS[i], level, tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 4]))
  out[i + 2] = tostring(level)
end
if worst == 0 then redis.call('SET', res, '1', 'PX', ARGV[n * 4 + 1]) end
out[1], out[2] = worst, tostring(wait)
return out
"""

# KEYS and ARGV as for TAKE: give back what the take took if it ran; in any case mark
# the reservation voided ("0") so a take still to come does nothing. Idempotent.
VOID = BUCKET + """
local res = KEYS[#KEYS]
local n = #KEYS - 1
local state = redis.call('GET', res)
redis.call('SET', res, '0', 'PX', ARGV[n * 4 + 1])
if state ~= '1' then return 0 end
for i = 1, n do
  local b = (i - 1) * 4
  local rate, cap = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local need, factor = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  store(KEYS[i], math.min(cap, level_of(KEYS[i], rate, cap, factor) + need), rate, cap,
        factor)
end
return 1
"""

# KEYS[1]; ARGV rate, cap, factor, amount: refill, then take amount (negative: give back).
CHARGE = BUCKET + """
local rate, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local factor, amount = tonumber(ARGV[3]), tonumber(ARGV[4])
store(KEYS[1], math.min(cap, level_of(KEYS[1], rate, cap, factor) - amount), rate, cap,
      factor)
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
        self._void = self.client.register_script(VOID)
        self._charge = self.client.register_script(CHARGE)
        self.pending: set[asyncio.Task] = set()

    async def take(self, keys: list[str], specs: list[Spec],
                   levels: list[float] | None = None) -> tuple[int, float]:
        """As MemoryStore.take, on Redis server time."""
        args: list[float] = []
        for spec in specs:
            args += spec
        keys = [*keys, f"rl:res:{uuid.uuid4().hex}"]
        args.append(RESERVATION_TTL_MS)
        try:
            answer = await asyncio.wait_for(self._take(keys=keys, args=args), self.timeout)
        except BaseException:
            # Cancelled (the client is gone) or failed: the take may have run, or may
            # still run. Undo it either way.
            self._spawn(self._void_now(keys, args))
            raise
        if levels is not None:
            levels.extend(float(x) for x in answer[2:])
        return int(answer[0]) - 1, float(answer[1])

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _void_now(self, keys: list[str], args: list[float]) -> None:
        delay = VOID_BACKOFF
        for attempt in range(VOID_ATTEMPTS):
            try:
                await asyncio.wait_for(self._void(keys=keys, args=args), self.timeout)
                return
            except Exception as exc:
                if attempt == VOID_ATTEMPTS - 1:
                    log.warning("rate limit reservation %s not voided at %s: %s", keys[-1],
                                self.url, exc)
                    return
            await asyncio.sleep(delay)
            delay *= 2

    def charge(self, key: str, spec: Spec, amount: float) -> None:
        """Fire and forget: a failed settlement is logged, never waited for."""
        if not amount or math.isnan(amount):
            return
        self._spawn(self._charge_now(key, spec, amount))

    async def _charge_now(self, key: str, spec: Spec, amount: float) -> None:
        try:
            await asyncio.wait_for(
                self._charge(keys=[key], args=[spec[0], spec[1], spec[3], amount]),
                self.timeout)
        except Exception as exc:  # the budget drifts; requests go on
            log.warning("rate limit settlement to %s failed: %s", without_password(self.url),
                        exc)

    async def close(self) -> None:
        await self.client.aclose()
