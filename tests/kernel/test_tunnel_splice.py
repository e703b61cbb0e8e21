"""Upgrade tunnels through the real proxy, spliced in the kernel and copied in user space.

Every test runs twice: `[kernel] splice_tunnels = true` ("spliced", root + bpf() only)
and `splice_tunnels = false` ("copied"). Both paths must carry the same bytes in the
same order, propagate half-closes, and release both sockets (and the splice map
entries) when a side closes. The 100 MiB test prints the proxy's CPU time per path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest
from websockets.asyncio.client import connect as ws_connect_async
from websockets.sync.client import connect as ws_connect
from websockets.sync.server import serve as ws_serve

from aiproxy.kernel.splice import Splicer
from tests.conftest import simple_config
from tests.h2_support import make_pki
from tests.kernel.conftest import SPLICE_DAMAGE, bpf_skip_reason
from tests.support import (
    admin_block,
    free_port,
    process_log,
    scrape,
    tree_cpu_seconds,
    wait_port,
    wait_ready,
)

MiB = 1 << 20
BIG = 100 * MiB
CHUNK = 1 * MiB


def splice_reason() -> str | None:
    reason = bpf_skip_reason()
    if reason:
        return reason
    s = Splicer()
    try:
        return None if s.available() else s.reason
    finally:
        s.close()


@pytest.fixture(params=["spliced", "copied"])
def mode(request) -> str:
    if request.param == "spliced":
        reason = splice_reason()
        if reason:
            pytest.skip(f"socket splicing unavailable: {reason}")
    return request.param


def start(start_proxy, mode: str, upstream_port: int):
    """The proxy in front of one upstream, with an admin port; returns (proxy, admin)."""
    admin = free_port()
    kernel = f"\n[kernel]\nsplice_tunnels = {'true' if mode == 'spliced' else 'false'}\n"
    proxy = start_proxy(simple_config(upstream_port) + admin_block(admin) + kernel)
    wait_ready(admin)
    return proxy, admin


def tunnel_metrics(admin: int) -> dict[str, float]:
    samples = scrape(admin)
    return {
        "spliced": samples[("aiproxy_kernel_tunnels_total", (("path", "spliced"),))],
        "copied": samples[("aiproxy_kernel_tunnels_total", (("path", "copied"),))],
        "active": samples[("aiproxy_kernel_spliced_tunnels_active", ())],
        "bytes": samples[("aiproxy_kernel_spliced_bytes_total", ())],
    }


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def wait_decided(admin: int, tunnels: int) -> None:
    """Wait until the proxy has chosen spliced or copied for `tunnels` tunnels: a
    splice waits for the receive queues to empty (aiproxy/kernel/tunnel.py _drain),
    which a loopback sender that never pauses can outrun until it is done."""
    assert wait_for(lambda: sum(tunnel_metrics(admin)[k] for k in ("spliced", "copied"))
                    >= tunnels, timeout=20)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def assert_path(admin: int, mode: str, tunnels: int) -> None:
    m = tunnel_metrics(admin)
    assert m[mode] == tunnels, m


# == WebSocket: real client (websockets) and real servers =====================================


@pytest.mark.timeout(60)
def test_websocket_echo(start_proxy, demo_upstream, mode):
    proxy, admin = start(start_proxy, mode, demo_upstream)
    big = os.urandom(MiB)
    fds_before = open_fds(proxy.proc.pid)
    with ws_connect(f"ws://127.0.0.1:{proxy.port}/ws", max_size=4 * MiB, open_timeout=10,
                    close_timeout=5, compression=None) as ws:
        assert ws.response.headers["x-upstream"] == "demo-a"
        # A message sent before the pair is armed is passed back to user space, and its
        # direction is then copied for the tunnel's life (aiproxy/kernel/tunnel.py, step
        # 3): this test is about the kernel path, so it speaks once that is decided.
        wait_decided(admin, 1)
        for i in range(20):
            ws.send(f"text message {i} ✓")
            assert ws.recv(timeout=10) == f"text message {i} ✓"
        ws.send(big)
        assert ws.recv(timeout=10) == big
        if mode == "spliced":
            assert tunnel_metrics(admin)["active"] == 1
        ws.close()
        assert ws.close_code == 1000
    assert wait_for(lambda: open_fds(proxy.proc.pid) <= fds_before), (
        "the proxy kept descriptors after the WebSocket closed")
    m = tunnel_metrics(admin)
    assert m[mode] == 1 and m["active"] == 0, m
    if mode == "spliced":  # the kernel carried the messages (both ways, with framing)
        assert m["bytes"] >= 2 * MiB
    # The access log counts the tunnel's bytes, however they went (the echo: the same
    # frames back, the client's masked and 4 bytes a frame longer).
    assert wait_for(lambda: '"path":"/ws"' in proxy.log())
    line = next(json.loads(x) for x in proxy.log().splitlines() if '"path":"/ws"' in x)
    assert line["status"] == 101
    assert MiB < line["bytes_out"] < line["bytes_in"] < MiB + 2048, line


class HashingEcholess:
    """A `websockets` server that hashes what it receives and sends `size` random bytes
    of its own at the same time; reports both digests."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.sent = hashlib.sha256()
        self.got = hashlib.sha256()
        self.got_n = 0
        self.done = threading.Event()
        self.server = ws_serve(self.handler, "127.0.0.1", 0, compression=None,
                               max_size=2 * CHUNK)
        self.port = self.server.socket.getsockname()[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def handler(self, ws) -> None:
        def send() -> None:
            left = self.size
            while left:
                block = os.urandom(min(CHUNK, left))
                self.sent.update(block)
                ws.send(block)
                left -= len(block)
            ws.send("end")

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        for msg in ws:
            if msg == "end":
                break
            self.got.update(msg)
            self.got_n += len(msg)
        sender.join(120)
        self.done.set()

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join(5)


@pytest.mark.timeout(300)
def test_websocket_100mib_both_ways(start_proxy, mode, record_property, request):
    if mode == "spliced":
        request.applymarker(SPLICE_DAMAGE)
    server = HashingEcholess(BIG)
    got_n, admin = 0, 0
    try:
        proxy, admin = start(start_proxy, mode, server.port)
        sent, got = hashlib.sha256(), hashlib.sha256()
        with ws_connect(f"ws://127.0.0.1:{proxy.port}/ws", max_size=2 * CHUNK,
                        compression=None, open_timeout=10, close_timeout=10) as ws:
            cpu0, t0 = tree_cpu_seconds(proxy.proc.pid), time.monotonic()

            def send() -> None:
                left = BIG
                while left:
                    block = os.urandom(min(CHUNK, left))
                    sent.update(block)
                    ws.send(block)
                    left -= len(block)
                ws.send("end")

            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            while (msg := ws.recv(timeout=60)) != "end":
                got.update(msg)
                got_n += len(msg)
            sender.join(120)
            assert server.done.wait(60)
            wall, cpu = time.monotonic() - t0, tree_cpu_seconds(proxy.proc.pid) - cpu0
        assert got_n == BIG and got.hexdigest() == server.sent.hexdigest()
        assert server.got_n == BIG and server.got.hexdigest() == sent.hexdigest()
        assert_path(admin, mode, 1)
        record_property("proxy_cpu_s", cpu)
        print(f"\nWebSocket {BIG // MiB} MiB each way, {mode}: proxy CPU {cpu:.3f} s "
              f"({cpu * 1000 / (2 * BIG / MiB):.3f} ms/MiB), wall {wall:.2f} s")
    except Exception:
        # Evidence for a rare failure (seen once in CI: a frame header the server could
        # not parse, so bytes were lost or repeated on the way up): how far each side
        # got and what the proxy counted.
        print(f"client got {got_n} bytes, server got {server.got_n} bytes of {BIG}")
        with contextlib.suppress(Exception):
            print(f"proxy tunnel metrics: {tunnel_metrics(admin)}")
        raise
    finally:
        server.close()


# == Raw upgrade tunnel: ordering, half-close, teardown =========================================


class RawUpgradeServer:
    """Answers `conns` Upgrade requests (one after the other) with a 101 followed, in
    the same write, by `early`; then runs `script(conn, rest, result)` on the raw socket."""

    def __init__(self, early: bytes, script, conns: int = 1, delay_101: float = 0.0) -> None:
        self.delay_101 = delay_101
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.early = early
        self.script = script
        self.results: list[dict] = []
        self.thread = threading.Thread(target=self._run, args=(conns,), daemon=True)
        self.thread.start()

    @property
    def result(self) -> dict:
        return self.results[-1]

    def _run(self, conns: int) -> None:
        for _ in range(conns):
            self.results.append({})
            self._one()

    def _one(self) -> None:
        conn, _ = self.sock.accept()
        conn.settimeout(30)
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(4096)
        head, rest = head.split(b"\r\n\r\n", 1)
        self.result["head"] = head
        time.sleep(self.delay_101)
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\n"
                     b"Upgrade: raw-test\r\n\r\n" + self.early)
        try:
            self.script(conn, rest, self.result)
        finally:
            conn.close()

    def close(self) -> None:
        self.thread.join(30)
        self.sock.close()


