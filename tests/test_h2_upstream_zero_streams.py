"""An HTTP/2 upstream whose SETTINGS allow no concurrent streams
(SETTINGS_MAX_CONCURRENT_STREAMS = 0, RFC 9113 6.5.2): the proxy must not open
connection after connection to it. Real proxy process, real h2c upstream, real client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.h2_support import H2Upstream, ProxyProc

pytestmark = pytest.mark.timeout(60)

CONFIG = """
[server]
workers = 1  # one pool: each worker process has its own
drain_timeout_ms = 1000

[[listeners]]
name = "http"
address = "127.0.0.1:{port}"

[[clusters]]
name = "zero"
protocol = "h2"
endpoints = ["127.0.0.1:{up}"]
connect_timeout_ms = 800

[[routes]]
name = "all"
cluster = "zero"
"""


@pytest.fixture
def zero() -> Iterator[H2Upstream]:
    up = H2Upstream(name="zero", max_streams=0)
    yield up
    up.stop()


@pytest.fixture
def proxy(zero: H2Upstream, tmp_path: Path) -> Iterator[ProxyProc]:
    p = ProxyProc(tmp_path, CONFIG.replace("{up}", str(zero.port)))
    yield p
    p.stop()


def test_zero_stream_limit_fails_with_503_on_one_connection(zero, proxy):
    url = f"http://127.0.0.1:{proxy.ports['port']}/echo"
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: httpx.post(url, content=b"hi", timeout=10),
                                range(4)))
    took = time.monotonic() - t0
    for r in replies:
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "upstream_no_streams", r.text
        assert "SETTINGS_MAX_CONCURRENT_STREAMS" in r.json()["error"]["message"]
    assert took < 5, took  # within about the connect timeout, not a request timeout
    # One connection, kept for a SETTINGS that may raise the limit; not one per retry.
    assert zero.connections == 1, zero.connections
    assert not [e for e in zero.events if e[1] == "request"]  # no stream was opened


def test_a_raised_limit_lets_waiting_requests_through(zero, proxy):
    url = f"http://127.0.0.1:{proxy.ports['port']}/echo"
    with ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(httpx.post, url, content=b"hi", timeout=10) for _ in range(2)]
        deadline = time.monotonic() + 5
        while zero.connections < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        zero.update_settings(10)  # within connect_timeout_ms of the requests
        replies = [f.result() for f in pending]
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    assert zero.connections == 1
