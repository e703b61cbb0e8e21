"""What an HTTP/2 client can make the proxy hold of an HTTP/2 (gRPC) upstream's
responses (CVE-2019-9517, internal data buffering): the upstream's stream windows start
small and grow only while the client takes what arrives, so a client that does not
read holds back its upstream streams after a few tens of KiB each, and the windows one
client connection's streams grow into together are bounded. A client that reads gets
its response whole, at full windows.

The upstream (tests/h2_support.H2Upstream, the `h2` library) counts what it sends on
each stream and the largest stream window the proxy gave it; the client is raw frames
(FrameClient), so its windows are exactly what a test sets."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h2.exceptions
import pytest
from hyperframe.frame import DataFrame, HeadersFrame, SettingsFrame

from tests.h2_support import BLOCK, FrameClient, H2Upstream, ProxyProc, bytes_sha256, wait_for
from tests.support import admin_block, free_port, run_nginx, scrape

pytestmark = pytest.mark.timeout(120)

KiB = 1024
MiB = 1024 * KiB
INITIAL = 64 * KiB  # the proxy's SETTINGS_INITIAL_WINDOW_SIZE to upstreams
STREAM_WINDOW = MiB  # the most one upstream stream's window grows to
SHARE = 4 * MiB  # the growth one client connection's upstream streams share

CONFIG = """
[server]
workers = 1

[[listeners]]
name = "h2c"
address = "127.0.0.1:{port}"
protocols = ["h2c"]

[[clusters]]
name = "big"
endpoints = ["127.0.0.1:%d"]
protocol = "h2"

[[routes]]
name = "all"
cluster = "big"
"""


class Big:
    """/big/N: N bytes of the BLOCK pattern, sent as fast as the windows allow; per
    stream, what was sent, the largest stream window seen, and whether the sender now
    waits for the stream's own window (not the connection's)."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int], int] = {}
        self.peak: dict[tuple[int, int], int] = {}
        self.waiting: set[tuple[int, int]] = set()
        self.live: dict[tuple[int, int], Any] = {}  # h2 stream states being sent on
        self.most = 0  # the most the live streams' windows added up to at once

    async def __call__(self, proto, sid: int, path: str, head: dict, body: bytes) -> None:
        n = int(path.rsplit("/", 1)[1])
        key = (id(proto), sid)
        self.sent[key] = 0
        self.peak[key] = 0
        conn = proto.conn
        conn.send_headers(sid, [(b":status", b"200"),
                                (b"content-type", b"application/octet-stream")])
        proto.flush()
        off = 0
        while off < n:
            try:
                stream_window = conn.streams[sid].outbound_flow_control_window
                window = min(conn.local_flow_control_window(sid),
                             conn.max_outbound_frame_size)
            except (KeyError, h2.exceptions.ProtocolError):
                self.live.pop(key, None)
                return
            self.peak[key] = max(self.peak[key], stream_window)
            self.live[key] = conn.streams[sid]
            self.most = max(self.most, sum(
                max(st.outbound_flow_control_window, 0) for st in self.live.values()))
            if window <= 0:
                if stream_window <= 0:
                    self.waiting.add(key)
                ev = proto.windows.setdefault(sid, asyncio.Event())
                ev.clear()
                await ev.wait()
                self.waiting.discard(key)
                if proto.transport is None or proto.transport.is_closing():
                    return
                continue
            at = off % len(BLOCK)
            piece = BLOCK[at:at + min(window, n - off, len(BLOCK) - at)]
            conn.send_data(sid, piece)
            off += len(piece)
            self.sent[key] = off
            proto.flush()
            if len(piece) < window:
                await asyncio.sleep(0)
        conn.end_stream(sid)
        self.live.pop(key, None)


@pytest.fixture
def big() -> Iterator[tuple[H2Upstream, Big]]:
    handler = Big()
    up = H2Upstream(handler, name="big")
    yield up, handler
    up.stop()


@pytest.fixture
def proxy(big: tuple[H2Upstream, Big], tmp_path: Path) -> Iterator[ProxyProc]:
    up, _ = big
    admin = free_port()
    p = ProxyProc(tmp_path, CONFIG % up.port + admin_block(admin))
    p.admin = admin  # type: ignore[attr-defined]
    yield p
    p.stop()


def _gauges(p: ProxyProc, up: H2Upstream) -> tuple[float, float]:
    """(response bytes held for clients, window the upstream may still fill) of the
    `big` cluster, from /metrics."""
    m = scrape(p.admin)  # type: ignore[attr-defined]
    labels = (("cluster", "big"), ("endpoint", f"127.0.0.1:{up.port}"))
    return (m[("aiproxy_upstream_h2_response_held_bytes", labels)],
            m[("aiproxy_upstream_h2_stream_window_bytes", labels)])


