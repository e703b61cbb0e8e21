"""Heads that arrive as field lists (HTTP/2), with the interface of the Cython heads
of aiproxy._fast.h1, so the Exchange and both upstream kinds handle either without
caring where a head came from. A request becomes a RequestHead itself
(h2_request_head); a response is a FieldsHead."""

from __future__ import annotations

from http import HTTPStatus

from aiproxy._fast.h1 import RequestHead, fields_request_head, valid_authority, valid_field_line

# Flags, as in aiproxy/_fast/h1.pxd.
F_HOP = 1
F_CONTENT_LENGTH = 2
F_TRANSFER_ENCODING = 4
F_HOST = 8
F_XFF = 128
F_XFP = 256
F_OWN = 1024

# Fields that never cross a hop, whatever the protocol (RFC 9110 7.6.1, RFC 9113 8.2.2).
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade",
        b"te", b"trailer", b"proxy", b"expect", b"http2-settings"}
_FLAGS = {b"content-length": F_CONTENT_LENGTH, b"host": F_HOST, b"x-forwarded-for": F_XFF,
          b"x-forwarded-proto": F_XFP}

# Request fields that carry a caller's credentials to the upstream: HTTP authentication,
# the API key fields of Anthropic (x-api-key), Azure OpenAI (api-key), Gemini
# (x-goog-api-key) and OpenStack-style APIs (x-auth-token), and cookies. The cache keys
# its entries by them (aiproxy/cache/prompt.py).
REQUEST_CREDENTIALS = (b"authorization", b"x-api-key", b"api-key", b"x-goog-api-key",
                       b"x-auth-token", b"cookie")
# Every field whose value is a secret: those, Proxy-Authorization (credentials for one
# hop) and Set-Cookie. The admin /config view redacts their values; HTTP/2 sends them
# never-indexed (RFC 7541 7.1.3) and does not keep their encoding.
CREDENTIAL_FIELDS = frozenset((*REQUEST_CREDENTIALS, b"proxy-authorization", b"set-cookie"))


# RFC 9110 6.5.1: besides hop fields, what a trailer section must not carry (framing,
# routing, credentials), and the fields the proxy states for the client (forwarding,
# tracing, lineage, deadline): a client's request trailers never carry them upstream,
# where an upstream that merges trailers into the header section would believe them.
_NOT_IN_TRAILERS = _HOP | set(REQUEST_CREDENTIALS) | {
    b"content-length", b"host", b"content-type", b"content-encoding", b"content-range",
    b"forwarded", b"via", b"traceparent", b"tracestate", b"x-trace-id", b"x-model-id",
    b"grpc-timeout"}