UPGRADE_REQUEST = (b"GET /raw HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\n"
                   b"Upgrade: raw-test\r\n\r\n")


def upgrade_request(port: int, early: bytes) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", port))
    c.settimeout(30)
    c.sendall(UPGRADE_REQUEST + early)
    return c


def read_101(c: socket.socket) -> bytes:
    """Reads the 101 head; returns what came after it."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = c.recv(4096)
        assert chunk, f"closed before the 101: {data!r}"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 101 "), head
    return rest


def read_all(sock: socket.socket, first: bytes = b"") -> bytes:
    out = bytearray(first)
    while chunk := sock.recv(1 << 20):
        out += chunk
    return bytes(out)


def stream(n: int, tag: bytes) -> Iterator[bytes]:
    """n numbered 9 KiB blocks: order and loss both show up in the comparison."""
    for i in range(n):
        yield (tag + b"%08d" % i) * 1024


@pytest.mark.timeout(60)
def test_bytes_read_before_the_splice_keep_their_order(start_proxy, mode):
    up_blocks = list(stream(256, b"U"))
    down_blocks = list(stream(256, b"D"))

    def script(conn, rest, result):
        # The client's bytes that came with its request, then everything it sends after
        # the 101 until its EOF; meanwhile send our own stream, then half-close.
        reader = threading.Thread(target=lambda: result.update(got=read_all(conn, rest)))
        reader.start()
        for i, block in enumerate(up_blocks):
            conn.sendall(block)
            if i == 0:
                wait_decided(ports["admin"], 1)  # the rest goes spliced, mid-stream
        conn.shutdown(socket.SHUT_WR)
        reader.join(30)

    ports: dict[str, int] = {}
    server = RawUpgradeServer(b"early-from-upstream|", script)
    try:
        proxy, admin = start(start_proxy, mode, server.port)
        ports["admin"] = admin
        c = upgrade_request(proxy.port, b"early-from-client|")
        rest = read_101(c)
        reader_out: dict = {}
        reader = threading.Thread(target=lambda: reader_out.update(got=read_all(c, rest)))
        reader.start()
        for i, block in enumerate(down_blocks):
            c.sendall(block)
            if i == 0:
                wait_decided(admin, 1)
        c.shutdown(socket.SHUT_WR)  # half-close: the upstream's stream still arrives
        reader.join(30)
        server.close()
        c.close()
        assert reader_out["got"] == b"early-from-upstream|" + b"".join(up_blocks)
        assert server.result["got"] == b"early-from-client|" + b"".join(down_blocks)
        assert wait_for(lambda: tunnel_metrics(admin)["active"] == 0)
        assert_path(admin, mode, 1)
    finally:
        server.sock.close()


@pytest.mark.timeout(60)
def test_client_streams_before_the_101(start_proxy, mode):
    """A client that speaks first: megabytes right behind its Upgrade request, sent
    before the upstream's 101 (delayed here). The proxy stops reading them as a
    pipelined request past max_header_bytes; once the 101 turns the connection into a
    tunnel they are tunnel bytes and must all reach the upstream, in order."""
    down_blocks = list(stream(1024, b"D"))  # 9 MiB
    up_blocks = list(stream(64, b"U"))

    def script(conn, rest, result):
        # A late reader: what the proxy drains before a splice fills its write buffer
        # toward us, and the flow control that follows must leave the client's reading
        # to the splice (TunnelSplice.holds).
        time.sleep(0.3)
        reader = threading.Thread(target=lambda: result.update(got=read_all(conn, rest)))
        reader.start()
        for block in up_blocks:
            conn.sendall(block)
        conn.shutdown(socket.SHUT_WR)
        reader.join(30)

    server = RawUpgradeServer(b"", script, delay_101=0.3)
    try:
        proxy, admin = start(start_proxy, mode, server.port)
        c = socket.create_connection(("127.0.0.1", proxy.port))
        c.settimeout(30)
        sender = threading.Thread(target=lambda: (
            c.sendall(UPGRADE_REQUEST + b"".join(down_blocks)),
            c.shutdown(socket.SHUT_WR)))
        sender.start()
        got = read_all(c, read_101(c))
        sender.join(30)
        server.close()
        c.close()
        assert got == b"".join(up_blocks)
        up_got = server.result.get("got", b"")  # absent: the upstream never saw the EOF
        want = b"".join(down_blocks)
        assert len(up_got) == len(want) and up_got == want
        # Spliced or copied: a sender that outruns the drain keeps the copy path.
        m = tunnel_metrics(admin)
        assert m["spliced"] + m["copied"] == 1 and wait_for(
            lambda: tunnel_metrics(admin)["active"] == 0)
    finally:
        server.sock.close()


@pytest.mark.timeout(60)
def test_upstream_half_close_then_client_keeps_sending(start_proxy, mode):
    def script(conn, rest, result):
        conn.sendall(b"bye")
        conn.shutdown(socket.SHUT_WR)  # done talking, still listening
        result["got"] = read_all(conn, rest)

    server = RawUpgradeServer(b"", script)
    try:
        proxy, admin = start(start_proxy, mode, server.port)
        c = upgrade_request(proxy.port, b"")
        got = read_all(c, read_101(c))
        assert got == b"bye"  # EOF reached the client, its side is still open
        payload = b"".join(stream(64, b"C"))
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        server.close()
        assert server.result["got"] == payload
        assert c.recv(1) == b""
        c.close()
        assert wait_for(lambda: tunnel_metrics(admin)["active"] == 0)
    finally:
        server.sock.close()


@pytest.mark.timeout(60)
def test_upstream_reset_tears_down_both(start_proxy, mode):
    def script(conn, rest, result):
        conn.sendall(b"x" * 1000)
        time.sleep(0.3)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        conn.close()  # RST

    server = RawUpgradeServer(b"", script)
    try:
        proxy, admin = start(start_proxy, mode, server.port)
        fds_before = open_fds(proxy.proc.pid)
        c = upgrade_request(proxy.port, b"")
        rest = read_101(c)
        got = rest
        try:
            while chunk := c.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        assert got == b"x" * 1000
        server.close()
        c.close()
        assert wait_for(lambda: open_fds(proxy.proc.pid) <= fds_before)
        m = tunnel_metrics(admin)
        assert m["active"] == 0 and m[mode] == 1, m
    finally:
        server.sock.close()


@pytest.mark.timeout(120)
def test_client_half_close_while_upstream_streams(start_proxy, mode):
    """The client says a little and half-closes right after the 101 while the upstream
    streams 32 MiB: its FIN reaches the proxy while the kernel still queues upstream
    bytes for the client (an empty FIN skb in that queue used to break the pipe and drop
    the rest). Three times, then once with the FIN sent along with the request (before
    the 101: that socket is no longer established, so the tunnel is copied)."""
    size = 32 * MiB
    blocks = [os.urandom(MiB) for _ in range(4)]
    want = hashlib.sha256(b"".join(blocks[i % 4] for i in range(size // MiB))).hexdigest()

    calls: list[int] = []
    ports: dict[str, int] = {}

    def script(conn, rest, result):
        calls.append(1)
        conn.sendall(blocks[0])
        wait_decided(ports["admin"], len(calls))
        for i in range(1, size // MiB):
            conn.sendall(blocks[i % 4])
        conn.shutdown(socket.SHUT_WR)
        result["got"] = read_all(conn, rest)

    # The 101 waits a little, so the early FIN surely arrives before it.
    server = RawUpgradeServer(b"", script, conns=4, delay_101=0.05)
    try:
        proxy, admin = start(start_proxy, mode, server.port)
        ports["admin"] = admin
        for attempt in range(4):
            early_fin = attempt == 3
            c = upgrade_request(proxy.port, b"hello" if early_fin else b"")
            if early_fin:
                c.shutdown(socket.SHUT_WR)
            rest = read_101(c)
            if not early_fin:
                wait_decided(admin, attempt + 1)  # spliced; the upstream's stream goes on
                c.sendall(b"hello")
                c.shutdown(socket.SHUT_WR)
            got = read_all(c, rest)
            c.close()
            assert len(got) == size and hashlib.sha256(got).hexdigest() == want, (
                f"attempt {attempt}: {len(got)} of {size} bytes")
        server.close()
        assert [r["got"] for r in server.results] == [b"hello"] * 4
        assert wait_for(lambda: tunnel_metrics(admin)["active"] == 0)
        m = tunnel_metrics(admin)
        assert (m["spliced"], m["copied"]) == ((3, 1) if mode == "spliced" else (0, 4)), m
    finally:
        server.sock.close()


@pytest.mark.timeout(60)
def test_tls_listener_tunnels_are_copied_and_logged_once(start_proxy, demo_upstream, tmp_path):
    """The kernel cannot splice TLS: with splice_tunnels on, wss tunnels still work,
    copied in user space, and the proxy says why once."""
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    reason = splice_reason()
    if reason:
        pytest.skip(f"socket splicing unavailable: {reason}")
    pki = make_pki(tmp_path / "pki")
    admin = free_port()
    proxy = start_proxy(  # one process: "logged once" is per process
        "[server]\nworkers = 1\n" + simple_config(demo_upstream) + admin_block(admin)
        + "\n[kernel]\nsplice_tunnels = true\n",
        listener_extra=f'tls = {{ cert = "{pki.cert}", key = "{pki.key}" }}')
    wait_port("127.0.0.1", admin)
    ctx = ssl.create_default_context(cafile=str(pki.ca))

    # websockets' asyncio client: its sync client reads in a thread while the caller
    # writes on the same SSLSocket, and under TLS 1.3 that loses its handshake request
    # now and then (Python's SSL objects are not safe to read and write at once; the
    # same hang happens against a plain uvloop or asyncio TLS server, never with TLS 1.2).
    async def echo_twice() -> None:
        for i in range(2):
            async with ws_connect_async(f"wss://127.0.0.1:{proxy.port}/ws", ssl=ctx,
                                        compression=None, open_timeout=10) as ws:
                await ws.send(f"over tls {i}")
                assert await asyncio.wait_for(ws.recv(), 10) == f"over tls {i}"

    asyncio.run(echo_twice())
    m = tunnel_metrics(admin)
    assert (m["spliced"], m["copied"]) == (0, 2), m
    log = process_log(proxy.proc)
    assert log.count("tunnels over TLS are copied") == 1, log
