"""The Location of a route's redirect (`[[routes]] redirect = {...}`): the request's URL
with the parts the route sets replaced, as nginx's `return 301 https://$host$request_uri`
or Envoy's redirect action build it."""

from __future__ import annotations

from urllib.parse import quote_from_bytes

from aiproxy.config.address import split_authority
from aiproxy.config.schema import Redirect

DEFAULT_PORTS = {b"http": b"80", b"https": b"443"}
# RFC 3986 3.3 / 3.4: what a path or query may hold as is; '%' too, so the request's own
# escapes stay as they were. Anything else (a space, a byte over 0x7f that the request
# line carried) is percent-encoded: a field value must not carry it raw.
_PATH_SAFE = "/:@!$&'()*+,;=-._~%"
_QUERY_SAFE = _PATH_SAFE + "?"


def location(r: Redirect, scheme: bytes, authority: bytes | None, path: bytes,
             query: bytes, path_prefix: bytes | None) -> bytes | None:
    """The Location for a request to `scheme`://`authority``path`?`query` (query
    without its '?'). None when the URL needs a host the request did not name."""
    if r.path is not None:
        new_path, mark, new_query = r.path.partition(b"?")
        if mark:
            query = new_query
        path = new_path
    elif r.prefix_rewrite is not None and path_prefix is not None:
        path = r.prefix_rewrite + path[len(path_prefix):]
    elif path[:1] != b"/":  # OPTIONS *
        path = b"/"
    if r.strip_query and (r.path is None or b"?" not in r.path):
        query = b""
    tail = quote_from_bytes(path, _PATH_SAFE).encode("ascii")
    if query:
        tail += b"?" + quote_from_bytes(query, _QUERY_SAFE).encode("ascii")
    new_scheme = r.scheme or scheme
    host, port = split_authority(authority) if authority else (None, None)
    if r.host is not None:
        host, port = r.host, None  # another host: its scheme's port unless one is set
    elif r.scheme is not None and r.scheme != scheme:
        port = None  # http -> https: the request's port was the other scheme's
    if r.port is not None:
        port = b"%d" % r.port
    if host is None:
        if r.scheme is not None or r.port is not None:
            return None
        # Relative (RFC 9110 10.2.2). One leading '/': "//host/..." would name a host.
        return b"/" + tail.lstrip(b"/")
    if port is not None and port != DEFAULT_PORTS.get(new_scheme):
        host += b":" + port
    return new_scheme + b"://" + host + tail