def _on_loop(up: H2Upstream, fn):  # noqa: ANN001, ANN202 - a test helper
    """fn() run in the upstream's thread, between its events."""
    async def call():  # noqa: ANN202
        return fn()
    return asyncio.run_coroutine_threadsafe(call(), up.loop).result(10)


def test_a_client_that_never_reads_holds_back_its_upstream_streams(
        proxy: ProxyProc, big: tuple[H2Upstream, Big]) -> None:
    """100 streams of 64 MiB responses on one connection whose windows stay at 64 KiB
    (connection and streams) and are never opened: with the upstream's stream windows
    held at 1 MiB the proxy took about 1.1 MiB a stream (108 MiB). Now each stream's
    window stays at 64 KiB (the client never kept up), so what the upstream sends
    before every stream waits for window is a few tens of KiB over the client-side
    bound a stream, and the proxy's gauge of what it holds says the same."""
    up, handler = big
    streams = 100
    with FrameClient(proxy.ports["port"], timeout=30) as c:
        c.handshake()
        for i in range(streams):
            c.send(c.request(1 + 2 * i, f"/big/{64 * MiB}"))
        heads = c.frames_until(lambda f: isinstance(f, HeadersFrame) and f.stream_id == 199, 30)
        assert heads and heads[-1].stream_id == 199

        def settled() -> bool:
            if len(_on_loop(up, lambda: set(handler.waiting))) < streams:
                return False
            try:
                return _gauges(proxy, up)[1] == 0
            except KeyError:  # no such gauge: the upstream's side alone says it
                return True

        assert wait_for(settled, 60), f"{len(handler.waiting)} streams wait for window"
        sent = _on_loop(up, lambda: dict(handler.sent))
        total = sum(sent.values())
        # The client's connection window (64 KiB) took some; the rest the proxy holds.
        assert max(sent.values()) <= 512 * KiB, max(sent.values())
        assert total <= 16 * MiB, total
        held, window = _gauges(proxy, up)
        assert window == 0
        assert total - 65535 <= held <= total, (held, total)


def test_a_client_that_reads_gets_the_whole_response_at_full_window(
        proxy: ProxyProc, big: tuple[H2Upstream, Big]) -> None:
    """A client with large windows that reads as data comes: the response arrives byte
    for byte, and its upstream stream's window grew from 64 KiB to the full 1 MiB."""
    up, handler = big
    size = 32 * MiB
    with FrameClient(proxy.ports["port"], timeout=60) as c:
        c.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: 16 * MiB}, window=256 * MiB)
        c.send(c.request(1, f"/big/{size}"))
        resp = c.response(1, timeout=60)
    assert resp.status == 200 and resp.reset is None
    assert len(resp.body) == size
    assert hashlib.sha256(resp.body).hexdigest() == bytes_sha256(size)
    peaks = _on_loop(up, lambda: list(handler.peak.values()))
    assert peaks == [STREAM_WINDOW], peaks


def test_a_client_that_reads_many_streams_then_stops_holds_a_bounded_total(
        proxy: ProxyProc, big: tuple[H2Upstream, Big]) -> None:
    """16 streams read together, fast enough for their windows to grow, then none read
    any more: the windows grew by at most the client connection's share (4 MiB) in all,
    not 16 x (1 MiB - 64 KiB), so what the proxy is left holding is bounded by it."""
    up, handler = big
    streams = 16
    sids = [1 + 2 * i for i in range(streams)]
    got = dict.fromkeys(sids, 0)
    with FrameClient(proxy.ports["port"], timeout=60) as c:
        # Windows far larger than what is read: the proxy's output to it never waits.
        c.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: 64 * MiB}, window=1024 * MiB)
        for sid in sids:
            c.send(c.request(sid, f"/big/{1024 * MiB}"))
        while min(got.values()) < 2 * MiB:
            frame = c.recv(30)
            assert frame is not None, got
            if isinstance(frame, DataFrame) and frame.data:
                got[frame.stream_id] += len(frame.data)

        def settled() -> bool:
            if len(_on_loop(up, lambda: set(handler.waiting))) < streams:
                return False
            try:
                return _gauges(proxy, up)[1] == 0
            except KeyError:
                return True

        assert wait_for(settled, 60), f"{len(handler.waiting)} streams wait for window"
        total = sum(_on_loop(up, lambda: list(handler.sent.values())))
        most = _on_loop(up, lambda: handler.most)
        # Read by the client or in its socket: what the proxy sent it (its windows are
        # open), less than 64 KiB a stream over what was counted above.
        assert streams * INITIAL < most <= streams * INITIAL + SHARE, most
        held, _ = _gauges(proxy, up)
        assert held <= 8 * MiB, (held, total - sum(got.values()))


