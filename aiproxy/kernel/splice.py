"""Splice two TCP sockets in the kernel (sockhash + sk_skb stream verdict).

    splicer = Splicer()                 # loads bpf/sk_splice.c once per process
    if splicer.available():
        pair = splicer.splice(client_sock, upstream_sock)
        ...                             # wait for EOF/errors on either socket, then
        splicer.unsplice(pair)          # (drains what the kernel still holds first)
    else:
        ...                             # copy in user space, as before

Contract for :meth:`Splicer.splice`:
  * both sockets are connected TCP sockets;
  * the caller has already written to each socket every byte it read from the other
    (its user-space buffers are empty). Bytes still queued in a socket's receive queue
    are not lost: after inserting the sockets the splicer nudges the kernel (SO_RCVLOWAT)
    so the verdict program handles them, in order, before anything newer.
Once spliced, a socket's received bytes go straight out of its peer. recv() on it
returns b"" at EOF (or raises on error): that is the caller's cue to call
:meth:`Splicer.shutdown_peer` (half-close, after the in-flight bytes are written) or
:meth:`Splicer.unsplice`.

The two sockets join the kernel's map one after the other. Bytes that reach the first
before the second has joined cannot be redirected (the kernel would drop them), so the
verdict passes them to user space, and with them every later byte of that socket:
:meth:`Splicer.passed` says which direction that happened to, and the caller copies
that direction itself (recv() returns its bytes, in order) while the kernel carries the
other. The second socket joins with the first armed (in the map) already, so its own
bytes are always redirected.

Limits: the kernel queues redirected bytes for the peer without TCP back-pressure on
the sender beyond the socket buffers; a peer that stops reading makes the kernel hold
up to the redirect backlog. Use splicing for tunnels whose both ends are live.

:func:`relay` is a blocking two-socket relay that uses the splicer when available and
copies in user space otherwise; both paths pass the same tests.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from .libbpf import BPFError, BpfObject, BPFUnavailable, object_path, prog_attach
from .structs import SplicePeer

SO_COOKIE = 57
SIOCOUTQ = 0x5411  # TIOCOUTQ: bytes in the send queue not yet acked
BPF_SK_SKB_STREAM_VERDICT = 5
TCP_INFO_BYTES_ACKED = 120  # offsetof(struct tcp_info, tcpi_bytes_acked)
POLL_S = 0.001
EOF_WAIT_S = 5.0  # how long a recv() of 0 may disagree with poll() before it is believed


def _key(cookie: int) -> bytes:
    return cookie.to_bytes(8, "little")


def socket_cookie(sock: socket.socket) -> int:
    return struct.unpack("=Q", sock.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8))[0]


def bytes_written(sock: socket.socket) -> int:
    """Bytes the kernel has taken into this socket's send path since it was connected
    (acked + still queued)."""
    import fcntl

    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    acked = struct.unpack_from("=Q", info, TCP_INFO_BYTES_ACKED)[0]
    queued = struct.unpack("=i", fcntl.ioctl(sock.fileno(), SIOCOUTQ, b"\0" * 4))[0]
    return acked + queued


@dataclass
class SplicedPair:
    a: socket.socket
    b: socket.socket
    cookie_a: int
    cookie_b: int
    written_a: int  # bytes_written(a) when spliced
    written_b: int
    closed: set[str] = field(default_factory=set)

    def other(self, sock: socket.socket) -> socket.socket:
        return self.b if sock is self.a else self.a


class Splicer:
    """Loads sk_splice once; splices socket pairs. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._obj: BpfObject | None = None
        self._error: str | None = None
        self._pairs: dict[int, SplicedPair] = {}

    def available(self) -> bool:
        """True when the kernel path works here (loads the program on first call)."""
        with self._lock:
            self._ensure()
            return self._obj is not None

    @property
    def reason(self) -> str | None:
        """Why splicing is unavailable (None when it is available or untried)."""
        return self._error

    def _ensure(self) -> None:
        if self._obj is not None or self._error is not None:
            return
        try:
            obj = BpfObject(object_path("sk_splice"))
            prog_attach(obj.program("sk_splice_verdict"), obj.map("splice_socks").fd,
                        BPF_SK_SKB_STREAM_VERDICT)
        except BPFError as exc:
            self._error = str(exc)
            return
        self._obj = obj

    def splice(self, a: socket.socket, b: socket.socket) -> SplicedPair:
        with self._lock:
            self._ensure()
            if self._obj is None:
                raise BPFUnavailable(f"socket splicing unavailable: {self._error}")
            socks = self._obj.map("splice_socks")
            peers = self._obj.map("splice_peers")
            ca, cb = socket_cookie(a), socket_cookie(b)
            pair = SplicedPair(a, b, ca, cb, bytes_written(a), bytes_written(b))
            # Peers first, then each socket joins and is armed: a socket's bytes are
            # redirected once its peer is armed (in splice_socks); before that a redirect
            # could find no peer and drop them, so the verdict passes them to user space
            # instead (see passed()). b joins with a armed already: its bytes (an echo
            # of a's, say) are never passed.
            peers.update(_key(ca), bytes(SplicePeer(cb)))
            peers.update(_key(cb), bytes(SplicePeer(ca)))
            armed = self._obj.map("splice_armed")
            try:
                self._join(socks, ca, a)
                self._arm(armed, ca)
                self._join(socks, cb, b)
                self._arm(armed, cb)
            except BPFError:
                self._forget(pair)
                raise
            self._pairs[ca] = pair
            for s in (a, b):
                # tcp_set_rcvlowat() calls sk_data_ready(): the verdict program now takes
                # whatever arrived before the socket joined the map.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            return pair

    def _join(self, socks, cookie: int, sock: socket.socket) -> None:
        socks.update(_key(cookie), sock.fileno().to_bytes(8, "little"))

    def _arm(self, armed, cookie: int) -> None:
        armed.update(_key(cookie), b"\1\0\0\0")

    def _peer_entries(self, pair: SplicedPair) -> tuple[SplicePeer | None, SplicePeer | None]:
        peers = self._obj.map("splice_peers") if self._obj else None
        out = []
        for cookie in (pair.cookie_a, pair.cookie_b):
            raw = peers.lookup(_key(cookie)) if peers else None
            out.append(SplicePeer.from_buffer_copy(raw) if raw else None)
        return out[0], out[1]

    def redirected(self, pair: SplicedPair) -> tuple[int, int]:
        """(bytes a->b, bytes b->a) the kernel has redirected so far."""
        ea, eb = self._peer_entries(pair)
        return (ea.bytes if ea else 0), (eb.bytes if eb else 0)

    def passed(self, pair: SplicedPair) -> tuple[int, int]:
        """(bytes of a, bytes of b) handed to user space instead of the peer: non-zero
        for a socket whose bytes arrived before its pair was armed. Such a direction is
        the caller's to copy, to the end of the tunnel; the kernel never redirects it."""
        ea, eb = self._peer_entries(pair)
        return (ea.passed if ea else 0), (eb.passed if eb else 0)

    def unflushed(self, pair: SplicedPair) -> tuple[int, int]:
        """(bytes a->b, bytes b->a) the kernel has redirected but not yet put into the
        peer's send queue; (0, 0) once a socket is gone. Non-blocking (for event loops)."""
        ab, ba = self.redirected(pair)
        try:
            return (max(0, ab - (bytes_written(pair.b) - pair.written_b)),
                    max(0, ba - (bytes_written(pair.a) - pair.written_a)))
        except OSError:
            return 0, 0

    def at_eof(self, pair: SplicedPair, sock: socket.socket, copied: int) -> bool:
        """recv() on a spliced socket returned b"": is that its peer's EOF?

        Not always. The kernel's sockmap recvmsg can return 0 while the stream goes on
        (seen under load: no FIN yet, or bytes the verdict passed still on their way to
        the socket's queue). It is the EOF only once the peer's FIN has arrived (poll
        reports RDHUP/HUP/ERR) and user space has read every byte the verdict passed
        back (``copied``: bytes read from ``sock`` since the splice)."""
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLRDHUP)
        events = poller.poll(0)
        if not events or not events[0][1] & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
            return False
        passed = self.passed(pair)
        return copied >= (passed[0] if sock is pair.a else passed[1])

    def release(self, pair: SplicedPair) -> tuple[int, int]:
        """Take both sockets out of the kernel path now (no waiting); returns the bytes
        the kernel redirected (a->b, b->a). Safe to call twice."""
        with self._lock:
            if pair.cookie_a not in self._pairs:
                return 0, 0
            counts = self.redirected(pair)
            self._forget(pair)
            return counts

    @property
    def active(self) -> int:
        """Socket pairs spliced now."""
        return len(self._pairs)

    def pairs(self) -> list[SplicedPair]:
        with self._lock:
            return list(self._pairs.values())

    def wait_flushed(self, pair: SplicedPair, timeout: float = 5.0) -> bool:
        """Wait until every redirected byte has entered its peer's send queue."""
        deadline = time.monotonic() + timeout
        while True:
            ab, ba = self.redirected(pair)
            try:
                done = (bytes_written(pair.b) - pair.written_b >= ab
                        and bytes_written(pair.a) - pair.written_a >= ba)
            except OSError:
                return True  # a socket is gone: nothing more will be written
            if done:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def shutdown_peer(self, pair: SplicedPair, eof_on: socket.socket,
                      timeout: float = 5.0) -> None:
        """``eof_on`` read EOF: once its bytes are out, half-close its peer for writing."""
        self.wait_flushed(pair, timeout)
        try:
            pair.other(eof_on).shutdown(socket.SHUT_WR)
        except OSError:
            pass
        pair.closed.add("a" if eof_on is pair.a else "b")

    def unsplice(self, pair: SplicedPair, timeout: float = 5.0) -> None:
        """Take both sockets out of the kernel path (after in-flight bytes are written).

        The sockets stay open and usable for user-space I/O."""
        self.wait_flushed(pair, timeout)
        with self._lock:
            self._forget(pair)

    def _forget(self, pair: SplicedPair) -> None:
        if self._obj is None:
            return
        # Disarm both first: a socket whose peer is still armed after the peer left
        # splice_socks would have its bytes redirected nowhere, and dropped.
        for name in ("splice_armed", "splice_socks", "splice_peers"):
            for cookie in (pair.cookie_a, pair.cookie_b):
                try:
                    self._obj.map(name).delete(_key(cookie))
                except BPFError:
                    pass
        self._pairs.pop(pair.cookie_a, None)

    def close(self) -> None:
        with self._lock:
            for pair in list(self._pairs.values()):
                self._forget(pair)
            if self._obj is not None:
                self._obj.close()
                self._obj = None


