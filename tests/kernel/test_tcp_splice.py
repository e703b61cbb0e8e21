"""Raw TCP listeners through the real proxy, spliced in the kernel and copied in user space.

Every test runs twice, like tests/kernel/test_tunnel_splice.py: `[kernel]
splice_tunnels = true` ("spliced", root + bpf() only) and `false` ("copied"). Both must
carry the same bytes both ways, propagate half-closes in either direction and release
both sockets. The 100 MiB test prints the proxy's CPU time per path (not asserted).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time

import pytest

from tests.kernel.conftest import SPLICE_DAMAGE
from tests.kernel.test_tunnel_splice import (
    open_fds,
    splice_reason,
    tunnel_metrics,
    wait_for,
)
from tests.support import (
    admin_block,
    free_port,
    recv_exact,
    tree_cpu_seconds,
    wait_ready,
)
from tests.test_tcp_proxy import ThreadServer, echo, start_tcp_proxy, tunnel_lines

MiB = 1 << 20
BIG = 100 * MiB
CHUNK = 1 << 18


@pytest.fixture(params=["spliced", "copied"])
def mode(request) -> str:
    if request.param == "spliced":
        reason = splice_reason()
        if reason:
            pytest.skip(f"socket splicing unavailable: {reason}")
    return request.param


def start(start_proxy, mode: str, *ports: int, listener_extra: str = ""):
    admin = free_port()
    kernel = f"[kernel]\nsplice_tunnels = {'true' if mode == 'spliced' else 'false'}\n"
    proxy = start_tcp_proxy(start_proxy, *ports, extra=admin_block(admin) + "\n" + kernel,
                            listener_extra=listener_extra)
    wait_ready(admin)
    return proxy, admin


@pytest.mark.timeout(60)
def test_tcp_echo(start_proxy, mode):
    server = ThreadServer(echo)
    try:
        proxy, admin = start(start_proxy, mode, server.port)
        before = tunnel_metrics(admin)
        fds_before = open_fds(proxy.proc.pid)
        big = os.urandom(MiB)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            for i in range(20):
                msg = f"message {i} ✓".encode()
                s.sendall(msg)
                assert recv_exact(s, len(msg)) == msg
            s.sendall(big)
            assert recv_exact(s, len(big)) == big
            if mode == "spliced":
                assert tunnel_metrics(admin)["active"] == 1
            s.shutdown(socket.SHUT_WR)
            assert s.recv(10) == b""  # the echo server's half-close came through
        assert wait_for(lambda: open_fds(proxy.proc.pid) <= fds_before), (
            "the proxy kept descriptors after the tunnel closed")
        after = tunnel_metrics(admin)
        assert after[mode] >= before[mode] + 1 and after["active"] == 0, (before, after)
        if mode == "spliced":  # the kernel carried the bytes
            assert after["bytes"] - before["bytes"] >= 2 * MiB
    finally:
        server.close()


class HashingPeer:
    """Sends `size` random bytes then half-closes, while hashing everything it receives
    until EOF (both at once, in two threads)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.sent = hashlib.sha256()
        self.got = hashlib.sha256()
        self.got_n = 0

    def run(self, conn: socket.socket) -> None:
        sender = threading.Thread(target=self._send, args=(conn,), daemon=True)
        sender.start()
        while data := conn.recv(CHUNK):
            self.got.update(data)
            self.got_n += len(data)
        sender.join(240)

    def _send(self, conn: socket.socket) -> None:
        left = self.size
        try:
            while left:
                block = os.urandom(min(CHUNK, left))
                conn.sendall(block)
                self.sent.update(block)
                left -= len(block)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the reader reports what arrived; a short transfer fails the test