@pytest.mark.skipif(shutil.which("h2load") is None, reason="needs h2load (nghttp2-client)")
def test_h2load_many_streams_of_large_responses_from_nginx(tmp_path: Path) -> None:
    """h2load reads 40 streams of 8 MiB from nginx (h2c) through the proxy on one
    connection. With 1 MiB upstream stream windows, what waited for the client (paused
    while its socket was full) went out in one write when it resumed, over the 8 MiB a
    client that does not read its socket may have pending, and the proxy closed the
    connection on a client that reads: every request failed. Now all complete."""
    www = tmp_path / "www"
    www.mkdir()
    (www / "b8.bin").write_bytes(BLOCK * 128)
    with run_nginx(tmp_path, f"        root {www};", listen_extra="http2") as port:
        p = ProxyProc(tmp_path, CONFIG % port)
        try:
            res = subprocess.run(
                ["h2load", "-n", "40", "-c", "1", "-m", "40",
                 f"http://127.0.0.1:{p.ports['port']}/b8.bin"],
                capture_output=True, text=True, timeout=60)
        finally:
            log = p.stop()
    assert "40 succeeded, 0 failed" in res.stdout, res.stdout + res.stderr
    assert "does not read its socket" not in log


def _read_slowly(port: int, paths: list[str]) -> tuple[dict[int, int], set[int], bool]:
    """One connection with windows that never hold the proxy back asks for `paths` at
    once, then reads its socket in bursts of 16 KiB with a pause after each: slower than
    the proxy produces, so the proxy's side of the socket fills and its transport pauses
    and resumes again and again. Returns (DATA bytes per stream, streams ended, whether
    the proxy closed the connection first)."""
    with FrameClient(port, timeout=60, rcvbuf=64 * KiB) as c:
        c.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: 2**31 - 1}, window=2**31 - 1 - 65535)
        sids = [1 + 2 * i for i in range(len(paths))]
        c.send(*[c.request(sid, path) for sid, path in zip(sids, paths, strict=True)])
        got = dict.fromkeys(sids, 0)
        ended: set[int] = set()
        buf = bytearray()
        while len(ended) < len(sids):
            try:
                data = c.sock.recv(16 * KiB)
            except (ConnectionResetError, TimeoutError):
                data = b""
            if not data:
                return got, ended, True
            buf += data
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                length = int.from_bytes(buf[:3], "big")
                kind, flags, sid = buf[3], buf[4], int.from_bytes(buf[5:9], "big")
                if kind == 0x0:  # DATA (the proxy does not pad)
                    got[sid] += length
                if kind in (0x0, 0x1) and flags & 0x1:  # END_STREAM
                    ended.add(sid)
                if kind == 0x4 and not flags & 0x1:  # SETTINGS: ACK it
                    c.send(SettingsFrame(0, flags=["ACK"]))
                del buf[:9 + length]
            time.sleep(0.0005)
    return got, ended, False


@pytest.mark.parametrize(("listen_extra", "streams", "size"),
                         [("http2", 100, MiB), ("", 16, 8 * MiB)],
                         ids=["h2c-upstream", "http1-upstream"])
def test_a_client_that_reads_slowly_is_not_taken_for_one_that_does_not_read(
        tmp_path: Path, listen_extra: str, streams: int, size: int) -> None:
    """A client that reads all the time, but slower than the proxy produces: its
    socket fills and the proxy's transport pauses. What waited meanwhile on every
    stream (up to a stream window each from an h2c upstream, a read of the upstream
    socket each from HTTP/1.1 ones) went out in one write when the transport resumed,
    and one write of what a single turn of the event loop got from all the streams'
    upstreams: over the 8 MiB a client that does not read its socket may have pending,
    so the proxy closed the connection of a client that reads. Now the proxy stops
    handing out output once the transport pauses, and every response arrives whole."""
    www = tmp_path / "www"
    www.mkdir()
    (www / "f.bin").write_bytes(BLOCK * (size // len(BLOCK)))
    protocol = "h2" if listen_extra else "http1"
    config = CONFIG.replace('protocol = "h2"', f'protocol = "{protocol}"')
    with run_nginx(tmp_path, f"        root {www};", listen_extra=listen_extra) as port:
        p = ProxyProc(tmp_path, config % port)
        try:
            got, ended, cut = _read_slowly(p.ports["port"], ["/f.bin"] * streams)
        finally:
            log = p.stop()
    assert "does not read its socket" not in log
    assert not cut, f"closed after {sum(got.values()) / MiB:.1f} MiB"
    assert len(ended) == streams and set(got.values()) == {size}, got
