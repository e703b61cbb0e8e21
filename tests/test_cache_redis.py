"""[cache] backend = "redis": two aiproxy processes share prompt cache entries through a
real redis-server; Redis down or stuck means a miss, never a hang."""

from __future__ import annotations

import os
import shutil
import signal
import time

import httpx
import pytest

from aiproxy.cache.redis_store import decode, encode
from tests.conftest import simple_config
from tests.support import start_redis_server, stop_process

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed")

CHAT = {"model": "demo-model", "max_tokens": 6,
        "messages": [{"role": "user", "content": "name three rivers in Europe"}]}


def test_entry_encoding_round_trips():
    items = [(b"content-type", b"text/event-stream"), (b"x-upstream", b"a")]
    chunks = [b"data: 1\n\n", b"", b"data: [DONE]\n\n"]
    assert decode(encode(200, 12.5, items, chunks)) == (200, 12.5, items, chunks)
    with pytest.raises(ValueError):
        decode(encode(200, 1.0, items, chunks) + b"x")


@pytest.fixture
def redis(tmp_path):
    proc, port = start_redis_server(tmp_path)
    yield proc, port
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
    stop_process(proc)


def _cfg(upstream: int, redis_port: int) -> str:
    return simple_config(upstream) + f"""
[cache]
shared = true
backend = "redis"
redis_url = "redis://127.0.0.1:{redis_port}/0"
"""


def _wait_hit(client: httpx.Client, url: str, body: dict) -> httpx.Response:
    # The store is fire-and-forget after the response: give it a moment to land.
    for _ in range(50):
        r = client.post(url, json=body)
        if r.headers["x-aiproxy-cache"] == "hit":
            return r
        time.sleep(0.05)
    raise AssertionError("never a hit")


def test_two_proxies_share_entries(start_proxy, demo_upstream, redis):
    _, port = redis
    a = start_proxy(_cfg(demo_upstream, port))
    b = start_proxy(_cfg(demo_upstream, port))
    with httpx.Client() as c:
        first = c.post(f"{a.url}/v1/chat/completions", json=CHAT)
        assert first.headers["x-aiproxy-cache"] == "miss"
        hit = _wait_hit(c, f"{b.url}/v1/chat/completions", CHAT)
        assert hit.content == first.content
        body = {**CHAT, "stream": True}
        live = c.post(f"{b.url}/v1/chat/completions", json=body)
        replay = _wait_hit(c, f"{a.url}/v1/chat/completions", body)
        assert replay.content == live.content
        assert replay.headers["content-type"] == "text/event-stream"


def test_redis_stuck_or_down_is_a_miss(start_proxy, demo_upstream, redis):
    proc, port = redis
    proxy = start_proxy(_cfg(demo_upstream, port))
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client(timeout=10) as c:
        c.post(url, json=CHAT)
        _wait_hit(c, url, CHAT)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = c.post(url, json=CHAT)
            took = time.monotonic() - t0
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert r.status_code == 200 and r.headers["x-aiproxy-cache"] == "miss"
        assert took < 5
        stop_process(proc)
        r = c.post(url, json=CHAT)
        assert r.status_code == 200 and r.headers["x-aiproxy-cache"] == "miss"
    assert "prompt cache lookup at redis://127.0.0.1" in proxy.log()
