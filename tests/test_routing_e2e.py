"""Routing end to end through the real proxy: weighted splits, sticky keys and the
per-route policy (timeouts, retries, header edits, prefix rewrite, model override)."""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.tunable import TunableUpstream


@pytest.fixture
def tunable() -> Iterator:
    started: list[TunableUpstream] = []

    def _make(name: str, **kw) -> TunableUpstream:
        up = TunableUpstream(name, **kw).start()
        started.append(up)
        return up

    yield _make
    for up in started:
        up.stop()


def cluster(name: str, *ports: int, extra: str = "") -> str:
    endpoints = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
    return f'\n[[clusters]]\nname = "{name}"\nendpoints = [{endpoints}]\n{extra}\n'


async def fan_out(url: str, n: int, concurrency: int = 4, headers_for=None,
                  path: str = "/echo") -> list[httpx.Response]:
    out: list[httpx.Response] = []
    queue = iter(range(n))

    async def worker(client: httpx.AsyncClient) -> None:
        for i in queue:
            headers = headers_for(i) if headers_for else None
            out.append(await client.get(path, headers=headers))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=10, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return out


SPLIT = """
[[routes]]
name = "creative"
match = {{ path_prefix = "/" }}
split = [{{ cluster = "creative-v2", weight = 80 }}, {{ cluster = "creative-v1", weight = 20 }}]
{sticky}
"""


def test_weighted_split_80_20(start_proxy, demo_upstream, demo_upstream_b):
    proxy = start_proxy(cluster("creative-v2", demo_upstream) + cluster("creative-v1",
                        demo_upstream_b) + SPLIT.format(sticky=""))
    responses = asyncio.run(fan_out(proxy.url, 5000))
    counts = collections.Counter(r.headers["x-upstream"] for r in responses)
    assert sum(counts.values()) == 5000 and all(r.status_code == 200 for r in responses)
    share = counts["demo-a"] / 5000 * 100
    assert 77 <= share <= 83, counts


def test_sticky_split_keeps_a_user_on_one_side(start_proxy, demo_upstream, demo_upstream_b):
    proxy = start_proxy(cluster("creative-v2", demo_upstream) + cluster("creative-v1",
                        demo_upstream_b) + SPLIT.format(sticky='sticky_header = "x-user-id"'))
    users = [f"user-{i}" for i in range(200)]
    responses = asyncio.run(fan_out(proxy.url, 2000,
                                    headers_for=lambda i: {"x-user-id": users[i % 200]}))
    sides: dict[str, set[str]] = collections.defaultdict(set)
    for r in responses:
        sides[r.request.headers["x-user-id"]].add(r.headers["x-upstream"])
    assert len(sides) == 200
    assert all(len(s) == 1 for s in sides.values()), "a user moved between sides"
    per_side = collections.Counter(next(iter(s)) for s in sides.values())
    assert 120 <= per_side["demo-a"] <= 190, per_side  # about 80% of users on v2


def test_route_policy_headers_rewrite_model(start_proxy, tunable):
    up = tunable("t", )
    up.extra_headers = {"x-secret": "1", "x-keep": "yes"}
    proxy = start_proxy(cluster("c", up.port) + """
[[routes]]
name = "api"
match = { path_prefix = "/api/" }
cluster = "c"
prefix_rewrite = "/v1/"
model = "gpt-4o-mini"
request_headers_add = { x-team = "blue" }
request_headers_remove = ["cookie"]
response_headers_add = { x-served-by = "aiproxy" }
response_headers_remove = ["x-secret", "server"]
""", listener_extra='protocols = ["http1", "h2c"]')
    for http2 in (False, True):
        with httpx.Client(base_url=proxy.url, http1=not http2, http2=http2) as client:
            r = client.get("/api/chat?q=1", headers={"cookie": "a=b", "x-model-id": "other"})
        assert r.status_code == 200
        body = r.json()
        assert body["target"] == "/v1/chat?q=1"
        assert body["headers"]["x-team"] == "blue"
        assert body["headers"]["x-model-id"] == "gpt-4o-mini"
        assert "cookie" not in body["headers"]
        assert r.headers["x-served-by"] == "aiproxy" and r.headers["x-keep"] == "yes"
        assert "x-secret" not in r.headers and "server" not in r.headers


