"""Downstream HTTP/2 (h2c prior knowledge, h2c upgrade, TLS with ALPN) on the h2 library.

One protocol instance per client connection; each stream is an `H2Stream`, the
downstream side of one Exchange. Flow control runs end to end: request DATA is
acknowledged (WINDOW_UPDATE) only once it has been handed to the upstream, and
response data beyond the client's window waits in the stream while the
upstream is paused, so neither direction buffers without bound.

Abuse handling (RFC 9113 and the known CVEs): excess concurrent streams are
refused with RST_STREAM(REFUSED_STREAM) without killing the connection; client
resets are budgeted (CVE-2023-44487 rapid reset), and so are the resets a client
provokes with a frame the proxy must answer with RST_STREAM (CVE-2025-8671,
MadeYouReset); a peer over budget gets GOAWAY(ENHANCE_YOUR_CALM); CONTINUATION floods hit h2's frame backlog limit and
the header list size limit (CVE-2024-27316): a header list over max_header_bytes is
still decoded (HPACK state stays in step) and answered 431 on its stream, but one over
HEADER_LIST_HARD_FACTOR times the limit ends the connection; PING/SETTINGS and frames that carry
no request are budgeted too (h2_budgets.py); a peer that does not read its
socket while sending control frames is cut off once the write buffer passes a
bound.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame, SettingsFrame

from aiproxy.pipeline.ends import BODY_NONE, Downstream, forwarded_lines, response_version
from aiproxy.pipeline.exchange import Exchange
from aiproxy.protocols import h2_fast, replies
from aiproxy.protocols.fields import F_CONTENT_LENGTH, F_HOP, MalformedHead, h2_request_head
from aiproxy.protocols.h2_budgets import (
    IDLE_PER_REQUEST,
    SMALL_DATA_CLIENT,
    SMALL_WINDOW_CLIENT,
    FrameBudgets,
    UnsentAcks,
)
from aiproxy.protocols.h2_output import (
    CONN_OUT_HIGH,
    CONN_OUT_LOW,
    FLUSH_NOW,
    OUTPUT_SLOTS,
    StreamOutput,
    WindowShare,
    open_window,
    release_order,
)
from aiproxy.ratelimit.bucket import Budget
from aiproxy.telemetry.recorder import server_timing

if TYPE_CHECKING:
    from aiproxy.server.app import ProxyServer

log = logging.getLogger("aiproxy.h2")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
STREAM_WINDOW = 256 * 1024
CONNECTION_WINDOW = 4 * 1024 * 1024
WRITE_BUFFER_LIMIT = 8 * 1024 * 1024
RESET_BUDGET = 200.0        # client stream resets (and refused streams) allowed in a burst ...
RESET_REFILL = 100.0        # ... and per second after it (CVE-2023-44487)
SETTINGS_NO_RFC7540_PRIORITIES = 0x9  # RFC 9218 2.1: 0 or 1, else PROTOCOL_ERROR
# RFC 9113 6.5.3: how long the client has to acknowledge our SETTINGS (capped by
# header_timeout_ms, the rest of its handshake's limit), as nghttpx's
# --frontend-http2-settings-timeout (10 s).
SETTINGS_ACK_SECONDS = 10.0
LINGER_SECONDS = 2.0        # how long a closing connection may take to flush its output
EARLY_RESET_SECONDS = 5.0   # a stream answered early is reset this long after at the latest
EARLY_PING = 0xA1 << 56     # PING opaque data: this tag | stream id (see end_early)
DRAIN_PING = struct.pack(">Q", 0xD2 << 56)  # PING opaque data of drain()'s round trip
MAX_STREAM_ID = 2**31 - 1
# What h2 wraps in a plain ProtocolError when a field block cannot be decoded.
HPACK_ERRORS = (hpack.HPACKError, IndexError, TypeError, UnicodeDecodeError)
INFINITY = float("inf")
# A header list over max_header_bytes gets 431 on its stream up to this many times the
# limit; past it (or a header block that long) the connection goes (h2_fast.FastDecoder).
HEADER_LIST_HARD_FACTOR = 4
class _ServerH2(h2_fast.FastReceive, h2.connection.H2Connection):
    """h2 with the corrections of FastReceive (RFC 9113 5.1.2: streams over the limit are
    refused one by one) and two more:
    - RFC 9113 4.3: a field block that cannot be decoded is COMPRESSION_ERROR (h2 says
      PROTOCOL_ERROR).
    - RFC 9113 6.8: a GOAWAY from the client stops new streams, not the ones in flight
      (h2 would refuse to send another frame).
    - RFC 9113 6.8: the GOAWAY of a connection error names the last stream the proxy
      took (`last_request`), not h2's highest: the streams of the read that raised were
      never handled."""

    refuse_excess = True
    settings_seen = False
    last_request = 0  # the id of the last stream the proxy started a request on

    def _terminate_connection(self, error_code: Any) -> None:
        self.state_machine.process_input(h2.connection.ConnectionInputs.SEND_GOAWAY)
        self._prepare_for_sending([GoAwayFrame(0, last_stream_id=self.last_request,
                                               error_code=error_code)])

    def _receive_frame(self, frame: Any) -> list:
        if not self.settings_seen:
            # RFC 9113 3.4: the client preface is the magic and then a SETTINGS frame.
            if type(frame) is not SettingsFrame or "ACK" in frame.flags:
                raise h2.exceptions.ProtocolError("the preface is not followed by SETTINGS")
            self.settings_seen = True
        try:
            return super()._receive_frame(frame)
        except h2.exceptions.ProtocolError as exc:
            if type(exc) is h2.exceptions.ProtocolError and isinstance(exc.__cause__,
                                                                        HPACK_ERRORS):
                exc.error_code = ErrorCodes.COMPRESSION_ERROR
            raise

    def _receive_settings_frame(self, frame: Any) -> tuple[list, list]:
        if frame.settings.get(SETTINGS_NO_RFC7540_PRIORITIES, 0) > 1:
            raise h2.exceptions.ProtocolError("SETTINGS_NO_RFC7540_PRIORITIES not 0 or 1")
        return super()._receive_settings_frame(frame)

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


class H2ServerConnection(asyncio.Protocol):
    def __init__(self, server: ProxyServer, scheme: bytes = b"http",
                 upgrade: tuple[Any, bytes] | None = None) -> None:
        self.server = server
        self.loop = server.loop
        self.scheme = scheme
        self.upgrade = upgrade
        self.transport: asyncio.Transport | None = None
        self.h2: _ServerH2 | None = None
        self.streams: dict[int, H2Stream] = {}
        self.peer = b""
        self.forwarded = b""
        self.writing_paused = False
        self.out_waiting = 0         # response bytes its streams hold for the client's windows
        self.out_high = CONN_OUT_HIGH
        self.out_low = CONN_OUT_LOW
        self.window_share = WindowShare()  # for its streams' HTTP/2 upstream windows
        self.closed = False
        self.receiving = False       # inside data_received, which flushes when done
        self.flush_wanted = False
        self.released_to = 0         # the last stream resume_writing released output of
        self.window_to = 0           # the stream the send window last ran out at
        self.goaway_sent = False
        self.drain_ping = False      # drain() announced the stop; the last GOAWAY is to come
        self.timer: asyncio.Handle | None = None
        # When self.timer is due: a time already past makes uvloop's call_at a plain
        # Handle, which has no when().
        self.timer_at = INFINITY
        self.idle_since = 0.0
        self.partial_since = 0.0     # since when part of a frame waits for the rest
        self.settings_due = 0.0      # when our SETTINGS must be acknowledged by; 0: they are
        self.acks = UnsentAcks()     # PING/SETTINGS ACKs the client has not read yet
        self.resets = Budget(RESET_BUDGET, RESET_REFILL)
        self.requests = 0            # streams opened, for [http] h2_max_requests (the id
                                     # of the last: self.h2.last_request)
        # Settled at the end of data_received.
        self.budgets = FrameBudgets(SMALL_DATA_CLIENT, SMALL_WINDOW_CLIENT)
        self.early: dict[int, asyncio.TimerHandle] = {}  # streams answered early, see end_early
        # After `Upgrade: h2c`, response DATA waits for the client's connection preface.
        # RFC 7540 3.2 would let it go right behind our SETTINGS, but curl 7.88 keeps
        # what arrives behind the 101 in a 32 KiB buffer and fails past it ("curl: (16)
        # connection buffer size is too small ... following HTTP Upgrade response
        # header"), seen with MiB responses when this wait was taken out. HEADERS do
        # not wait.
        self.await_preface = upgrade is not None

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport, data: bytes = b"") -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.peer:  # else a PROXY protocol header named the client
            peer = transport.get_extra_info("peername")
            self.peer = peer[0].encode() if peer else b""
        self.forwarded = forwarded_lines(self.peer, self.scheme)
        self.server.connections.add(self)
        http = self.server.runtime.http
        config = h2.config.H2Configuration(
            client_side=False, header_encoding=None, validate_inbound_headers=True,
            normalize_inbound_headers=True, validate_outbound_headers=False,
            normalize_outbound_headers=False)
        conn = _ServerH2(config=config)
        conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: http.h2_max_concurrent_streams,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: http.max_header_bytes,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
        })
        conn.decoder.max_header_list_size = http.max_header_bytes
        conn.decoder.hard_limit = HEADER_LIST_HARD_FACTOR * http.max_header_bytes
        conn.incoming_buffer.block_limit = conn.decoder.hard_limit
        self.h2 = conn
        h2_fast.quiet_hpack_logging()
        self.idle_since = self.reset_at = self.control_at = self.idle_at = self.loop.time()
        if self.upgrade is not None:
            head, settings = self.upgrade
            conn.initiate_upgrade_connection(settings)
        else:
            conn.initiate_connection()
        conn.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self._flush()
        self.settings_due = self.idle_since + min(SETTINGS_ACK_SECONDS,
                                                  http.header_timeout_ms / 1000)
        self._arm_at(self.loop.time() + self.server.runtime.min_timeout)
        if self.upgrade is not None:
            self.requests = conn.last_request = 1
            self._start_stream(1, self.upgrade[0], True)
            self.upgrade = None
            self._flush()
        if data:
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        conn = self.h2
        try:
            events = conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self._connection_error(exc)
            return
        while True:
            if self._handle(events):
                return
            if not conn.incoming_buffer.more:
                break
            try:
                events = conn.receive_data(b"")  # the frames past FRAMES_PER_PASS
            except h2.exceptions.ProtocolError as exc:
                self._connection_error(exc)
                return
        if conn.incoming_buffer.partial():
            if not self.partial_since:
                self.partial_since = self.loop.time()
        else:
            self.partial_since = 0.0
        self._flush()
        if not self.streams and self._spent():
            self._end_spent()  # its last request was malformed

    def _handle(self, events: list) -> bool:
        """Handles one pass of receive_data's events and charges what they cost; True
        once the connection is closed."""
        self.receiving = True
        try:
            if self.await_preface:
                self.await_preface = False
                for stream in list(self.streams.values()):
                    stream.try_send()
            for event in events:
                handler = _HANDLERS.get(type(event))
                if handler is not None:
                    handler(self, event)
                if self.closed:
                    return True
        finally:
            self.receiving = False
        conn = self.h2
        if conn.refused:
            # Streams refused over the concurrency limit cost like client resets
            # (a rapid-reset variant that needs no RST_STREAM from the client).
            n, conn.refused = conn.refused, 0
            if self._charge_resets(n):
                return True
        if not self.budgets.settle(conn, self.loop.time):
            log.warning("client %s floods frames that carry no request (empty or tiny "
                        "DATA, PRIORITY, WINDOW_UPDATE, unknown or on closed streams): GOAWAY",
                        self.peer.decode())
            self._goaway(ErrorCodes.ENHANCE_YOUR_CALM, close=True)
            return True
        return self.closed

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        early, self.early = self.early, {}
        for handle in early.values():
            handle.cancel()
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.lost()

    def pause_writing(self) -> None:
        self.writing_paused = True
        for stream in list(self.streams.values()):
            ex = stream.exchange
            if ex is not None:
                ex.on_client_pause_writing()

    def resume_writing(self) -> None:
        # What the streams queued while paused goes out stream by stream, and stops
        # once the transport pauses again (want_flush writes as it grows): the rest
        # waits for the next resume, instead of all of it landing in the transport's
        # buffer at once and passing for a client that does not read. The next resume
        # starts after the last stream served, so every stream gets its turn.
        self.writing_paused = False
        for stream in release_order(self.streams, self.released_to):
            stream.try_send()
            if self.writing_paused or self.closed:
                self.released_to = stream.sid
                return
            ex = stream.exchange
            if ex is not None and not stream.writing_paused:
                ex.on_client_resume_writing()
        self._flush()

    # -- events -----------------------------------------------------------------------

    def _on_request(self, ev: h2.events.RequestReceived) -> None:
        self.budgets.idle.credit(IDLE_PER_REQUEST)
        if self.goaway_sent or self._spent():
            if not self.goaway_sent:
                # Past h2_max_requests while streams are in flight: GOAWAY now, as
                # nginx's keepalive_requests, naming the last stream served.
                self._goaway(ErrorCodes.NO_ERROR, close=False)
            self._reset_stream(ev.stream_id, ErrorCodes.REFUSED_STREAM)
            return
        self.requests += 1
        self.h2.last_request = ev.stream_id
        try:
            head = h2_request_head(ev.headers, bool(ev.stream_ended))
        except MalformedHead as exc:
            log.info("malformed HTTP/2 request on stream %d: %s", ev.stream_id, exc)
            self._reset_stream(ev.stream_id, ErrorCodes.PROTOCOL_ERROR)
            self._rejected(str(exc))
            self._charge_resets(1)  # CVE-2025-8671: resets the client provokes count too
            return
        too_large = getattr(ev, "header_list_too_large", False)
        if too_large:
            log.info("HTTP/2 request on stream %d: header list over max_header_bytes",
                     ev.stream_id)
            # Each costs a decode of up to 4x the limit and a reply: budgeted like the
            # resets a client provokes, so a stream of them ends in GOAWAY.
            if self._charge_resets(1):
                return
        self._start_stream(ev.stream_id, head, bool(ev.stream_ended), too_large)

    def _on_malformed(self, ev: h2_fast.MalformedStream) -> None:
        log.info("malformed HTTP/2 request on stream %d: %s", ev.stream_id, ev.reason)
        self._rejected(ev.reason)

    def _rejected(self, reason: str) -> None:
        """The access line of a request reset for its malformed head (RFC 9113 8.1.1):
        400, the status an HTTP/1.1 client gets for one."""
        self.server.telemetry.rejected(self.peer, 400, reason, 0, 0, "HTTP/2")

    def _reset_stream(self, sid: int, code: int) -> None:
        """RST_STREAM, unless the stream is closed already: the events of one read are
        handled after h2 has taken all its frames, so a client's RST_STREAM behind the
        frame being handled has closed the stream by now."""
        try:
            self.h2.reset_stream(sid, code)
        except h2.exceptions.ProtocolError:
            pass

    def _start_stream(self, sid: int, head: Any, ended: bool, too_large: bool = False) -> None:
        stream = H2Stream(self, sid, head)
        self.streams[sid] = stream
        ex = Exchange(stream, head, self.loop.time())
        stream.exchange = ex
        if too_large:
            ex.refuse(431, "request header section too large")
            return
        ex.start()
        if not ex.finished and ex.deadline_at < self._timer_due():
            # A grpc-timeout shorter than the timer period: wake up for it.
            self._arm_at(ex.deadline_at)

    def _on_data(self, ev: h2.events.DataReceived) -> None:
        sid = ev.stream_id
        if ev.stream_ended is None:
            self.budgets.data(ev.flow_controlled_length)
        stream = self.streams.get(sid)
        if stream is None or stream.exchange is None or stream.exchange.finished:
            if sid in self.early:
                # Dropped; only the connection's window reopens, so the client can send
                # no more than what is left of the stream's window.
                if ev.flow_controlled_length:
                    self.h2.increment_flow_control_window(ev.flow_controlled_length)
            else:
                self.h2.acknowledge_received_data(ev.flow_controlled_length, sid)
            return
        stream.on_data(ev.data, ev.flow_controlled_length)

    def _on_stream_ended(self, ev: h2.events.StreamEnded) -> None:
        handle = self.early.pop(ev.stream_id, None)
        if handle is not None:
            handle.cancel()  # the client finished its request after all: nothing to reset
        sid = ev.stream_id
        stream = self.streams.get(sid)
        if stream is not None and stream.exchange is not None:
            ex = stream.exchange
            if 0 <= ex.head.content_length != ex.req_bytes and not ex.finished:
                # RFC 9113 8.1.1: malformed. h2 checks the sum at a DATA frame with
                # END_STREAM, not when trailers end the stream; what went upstream stops
                # short of its Content-Length, so that connection goes too (lost()).
                log.info("stream %d ended after %d of %d content-length bytes", sid,
                         ex.req_bytes, ex.head.content_length)
                stream.lost(f"PROTOCOL_ERROR: the body ended after {ex.req_bytes} of "
                            f"{ex.head.content_length} content-length bytes")
                self._reset_stream(sid, ErrorCodes.PROTOCOL_ERROR)
                self.stream_done(stream)
                self._charge_resets(1)
                return
            ex.body_end()

    def _on_trailers(self, ev: h2.events.TrailersReceived) -> None:
        stream = self.streams.get(ev.stream_id)
        if stream is not None:
            stream.request_trailers = ev.headers

    def _on_reset(self, ev: h2.events.StreamReset) -> None:
        handle = self.early.pop(ev.stream_id, None)
        if handle is not None:
            handle.cancel()
        stream = self.streams.pop(ev.stream_id, None)
        if stream is None:
            return
        if ev.remote_reset:
            stream.lost()
        else:  # a stream error of the client's (RFC 9113 5.4.2): h2 has reset the stream
            code = ev.error_code
            name = ErrorCodes(code).name if code in ErrorCodes._value2member_map_ else str(code)
            reason = getattr(ev, "reason", "")
            stream.lost(f"{name}: {reason}" if reason else name)
        self._charge_resets(1)

    def _charge_resets(self, n: int) -> bool:
        """Spend n from the reset budget; True (and GOAWAY) once it is exhausted."""
        if not self.resets.spend(n, self.loop.time()):
            log.warning("client %s reset or overran streams too fast: GOAWAY",
                        self.peer.decode())
            self._goaway(ErrorCodes.ENHANCE_YOUR_CALM, close=True)
            return True
        return False

    def _on_control(self, ev: Any) -> None:
        """A PING or SETTINGS frame, which h2 has already answered with an ACK."""
        self.acks.queued += 1
        if not self.budgets.control.spend(1, self.loop.time()):
            log.warning("client %s floods PING/SETTINGS frames: GOAWAY", self.peer.decode())
            self._goaway(ErrorCodes.ENHANCE_YOUR_CALM, close=True)

    def _on_ping_ack(self, ev: h2.events.PingAckReceived) -> None:
        self.budgets.idle_frames += 1  # owed nothing; unasked-for ones are a flood
        if ev.ping_data == DRAIN_PING:
            if not self.goaway_sent:
                self._goaway(ErrorCodes.NO_ERROR, close=not self.streams)
            return
        (tag,) = struct.unpack(">Q", ev.ping_data)
        if tag & ~0x7FFFFFFF == EARLY_PING:
            self._reset_early(tag & 0x7FFFFFFF)

    def end_early(self, sid: int) -> None:
        """A stream's response is complete while its request is not (RFC 9113 8.1): the
        client is to stop sending with RST_STREAM(NO_ERROR). Not right behind the
        response, though: a client handling the frames of one read together (curl 7.x
        with nghttp2) sees its stream closed before it has taken the response and fails
        (curl exit 92). So a PING goes after the response and the reset follows its ACK,
        by when the client has processed the response; or after EARLY_RESET_SECONDS if
        no ACK comes. Meanwhile request DATA is dropped without reopening the stream's
        window, so at most one stream window of it arrives."""
        if self.closed or sid in self.early:
            return
        try:
            self.h2.ping(struct.pack(">Q", EARLY_PING | sid))
        except h2.exceptions.ProtocolError:
            self._reset_early(sid)
            return
        self.early[sid] = self.loop.call_later(EARLY_RESET_SECONDS, self._reset_early, sid)
        self.want_flush()

    def _reset_early(self, sid: int) -> None:
        handle = self.early.pop(sid, None)
        if handle is None or self.closed:
            return
        handle.cancel()
        try:
            self.h2.reset_stream(sid, ErrorCodes.NO_ERROR)
        except (h2.exceptions.ProtocolError, KeyError):
            return  # closed meanwhile
        self.want_flush()

    def _on_idle_frame(self, ev: Any) -> None:
        self.budgets.idle_frames += 1

    def _on_settings_ack(self, ev: h2.events.SettingsAcknowledged) -> None:
        self.settings_due = 0.0  # only one SETTINGS frame is sent, at the start
        self.budgets.idle_frames += 1

    def _on_window(self, ev: h2.events.WindowUpdated) -> None:
        self.budgets.window_updates += 1
        if ev.stream_id == 0:
            self.window_to = open_window(self.h2, self.streams, self.window_to)
        else:
            stream = self.streams.get(ev.stream_id)
            if stream is not None:
                stream.try_send()

    def _on_settings(self, ev: h2.events.RemoteSettingsChanged) -> None:
        self._on_control(ev)
        if self.closed:
            return
        if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in ev.changed_settings:
            self.window_to = open_window(self.h2, self.streams, self.window_to)

    def _on_terminated(self, ev: h2.events.ConnectionTerminated) -> None:
        # The client is going away: streams it still counts on finish, nothing new starts.
        self.budgets.idle_frames += 1  # a client may repeat its GOAWAY, but not endlessly
        if self.goaway_sent:
            if not self.streams:
                self.close()
        elif not self.streams:
            # RFC 9113 6.8: GOAWAY before closing, behind what h2 has queued (PING ACKs).
            self._goaway(ErrorCodes.NO_ERROR, close=True)
        else:
            # Now, naming the last stream taken: the connection closes when the streams
            # in flight are done, and 6.8 asks for a GOAWAY before any close.
            self._goaway(ErrorCodes.NO_ERROR, close=False)

    # -- output and lifecycle --------------------------------------------------------------

    def want_flush(self) -> None:
        """Write what h2 has queued once this event-loop turn is over: the streams of a
        connection answered in one turn share one write (one syscall)."""
        if self.closed:
            return
        if len(self.h2._data_to_send) >= FLUSH_NOW:
            # Now: a transport that pauses in this write blocks the DATA of the streams
            # that come next in this turn (they queue it, their producers pause), where
            # one write at the end of the turn would hold what all of them produced.
            self._flush()
            return
        if not self.flush_wanted:
            self.flush_wanted = True
            if not self.receiving:
                self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_wanted = False
        if self.closed:
            return
        data = self.h2.data_to_send()
        # A TLS transport closes by itself (the client's close_notify, or its socket
        # lost) before connection_lost() reaches us: uvloop drops what is written then
        # and logs "SSL connection is closed" for each write past the fifth.
        if data and not self.transport.is_closing():
            self.transport.write(data)
            acks = self.acks
            acks.written += len(data)
            size = self.transport.get_write_buffer_size()
            if size > WRITE_BUFFER_LIMIT:
                log.warning("client %s does not read its socket: closing", self.peer.decode())
                self.abort()
            elif (acks.queued or acks.count) and acks.over(size):
                log.warning("client %s does not read the ACKs of its PING/SETTINGS frames: "
                            "GOAWAY", self.peer.decode())
                self._goaway(ErrorCodes.ENHANCE_YOUR_CALM, close=True)

    def _connection_error(self, exc: h2.exceptions.ProtocolError) -> None:
        # h2 has already queued GOAWAY with the error's code (receive_data does that),
        # except for an invalid client preface, checked before: RFC 9113 3.4 lets that
        # GOAWAY be omitted, but it is cheap and tells the client why.
        log.info("HTTP/2 connection error from %s: %s", self.peer.decode(), exc)
        conn = self.h2
        if conn.state_machine.state is not h2.connection.ConnectionState.CLOSED:
            conn._terminate_connection(exc.error_code)
        self.goaway_sent = True
        self._flush()
        self.close()

    def _goaway(self, code: int, close: bool) -> None:
        # RFC 9113 6.8: the last stream taken, not h2's highest: a request parsed in the
        # same read as what ends the connection is dropped unanswered, one behind the
        # client's GOAWAY is refused, and neither may be named.
        last = self.h2.last_request
        if close:
            try:
                self.h2.close_connection(error_code=code, last_stream_id=last)
            except h2.exceptions.ProtocolError:
                pass
            self.goaway_sent = True
            self._flush()
            self.close()
            return
        # Graceful: written by hand, because h2.close_connection() would also refuse to
        # send anything more, and the streams in flight still have to finish.
        self._flush()
        self.goaway_sent = True
        if not self.closed:
            frame = GoAwayFrame(0, last_stream_id=last, error_code=code).serialize()
            self.transport.write(frame)
            self.acks.written += len(frame)

    def stream_done(self, stream: H2Stream) -> None:
        self.streams.pop(stream.sid, None)
        if not self.streams:
            self.idle_since = self.loop.time()
            if self._spent():
                self._end_spent()
            elif self.goaway_sent or (self.server.draining and not self.drain_ping):
                self.close()

    def _spent(self) -> bool:
        """Whether the connection has had its [http] h2_max_requests (one, with
        keep-alive off: keepalive_timeout_ms = 0, as nginx's keepalive_timeout 0)."""
        rt = self.server.runtime
        limit = rt.http.h2_max_requests if rt.keepalive_timeout_ms else 1
        return limit > 0 and self.requests >= limit

    def _end_spent(self) -> None:
        """The connection's last request is over: GOAWAY naming it, and close. Sent once
        no stream is in flight, the GOAWAY is the last frame: a client that takes no
        frame after one (python h2, hence httpx) has its responses whole."""
        if not self.goaway_sent:
            self._goaway(ErrorCodes.NO_ERROR, close=False)
        self.close()

    def drain(self, idle_grace: float = 0.0) -> None:
        """Graceful stop, in two steps (RFC 9113 6.8): GOAWAY with the largest stream id
        and a PING; once its ACK is back, every stream the client opened before it has
        arrived, and the GOAWAY naming the last of them follows. A stream the client
        had on the way when the stop began is served, not refused. The connection closes
        once the streams in flight are done (the drain timeout cuts a client that does
        not answer the PING)."""
        if self.closed or self.goaway_sent or self.drain_ping:
            return
        self.drain_ping = True
        self._flush()
        frame = GoAwayFrame(0, last_stream_id=MAX_STREAM_ID,
                            error_code=ErrorCodes.NO_ERROR).serialize()
        self.transport.write(frame)
        self.acks.written += len(frame)
        try:
            self.h2.ping(DRAIN_PING)
        except h2.exceptions.ProtocolError:
            self._goaway(ErrorCodes.NO_ERROR, close=not self.streams)
            return
        self._flush()

    def close(self) -> None:
        if not self.closed:
            if self.flush_wanted:
                self._flush()  # what the last streams queued (their ends) goes out first
            self.closed = True
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            transport = self.transport
            transport.close()
            if transport.get_write_buffer_size():
                # close() waits for the output to drain: bound the wait, a client that
                # never reads would otherwise keep the socket and its buffer forever.
                self.loop.call_later(LINGER_SECONDS, transport.abort)

    def abort(self) -> None:
        self.close()
        self.transport.abort()

    def _timer_due(self) -> float:
        return self.timer_at if self.timer is not None else INFINITY

    def _arm_at(self, when: float) -> None:
        if self.closed:
            return
        if self.timer is not None:
            self.timer.cancel()
        self.timer_at = when
        self.timer = self.loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        if self.closed:
            return
        rt = self.server.runtime
        http = rt.http
        now = self.loop.time()
        left = rt.min_timeout
        due = self.settings_due
        if due and self.h2.settings_seen:
            # Before the client's preface is in, header_timeout_ms applies (below).
            if now >= due:
                log.info("client %s did not acknowledge SETTINGS: GOAWAY", self.peer.decode())
                self._goaway(ErrorCodes.SETTINGS_TIMEOUT, close=True)
                return
            left = min(left, due - now)
        send_timeout = http.send_timeout_ms / 1000
        for stream in list(self.streams.values()):
            if stream.stalled(now) >= send_timeout:
                # The client took none of the response for send_timeout_ms (its window
                # stays shut): the stream goes, as nginx's send_timeout closes.
                log.info("stream %d: client took no response data for %d ms: reset",
                         stream.sid, http.send_timeout_ms)
                stream.lost()
                stream.clear_output()
                self._reset_stream(stream.sid, ErrorCodes.CANCEL)
                self.stream_done(stream)
                continue
            ex = stream.exchange
            if ex is not None and not ex.finished:
                remaining = ex.check_deadline(now, http.body_timeout_ms / 1000)
                if remaining is not None and remaining < left:
                    left = remaining
        self._flush()
        if not self.streams:
            # Keep-alive off, a connection is idle only before its request: that wait is
            # header_timeout_ms, as for HTTP/1.1. So is the wait for the rest of a frame
            # (or preface) begun: a request head on its way, as nginx's
            # client_header_timeout for an incomplete frame.
            idle_ms = http.keepalive_timeout_ms or http.header_timeout_ms
            idle = self.idle_since + idle_ms / 1000 - now
            if self.partial_since:
                idle = min(idle, self.partial_since + http.header_timeout_ms / 1000 - now)
            if idle <= 0:
                if self.partial_since:
                    log.info("client %s sent part of a frame and not the rest within "
                             "header_timeout_ms: closed", self.peer.decode())
                self._goaway(ErrorCodes.NO_ERROR, close=True)
                return
            left = min(left, idle)
        if not self.closed:
            self._arm_at(self.loop.time() + max(left, 0.001))


_HANDLERS = {
    h2.events.RequestReceived: H2ServerConnection._on_request,
    h2.events.DataReceived: H2ServerConnection._on_data,
    h2.events.StreamEnded: H2ServerConnection._on_stream_ended,
    h2.events.TrailersReceived: H2ServerConnection._on_trailers,
    h2.events.StreamReset: H2ServerConnection._on_reset,
    h2.events.WindowUpdated: H2ServerConnection._on_window,
    h2.events.RemoteSettingsChanged: H2ServerConnection._on_settings,
    h2.events.ConnectionTerminated: H2ServerConnection._on_terminated,
    h2.events.PingReceived: H2ServerConnection._on_control,
    h2.events.PingAckReceived: H2ServerConnection._on_ping_ack,
    h2_fast.MalformedStream: H2ServerConnection._on_malformed,
    h2.events.PriorityUpdated: H2ServerConnection._on_idle_frame,
    h2.events.UnknownFrameReceived: H2ServerConnection._on_idle_frame,
    h2.events.SettingsAcknowledged: H2ServerConnection._on_settings_ack,
}


class H2Stream(StreamOutput, Downstream):
    """One request/response on an HTTP/2 connection: the downstream of an Exchange."""

    __slots__ = ("conn", "sid", "head", "exchange", "pause_mask", "unacked",
                 "request_trailers", "done", "ended", *OUTPUT_SLOTS)

    def __init__(self, conn: H2ServerConnection, sid: int, head: Any) -> None:
        self.conn = conn
        self.sid = sid
        self.head = head
        self.exchange: Exchange | None = None
        self.pause_mask = 0
        self.unacked = 0
        self.request_trailers: list | None = None
        self.done = False
        self.ended = False
        self.loop = conn.loop
        self.server = conn.server
        self.peer = conn.peer
        self.scheme = conn.scheme
        self.forwarded = conn.forwarded
        self._init_output()

    # what the Exchange reads
    @property
    def writing_paused(self) -> bool:
        # producer_paused, not a look at out_size: the upstream stays paused until
        # try_send resumes it (its hysteresis, and the connection's bound).
        return self.conn.writing_paused or self.producer_paused

    def output_paused(self) -> bool:
        return self.writing_paused

    def response_backlog(self) -> int:
        # The connection's transport buffer is not counted: shared by the streams, it
        # is bounded by pause_writing, which output_paused() tells.
        return self.out_size

    def window_share(self) -> WindowShare:
        return self.conn.window_share

    # -- request body flow control ---------------------------------------------------

    def on_data(self, data: bytes, flow_len: int) -> None:
        if self.pause_mask:
            # Hold back this stream's window only: the connection's window is shared by
            # the client's other streams (other calls, perhaps to other upstreams).
            self.unacked += flow_len
            if flow_len:
                self.conn.h2.increment_flow_control_window(flow_len)
        else:
            self.conn.h2.acknowledge_received_data(flow_len, self.sid)
        self.exchange.body_data(data)

    def pause(self, reason: int) -> None:
        self.pause_mask |= reason

    def resume(self, reason: int) -> None:
        if self.pause_mask & reason:
            self.pause_mask &= ~reason
            if not self.pause_mask and self.unacked:
                n, self.unacked = self.unacked, 0
                self._ack(n)

    def _ack(self, n: int) -> None:
        """Open the stream's window for n bytes held back while paused (the connection's
        share was acknowledged when they arrived)."""
        conn = self.conn
        if conn.closed:
            return
        try:
            conn.h2.increment_flow_control_window(n, stream_id=self.sid)
        except (h2.exceptions.ProtocolError, KeyError):
            return  # the stream is over: no window to open
        conn.want_flush()

    # -- response --------------------------------------------------------------------

    def send_continue(self) -> None:
        pass  # HTTP/2 clients send the body without waiting for 100

    def send_informational(self, resp: Any) -> None:
        # RFC 9110 8.6: no Content-Length in a 1xx or 204 response; 7.6.3: a Via on
        # every message forwarded.
        fields = resp.fields(F_HOP | F_CONTENT_LENGTH)
        via = self.server.runtime.via_fields.get(response_version(resp))
        if via is not None:
            fields.append(via)
        self._headers([(b":status", b"%d" % resp.status), *fields], False)

    def send_response(self, ex: Exchange, resp: Any, mode: int) -> bool:
        # One content-length with one value (RFC 9113 8.1.1 and 9110 8.6): an HTTP/1.1
        # upstream's may be a list ("5, 5") or repeated, which an HTTP/2 client rejects
        # as malformed. A 204 has none, nor does a gRPC response (PROTOCOL-HTTP2.md has
        # none in Response-Headers): an upstream that cuts its body short leaves the proxy
        # to end the call with grpc-status 14 trailers, which must not follow a body
        # shorter than a content-length it passed on (RFC 9113 8.1.1).
        fields = [(b":status", b"%d" % resp.status), *resp.fields(F_HOP | F_CONTENT_LENGTH)]
        length = resp.content_length
        if length >= 0 and resp.status != 204 and not ex.grpc:
            fields.append((b"content-length", b"%d" % length))
        route = ex.route
        if route is not None and route.resp_edit:
            remove = route.resp_remove
            if remove:
                fields = [f for f in fields if f[0] not in remove]
            fields += route.resp_add
        rt = self.server.runtime
        via = rt.via_fields.get(ex.resp_version)
        if via is not None:
            fields.append(via)
        if rt.http.server_timing:
            fields.append((b"server-timing", server_timing(ex)))
        if mode == BODY_NONE:
            # One HEADERS frame with END_STREAM: keeps a gRPC trailers-only response one.
            self._headers(fields, True)
            self.ended = True
        else:
            self._headers(fields, False)
        return True

    def send_body(self, data: bytes) -> None:
        if self.ended or self.done:
            return
        self.queue_data(data)
        self.conn.want_flush()

    def flush(self) -> None:
        self.conn.want_flush()

    def send_end(self, trailers: list[tuple[bytes, bytes]] | None) -> None:
        if self.ended or self.done:
            return
        self.queue_end(trailers)

    def send_error(self, ex: Exchange, status: int, message: str, code: str | None,
                   headers: list[tuple[bytes, bytes]] | None = None) -> bool:
        if self.ended or self.done:
            return True
        extra = headers or []
        if ex.grpc:
            # gRPC callers get a trailers-only response, never an HTTP error page.
            ex.grpc_status = replies.grpc_status_for(status, code)
            self._headers([(b":status", b"200"), (b"content-type", b"application/grpc"),
                           (b"grpc-status", b"%d" % ex.grpc_status),
                           (b"grpc-message", quote(message).encode()), *extra], True)
            self.ended = True
            return True
        body = replies.error_body(status, code, message)
        self._headers([(b":status", b"%d" % status), (b"content-type", b"application/json"),
                       (b"content-length", b"%d" % len(body)), (b"server", replies.SERVER),
                       *extra], ex.method == b"HEAD")
        if ex.method == b"HEAD":
            self.ended = True
        else:
            self.send_body(body)
            self.send_end(None)
        return True

    def abort_response(self, code: int = ErrorCodes.INTERNAL_ERROR) -> None:
        self.clear_output()
        self._reset(code)
        self._finish()

    def close(self) -> None:
        self.abort_response(ErrorCodes.CANCEL)

    def exchange_done(self, ex: Exchange, keep_alive: bool) -> None:
        if self.ended:
            self._finish()

    def start_tunnel(self, resp: Any, upgrade: bytes) -> None:  # pragma: no cover
        self.abort_response()

    # -- StreamOutput -----------------------------------------------------------------

    def _blocked(self) -> bool:
        conn = self.conn
        return conn.writing_paused or conn.await_preface

    def _output_failed(self, exc: Exception) -> None:
        log.info("cannot send data on stream %d: %s", self.sid, exc)
        self._finish()

    def _output_ended(self, ok: bool, exc: Exception | None) -> None:
        if not ok:
            log.info("cannot end stream %d: %s", self.sid, exc)
        self.ended = True
        ex = self.exchange
        if ex is None or ex.finished:
            self._finish()

    def _pause_producer(self) -> None:
        if self.exchange is not None:
            self.exchange.on_client_pause_writing()

    def _resume_producer(self) -> None:
        if self.exchange is not None:
            self.exchange.on_client_resume_writing()

    # -- internals ---------------------------------------------------------------------

    def _headers(self, fields: list[tuple[bytes, bytes]], end: bool) -> None:
        conn = self.conn
        if conn.closed:
            return
        try:
            h2_fast.send_headers(conn.h2, self.sid, fields, end)
        except h2.exceptions.ProtocolError as exc:
            log.info("cannot send headers on stream %d: %s", self.sid, exc)
            self._finish()
            return
        conn.want_flush()

    def _reset(self, code: int) -> None:
        conn = self.conn
        if conn.closed or self.done:
            return
        conn._reset_stream(self.sid, code)
        conn.want_flush()

    def _finish(self) -> None:
        if self.done:
            return
        ex = self.exchange
        if (ex is not None and not ex.req_done and self.ended
                and not 0 <= ex.head.content_length <= ex.req_bytes):
            # RFC 9113 8.1: a complete response may end the request early (not worth it
            # when all the declared body is in and only END_STREAM is still to come).
            self.conn.end_early(self.sid)
        self.done = True
        self.clear_output()  # unsent when it failed: out of the connection's total
        self.conn.stream_done(self)

    def lost(self, stream_error: str | None = None) -> None:
        """The client reset the stream or the connection went away; or, `stream_error`
        says why, the proxy reset it for the client's protocol error."""
        self.done = True
        self.clear_output()
        ex = self.exchange
        if ex is not None:
            if stream_error is not None and not ex.finished:
                ex.stream_error = stream_error
            ex.on_client_lost()


def is_preface(data: bytes | bytearray) -> bool:
    return data[:len(PREFACE)] == PREFACE


def preface_pending(data: bytes | bytearray) -> bool:
    """True while data could still become the HTTP/2 connection preface."""
    return len(data) < len(PREFACE) and PREFACE.startswith(bytes(data))