class HashingServer(ThreadServer):
    """Every connection is a HashingPeer sending `size` bytes, started `delay` seconds
    after the accept (and once `go` is set, if given); `upstream()` is the one that
    received bytes (wait_port's probe connects too)."""

    def __init__(self, size: int, delay: float = 0.0,
                 go: threading.Event | None = None) -> None:
        self.peers: list[HashingPeer] = []
        self.done = threading.Event()

        def handler(conn: socket.socket) -> None:
            time.sleep(delay)
            if go is not None:
                go.wait(60)
            peer = HashingPeer(size)
            self.peers.append(peer)
            peer.run(conn)
            if peer.got_n:
                self.done.set()

        super().__init__(handler)

    def upstream(self) -> HashingPeer:
        assert self.done.wait(60)
        return next(p for p in self.peers if p.got_n)


@pytest.mark.timeout(300)
def test_tcp_100mib_both_ways(start_proxy, mode, record_property, request):
    if mode == "spliced":
        request.applymarker(SPLICE_DAMAGE)
    go = threading.Event()
    server = HashingServer(BIG, go=go)
    try:
        proxy, admin = start(start_proxy, mode, server.port)
        client = HashingPeer(BIG)
        # wait_port's probe is a tunnel too (spliced or not, counted early or late): what
        # proves this transfer was spliced is the spliced byte count it added.
        before = tunnel_metrics(admin) if mode == "spliced" else {}
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=60) as s:
            if mode == "spliced":
                # A byte that reaches its socket before the pair is armed sends that
                # direction through user space for the tunnel's life (aiproxy/kernel/
                # tunnel.py, step 3; test_tcp_client_first_to_a_late_reader covers
                # early bytes). This test measures the kernel path both ways, so both
                # ends speak once the splice is in place.
                assert wait_for(lambda: tunnel_metrics(admin)["active"] >= 1, timeout=20)
            go.set()
            cpu0, t0 = tree_cpu_seconds(proxy.proc.pid), time.monotonic()
            client.run(s)
            upstream = server.upstream()
            wall, cpu = time.monotonic() - t0, tree_cpu_seconds(proxy.proc.pid) - cpu0
        assert client.got_n == BIG and client.got.hexdigest() == upstream.sent.hexdigest()
        assert upstream.got_n == BIG and upstream.got.hexdigest() == client.sent.hexdigest()
        if mode == "spliced":
            # What the proxy read before the splice (the receive queues it emptied first,
            # aiproxy/kernel/tunnel.py _drain) went through user space; the rest, spliced.
            m = tunnel_metrics(admin)
            assert m["spliced"] > before["spliced"], (before, m)
            assert m["bytes"] - before["bytes"] >= 1.8 * BIG, (before, m)
        record_property("proxy_cpu_s", cpu)
        print(f"\nraw TCP {BIG // MiB} MiB each way, {mode}: proxy CPU {cpu:.3f} s "
              f"({cpu * 1000 / (2 * BIG / MiB):.3f} ms/MiB), wall {wall:.2f} s "
              f"({2 * BIG / MiB / wall:.0f} MiB/s)")
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_tcp_client_first_to_a_late_reader(start_proxy, mode):
    """The client streams from its first byte; the upstream starts reading 0.3 s late.
    What the proxy holds meanwhile (bytes read while connecting, the receive queues it
    drains before a splice) arrives once and in order, spliced or copied."""
    size = 16 * MiB
    server = HashingServer(MiB, delay=0.3)
    try:
        proxy, admin = start(start_proxy, mode, server.port)
        client = HashingPeer(size)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=60) as s:
            client.run(s)
            upstream = server.upstream()
        assert upstream.got_n == size and upstream.got.hexdigest() == client.sent.hexdigest()
        assert client.got_n == MiB and client.got.hexdigest() == upstream.sent.hexdigest()
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_tcp_half_close_client_first(start_proxy, mode):
    """The client sends and half-closes; the upstream sees EOF, then still answers."""
    seen: dict = {}

    def handler(conn: socket.socket) -> None:
        got = b""
        while data := conn.recv(1 << 16):
            got += data
        if not got:
            return  # wait_port's probe
        seen["request"] = got
        time.sleep(0.2)  # the answer comes well after the EOF
        conn.sendall(b"answer to %d bytes" % len(got))
        conn.shutdown(socket.SHUT_WR)

    server = ThreadServer(handler)
    try:
        proxy, _ = start(start_proxy, mode, server.port)
        payload = os.urandom(300_000)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            time.sleep(0.2)  # let the splice (if any) take over before bytes flow
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            got = b""
            while data := s.recv(1 << 16):
                got += data
        assert seen["request"] == payload
        assert got == b"answer to 300000 bytes"
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_tcp_half_close_upstream_first(start_proxy, mode):
    """The upstream sends a greeting and half-closes; the client reads it to EOF, then
    sends on the still-open direction."""
    seen: dict = {}
    greeting = os.urandom(200_000)

    def handler(conn: socket.socket) -> None:
        time.sleep(0.2)
        conn.sendall(greeting)
        conn.shutdown(socket.SHUT_WR)
        got = b""
        while data := conn.recv(1 << 16):
            got += data
        if got:  # not wait_port's probe
            seen["late"] = got

    server = ThreadServer(handler)
    try:
        proxy, _ = start(start_proxy, mode, server.port)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            got = b""
            while data := s.recv(1 << 16):
                got += data
            assert got == greeting
            time.sleep(0.1)
            s.sendall(b"late words after the upstream's EOF")
            s.shutdown(socket.SHUT_WR)
            assert s.recv(10) == b""  # both directions done: the proxy closes
        assert wait_for(lambda: "late" in seen)
        assert seen["late"] == b"late words after the upstream's EOF"
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_tcp_access_log_and_idle_timeout(start_proxy, mode):
    """One access log line per tunnel at close (bytes each way, path, how it ended); a
    tunnel idle for idle_timeout_ms is closed, spliced or copied, and one that keeps
    carrying bytes is not."""
    server = ThreadServer(echo)
    try:
        proxy, admin = start(start_proxy, mode, server.port,
                             listener_extra="idle_timeout_ms = 800\n")
        big = os.urandom(MiB)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            s.sendall(b"hello")
            assert recv_exact(s, 5) == b"hello"
            if mode == "spliced":
                assert wait_for(lambda: tunnel_metrics(admin)["active"] == 1, 5)
            s.sendall(big)
            assert recv_exact(s, len(big)) == big
            for _ in range(8):  # 1.6 s of small talk: busy, never idle for 800 ms
                time.sleep(0.2)
                s.sendall(b"ping")
                assert recv_exact(s, 4) == b"ping"
            s.shutdown(socket.SHUT_WR)
            assert s.recv(10) == b""
        # (start_proxy's port probe made a tunnel too, that carried nothing)
        def carried() -> list[dict]:
            return [t for t in tunnel_lines(proxy) if t["bytes_in"]]

        assert wait_for(lambda: len(carried()) == 1, 5)
        line = carried()[0]
        n = 5 + MiB + 8 * 4
        assert line["bytes_in"] == n and line["bytes_out"] == n, json.dumps(line)
        assert line["ended"] == "eof" and line["path"] == mode, line
        assert line["listener"] == "test" and line["cluster"] == "up", line
        assert line["endpoint"] == f"127.0.0.1:{server.port}", line
        assert line["client"] == "127.0.0.1" and line["duration_ms"] >= 1600, line

        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            s.sendall(b"then silence")
            assert recv_exact(s, 12) == b"then silence"
            t0 = time.monotonic()
            assert s.recv(10) == b""  # the proxy closed it
            waited = time.monotonic() - t0
        assert 0.7 <= waited <= 3, waited
        assert wait_for(lambda: len(carried()) == 2, 5)
        line = carried()[1]
        assert line["ended"] == "idle_timeout" and line["path"] == mode, line
        assert line["bytes_in"] == line["bytes_out"] == 12, line
    finally:
        server.close()