def test_route_timeout_overrides_cluster(start_proxy, tunable):
    up = tunable("slow", delay_ms=400)
    proxy = start_proxy(cluster("c", up.port, extra="request_timeout_ms = 5000") + """
[[routes]]
name = "fast"
match = { path_prefix = "/fast" }
cluster = "c"
timeout_ms = 100
[[routes]]
name = "rest"
match = { path_prefix = "/" }
cluster = "c"
""")
    # The upstream answers in 400 ms, well inside the cluster's 5 s: only the route's
    # 100 ms can make this a 504.
    r = httpx.get(proxy.url + "/fast")
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert httpx.get(proxy.url + "/slow").status_code == 200


def test_retries_on_503_with_budget_and_backoff(start_proxy, tunable):
    a = tunable("a")
    b = tunable("b")
    proxy = start_proxy(cluster("c", a.port, b.port) + """
[[routes]]
name = "r"
match = { path_prefix = "/" }
cluster = "c"
retries = { attempts = 2, on = ["503", "connect-failure"], backoff_ms = 5 }
""")
    a.fail_first = b.fail_first = 1  # each endpoint fails once, then recovers
    with httpx.Client(base_url=proxy.url) as client:
        r = client.get("/x")
        assert r.status_code == 200
        assert a.requests + b.requests == 3  # two 503s retried, third attempt answers
        a.fail_first = b.fail_first = 10
        r = client.get("/x")
        assert r.status_code == 503  # attempts exhausted: the upstream's answer goes back
        a.fail_first = b.fail_first = 0
        r = client.post("/x", content=b"payload" * 10)
        assert r.status_code == 200 and r.json()["body_bytes"] == 70
        a.fail_first = 1
        b.fail_first = 1
        before = a.requests + b.requests
        # The upstream answered: it may have acted on the POST, which is not sent again
        # without non_idempotent (tests/test_upstream_replay.py); a PUT is.
        assert client.post("/x", content=b"payload" * 10).status_code == 503
        assert a.requests + b.requests - before == 1
        a.fail_first = 1
        b.fail_first = 1
        r = client.put("/x", content=b"payload" * 10)  # body fully held: replayable
        assert r.status_code == 200 and r.json()["body_bytes"] == 70


def test_no_retry_without_policy_status(start_proxy, tunable):
    a = tunable("a")
    proxy = start_proxy(cluster("c", a.port) + """
[[routes]]
name = "r"
match = { path_prefix = "/" }
cluster = "c"
retries = { attempts = 3, on = ["502"] }
""")
    a.fail_first = 1
    assert httpx.get(proxy.url + "/x").status_code == 503
    assert a.requests == 1


def test_model_override_rewrites_small_json_bodies(start_proxy, tunable):
    up = tunable("t")
    proxy = start_proxy(cluster("c", up.port) + """
[[routes]]
name = "chat"
match = { path_prefix = "/" }
cluster = "c"
model = "gpt-4o-mini"
""", listener_extra='protocols = ["http1", "h2c"]')
    payload = {"model": "whatever", "messages": [{"role": "user", "content": "héllo"}]}
    for http2 in (False, True):
        with httpx.Client(base_url=proxy.url, http1=not http2, http2=http2) as client:
            r = client.post("/v1/chat/completions", json=payload)
            assert r.status_code == 200, r.text
            seen = r.json()
            assert seen["headers"]["x-model-id"] == "gpt-4o-mini"
            sent = json.loads(seen["body"])
            assert sent == {**payload, "model": "gpt-4o-mini"}
            assert seen["body_bytes"] == int(seen["headers"]["content-length"])
            # Not JSON, or too big to hold: forwarded untouched, header only.
            r = client.post("/x", content=b"model=abc", headers={"content-type": "text/plain"})
            assert r.json()["body"] == "model=abc"
            big = json.dumps({"model": "m", "pad": "x" * 70_000}).encode()
            r = client.post("/x", content=big, headers={"content-type": "application/json"})
            assert r.json()["body_bytes"] == len(big)
            assert r.json()["headers"]["x-model-id"] == "gpt-4o-mini"


def test_retry_on_reset(start_proxy, tunable):
    a = tunable("a")
    proxy = start_proxy(cluster("c", a.port) + """
[[routes]]
name = "r"
match = { path_prefix = "/" }
cluster = "c"
retries = { attempts = 1, on = ["reset"], backoff_ms = 1 }
""")
    a.reset_first = 1
    # one client connection, so one worker process and its upstream pool serve both
    with httpx.Client(base_url=proxy.url) as client:
        assert client.get("/x").status_code == 200
        # Now on a pooled connection: a reset before any byte is first replayed once on
        # a fresh connection (a stale keep-alive connection, not a retry), then the
        # policy's one retry; the third reset is the answer.
        before = a.requests
        a.reset_first = 3
        assert client.get("/x").status_code == 502
    assert a.requests - before == 3


