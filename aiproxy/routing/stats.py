"""Per-endpoint state: load, latency, throughput, health and ejections."""

from __future__ import annotations

import asyncio
from typing import Any

REPORTED_LOAD_TTL = 10.0  # seconds a backend-reported load stays valid
# Response fields in which a backend reports its load (percent).
LOAD_HEADERS = (b"x-backend-load", b"x-gpu-mem-used-pct")
TOKEN_WINDOW = 60.0


class EndpointStats:
    """What the balancers, outlier detection and /clusters know about one endpoint."""

    __slots__ = ("in_flight", "requests", "failures", "consecutive_failures", "ejected",
                 "ejected_until", "times_ejected", "eject_timer", "healthy", "hc_ok", "hc_fail",
                 "hc_last", "ttfb_ms", "tok_start", "tok_cur", "tok_prev", "reported_load",
                 "reported_at", "score")

    def __init__(self) -> None:
        self.in_flight = 0
        self.requests = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.ejected = False
        self.ejected_until = 0.0
        self.times_ejected = 0
        self.eject_timer: asyncio.TimerHandle | None = None
        self.healthy = True
        self.hc_ok = 0
        self.hc_fail = 0
        self.hc_last = ""
        self.ttfb_ms = -1.0  # EWMA; -1 until the first sample
        self.tok_start = 0.0
        self.tok_cur = 0
        self.tok_prev = 0
        self.reported_load = -1.0
        self.reported_at = 0.0
        self.score = 0.0

    @property
    def available(self) -> bool:
        return self.healthy and not self.ejected

    def observe_ttfb(self, ms: float, alpha: float) -> None:
        old = self.ttfb_ms
        self.ttfb_ms = ms if old < 0 else old + alpha * (ms - old)

    def _roll(self, now: float) -> None:
        elapsed = now - self.tok_start
        if elapsed >= TOKEN_WINDOW:
            self.tok_prev = self.tok_cur if elapsed < 2 * TOKEN_WINDOW else 0
            self.tok_cur = 0
            self.tok_start = now - (elapsed % TOKEN_WINDOW)

    def add_tokens(self, n: int, now: float) -> None:
        self._roll(now)
        self.tok_cur += n

    def tpm(self, now: float) -> float:
        """Tokens over the last minute (sliding-window estimate)."""
        self._roll(now)
        return self.tok_prev * (1 - (now - self.tok_start) / TOKEN_WINDOW) + self.tok_cur

    def load_pct(self, now: float, capacity: int) -> float:
        if self.reported_at and now - self.reported_at < REPORTED_LOAD_TTL:
            return self.reported_load
        if capacity:
            return min(100.0, self.in_flight * 100.0 / capacity)
        return 0.0

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "healthy": self.healthy, "ejected": self.ejected,
            "ejected_for_ms": max(0, round((self.ejected_until - now) * 1000))
            if self.ejected else 0,
            "times_ejected": self.times_ejected, "in_flight": self.in_flight,
            "requests": self.requests, "failures": self.failures,
            "consecutive_failures": self.consecutive_failures,
            "ttfb_ewma_ms": round(self.ttfb_ms, 3) if self.ttfb_ms >= 0 else None,
            "tokens_per_minute": round(self.tpm(now), 1),
            "reported_load_pct": self.reported_load
            if self.reported_at and now - self.reported_at < REPORTED_LOAD_TTL else None,
            "health_check": self.hc_last or None,
        }
