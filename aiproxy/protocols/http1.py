"""Downstream HTTP/1.1: one protocol instance per client connection.

It parses request heads (pipelined requests are answered in order, one
exchange at a time), hands body bytes to the current Exchange, and owns the
connection-level timers: header read, keep-alive idle and request body idle.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiproxy._fast.h1 import ParseError, parse_request
from aiproxy.pipeline.exchange import Exchange
from aiproxy.protocols import replies

if TYPE_CHECKING:
    from aiproxy.server.app import ProxyServer

log = logging.getLogger("aiproxy.http1")

P_PIPELINE = 4
LINGER_SECONDS = 2.0


class H1Connection(asyncio.Protocol):
    __slots__ = ("server", "loop", "transport", "buf", "exchange", "peer", "served",
                 "pause_mask", "writing_paused", "closed", "lingering", "tunnel",
                 "timer", "head_started", "idle_since", "in_process", "client_eof")

    def __init__(self, server: ProxyServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.exchange: Exchange | None = None
        self.peer = b""
        self.served = 0
        self.pause_mask = 0
        self.writing_paused = False
        self.closed = False
        self.lingering = False
        self.tunnel = False
        self.timer: asyncio.TimerHandle | None = None
        self.head_started = 0.0
        self.idle_since = 0.0
        self.in_process = False
        self.client_eof = False

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = peer[0].encode() if peer else b""
        self.server.connections.add(self)
        self.head_started = self.idle_since = self.loop.time()
        self._arm(self.server.runtime.min_timeout)

    def data_received(self, data: bytes) -> None:
        if self.tunnel:
            self.exchange.tunnel_from_client(data)
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
            self.head_started = self.loop.time()
        self.buf += data
        self._process()

    def eof_received(self) -> bool:
        self.client_eof = True
        if self.tunnel:
            self.exchange.tunnel_client_eof()
            return True
        ex = self.exchange
        if ex is not None and not ex.reading_body and not self.lingering:
            return True  # half-closed client still gets its response
        return False

    def connection_lost(self, exc: Exception | None) -> None:
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
                    if len(self.buf) > self.server.runtime.http.max_header_bytes:
                        self.pause(P_PIPELINE)
                    break
        finally:
            self.in_process = False

    def _start_exchange(self) -> bool:
        http = self.server.runtime.http
        try:
            head = parse_request(self.buf, http.max_header_bytes, http.max_request_line_bytes,
                                 http.max_headers)
        except ParseError as exc:
            self.reject(exc.status, exc.message)
            return False
        if head is None:
            return False
        del self.buf[:head.consumed]
        self.exchange = ex = Exchange(self, head, self.head_started)
        ex.start()
        return True

    def reject(self, status: int, message: str) -> None:
        """Answer a message that cannot be framed, then close."""
        log.info("rejecting request from %s: %d %s", self.peer.decode(), status, message)
        self.transport.write(replies.error_response(status, message))
        self.linger()

    # -- called by the exchange ---------------------------------------------------------

    def exchange_done(self, ex: Exchange, keep_alive: bool) -> None:
        self.exchange = None
        self.served += 1
        if self.closed:
            return
        http = self.server.runtime.http
        if (not keep_alive or self.server.draining or self.client_eof
                or (http.max_keepalive_requests and self.served >= http.max_keepalive_requests)):
            if ex.req_done:
                self.close()
            else:
                self.linger()
            return
        if self.pause_mask:
            self.pause_mask = 0
            self.transport.resume_reading()
        self.idle_since = self.head_started = self.loop.time()
        if self.buf:
            self._process()
        elif not http.keepalive_timeout_ms:
            self.close()

    def may_keep_alive(self) -> bool:
        """False when the connection closes after the current response regardless of the
        request: draining, or the response is the last max_keepalive_requests allows."""
        http = self.server.runtime.http
        limit = http.max_keepalive_requests
        return (not self.server.draining and http.keepalive_timeout_ms > 0
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

    def start_tunnel(self) -> None:
        self.tunnel = True
        if self.buf:
            data = bytes(self.buf)
            self.buf.clear()
            self.exchange.tunnel_from_client(data)

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

    def drain(self) -> None:
        """Graceful stop: idle connections close now, busy ones after their response."""
        if self.exchange is None:
            self.close()

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
        now = self.loop.time()
        ex = self.exchange
        left: float | None
        if ex is not None:
            left = ex.check_deadline(now, http.body_timeout_ms / 1000)
        elif self.buf:
            left = self.head_started + http.header_timeout_ms / 1000 - now
            if left <= 0:
                self.reject(408, "timed out reading the request head")
                return
        else:
            if self.served:
                left = self.idle_since + http.keepalive_timeout_ms / 1000 - now
            else:
                left = self.head_started + http.header_timeout_ms / 1000 - now
            if left <= 0:
                self.close()  # idle: close quietly
                return
        if self.closed or self.timer is not None:
            return
        if left is None or left > rt.min_timeout:
            left = rt.min_timeout
        self.timer = self.loop.call_later(left, self._on_timer)
