"""An upstream that closes a keep-alive connection (idle: uvicorn and Node after 5 s,
gunicorn after 2 s; or after N requests without Connection: close) races the proxy's
next request on it. When the close is already in the proxy's socket as the connection
is picked, the request must go on a fresh connection: a POST lost on the stale one
cannot be replayed (it might have been processed). The race is made deterministic by
stopping the proxy (SIGSTOP) while the response and the FIN (or RST) arrive together.
The upstream's Keep-Alive hint (timeout, max) is honoured so the race is not run."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import simple_config
from tests.h2_support import make_pki

SINGLE = "\n[server]\nworkers = 1\n"


class Upstream:
    """HTTP/1.1 keep-alive upstream, a thread per connection. Records (method, path,
    connection number) per request; close_idle() closes every connection (FIN, or RST
    with rst=True) from its own thread, as a keep-alive timeout would."""

    def __init__(self, extra: bytes = b"", tls: ssl.SSLContext | None = None) -> None:
        self.extra = extra
        self.tls = tls  # HTTP/1.1 over TLS with this server context
        self.seen: list[tuple[str, str, int]] = []
        self.conns: list[tuple[threading.Event, threading.Event]] = []
        self.rst = False
        # A request for /last waits for `go`, is answered, and its connection closed
        # without Connection: close (a server's request limit, as gunicorn's
        # max_requests); `arrived` is set when it is in.
        self.arrived = threading.Event()
        self.go = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            events = (threading.Event(), threading.Event())
            self.conns.append(events)
            threading.Thread(target=self._serve, args=(sock, len(self.conns), *events),
                             daemon=True).start()

    def _serve(self, sock: socket.socket, n: int, stop: threading.Event,
               closed: threading.Event) -> None:
        if self.tls is not None:
            sock.settimeout(10)
            sock = self.tls.wrap_socket(sock, server_side=True)
        sock.settimeout(0.02)
        buf = b""
        while not stop.is_set():
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                break
            buf += data
            while b"\r\n\r\n" in buf:
                head, _, rest = buf.partition(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if len(rest) < length:
                    break
                buf = rest[length:]
                method, path = lines[0].split()[:2]
                self.seen.append((method.decode(), path.decode(), n))
                if path == b"/last":
                    self.arrived.set()
                    assert self.go.wait(10)
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n" + self.extra
                             + b"\r\nok")
                if path == b"/last":
                    stop.set()
                    break
        if self.rst:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        closed.set()

    def close_idle(self, rst: bool = False) -> None:
        self.rst = rst
        for stop, closed in self.conns:
            stop.set()
            assert closed.wait(10)

    def stop(self) -> None:
        self.listener.close()
        for stop, _ in self.conns:
            stop.set()


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    yield up
    up.stop()


def tcp_sockets() -> list[tuple[int, int, int, int]]:
    """(local port, remote port, state, rx queue) of every IPv4 TCP socket."""
    out = []
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, remote, state, queues = fields[1], fields[2], fields[3], fields[4]
            out.append((int(local.split(":")[1], 16), int(remote.split(":")[1], 16),
                        int(state, 16), int(queues.split(":")[1], 16)))
    return out


def wait_until(cond, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def read_response(f) -> bytes:  # noqa: ANN001
    """Status line and body of the next response on f (a socket's makefile("rb"))."""
    status = f.readline().rstrip(b"\r\n")
    length = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status + b" " + f.read(length)


CLOSE_WAIT = 8


@pytest.mark.parametrize("rst", [False, True], ids=["fin", "rst"])
def test_request_after_an_unannounced_last_response_goes_on_a_fresh_connection(
        start_proxy, upstream: Upstream, rst: bool) -> None:
    # The upstream answers /last and closes at once. The proxy is stopped while both the
    # response and the FIN land in its socket: it reads the response, pools the
    # connection, and starts the client's pipelined POST before its loop has read the
    # EOF. Whatever order epoll reports things in, only this one socket is involved.
    proxy = start_proxy(SINGLE + simple_config(upstream.port))
    pid = proxy.proc.pid
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c, \
            c.makefile("rb") as r:
        c.sendall(b"GET /last HTTP/1.1\r\nHost: t\r\n\r\n"
                  b"POST /once HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\ndata")
        assert upstream.arrived.wait(10)
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: state_of(pid) == "T", "proxy not stopped")
            upstream.rst = rst
            upstream.go.set()
            # CLOSE_WAIT: the FIN is in; after an RST the socket leaves the table.
            wait_until(lambda: not any(rp == upstream.port and st == 1
                                       for _, rp, st, _ in tcp_sockets()),
                       "the response and FIN did not reach the proxy")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert read_response(r) == b"HTTP/1.1 200 OK ok"
        assert read_response(r) == b"HTTP/1.1 200 OK ok"
    assert upstream.seen == [("GET", "/last", 1), ("POST", "/once", 2)]


