"""HTTP/2 client side (h2c prior knowledge): one multiplexed connection per endpoint.

Each proxied request is an `H2UpstreamStream`, the upstream side of one Exchange.
Trailers (gRPC's grpc-status/grpc-message) travel back with the end of the
stream; flow control is end to end as on the server side: response DATA is
acknowledged only while the client keeps up.

What a response can make the proxy hold (CVE-2019-9517, internal data buffering) is
what waits for its client plus what its upstream may still send: the stream's window.
So a stream starts with INITIAL_STREAM_WINDOW (SETTINGS_INITIAL_WINDOW_SIZE), and its
window doubles, up to STREAM_WINDOW, each time a whole window's worth has gone straight
on to the client (nothing waiting for it: Downstream.response_backlog() 0), i.e. while
the upstream's window and not the client is what limits the stream; as Envoy's edge
settings (64 KiB stream windows) and grpc-go (windows grown with what the reader takes)
do. The growth of all the streams of one client connection comes out of one
h2_output.WindowShare, held by each stream until it ends. A stream whose client is
backed up (paused) stops re-opening its window; the connection's window is re-opened as
DATA arrives, whatever the stream, as it is shared with other clients' streams.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes

from aiproxy._fast.sendnow import unread
from aiproxy.pipeline.ends import BODY_LENGTH, BODY_NONE, BODY_UNTIL_CLOSE, Upstream
from aiproxy.protocols import h2_fast
from aiproxy.protocols.fields import H2ResponseHead, MalformedHead, response_trailer_fields
from aiproxy.protocols.h2_budgets import (
    IDLE_PER_REQUEST,
    SMALL_DATA_UPSTREAM,
    SMALL_WINDOW_UPSTREAM,
    FrameBudgets,
    UnsentAcks,
)
from aiproxy.protocols.h2_output import (
    FLUSH_NOW,
    OUTPUT_SLOTS,
    StreamOutput,
    WindowShare,
    open_window,
    release_order,
)

if TYPE_CHECKING:
    from aiproxy.routing.pool import H2Pool

log = logging.getLogger("aiproxy.h2.upstream")

INITIAL_STREAM_WINDOW = 64 * 1024
STREAM_WINDOW = 1024 * 1024  # the most a stream's window grows to
# A response field section over max_header_bytes but within this many times it is
# decoded to its end (the HPACK table stays in step) and fails its stream alone, as
# h2_server does for requests; a larger one ends the connection.
HEADER_LIST_HARD_FACTOR = 4
CONNECTION_WINDOW = 8 * 1024 * 1024
CONNECTION_UPDATE = CONNECTION_WINDOW // 4  # DATA bytes between connection WINDOW_UPDATEs
SWEEP_EVERY = 64
NO_BOUND = 1 << 62  # out_high of an upstream connection: no bound but OUT_HIGH per stream
# RFC 9113 6.5.3: how long the upstream has to acknowledge our SETTINGS (capped by the
# cluster's read_timeout_ms: it has been silent to us that long), as nghttpx's
# --backend-http2-settings-timeout (10 s). Not connect_timeout_ms (1 s by default): a
# busy upstream may be slow to get round to a new connection's frames.
SETTINGS_ACK_SECONDS = 10.0
# Events of frames that carry no response (PING ACKs: the proxy sends no PING).
_IDLE_EVENTS = frozenset((h2.events.PriorityUpdated, h2.events.UnknownFrameReceived,
                          h2.events.PingAckReceived))


# An upstream's RST_STREAM code, as the proxy's error code (and so, for a gRPC caller,
# the status replies.GRPC_CODE_STATUS gives it).
RESET_CODES = {ErrorCodes.CANCEL: "upstream_cancelled",
               ErrorCodes.ENHANCE_YOUR_CALM: "upstream_enhance_your_calm",
               ErrorCodes.INADEQUATE_SECURITY: "upstream_inadequate_security"}

class _ClientH2(h2_fast.FastReceive, h2.connection.H2Connection):
    """h2 with RFC 9113 6.8: after the upstream's GOAWAY the streams it will still
    process (up to its last stream id) carry on; h2 itself would refuse every frame
    from then on, failing responses a gracefully stopping upstream is finishing."""

    def _receive_goaway_frame(self, frame: Any) -> tuple[list, list]:
        state = self.state_machine.state
        # h2 empties its send buffer here: frames queued for streams the peer still
        # processes (DATA, their ends) and not yet written would be lost.
        pending = self._data_to_send
        frames, events = super()._receive_goaway_frame(frame)
        self._data_to_send = pending
        if state is not h2.connection.ConnectionState.CLOSED:
            self.state_machine.state = state
        return frames, events


def response_held(conns: list[H2UpstreamConnection]) -> tuple[int, int]:
    """(response bytes of these connections' streams the proxy holds for their clients,
    bytes their upstream may still send on them: the windows it has), for /metrics."""
    held = window = 0
    for conn in conns:
        for stream in conn.streams.values():
            down = stream.down
            if down is not None:
                held += down.response_backlog()
            if stream.credit > 0:
                window += stream.credit
    return held, window


def write_buffered(conns: list[H2UpstreamConnection]) -> int:
    """Bytes written to these connections that their sockets have not taken yet (the
    transports' write buffers), for /metrics."""
    n = 0
    for conn in conns:
        transport = conn.transport
        if transport is not None and not conn.closed:
            n += transport.get_write_buffer_size()
    return n


class H2UpstreamConnection(asyncio.Protocol):
    def __init__(self, pool: H2Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.h2: _ClientH2 | None = None
        self.streams: dict[int, H2UpstreamStream] = {}
        self.closed = False
        self.goaway = False
        self.writing_paused = False
        # Request bytes waiting for the upstream's windows. No bound per connection here
        # (only OUT_HIGH per stream): the upstream is trusted, and its connection carries
        # the uploads of many clients, which one bound would hold back together.
        self.out_waiting = 0
        self.out_high = self.out_low = NO_BOUND
        self.receiving = False       # inside data_received, which flushes when done
        self.flush_wanted = False
        self.released_to = 0         # the last stream resume_writing released output of
        self.window_to = 0           # the stream the send window last ran out at
        self.max_streams = 100       # the peer's SETTINGS_MAX_CONCURRENT_STREAMS, once known
        self.done_count = 0
        self.idle_since = 0.0
        self.budgets = FrameBudgets(SMALL_DATA_UPSTREAM, SMALL_WINDOW_UPSTREAM)  # settled per read
        self.unacked = 0             # DATA bytes not yet given back to the connection window
        # Done when the peer's first SETTINGS frame has arrived (its stream limit is known).
        self.settings_received: asyncio.Future[None] = pool.loop.create_future()
        self.fd = -1  # the socket's (plain TCP only), for what is left unread at a reset
        self.settings_timer: asyncio.TimerHandle | None = None  # until our SETTINGS are acked
        self.acks = UnsentAcks()
        # The highest stream id whose HEADERS went to a write that did not fail at once:
        # a stream above it, at a connection loss, never reached the upstream.
        self.sent_to = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and self.pool.cluster_cfg.tls is None:
            self.fd = sock.fileno()
        self.pool.open_count += 1
        config = h2.config.H2Configuration(
            client_side=True, header_encoding=None, validate_inbound_headers=True,
            normalize_inbound_headers=True, validate_outbound_headers=False,
            normalize_outbound_headers=False)
        conn = _ClientH2(config=config)
        conn.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: INITIAL_STREAM_WINDOW,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: self.pool.max_head,
        })
        conn.decoder.max_header_list_size = self.pool.max_head
        conn.decoder.hard_limit = HEADER_LIST_HARD_FACTOR * self.pool.max_head
        conn.initiate_connection()
        conn.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self.h2 = conn
        self.flush()
        self.settings_timer = self.pool.loop.call_later(
            min(SETTINGS_ACK_SECONDS, self.pool.cluster_cfg.read_timeout_ms / 1000),
            self._settings_timeout)

    # -- streams ---------------------------------------------------------------------

    def available(self) -> bool:
        if self.closed or self.goaway or self.transport is None or self.transport.is_closing():
            return False
        streams = self.streams
        if not streams and not self.receiving and self.fd >= 0 and unread(self.fd):
            # Idle, and something is in the socket the loop has not read yet: maybe the
            # upstream's FIN, RST or GOAWAY, closing its idle connection as this request
            # picks it (a stream opened now would be lost with it). Read it first. A
            # connection with open streams is in use and skips this syscall; so does one
            # inside its own data_received (a refused stream replayed onto it), whose
            # events are not all dispatched yet: the next bytes would overtake them.
            self._read_waiting()
            if self.closed or self.goaway or self.transport.is_closing():
                return False
        return len(streams) < self.max_streams

    def open_stream(self) -> H2UpstreamStream | None:
        if not self.available():
            return None
        return H2UpstreamStream(self)

    def want_flush(self) -> None:
        """Write what h2 has queued once this event-loop turn is over: the requests
        started in one turn share one write."""
        if self.closed:
            return
        if len(self.h2._data_to_send) >= FLUSH_NOW:
            # Now: a transport that pauses in this write holds back the request bodies
            # of the streams that come next in this turn (they queue them, and pause
            # their clients past OUT_HIGH) instead of all of them landing in its buffer.
            self.flush()
            return
        if not self.flush_wanted:
            self.flush_wanted = True
            if not self.receiving:
                self.pool.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_wanted = False
        if self.closed:
            return
        data = self.h2.data_to_send()
        # A transport that is closing (a TLS one closes by itself at the upstream's
        # close_notify, before connection_lost) drops what is written to it.
        transport = self.transport
        if data and not transport.is_closing():
            transport.write(data)
            if transport.is_closing():
                return  # the send failed at once (uvloop tries it now): none of it left
            self.sent_to = self.h2.highest_outbound_stream_id
            if self.acks.wrote(len(data), transport.get_write_buffer_size()):
                self._connection_error(ErrorCodes.ENHANCE_YOUR_CALM,
                                       "does not read the ACKs of its PING/SETTINGS frames",
                                       abort=True)

    def stream_done(self, stream: H2UpstreamStream) -> None:
        self.streams.pop(stream.sid, None)
        stream.clear_output()  # never sent once done: out of out_waiting
        stream.release_window()
        self.done_count += 1
        if self.done_count >= SWEEP_EVERY:
            # h2 forgets its closed streams only while counting the open ones (a scan of
            # all): once per SWEEP_EVERY streams, not on every new one as h2 itself would.
            self.done_count = 0
            self.h2.open_outbound_streams  # noqa: B018
        if self.pool.capacity is not None:
            self.pool.capacity_changed()  # a stream is free for a request waiting
        if not self.streams:
            self.idle_since = self.pool.loop.time()
            if self.goaway:
                self.close()

    def close(self, abort: bool = False) -> None:
        if not self.closed:
            if self.flush_wanted and not abort:
                self.flush()
            self.closed = True
            self._stop_settings_timer()
            if self.transport is not None:
                if abort:
                    self.transport.abort()
                else:
                    self.transport.close()

    def _stop_settings_timer(self) -> None:
        timer, self.settings_timer = self.settings_timer, None
        if timer is not None:
            timer.cancel()

    def _settings_timeout(self) -> None:
        self.settings_timer = None
        if not self.closed:
            self._connection_error(ErrorCodes.SETTINGS_TIMEOUT,
                                   "did not acknowledge our SETTINGS (RFC 9113 6.5.3)")

    # -- asyncio.Protocol -----------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self._protocol_error(exc)
            return
        while True:
            self.receiving = True
            try:
                self._dispatch(events)
            finally:
                self.receiving = False
            if self.closed:
                return
            if not self.budgets.settle(self.h2, self.pool.loop.time):
                self._flooded("frames that carry no response (empty DATA, PRIORITY, "
                              "WINDOW_UPDATE, unknown or on closed streams)")
                return
            if not self.h2.incoming_buffer.more:
                break
            try:
                events = self.h2.receive_data(b"")  # the frames past FRAMES_PER_PASS
            except h2.exceptions.ProtocolError as exc:
                self._protocol_error(exc)
                return
        self.flush()

    def _protocol_error(self, exc: h2.exceptions.ProtocolError) -> None:
        log.warning("HTTP/2 protocol error from upstream %s: %s",
                    self.pool.endpoint.address, exc)
        # Out of the pool before the streams fail: a replay must not be opened on
        # this connection, whose h2 state is closed.
        self.goaway = True
        self.pool.discard(self)
        try:
            self.h2.close_connection(getattr(exc, "error_code", ErrorCodes.PROTOCOL_ERROR))
        except h2.exceptions.ProtocolError:
            pass
        self.flush()
        self._fail_all("upstream_bad_response", f"HTTP/2 protocol error: {exc}")
        self.close()

    def _flooded(self, what: str) -> None:
        """The upstream overdrew a frame budget (h2_budgets.py)."""
        self._connection_error(ErrorCodes.ENHANCE_YOUR_CALM, f"floods {what}")

    def _connection_error(self, code: int, what: str, abort: bool = False) -> None:
        """GOAWAY(code), and the connection's streams fail; the pool opens a new
        connection for the next request. With abort, the GOAWAY is not waited for: the
        upstream does not read what it is sent."""
        address = self.pool.endpoint.address
        log.warning("upstream %s %s: GOAWAY", address, what)
        self.goaway = True
        self.pool.discard(self)
        try:
            self.h2.close_connection(code)
        except h2.exceptions.ProtocolError:
            pass
        if not abort:
            self.flush()
        self._fail_all("upstream_bad_response", f"upstream {what}")  # the log has the address
        self.close(abort)

    def _dispatch(self, events: list) -> None:
        budgets = self.budgets
        for event in events:
            sid = getattr(event, "stream_id", 0)
            stream = self.streams.get(sid) if sid else None
            kind = type(event)
            if kind is h2.events.DataReceived:
                n = event.flow_controlled_length
                if n:
                    # The connection's window is shared with other clients' streams:
                    # it flows whatever this stream's client does.
                    self.unacked += n
                    if self.unacked >= CONNECTION_UPDATE:
                        self.h2.increment_flow_control_window(self.unacked)
                        self.unacked = 0
                if stream is not None:
                    stream.credit -= n
                    stream.on_data(event.data)
                    if n and event.stream_ended is None:
                        stream.replenish(n)
                if event.stream_ended is None:
                    budgets.data(event.flow_controlled_length)
            elif kind is h2.events.ResponseReceived:
                if stream is not None:
                    stream.on_head(event.headers, bool(event.stream_ended))
            elif kind is h2.events.InformationalResponseReceived:
                if stream is not None:
                    stream.on_informational(event.headers)
            elif kind is h2.events.TrailersReceived:
                if stream is not None:
                    stream.trailers = event.headers
            elif kind is h2.events.StreamEnded:
                if stream is not None:
                    stream.on_end()
            elif kind is h2.events.StreamReset:
                if stream is not None:
                    stream.on_reset(event.error_code, getattr(event, "reason", None))
            elif kind is h2.events.WindowUpdated:
                budgets.window_updates += 1
                if sid == 0:
                    self.window_to = open_window(self.h2, self.streams, self.window_to)
                elif stream is not None:
                    stream.try_send()
            elif kind is h2.events.RemoteSettingsChanged:
                self.acks.queued += 1
                if not budgets.control.spend(1, self.pool.loop.time()):
                    return self._flooded("SETTINGS frames")
                # Kept here: h2's Settings answer each read through collections.abc.
                self.max_streams = self.h2.remote_settings.max_concurrent_streams
                if not self.settings_received.done():
                    self.settings_received.set_result(None)
                elif self.max_streams:
                    self.pool.capacity_changed()  # requests may wait on a limit of 0
                self.window_to = open_window(self.h2, self.streams, self.window_to)
            elif kind is h2.events.ConnectionTerminated:
                self.goaway = True
                last = event.last_stream_id if event.last_stream_id is not None else 0
                for s in list(self.streams.values()):
                    if s.sid > last:
                        # Never processed by the upstream: safe to retry elsewhere.
                        s.fail(503, "upstream_goaway", "upstream sent GOAWAY")
                self.pool.discard(self)
                if not self.streams:
                    # Nothing left to finish (stream_done closes it when the last one
                    # ends otherwise): the pool has let go of it, and an upstream that
                    # keeps it open would hold the socket, and a max_connections slot,
                    # for good.
                    self.close()
            elif kind is h2.events.PingReceived:
                self.acks.queued += 1
                if not budgets.control.spend(1, self.pool.loop.time()):
                    return self._flooded("PING frames")
            elif kind is h2.events.SettingsAcknowledged:
                self._stop_settings_timer()  # only one SETTINGS frame is sent, at the start
                budgets.idle_frames += 1
            elif kind in _IDLE_EVENTS:
                budgets.idle_frames += 1
            if self.closed:
                return

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and not self.closed and self.fd >= 0:
            self._read_left()
        self.fd = -1
        self.pool.open_count -= 1
        self.closed = True
        self._stop_settings_timer()
        if not self.settings_received.done():
            self.settings_received.set_exception(
                ConnectionError("connection closed before its HTTP/2 SETTINGS"))
        self.pool.discard(self)
        reason = "upstream closed the connection" if exc is None else f"upstream connection lost: {exc}"
        sent_to = self.sent_to
        for stream in list(self.streams.values()):
            if stream.sid > sent_to:
                # No byte of it was sent: safe to replay whatever the method
                # (Exchange: NEVER_PROCESSED).
                stream.fail(502, "upstream_not_sent",
                            f"{reason} before the request was sent")
            else:
                stream.fail(502, "upstream_reset", reason)

    def _read_waiting(self) -> None:
        """What the socket holds, read now, ahead of the loop: frames (a PING, SETTINGS
        or GOAWAY) as data_received; an EOF or error ends the connection."""
        for _ in range(16):  # bounded: an idle connection has only control frames
            try:
                data = os.read(self.fd, 1 << 18)
            except BlockingIOError:
                return
            except OSError:
                self.goaway = True
                self.pool.discard(self)
                self.close(abort=True)
                return
            if not data:
                self.goaway = True
                self.pool.discard(self)
                self.close()
                return
            self.data_received(data)
            if self.closed:
                return

    def _read_left(self) -> None:
        """The connection failed (a write that met the upstream's RST) with frames the
        loop has not read still in the socket: an upstream that sends GOAWAY and then
        resets names in it the streams it never processed (RFC 9113 6.8), which are
        then replayed instead of failed. The socket is still open until this returns."""
        while not self.closed:
            try:
                data = os.read(self.fd, 1 << 18)
            except OSError:  # EAGAIN: nothing left; or the error itself
                return
            if not data:
                return
            self.data_received(data)

    def _fail_all(self, code: str, message: str) -> None:
        for stream in list(self.streams.values()):
            stream.fail(502, code, message)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        # As h2_server's: what the streams queued while paused goes out stream by
        # stream until the transport pauses again (want_flush writes as it grows), and
        # the next resume starts after the last stream served, so every one gets its turn.
        self.writing_paused = False
        for stream in release_order(self.streams, self.released_to):
            stream.try_send()
            if self.writing_paused or self.closed:
                self.released_to = stream.sid
                return
        self.flush()


