"""backend = "redis": buckets shared by several aiproxy processes through a real
redis-server on a loopback port; Redis down or stuck fails open or closed, never hangs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import simple_config
from tests.support import start_demo_upstream, start_redis_server, stop_process

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed")


REDIS: dict[int, subprocess.Popen] = {}


@pytest.fixture
def redis_port(tmp_path) -> Iterator[int]:
    """A redis-server of this test's own on a free loopback port."""
    proc, port = start_redis_server(tmp_path)
    REDIS[port] = proc
    yield port
    del REDIS[port]
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
    stop_process(proc)


def _limit(port: int, extra: str = "") -> str:
    return f"""
[[ratelimits]]
name = "shared"
requests_per_second = 0.01
burst_requests = 10
backend = "redis"
redis_url = "redis://127.0.0.1:{port}/0"
{extra}
"""


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def test_two_proxies_enforce_one_budget(start_proxy, demo_upstream, redis_port):
    a = start_proxy(simple_config(demo_upstream) + _limit(redis_port))
    b = start_proxy(simple_config(demo_upstream) + _limit(redis_port))
    codes = []
    with httpx.Client(timeout=10) as c:
        for i in range(30):
            proxy = a if i % 2 else b
            r = c.post(f"{proxy.url}/v1/chat/completions", json=CHAT)
            codes.append(r.status_code)
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                assert r.headers["x-aiproxy-backpressure"] == "requests"
    assert codes.count(200) == 10, codes  # one bucket of 10 across both processes
    assert codes[:10] == [200] * 10


def test_token_budget_is_shared_and_settled(start_proxy, demo_upstream, redis_port):
    limit = f"""
[[ratelimits]]
name = "tpm"
tokens_per_minute = 600
burst_tokens = 600
backend = "redis"
redis_url = "redis://127.0.0.1:{redis_port}/0"
"""
    a = start_proxy(simple_config(demo_upstream) + limit)
    b = start_proxy(simple_config(demo_upstream) + limit)
    body = {"model": "m", "max_tokens": 100,
            "messages": [{"role": "user", "content": "one two three"}]}
    used = 0
    ok = 0
    with httpx.Client(timeout=10) as c:
        for i in range(40):
            r = c.post(f"{(a, b)[i % 2].url}/v1/chat/completions", json=body)
            if r.status_code == 200:
                ok += 1
                used += r.json()["usage"]["total_tokens"]
            time.sleep(0.01)  # settlements are fire-and-forget; let them land
    # Each reserves ~108 but uses 11: settling gives the rest back, so far more than
    # 600 // 108 = 5 requests pass, and the real usage stays within the budget.
    assert ok > 10
    assert used <= 600 + 10 * 40 * 0.01 + 108


@pytest.mark.parametrize("mode, status", [("open", 200), ("closed", 503)])
def test_redis_down_fails_per_config(start_proxy, demo_upstream, redis_port, mode, status):
    proxy = start_proxy(simple_config(demo_upstream)
                        + _limit(redis_port, f'on_backend_error = "{mode}"'))
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client(timeout=10) as c:
        assert c.post(url, json=CHAT).status_code == 200
        pids = [REDIS[redis_port].pid]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # stuck, not refusing: the timeout must act
        try:
            t0 = time.monotonic()
            r = c.post(url, json=CHAT)
            stuck_for = time.monotonic() - t0
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        assert r.status_code == status, r.text
        if status == 503:
            assert r.headers["x-aiproxy-backpressure"] == "backend_unavailable"
        assert stuck_for < 5  # bounded by redis_timeout_ms, not a hang
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.3)
        r = c.post(url, json=CHAT)  # connection refused now
        assert r.status_code == status
    assert "backend redis://127.0.0.1" in proxy.log()


def _tokens_level(port: int) -> float:
    """The (only) tokens bucket's level now, refilled as the scripts do."""
    import redis

    r = redis.Redis(port=port)
    try:
        keys = r.keys("rl:tpm:t:*")
        assert len(keys) == 1, keys
        level, stamp = (float(v) for v in r.hmget(keys[0], "l", "t"))
        secs, micros = r.time()
    finally:
        r.close()
    return min(BURST, level + (secs + micros / 1e6 - stamp) * TPM / 60)


TPM, BURST = 6, 10_000


def _settled(port: int, expect_low: float, expect_high: float) -> float:
    deadline = time.monotonic() + 10
    while True:
        level = _tokens_level(port)
        if expect_low <= level <= expect_high or time.monotonic() > deadline:
            return level
        time.sleep(0.05)


@pytest.fixture
def slow_upstream() -> Iterator[int]:
    """A demo upstream streaming a token every 20 ms."""
    proc, port = start_demo_upstream("slow", token_delay_ms=20)
    yield port
    stop_process(proc)


