"""Request bodies uploaded to an HTTP/2 upstream that reads slowly: what the proxy
writes towards it stays about one flush (256 KiB) plus one stream's queue, however many
streams upload at once. The upstream (tests/h2_raw_upstream.RawUpstream) opens its
windows wide and reads its socket slowly, so the proxy's transport pauses and resumes
again and again; the client is httpx, uploading over one HTTP/2 connection; the bound is
read from /metrics (aiproxy_upstream_h2_write_buffer_bytes) while the uploads run."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from hyperframe.frame import DataFrame, HeadersFrame, SettingsFrame, WindowUpdateFrame

from aiproxy.protocols.h2_output import SILLY_WINDOW
from tests.h2_raw_upstream import RawConn, RawUpstream
from tests.h2_support import BLOCK, ProxyProc
from tests.support import admin_block, free_port, scrape

pytestmark = pytest.mark.timeout(120)

KiB = 1024
MiB = 1024 * KiB
STREAMS = 16
SIZE = 2 * MiB
MAX_WINDOW = 2**31 - 1

CONFIG = """
[server]
workers = 1

[[listeners]]
name = "h2c"
address = "127.0.0.1:{port}"
protocols = ["h2c"]

[[clusters]]
name = "slow"
endpoints = ["127.0.0.1:%d"]
protocol = "h2"

