"""One proxied request/response: routing, upstream selection, framing and flow control.

The downstream connection (protocols.http1) creates an Exchange per request head
and feeds it body bytes; the upstream connection (protocols.h1_upstream) calls
back with the response. Bodies stream in both directions; the only buffering is
body bytes that arrive while an upstream connection is still being opened
(bounded: reading pauses) and a small copy of the request body kept so a request
can be replayed on another endpoint after a connect failure.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiproxy._fast.h1 import (
    ChunkedDecoder,
    ParseError,
)
from aiproxy.protocols import replies
from aiproxy.protocols.h1_upstream import BODY_NONE, BODY_TUNNEL
from aiproxy.routing.pool import UpstreamConnectError

if TYPE_CHECKING:
    from aiproxy._fast.h1 import RequestHead, ResponseHead
    from aiproxy.protocols.h1_upstream import H1UpstreamConnection
    from aiproxy.protocols.http1 import H1Connection
    from aiproxy.routing.pool import Pool
    from aiproxy.routing.table import Route

log = logging.getLogger("aiproxy.exchange")

# Header flags from aiproxy/_fast/h1.pxd.
F_HOP = 1
F_CONTENT_LENGTH = 2
F_HOST = 8
F_XFF = 128
F_XFP = 256

P_UPSTREAM = 1  # reasons the downstream connection stops reading
P_PENDING = 2

REQ_NONE = 0
REQ_LENGTH = 1
REQ_CHUNKED = 2

PENDING_LIMIT = 256 * 1024
REPLAY_LIMIT = 64 * 1024
LAST_CHUNK = b"0\r\n\r\n"
CRLF = b"\r\n"
INFINITY = float("inf")
IDEMPOTENT = frozenset((b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"))
# What the head parser accepts in a Host field (HOSTCHAR in aiproxy/_fast/h1.pyx); an
# absolute-form authority becomes the upstream Host field, so it must pass the same check.
HOST_CHARS = (b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
              b"-._~!$&'()*+,;=:[]%")


class Exchange:
    __slots__ = (
        "conn", "loop", "rt", "head", "method", "route", "pool", "upstream", "connect_task",
        "reading_body", "req_done", "req_mode", "req_remaining", "decoder", "req_bytes",
        "pending", "pending_size", "replay", "replay_size", "tried", "reused",
        "path", "up_target", "host_line", "head_sent", "finished", "keep_alive",
        "down_chunked", "status", "resp_bytes", "activity", "body_activity", "req_done_at",
        "head_out", "tunnel", "tunnel_up_eof", "t_start",
    )

    def __init__(self, conn: H1Connection, head: RequestHead, now: float) -> None:
        self.conn = conn
        self.loop = conn.loop
        self.rt = conn.server.runtime
        self.head = head
        self.method = head.method
        self.route: Route | None = None
        self.pool: Pool | None = None
        self.upstream: H1UpstreamConnection | None = None
        self.connect_task: asyncio.Task | None = None
        self.reading_body = False
        self.req_done = False
        self.req_mode = REQ_NONE
        self.req_remaining = 0
        self.decoder: ChunkedDecoder | None = None
        self.req_bytes = 0
        self.pending: list[bytes] = []
        self.pending_size = 0
        self.replay: list[bytes] | None = []
        self.replay_size = 0
        self.tried: tuple[Pool, ...] = ()
        self.reused = False
        self.path = b""
        self.up_target = b""
        self.host_line = b""
        self.head_sent = False
        self.finished = False
        self.keep_alive = False
        self.down_chunked = False
        self.status = 0
        self.resp_bytes = 0
        self.activity = now
        self.body_activity = now
        self.req_done_at = now
        self.head_out = b""
        self.tunnel = False
        self.tunnel_up_eof = False
        self.t_start = now

    # -- request side -------------------------------------------------------------

    def start(self) -> None:
        head = self.head
        method = self.method
        target = head.target
        if method == b"CONNECT":
            self._framing()
            return self.local_reply(501, "CONNECT is not supported by this listener")
        if target[:1] == b"/":
            if b"#" in target:
                return self.local_reply(400, "fragment in request target")
            q = target.find(b"?")
            self.path = target if q < 0 else target[:q]
            self.up_target = target
        elif target == b"*" and method == b"OPTIONS":
            self.path = self.up_target = b"*"
        elif not self._absolute_form(target):
            return self.local_reply(400, "invalid request target")
        if head.expect_unknown:
            return self.local_reply(417, "unsupported expectation")
        if not self._framing():
            return
        host = head.host if not self.host_line else self.host_line[6:-2]
        route = self.rt.table.match(method, self.path, host, head)
        if route is None:
            return self.local_reply(404, "no route matches the request")
        self.route = route
        pool = route.cluster.pick()
        if pool is None:
            return self.local_reply(503, f"cluster {route.cluster.name!r} has no endpoints",
                                    "no_healthy_upstream")
        if head.expect_continue and self.reading_body:
            self.conn.transport.write(replies.CONTINUE_100)
        self._use(pool)

    def _absolute_form(self, target: bytes) -> bool:
        lower = target[:8].lower()
        if lower.startswith(b"http://"):
            rest = target[7:]
        elif lower.startswith(b"https://"):
            rest = target[8:]
        else:
            return False
        end = len(rest)
        for sep in (b"/", b"?"):
            i = rest.find(sep)
            if 0 <= i < end:
                end = i
        authority = rest[:end]
        if not authority or authority.translate(None, HOST_CHARS) or b"#" in rest:
            return False  # also rejects userinfo ('@' is not a host character)
        path = rest[end:] or b"/"
        if path[:1] == b"?":
            path = b"/" + path
        self.up_target = path
        q = path.find(b"?")
        self.path = path if q < 0 else path[:q]
        # RFC 9112 3.2.2: the target's authority replaces the Host field.
        self.host_line = b"Host: " + authority + CRLF
        return True

    def _framing(self) -> bool:
        head = self.head
        if head.chunked:
            self.req_mode = REQ_CHUNKED
            self.decoder = ChunkedDecoder(self.rt.http.max_header_bytes)
            self.reading_body = True
        elif head.content_length > 0:
            if self.rt.max_body and head.content_length > self.rt.max_body:
                self.local_reply(413, "request body larger than max_body_bytes")
                return False
            self.req_mode = REQ_LENGTH
            self.req_remaining = head.content_length
            self.reading_body = True
        else:
            self.req_done = True
        return True

    def _upstream_head(self, pool: Pool) -> bytes:
        head = self.head
        rt = self.rt
        drop = F_HOP | F_CONTENT_LENGTH
        extra = []
        if self.host_line:
            drop |= F_HOST
            extra.append(self.host_line)
        elif head.host is None:
            extra.append(b"Host: " + pool.endpoint.address.encode() + CRLF)
        if rt.http.x_forwarded:
            drop |= F_XFF | F_XFP
            peer = self.conn.peer
            if head.has_xff:
                peer = b", ".join([*head.get_all(b"x-forwarded-for"), peer])
            extra.append(b"X-Forwarded-For: " + peer + b"\r\nX-Forwarded-Proto: http\r\n")
        if rt.via_line:
            extra.append(rt.via_line)
        if self.req_mode == REQ_CHUNKED:
            extra.append(b"Transfer-Encoding: chunked\r\n")
        elif head.content_length >= 0:
            extra.append(b"Content-Length: %d\r\n" % head.content_length)
        if head.upgrade is not None:
            extra.append(b"Connection: upgrade\r\nUpgrade: " + head.upgrade + CRLF)
        return head.serialize(self.method + b" " + self.up_target + b" HTTP/1.1\r\n",
                              b"".join(extra), drop)

    def feed_body(self, data: bytes) -> int:
        """Take request body bytes from data; returns how many belonged to the body."""
        self.body_activity = self.loop.time()
        if self.req_mode == REQ_LENGTH:
            n = len(data)
            rem = self.req_remaining
            if n > rem:
                data = data[:rem]
                n = rem
            self.req_remaining = rem - n
            self.req_bytes += n
            self._forward((data,))
            if self.req_remaining == 0:
                self._request_complete()
            return n
        decoder = self.decoder
        try:
            pieces = decoder.feed(data)
        except ParseError as exc:
            self._request_body_error(exc.status, exc.message)
            return len(data)
        parts = []
        for piece in pieces:
            self.req_bytes += len(piece)
            parts += (b"%x\r\n" % len(piece), piece, CRLF)
        max_body = self.rt.max_body
        if max_body and self.req_bytes > max_body:
            self._request_body_error(413, "request body larger than max_body_bytes")
            return len(data)
        if decoder.done:
            parts.append(LAST_CHUNK)
            self._forward(parts)
            self._request_complete()
            return decoder.tail
        if parts:
            self._forward(parts)
        return len(data)

    def _forward(self, parts: tuple[bytes, ...] | list[bytes]) -> None:
        if self.replay is not None:
            self.replay_size += sum(map(len, parts))
            if self.replay_size > REPLAY_LIMIT:
                self.replay = None
            else:
                self.replay.extend(parts)
        up = self.upstream
        if up is not None:
            up.transport.writelines(parts)
        elif not self.finished:
            self.pending.extend(parts)
            self.pending_size += sum(map(len, parts))
            if self.pending_size > PENDING_LIMIT:
                self.conn.pause(P_PENDING)

    def _request_complete(self) -> None:
        self.reading_body = False
        self.req_done = True
        self.req_done_at = self.loop.time()

    def _request_body_error(self, status: int, message: str) -> None:
        self.reading_body = False
        if self.head_sent:
            self._abort()
        else:
            self.local_reply(status, message)

    def upload_stalled(self, now: float) -> bool:
        """True (and the exchange ended) when the upstream stopped taking the body."""
        cfg = self.route.cluster.cfg if self.route is not None else None
        if cfg is None or now - self.body_activity < cfg.read_timeout_ms / 1000:
            return False
        self._request_body_error(504, "upstream stopped reading the request body")
        return True

    def client_body_timeout(self) -> None:
        self._request_body_error(408, "timed out reading the request body")

    # -- upstream selection -------------------------------------------------------

    def _use(self, pool: Pool) -> None:
        self.pool = pool
        up = pool.take()
        if up is not None:
            self._attach(up, True)
        else:
            self.connect_task = self.loop.create_task(self._connect(pool))

    async def _connect(self, pool: Pool) -> None:
        try:
            up = await pool.connect()
        except UpstreamConnectError as exc:
            self.connect_task = None
            if not self.finished:
                self._connect_failed(pool, exc)
            return
        self.connect_task = None
        if self.finished:
            pool.release(up)
            return
        self._attach(up, False)

    def _connect_failed(self, pool: Pool, exc: UpstreamConnectError) -> None:
        self.tried += (pool,)
        nxt = self.route.cluster.pick(self.tried) if self.replay is not None else None
        if nxt is not None:
            log.info("retrying on %s: %s", nxt.endpoint.address, exc)
            self._replay_pending()
            self._use(nxt)
            return
        if exc.timeout:
            self.fail(504, "upstream_connect_timeout", str(exc))
        else:
            self.fail(502, "upstream_connect_failed", str(exc))

    def _replay_pending(self) -> None:
        self.pending = list(self.replay)
        self.pending_size = self.replay_size

    def _attach(self, up: H1UpstreamConnection, reused: bool) -> None:
        self.upstream = up
        self.reused = reused
        up.start(self, self._upstream_head(self.pool), self.method == b"HEAD")
        if self.pending:
            up.transport.writelines(self.pending)
            self.pending = []
            self.pending_size = 0
            self.conn.resume(P_PENDING)
        if self.conn.writing_paused:
            up.pause()

    # -- deadlines (checked by the connection's timer) ----------------------------------

    def check_deadline(self, now: float, body_timeout: float) -> float | None:
        """Seconds until this exchange's current deadline, or None if it just ended it."""
        if self.finished or self.tunnel:
            return INFINITY
        if self.reading_body:
            if self.conn.pause_mask:
                return None if self.upload_stalled(now) else body_timeout
            left = self.body_activity + body_timeout - now
            if left <= 0:
                self.client_body_timeout()
                return None
            return left
        cfg = self.route.cluster.cfg
        if not self.head_sent:
            left = self.req_done_at + cfg.request_timeout_ms / 1000 - now
            if left <= 0:
                self.fail(504, "upstream_timeout",
                          f"upstream sent no response head within {cfg.request_timeout_ms} ms")
                return None
            return left
        left = self.activity + cfg.read_timeout_ms / 1000 - now
        if left <= 0:
            log.warning("upstream read timeout on route %s", self.route.name)
            self._abort()
            return None
        return left

    # -- upstream callbacks ---------------------------------------------------------

    def on_upstream_informational(self, resp: ResponseHead) -> None:
        if resp.status == 100 or self.head.version < 11:
            return
        self.conn.transport.write(resp.serialize(
            b"HTTP/1.1 %d %s\r\n" % (resp.status, resp.reason), b"", F_HOP))

    def on_upstream_head(self, resp: ResponseHead, mode: int) -> None:
        head = self.head
        rt = self.rt
        conn = self.conn
        self.status = status = resp.status
        self.head_sent = True
        self.activity = self.loop.time()
        start = b"HTTP/1.1 %d %s\r\n" % (status, resp.reason)
        if mode == BODY_TUNNEL:
            return self._start_tunnel(resp, start)
        extra = [rt.via_line] if rt.via_line else []
        # The connection closes after this response if the request body is still arriving
        # (the rest of it is not read) or this is the last request allowed on it: say so.
        keep = head.keep_alive and self.req_done and conn.may_keep_alive()
        if mode == BODY_NONE:
            drop = F_HOP
        else:
            drop = F_HOP | F_CONTENT_LENGTH
            if resp.content_length >= 0 and not resp.chunked:
                extra.append(b"Content-Length: %d\r\n" % resp.content_length)
            elif head.version >= 11:
                self.down_chunked = True
                extra.append(b"Transfer-Encoding: chunked\r\n")
            else:
                keep = False  # HTTP/1.0 client: the end of the body is the close
        if not keep:
            extra.append(b"Connection: close\r\n")
        elif head.version < 11:
            extra.append(b"Connection: keep-alive\r\n")
        self.keep_alive = keep
        # Written with the first body bytes (one syscall), or by flush().
        self.head_out = resp.serialize(start, b"".join(extra), drop)

    def on_upstream_body(self, data: bytes) -> None:
        self.resp_bytes += len(data)
        self.activity = self.loop.time()
        head = self.head_out
        if self.down_chunked:
            if head:
                self.head_out = b""
                self.conn.transport.writelines((head, b"%x\r\n" % len(data), data, CRLF))
            else:
                self.conn.transport.writelines((b"%x\r\n" % len(data), data, CRLF))
        elif head:
            self.head_out = b""
            self.conn.transport.writelines((head, data))
        else:
            self.conn.transport.write(data)

    def flush(self) -> None:
        if self.head_out:
            head = self.head_out
            self.head_out = b""
            self.conn.transport.write(head)

    def on_upstream_end(self) -> None:
        up = self.upstream
        self.upstream = None
        if self.down_chunked:
            self.conn.transport.write(self.head_out + LAST_CHUNK)
            self.head_out = b""
        else:
            self.flush()
        if up is not None:
            if self.req_done:
                self.pool.release(up)
            else:
                up.close()
        self._finish(self.keep_alive and self.req_done)

    def on_upstream_failed(self, status: int, code: str, message: str) -> None:
        up = self.upstream
        self.upstream = None
        if self.finished:
            return
        if self.head_sent:
            log.warning("upstream failed mid-response on route %s: %s", self.route.name, message)
            self._abort()
            return
        if (self.reused and up is not None and not up.received and self.replay is not None
                and self.method in IDEMPOTENT):
            # A pooled connection the upstream had already closed: replay once, fresh.
            self.reused = False
            self._replay_pending()
            self.connect_task = self.loop.create_task(self._connect(self.pool))
            return
        self.fail(status, code, message)

    def on_upstream_pause_writing(self) -> None:
        self.conn.pause(P_UPSTREAM)

    def on_upstream_resume_writing(self) -> None:
        self.body_activity = self.loop.time()
        self.conn.resume(P_UPSTREAM)

    # -- downstream callbacks -------------------------------------------------------

    def on_client_pause_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.pause()

    def on_client_resume_writing(self) -> None:
        self.activity = self.loop.time()
        if self.upstream is not None:
            self.upstream.resume()

    def on_client_lost(self) -> None:
        if self.finished:
            return
        self.finished = True
        self._drop_upstream()

    # -- tunnel (Upgrade) -------------------------------------------------------------

    def _start_tunnel(self, resp: ResponseHead, start: bytes) -> None:
        upgrade = resp.upgrade or resp.get(b"upgrade")
        if self.head.upgrade is None or upgrade is None:
            self.on_upstream_failed(502, "upstream_bad_response", "unexpected 101 response")
            return
        self.tunnel = True
        self.conn.transport.write(resp.serialize(
            start, b"Connection: upgrade\r\nUpgrade: " + upgrade + CRLF, F_HOP))
        self.conn.start_tunnel()

    def tunnel_from_client(self, data: bytes) -> None:
        up = self.upstream
        if up is not None and up.transport is not None:
            up.transport.write(data)

    def on_upstream_tunnel_data(self, data: bytes) -> None:
        self.conn.transport.write(data)

    def on_upstream_tunnel_eof(self) -> None:
        self.tunnel_up_eof = True
        t = self.conn.transport
        if self.conn.client_eof or not t.can_write_eof():
            self._close_tunnel()  # both directions are done
        else:
            t.write_eof()

    def tunnel_client_eof(self) -> None:
        up = self.upstream
        if self.tunnel_up_eof or up is None or up.transport is None:
            self._close_tunnel()  # both directions are done
        elif up.transport.can_write_eof():
            up.transport.write_eof()

    def _close_tunnel(self) -> None:
        # After EOF both ways nothing else closes the sockets (eof_received returned True
        # to keep each half open), so close both here; close() still flushes queued bytes.
        up = self.upstream
        self.upstream = None
        self.finished = True
        if up is not None:
            up.close()
        self.conn.close()

    def on_upstream_tunnel_closed(self) -> None:
        self.upstream = None
        self.finished = True
        self.conn.close()

    # -- endings --------------------------------------------------------------------

    def fail(self, status: int, code: str, message: str) -> None:
        log.info("%d %s: %s", status, code, message)
        self.local_reply(status, message, code)

    def local_reply(self, status: int, message: str, code: str | None = None) -> None:
        """Answer with a JSON error; the connection stays open only if that is safe."""
        head = self.head
        conn = self.conn
        self.reading_body = False
        keep = head.keep_alive and self.req_done and conn.may_keep_alive()
        self.status = status
        self.head_sent = True
        conn.transport.write(replies.error_response(
            status, message, code, close=not keep, head_only=self.method == b"HEAD",
            keep_alive_10=keep and head.version < 11))
        self._drop_upstream()
        self._finish(keep)

    def _drop_upstream(self) -> None:
        task = self.connect_task
        if task is not None:
            self.connect_task = None
            task.cancel()
        up = self.upstream
        if up is not None:
            self.upstream = None
            up.abort()

    def _finish(self, keep_alive: bool) -> None:
        if self.finished:
            return
        self.finished = True
        self.conn.exchange_done(self, keep_alive)

    def _abort(self) -> None:
        if self.finished:
            return
        self.finished = True
        self._drop_upstream()
        self.conn.close()
