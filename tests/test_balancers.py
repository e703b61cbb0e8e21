"""Balancers, outlier detection and circuit breakers on a Cluster, without sockets."""

from __future__ import annotations

import asyncio
import collections

import pytest

from aiproxy.config import load_config_text
from aiproxy.routing.cluster import Cluster


class FakeHead:
    def __init__(self, headers: dict[bytes, bytes]) -> None:
        self.headers = headers

    def get(self, name: bytes) -> bytes | None:
        return self.headers.get(name)


class FakeDown:
    def __init__(self, peer: bytes) -> None:
        self.peer = peer


class FakeExchange:
    def __init__(self, user: str | None = None, peer: str = "10.0.0.1") -> None:
        self.head = FakeHead({b"x-user-id": user.encode()} if user else {})
        self.down = FakeDown(peer.encode())


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def make(loop, balancer: str, n: int = 3, extra: str = "", weights=None) -> Cluster:
    eps = ", ".join(
        f'{{ address = "127.0.0.1:{9000 + i}", weight = {weights[i] if weights else 1}, '
        f'capacity = 10 }}' for i in range(n))
    cfg = load_config_text(f"""
[[listeners]]
name = "l"
address = "127.0.0.1:1"
[[clusters]]
name = "c"
endpoints = [{eps}]
balancer = "{balancer}"
hash_key = "header:x-user-id"
{extra}
""", "t.toml")
    return Cluster(cfg.clusters[0], cfg.http, loop)


def port(pool) -> int:
    return pool.endpoint.port - 9000


def test_round_robin_is_weighted_and_smooth(loop):
    c = make(loop, "round_robin", 3, weights=[3, 1, 1])
    picks = [port(c.pick()) for _ in range(500)]
    assert collections.Counter(picks) == {0: 300, 1: 100, 2: 100}
    assert picks[:5].count(0) == 3  # smooth: not three in a row then the others


def test_round_robin_skips_unavailable_and_panics_when_none_left(loop):
    c = make(loop, "round_robin", 3)
    from aiproxy.routing.cluster import _set_availability_changed
    c.pools[0].stats.ejected = True
    c.pools[1].stats.healthy = False
    _set_availability_changed()
    assert {port(c.pick()) for _ in range(10)} == {2}
    c.pools[2].stats.ejected = True
    _set_availability_changed()
    assert {port(c.pick()) for _ in range(30)} == {0, 1, 2}  # panic: all of them
    for p in c.pools:
        p.stats.ejected = False
        p.stats.healthy = True
    _set_availability_changed()


def test_least_request_prefers_fewer_in_flight(loop):
    c = make(loop, "least_request", 3)
    c.pools[0].stats.in_flight = 50
    c.pools[1].stats.in_flight = 5
    picks = collections.Counter(port(c.pick()) for _ in range(3000))
    assert picks[2] > picks[1] > picks[0] == 0


@pytest.mark.parametrize("kind", ["ring_hash", "maglev"])
def test_hashing_is_sticky_spread_and_consistent(loop, kind):
    c = make(loop, kind, 4)
    users = [f"u{i}" for i in range(2000)]
    first = {u: port(c.pick(FakeExchange(u))) for u in users}
    assert all(port(c.pick(FakeExchange(u))) == first[u] for u in users[:200])
    spread = collections.Counter(first.values())
    assert len(spread) == 4 and min(spread.values()) > 2000 / 4 * 0.6, spread
    # Take endpoint 3 out: only its users move.
    from aiproxy.routing.cluster import _set_availability_changed
    c.pools[3].stats.ejected = True
    _set_availability_changed()
    after = {u: port(c.pick(FakeExchange(u))) for u in users}
    moved = [u for u in users if after[u] != first[u]]
    assert all(first[u] == 3 for u in moved) or kind == "maglev"
    stayed = sum(1 for u in users if first[u] != 3 and after[u] == first[u])
    assert stayed / sum(1 for u in users if first[u] != 3) > (0.99 if kind == "ring_hash"
                                                              else 0.9)
    c.pools[3].stats.ejected = False
    _set_availability_changed()
    # Without the header the client address is the key.
    assert port(c.pick(FakeExchange(None, "1.2.3.4"))) == port(c.pick(FakeExchange(None,
                                                                                 "1.2.3.4")))


