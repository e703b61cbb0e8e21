"""Balancing and health end to end: llm_score against real upstreams of different
latency, ejection and recovery of a failing upstream, active health checks, circuit
breakers, and what GET /clusters shows."""

from __future__ import annotations

import asyncio
import collections
import time

import httpx

from tests.support import StreamServerThread, free_port, wait_port
from tests.test_routing_e2e import cluster, fan_out, tunable  # noqa: F401 (fixture)

# Circuit breakers, outlier ejection and llm_score state are per worker process:
# exact limits, ejections and shares show with one process.
SINGLE_PROCESS = "\n[server]\nworkers = 1\n"
ROUTE = """
[[routes]]
name = "all"
match = { path_prefix = "/" }
cluster = "c"
"""


def admin(port: int) -> str:
    return f'\n[admin]\naddress = "127.0.0.1:{port}"\n'


def counts(responses: list[httpx.Response]) -> collections.Counter:
    return collections.Counter(r.headers.get("x-upstream", str(r.status_code)) for r in responses)


def test_llm_score_prefers_fast_and_moves_when_it_slows(start_proxy, tunable):  # noqa: F811
    fast, medium, slow = tunable("fast", delay_ms=5), tunable("medium", delay_ms=60), \
        tunable("slow", delay_ms=200)
    endpoints = ", ".join(f'{{ address = "127.0.0.1:{u.port}", capacity = 10 }}'
                          for u in (fast, medium, slow))
    # scores are learned per worker process; the shares asserted are one learner's
    proxy = start_proxy(SINGLE_PROCESS + f"""
[[clusters]]
name = "c"
endpoints = [{endpoints}]
balancer = "llm_score"
""" + ROUTE)
    first = counts(asyncio.run(fan_out(proxy.url, 300, concurrency=4)))
    assert first["fast"] > 0.75 * 300, first
    assert first["fast"] > first["medium"] > 0 and first["slow"] < 0.1 * 300, first
    fast.delay_ms = 600  # the fast one degrades
    warmup = counts(asyncio.run(fan_out(proxy.url, 40, concurrency=4)))
    after = counts(asyncio.run(fan_out(proxy.url, 200, concurrency=4)))
    assert after["medium"] > 0.7 * 200, (first, warmup, after)
    assert after["fast"] < 0.1 * 200, (first, warmup, after)


def test_failing_upstream_is_ejected_and_comes_back(start_proxy, tunable):  # noqa: F811
    a, b = tunable("a"), tunable("b")
    admin_port = free_port()
    # ejections are per worker process, and /clusters[0] must be the one that served
    proxy = start_proxy(SINGLE_PROCESS + cluster("c", a.port, b.port, extra="""
outlier_detection = { consecutive_failures = 3, base_ejection_ms = 300 }
health_check = { path = "/healthz", interval_ms = 50, timeout_ms = 200, healthy_threshold = 2, unhealthy_threshold = 2 }
""") + ROUTE + admin(admin_port))
    wait_port("127.0.0.1", admin_port)
    with httpx.Client(base_url=proxy.url) as client:
        assert {client.get("/x").headers["x-upstream"] for _ in range(10)} == {"a", "b"}
        a.status = 500
        a.health_status = 500
        seen = [client.get("/x").status_code for _ in range(10)]
        assert seen.count(500) <= 3  # ejected after 3 consecutive failures
        assert {client.get("/x").headers["x-upstream"] for _ in range(20)} == {"b"}
        info = httpx.get(f"http://127.0.0.1:{admin_port}/clusters").json()[0]
        ep_a = next(e for e in info["endpoints"] if e["address"].endswith(f":{a.port}"))
        assert not ep_a["available"] and ep_a["times_ejected"] >= 1 or not ep_a["healthy"]
        time.sleep(0.5)  # the ejection ended, but the active checks still fail
        assert {client.get("/x").headers["x-upstream"] for _ in range(20)} == {"b"}
        a.status = 200
        a.health_status = 200
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if any(client.get("/x").headers["x-upstream"] == "a" for _ in range(4)):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("a never came back")
        info = httpx.get(f"http://127.0.0.1:{admin_port}/clusters").json()[0]
        ep_a = next(e for e in info["endpoints"] if e["address"].endswith(f":{a.port}"))
        assert ep_a["healthy"] and ep_a["health_check"] == "HTTP 200"
        assert {"in_flight", "ttfb_ewma_ms", "times_ejected", "score"} <= set(ep_a)