class H2UpstreamStream(StreamOutput, Upstream):
    """The upstream side of one Exchange over a shared HTTP/2 connection."""

    __slots__ = ("conn", "sid", "exchange", "down", "paused", "window", "credit", "clean",
                 "share", "grown", "received", "trailers", "done", "ended_local",
                 "body_left", *OUTPUT_SLOTS)

    def __init__(self, conn: H2UpstreamConnection) -> None:
        self.conn = conn
        self.sid = 0
        self.exchange: Any = None
        self.down: Any = None        # the exchange's Downstream: where the response goes
        self.paused = False
        self.window = INITIAL_STREAM_WINDOW  # what the upstream may have in flight
        self.credit = INITIAL_STREAM_WINDOW  # what it may still send (its window as sent)
        self.clean = 0               # bytes gone straight on to the client since it grew
        self.share: WindowShare | None = None
        self.grown = 0               # taken from share
        self.received = False
        self.trailers: list | None = None
        self.done = False
        self.ended_local = False
        self.body_left = -1          # content-length bytes still to come; -1: no length
        self._init_output()

    # -- driven by the exchange ----------------------------------------------------------

    def start(self, exchange: Any) -> None:
        conn = self.conn
        self.exchange = exchange
        self.down = down = exchange.down
        self.share = down.window_share()
        conn.budgets.idle.credit(IDLE_PER_REQUEST)
        self.sid = conn.h2.get_next_available_stream_id()
        conn.streams[self.sid] = self
        try:
            h2_fast.send_headers(conn.h2, self.sid, exchange.h2_request_headers(conn.pool),
                                 method=exchange.method)
        except h2.exceptions.ProtocolError as exc:
            self.fail(503, "upstream_overloaded", f"cannot open an upstream stream: {exc}")
            return
        conn.want_flush()

    def send_body(self, pieces: tuple[bytes, ...] | list[bytes]) -> None:
        for piece in pieces:
            self.queue_data(piece)
        self.conn.want_flush()

    def end_body(self) -> None:
        if self.done or self.ended_local:
            return
        # An HTTP/2 client's request trailers (gRPC client streaming may send some).
        self.queue_end(self.exchange.request_trailers() or None)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self.clean = 0
            if self.credit < self.window and not self.done:
                self._open(self.window - self.credit)
                self.conn.want_flush()

    def replenish(self, n: int) -> None:
        """n bytes of DATA were handed on to the client: re-open the stream's window
        unless the client is backed up, and grow it while nothing waits for the client."""
        if self.paused or self.done:
            return
        down = self.down
        if down is not None and not down.output_paused() and down.response_backlog() == 0:
            self.clean += n
            window = self.window
            if self.clean >= window and window < STREAM_WINDOW:
                self.clean = 0
                more = min(window, STREAM_WINDOW - window)
                share = self.share
                if share is not None:
                    more = share.take(more)
                    self.grown += more
                self.window = window + more
        else:
            self.clean = 0
        # As h2's own window manager: a WINDOW_UPDATE once half the window is used.
        give = self.window - self.credit
        if give >= self.window >> 1:
            self._open(give)

    def release_window(self) -> None:
        """The stream is over: its growth goes back to its client's share."""
        share, self.share = self.share, None
        if share is not None and self.grown:
            share.give(self.grown)
            self.grown = 0
        self.down = None

    def _open(self, n: int) -> None:
        try:
            self.conn.h2.increment_flow_control_window(n, stream_id=self.sid)
        except (h2.exceptions.ProtocolError, KeyError):
            return  # the stream is over: no window to open
        self.credit += n

    def usable(self) -> bool:
        return False  # a stream carries one exchange; the connection is what is shared

    def abort(self) -> None:
        self._reset(ErrorCodes.CANCEL)

    def close(self) -> None:
        if not self.done:
            self._reset(ErrorCodes.CANCEL)

    def tunnel_write(self, data: bytes) -> None:  # pragma: no cover - no Upgrade over h2
        pass

    def tunnel_eof(self) -> bool:  # pragma: no cover
        return False

    # -- connection events ---------------------------------------------------------------

    def on_head(self, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        self.received = True
        ex = self.exchange
        if ex is None:
            return
        try:
            resp = H2ResponseHead(headers)
        except MalformedHead as exc:
            self._reset(ErrorCodes.PROTOCOL_ERROR)
            ex.on_upstream_failed(502, "upstream_bad_response", str(exc))
            return
        no_content = resp.status in (204, 304) or ex.method == b"HEAD"
        if ended and not no_content:
            if resp.content_length > 0:
                self._malformed(ex, "the response ended before its content-length")
                return
            # An empty body: one that says so (an HTTP/1.1 client's connection would
            # otherwise read on to its close).
            resp.content_length = 0
        elif not no_content:
            self.body_left = resp.content_length
        if ended or no_content:
            mode = BODY_NONE
        elif resp.content_length >= 0:
            mode = BODY_LENGTH
        else:
            mode = BODY_UNTIL_CLOSE
        ex.on_upstream_head(resp, mode)
        if no_content and not ended and self.exchange is ex:
            # A 204, 304 or HEAD response ends with its head (RFC 9110 6.4.1); DATA after
            # it would be forwarded as a body the client does not expect (RFC 9113 8.1.1:
            # malformed). The response is complete: end it, and cancel the stream.
            self._reset(ErrorCodes.CANCEL)
            ex.on_upstream_end(None)

    def on_informational(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.received = True
        if self.exchange is None:
            return
        try:
            self.exchange.on_upstream_informational(H2ResponseHead(headers))
        except MalformedHead:
            pass

    def on_data(self, data: bytes) -> None:
        self.received = True
        if self.body_left > 0:
            self.body_left -= len(data)  # more than that: h2 resets the stream
        if self.exchange is not None and data:
            self.exchange.on_upstream_body(data)

    def on_end(self) -> None:
        ex = self.exchange
        if self.body_left > 0 and ex is not None:
            # h2 checks the sum at a DATA frame with END_STREAM, not when trailers end
            # the stream (RFC 9113 8.1.1: malformed).
            self._malformed(ex, f"the response ended {self.body_left} bytes short of its "
                            "content-length")
            return
        self.exchange = None
        self.done = True
        conn = self.conn
        stream = conn.h2.streams.get(self.sid)
        if stream is not None and not stream.closed:
            # The response is complete before the request (RFC 9113 8.1): what is left
            # of its body will not be sent (stream_done drops it, and the exchange lets
            # go of the upstream). RST_STREAM ends our half, which would otherwise
            # count against the peer's stream limit for good (5.1.2).
            try:
                conn.h2.reset_stream(self.sid, ErrorCodes.CANCEL)
            except h2.exceptions.ProtocolError:
                pass
            conn.want_flush()
        conn.stream_done(self)
        if ex is not None:
            ex.on_upstream_end(response_trailer_fields(self.trailers) or None)

    def on_reset(self, code: int, reason: str | None = None) -> None:
        """The stream was reset: by the upstream, or (with `reason`) by the proxy for a
        malformed response (h2_fast: RFC 9113 8.1.1, a stream error)."""
        ex = self.exchange
        self.exchange = None
        self.done = True
        self.conn.stream_done(self)
        if ex is None:
            return
        if reason:
            ex.on_upstream_failed(502, "upstream_bad_response",
                                  f"malformed response from upstream: {reason}")
        elif code == ErrorCodes.REFUSED_STREAM:
            ex.on_upstream_failed(503, "upstream_refused_stream", "upstream refused the stream")
        else:
            name = (ErrorCodes(code).name if code in ErrorCodes._value2member_map_
                    else str(code))
            ex.on_upstream_failed(502, RESET_CODES.get(code, "upstream_stream_error"),
                                  f"upstream reset the stream ({name})")

    def fail(self, status: int, code: str, message: str) -> None:
        ex = self.exchange
        self.exchange = None
        self.done = True
        self.conn.stream_done(self)
        if ex is not None:
            ex.on_upstream_failed(status, code, message)

    # -- StreamOutput ----------------------------------------------------------------------

    def _output_failed(self, exc: Exception) -> None:
        pass  # the stream is over; its end (reset or response) arrives as an event

    def _output_ended(self, ok: bool, exc: Exception | None) -> None:
        if ok:
            self.ended_local = True

    def _pause_producer(self) -> None:
        if self.exchange is not None:
            self.exchange.on_upstream_pause_writing()

    def _resume_producer(self) -> None:
        if self.exchange is not None:
            self.exchange.on_upstream_resume_writing()

    # -- internals ---------------------------------------------------------------------------

    def _malformed(self, ex: Any, why: str) -> None:
        self._reset(ErrorCodes.PROTOCOL_ERROR)
        ex.on_upstream_failed(502, "upstream_bad_response", f"malformed response from upstream: {why}")

    def _reset(self, code: int) -> None:
        conn = self.conn
        if self.done:
            return
        self.done = True
        self.exchange = None
        if not conn.closed and self.sid:
            try:
                conn.h2.reset_stream(self.sid, code)
            except h2.exceptions.ProtocolError:
                pass
            conn.want_flush()
        conn.stream_done(self)
