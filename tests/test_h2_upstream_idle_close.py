"""An HTTP/2 upstream that closes its idle connection (a FIN, GOAWAY then FIN, or an
RST) just as a request for it arrives at the proxy, with real sockets. The close is in
the proxy's socket, not yet read, when the request picks the connection: the request
(a POST too) must go on a fresh connection, never be failed with 502. A stream the
upstream never saw is safe to send again whatever its method (RFC 9113 6.8, 8.7).

The proxy is stopped (SIGSTOP) while the client's POST and then the upstream's close
reach its sockets: resumed, it reads the POST first (epoll reports sockets in the order
they became readable) and picks the pooled connection before its loop reads the close."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

import pytest
from hyperframe.frame import DataFrame, HeadersFrame

from tests.conftest import Proxy
from tests.h2_raw_upstream import RawConn, RawUpstream
from tests.h2_support import raw_frame
from tests.test_h2_upstream_goaway import epoll_waiting
from tests.test_upstream_keepalive_race import (
    HeldAtCall,
    read_response,
    state_of,
    tcp_sockets,
    upstream_fd,
    wait_until,
)

GOAWAY = 0x7
POST = b"POST /once HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\ndata"


def h2_config(port: int) -> str:
    return f"""
[server]
workers = 1

[[clusters]]
name = "up"
protocol = "h2"
endpoints = ["127.0.0.1:{port}"]

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
"""


class ClosingUpstream(RawUpstream):
    """An HTTP/2 upstream that answers each stream 200 "ok" and records it in `seen` as
    (connection number, method, path). Its first connection, after one response, is
    closed (`close`: "fin", "goaway-fin" or "rst") once `go` is set."""

    def __init__(self, close: str) -> None:
        self.close_by = close
        self.go = threading.Event()
        self.seen: list[tuple[int, bytes, bytes]] = []
        super().__init__(self.serve)

    def serve(self, conn: RawConn) -> None:
        n = len(self.conns)
        conn.handshake()
        ok = [(b":status", b"200"), (b"content-length", b"2")]
        heads: dict[int, dict[bytes, bytes]] = {}
        while not (n == 1 and self.seen):
            f = conn.recv(timeout=30)
            if f is None:
                return
            if hasattr(f, "decoded"):
                heads[f.stream_id] = dict(f.decoded)
            if "END_STREAM" in f.flags and isinstance(f, HeadersFrame | DataFrame):
                head = heads[f.stream_id]
                self.seen.append((n, head[b":method"], head[b":path"]))
                conn.send(conn.headers(f.stream_id, ok), conn.data(f.stream_id, b"ok", True))
        assert self.go.wait(30)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.close_by == "goaway-fin":
            conn.send(raw_frame(GOAWAY, 0, 0, struct.pack(">II", 1, 0)))
        if self.close_by == "rst":
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.sock.close()

    def closed_for_proxy(self) -> bool:
        """The proxy's side of the first connection is no longer ESTABLISHED: CLOSE_WAIT
        after a FIN, gone from the table after an RST."""
        return not any(rp == self.port and st == 1 for _, rp, st, _ in tcp_sockets())

    def check_replayed(self) -> None:
        """The POST went on a second connection; the first had only the warm-up."""
        assert self.seen == [(1, b"GET", b"/warm"), (2, b"POST", b"/once")], self.seen
        assert not self.errors, self.errors


@contextmanager
def warmed_client(proxy: Proxy) -> Iterator[tuple[socket.socket, BinaryIO]]:
    """A client connection whose GET /warm opened the proxy's first upstream connection
    (idle in its pool now)."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c, \
            c.makefile("rb") as r:
        c.sendall(b"GET /warm HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(r) == b"HTTP/1.1 200 OK ok"
        yield c, r


@pytest.mark.parametrize("close", ["fin", "goaway-fin", "rst"])
def test_request_racing_an_idle_close_goes_on_a_fresh_connection(
        start_proxy: Callable[..., Proxy], close: str) -> None:
    up = ClosingUpstream(close)
    try:
        proxy = start_proxy(h2_config(up.port))
        pid = proxy.proc.pid
        with warmed_client(proxy) as (c, r):
            port = c.getsockname()[1]
            wait_until(lambda: epoll_waiting(pid), "proxy not idle")
            os.kill(pid, signal.SIGSTOP)
            try:
                wait_until(lambda: state_of(pid) == "T", "proxy not stopped")
                c.sendall(POST)
                wait_until(lambda: sum(rx for lp, rp, _, rx in tcp_sockets()
                                       if lp == proxy.port and rp == port) == len(POST),
                           "the POST did not reach the proxy")
                up.go.set()
                wait_until(up.closed_for_proxy, "the close did not reach the proxy")
            finally:
                os.kill(pid, signal.SIGCONT)
            assert read_response(r) == b"HTTP/1.1 200 OK ok"
    finally:
        up.stop()
    up.check_replayed()


@pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb (scripts/bootstrap.sh "
                    "--test installs it)")
@pytest.mark.skipif(platform.machine() != "x86_64",
                    reason="the breakpoint reads write()'s descriptor from x86-64's rdi")
def test_stream_whose_first_write_meets_a_reset_is_replayed(
        start_proxy: Callable[..., Proxy], tmp_path) -> None:  # noqa: ANN001
    # The idle connection passes the peek; the upstream's RST lands after it, before the
    # write carrying the POST's HEADERS, which fails with nothing sent: the stream never
    # reached the upstream and goes on a fresh connection. The proxy is held (a gdb
    # breakpoint on write() to that descriptor) between the peek and the write.
    up = ClosingUpstream("rst")
    try:
        proxy = start_proxy(h2_config(up.port))
        pid = proxy.proc.pid
        with warmed_client(proxy) as (c, r):
            with HeldAtCall(pid, upstream_fd(pid, up.port), ("write", "writev"),
                            tmp_path) as held:
                c.sendall(POST)
                held.wait_hit("the proxy did not write the request")
                up.go.set()
                wait_until(up.closed_for_proxy, "the RST did not reach the proxy")
            assert read_response(r) == b"HTTP/1.1 200 OK ok", held.out
    finally:
        up.stop()
    up.check_replayed()
