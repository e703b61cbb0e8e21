"""How long a stored response stays fresh (RFC 9111 4.2), as a shared cache reads it:
the lifetime the response gives and the age it already had when it arrived."""

from __future__ import annotations

from email.utils import mktime_tz, parsedate_tz
from typing import Any


def http_date(value: bytes | None) -> float | None:
    """An HTTP-date (IMF-fixdate, RFC 850 or asctime: RFC 9110 5.6.7) as epoch seconds;
    None when absent or not a date."""
    if value is None:
        return None
    parsed = parsedate_tz(value.decode("latin-1"))
    if parsed is None:
        return None
    try:
        return float(mktime_tz(parsed))
    except (OverflowError, ValueError):
        return None


def lifetime(resp: Any, cc: dict[bytes, bytes], received: float) -> float | None:
    """The freshness lifetime in seconds the response gives (RFC 9111 4.2.1): s-maxage,
    else max-age, else Expires minus Date (the time received without a Date); None when
    it gives none. An invalid value gives 0 (stale): RFC 9111 4.2.1 and 5.3."""
    for name in (b"s-maxage", b"max-age"):
        arg = cc.get(name)
        if arg is not None:
            return float(arg) if arg.isdigit() else 0.0
    expires = resp.get(b"expires")
    if expires is None:
        return None
    at = http_date(expires)
    if at is None:
        return 0.0
    date = http_date(resp.get(b"date"))
    return max(0.0, at - (received if date is None else date))


def initial_age(resp: Any) -> float:
    """The Age the response arrived with (RFC 9111 5.1: the first member of a list; an
    invalid value is ignored)."""
    value = resp.get(b"age")
    if value is None:
        return 0.0
    first = value.split(b",", 1)[0].strip()
    return float(first) if first.isdigit() else 0.0