def test_upstream_that_times_out_is_ejected(start_proxy, tunable):  # noqa: F811
    # An endpoint that takes requests and never answers within request_timeout_ms is as
    # failed as one that answers 5xx (nginx's max_fails counts `timeout`, Envoy's
    # outlier detection a locally made 504): it must not take its share forever.
    hung, good = tunable("hung", delay_ms=5000), tunable("good")
    proxy = start_proxy(SINGLE_PROCESS + cluster("c", hung.port, good.port, extra="""
request_timeout_ms = 300
outlier_detection = { consecutive_failures = 2, base_ejection_ms = 60000 }
""") + ROUTE)
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        seen = [client.get("/x") for _ in range(12)]
    timed_out = [r for r in seen if r.status_code == 504]
    assert len(timed_out) == 2, [r.status_code for r in seen]
    assert all(r.json()["error"]["code"] == "upstream_timeout" for r in timed_out)
    assert [r.headers["x-upstream"] for r in seen[-6:]] == ["good"] * 6


async def flood_informational(reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
    """Answers every request with 103 Early Hints, on and on: never a final response."""
    try:
        await reader.readuntil(b"\r\n\r\n")
        while True:
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n" * 64)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def test_upstream_flooding_informational_responses_is_ejected(start_proxy, tunable):  # noqa: F811
    # The 502 the proxy makes for a 1xx flood is the endpoint's failure as much as a
    # garbled or oversized response head is.
    flooder = StreamServerThread(flood_informational)
    try:
        good = tunable("good")
        proxy = start_proxy(SINGLE_PROCESS + cluster("c", flooder.port, good.port, extra="""
outlier_detection = { consecutive_failures = 2, base_ejection_ms = 60000 }
""") + ROUTE)
        with httpx.Client(base_url=proxy.url, timeout=10) as client:
            seen = [client.get("/x") for _ in range(12)]
    finally:
        flooder.close()
    flooded = [r for r in seen if r.status_code == 502]
    assert len(flooded) == 2, [r.status_code for r in seen]
    assert all(r.json()["error"]["code"] == "upstream_bad_response" for r in flooded)
    assert [r.headers["x-upstream"] for r in seen[-6:]] == ["good"] * 6


def test_circuit_breaker_gives_503_at_once(start_proxy, tunable):  # noqa: F811
    up = tunable("slow", delay_ms=400)
    proxy = start_proxy(SINGLE_PROCESS + cluster("c", up.port, extra="max_requests = 2") + ROUTE)

    async def burst() -> list[tuple[int, float, dict]]:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=5) as client:
            async def one():
                t = time.monotonic()
                r = await client.get("/x")
                return r.status_code, time.monotonic() - t, r.json()
            first = [asyncio.create_task(one()) for _ in range(2)]
            await asyncio.sleep(0.1)
            rest = await asyncio.gather(*(one() for _ in range(4)))
            return [*await asyncio.gather(*first), *rest]

    results = asyncio.run(burst())
    assert [s for s, _, _ in results].count(200) == 2
    refused = [(t, body) for s, t, body in results if s == 503]
    assert len(refused) == 4
    assert all(t < 0.2 and body["error"]["code"] == "upstream_overflow" for t, body in refused)
    assert up.max_in_flight <= 2


def test_max_connections_breaker(start_proxy, tunable):  # noqa: F811
    up = tunable("slow", delay_ms=300)
    proxy = start_proxy(SINGLE_PROCESS + cluster("c", up.port, extra="max_connections = 1")
                        + ROUTE)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=5) as client:
            return [r.status_code for r in await asyncio.gather(
                *(client.get("/x") for _ in range(3)))]

    statuses = asyncio.run(burst())
    assert sorted(statuses) == [200, 503, 503]


def test_llm_score_uses_polled_backend_load(start_proxy, tunable):  # noqa: F811
    busy, idle = tunable("busy", delay_ms=5), tunable("idle", delay_ms=5)
    busy.metrics_text = ('# TYPE vllm:gpu_cache_usage_perc gauge\n'
                         'vllm:gpu_cache_usage_perc{model_name="m"} 0.97\n')
    idle.metrics_text = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.05\n'
    admin_port = free_port()
    # One process: with workers, /clusters lists only the workers that have reported
    # ready (none yet when the listener already accepts), and each polls on its own.
    proxy = start_proxy(SINGLE_PROCESS + cluster("c", busy.port, idle.port, extra="""
balancer = "llm_score"
load_metrics = { path = "/metrics", interval_ms = 100 }
[clusters.llm_score]
tpm_weight = 0.0
""") + ROUTE + admin(admin_port))
    wait_port("127.0.0.1", admin_port)

    def loads() -> dict[str, float | None]:
        info = httpx.get(f"http://127.0.0.1:{admin_port}/clusters").json()[0]
        return {e["address"]: e["reported_load_pct"] for e in info["endpoints"]}

    # Both endpoints polled once (None until then), not a sleep that a loaded box outlasts.
    deadline = time.monotonic() + 15
    while None in loads().values():
        assert time.monotonic() < deadline, loads()
        time.sleep(0.05)
    assert loads() == {f"127.0.0.1:{busy.port}": 97.0, f"127.0.0.1:{idle.port}": 5.0}
    seen = counts(asyncio.run(fan_out(proxy.url, 100, concurrency=2)))
    assert seen["idle"] > 85, seen