def test_maglev_weights(loop):
    c = make(loop, "maglev", 2, weights=[3, 1])
    picks = collections.Counter(port(c.pick(FakeExchange(f"u{i}"))) for i in range(4000))
    assert 0.68 < picks[0] / 4000 < 0.82, picks


def test_llm_score_formula_and_inputs(loop):
    c = make(loop, "llm_score", 3, extra="[clusters.llm_score]\nexplore_pct = 0\n")
    s0, s1, s2 = (p.stats for p in c.pools)
    s0.ttfb_ms, s1.ttfb_ms, s2.ttfb_ms = 50.0, 400.0, 250.0
    picks = collections.Counter(port(c.pick()) for _ in range(200))
    assert picks == {0: 200}
    # 0.4*(1-0.1) + 0.3*(1-0) + 0.3*0 = 0.66 (+ < 0.01 tie-break)
    assert 0.66 <= s0.score < 0.67
    s0.in_flight = 10  # at capacity: load term 0 -> 0.36; endpoint 2: 0.4*0.5 + 0.3 = 0.5
    assert port(c.pick()) == 2
    s0.in_flight = 0
    s2.add_tokens(2000, loop.time())  # full tpm term: 0.2 + 0.3 + 0.3 = 0.8
    assert port(c.pick()) == 2
    s2.reported_load = 100.0  # the backend says it is full: 0.2 + 0 + 0.3 = 0.5
    s2.reported_at = loop.time()
    assert port(c.pick()) == 0


def test_outlier_ejection_grows_and_is_capped(loop):
    c = make(loop, "round_robin", 3, extra=(
        "outlier_detection = { consecutive_failures = 2, base_ejection_ms = 50, "
        "max_ejection_pct = 34 }"))
    p0, p1, _ = c.pools
    c.record(p0, True)
    assert not p0.stats.ejected
    c.record(p0, True)
    assert p0.stats.ejected and p0.stats.times_ejected == 1
    c.record(p1, True)
    c.record(p1, True)
    assert not p1.stats.ejected  # 1 of 3 already ejected: 34% cap reached
    loop.run_until_complete(asyncio.sleep(0.08))
    assert not p0.stats.ejected  # ejection over
    c.record(p0, True)
    c.record(p0, True)
    assert p0.stats.ejected and p0.stats.ejected_until - loop.time() > 0.06  # 2 x base
    loop.run_until_complete(asyncio.sleep(0.11))
    c.record(p0, False)
    assert not p0.stats.ejected and p0.stats.consecutive_failures == 0


def test_circuit_breakers(loop):
    c = make(loop, "round_robin", 1, extra="max_requests = 2\nmax_pending = 1\n"
                                           "max_connections = 3")
    assert c.overflow() is None
    c.active = 2
    assert "max_requests" in c.overflow()
    c.active = 0
    c.pending = 1
    assert "max_pending" in c.connect_overflow()
    c.pending = 0
    c.pools[0].open_count = 3
    assert "max_connections" in c.connect_overflow()
    assert c.overflows == 3


def test_gauge_value_parses_prometheus_text():
    from aiproxy.routing.cluster import gauge_value
    text = (b"# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage.\n"
            b"# TYPE vllm:gpu_cache_usage_perc gauge\n"
            b'vllm:gpu_cache_usage_perc{model_name="a"} 0.25\n'
            b'vllm:gpu_cache_usage_perc{model_name="b"} 0.5 1700000000\n'
            b"vllm:gpu_cache_usage_perc_other 9\n"
            b"vllm:num_requests_running 3\n")
    assert gauge_value(text, b"vllm:gpu_cache_usage_perc") == 0.5
    assert gauge_value(text, b"vllm:num_requests_running") == 3.0
    assert gauge_value(text, b"missing") is None
