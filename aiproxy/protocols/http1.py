# cython: binding=False
"""Downstream HTTP/1.1: one protocol instance per client connection.

It parses request heads (pipelined requests are answered in order, one
exchange at a time), hands body bytes to the current Exchange, and owns the
connection-level timers: header read, keep-alive idle and request body idle.

Reads land in a slab of the process's buffer pool (aiproxy/_fast/bufpool.pyx),
taken in get_buffer and back in the pool when buffer_updated returns: a request
head is parsed in place; bytes that must wait (a partial head, pipelined
requests) are copied to `buf`; request body bytes leave as bytes (the exchange
keeps them for replay) unless they go to an HTTP/1.1 upstream: then as views of
the slab, which returns to the pool once that upstream's transport has sent them.
Response body bytes from an HTTP/1.1 upstream arrive as views of the upstream's
slab (this connection's transport is its `views_to`) and go straight to it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import socket
import struct
from typing import TYPE_CHECKING, Any

from aiproxy._fast.bufpool import POOL, copy_out
from aiproxy._fast.clock import event_begin, event_end, event_now, monotonic
from aiproxy._fast.h1 import (
    ParseError,
    ResponseHead,
    chunk_frame,
    chunk_size_line,
    parse_request,
)
from aiproxy._fast.sendnow import Sender
from aiproxy.pipeline.ends import BODY_NONE, Downstream, forwarded_lines, response_version
from aiproxy.pipeline.exchange import Exchange, joined, serialize_without
from aiproxy.protocols import h2_server, replies
from aiproxy.protocols.fields import MalformedHead, h2_request_head
from aiproxy.telemetry.recorder import server_timing

if TYPE_CHECKING:
    from aiproxy.server.app import ProxyServer

log = logging.getLogger("aiproxy.http1")

F_HOP = 1  # header flags from aiproxy/_fast/h1.pxd
F_CONTENT_LENGTH = 2
F_HOST = 8
F_NAMED_BY_CONNECTION = 512
CRLF = b"\r\n"
LAST_CHUNK = b"0\r\n\r\n"
P_PIPELINE = 4
LINGER_SECONDS = 2.0
RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a RST
SMALL_BODY = 2048  # bodies up to this size are copied behind the head (one write)
STATUS_200 = b"HTTP/1.1 200 OK\r\n"
# Content-Length lines of the sizes seen (bounded): bytes %-formatting costs more per
# response than the lookup.
CONTENT_LENGTH_LINES: dict[int, bytes] = {}
CONTENT_LENGTH_CACHE = 4096
# The lines for 0..SMALL_LENGTHS-1, made once: an index, not a PyLong and a dict lookup.
SMALL_LENGTHS = 1024
CONTENT_LENGTH_SMALL: tuple = tuple(b"Content-Length: %d\r\n" % n for n in range(SMALL_LENGTHS))


def content_length_line(n: int) -> bytes:
    """The Content-Length field line for a length n >= 0."""
    if n < SMALL_LENGTHS:
        return CONTENT_LENGTH_SMALL[n]
    line = CONTENT_LENGTH_LINES.get(n)
    if line is None:
        line = b"Content-Length: %d\r\n" % n
        if len(CONTENT_LENGTH_LINES) < CONTENT_LENGTH_CACHE:
            CONTENT_LENGTH_LINES[n] = line
    return line


_BASE64URL = (b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def valid_h2_settings(value: bytes) -> bool:
    """HTTP2-Settings (RFC 7540 3.2.1): a SETTINGS payload in base64url without padding,
    whose entries are all values a SETTINGS frame may carry (RFC 9113 6.5.2)."""
    if value.translate(None, _BASE64URL) or len(value) % 4 == 1:
        return False
    try:
        raw = base64.urlsafe_b64decode(value + b"=" * (-len(value) % 4))
    except (binascii.Error, ValueError):
        return False
    if len(raw) % 6:
        return False
    for i in range(0, len(raw), 6):
        ident = int.from_bytes(raw[i:i + 2], "big")
        n = int.from_bytes(raw[i + 2:i + 6], "big")
        if ((ident == 0x2 and n > 1) or (ident == 0x4 and n > 0x7FFFFFFF)
                or (ident == 0x5 and not 0x4000 <= n <= 0xFFFFFF)
                or (ident == 0x9 and n > 1)):  # RFC 9218 2.1
            return False
    return True


def _named_by_connection(head: Any, lname: bytes) -> bool:
    return any(flags & F_NAMED_BY_CONNECTION and name.lower() == lname
               for (name, _), flags in zip(head.headers(), head.header_flags(), strict=True))


class H1ConnectionCore(Downstream):
    """The protocol (compiled as a C class: http1.pxd). uvloop, and its TLS layer, take
    any protocol with get_buffer() that is not an asyncio.Protocol as a buffered one."""

    __slots__ = ("transport", "buf", "exchange", "served",
                 "pause_mask", "writing_paused", "closed", "lingering", "tunnel",
                 "timer", "head_started", "idle_since", "in_process", "client_eof",
                 "head_out", "chunked_out", "until_close_out", "h2c", "switched", "slab", "held", "held_status",
                 "held_extra", "held_drop", "tx")

    def __init__(self, server: ProxyServer, h2c: bool = False) -> None:
        self.server = server
        self.h2c = h2c
        self.switched = False
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.exchange: Exchange | None = None
        self.peer = b""
        self.forwarded = b""
        self.served = 0
        self.pause_mask = 0
        self.writing_paused = False
        self.closed = False
        self.lingering = False
        self.tunnel = False
        self.timer: asyncio.TimerHandle | None = None
        self.head_started = 0.0
        self.idle_since = 0.0
        self.drain_idle = 0.0
        self.in_process = False
        self.client_eof = False
        self.scheme = b"http"
        self.head_out = b""  # a response head not sent yet, as bytes; or held:
        self.held: ResponseHead | None = None  # held.compose(held_status, None, held_extra, ...)
        self.held_status: bytes | None = None
        self.held_extra: tuple | None = None
        self.held_drop = 0
        self.chunked_out = False
        self.until_close_out = False  # the response body ends with the connection
        self.slab: bytearray | None = None

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = self.views_to = transport  # type: ignore[assignment]
        # Response bytes go to the socket at once when nothing is queued (sendnow.pyx).
        self.tx = Sender(transport)
        if not self.peer:  # else a PROXY protocol header named the client
            peer = transport.get_extra_info("peername")
            self.peer = peer[0].encode() if peer else b""
        if transport.get_extra_info("sslcontext") is not None:
            self.scheme = b"https"
        self.forwarded = forwarded_lines(self.peer, self.scheme)
        self.server.connections.add(self)
        self.head_started = self.idle_since = monotonic()
        self._arm(self.server.runtime.min_timeout)

    def get_buffer(self, sizehint: int) -> bytearray:
        slab = self.slab
        if slab is None:
            slab = self.slab = POOL.get()
        return slab

    def buffer_updated(self, nbytes: int) -> None:
        slab = self.slab
        self.slab = None
        lend_to = None
        now = event_begin()
        try:
            if (self.exchange is None and not self.buf and not self.in_process
                    and not self.tunnel and not self.lingering
                    and not (self.h2c and not self.served)):
                # A new request head: parsed in place, only the rest is copied.
                self.head_started = now
                self.in_process = True
                try:
                    started = self._start_exchange(slab, nbytes)
                finally:
                    self.in_process = False
                if started and self.buf:
                    self._process()
                return
            ex = self.exchange
            up = ex.upstream if ex is not None else None
            if (up is not None and getattr(up, "takes_views", False) and ex.reading_body
                    and not self.buf and not self.tunnel and not self.lingering):
                # Request body for an HTTP/1.1 upstream: its transport gets views of the
                # slab (the exchange copies what it keeps for replay or while pending).
                lend_to = up.transport
                data = memoryview(slab)[:nbytes]
                n = ex.feed_body(data)
                if n < nbytes and not self.closed:
                    self.buf += data[n:]
                    self._process()
            else:
                self.data_received(copy_out(slab, 0, nbytes))
        finally:
            event_end()
            POOL.lend(slab, lend_to)

    def _release_slab(self) -> None:
        # get_buffer() not followed by buffer_updated(): the read failed or hit EOF.
        if self.slab is not None:
            POOL.put(self.slab)
            self.slab = None

    def data_received(self, data: bytes) -> None:
        if self.tunnel:
            self._tunnel_in(data)
            return
        if self.lingering:
            return
        ex = self.exchange
        if ex is not None and ex.reading_body and not self.buf:
            n = ex.feed_body(data)
            if n < len(data) and not self.closed:
                self.buf += data[n:]
                self._process()
            return
        if ex is None and not self.buf:
            self.head_started = monotonic()
        self.buf += data
        self._process()

    def eof_received(self) -> bool:
        self.client_eof = True
        self._release_slab()
        # Over TLS a half-close cannot be kept (asyncio closes the transport, and warns
        # when asked otherwise): True only on plain TCP.
        half_open = self.scheme != b"https"
        if self.tunnel:
            self.exchange.tunnel_client_eof()
            return half_open
        ex = self.exchange
        if ex is not None and not ex.reading_body and not self.lingering:
            if self.server.runtime.http.ignore_client_abort or ex.head.upgrade is not None:
                # A half-closed client still gets its response; an Upgrade's FIN is the
                # end of what it sends through the tunnel to be.
                return half_open
            # As nginx (proxy_ignore_client_abort off): a client that closed its side
            # has given up (the openai SDK's stream.close(), say); the upstream is let
            # go now (499) rather than at the next write, which may be minutes away.
            self.exchange = None
            ex.on_client_lost()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.tx is not None:
            self.tx.detach()  # uvloop closes the socket when this returns
        self._release_slab()
        if self.switched:
            return
        self.closed = True
        self.server.connections.discard(self)
        self._cancel_timer()
        ex = self.exchange
        if ex is not None:
            self.exchange = None
            ex.on_client_lost()

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.exchange is not None:
            self.exchange.on_client_pause_writing()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.exchange is not None:
            self.exchange.on_client_resume_writing()

    # -- request heads ------------------------------------------------------------------

    def _process(self) -> None:
        if self.in_process:
            return
        self.in_process = True
        try:
            while not self.closed and not self.lingering and not self.tunnel:
                ex = self.exchange
                if ex is None:
                    if not self.buf or not self._start_exchange():
                        break
                elif ex.reading_body:
                    if not self.buf:
                        break
                    data = bytes(self.buf)
                    self.buf.clear()
                    n = ex.feed_body(data)
                    if n < len(data) and not self.closed:
                        self.buf += data[n:]
                    if n == 0:
                        break
                else:
                    # The rest is pipelined: it waits for the current response.
                    if len(self.buf) > self.server.runtime.max_header_bytes:
                        self.pause(P_PIPELINE)
                    break
        finally:
            self.in_process = False

    def _start_exchange(self, slab: bytearray | None = None, nbytes: int = 0) -> bool:
        """Parse a request head from self.buf, or (self.buf empty) from slab[:nbytes]."""
        rt = self.server.runtime
        if slab is None and self.h2c and not self.served and self.buf[:1] == b"P":
            if h2_server.preface_pending(self.buf):
                return False
            if h2_server.is_preface(self.buf):
                self._switch(h2_server.H2ServerConnection(self.server, self.scheme))
                return False
        try:
            if slab is None:
                head = parse_request(self.buf, rt.max_header_bytes, rt.max_request_line_bytes,
                                     rt.max_headers)
            else:
                head = parse_request(slab, rt.max_header_bytes, rt.max_request_line_bytes,
                                     rt.max_headers, nbytes)
        except ParseError as exc:
            self.reject(exc.status, exc.message, nbytes if slab is not None else len(self.buf))
            return False
        if head is None:
            if slab is not None:
                self.buf += memoryview(slab)[:nbytes]
            return False
        if slab is None:
            del self.buf[:head.consumed]
        elif head.consumed < nbytes:
            self.buf += memoryview(slab)[head.consumed:nbytes]  # body or pipelined requests
        if self.h2c and head.upgrade is not None and self._upgrade_h2c(head):
            return False
        self.exchange = ex = Exchange.__new__(Exchange)
        ex.setup(self, head, self.head_started)
        ex.start()
        if not ex.finished and ex.deadline_at - monotonic() < self.server.runtime.min_timeout:
            # A grpc-timeout shorter than the timer period: wake up for it, or the
            # deadline would be seen up to min_timeout late.
            self._arm(max(ex.deadline_at - monotonic(), 0.001))
        return True

    def _upgrade_h2c(self, head: Any) -> bool:
        """RFC 7540 3.2 `Upgrade: h2c` (bodyless requests; others stay on HTTP/1.1)."""
        tokens = [t.strip().lower() for t in head.upgrade.split(b",")]
        settings = head.get_all(b"http2-settings")
        # Exactly one HTTP2-Settings field, named in Connection, or no upgrade (RFC 7540
        # 3.2.1).
        if (b"h2c" not in tokens or len(settings) != 1 or head.chunked
                or head.content_length > 0 or not valid_h2_settings(settings[0])
                or not _named_by_connection(head, b"http2-settings")):
            return False
        settings = settings[0]
        fields = [(b":method", head.method), (b":scheme", b"http"), (b":path", head.target)]
        if head.host is not None:
            fields.append((b":authority", head.host))
        try:
            h2head = h2_request_head(fields + head.fields(F_HOP | F_HOST), True)
        except MalformedHead:
            return False
        self.tx.through(b"HTTP/1.1 101 Switching Protocols\r\n"
                        b"Connection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
        self._switch(h2_server.H2ServerConnection(self.server, self.scheme,
                                                  upgrade=(h2head, settings)))
        return True

    def _switch(self, proto: asyncio.Protocol) -> None:
        """Hand the socket (and what was read past the HTTP/1.1 part) to HTTP/2."""
        self.switched = True
        self.closed = True
        self.tx.detach()  # the new protocol writes through the transport
        self._cancel_timer()
        self.server.connections.discard(self)
        data = bytes(self.buf)
        self.buf.clear()
        if self.pause_mask:
            self.pause_mask = 0
            self.transport.resume_reading()
        proto.peer = self.peer
        self.transport.set_protocol(proto)
        proto.connection_made(self.transport, data)

    def reject(self, status: int, message: str, received: int) -> None:
        """Answer a message that cannot be framed (`received` bytes of it read), then
        close."""
        log.info("rejecting request from %s: %d %s", self.peer.decode(), status, message)
        reply = replies.error_response(status, message)
        self.tx.through(reply)
        self.server.telemetry.rejected(self.peer, status, message, received, len(reply))
        self.linger()

    # -- called by the exchange ---------------------------------------------------------

    def exchange_done(self, ex: Exchange, keep_alive: bool) -> None:
        e = ex
        self.exchange = None
        self.served += 1
        if self.closed:
            return
        rt = self.server.runtime
        if (not keep_alive or self.server.draining or (self.client_eof and not self.buf)
                or (rt.max_keepalive_requests and self.served >= rt.max_keepalive_requests)):
            if e.req_done and not e.close_after and not self.buf:
                self.close()
            else:
                # More bytes may come (pipelined ones are here already): read and
                # dropped, not answered with a reset that could cut this response.
                self.linger()
            return
        if self.pause_mask:
            self.pause_mask = 0
            self.transport.resume_reading()
        self.idle_since = self.head_started = event_now()
        if self.buf:
            # Pipelined requests: a client that half-closed behind them (only reaching
            # here with ignore_client_abort) still gets an answer to each.
            self._process()
            if (self.client_eof and self.exchange is None and not self.closed
                    and not self.lingering):
                self.close()  # what is left is not a whole request, and no more can come
        elif not rt.keepalive_timeout_ms:
            self.close()

    def may_keep_alive(self) -> bool:
        """False when the connection closes after the current response regardless of the
        request: draining, or the response is the last max_keepalive_requests allows."""
        rt = self.server.runtime
        limit = rt.max_keepalive_requests
        return (not self.server.draining and rt.keepalive_timeout_ms > 0
                and not (limit and self.served + 1 >= limit))

    def pause(self, reason: int) -> None:
        if not self.pause_mask and not self.closed:
            self.transport.pause_reading()
        self.pause_mask |= reason

    def resume(self, reason: int) -> None:
        if self.pause_mask & reason:
            self.pause_mask &= ~reason
            if not self.pause_mask and not self.closed:
                self.transport.resume_reading()

    def output_paused(self) -> bool:
        return self.writing_paused

    def response_backlog(self) -> int:
        transport = self.transport
        return transport.get_write_buffer_size() if transport is not None else 0

    # -- the downstream side of an Exchange: writing the response --------------------

    def send_continue(self) -> None:
        self.tx.through(replies.CONTINUE_100)

    def send_informational(self, resp: Any) -> None:
        ex = self.exchange
        if ex is not None and ex.head.version >= 11:
            # RFC 9110 8.6: no Content-Length in a 1xx or 204 response; 7.6.3: a Via
            # on every message forwarded.
            via = self.server.runtime.via_lines.get(response_version(resp))
            self.tx.through(resp.serialize(
                b"HTTP/1.1 %d %s\r\n" % (resp.status, resp.reason), via or b"",
                F_HOP | F_CONTENT_LENGTH))

    def send_response(self, ex: Exchange, resp: Any, mode: int) -> bool:
        """Frame the response for this client; returns whether the connection stays open.

        The head is held until the first body bytes so both go out in one write."""
        e = ex  # typed Exchange (http1.pxd); Downstream's signature takes any object
        head = e.head
        rt = self.server.runtime
        if type(resp) is ResponseHead:  # from an HTTP/1.1 upstream: read in C
            r = resp
            status, reason, length, chunked = r.status, r.reason, r.content_length, r.chunked
        else:
            r = None
            status, reason = resp.status, resp.reason
            length, chunked = resp.content_length, resp.chunked
        # The added field lines, one slot each (None: not sent): see Head.compose.
        framing = timing = conn = None
        # The connection closes after this response if the request body is still arriving
        # (the rest of it is not read) or this is the last request allowed on it: say so.
        keep = head.keep_alive and e.req_done and self.may_keep_alive()
        drop = F_HOP | F_CONTENT_LENGTH
        if mode == BODY_NONE:
            # A 304's or a HEAD response's Content-Length is the length the body would
            # have: kept, as one field with one value (the upstream's may be a list or
            # repeated: RFC 9110 8.6). A 204 has none.
            if length >= 0 and status != 204:
                framing = content_length_line(length)
        elif length >= 0 and not chunked:
            framing = content_length_line(length)
        elif head.version >= 11:
            self.chunked_out = True
            framing = b"Transfer-Encoding: chunked\r\n"
        else:
            keep = False  # HTTP/1.0 client: the end of the body is the close
            self.until_close_out = True
        if rt.server_timing:
            timing = b"Server-Timing: " + server_timing(e) + CRLF
        if not keep:
            conn = b"Connection: close\r\n"
        elif head.version < 11:
            conn = b"Connection: keep-alive\r\n"
        if status == 200 and reason == b"OK":
            status_line = STATUS_200
        else:
            status_line = b"HTTP/1.1 %d %s\r\n" % (status, reason)
        via = rt.via_line(e.resp_version)
        route = e.route
        if route is not None and route.resp_edit:
            extra = (via, framing, timing, conn, route.resp_add_lines)
            if route.resp_remove:
                self.head_out = serialize_without(resp, status_line, joined(extra), drop,
                                                  route.resp_remove)
                return keep
        else:
            extra = (via, framing, timing, conn)
        if r is not None:
            # Composed with the first body bytes behind it: one buffer (_take_head).
            self.held = r
            self.held_status = status_line
            self.held_extra = extra
            self.held_drop = drop
        else:
            self.head_out = resp.serialize(status_line, joined(extra), drop)
        return keep

    def take_back_response(self) -> bool:
        if self.held is None and not self.head_out:
            return False
        self.held = None
        self.head_out = b""
        self.chunked_out = False
        self.until_close_out = False
        return True

    def _take_head(self, tail: Any = None) -> bytes:
        """The response head not sent yet (with tail, body bytes, behind it)."""
        r = self.held
        if r is not None:
            self.held = None
            return r.compose(self.held_status, None, self.held_extra, self.held_drop, tail)
        head = self.head_out
        self.head_out = b""
        return head if tail is None else head + tail

    def send_body(self, data: bytes) -> None:
        head_pending = self.held is not None or self.head_out
        if self.chunked_out:
            if type(data) is bytes and len(data) <= SMALL_BODY:
                if not data:  # a chunk of 0 would end the body
                    if head_pending:
                        self.tx.write(self._take_head())
                    return
                # A streamed event as one chunk in one buffer: one send, no iovec.
                frame = chunk_frame(data)
                self.tx.write(self._take_head(frame) if head_pending else frame)
            elif head_pending:
                self.tx.writelines((self._take_head(), chunk_size_line(len(data)), data, CRLF))
            else:
                self.tx.writelines((chunk_size_line(len(data)), data, CRLF))
        elif head_pending:
            if len(data) <= SMALL_BODY:
                # One buffer: write() is cheaper than writelines() for a small body.
                self.tx.write(self._take_head(data))
            else:
                self.tx.writelines((self._take_head(), data))
        else:
            self.tx.write(data)

    def flush(self) -> None:
        if self.held is not None or self.head_out:
            self.tx.write(self._take_head())

    def send_end(self, trailers: list[tuple[bytes, bytes]] | None) -> None:
        if self.chunked_out:
            self.chunked_out = False
            end = LAST_CHUNK
            ex = self.exchange
            if trailers and ex is not None and b"trailers" in (ex.head.get(b"te") or b""):
                end = b"0\r\n" + b"".join([b"%s: %s\r\n" % t for t in trailers]) + CRLF
            self.tx.write(self._take_head(end))
        else:
            self.flush()

    def send_error(self, ex: Exchange, status: int, message: str, code: str | None,
                   headers: list[tuple[bytes, bytes]] | None = None) -> bool:
        head = ex.head
        keep = head.keep_alive and ex.req_done and not ex.close_after and self.may_keep_alive()
        self.head_out = b""
        self.held = None
        self.chunked_out = False
        self.until_close_out = False
        self.tx.through(replies.error_response(
            status, message, code, close=not keep, head_only=ex.method == b"HEAD",
            keep_alive_10=keep and head.version < 11, headers=headers))
        return keep

    def abort_response(self) -> None:
        # A response cut short: closing is the only signal HTTP/1.1 has (a missing last
        # chunk or a short Content-Length body tells the client it is incomplete).
        if self.scheme == b"https" and not self.chunked_out and not self.closed:
            # Over TLS, without close_notify: a body that ends at the close (an HTTP/1.0
            # client's) would read as complete with it (RFC 9112 9.8). nginx, too, sends
            # none after an error.
            self.closed = True
            self._cancel_timer()
            self.transport.abort()
            return
        if self.until_close_out and not self.closed:
            # A body that ends with the connection is whole at a FIN (RFC 9112 8): only
            # an error of the connection tells the client otherwise. A reset is that
            # error over plain TCP, as a missing close_notify is over TLS.
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET_ON_CLOSE)
                except OSError:
                    pass  # the socket is going already: it cannot say more
            self.closed = True
            self._cancel_timer()
            self.transport.abort()
            return
        self.close()

    def start_tunnel(self, resp: Any, upgrade: bytes) -> None:
        via = self.server.runtime.via_lines.get(response_version(resp))
        self.tx.through(resp.serialize(
            b"HTTP/1.1 %d %s\r\n" % (resp.status, resp.reason),
            (via or b"") + b"Connection: upgrade\r\nUpgrade: " + upgrade + CRLF,
            F_HOP | F_CONTENT_LENGTH))  # RFC 9110 8.6: no Content-Length on a 1xx
        self.tunnel = True
        if self.buf:
            data = bytes(self.buf)
            self.buf.clear()
            self._tunnel_in(data)
        # Bytes the client sent behind its Upgrade request were held as a pipelined
        # request (reading paused past max_header_bytes); they are tunnel bytes now.
        self.resume(P_PIPELINE)
        if self.client_eof and self.exchange is not None:
            # The client's FIN came before the 101: pass it on now, or each side would
            # wait for the other.
            self.exchange.tunnel_client_eof()

    def _tunnel_in(self, data: bytes) -> None:
        ex = self.exchange
        if ex.reading_body:
            # A 101 that came before the whole request body: the client sends the rest
            # as HTTP/1.1 (RFC 9110 7.8), and it goes on in the upstream request's
            # framing (re-chunked, say); only the bytes after it are the tunnel's.
            n = ex.feed_body(data)
            data = data[n:]
            if not data or self.exchange is None or ex.reading_body:
                return
        ex.tunnel_from_client(data)

    def tunnel_write(self, data: bytes) -> None:
        self.tx.through(data)

    def tunnel_eof(self) -> bool:
        """Half-close towards the client; False if the client is done too or cannot."""
        t = self.transport
        if self.client_eof or t.is_closing() or not t.can_write_eof():
            return False
        t.write_eof()
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._cancel_timer()
            self.transport.close()

    def linger(self) -> None:
        """Stop writing, discard what the client still sends, close soon.

        Closing a socket with unread input makes the kernel send RST, which can
        destroy the error response before the client reads it (nginx's
        lingering_close solves the same problem)."""
        if self.closed or self.lingering:
            return
        self.lingering = True
        self.buf.clear()
        if self.pause_mask:
            self.pause_mask = 0
            self.transport.resume_reading()
        if self.client_eof or not self.transport.can_write_eof():
            self.close()
            return
        self.transport.write_eof()
        self._arm(LINGER_SECONDS)

    def drain(self, idle_grace: float = 0.0) -> None:
        """Graceful stop: a busy connection closes after its response, which says
        `Connection: close`. An idle one may have its next request already on the way,
        and closing under it loses that request (or resets it): it closes once it has
        been idle `idle_grace` seconds, unless a request comes first (and is answered
        with `Connection: close`)."""
        if self.exchange is not None or self.closed or self.lingering:
            return
        self.drain_idle = idle_grace
        if self.buf:
            return  # a head arriving: it becomes a request (or times out)
        left = self._idle_from() + idle_grace - monotonic()
        if left <= 0:
            self.close()
        else:
            self._arm(left)

    def _idle_from(self) -> float:
        return self.idle_since if self.served else self.head_started

    # -- timers ---------------------------------------------------------------------

    def _arm(self, delay: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_later(delay, self._on_timer)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _on_timer(self) -> None:
        """One timer per connection, re-armed at most every `min_timeout`.

        Requests only record timestamps; since every deadline lies at least
        min_timeout after the moment it is set, a timer that re-arms for
        min(time left, min_timeout) never fires late and costs nothing per request."""
        self.timer = None
        if self.closed:
            return
        if self.lingering:
            self.close()
            return
        rt = self.server.runtime
        http = rt.http
        now = monotonic()
        ex = self.exchange
        left: float | None
        if ex is not None:
            left = ex.check_deadline(now, http.body_timeout_ms / 1000)
        elif self.buf:
            left = self.head_started + http.header_timeout_ms / 1000 - now
            if left <= 0:
                self.reject(408, "timed out reading the request head", len(self.buf))
                return
        else:
            if self.served:
                left = self.idle_since + http.keepalive_timeout_ms / 1000 - now
            else:
                left = self.head_started + http.header_timeout_ms / 1000 - now
            if self.server.draining:
                left = min(left, self._idle_from() + self.drain_idle - now)
            if left <= 0:
                self.close()  # idle: close quietly
                return
        if self.closed or self.timer is not None:
            return
        if left is None or left > rt.min_timeout:
            left = rt.min_timeout
        self.timer = self.loop.call_later(left, self._on_timer)


# The C class itself, not a Python subclass mixing in asyncio.BufferedProtocol: on an
# exact C type a cpdef method does not check for a Python override on every call.
H1Connection = H1ConnectionCore
