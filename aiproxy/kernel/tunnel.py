"""The kernel splice of one proxied tunnel (an Upgrade after its 101), on the event loop.

The Exchange has two asyncio transports (client and upstream) that so far copied bytes
in user space. :class:`TunnelSplice` moves them into sk_splice:

1. both transports stop reading; bytes already read in user space (the client's bytes
   after the upgrade request, the upstream's after its 101) were written by the copy
   path before this point, and the splice waits until both write buffers are empty,
   so those bytes are in the kernel's send queues ahead of anything spliced;
2. both sockets go into the sockhash (what arrived meanwhile is handed to the verdict
   program in order by the splicer's nudge) and the kernel carries the bytes. The
   transports stay paused: the kernel still wakes readers for every redirected skb, so
   a reading transport would pay a wakeup and an empty read() per skb. Instead
   :class:`HangupWatch` waits for EPOLLRDHUP/ERR/HUP only (those wakeups are filtered
   in the kernel), then resumes that transport, which reads the EOF or the error and
   drives the usual protocol callbacks;
3. a direction whose bytes reached its socket before the other socket had joined the
   map is passed back to user space by the verdict (Splicer.passed), to its end: the
   tunnel reads that socket itself and writes to the peer transport, and resumes the
   transport only once the sockmap's recv() of 0 is a real EOF (Splicer.at_eof);
4. on EOF from one side, :meth:`after_flush` waits until the kernel has put every byte
   it redirected from that side into the peer's send queue before the caller
   half-closes the peer (a shutdown before that would lose the tail);
5. :meth:`release` (both sides done, or one lost) takes the pair out of the maps.

If any step fails the tunnel simply stays on the copy path (reading resumes).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import select
import socket
import struct
import termios
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .libbpf import BPFError

if TYPE_CHECKING:
    from .lifecycle import ProxyKernel
    from .splice import SplicedPair

log = logging.getLogger("aiproxy.kernel")

DOWN_TO_UP = 1  # after_flush: client -> upstream bytes
UP_TO_DOWN = 2  # upstream -> client bytes
BOTH = DOWN_TO_UP | UP_TO_DOWN

TCP_ESTABLISHED = 1  # tcpi_state
POLL_S = 0.001
FLUSH_TIMEOUT_S = 10.0
FLUSH_POLL_MAX_S = 0.02
DRAIN_READS = 64  # reads that must empty a receive queue before a splice
COPY_READ = 256 * 1024

_DRAINING, _SPLICED, _COPYING, _RELEASED = range(4)


class HangupWatch:
    """One epoll set for the process, registered with the loop: calls back once when a
    socket's peer half-closes or the socket fails. Not woken by incoming data."""

    EVENTS = select.EPOLLRDHUP | select.EPOLLERR | select.EPOLLHUP

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.epoll = select.epoll()
        self.callbacks: dict[int, Callable[[], Any]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
            callback: Callable[[], Any]) -> None:
        if self.loop is None:
            self.loop = loop
            loop.add_reader(self.epoll.fileno(), self._ready)
        self.epoll.register(sock.fileno(), self.EVENTS)
        self.callbacks[sock.fileno()] = callback

    def discard(self, sock: socket.socket) -> None:
        if self.callbacks.pop(sock.fileno(), None) is not None:
            self.epoll.unregister(sock.fileno())

    def _ready(self) -> None:
        for fd, _events in self.epoll.poll(0):
            callback = self.callbacks.pop(fd, None)
            if callback is not None:
                self.epoll.unregister(fd)
                callback()

    def close(self) -> None:
        if self.loop is not None:
            self.loop.remove_reader(self.epoll.fileno())
        self.epoll.close()
        self.callbacks.clear()


def _dup_socket(transport: asyncio.Transport) -> socket.socket:
    """A socket object of our own for the transport's socket (the loop keeps its fd)."""
    return socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))


