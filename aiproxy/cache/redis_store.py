"""Prompt cache entries in Redis (`backend = "redis"`), shared by every aiproxy using
the server. Entries expire through Redis (PX); the byte bound is Redis's own
(maxmemory with an LRU policy). Every call is bounded by the timeout; a failed lookup
is a miss and a failed store is dropped, both logged at most every 5 s."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from typing import Any

from aiproxy.config.address import without_password

log = logging.getLogger("aiproxy.cache")
LOG_INTERVAL = 5.0
_HEAD = struct.Struct("!HdHI")  # status, created (epoch s), field count, chunk count
_LEN = struct.Struct("!I")


def encode(status: int, created: float, items: list[tuple[bytes, bytes]],
           chunks: list[bytes]) -> bytes:
    out = [_HEAD.pack(status, created, len(items), len(chunks))]
    for part in [p for item in items for p in item] + chunks:
        out += (_LEN.pack(len(part)), part)
    return b"".join(out)


def decode(blob: bytes) -> tuple[int, float, list[tuple[bytes, bytes]], list[bytes]]:
    status, created, n_items, n_chunks = _HEAD.unpack_from(blob)
    pos = _HEAD.size
    parts = []
    for _ in range(2 * n_items + n_chunks):
        (n,) = _LEN.unpack_from(blob, pos)
        pos += _LEN.size
        parts.append(blob[pos:pos + n])
        pos += n
    if pos != len(blob):
        raise ValueError("trailing bytes in a cache entry")
    items = list(zip(parts[:2 * n_items:2], parts[1:2 * n_items:2], strict=True))
    return status, created, items, parts[2 * n_items:]


class RedisCache:
    def __init__(self, url: str, timeout: float) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.timeout = timeout
        self.client = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout,
            retry_on_timeout=False)
        self.errors = 0
        self.logged_at = -LOG_INTERVAL
        self.pending: set[asyncio.Task] = set()

    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self.logged_at >= LOG_INTERVAL:
            self.logged_at = now
            log.error("prompt cache %s at %s failed (%s); serving without the cache",
                      what, without_password(self.url), exc or type(exc).__name__)

    async def get(self, key: str) -> Any:
        """(status, created, items, chunks) or None (absent, or Redis failed)."""
        try:
            blob = await asyncio.wait_for(self.client.get(key), self.timeout)
        except Exception as exc:
            self._failed("lookup", exc)
            return None
        if blob is None:
            return None
        try:
            return decode(blob)
        except (ValueError, struct.error) as exc:
            self._failed("entry decode", exc)
            return None

    def put(self, key: str, blob: bytes, ttl_ms: int) -> None:
        task = asyncio.get_running_loop().create_task(self._put(key, blob, ttl_ms))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _put(self, key: str, blob: bytes, ttl_ms: int) -> None:
        try:
            await asyncio.wait_for(self.client.set(key, blob, px=ttl_ms), self.timeout)
        except Exception as exc:
            self._failed("store", exc)