def test_reservations_settled_when_the_client_goes(start_proxy, demo_upstream, slow_upstream,
                                                  redis_port):
    """Whatever ends the exchange, the tokens reserved (prompt + max_tokens = ~505) are
    settled to the use: a client gone mid-stream pays for what was streamed only; a
    client gone (or a timeout) while the Redis take is in flight pays nothing, even when
    the stuck Redis runs the take after the proxy gave up on it."""
    # One worker, so the request after the first one uses its warm Redis connection: on a
    # new one, redis-py waits for the handshake before sending the take.
    limit = f"""
[server]
workers = 1

[[ratelimits]]
name = "tpm"
tokens_per_minute = {TPM}
burst_tokens = {BURST}
backend = "redis"
redis_url = "redis://127.0.0.1:{redis_port}/0"
redis_timeout_ms = {{timeout}}
"""
    body = {"model": "m", "max_tokens": 500, "stream": True,
            "messages": [{"role": "user", "content": " ".join(["word"] * 600)}]}
    proxy = start_proxy(simple_config(slow_upstream) + limit.format(timeout=3000),
                        'protocols = ["http1", "h2c"]')
    url = f"{proxy.url}/v1/chat/completions"
    # 1. Mid-stream: the upstream streams 500 words 20 ms apart; the client reads a few
    #    and hangs up. Reserved: the prompt (~750 estimated) + 500.
    with httpx.Client(timeout=10) as c, c.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    used = BURST - _settled(redis_port, BURST - 850, BURST - 700)
    assert 700 <= used <= 850, used  # the prompt and the words streamed, not ~1250

    # 2. The client goes while the take waits on a stuck Redis, which then runs it.
    #    (HTTP/2, where a client that gives up is seen at once: its stream ends.)
    before = _tokens_level(redis_port)
    redis_proc = REDIS[redis_port]
    os.kill(redis_proc.pid, signal.SIGSTOP)
    try:
        with (pytest.raises(httpx.ReadTimeout),
              httpx.Client(timeout=0.5, http2=True, http1=False) as c):
            c.post(f"{proxy.url}/v1/chat/completions", json=body)
        time.sleep(0.3)
    finally:
        os.kill(redis_proc.pid, signal.SIGCONT)
    time.sleep(1)
    assert _settled(redis_port, before - 5, BURST) >= before - 5
    gone = [json.loads(line) for line in proxy.log().splitlines()
            if line.startswith("{") and '"HTTP/2"' in line]
    assert gone and gone[-1].get("client_closed") and gone[-1]["bytes_out"] == 0, gone

    # 3. The take times out (failing open: the request goes on unlimited) and the stuck
    #    Redis runs it later: voided as well.
    proxy2 = start_proxy(simple_config(demo_upstream) + limit.format(timeout=200))
    small = {**body, "stream": False, "max_tokens": 5}
    with httpx.Client(timeout=10) as c:
        assert c.post(f"{proxy2.url}/v1/chat/completions", json=small).status_code == 200
        time.sleep(0.2)
        before = _tokens_level(redis_port)
        os.kill(redis_proc.pid, signal.SIGSTOP)
        try:
            r = c.post(f"{proxy2.url}/v1/chat/completions", json=small)
            assert r.status_code == 200, r.text
            time.sleep(0.5)
        finally:
            os.kill(redis_proc.pid, signal.SIGCONT)
    time.sleep(1)
    assert _settled(redis_port, before - 5, BURST) >= before - 5


def test_debt_lasts_as_long_as_in_memory(start_proxy, demo_upstream, redis_port):
    """A request that used more tokens than the bucket holds leaves it in debt: the
    in-process bucket refuses until the debt has refilled, so the Redis bucket must live
    that long too. It expired cap/rate + 60 s after its last use whatever its level, and
    came back full, forgiving the rest of the debt."""
    import redis

    proxy = start_proxy(simple_config(demo_upstream) + f"""
[[ratelimits]]
name = "tpm"
tokens_per_minute = 60
burst_tokens = 100
backend = "redis"
redis_url = "redis://127.0.0.1:{redis_port}/0"
""")
    body = {"model": "m", "max_tokens": 5,
            "messages": [{"role": "user", "content": " ".join(["word"] * 600)}]}
    with httpx.Client(timeout=10) as c:
        r = c.post(f"{proxy.url}/v1/chat/completions", json=body)
        assert r.status_code == 200
        used = r.json()["usage"]["total_tokens"]
        assert used > 600
        assert c.post(f"{proxy.url}/v1/chat/completions", json=body).status_code == 429
    client = redis.Redis(port=redis_port)
    try:
        [key] = client.keys("rl:tpm:t:*")
        deadline = time.monotonic() + 10
        while True:  # until the settlement (fire and forget) has landed
            level = float(client.hget(key, "l"))
            if level > 100 - used - 10 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        ttl = client.pttl(key)
    finally:
        client.close()
    assert level <= 100 - used + 10, level
    refill_ms = (100 - level) / (60 / 60) * 1000  # ~600 s at 1 token/s
    assert ttl >= refill_ms, (ttl, refill_ms)


def _sf_list(value: str) -> list[tuple[str, dict]]:
    import http_sf

    return [(name, dict(params)) for name, params in http_sf.parse(value.encode(),
                                                                   tltype="list")]


def test_ratelimit_fields_count_one_shared_budget(start_proxy, demo_upstream, redis_port):
    """The RateLimit fields of a Redis bucket: what the take script left, so two proxies
    sharing it count down together, one unit per request whichever answers."""
    a = start_proxy(simple_config(demo_upstream) + _limit(redis_port, "response_headers = true"))
    b = start_proxy(simple_config(demo_upstream) + _limit(redis_port))
    remaining = []
    with httpx.Client(timeout=10) as c:
        for i in range(10):
            r = c.post(f"{(a, b)[i % 2].url}/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
            if i % 2 == 0:  # a shows them on admitted responses, b (the default) does not
                assert _sf_list(r.headers["ratelimit-policy"]) == [
                    ("shared", {"q": 10, "w": 1000})]
                [(name, params)] = _sf_list(r.headers["ratelimit"])
                remaining.append(params["r"])
            else:
                assert "ratelimit" not in r.headers
        refused = c.post(f"{b.url}/v1/chat/completions", json=CHAT)
    assert remaining == [9, 7, 5, 3, 1]
    assert refused.status_code == 429
    after = int(refused.headers["retry-after"])
    assert _sf_list(refused.headers["ratelimit"]) == [("shared", {"r": 0, "t": after})]
