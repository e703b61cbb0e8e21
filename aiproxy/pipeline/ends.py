"""The two ends of an exchange and the exchange as they see it, as compiled base classes.

exchange.py documents the interfaces. These classes declare their per-request methods
(ends.pxd) so compiled code calls them in C through the class's method table, with no
attribute lookup per call. An HTTP/1.1 connection and upstream connection (compiled)
override them in C; HTTP/2 streams (Python subclasses) override them in Python and
are called through the same declaration.

The module imports nothing: the protocols and the exchange cimport it, and a cimport
imports its module first.
"""

from __future__ import annotations

from typing import Any

# How an upstream frames the response body it hands on (on_upstream_head's `mode`).
BODY_NONE = 0
BODY_LENGTH = 1
BODY_CHUNKED = 2
BODY_UNTIL_CLOSE = 3
BODY_TUNNEL = 4


def forwarded_lines(peer: bytes, scheme: bytes) -> bytes:
    """X-Forwarded-For and X-Forwarded-Proto for a client without an X-Forwarded-For of
    its own: the same for every request on a connection, so made once."""
    return b"X-Forwarded-For: " + peer + b"\r\nX-Forwarded-Proto: " + scheme + b"\r\n"


def response_version(resp: Any) -> int:
    """The version a forwarded response's Via names: an HTTP/1.x upstream's head
    (h1.ResponseHead) carries it; an HTTP/2 upstream's (fields.H2ResponseHead) is 2."""
    return getattr(resp, "version", 20)


class ServerCore:
    """What the per-request path reads of the server (app.ProxyServer is the subclass):
    C fields, so a connection or exchange reads them without an attribute lookup."""

    # drain_expired: the drain deadline has passed and the connections left are being
    # cut: what they lose is the proxy's doing, not the client's.
    __slots__ = ("runtime", "telemetry", "draining", "drain_expired")


class Reporter:
    """What ends an exchange's life: telemetry.recorder.Telemetry is the subclass."""

    __slots__ = ()

    def exchange_done(self, ex: Any) -> None:
        raise NotImplementedError

    def rejected(self, peer: bytes, status: int, reason: str, bytes_in: int,
                 bytes_out: int, protocol: str = "HTTP/1.1") -> None:
        """A message refused before it became a request (it could not be framed, or its
        head did not arrive in time): answered `status` and the connection closed; an
        HTTP/2 one (`protocol`), its stream reset."""


class Downstream:
    """The client side: an HTTP/1.1 connection or one HTTP/2 stream."""

    # views_to: the client transport an HTTP/1.1 upstream may write views of its read
    # slab to (send_body() writes what it gets at once), or None: body as bytes.
    __slots__ = ("loop", "server", "peer", "scheme", "forwarded", "views_to")

    def send_response(self, ex: Any, resp: Any, mode: int) -> bool:
        raise NotImplementedError

    def send_body(self, data: Any) -> None:
        raise NotImplementedError

    def take_back_response(self) -> bool:
        """Drop the response head send_response() took, if no byte of the response
        has gone out yet (HTTP/1.1 holds the head for the first body bytes): True if
        so, and the exchange may answer otherwise (a 502, or a retry)."""
        return False

    def flush(self) -> None:
        raise NotImplementedError

    def send_end(self, trailers: Any) -> None:
        raise NotImplementedError

    def exchange_done(self, ex: Any, keep_alive: bool) -> None:
        raise NotImplementedError

    def pause(self, reason: int) -> None:
        raise NotImplementedError

    def resume(self, reason: int) -> None:
        raise NotImplementedError

    def output_paused(self) -> bool:
        """Whether writes to the client are paused: the exchange then holds its upstream."""
        raise NotImplementedError

    def response_backlog(self) -> int:
        """Bytes of this response the proxy holds, waiting for the client (for its
        flow-control window, or in a transport buffer of its own): an HTTP/2 upstream
        stream's window grows only while this stays 0 and output_paused() is False."""
        return 0

    def window_share(self) -> Any:
        """The h2_output.WindowShare the windows of this client's HTTP/2 upstream streams
        grow into together, or None: one exchange at a time, bounded per stream."""
        return None


class Upstream:
    """The origin side: an HTTP/1.1 connection or one HTTP/2 stream."""

    __slots__ = ()

    def start(self, exchange: Any) -> None:
        raise NotImplementedError

    def send_body(self, pieces: Any) -> None:
        raise NotImplementedError

    def end_body(self) -> None:
        raise NotImplementedError

    def usable(self) -> bool:
        raise NotImplementedError

    def pause(self) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class ExchangeBase:
    """What an upstream reads and calls on its exchange (the Exchange is the only
    subclass; its other fields and methods are in exchange.py)."""

    __slots__ = ("down", "method", "up_chunked")

    def h1_request_head(self, pool: Any) -> bytes:
        raise NotImplementedError

    def on_upstream_head(self, resp: Any, mode: int) -> None:
        raise NotImplementedError

    def on_upstream_body(self, data: Any) -> None:
        raise NotImplementedError

    def on_upstream_end(self, trailers: Any = None) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        raise NotImplementedError