[[routes]]
name = "all"
cluster = "slow"
"""


def _slow_reader(received: dict[int, int]) -> object:
    """An upstream script: windows as wide as HTTP/2 allows, then one DATA frame read
    at a time with a pause after each; each request is answered with the number of body
    bytes it carried once its body ends."""

    def script(conn: RawConn) -> None:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
        conn.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: MAX_WINDOW})
        conn.send(WindowUpdateFrame(0, window_increment=MAX_WINDOW - 65535))
        ended = 0
        while ended < STREAMS:
            frame = conn.recv(timeout=60)
            if frame is None:
                return
            conn.frames.clear()
            if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                conn.send(SettingsFrame(0, flags=["ACK"]))
            if isinstance(frame, DataFrame):
                received[frame.stream_id] = received.get(frame.stream_id, 0) + len(frame.data)
                time.sleep(0.001)
            if isinstance(frame, (DataFrame, HeadersFrame)) and "END_STREAM" in frame.flags:
                ended += 1
                body = b"%d" % received.get(frame.stream_id, 0)
                conn.send(conn.headers(frame.stream_id, [
                    (b":status", b"200"), (b"content-length", b"%d" % len(body))]),
                    conn.data(frame.stream_id, body, end=True))
        conn.until(lambda f: False, timeout=5)  # until the proxy closes

    return script


def test_uploads_to_a_slow_upstream_keep_its_write_buffer_bounded(tmp_path: Path) -> None:
    """16 request bodies uploaded at once over one client connection to an upstream that
    opens wide windows and reads slowly: each stream's body waits in its queue (up to
    256 KiB before its client is paused) while the upstream's transport is paused. All
    of them went into the transport's buffer at once when it resumed, several MiB for
    an upstream that reads slowly; now they are released stream by stream until the
    transport pauses again, so the buffer stays within about a flush plus one stream's
    queue (well under 1 MiB)."""
    received: dict[int, int] = {}
    up = RawUpstream(_slow_reader(received))
    admin = free_port()
    p = ProxyProc(tmp_path, CONFIG % up.port + admin_block(admin))
    body = BLOCK * (SIZE // len(BLOCK))
    labels = (("cluster", "slow"), ("endpoint", f"127.0.0.1:{up.port}"))
    peak = 0
    try:
        url = f"http://127.0.0.1:{p.ports['port']}/upload"
        results: list[tuple[int, bytes]] = []
        done = threading.Event()

        async def upload() -> None:
            async with httpx.AsyncClient(http1=False, http2=True, timeout=90) as client:
                replies = await asyncio.gather(*[client.post(url, content=body)
                                                 for _ in range(STREAMS)])
            results.extend((r.status_code, r.content) for r in replies)

        def run() -> None:
            try:
                asyncio.run(upload())
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()
        while not done.is_set():
            m = scrape(admin)
            peak = max(peak, m.get(("aiproxy_upstream_h2_write_buffer_bytes", labels), 0))
    finally:
        log = p.stop()
        up.stop()
    assert results == [(200, b"%d" % SIZE)] * STREAMS, (results, log[-3000:])
    assert sorted(received.values()) == [SIZE] * STREAMS, received
    # The transport did back up (past its 64 KiB high-water mark): the bound was tested.
    assert peak > 64 * KiB, f"the upstream's transport never backed up: {peak}"
    assert peak < MiB, f"{peak / MiB:.2f} MiB waited in the transport towards the upstream"


def _window_by_steps(served: list[int], streams: int, step: int) -> object:
    """An upstream script: stream windows wide open, the connection's window left at
    65,535 and then opened `step` bytes at a time, 3 x `streams` times, once every
    request's HEADERS and the first window's DATA have arrived; `served` gets the stream
    that took most of each step. Then the window opens wide and each request is answered
    with the number of body bytes it carried."""

    def script(conn: RawConn) -> None:
        conn.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: MAX_WINDOW})
        got: dict[int, int] = {}
        ended: set[int] = set()

        def read(turn: dict[int, int]) -> bool:
            frame = conn.recv(timeout=30)
            if frame is None:
                return False
            if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                conn.send(SettingsFrame(0, flags=["ACK"]))
            if isinstance(frame, HeadersFrame):
                got.setdefault(frame.stream_id, 0)
            if isinstance(frame, DataFrame):
                got[frame.stream_id] = got.get(frame.stream_id, 0) + len(frame.data)
                turn[frame.stream_id] = turn.get(frame.stream_id, 0) + len(frame.data)
            if isinstance(frame, (DataFrame, HeadersFrame)) and "END_STREAM" in frame.flags:
                ended.add(frame.stream_id)
                body = b"%d" % got[frame.stream_id]
                conn.send(conn.headers(frame.stream_id, [
                    (b":status", b"200"), (b"content-length", b"%d" % len(body))]),
                    conn.data(frame.stream_id, body, end=True))
            return True

        first: dict[int, int] = {}
        while len(got) < streams or sum(first.values()) <= 65535 - SILLY_WINDOW:
            if not read(first):
                return
        for _ in range(3 * streams):
            conn.send(WindowUpdateFrame(0, window_increment=step))
            turn: dict[int, int] = {}
            while sum(turn.values()) <= step - SILLY_WINDOW:
                if not read(turn):
                    return
            served.append(max(turn, key=turn.__getitem__))
        conn.send(WindowUpdateFrame(0, window_increment=MAX_WINDOW - 65535 - 3 * streams * step))
        while len(ended) < streams:
            if not read({}):
                return
        conn.until(lambda f: False, timeout=5)  # until the proxy closes

    return script


def test_connection_window_updates_go_round_the_uploads(tmp_path: Path) -> None:
    """Four uploads over one upstream connection whose stream windows are wide open and
    whose connection window opens 16 KiB at a time: each update goes to the next upload
    with body waiting, round them. In id order the first took every update while the
    others, their bodies queued too, waited until it had ended."""
    streams = 4
    served: list[int] = []
    up = RawUpstream(_window_by_steps(served, streams, 16 * KiB))
    p = ProxyProc(tmp_path, CONFIG % up.port)
    body = BLOCK * (SIZE // len(BLOCK))
    try:
        url = f"http://127.0.0.1:{p.ports['port']}/upload"

        async def upload() -> list[tuple[int, bytes]]:
            async with httpx.AsyncClient(http1=False, http2=True, timeout=60) as client:
                replies = await asyncio.gather(*[client.post(url, content=body)
                                                 for _ in range(streams)])
            return [(r.status_code, r.content) for r in replies]

        results = asyncio.run(upload())
    finally:
        log = p.stop()
        up.stop()
    assert results == [(200, b"%d" % SIZE)] * streams, (results, log[-3000:])
    assert len(set(served)) == streams, f"updates went to streams {served}"
