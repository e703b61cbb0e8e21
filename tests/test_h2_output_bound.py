"""The response data an HTTP/2 client connection can make the proxy hold (CVE-2019-9517,
internal data buffering): per stream, OUT_HIGH waits for the client's window before the
upstream is paused; per connection, past CONN_OUT_HIGH the streams adding to the total
are paused too. Raw frames (tests/h2_support.py FrameClient) keep the windows shut
exactly; the demo upstream serves the bodies; the proxy's RSS is read from /proc."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hyperframe.frame import DataFrame, SettingsFrame, WindowUpdateFrame

from tests.h2_support import FrameClient, H2Response, ProxyProc, RssMonitor
from tests.support import stops_reading

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
