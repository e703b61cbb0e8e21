"""``host:port`` parsing shared by listeners, the admin endpoint and cluster endpoints."""

from __future__ import annotations

import ipaddress
import re

_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_NUMERIC = re.compile(r"[0-9.]+")


def parse_address(text: str) -> tuple[str, int]:
    """Split ``host:port`` or ``[v6]:port``; the IPv6 host is returned without brackets.

    Raises ValueError with a short reason.
    """
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep or not _is_ipv6(host):
            raise ValueError("expected host:port")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not HOSTNAME.fullmatch(host):
            raise ValueError("expected host:port")
        if _NUMERIC.fullmatch(host):  # no host name is all digits: an IPv4 address
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise ValueError(f"invalid IPv4 address '{host}'") from None
    if not port.isascii() or not port.isdigit():
        raise ValueError("expected host:port")
    number = int(port)
    if not 1 <= number <= 65535:
        raise ValueError("port must be between 1 and 65535")
    return host, number


def is_host(text: str, port: bool = False) -> bool:
    """An ASCII host name or IP address. Without ``port`` as a URI's host is given apart
    from its brackets (IPv6 bare); with ``port`` as a Host field value: ``name[:port]``,
    ``[v6][:port]``."""
    if port:
        candidates = (text, text + ":1")
    else:
        candidates = (f"[{text}]:1" if ":" in text else f"{text}:1",)
    for candidate in candidates:
        try:
            parse_address(candidate)
        except ValueError:
            continue
        return text.isascii()
    return False


def loopback_name(host: str) -> bool:
    """A Host value (port or not) that names this machine's loopback: 127.0.0.0/8, ::1,
    localhost or a name under .localhost (RFC 6761 6.3: those resolve to loopback)."""
    if host.startswith("["):
        name = host[1:host.find("]")] if "]" in host else ""
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def split_authority(authority: bytes) -> tuple[bytes, bytes | None]:
    """(host, port or None) of a Host field value or :authority."""
    if authority.startswith(b"["):
        end = authority.find(b"]")
        if end > 0:
            rest = authority[end + 1:]
            return authority[:end + 1], rest[1:] if rest[:1] == b":" and rest[1:] else None
        return authority, None
    host, colon, port = authority.rpartition(b":")
    if colon and port.isdigit():
        return host, port
    return authority.rstrip(b":"), None


# The userinfo of a URL ends at the authority's last "@" (as urllib and redis-py split
# it): a password with a raw "@" in it is hidden whole.
_URL_PASSWORD = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://[^/?#@:\s]*:)[^/?#\s]*@")


def without_password(text: str) -> str:
    """`text` with the password of every URL in it (redis://:PASSWORD@host) replaced by
    <redacted>: for logs and the admin API's /config."""
    return _URL_PASSWORD.sub(r"\1<redacted>@", text)