def test_keep_alive_timeout_hint_retires_idle_connection(start_proxy) -> None:
    # `Keep-Alive: timeout=1`: the upstream will close a connection idle 1 s; the proxy
    # stops reusing it after 0.5 s instead of racing that close.
    up = Upstream(b"Keep-Alive: timeout=1\r\n")
    try:
        proxy = start_proxy(SINGLE + simple_config(up.port))
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c, \
            c.makefile("rb") as r:
            c.sendall(b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
            assert read_response(r) == b"HTTP/1.1 200 OK ok"
            time.sleep(0.6)
            c.sendall(b"POST /b HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\nx")
            assert read_response(r) == b"HTTP/1.1 200 OK ok"
        assert [n for _, _, n in up.seen] == [1, 2]
    finally:
        up.stop()


def test_keep_alive_max_0_is_the_last_request(start_proxy) -> None:
    up = Upstream(b"Keep-Alive: timeout=60, max=0\r\n")
    try:
        proxy = start_proxy(SINGLE + simple_config(up.port))
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c, \
            c.makefile("rb") as r:
            for path in (b"/a", b"/b"):
                c.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: t\r\n\r\n")
                assert read_response(r) == b"HTTP/1.1 200 OK ok"
        assert [n for _, _, n in up.seen] == [1, 2]
    finally:
        up.stop()


def upstream_fd(pid: int, port: int) -> int:
    """The proxy's descriptor of its one established connection to 127.0.0.1:port."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if int(fields[2].split(":")[1], 16) == port and int(fields[3], 16) == 1:
                inodes.add(fields[9])
    assert len(inodes) == 1, inodes
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target == f"socket:[{next(iter(inodes))}]":
            return int(name)
    raise AssertionError("no descriptor for the upstream connection")


class HeldAtCall:
    """Holds process `pid` (gdb breakpoints) at its first call of one of `calls` on
    descriptor `fd` (x86-64: the first argument in rdi), from the moment it gets there
    until the with block ends: what the test does in between happens before the kernel
    sees that call. `out`: gdb's output, once the block has ended."""

    def __init__(self, pid: int, fd: int, calls: tuple[str, ...], tmp_path: Path) -> None:
        self.hit, self.go = tmp_path / "hit", tmp_path / "go"
        attached = tmp_path / "attached"
        breaks = [a for call in calls for a in ("-ex", f"break {call} if $rdi == {fd}")]
        self.gdb = subprocess.Popen(
            ["gdb", "-p", str(pid), "-batch", "-nx", *breaks,
             "-ex", f"shell touch {attached}",
             "-ex", "continue",
             "-ex", f"shell touch {self.hit}",
             "-ex", f"shell while [ ! -e {self.go} ]; do sleep 0.01; done",
             "-ex", "delete", "-ex", "detach"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.out = b""
        wait_until(lambda: attached.exists() or self.gdb.poll() is not None,
                   "gdb did not attach")
        if self.gdb.poll() is not None:
            out = self.gdb.communicate()[0]
            if b"Operation not permitted" in out:
                pytest.skip("gdb may not attach (ptrace)")
            raise AssertionError(out)

    def __enter__(self) -> HeldAtCall:
        return self

    def wait_hit(self, what: str) -> None:
        wait_until(self.hit.exists, what)

    def __exit__(self, *exc: object) -> None:
        self.go.touch()
        try:
            self.out = self.gdb.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:  # never hit: gdb's exit detaches it
            self.gdb.kill()
            self.out = self.gdb.communicate()[0]


@pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb (scripts/bootstrap.sh "
                    "--test installs it)")
@pytest.mark.skipif(platform.machine() != "x86_64",
                    reason="the breakpoint reads send()'s descriptor from x86-64's rdi")
@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_request_whose_first_send_meets_a_reset_is_replayed(start_proxy, tmp_path,
                                                            tls: bool) -> None:
    # The pooled connection passes the pool's peek; the upstream's RST lands after it,
    # before the request's first send(), which fails with nothing sent: the POST never
    # reached the upstream and goes on a fresh connection. The proxy is held (gdb
    # breakpoint on send() to that descriptor; over TLS uvloop's write()) between the
    # peek and the send.
    extra = ""
    server_ctx = None
    if tls:
        if shutil.which("openssl") is None:
            pytest.skip("needs openssl")
        pki = make_pki(tmp_path / "pki")
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(pki.cert, pki.key)
        extra = f'tls = {{ ca = "{pki.ca}" }}'
    upstream = Upstream(tls=server_ctx)
    try:
        _first_send_meets_reset(start_proxy, upstream, tmp_path, extra,
                                "write" if tls else "send")
    finally:
        upstream.stop()


def _first_send_meets_reset(start_proxy, upstream: Upstream, tmp_path, cluster_extra: str,
                            call: str) -> None:  # noqa: ANN001
    proxy = start_proxy(SINGLE + simple_config(upstream.port, cluster_extra=cluster_extra))
    pid = proxy.proc.pid
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c, \
            c.makefile("rb") as r:
        c.sendall(b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(r) == b"HTTP/1.1 200 OK ok"
        with HeldAtCall(pid, upstream_fd(pid, upstream.port), (call,), tmp_path) as held:
            c.sendall(b"POST /once HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\ndata")
            held.wait_hit("the proxy did not send the request")
            upstream.close_idle(rst=True)
            wait_until(lambda: not any(rp == upstream.port and st == 1
                                       for _, rp, st, _ in tcp_sockets()),
                       "the RST did not reach the proxy")
        assert read_response(r) == b"HTTP/1.1 200 OK ok", held.out
    assert upstream.seen == [("GET", "/a", 1), ("POST", "/once", 2)]
