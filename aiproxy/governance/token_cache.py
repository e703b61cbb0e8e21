"""Verified bearer tokens, so a client sending the same JWT on every request pays for
one signature check (an RS256 verify costs tens of microseconds) per `ttl`.

A bounded LRU keyed by the token text. A verified token's entry lasts until
min(its `exp`, verified + ttl): past `exp` the token goes through full verification
again (and the leeway) and is refused there. A refusal is kept only FAIL_TTL seconds
(a token that is not yet valid, or whose key is about to be published, is not refused
for long), so a client retrying a bad token costs one verify per FAIL_TTL. The owner
clears the cache when the verification keys change (JWKS re-read), and on a config
reload hands the entries over (`adopt`) only when the verification settings are the same."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

FAIL_TTL = 1.0
# Refusals are kept only for tokens up to this long: junk tokens near the header limit
# (32 KiB) would otherwise let any client park cache_size of them in memory.
MAX_REFUSED_LEN = 2048


class TokenCache:
    __slots__ = ("size", "ttl", "entries", "hits", "misses")

    def __init__(self, size: int, ttl: float) -> None:
        self.size = size
        self.ttl = ttl
        self.entries: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, token: str, now: float) -> Any:
        """The value stored for token (a verified identity, or a refusal), or None."""
        entry = self.entries.get(token)
        if entry is None:
            self.misses += 1
            return None
        if entry[0] <= now:
            del self.entries[token]
            self.misses += 1
            return None
        self.entries.move_to_end(token)
        self.hits += 1
        return entry[1]

    def verified(self, token: str, value: Any, exp: Any, now: float) -> None:
        until = now + self.ttl
        if isinstance(exp, int | float) and not isinstance(exp, bool) and exp < until:
            until = exp  # (compared as numbers: an int past float range is no error)
        self._put(token, value, until, now)

    def refused(self, token: str, value: Any, now: float) -> None:
        if len(token) > MAX_REFUSED_LEN:
            return
        self._put(token, value, now + min(FAIL_TTL, self.ttl), now)

    def _put(self, token: str, value: Any, until: float, now: float) -> None:
        if until <= now:
            return
        entries = self.entries
        entries[token] = (until, value)
        entries.move_to_end(token)
        if len(entries) > self.size:
            entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()

    def adopt(self, old: TokenCache, entries: bool) -> None:
        """On a config reload: carry on old's counters and, if `entries`, its entries
        (the most recently used, up to this cache's size)."""
        self.hits = old.hits
        self.misses = old.misses
        if entries:
            kept = old.entries
            while len(kept) > self.size:
                kept.popitem(last=False)
            self.entries = kept
            old.entries = OrderedDict()
