"""Token buckets kept in process.

A bucket holds up to `cap` units and refills at `rate` units/s. Admission takes a
request's whole need at once (its reservation), so concurrent requests cannot all pass
on one bucket's remaining units. A need larger than what the bucket can ever hold is
admitted when the bucket is as full as it gets, and leaves it in debt.

Backpressure scales a bucket by `factor` (0 < factor <= 1): it refills at rate*factor
and keeps cap*(1 - factor) units out of reach, so both the burst and the sustained rate
shrink together.
"""

from __future__ import annotations

from collections import OrderedDict

# (rate units/s, capacity, need, factor) for one bucket of one admission
Spec = tuple[float, float, float, float]


class Bucket:
    __slots__ = ("level", "stamp")

    def __init__(self, cap: float, now: float) -> None:
        self.level = cap
        self.stamp = now

    def refill(self, now: float, rate: float, cap: float, factor: float) -> float:
        elapsed = now - self.stamp
        if elapsed > 0:
            self.level = min(cap, self.level + elapsed * rate * factor)
            self.stamp = now
        return self.level


class Budget(Bucket):
    """A bucket of fixed size and refill that a peer's costly-but-harmless actions are
    charged to (HTTP/2 control frames, resets, informational responses): `burst` units
    at first, `rate` more per second; overdrawn means the peer is abusing its connection."""

    __slots__ = ("burst", "rate")

    def __init__(self, burst: float, rate: float, now: float = 0.0) -> None:
        super().__init__(burst, now)
        self.burst = burst
        self.rate = rate

    def credit(self, n: float) -> None:
        """Give back n units (for work the peer did that earns it some slack)."""
        self.level = min(self.burst, self.level + n)

    def spend(self, n: float, now: float) -> bool:
        """Take n units at time `now` (seconds); False once the budget is overdrawn."""
        self.refill(now, self.rate, self.burst, 1.0)
        self.level -= n
        return self.level >= 0


def shortfall(level: float, spec: Spec) -> float:
    """Seconds until `level` admits spec's need (0: now)."""
    rate, cap, need, factor = spec
    floor = cap * (1 - factor)
    want = min(need, cap * factor)
    missing = want - (level - floor)
    return 0.0 if missing <= 0 else missing / (rate * factor)


class MemoryStore:
    """Buckets by key, the least recently used dropped past max_keys (a dropped bucket
    comes back full: bounded memory at the price of forgiving idle debt)."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self.buckets: OrderedDict[str, Bucket] = OrderedDict()

    def _bucket(self, key: str, cap: float, now: float) -> Bucket:
        buckets = self.buckets
        b = buckets.get(key)
        if b is None:
            b = buckets[key] = Bucket(cap, now)
            if len(buckets) > self.max_keys:
                buckets.popitem(last=False)
        else:
            buckets.move_to_end(key)
        return b

    def take(self, keys: list[str], specs: list[Spec], now: float,
             levels: list[float] | None = None) -> tuple[int, float]:
        """Take every spec's need from its bucket, or none: (-1, 0) when admitted, else
        (index of the bucket that waits longest, seconds to wait). `levels` gets each
        bucket's level after (less the need when admitted)."""
        worst, wait = -1, 0.0
        buckets = []
        for i, (key, spec) in enumerate(zip(keys, specs, strict=True)):
            b = self._bucket(key, spec[1], now)
            buckets.append(b)
            w = shortfall(b.refill(now, spec[0], spec[1], spec[3]), spec)
            if w > wait:
                worst, wait = i, w
        if worst < 0:
            for b, spec in zip(buckets, specs, strict=True):
                b.level -= spec[2]
        if levels is not None:
            levels.extend(b.level for b in buckets)
        return worst, wait

    def charge(self, key: str, spec: Spec, amount: float, now: float) -> None:
        """Take `amount` more (negative: give back) from a bucket."""
        b = self._bucket(key, spec[1], now)
        b.refill(now, spec[0], spec[1], spec[3])
        b.level = min(spec[1], b.level - amount)
