"""The response data an HTTP/2 client connection can make the proxy hold (CVE-2019-9517,
internal data buffering): per stream, OUT_HIGH waits for the client's window before the
upstream is paused; per connection, past CONN_OUT_HIGH the streams adding to the total
are paused too. Raw frames (tests/h2_support.py FrameClient) keep the windows shut
exactly; the demo upstream serves the bodies; the proxy's RSS is read from /proc."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hyperframe.frame import (
    DataFrame,
    HeadersFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from aiproxy.protocols.h2_output import SILLY_WINDOW
from tests.h2_support import FrameClient, H2Response, ProxyProc, RssMonitor
from tests.support import bytes_read, stops_reading

pytestmark = pytest.mark.timeout(90)

MiB = 1024 * 1024
STREAMS = 100  # the h2_max_concurrent_streams default

CONFIG = """
[[listeners]]
name = "h2c"
address = "127.0.0.1:{port}"
protocols = ["h2c"]

[http]
h2_max_concurrent_streams = %d

[[clusters]]
name = "demo"
endpoints = ["127.0.0.1:%d"]

[[routes]]
name = "all"
cluster = "demo"
"""


@pytest.fixture
def proxy(demo_upstream: int, tmp_path) -> Iterator[ProxyProc]:
    p = ProxyProc(tmp_path, CONFIG % (STREAMS, demo_upstream))
    yield p
    p.stop()


def _first_bytes(c: FrameClient, sids: list[int], timeout: float = 20) -> None:
    """Reads until each stream in sids has had DATA (its 1-byte window's worth)."""
    waiting = set(sids)
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        frame = c.recv(1)
        if isinstance(frame, DataFrame) and frame.data:
            waiting.discard(frame.stream_id)
    assert not waiting, f"no DATA on streams {sorted(waiting)}"


def _response(c: FrameClient, sid: int) -> H2Response:
    """c.response(), failing with a short message (not the body so far) if stuck."""
    try:
        return c.response(sid, timeout=30)
    except TimeoutError:
        pytest.fail(f"stream {sid} never completed: paused behind the stalled streams")


def test_shut_windows_on_many_streams_hold_a_bounded_total(proxy: ProxyProc) -> None:
    """One connection, 100 streams of large responses, every stream window 1 byte: each
    stream paused only at OUT_HIGH (256 KiB) made the proxy hold about 30 MiB for it.
    The connection's bound keeps that to about 1 MiB plus one upstream read a stream."""
    port = proxy.ports["port"]
    sids = [1 + 2 * i for i in range(STREAMS)]
    with RssMonitor(proxy.pid) as rss, FrameClient(port) as c:
        c.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: 1})
        for sid in sids:
            c.send(c.request(sid, "/bytes/50000000"))
        _first_bytes(c, sids)
        assert stops_reading(proxy.pid), "the proxy never paused its upstreams"
    assert rss.growth < 16 * MiB, rss.describe()


