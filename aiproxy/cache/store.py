"""An in-process cache: entries expire after their TTL and the least recently used go
first once the entries' bytes pass max_bytes."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class MemoryCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self.entries: OrderedDict[str, tuple[float, int, Any]] = OrderedDict()

    def get(self, key: str, now: float) -> Any:
        entry = self.entries.get(key)
        if entry is None:
            return None
        expires, size, value = entry
        if expires <= now:
            del self.entries[key]
            self.size -= size
            return None
        self.entries.move_to_end(key)
        return value

    def put(self, key: str, value: Any, size: int, expires: float) -> None:
        if size > self.max_bytes:
            return
        old = self.entries.pop(key, None)
        if old is not None:
            self.size -= old[1]
        self.entries[key] = (expires, size, value)
        self.size += size
        self.trim()

    def trim(self) -> None:
        """Drop the least recently used entries until the rest fit max_bytes."""
        while self.size > self.max_bytes:
            _, (_, n, _) = self.entries.popitem(last=False)
            self.size -= n