# -- a blocking relay (tests, benchmarks, simple tunnels) ------------------------------


def relay(a: socket.socket, b: socket.socket, splicer: Splicer | None = None,
          bufsize: int = 256 * 1024) -> dict:
    """Carry bytes both ways between ``a`` and ``b`` until both directions are closed.

    With a working ``splicer`` the kernel carries the bytes and this thread only waits
    for EOFs (and copies a direction the kernel passed back, see Splicer.passed);
    otherwise it copies. Returns {"spliced": bool, "a_to_b": n, "b_to_a": n} (bytes
    carried either way) and, when spliced, "copied": [a_to_b, b_to_a], the part of those
    that went through this thread, and "passed": what the verdict handed to user space. The sockets are left open (the caller closes them).
    """
    if splicer is not None and splicer.available():
        return _relay_spliced(a, b, splicer)
    return _relay_copy(a, b, bufsize)


def _relay_spliced(a: socket.socket, b: socket.socket, splicer: Splicer) -> dict:
    pair = splicer.splice(a, b)
    poller = select.poll()
    fds = {a.fileno(): a, b.fileno(): b}
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLRDHUP)
    open_ = set(fds)
    copied = {a.fileno(): 0, b.fileno(): 0}
    early_zero: dict[int, float] = {}
    try:
        while open_:
            for fd, _ev in poller.poll(1000):
                sock = fds[fd]
                try:
                    data = sock.recv(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                except OSError:
                    data = None  # an error ends this direction at once
                if data:
                    # The verdict passed this socket's bytes back (they arrived before the
                    # pair was armed): this direction is copied here, in order.
                    pair.other(sock).sendall(data)
                    copied[fd] += len(data)
                    early_zero.pop(fd, None)  # a later 0 gets its own grace period
                    continue
                if data is not None and not splicer.at_eof(pair, sock, copied[fd]):
                    since = early_zero.setdefault(fd, time.monotonic())
                    if time.monotonic() - since < EOF_WAIT_S:
                        time.sleep(POLL_S)
                        continue
                splicer.shutdown_peer(pair, sock)
                poller.unregister(fd)
                open_.discard(fd)
    finally:
        ab, ba = splicer.redirected(pair)
        passed = splicer.passed(pair)
        splicer.unsplice(pair)
    ca, cb = copied[a.fileno()], copied[b.fileno()]
    return {"spliced": True, "a_to_b": ab + ca, "b_to_a": ba + cb, "copied": [ca, cb],
            "passed": list(passed)}


def _relay_copy(a: socket.socket, b: socket.socket, bufsize: int) -> dict:
    buf = bytearray(bufsize)
    view = memoryview(buf)
    counts = {a.fileno(): 0, b.fileno(): 0}
    fds = {a.fileno(): a, b.fileno(): b}
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLRDHUP)
    open_ = set(fds)
    while open_:
        for fd, _ev in poller.poll(1000):
            sock = fds[fd]
            peer = b if sock is a else a
            try:
                n = sock.recv_into(view, bufsize, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno not in (errno.ECONNRESET, errno.EPIPE):
                    raise
                n = 0
            if n:
                peer.sendall(view[:n])
                counts[fd] += n
                continue
            try:
                peer.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            poller.unregister(fd)
            open_.discard(fd)
    return {"spliced": False, "a_to_b": counts[a.fileno()], "b_to_a": counts[b.fileno()]}


def _main() -> int:  # pragma: no cover - exercised by tests/bench as a subprocess
    """`python -m aiproxy.kernel.splice LISTEN_PORT UPSTREAM_PORT [copy|splice]`:
    accept one connection, connect upstream, relay, print counts and CPU time as JSON."""
    import json
    import resource
    import sys

    listen_port, upstream_port = int(sys.argv[1]), int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "splice"
    splicer = Splicer() if mode == "splice" else None
    if splicer is not None and not splicer.available():
        print(json.dumps({"error": splicer.reason}), flush=True)
        return 1
    srv = socket.create_server(("127.0.0.1", listen_port))
    print(json.dumps({"ready": True}), flush=True)
    a, _ = srv.accept()
    b = socket.create_connection(("127.0.0.1", upstream_port))
    start = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    result = relay(a, b, splicer)
    end = resource.getrusage(resource.RUSAGE_SELF)
    result["wall_s"] = time.monotonic() - t0
    result["cpu_s"] = (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime)
    a.close()
    b.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main())


__all__ = ["Splicer", "SplicedPair", "relay", "socket_cookie", "bytes_written"]