def test_stream_the_client_reads_completes_beside_stalled_ones(proxy: ProxyProc) -> None:
    """Streams whose windows stay shut hold the connection's total over its mark; a
    stream on the same connection whose client reads (with a small window, so its data
    waits now and then and it is paused for the total) still completes, whole. Once the
    stalled streams' windows open, they complete too: nothing lost or reordered."""
    port = proxy.ports["port"]
    stalled = [1 + 2 * i for i in range(12)]  # 12 x 256 KiB: well over the 1 MiB mark
    size = 2 * MiB
    with FrameClient(port, timeout=30) as c:
        c.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: 1}, window=64 * MiB)
        for sid in stalled:
            c.send(c.request(sid, f"/bytes/{size}"))
        _first_bytes(c, stalled)
        # The stalled streams fill up to their own limit.
        assert stops_reading(proxy.pid), "the proxy never paused its upstreams"
        reader = stalled[-1] + 2
        c.send(c.request(reader, f"/bytes/{size}"),
               WindowUpdateFrame(reader, window_increment=16 * 1024))
        resp = _response(c, reader)  # acknowledges each DATA frame as it reads it
        assert resp.status == 200 and resp.reset is None
        assert len(resp.body) == size
        assert resp.body == (bytes(range(256)) * (size // 256))
        # The stalled streams resume once their windows open.
        for sid in stalled:
            c.send(WindowUpdateFrame(sid, window_increment=size))
        for sid in stalled:
            got = _response(c, sid)
            assert got.reset is None, f"stream {sid} reset: {got.reset}"
            # 1 byte arrived before response() was asked, while the windows were shut.
            assert len(got.body) == size - 1, f"stream {sid}: {len(got.body)} bytes"
            assert got.body == (bytes(range(256)) * (size // 256))[1:]


def test_a_stream_is_not_resumed_while_the_connection_cannot_write(proxy: ProxyProc) -> None:
    """A stream paused for the connection's total (its own queue small) stays paused
    while the connection's transport is paused, even once the total falls and its
    window opens: its upstream is read again only when the bytes can go. Before, the
    WINDOW_UPDATE resumed its upstream at once, and the proxy read up to OUT_HIGH more
    of it into a queue that could not move."""
    port = proxy.ports["port"]
    stalled = [1 + 2 * i for i in range(12)]
    target = stalled[-1] + 2  # window 1: paused for the total, with one read queued
    bulk = target + 2  # window open, client not reading: fills the socket
    size = 2 * MiB
    bulk_size = 16 * MiB
    with FrameClient(port, timeout=30, rcvbuf=64 * 1024) as c:
        c.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: 1}, window=2**31 - 1 - 65535)
        for sid in stalled:
            c.send(c.request(sid, f"/bytes/{size}"))
        _first_bytes(c, stalled)
        assert stops_reading(proxy.pid), "the proxy never paused its upstreams"
        c.send(c.request(target, f"/bytes/{size}"))
        _first_bytes(c, [target])
        c.send(c.request(bulk, f"/bytes/{bulk_size}"),
               WindowUpdateFrame(bulk, window_increment=bulk_size))
        # The client reads nothing now: the transport pauses, and bulk's upstream with it.
        assert stops_reading(proxy.pid), "the proxy never paused bulk's upstream"
        # The connection's total falls under its low mark ...
        c.send(*[RstStreamFrame(sid, error_code=0x8) for sid in stalled])
        assert stops_reading(proxy.pid)
        before = bytes_read(proxy.pid)
        # ... and target's window opens, while the transport is still paused.
        c.send(WindowUpdateFrame(target, window_increment=size))
        assert stops_reading(proxy.pid)
        read = bytes_read(proxy.pid) - before
        assert read < 64 * 1024, f"read {read} bytes from upstreams that cannot be sent"
        # Once the client reads, both complete whole.
        got = _response(c, target)
        assert got.reset is None and len(got.body) == size - 1, len(got.body)
        assert got.body == (bytes(range(256)) * (size // 256))[1:]
        got = _response(c, bulk)
        assert got.status == 200 and got.reset is None
        assert got.body == bytes(range(256)) * (bulk_size // 256)


def test_connection_window_updates_go_round_the_streams(proxy: ProxyProc) -> None:
    """Stream windows wide open, the connection's window opened 16 KiB at a time: each
    update goes to the next stream with data waiting, round the streams. In id order,
    the first stream took every update while the others, their bodies queued too,
    waited until it had ended."""
    port = proxy.ports["port"]
    sids = [1, 3, 5, 7]
    step = 16 * 1024
    with FrameClient(port, timeout=30) as c:
        c.handshake({SettingsFrame.INITIAL_WINDOW_SIZE: 64 * MiB})
        for sid in sids:
            c.send(c.request(sid, "/bytes/8388608"))
        got = {sid: 0 for sid in sids}
        heads: set[int] = set()
        # The connection's initial 65,535 bytes (less what is under SILLY_WINDOW, which
        # waits for the next update), and every response's HEADERS.
        while sum(got.values()) <= 65535 - SILLY_WINDOW or len(heads) < len(sids):
            frame = c.recv(10)
            assert frame is not None, f"stuck: {got}, heads of {sorted(heads)}"
            if isinstance(frame, DataFrame):
                got[frame.stream_id] += len(frame.data)
            elif isinstance(frame, HeadersFrame):
                heads.add(frame.stream_id)
        served: list[int] = []
        # A stream whose body has not yet come from the upstream (a busy machine) is
        # passed over, so allow some updates beyond one round; in id order the first
        # stream would take all of them (its 8 MiB needs 512).
        while set(served) != set(sids) and len(served) < 10 * len(sids):
            c.send(WindowUpdateFrame(0, window_increment=step))
            turn: dict[int, int] = {}
            while sum(turn.values()) <= step - SILLY_WINDOW:
                frame = c.recv(10)
                assert frame is not None, f"stuck after {served}: {turn}"
                if isinstance(frame, DataFrame):
                    turn[frame.stream_id] = turn.get(frame.stream_id, 0) + len(frame.data)
            served.append(max(turn, key=turn.__getitem__))
        assert set(served) == set(sids), f"updates went to streams {served}"


def test_release_order_starts_after_the_stream_last_served() -> None:
    from aiproxy.protocols.h2_output import release_order
    streams = {1: "a", 3: "b", 7: "c", 9: "d"}
    assert release_order(streams, 0) == ["a", "b", "c", "d"]
    assert release_order(streams, 3) == ["c", "d", "a", "b"]
    assert release_order(streams, 5) == ["c", "d", "a", "b"]  # stream 5 has ended since
    assert release_order(streams, 9) == ["a", "b", "c", "d"]
    assert release_order({}, 9) == []
