# cython: binding=False
"""HTTP/1.1 client side of the proxy: one upstream connection, driven by an Exchange.

The connection parses the response head and frames the body (Content-Length,
chunked, or read-until-close) and hands the pieces to its exchange:
  on_upstream_head(resp, mode), on_upstream_informational(resp),
  on_upstream_body(data), on_upstream_end(), on_upstream_failed(status, code, message),
  on_upstream_tunnel_data(data), on_upstream_pause_writing(), on_upstream_resume_writing().

Reads land in a slab of the process's buffer pool (aiproxy/_fast/bufpool.pyx) and
are parsed there. When the exchange's downstream takes views (an HTTP/1.1 client
connection: its `views_to` transport), on_upstream_body gets a memoryview of the slab,
valid only during the call: whoever keeps body bytes past it must copy them. The
slab goes back to the pool with lend() once the downstream's transport has sent
what it took from it. Other downstreams (HTTP/2 streams queue DATA under flow
control) get bytes.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiproxy._fast.bufpool import POOL, copy_out
from aiproxy._fast.clock import event_begin, event_end
from aiproxy._fast.h1 import ChunkedDecoder, ParseError, chunk_size_line, parse_response
from aiproxy._fast.sendnow import Sender, closed_unsent, sent_mark, unread
from aiproxy.pipeline.ends import (
    BODY_CHUNKED,
    BODY_LENGTH,
    BODY_NONE,
    BODY_TUNNEL,
    BODY_UNTIL_CLOSE,
    Upstream,
)

if TYPE_CHECKING:
    from aiproxy.routing.pool import Pool

_IDLE = 0
_HEAD = 1
_BODY = 2
_TUNNEL = 3
_CLOSED = 4

# Body bytes up to this size go to the client as a copy, not as a view of the read slab:
# copying a small body costs less than making and releasing a memoryview, and a write
# the client's socket cannot take at once then parks no slab (bufpool.pyx).
SMALL_COPY = 2048


def keep_alive_hint(value: bytes) -> tuple[float, int]:
    """(timeout seconds, max requests) of a `Keep-Alive: timeout=5, max=100` response
    field, -1 for a parameter absent or not a number."""
    timeout = -1.0
    left = -1
    for part in value.split(b","):
        name, _, arg = part.partition(b"=")
        name = name.strip().lower()
        arg = arg.strip()
        if arg.isdigit():
            if name == b"timeout":
                timeout = float(arg)
            elif name == b"max":
                left = int(arg)
    return timeout, left


class H1UpstreamCore(Upstream):
    """The protocol (compiled as a C class: h1_upstream.pxd). uvloop, and its TLS layer,
    take any protocol with get_buffer() that is not an asyncio.Protocol as a buffered one."""

    __slots__ = ("pool", "transport", "exchange", "state", "buf", "mode", "remaining",
                 "decoder", "no_body", "keep_alive", "broken", "requests", "idle_since",
                 "received", "reading_paused", "chunked", "slab", "views_to", "viewed",
                 "max_head", "max_headers", "tx", "tx_closing", "fd", "ka_idle", "unsent")

    # send_body() hands what it gets to the transport at once and keeps no reference:
    # the client connection may pass views of its read slab.
    takes_views = True

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.exchange: Any = None
        self.state = _IDLE
        self.buf = bytearray()
        self.mode = BODY_NONE
        self.remaining = 0
        self.decoder: ChunkedDecoder | None = None
        self.no_body = False
        self.keep_alive = True
        self.broken = False
        self.requests = 0
        self.idle_since = 0.0
        self.received = False
        self.unsent = False
        self.reading_paused = False
        self.chunked = False
        self.slab: bytearray | None = None
        # The downstream transport body views go to, or None: body as bytes.
        self.views_to: asyncio.Transport | None = None
        self.viewed = False  # whether _head passed on a view of the slab it parsed
        self.max_head = pool.max_head
        self.max_headers = pool.max_headers
        self.fd = -1  # the socket's, for reusable()'s peek; -1 once it is gone
        # Idle seconds after which the upstream's Keep-Alive field says not to reuse
        # this connection (-1: it said nothing).
        self.ka_idle = -1.0

    # -- driven by the exchange -------------------------------------------------

    def start(self, exchange: Any) -> None:
        self.exchange = ex = exchange
        self.state = _HEAD
        self.no_body = ex.method == b"HEAD"
        self.chunked = ex.up_chunked
        self.received = False
        self.requests += 1
        down = ex.down
        self.views_to = down.views_to
        tx = self.tx
        if tx.tls and self.fd >= 0:
            # The TLS layer writes through its own TCP transport, not tx's send(): the
            # proof that none of the request left comes from the kernel instead. The
            # socket's count of bytes sent did not move across the write and the socket
            # is closed (an RST came in): nothing written now, nor after, reached the peer.
            mark = sent_mark(self.fd)
            tx.write(ex.h1_request_head(self.pool))
            self.unsent = closed_unsent(self.fd, mark)
            return
        tx.write(ex.h1_request_head(self.pool))
        # The connection was gone (an RST that came after the pool's peek) before any
        # byte of this request went out: it never reached the upstream.
        self.unsent = tx.reset != 0

    def send_body(self, pieces: tuple[bytes, ...] | list[bytes]) -> None:
        if not self.chunked:
            self.tx.writelines(pieces)
            return
        out = []
        for piece in pieces:
            if piece:  # an empty one would be the last chunk: the body cut short
                out += (chunk_size_line(len(piece)), piece, b"\r\n")
        self.tx.writelines(out)

    def end_body(self) -> None:
        if self.chunked:
            # An HTTP/2 client's request trailers are dropped, as an HTTP/1.1 client's
            # are (and as nginx and Envoy do): some servers (aiohttp) read a trailer
            # section into the next request's header section, which on a pooled
            # connection is another client's.
            self.tx.write(b"0\r\n\r\n")

    def tunnel_write(self, data: bytes) -> None:
        if self.transport is not None:
            self.tx.through(data)

    def tunnel_eof(self) -> bool:
        """Half-close towards the upstream; False if that is not possible."""
        t = self.transport
        if t is None or t.is_closing() or not t.can_write_eof():
            return False
        t.write_eof()
        return True

    def usable(self) -> bool:
        t = self.transport
        return (self.state == _IDLE and not self.broken and self.keep_alive
                and t is not None and not self.tx_closing())

    def reusable(self, now: float) -> bool:
        """usable(), and the upstream has not closed it unseen: no EOF (or byte) is
        waiting in the socket, and it has not been idle past the Keep-Alive timeout
        the upstream announced."""
        if not self.usable():
            return False
        if self.ka_idle >= 0 and now - self.idle_since >= self.ka_idle:
            return False
        return self.fd < 0 or not unread(self.fd)

    def park(self, now: float) -> None:
        self.exchange = None
        self.views_to = None  # an idle connection keeps no client transport alive
        self.idle_since = now
        if self.reading_paused:
            self.resume()

    def pause(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.broken = True
        self.exchange = None
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.broken = True
        self.exchange = None
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio.Protocol -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # Request bytes go to the socket at once when nothing is queued (sendnow.pyx).
        self.tx = Sender(transport)
        self.tx_closing = transport.is_closing  # bound once: usable() runs per request
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.fd = sock.fileno()
        self.pool.open_count += 1

    def get_buffer(self, sizehint: int) -> bytearray:
        slab = self.slab
        if slab is None:
            slab = self.slab = POOL.get()
        return slab

    def buffer_updated(self, nbytes: int) -> None:
        slab = self.slab
        self.slab = None
        self.received = True
        views_to = self.views_to
        event_begin()
        try:
            if self.state == _BODY:
                if self.mode == BODY_CHUNKED:
                    # Decoded in place: each piece is copied out once, the read is not.
                    views_to = None
                    self._chunked(slab, nbytes)
                elif views_to is None or nbytes <= SMALL_COPY:
                    views_to = None
                    self._body(copy_out(slab, 0, nbytes))
                else:
                    self._body(memoryview(slab)[:nbytes])
            elif self.state == _HEAD:
                if self.buf:
                    views_to = None  # copied into buf
                    self.buf += memoryview(slab)[:nbytes]
                    self._head(None, 0)
                else:
                    self.viewed = False
                    self._head(slab, nbytes)
                    if not self.viewed:
                        views_to = None
            elif self.state == _TUNNEL:
                views_to = None
                self.exchange.on_upstream_tunnel_data(copy_out(slab, 0, nbytes))
            else:
                # Bytes on an idle connection: the peer is out of sync; never reuse it.
                views_to = None
                self.close()
        finally:
            event_end()
            POOL.lend(slab, views_to)

    def eof_received(self) -> bool:
        self.keep_alive = False
        if self.state == _BODY and self.mode == BODY_UNTIL_CLOSE:
            self._finish()
        elif self.state == _TUNNEL:
            ex = self.exchange
            if ex is not None:
                ex.on_upstream_tunnel_eof()
                return True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.tx is not None:
            self.tx.detach()  # uvloop closes the socket when this returns
        self.fd = -1
        if self.slab is not None:  # get_buffer without buffer_updated: a failed read
            POOL.put(self.slab)
            self.slab = None
        self.pool.open_count -= 1
        state = self.state
        self.state = _CLOSED
        self.broken = True
        ex = self.exchange
        self.exchange = None
        if state == _IDLE:
            self.pool.discard(self)
        elif ex is not None:
            truncated = False
            if state == _BODY and self.mode == BODY_UNTIL_CLOSE and exc is None:
                # A body that ends with the connection ends in eof_received(). Over TLS
                # that is a close_notify; a bare TCP close arrives here alone, and may be
                # a truncation (RFC 9112 9.8): not a complete response.
                if self.pool.cluster_cfg.tls is None:
                    self.exchange = ex
                    self.state = _BODY
                    self._finish()
                    return
                truncated = True
            if state == _TUNNEL:
                ex.on_upstream_tunnel_closed()
                return
            if state == _HEAD and self.unsent:
                # Safe to replay whatever the method (Exchange: NEVER_PROCESSED).
                ex.on_upstream_failed(502, "upstream_not_sent",
                                      f"upstream connection lost before the request was sent: {exc}")
                return
            if truncated:
                reason = ("upstream closed the TLS connection without close_notify: "
                          "the response body may be truncated")
            elif exc is None:
                reason = "upstream closed the connection"
            else:
                reason = f"upstream connection lost: {exc}"
            ex.on_upstream_failed(502, "upstream_reset", reason)

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.on_upstream_pause_writing()

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.on_upstream_resume_writing()

    # -- response parsing ---------------------------------------------------------

    def _fail(self, code: str, message: str) -> None:
        ex = self.exchange
        self.abort()
        self.state = _CLOSED
        if ex is not None:
            ex.on_upstream_failed(502, code, message)

    def _head(self, slab: bytearray | None, nbytes: int) -> None:
        """Parse from self.buf, or (self.buf empty) in place from slab[:nbytes]."""
        max_head = self.max_head
        start = 0
        declared_body = False
        while True:
            try:
                if slab is None:
                    resp = parse_response(self.buf, max_head, self.max_headers)
                elif start:
                    resp = parse_response(memoryview(slab)[start:nbytes], max_head,
                                          self.max_headers)
                else:
                    resp = parse_response(slab, max_head, self.max_headers, nbytes)
            except ParseError as exc:
                self._fail("upstream_bad_response", exc.message)
                return
            if resp is None:
                if slab is not None:
                    self.buf += memoryview(slab)[start:nbytes]
                if len(self.buf) > max_head:
                    self._fail("upstream_bad_response", "response header section too large")
                return
            if slab is None:
                del self.buf[:resp.consumed]
            else:
                start += resp.consumed
            status = resp.status
            if status < 200 and status != 101:
                if resp.content_length > 0 or resp.chunked:
                    declared_body = True
                self.exchange.on_upstream_informational(resp)
                if self.exchange is None:
                    return
                continue
            break
        if status == 204 and (resp.content_length > 0 or resp.chunked):
            declared_body = True
        # A 1xx or 204 declaring a body breaks a MUST NOT (RFC 9110 8.6, RFC 9112 6.1). The
        # response ends at its head (RFC 9112 6.3), but the upstream may send the body it
        # declared, which the next request on this connection would read as its response.
        self.keep_alive = resp.keep_alive and not declared_body
        if self.keep_alive and resp.keep_alive_field:  # no field scan when there is none
            self._keep_alive_hint(resp.get(b"keep-alive"))
        if status == 101:
            mode = BODY_TUNNEL
        elif self.no_body or status == 204 or status == 304:
            mode = BODY_NONE
        elif resp.chunked:
            mode = BODY_CHUNKED
            self.decoder = ChunkedDecoder(max_head, self.max_headers)
        elif resp.content_length >= 0:
            mode = BODY_LENGTH
            self.remaining = resp.content_length
        else:
            mode = BODY_UNTIL_CLOSE
            self.keep_alive = False
        self.mode = mode
        if slab is None:
            rest = bytes(self.buf)
            self.buf.clear()
        elif start == nbytes:
            rest = b""
        elif mode == BODY_TUNNEL or self.views_to is None or nbytes - start <= SMALL_COPY:
            rest = copy_out(slab, start, nbytes)
        else:
            self.viewed = True
            rest = memoryview(slab)[start:nbytes]
        ex = self.exchange
        if mode == BODY_TUNNEL:
            self.state = _TUNNEL
            self.keep_alive = False
            ex.on_upstream_head(resp, mode)
            if rest and self.exchange is not None:
                self.exchange.on_upstream_tunnel_data(rest)
            return
        self.state = _BODY
        ex.on_upstream_head(resp, mode)
        if self.exchange is None:
            return
        if mode == BODY_NONE or (mode == BODY_LENGTH and self.remaining == 0):
            if rest:
                self.broken = True
            self._finish()
            return
        if rest:
            self._body(rest)
        if self.exchange is ex:
            ex.flush()

    def _keep_alive_hint(self, value: bytes) -> None:
        # Keep-Alive (RFC 2068 19.7.1.1, gone from RFC 9112 but still sent by Apache,
        # Node and others) says when the upstream will close an idle connection. A
        # request sent as it does is lost, and a POST cannot be replayed: retire the
        # connection 1 s before (half the timeout when it is under 2 s; undici's rule).
        timeout, left = keep_alive_hint(value)
        if timeout >= 0:
            self.ka_idle = timeout - min(1.0, timeout / 2)
        if left == 0:  # no more requests on this connection
            self.keep_alive = False

    def _body(self, data: bytes) -> None:
        mode = self.mode
        ex = self.exchange
        if mode == BODY_LENGTH:
            n = len(data)
            if n < self.remaining:
                self.remaining -= n
                ex.on_upstream_body(data)
                return
            if n > self.remaining:
                self.broken = True  # bytes past the declared length: never reuse
                data = data[: self.remaining]
            self.remaining = 0
            if data:
                ex.on_upstream_body(data)
            if self.exchange is not None:
                self._finish()
        elif mode == BODY_CHUNKED:
            self._chunked(data, len(data))
        else:
            ex.on_upstream_body(data)

    def _chunked(self, data: Any, n: int) -> None:
        """n bytes of a chunked body: data[:n], a read slab (decoded in place) or bytes."""
        decoder = self.decoder
        try:
            if type(data) is bytearray:
                pieces = decoder.feed_slab(data, n)
            else:
                pieces = decoder.feed(data)
        except ParseError as exc:
            self._fail("upstream_bad_response", f"invalid chunked body: {exc.message}")
            return
        ex = self.exchange
        for piece in pieces:
            ex.on_upstream_body(piece)
            if self.exchange is None:
                return
        if decoder.done:
            if decoder.tail < n:
                self.broken = True
            self._finish()

    def _finish(self) -> None:
        ex = self.exchange
        self.state = _IDLE
        self.decoder = None
        if ex is not None:
            ex.on_upstream_end()


# The C class itself, not a Python subclass mixing in asyncio.BufferedProtocol: on an
# exact C type a cpdef method does not check for a Python override on every call.
H1UpstreamConnection = H1UpstreamCore