@pytest.mark.parametrize("non_idempotent", [False, True])
def test_a_post_is_retried_after_a_reset_only_when_allowed(start_proxy, tunable,
                                                           non_idempotent):
    """RFC 9112 9.3.1: the upstream may have acted on a POST it got before the reset."""
    a = tunable("a")
    flag = str(non_idempotent).lower()
    proxy = start_proxy(cluster("c", a.port) + f"""
[[routes]]
name = "r"
match = {{ path_prefix = "/" }}
cluster = "c"
retries = {{ attempts = 1, on = ["reset"], backoff_ms = 1, non_idempotent = {flag} }}
""")
    before = a.requests
    a.reset_first = 2
    r = httpx.post(proxy.url + "/charge", content=b"hello")
    assert r.status_code == 502
    assert a.requests - before == (2 if non_idempotent else 1)
    a.reset_first = 1
    before = a.requests
    # An idempotent method is retried either way.
    assert httpx.put(proxy.url + "/charge", content=b"hello").status_code == 200
    assert a.requests - before == 2


def test_retry_on_grpc_unavailable(start_proxy, tunable):
    a = tunable("a")
    proxy = start_proxy(cluster("c", a.port) + """
[[routes]]
name = "r"
match = { path_prefix = "/" }
cluster = "c"
retries = { attempts = 2, on = ["unavailable"], backoff_ms = 1, non_idempotent = true }
""")
    # gRPC calls are POSTs: retried after an answer only with non_idempotent.
    a.extra_headers = {"grpc-status": "14", "grpc-message": "warming up"}
    headers = {"content-type": "application/grpc"}
    before = a.requests
    r = httpx.post(proxy.url + "/pkg.Svc/Run", content=b"\0\0\0\0\0", headers=headers)
    # Every answer says UNAVAILABLE: two retries, then the third answer goes back as is.
    assert r.headers["grpc-status"] == "14" and a.requests - before == 3
    a.extra_headers = {"grpc-status": "0"}
    assert httpx.post(proxy.url + "/pkg.Svc/Run", content=b"\0\0\0\0\0",
                      headers=headers).headers["grpc-status"] == "0"


def test_backtracking_regexes_do_not_stall_the_worker(start_proxy, demo_upstream,
                                                      demo_upstream_b):
    """Route regexes run in RE2 (linear time). Under Python's `re`, `([a-z]+)+` against
    40 letters and a "!" backtracks for hours (29 bytes took 16 s) and the worker answers
    nobody meanwhile: each request here must complete within the client's 10 s."""
    proxy = start_proxy(cluster("a", demo_upstream) + cluster("b", demo_upstream_b) + """
[[routes]]
name = "tenant"
match = { headers = { x-tenant = { regex = "([a-z]+)+" } } }
cluster = "a"

[[routes]]
name = "path"
match = { path_regex = "/r/([a-z]+)+" }
cluster = "a"

[[routes]]
name = "rest"
match = { path_prefix = "/" }
cluster = "b"
""")
    evil = "a" * 40 + "!"
    with httpx.Client(base_url=proxy.url, timeout=10) as c:
        r = c.get("/echo", headers={"x-tenant": evil})
        assert r.status_code == 200 and r.headers["x-upstream"] == "demo-b"
        r = c.get("/r/" + evil)
        assert r.headers["x-upstream"] == "demo-b"
        # Matching values still route to the regex routes; others fall through.
        assert c.get("/echo", headers={"x-tenant": "acme"}).headers["x-upstream"] == "demo-a"
        assert c.get("/r/abc").headers["x-upstream"] == "demo-a"
        assert c.get("/echo", headers={"x-tenant": "Acme"}).headers["x-upstream"] == "demo-b"
        assert c.get("/r/abc/d").headers["x-upstream"] == "demo-b"
        # A byte that is not UTF-8 is matched as a byte, as under `re`'s bytes patterns.
        r = c.get("/echo", headers={"x-tenant": b"\xe9t\xe9"})
        assert r.headers["x-upstream"] == "demo-b"
