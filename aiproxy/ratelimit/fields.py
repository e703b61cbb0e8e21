"""The RateLimit-Policy and RateLimit response fields (draft-ietf-httpapi-ratelimit-headers
-10/11): Structured Field Lists (RFC 9651) with one member per request bucket, named by
its [[ratelimits]] entry.

A bucket of `cap` requests refilling at `rate`/s is the policy q=cap (the burst) per
w=cap/rate seconds; what it reports is r, the whole requests its level holds (after this
request's take; what backpressure keeps out of reach is not counted), and t, the seconds
until it is full again: a client that spends no more than r in that time is not refused
by this bucket, and has the whole burst again after it. Token buckets are not reported:
quota units (qu) must come from the draft's registry (requests, content-bytes,
concurrent-requests), which has none for tokens, and q without qu means requests.

The x-ratelimit-* fields OpenAI's API sends (and clients written for it read) report
both kinds: per kind, the bucket with the fewest units left among a request's limiters;
limit is its burst, remaining what its level holds, reset the time until it is full
again as a Go duration ("1s", "6m0s", "1h0m0s").
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from aiproxy.ratelimit.bucket import Spec

SF_INT_MAX = 999_999_999_999_999  # RFC 9651 3.3.1: at most 15 digits
# What an sf-string may hold (RFC 9651 3.3.3): printable ASCII.
PRINTABLE = re.compile(r"[\x20-\x7e]+")


def sf_string(text: str) -> bytes:
    return b'"' + text.replace("\\", "\\\\").replace('"', '\\"').encode("ascii") + b'"'


def _whole(x: float) -> int:
    """x rounded down to an sf-integer >= 0."""
    return 0 if not x > 0 else SF_INT_MAX if x >= SF_INT_MAX else math.floor(x)


def _seconds(x: float) -> int:
    """x seconds rounded up to an sf-integer >= 0 (delay-seconds)."""
    return 0 if not x > 0 else SF_INT_MAX if x >= SF_INT_MAX else math.ceil(x)


def policy_item(name: str, spec: Spec) -> bytes:
    rate, cap = spec[0], spec[1]
    return b"%s;q=%d;w=%d" % (sf_string(name), _whole(cap), max(1, _seconds(cap / rate)))


def left_and_reset(spec: Spec, level: float, until: int | None = None) -> tuple[int, int]:
    """(whole units the level holds, less what the watermark keeps out of reach; seconds
    until the bucket is full again). `until`: the Retry-After of a refusal, which no
    reset may pass (the draft's section 6: Retry-After SHOULD NOT come before the reset)."""
    rate, cap, _, factor = spec
    t = _seconds((cap - level) / (rate * factor))
    if until is not None and t > until:
        t = until
    return _whole(level - cap * (1 - factor)), t


def limit_item(name: str, spec: Spec, level: float, until: int | None = None) -> bytes:
    return b"%s;r=%d;t=%d" % (sf_string(name), *left_and_reset(spec, level, until))


def ratelimit_fields(snaps: Iterable[tuple[str, Spec, float]],
                     until: int | None = None) -> list[tuple[bytes, bytes]]:
    """The two fields for (policy name, request bucket spec, level) snapshots."""
    policies, limits = [], []
    for name, spec, level in snaps:
        policies.append(policy_item(name, spec))
        limits.append(limit_item(name, spec, level, until))
    if not limits:
        return []
    return [(b"ratelimit-policy", b", ".join(policies)), (b"ratelimit", b", ".join(limits))]


OPENAI_NAMES = {
    kind: (b"x-ratelimit-limit-" + kind.encode(), b"x-ratelimit-remaining-" + kind.encode(),
           b"x-ratelimit-reset-" + kind.encode())
    for kind in ("requests", "tokens")
}


def go_duration(seconds: int) -> bytes:
    """Whole seconds as Go's time.Duration prints them ("0s", "45s", "6m0s", "1h2m3s")."""
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    if h:
        return b"%dh%dm%ds" % (h, m, s)
    if m:
        return b"%dm%ds" % (m, s)
    return b"%ds" % s


def openai_fields(snaps: Iterable[tuple[str, Spec, float]],
                  until: int | None = None) -> list[tuple[bytes, bytes]]:
    """x-ratelimit-{limit,remaining,reset}-{kind} for (kind, spec, level) snapshots,
    "requests" or "tokens", the tightest bucket of each kind."""
    tightest: dict[str, tuple[int, int, int]] = {}
    for kind, spec, level in snaps:
        left, reset = left_and_reset(spec, level, until)
        seen = tightest.get(kind)
        if seen is None or (left, -reset) < (seen[1], -seen[2]):
            _, cap, _, factor = spec
            tightest[kind] = (_whole(cap * factor), left, reset)
    out = []
    for kind in ("requests", "tokens"):
        if kind in tightest:
            limit, left, reset = tightest[kind]
            names = OPENAI_NAMES[kind]
            out += [(names[0], b"%d" % limit), (names[1], b"%d" % left),
                    (names[2], go_duration(reset))]
    return out
