"""Flow-controlled output of one HTTP/2 stream, the same on both sides of the proxy:
the response to a client (h2_server.H2Stream) and the request body to an upstream
(h2_upstream.H2UpstreamStream).

DATA goes out as far as the peer's windows allow; the rest waits in `out` until a
WINDOW_UPDATE (or SETTINGS) calls try_send(). Past OUT_HIGH waiting bytes the producer
(the other side of the exchange) is paused, and resumed below half of it, so a peer that
stops reading holds back its sender instead of growing a buffer here. The end of the
stream (END_STREAM, or trailers) waits behind the data.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from h2.exceptions import ProtocolError

from aiproxy.protocols import h2_fast

OUT_HIGH = 256 * 1024  # waiting bytes per stream before the producer is paused
OUTPUT_SLOTS = ("out", "out_size", "end_pending", "trailers_pending", "producer_paused",
                "out_sent", "stall_seen", "stall_since")


class StreamOutput:
    """Base of a stream that sends DATA. Subclasses have `conn` (with .h2, .closed and
    want_flush()), `sid` and `done`, and say when the connection cannot take more now
    (_blocked), what an h2 refusal means (_output_failed), what follows the end
    (_output_ended) and how to pause/resume their producer."""

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
        elif data:
            self._send(data)
        if self.out_size > OUT_HIGH and not self.producer_paused:
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
        if window > 0:
            frame = h2c.max_outbound_frame_size
            try:
                if n <= window and n <= frame:
                    h2_fast.send_data(h2c, stream, data)
                    off = n
                else:
                    view = memoryview(data)
                    while off < n and window > 0:
                        size = min(n - off, window, frame)
                        h2_fast.send_data(h2c, stream, view[off:off + size])
                        off += size
                        window -= size
            except ProtocolError as exc:
                self._output_failed(exc)
                return
        self.out_sent += off
        if off < n:
            rest = data[off:] if off else data
            self.out.append(rest)
            self.out_size += len(rest)

    def try_send(self) -> None:
        """Send what waited for window; end the stream if its end was waiting too."""
        if self.done:
            return
        out = self.out
        while out:
            data = out.popleft()
            self.out_size -= len(data)
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
        if self.producer_paused and self.out_size <= OUT_HIGH // 2:
            self.producer_paused = False
            self._resume_producer()
        self.conn.want_flush()

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
