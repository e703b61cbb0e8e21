"""The PROXY protocol (HAProxy's proxy-protocol.txt, versions 1 and 2) on a listener with
`proxy_protocol = true`: a load balancer in front (HAProxy `send-proxy`, AWS NLB, ...)
opens each connection with a header that names the client's address, and that address,
not the balancer's, is the client's from then on (X-Forwarded-For, access and audit
logs, policy source CIDRs, rate limit keys).

Every connection to such a listener must start with a valid header, read before
anything else (before a TLS handshake too); one that does not, or that has not sent it
whole within `[http] header_timeout_ms`, is closed without a reply, as the
specification asks ("the receiver must not try to guess"). LOCAL (v2) and UNKNOWN (v1)
headers, health checks by the balancer itself, keep the connection's own address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("aiproxy.server")

V1_PREFIX = b"PROXY "
V1_MAX = 107  # the longest v1 line, CRLF included
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
# v2 address blocks are at most 216 bytes (AF_UNIX); what follows them is TLVs. A header
# may be 64 KiB long by its length field; this much is room for any balancer's TLVs.
V2_MAX = 16 + 4096
_V2_ADDRESS_BYTES = {0x1: 12, 0x2: 36, 0x3: 216}  # INET, INET6, UNIX


class ProxyHeaderError(ValueError):
    pass


def parse_header(data: bytes | bytearray) -> tuple[int, str | None] | None:
    """(bytes the header takes, the client's address or None to keep the connection's
    own) once `data` holds a whole header; None while it may still become one;
    ProxyHeaderError when it cannot."""
    if data[:1] == b"\r":
        return _parse_v2(data)
    if data[:1] == b"P":
        return _parse_v1(data)
    raise ProxyHeaderError("no PROXY protocol header")


def _parse_v1(data: bytes | bytearray) -> tuple[int, str | None] | None:
    n = min(len(data), len(V1_PREFIX))
    if data[:n] != V1_PREFIX[:n]:
        raise ProxyHeaderError("no PROXY protocol header")
    end = data.find(b"\r\n", 0, V1_MAX)
    if end < 0:
        if len(data) >= V1_MAX:
            raise ProxyHeaderError("v1 header longer than 107 bytes")
        return None
    line = bytes(data[len(V1_PREFIX):end])
    parts = line.split(b" ")
    if parts[0] == b"UNKNOWN":
        return end + 2, None  # the rest of the line is to be ignored
    if len(parts) != 5 or parts[0] not in (b"TCP4", b"TCP6"):
        raise ProxyHeaderError("v1 header is not PROXY TCP4|TCP6|UNKNOWN src dst sport dport")
    try:
        family = ipaddress.IPv4Address if parts[0] == b"TCP4" else ipaddress.IPv6Address
        src = family(parts[1].decode("ascii"))
        family(parts[2].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ProxyHeaderError("v1 header has an invalid address") from None
    for port in parts[3:]:
        if not (port.isdigit() and len(port) <= 5 and int(port) <= 65535
                and (port == b"0" or port[:1] != b"0")):
            raise ProxyHeaderError("v1 header has an invalid port")
    return end + 2, client_address(src)


def _parse_v2(data: bytes | bytearray) -> tuple[int, str | None] | None:
    n = min(len(data), len(V2_SIGNATURE))
    if data[:n] != V2_SIGNATURE[:n]:
        raise ProxyHeaderError("no PROXY protocol header")
    if len(data) < 16:
        return None
    version, command = data[12] >> 4, data[12] & 0x0F
    if version != 2:
        raise ProxyHeaderError(f"v2 header of version {version}")
    if command > 1:
        raise ProxyHeaderError(f"v2 header with unknown command {command}")
    family, transport = data[13] >> 4, data[13] & 0x0F
    length = int.from_bytes(data[14:16], "big")
    if 16 + length > V2_MAX:
        raise ProxyHeaderError(f"v2 header of {16 + length} bytes (at most {V2_MAX})")
    if len(data) < 16 + length:
        return None
    if command == 0:  # LOCAL: the balancer's own connection (a health check)
        return 16 + length, None
    if family > 3 or transport > 2:
        raise ProxyHeaderError("v2 header with an unknown address family or transport")
    need = _V2_ADDRESS_BYTES.get(family, 0)
    if length < need:
        raise ProxyHeaderError("v2 header shorter than its addresses")
    if family == 0 or family == 3 or transport != 1:
        return 16 + length, None  # UNSPEC, UNIX or datagram: nothing an IP client has
    size = 4 if family == 1 else 16
    raw = bytes(data[16:16 + size])
    address = ipaddress.IPv4Address(raw) if family == 1 else ipaddress.IPv6Address(raw)
    return 16 + length, client_address(address)


def client_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """The client's address as text; an IPv4-mapped IPv6 one (::ffff:a.b.c.d, what a
    dual-stack balancer names an IPv4 client by) as the IPv4 address it is, so IPv4
    source_cidrs, rate-limit keys and logs see one client under one address."""
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped if mapped is not None else address)


class ProxyHeaderReader(asyncio.Protocol):
    """A proxy_protocol listener's connection until its header is read: then the
    listener's own protocol takes the connection, with the client address from the
    header as its peer and the bytes read past the header."""

    def __init__(self, loop: asyncio.AbstractEventLoop, inner: Callable[[], Any],
                 timeout: float) -> None:
        self.loop = loop
        self.inner = inner
        self.timeout = timeout
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.timer = self.loop.call_later(self.timeout, self._expired)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        try:
            parsed = parse_header(buf)
        except ProxyHeaderError as exc:
            return self._refuse(str(exc))
        if parsed is None:
            return
        taken, client = parsed
        rest = bytes(buf[taken:])
        self.buf = bytearray()
        self._cancel()
        transport = self.transport
        assert transport is not None
        proto = self.inner()
        if client is not None:
            proto.peer = client.encode()
        transport.set_protocol(proto)
        proto.connection_made(transport)
        if rest and not transport.is_closing():
            proto.data_received(rest)

    def eof_received(self) -> bool:
        self._refuse("closed before a whole PROXY protocol header")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()

    def _expired(self) -> None:
        self.timer = None
        self._refuse("no whole PROXY protocol header within header_timeout_ms")

    def _refuse(self, why: str) -> None:
        self._cancel()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        peer = transport.get_extra_info("peername")
        log.info("closing a connection from %s: %s", peer[0] if peer else "?", why)
        transport.close()

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