def trailer_fields(fields: list[tuple[bytes, bytes]] | None,
                   owned: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    """The trailer fields (received over HTTP/2: validated, lower-case) to forward; none
    named in `owned` (the fields the proxy itself sets or removes on this request)."""
    if not fields:
        return []
    return [(n, v) for n, v in fields if _trailer_allowed(n, owned) and valid_field_line(n, v)]


_OWN_PREFIXES = (b"x-aiproxy-", b"x_aiproxy_")  # names the proxy sets; see F_OWN

# RFC 9110 6.5.1 for a response's trailer section: framing, routing, content metadata and
# cookies stay out, and so do the fields the proxy states on responses (x-aiproxy-*).
# Tracing and lineage fields pass: they say nothing the proxy relies on in a response.
_NOT_IN_RESPONSE_TRAILERS = _HOP | {
    b"content-length", b"host", b"content-type", b"content-encoding", b"content-range",
    b"set-cookie"}


def response_trailer_fields(fields: list[tuple[bytes, bytes]] | None
                            ) -> list[tuple[bytes, bytes]]:
    """The trailer fields of an HTTP/2 upstream's response (validated, lower-case) that
    go on to the client."""
    if not fields:
        return []
    return [(n, v) for n, v in fields
            if n not in _NOT_IN_RESPONSE_TRAILERS and n[:1] != b":"
            and n[:10] not in _OWN_PREFIXES and valid_field_line(n, v)]


def _trailer_allowed(name: bytes, owned: frozenset[bytes]) -> bool:
    dashed = name.replace(b"_", b"-")  # as CGI/WSGI-style servers read it (see _ALIASED)
    return not (dashed in _NOT_IN_TRAILERS or name in owned or dashed in owned
                or name[:1] == b":" or dashed[:6] == b"proxy-"
                or dashed[:10] == b"x-aiproxy-" or dashed[:12] == b"x-forwarded-")


class MalformedHead(Exception):
    """A field list that is not a valid message head (RFC 9113 8.1.1: malformed)."""


_NAME_FLAGS = {**_FLAGS, **dict.fromkeys(_HOP, F_HOP)}
# content_length, transfer_encoding, x_forwarded_for/_proto: servers that map '-' and '_'
# alike (CGI/WSGI environ names) read them as the fields the proxy frames and sets; not
# forwarded, as for HTTP/1.1 (_ieq_us in h1.pyx).
_ALIASED = {b"content-length", b"transfer-encoding", b"x-forwarded-for", b"x-forwarded-proto"}
_SCHEME_CHARS = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-."


def _content_length(values: list[bytes]) -> int:
    length = -1
    for value in values:
        for part in value.split(b","):
            part = part.strip(b" \t")
            if not part.isdigit() or len(part) > 18:
                raise MalformedHead("invalid content-length")
            n = int(part)
            if length not in (-1, n):
                raise MalformedHead("conflicting content-length values")
            length = n
    return length


def field_flags(items: list[tuple[bytes, bytes]]) -> tuple[list[int], int]:
    """Each field's flags (F_*) and the Content-Length (-1: none)."""
    flags = []
    lengths = None
    table = _NAME_FLAGS
    for name, value in items:
        f = table.get(name)
        if f is None:
            if name[:6] == b"proxy-":
                f = F_HOP
            elif name[:10] in _OWN_PREFIXES:
                f = F_OWN
            elif b"_" in name and name.replace(b"_", b"-") in _ALIASED:
                f = F_HOP
            else:
                f = 0
        elif f == F_CONTENT_LENGTH:
            if lengths is None:
                lengths = []
            lengths.append(value)
        flags.append(f)
    return flags, _content_length(lengths) if lengths else -1


class FieldsHead:
    """Regular fields (lower-case names, no pseudo-fields) plus derived framing."""

    __slots__ = ("items", "flags", "content_length")

    chunked = False
    keep_alive = True
    upgrade = None

    def __init__(self, items: list[tuple[bytes, bytes]]) -> None:
        self.items = items
        self.flags, self.content_length = field_flags(items)

    def get(self, lname: bytes) -> bytes | None:
        for name, value in self.items:
            if name == lname:
                return value
        return None

    def get_all(self, lname: bytes) -> list[bytes]:
        return [value for name, value in self.items if name == lname]

    def headers(self) -> list[tuple[bytes, bytes]]:
        return list(self.items)

    def fields(self, drop_mask: int) -> list[tuple[bytes, bytes]]:
        return [item for item, f in zip(self.items, self.flags, strict=True) if not f & drop_mask]

    def serialize(self, start_line: bytes, extra: bytes, drop_mask: int) -> bytes:
        parts = [start_line]
        for (name, value), f in zip(self.items, self.flags, strict=True):
            if not f & drop_mask:
                parts += (name, b": ", value, b"\r\n")
        parts += (extra, b"\r\n")
        return b"".join(parts)


_DEFAULT_PORTS = {b"http": b":80", b"https": b":443"}


def _authority_key(authority: bytes, scheme: bytes | None) -> bytes:
    key = authority.lower()
    if key.endswith(b":"):
        return key[:-1]
    default = _DEFAULT_PORTS.get(scheme.lower() if scheme else b"")
    if default is not None and key.endswith(default):
        return key[:-len(default)]
    return key


def same_authority(a: bytes, b: bytes, scheme: bytes | None) -> bool:
    """Whether two authorities name the same entity (RFC 9113 8.3.1: Host against
    :authority), compared as RFC 3986 6.2.2-6.2.3 normalizes them: the host in any
    case, an empty port or the scheme's default port as none."""
    return a == b or _authority_key(a, scheme) == _authority_key(b, scheme)


def h2_request_head(headers: list[tuple[bytes, bytes]], end_stream: bool) -> RequestHead:
    """A request from HTTP/2 pseudo-fields and fields, checked per RFC 9113 8.3. Sent to
    an HTTP/1.1 upstream, `host` (:authority, else the host field) becomes the Host field:
    Exchange.h1_request_head writes it (RFC 9113 8.3.1). The head has version 20, and
    the exchange checks its target itself (target_plain is false; _scan_target in
    h1.pyx)."""
    pseudo: dict[bytes, bytes] = {}
    items: list[tuple[bytes, bytes]] = []
    cookies: list[bytes] = []
    host = None
    for name, value in headers:
        if name[:1] == b":":
            if name in pseudo or items:
                raise MalformedHead("duplicate or misplaced pseudo-header")
            pseudo[name] = value
        elif name == b"cookie":
            cookies.append(value)  # RFC 9113 8.2.3: joined again for HTTP/1.1
        else:
            if name == b"host" and host is None:
                host = value
            items.append((name, value))
    if cookies:
        items.append((b"cookie", b"; ".join(cookies)))
    method = pseudo.get(b":method")
    if not method:
        raise MalformedHead("missing :method")
    path = pseudo.get(b":path")
    scheme = pseudo.get(b":scheme")
    if method == b"CONNECT":
        # RFC 9113 8.5: :authority only. Well formed, it reaches the exchange, which
        # answers 501 as it does for HTTP/1.1.
        if path is not None or scheme is not None or not pseudo.get(b":authority"):
            raise MalformedHead("CONNECT needs :authority and no :path or :scheme")
        path = pseudo[b":authority"]
    elif not path or not scheme:
        raise MalformedHead("missing :path or :scheme")
    elif path[:1] != b"/" and not (path == b"*" and method == b"OPTIONS"):
        raise MalformedHead("invalid :path")
    elif not scheme[:1].isalpha() or scheme.translate(None, _SCHEME_CHARS):
        raise MalformedHead("invalid :scheme")  # RFC 3986 3.1
    unknown = set(pseudo) - {b":method", b":path", b":scheme", b":authority"}
    if unknown:
        raise MalformedHead("unknown pseudo-header")
    flags, length = field_flags(items)
    if end_stream and length > 0:
        # RFC 9113 8.1.1: no DATA can follow, so the body cannot be the declared length.
        raise MalformedHead("content-length but no body")
    authority = pseudo.get(b":authority")
    if authority is not None and host is not None and not same_authority(authority, host,
                                                                          scheme):
        raise MalformedHead(":authority and host differ")
    if authority is None:
        authority = host
    # RFC 9113 8.3.1: not empty, no userinfo; it becomes the upstream's Host field.
    if authority is not None and not valid_authority(authority):
        raise MalformedHead("invalid :authority or host")
    try:
        return fields_request_head(items, flags, length, method, path, authority,
                                   F_XFF in flags, not end_stream)
    except ValueError as exc:
        raise MalformedHead(str(exc)) from None


class H2ResponseHead(FieldsHead):
    __slots__ = ("status", "reason")

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        status = None
        items = []
        for name, value in headers:
            if name == b":status":
                status = value
            elif name[:1] == b":":
                raise MalformedHead("unknown response pseudo-header")
            else:
                items.append((name, value))
        if (status is None or len(status) != 3 or not status.isdigit()
                or not b"100" <= status <= b"599"):  # RFC 9110 15: 100-599
            raise MalformedHead("missing or invalid :status")
        for name, value in items:
            if not valid_field_line(name, value):  # it may be written as HTTP/1.1
                raise MalformedHead("invalid field")
        super().__init__(items)
        self.status = int(status)
        try:
            self.reason = HTTPStatus(self.status).phrase.encode()
        except ValueError:
            self.reason = b"Unknown"