def _queued(sock: socket.socket) -> int:
    """Bytes waiting in the socket's receive queue (SIOCINQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def _drain(sock: socket.socket, peer: asyncio.Transport) -> int:
    """Empty the socket's receive queue into the peer: the bytes moved, -1 if it would
    not empty.

    The verdict program is handed every skb still in the receive queue when the socket
    joins the map, from the skb's start, even one user space has read part of (a read
    into a 64 KiB buffer can stop inside a large loopback skb, and TCP appends new
    segments to the last queued skb): its read bytes would go out twice. Once the queue
    has been empty, what arrives later is in new, unread skbs, which the kernel may
    take whole; the paused transports read nothing more."""
    moved = 0
    for _ in range(DRAIN_READS):
        n = _queued(sock)
        if not n:
            return moved
        data = sock.recv(n, socket.MSG_DONTWAIT)
        if not data:
            return moved  # EOF: the socket is no longer established; the caller copies
        peer.write(data)
        moved += len(data)
    return -1


def _established(sock: socket.socket) -> bool:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == TCP_ESTABLISHED


class TunnelSplice:
    __slots__ = ("kernel", "loop", "down", "up", "pair", "socks", "task", "state", "waiters",
                 "drained", "released", "was_spliced", "copying", "copied", "pending", "eof_wait",
                 "held")

    def __init__(self, kernel: ProxyKernel, loop: asyncio.AbstractEventLoop,
                 down: asyncio.Transport, up: asyncio.Transport) -> None:
        self.kernel = kernel
        self.loop = loop
        self.down = down
        self.up = up
        self.pair: SplicedPair | None = None
        self.socks: tuple[socket.socket, ...] = ()
        self.state = _DRAINING
        self.waiters: set[asyncio.Task] = set()
        self.drained = (0, 0)  # bytes (down->up, up->down) read here before splicing
        self.released = (0, 0)  # bytes the kernel moved, once released
        self.was_spliced = False
        self.copying = [False, False]  # a passed direction read here (down, up socket)
        self.copied = [0, 0]  # bytes read here from each socket since the splice
        self.pending: list[memoryview | None] = [None, None]  # read, not yet sent
        self.eof_wait: list[float | None] = [None, None]
        # Reading is ours until we give it back (_let_go): see holds().
        self.held = [True, True]
        down.pause_reading()
        up.pause_reading()
        self.task: asyncio.Task | None = loop.create_task(self._splice())

    @property
    def spliced(self) -> bool:
        return self.state == _SPLICED

    def holds(self, side: int) -> bool:
        """True while this splice keeps side 0 (client) or 1 (upstream) from reading.

        The protocols' flow control must not resume such a transport: while draining, a
        read of part of an skb would send those bytes twice (the verdict program takes
        the whole skb); once spliced, the kernel is the reader. Their resume_writing
        callbacks check this and leave the transport to the splice."""
        return self.held[side]

    def _let_go(self, side: int) -> None:
        self.held[side] = False
        t, peer = (self.down, self.up) if side == 0 else (self.up, self.down)
        if t.is_closing():
            return
        if not peer.is_closing() and (peer.get_write_buffer_size()
                                      > peer.get_write_buffer_limits()[1]):
            # The peer is over its high-water mark (the drain's writes, say): its
            # protocol's resume_writing resumes this side, now that holds() is False.
            return
        t.resume_reading()

    def moved(self) -> tuple[int, int]:
        """Bytes (down->up, up->down) carried outside the transports: read while draining
        plus what the kernel redirected (live while spliced, final once released)."""
        counts = self.released
        if self.pair is not None:
            counts = self.kernel.splicer.redirected(self.pair)
        return (self.drained[0] + self.copied[0] + counts[0],
                self.drained[1] + self.copied[1] + counts[1])

    async def _splice(self) -> None:
        down, up = self.down, self.up
        try:
            while down.get_write_buffer_size() or up.get_write_buffer_size():
                if down.is_closing() or up.is_closing():
                    return
                await asyncio.sleep(POLL_S)
            if down.is_closing() or up.is_closing():
                return
            try:
                self.socks = (_dup_socket(down), _dup_socket(up))
                to_up = _drain(self.socks[0], up)
                to_down = _drain(self.socks[1], down) if to_up >= 0 else -1
                self.drained = (max(to_up, 0), max(to_down, 0))
                if to_down < 0:
                    self._close_socks()  # a sender faster than the drain: keep copying
                    return
                while down.get_write_buffer_size() or up.get_write_buffer_size():
                    if down.is_closing() or up.is_closing():
                        self._close_socks()
                        return
                    await asyncio.sleep(POLL_S)
                if not all(map(_established, self.socks)):
                    # A side already half-closed (e.g. the client's FIN came with its
                    # request): the kernel only splices established sockets. Copy it.
                    self._close_socks()
                    return
                self.pair = self.kernel.splicer.splice(*self.socks)
            except (BPFError, OSError) as exc:
                self._close_socks()
                self.kernel.splice_failed(exc)
                return
            self.state = _SPLICED
            self.was_spliced = True
            self.kernel.tunnels_spliced += 1
            passed = self.kernel.splicer.passed(self.pair)
            for side, sock in enumerate(self.socks):
                if passed[side]:
                    # Bytes came before the pair was armed: this direction is ours.
                    self.copying[side] = True
                    self.loop.add_reader(sock.fileno(), self._copy, side)
                else:
                    # The transport reads the EOF or the error once there is one.
                    self.kernel.watch.add(self.loop, sock, lambda side=side: self._let_go(side))
        finally:
            self.task = None
            if self.state == _DRAINING:
                self.state = _COPYING
                self.kernel.tunnels_copied += 1
                self._let_go(0)
                self._let_go(1)

    def _copy(self, side: int) -> None:
        """Reader of a passed direction: forward what the verdict passed back, socket to
        socket, in order; hand the socket back to its transport at the real EOF (or an
        error), which then drives the protocol's usual EOF path.

        It writes to the peer's socket, not its transport: the source transport stays
        paused (holds()) until the real EOF, since its own reads would take a sockmap
        recv() of 0 for the EOF, and the peer transport's buffer would only be a second
        queue in front of the socket."""
        sock, dest = self.socks[side], self.socks[1 - side]
        try:
            data = sock.recv(COPY_READ, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = None  # the transport reads the error itself
        if data:
            self.copied[side] += len(data)
            self.eof_wait[side] = None  # a later 0 gets its own grace period
            try:
                sent = dest.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:
                sent = len(data)  # the peer is gone: its transport reports it
            if sent < len(data):
                self.pending[side] = memoryview(data)[sent:]
                self.loop.remove_reader(sock.fileno())
                self.loop.add_writer(dest.fileno(), self._flush_copy, side)
            return
        if data is not None and not self.kernel.splicer.at_eof(self.pair, sock,
                                                              self.copied[side]):
            # A recv() of 0 that poll() does not back: the stream goes on.
            now = self.loop.time()
            since = self.eof_wait[side] = self.eof_wait[side] or now
            if now - since < FLUSH_TIMEOUT_S:
                self.loop.remove_reader(sock.fileno())
                self.loop.call_later(POLL_S, self._resume_copy, side)
                return
            log.warning("spliced tunnel: recv() kept returning 0 without a hang-up; "
                        "taking it as the end")
        self.loop.remove_reader(sock.fileno())
        self.copying[side] = False
        self._let_go(side)

    def _flush_copy(self, side: int) -> None:
        dest, rest = self.socks[1 - side], self.pending[side]
        try:
            sent = dest.send(rest, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            sent = len(rest)
        rest = rest[sent:]
        if rest:
            self.pending[side] = rest
            return
        self.pending[side] = None
        self.loop.remove_writer(dest.fileno())
        self._resume_copy(side)

    def _resume_copy(self, side: int) -> None:
        if self.state == _SPLICED and self.copying[side]:
            self.loop.add_reader(self.socks[side].fileno(), self._copy, side)

    def after_flush(self, which: int, callback: Callable[[], Any]) -> None:
        """Call ``callback`` once the bytes the kernel redirected in direction(s) ``which``
        are in their peer's send queue; at once if the tunnel is not spliced. Not called
        at all if the tunnel is released first (the exchange is over by then)."""
        if self.state == _DRAINING:
            self._stop_draining()
        if self.state != _SPLICED:
            callback()
            return
        task = self.loop.create_task(self._after_flush(which, callback))
        self.waiters.add(task)
        task.add_done_callback(self.waiters.discard)

    async def _after_flush(self, which: int, callback: Callable[[], Any]) -> None:
        deadline = self.loop.time() + FLUSH_TIMEOUT_S
        splicer = self.kernel.splicer
        delay = POLL_S
        while self.state == _SPLICED:
            ab, ba = splicer.unflushed(self.pair)
            left = (ab if which & DOWN_TO_UP else 0) + (ba if which & UP_TO_DOWN else 0)
            if not left:
                break
            if self.loop.time() >= deadline:
                log.warning("spliced tunnel: %d bytes still queued in the kernel after %.0f s",
                            left, FLUSH_TIMEOUT_S)
                break
            # The kernel may still hold megabytes for a slow reader; each check takes
            # both socket locks and a few syscalls, so back off instead of spinning.
            await asyncio.sleep(delay)
            delay = min(delay * 2, FLUSH_POLL_MAX_S)
        if self.state == _SPLICED:
            callback()

    def _stop_draining(self) -> None:
        task = self.task
        if task is not None:
            self.task = None
            task.cancel()
        self.state = _COPYING
        self.kernel.tunnels_copied += 1
        self._let_go(0)
        self._let_go(1)

    def release(self) -> None:
        """Take the sockets out of the kernel path (idempotent; the caller closes them)."""
        if self.state == _RELEASED:
            return
        if self.state == _DRAINING:
            self._stop_draining()
        self.state = _RELEASED
        for task in list(self.waiters):
            task.cancel()
        if self.pair is not None:
            ab, ba = self.kernel.splicer.release(self.pair)
            self.kernel.spliced_bytes += ab + ba
            self.released = (ab, ba)
            self.pair = None
            if self.copied[0] or self.copied[1]:  # the fast path did not take it all
                log.info("spliced tunnel: the kernel carried %d + %d bytes (client to "
                         "upstream + back), %d + %d were handed to the proxy to copy, "
                         "%d + %d read before the splice", ab, ba, *self.copied,
                         *self.drained)
        self._close_socks()

    def _close_socks(self) -> None:
        watch = self.kernel.watch
        for side, s in enumerate(self.socks):
            if watch is not None:
                watch.discard(s)
            if self.copying[side]:
                self.copying[side] = False
                self.loop.remove_reader(s.fileno())
            if self.pending[1 - side] is not None:
                self.pending[1 - side] = None
                self.loop.remove_writer(s.fileno())
            s.close()
        self.socks = ()


__all__ = ["TunnelSplice", "DOWN_TO_UP", "UP_TO_DOWN", "BOTH"]
