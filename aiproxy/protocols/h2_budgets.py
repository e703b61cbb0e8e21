"""What an HTTP/2 peer, client or upstream, may make the proxy do for nothing.

Every frame costs Python work whatever it carries. Frames that move no request or
response along are charged to budgets, and a peer that overdraws one gets
GOAWAY(ENHANCE_YOUR_CALM):
- PING and SETTINGS, each owed an ACK (CVE-2019-9512 ping flood, 9515 settings flood);
- frames that carry nothing (9513 PRIORITY, 9518 empty DATA, unknown frame types,
  WINDOW_UPDATE, PING and SETTINGS ACKs, a repeated GOAWAY), frames on closed streams,
  each answered with RST_STREAM (9514), and any frame that raised no event at all
  (RST_STREAM or WINDOW_UPDATE on a stream gone);
- DATA frames a client's window cuts small (9511 data dribble; SMALL_WINDOW_CLIENT).
The idle-frame budget refills with time, and with work the peer asked for: each
request. WINDOW_UPDATEs that answer DATA the proxy sent are not idle: up to
ACKS_PER_DATA_SENT of them for each DATA frame, whenever they come. They used to be
charged, against a credit for each DATA frame sent that the budget could not hold once
full: a client that read a burst of frames late (a token stream of small frames, or
MiBs waiting in socket buffers under load) and answered each one got
GOAWAY(ENHANCE_YOUR_CALM). A peer may hold its answers back, but never sends more of
them free than the DATA frames it got called for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from aiproxy.ratelimit.bucket import Budget

CONTROL_BUDGET = 1000.0     # PING and SETTINGS frames allowed in a burst ...
CONTROL_REFILL = 100.0      # ... and per second after it
# ACKs of PING and SETTINGS written but still in the connection's output buffer behind
# what a client does not read: under the budget's refill they would pile up for as long
# as it keeps a stream open (nghttp2's max_outbound_ack, Envoy's
# max_outbound_control_frames: 1000). Below CONTROL_BUDGET, so a burst trips it too.
UNSENT_ACKS_LIMIT = 256
IDLE_BUDGET = 2000.0
IDLE_REFILL = 500.0
IDLE_PER_REQUEST = 8.0
ACKS_PER_DATA_SENT = 2  # a DATA frame's WINDOW_UPDATEs: its stream's and the connection's
# A DATA frame costs the proxy about the same whatever it carries, so a client's frame
# that carries less than this many bytes (data and padding: both cost the sender its
# window, RFC 9113 6.9.1) is charged the part of a frame it leaves empty:
# 1-byte frames (each dispatched in Python, about 20 us) cannot keep a worker busy
# either. An upstream's small frames are response bytes the client asked for (a token
# stream): only its empty ones are charged.
SMALL_DATA_CLIENT = 64
SMALL_DATA_UPSTREAM = 1
# The other way (CVE-2019-9511, data dribble): a client that opens its windows a byte at
# a time has the proxy send a DATA frame for each byte, each WINDOW_UPDATE answered by
# a frame, so that the allowance of ACKS_PER_DATA_SENT never runs out. A DATA frame the
# client's window cut to fewer than this many bytes, more waiting behind it, is charged
# the part it leaves empty. A window that narrow waits for the next update instead
# (h2_output.SILLY_WINDOW) once the client has granted a wider one, so it is mostly a
# client that never grants 1 KiB that is charged. An upstream is not charged for its
# windows.
SMALL_WINDOW_CLIENT = 1024
SMALL_WINDOW_UPSTREAM = 0


class FrameBudgets:
    """The control and idle-frame budgets of one HTTP/2 connection. The caller counts
    frames as events arrive and settles once per read (`settle`), so a read of many
    frames costs one refill."""

    __slots__ = ("control", "idle", "idle_frames", "window_updates", "acks_owed",
                 "data_sent_seen", "small_data", "small_window")

    def __init__(self, small_data: int, small_window: int) -> None:
        self.control = Budget(CONTROL_BUDGET, CONTROL_REFILL)
        self.idle = Budget(IDLE_BUDGET, IDLE_REFILL)
        self.idle_frames = 0.0
        self.window_updates = 0  # WINDOW_UPDATE frames since the last settle
        self.acks_owed = 0  # WINDOW_UPDATEs the DATA frames sent may still call for
        self.data_sent_seen = 0
        self.small_data = small_data
        self.small_window = small_window

    def data(self, n: int) -> None:
        """A DATA frame that did not end its stream, n bytes flow-controlled."""
        if n < self.small_data:
            self.idle_frames += 1 - n / self.small_data

    def window_cut(self, n: int) -> None:
        """A DATA frame sent, n bytes: all the peer's window let through of more."""
        if n < self.small_window:
            self.idle_frames += 1 - n / self.small_window

    def settle(self, conn: Any, clock: Callable[[], float]) -> bool:
        """Charge the idle frames counted since the last call, the WINDOW_UPDATEs past
        those the DATA frames sent on `conn` call for (those on streams that have ended
        too), and the frames on closed streams h2_fast.FastReceive counted on `conn`;
        False once overdrawn. `clock` is read
        only when there is something to charge."""
        updates = self.window_updates + conn.closed_window_updates
        if updates:
            self.window_updates = 0
            conn.closed_window_updates = 0
            sent = conn.data_frames_sent
            if sent != self.data_sent_seen:
                self.acks_owed += (sent - self.data_sent_seen) * ACKS_PER_DATA_SENT
                self.data_sent_seen = sent
            answers = min(updates, self.acks_owed)
            self.acks_owed -= answers
            updates -= answers
        n = self.idle_frames + conn.closed_frames + updates
        if not n:
            return True
        self.idle_frames = 0.0
        conn.closed_frames = 0
        return self.idle.spend(n, clock())


class UnsentAcks:
    """The ACKs of PING/SETTINGS frames a connection wrote that are still in its
    transport's (FIFO) buffer, behind what its peer does not read: the caller adds to
    `queued` for each ACK h2 queued, and calls wrote() after each write."""

    __slots__ = ("queued", "written", "marks", "count")

    def __init__(self) -> None:
        self.queued = 0          # ACKs queued since the last write
        self.written = 0         # bytes written to the transport
        self.marks: deque[tuple[int, int]] = deque()  # (written up to their end, how many)
        self.count = 0           # ACKs in the transport's buffer

    def wrote(self, n: int, buffered: int) -> bool:
        """n bytes just written, `buffered` now in the transport's buffer: True when
        more than UNSENT_ACKS_LIMIT ACKs wait in it (and the count starts over)."""
        self.written += n
        if not (self.queued or self.count):
            return False
        return self.over(buffered)

    def over(self, buffered: int) -> bool:
        """wrote() once `written` is counted and there are ACKs to follow (a caller on
        a hot path tests `queued or count` itself and skips the call)."""
        sent = self.written - buffered
        marks = self.marks
        while marks and marks[0][0] <= sent:
            self.count -= marks.popleft()[1]
        if self.queued:
            if buffered:
                marks.append((self.written, self.queued))
                self.count += self.queued
            self.queued = 0
        if self.count > UNSENT_ACKS_LIMIT:
            marks.clear()
            self.count = 0
            return True
        return False
