"""Request path normalization before routing (RFC 3986 6.2.2).

Routes, policies and the upstream must agree on which resource a request names: a
`/public/../admin` or `/%61dmin` that matched a `/public` route but reached `/admin`
upstream would walk past every path rule. So, like Envoy's normalize_path and nginx's
location matching, the path is normalized once and the normalized form is both matched
and forwarded:

- percent-encoded unreserved characters (ALPHA DIGIT - . _ ~) are decoded, other
  percent-encodings get upper-case hex; a malformed one (%zz, a trailing %) is an error;
- "." and ".." segments are removed (remove_dot_segments; ".." never climbs above /).

Encoded "/" (%2F) and "\\" (%5C) stay encoded: decoding them would change the segment
structure the client sent. Repeated slashes are kept (they are distinct paths).
"""

from __future__ import annotations

_HEX = b"0123456789abcdefABCDEF"
_UNRESERVED = frozenset(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


class BadPath(ValueError):
    """A path with malformed percent-encoding."""


def needs_normalizing(path: bytes) -> bool:
    # find(), not `in`: CPython's bytes.__contains__ first tries the operand as an int
    # and builds (then drops) a TypeError for a bytes operand, ~10x the cost per request.
    return path.find(b"%") >= 0 or path.find(b"/.") >= 0


def _decode_unreserved(path: bytes) -> bytes:
    out = bytearray()
    i = 0
    n = len(path)
    while True:
        j = path.find(b"%", i)
        if j < 0:
            out += path[i:]
            return bytes(out)
        out += path[i:j]
        pair = path[j + 1:j + 3]
        if len(pair) != 2 or pair[0] not in _HEX or pair[1] not in _HEX:
            raise BadPath("malformed percent-encoding in path")
        byte = int(pair, 16)
        if byte in _UNRESERVED:
            out.append(byte)
        else:
            out += b"%" + pair.upper()
        i = j + 3
        if i >= n:
            return bytes(out)


def _remove_dot_segments(path: bytes) -> bytes:
    segments = path.split(b"/")
    out: list[bytes] = []
    for seg in segments[1:]:
        if seg == b".":
            continue
        if seg == b"..":
            if out:
                out.pop()
            continue
        out.append(seg)
    # A trailing "." or ".." names a directory: keep the final slash.
    if segments[-1] in (b".", b".."):
        out.append(b"")
    return b"/" + b"/".join(out)


def normalize_path(path: bytes) -> bytes:
    """The normalized form of an origin-form path (starting with "/"). Raises BadPath."""
    if b"%" in path:
        path = _decode_unreserved(path)
    if b"/." in path:
        path = _remove_dot_segments(path)
    return path
