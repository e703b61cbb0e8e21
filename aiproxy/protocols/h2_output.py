"""Flow-controlled output of one HTTP/2 stream, the same on both sides of the proxy:
the response to a client (h2_server.H2Stream) and the request body to an upstream
(h2_upstream.H2UpstreamStream).

DATA goes out as far as the peer's windows allow; the rest waits in `out` until a
WINDOW_UPDATE (or SETTINGS) calls try_send(). Past OUT_HIGH waiting bytes the producer
(the other side of the exchange) is paused, and resumed below half of it, so a peer that
stops reading holds back its sender instead of growing a buffer here. The end of the
stream (END_STREAM, or trailers) waits behind the data.

The bytes waiting across all of a connection's streams are bounded too (`out_waiting`,
`out_high` and `out_low` of the connection): without that, a client that keeps the
windows of h2_max_concurrent_streams streams shut pins that many times OUT_HIGH
(CVE-2019-9517, internal data buffering). Past the connection's mark, a stream that adds
to the total has its producer paused as well; it resumes once its own queue is empty, or
is back under half of OUT_HIGH while the connection's total is under `out_low`. A stream
whose client reads thus never waits for the others.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from typing import Any

from h2.exceptions import ProtocolError

from aiproxy.protocols import h2_fast

OUT_HIGH = 256 * 1024  # waiting bytes per stream before the producer is paused
# Waiting bytes per client connection before the streams adding to them are paused:
# 1 MiB, Envoy's per_connection_buffer_limit_bytes default; four streams' worth of
# OUT_HIGH, so a few stalled streams do not slow the others. Past it a stream holds at
# most what its producer handed over in one piece (an HTTP/1.1 upstream read: 64 KiB
# slabs; an HTTP/2 upstream may still send what is left of the stream window it has).
CONN_OUT_HIGH = 4 * OUT_HIGH
CONN_OUT_LOW = CONN_OUT_HIGH // 2
# The window growth past their initial window that the HTTP/2 upstream streams of one
# client connection share (h2_upstream): four streams' worth of a full 1 MiB window.
CLIENT_WINDOW_SHARE = 4 * 1024 * 1024
# A send window narrower than this, and than half the widest the peer has granted
# (if that was as wide as this), waits for the peer's next update instead of being
# sent a small frame (_send).
SILLY_WINDOW = 1024
# Output h2 holds that a connection's want_flush() writes at once instead of at the end
# of the turn, so that a transport pausing in that write stops the streams after it.
FLUSH_NOW = 256 * 1024


def release_order(streams: dict[int, Any], released_to: int) -> list[Any]:
    """A connection's streams (by id, in id order) in the order its resume_writing
    releases their output: from the first after `released_to`, the stream the last
    resume stopped at, round to the ones before it, so every stream gets its turn."""
    order = list(streams.values())
    start = bisect_right(list(streams), released_to)
    return order[start:] + order[:start]


def open_window(h2c: Any, streams: dict[int, Any], start: int) -> int:
    """The connection's send window opened (a WINDOW_UPDATE on stream 0, or a larger
    SETTINGS_INITIAL_WINDOW_SIZE): each stream sends what waited, from the first after
    `start`, the stream the window last ran out at, round to the ones before it. In id
    order, a stream with more queued than each update opens took every update and the
    others waited until it ended. Returns where the window ran out (narrower than
    SILLY_WINDOW, which a stream with more waiting does not send into) this time, or
    `start`."""
    ran_out = 0
    for stream in release_order(streams, start):
        stream.try_send()
        if not ran_out and h2c.outbound_flow_control_window < SILLY_WINDOW:
            ran_out = stream.sid
    return ran_out or start


OUTPUT_SLOTS = ("out", "out_size", "end_pending", "trailers_pending", "producer_paused",
                "out_sent", "stall_seen", "stall_since", "max_window")


class StreamOutput:
    """Base of a stream that sends DATA. Subclasses have `conn` (with .h2, .closed,
    want_flush() and the out_waiting/out_high/out_low of the bound above), `sid` and
    `done`, and say when the connection cannot take more now (_blocked), what an h2
    refusal means (_output_failed), what follows the end (_output_ended) and how to
    pause/resume their producer."""

    # Slots of its own would clash with the compiled base of a subclass (ends.pxd):
    # subclasses list OUTPUT_SLOTS in theirs.
    __slots__ = ()

    conn: Any
    sid: int
    done: bool

    def _init_output(self) -> None:
        self.out: deque[bytes] = deque()
        self.out_size = 0
        self.end_pending = False
        self.trailers_pending: list | None = None
        self.producer_paused = False
        self.out_sent = 0  # bytes sent as DATA so far
        self.stall_seen = -1  # out_sent at the last stalled() look ...
        self.stall_since = 0.0  # ... and since when it has not moved
        self.max_window = 0  # the widest send window seen (the stream's and connection's)

    def stalled(self, now: float) -> float:
        """Seconds that data has waited here without a byte of it going out (0: none
        waits, or some went out since the last look)."""
        if not self.out and not self.end_pending:
            self.stall_seen = -1
            return 0.0
        if self.out_sent != self.stall_seen:
            self.stall_seen = self.out_sent
            self.stall_since = now
            return 0.0
        return now - self.stall_since

    # -- what subclasses define -----------------------------------------------------

    def _blocked(self) -> bool:
        return self.conn.writing_paused

    def _output_failed(self, exc: Exception) -> None:
        raise NotImplementedError

    def _output_ended(self, ok: bool, exc: Exception | None) -> None:
        raise NotImplementedError

    def _pause_producer(self) -> None:
        raise NotImplementedError

    def _resume_producer(self) -> None:
        raise NotImplementedError

    # -- output -----------------------------------------------------------------------

    def queue_data(self, data: bytes) -> None:
        """Send data now as far as the windows allow, queue the rest."""
        if self.out:
            self.out.append(data)
            self.out_size += len(data)
            self.conn.out_waiting += len(data)
        elif data:
            self._send(data)
        if self.out_size and not self.producer_paused and (
                self.out_size > OUT_HIGH or self.conn.out_waiting > self.conn.out_high):
            self.producer_paused = True
            self._pause_producer()

    def queue_end(self, trailers: list[tuple[bytes, bytes]] | None) -> None:
        """End the stream (with trailers, if any) once the queued data is out."""
        if self.out:
            self.end_pending = True
            self.trailers_pending = trailers
            return
        self._end(trailers)

    def clear_output(self) -> None:
        self.conn.out_waiting -= self.out_size
        self.out.clear()
        self.out_size = 0
        self.end_pending = False

    def _send(self, data: bytes) -> None:
        conn = self.conn
        if conn.closed or self.done:
            return
        h2c = conn.h2
        if self._blocked():
            stream, window = None, 0
        else:
            try:
                stream, window = h2_fast.stream_window(h2c, self.sid)
            except ProtocolError as exc:
                self._output_failed(exc)
                return
        n = len(data)
        off = 0
        if window > self.max_window:
            self.max_window = window
        elif (window < n and window < SILLY_WINDOW and 2 * window < self.max_window
                and self.max_window >= SILLY_WINDOW):
            # Silly window avoidance (RFC 1122 4.2.3.4, for TCP): a window opened by
            # a few bytes while more waits, and the peer has granted one at least
            # twice as wide (and SILLY_WINDOW), waits for the peer's next update.
            # Sending whatever opens keeps a window cut into small pieces for good (a
            # client that answers each DATA frame with its size answers a small frame
            # with a small update), each piece a frame. A peer that only ever grants a
            # few bytes gets them as they open (and is charged: budgets.window_cut).
            window = 0
        if window > 0:
            frame = h2c.max_outbound_frame_size
            try:
                if n <= window and n <= frame:
                    h2_fast.send_data(h2c, stream, data)
                    off = n
                else:
                    view = memoryview(data)
                    size = 0
                    while off < n and window > 0:
                        size = min(n - off, window, frame)
                        h2_fast.send_data(h2c, stream, view[off:off + size])
                        off += size
                        window -= size
                    if off < n:
                        conn.budgets.window_cut(size)
            except ProtocolError as exc:
                self._output_failed(exc)
                return
        self.out_sent += off
        if off < n:
            rest = data[off:] if off else data
            self.out.append(rest)
            self.out_size += len(rest)
            conn.out_waiting += len(rest)

    def try_send(self) -> None:
        """Send what waited for window; end the stream if its end was waiting too."""
        if self.done:
            return
        out = self.out
        conn = self.conn
        while out:
            data = out.popleft()
            self.out_size -= len(data)
            conn.out_waiting -= len(data)
            before = len(out)
            self._send(data)
            if self.done:
                return
            if len(out) > before:
                # _send appended the unsent rest at the back: put it first again.
                out.rotate(1)
                break
        if not out and self.end_pending:
            self.end_pending = False
            self._end(self.trailers_pending)
        # Not while the connection cannot write (its transport paused): what the
        # producer sent would only queue here; the connection's resume comes back.
        if self.producer_paused and not self._blocked() and (not self.out_size or (
                self.out_size <= OUT_HIGH // 2 and conn.out_waiting <= conn.out_low)):
            self.producer_paused = False
            self._resume_producer()
        conn.want_flush()

    def _end(self, trailers: list[tuple[bytes, bytes]] | None) -> None:
        conn = self.conn
        if conn.closed or self.done:
            return
        try:
            if trailers:
                h2_fast.send_headers(conn.h2, self.sid, trailers, end_stream=True)
            else:
                h2_fast.end_stream(conn.h2, self.sid)
        except ProtocolError as exc:
            self._output_ended(False, exc)
            return
        self._output_ended(True, None)
        conn.want_flush()


class WindowShare:
    """Bytes of upstream stream window one client connection's streams may still grow
    into: each stream holds what it took until it ends, so all of them together keep at
    most CLIENT_WINDOW_SHARE more in flight than their initial windows, whatever the
    client reads first and stops reading after."""

    __slots__ = ("left",)

    def __init__(self, size: int = CLIENT_WINDOW_SHARE) -> None:
        self.left = size

    def take(self, n: int) -> int:
        """Up to n bytes of the share (what is left of it)."""
        if n > self.left:
            n = self.left
        self.left -= n
        return n

    def give(self, n: int) -> None:
        self.left += n
