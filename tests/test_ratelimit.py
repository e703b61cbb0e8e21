"""[[ratelimits]]: token buckets with reservations, settlement, 429s and the GPU
memory watermark, through the real proxy to demo upstreams."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from aiproxy.config import ConfigError, load_config_text
from aiproxy.llm.openai import read_request
from aiproxy.ratelimit.bucket import Budget, MemoryStore
from aiproxy.ratelimit.watermark import factor_for
from tests.conftest import simple_config
from tests.grpc_support import grpc_modules  # noqa: F401 - fixture
from tests.support import free_port, start_demo_upstream, stop_process

# In-process buckets are per process: the budgets these tests check are one process's
# (with workers, use backend = "redis" for one budget; tests/test_ratelimit_redis.py).
ONE_PROCESS = "[server]\nworkers = 1\n"


def test_budget_burst_refill_and_credit():
    b = Budget(10, 5, now=100.0)
    assert b.spend(10, 100.0)           # the whole burst at once
    assert not b.spend(1, 100.0)        # overdrawn: -1
    assert b.spend(4, 101.0)            # 1 s refills 5: -1 + 5 - 4 = 0
    assert b.spend(10, 1000.0)          # a long pause refills to the burst, no further
    assert not b.spend(0.5, 1000.0)
    b.credit(100)                       # credit is capped at the burst too
    assert b.spend(10, 1000.0) and not b.spend(0.5, 1000.0)


def test_watermark_factor():
    assert factor_for(None) == factor_for(10) == factor_for(49.9) == 1.0
    assert factor_for(50) == 1.0
    assert factor_for(65) == pytest.approx(0.65)
    assert factor_for(80) == pytest.approx(0.3)
    assert factor_for(80.1) == factor_for(100) == 0.1


def test_memory_bucket_takes_all_or_nothing():
    store = MemoryStore(10)
    keys = ["r", "t"]
    # 10 requests/s burst 2 and 60 tokens/s burst 100
    assert store.take(keys, [(10, 2, 1, 1.0), (60, 100, 70, 1.0)], 0.0) == (-1, 0.0)
    worst, wait = store.take(keys, [(10, 2, 1, 1.0), (60, 100, 70, 1.0)], 0.0)
    assert worst == 1 and wait == pytest.approx(40 / 60)
    assert store.buckets["r"].level == 1  # nothing taken from the request bucket
    # a need larger than the bucket is admitted when it is full, leaving debt
    assert store.take(["big"], [(1, 10, 25, 1.0)], 0.0) == (-1, 0.0)
    assert store.buckets["big"].level == -15
    # scaled to 10%: 90 of 100 are out of reach
    assert store.take(["s"], [(1, 100, 6, 0.1)], 0.0) == (-1, 0.0)
    worst, wait = store.take(["s"], [(1, 100, 5, 0.1)], 0.0)
    assert worst == 0 and wait == pytest.approx(1 / 0.1)  # refills at 10%: 0.1/s


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config_text(text, "rl.toml")
    return [str(p) for p in err.value.problems]


BASE = """
[[listeners]]
name = "l"
address = "127.0.0.1:8080"
[[clusters]]
name = "up"
endpoints = ["127.0.0.1:9001"]
[[routes]]
name = "chat"
cluster = "up"
"""


def test_config_errors_name_file_line_and_key():
    probs = _problems(BASE + """
[[ratelimits]]
name = "a"
routes = ["nope"]
key = ["tenant", "colour"]
tokens_per_minute = -1
backend = "memcached"
[[ratelimits]]
name = "b"
""")
    text = "\n".join(probs)
    assert "rl.toml:14: ratelimits[0].routes[0]: unknown route 'nope'" in text
    assert "rl.toml:15: ratelimits[0].key[1]: unknown key part 'colour'" in text
    assert "rl.toml:16: ratelimits[0].tokens_per_minute: must be >= 0, got -1" in text
    assert "rl.toml:17: ratelimits[0].backend: must be one of memory, redis" in text
    assert "ratelimits[1]: give requests_per_second or tokens_per_minute" in text
    cfg = load_config_text(BASE + """
[[ratelimits]]
name = "a"
routes = ["chat"]
key = ["tenant", "model"]
requests_per_second = 0.5
tokens_per_minute = 1000
""", "rl.toml")
    rl = cfg.ratelimits[0]
    assert (rl.routes, rl.key, rl.requests_per_second, rl.tokens_per_minute) == (
        ("chat",), ("tenant", "model"), 0.5, 1000)


def _chat(words: int, max_tokens: int | None = None, stream: bool = False) -> dict:
    body = {"model": "demo-model", "stream": stream,
            "messages": [{"role": "user", "content": " ".join(["lorem"] * words)}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


async def _fire(url: str, bodies: list[dict], headers: dict | None = None) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        return await asyncio.gather(*(client.post(url, json=b, headers=headers)
                                      for b in bodies))


def test_200_concurrent_requests_never_overrun_the_token_bucket(start_proxy, demo_upstream):
    proxy = start_proxy(ONE_PROCESS + simple_config(demo_upstream) + """
[[ratelimits]]
name = "tpm"
tokens_per_minute = 10000
""")
    body = _chat(200, max_tokens=50)
    reservation = read_request("chat", json.dumps(body).encode(), True, -1).prompt_tokens + 50
    t0 = time.monotonic()
    responses = asyncio.run(_fire(f"{proxy.url}/v1/chat/completions", [body] * 200))
    elapsed = time.monotonic() - t0
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == 200
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    assert used <= 10000 + elapsed * 10000 / 60 + reservation, (len(ok), used, elapsed)
    assert len(ok) >= 10000 // reservation  # the bucket was used, not refused wholesale
    assert refused
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["x-aiproxy-backpressure"] == "tokens"
        assert r.json()["error"]["code"] == "rate_limited"


def test_requests_bucket_per_tenant_header(start_proxy, demo_upstream):
    proxy = start_proxy(ONE_PROCESS + simple_config(demo_upstream) + """
[llm]
tenant_header = "x-tenant"
[[ratelimits]]
name = "rps"
requests_per_second = 1
burst_requests = 3
""")
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        a = [c.post(url, json=_chat(3), headers={"x-tenant": "a"}).status_code
             for _ in range(5)]
        b = c.post(url, json=_chat(3), headers={"x-tenant": "b"})
    assert a[:3] == [200, 200, 200] and 429 in a[3:]
    assert b.status_code == 200  # another tenant has its own bucket


def test_a_rate_near_zero_refuses_with_a_bounded_retry_after(start_proxy, demo_upstream):
    """The wait for the next token overflows to inf at such a rate: still a 429, with
    Retry-After at most a day (it was a 500 from math.ceil(inf))."""
    proxy = start_proxy(ONE_PROCESS + simple_config(demo_upstream) + """
[[ratelimits]]
name = "rps"
requests_per_second = 1e-320
burst_requests = 1
""")
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        first = c.post(url, json=_chat(3))
        second = c.post(url, json=_chat(3))
    assert first.status_code == 200
    assert second.status_code == 429 and second.headers["retry-after"] == "86400"
    # the window and reset stay Structured Field integers (at most 15 digits)
    assert _limits(second.headers) == ([("rps", {"q": 1, "w": 999_999_999_999_999})],
                                       [("rps", {"r": 0, "t": 86400})])


@pytest.fixture(scope="module")
def slow_upstream():
    proc, port = start_demo_upstream("rl-slow", token_delay_ms=100)
    yield port
    stop_process(proc)


def test_stream_past_its_reservation_is_charged_as_it_streams(start_proxy, slow_upstream):
    proxy = start_proxy(ONE_PROCESS + simple_config(slow_upstream) + """
[[ratelimits]]
name = "tpm"
tokens_per_minute = 60
burst_tokens = 60
default_max_tokens = 1
""")
    url = f"{proxy.url}/v1/chat/completions"
    # 16 ten-letter words: prompt ~48 tokens, reservation ~49 of 60; the reply is
    # 16 words (~45 estimated tokens) although only 1 was reserved.
    words = " ".join(["abcdefghij"] * 16)
    stream_body = {"model": "m", "stream": True,
                   "messages": [{"role": "user", "content": words}]}
    small = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=30) as c, c.stream("POST", url, json=stream_body) as s:
        assert s.status_code == 200
        events = 0
        lines = s.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events += 1
            if events == 8:
                break
        # 11 tokens were left after the reservation; the stream has used more since.
        r = c.post(url, json=small)
        assert r.status_code == 429, r.text
        assert r.headers["x-aiproxy-backpressure"] == "tokens"
        rest = list(lines)
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"


@pytest.mark.parametrize("load, factor", [(60, 1 - 0.7 * 10 / 30), (85, 0.1)])
def test_watermark_scales_the_admitted_rate(start_proxy, load, factor):
    proc, port = start_demo_upstream("loaded", extra=("--report-load", str(load)))
    try:
        proxy = start_proxy(ONE_PROCESS + simple_config(port) + """
[[ratelimits]]
name = "rps"
requests_per_second = 5
burst_requests = 100
""")
        url = f"{proxy.url}/v1/chat/completions"
        assert httpx.post(url, json=_chat(2)).status_code == 200  # the load is now known
        t0 = time.monotonic()
        responses = asyncio.run(_fire(url, [_chat(2)] * 150))
        elapsed = time.monotonic() - t0
    finally:
        stop_process(proc)
    ok = sum(r.status_code == 200 for r in responses)
    refused = [r for r in responses if r.status_code == 429]
    reachable = 99 - 100 * (1 - factor)  # level after the first, minus what is out of reach
    assert int(reachable) - 1 <= ok <= reachable + 5 * factor * elapsed + 1, (ok, elapsed)
    assert refused and all(r.headers["x-aiproxy-backpressure"] == "gpu_watermark"
                           for r in refused)


def test_watermark_band_queues_instead_of_refusing(start_proxy):
    proc, port = start_demo_upstream("band", extra=("--report-load", "60"))
    admin = free_port()
    try:
        proxy = start_proxy(ONE_PROCESS + simple_config(port) + f"""
[admin]
address = "127.0.0.1:{admin}"
[[ratelimits]]
name = "rps"
requests_per_second = 10
burst_requests = 5
max_wait_ms = 3000
""")
        url = f"{proxy.url}/v1/chat/completions"
        assert httpx.post(url, json=_chat(2)).status_code == 200
        responses = asyncio.run(_fire(url, [_chat(2)] * 10))
        metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
    finally:
        stop_process(proc)
    assert [r.status_code for r in responses] == [200] * 10
    queued = [x for x in metrics.splitlines() if x.startswith("aiproxy_ratelimit_queued_total")]
    assert queued and float(queued[0].split()[-1]) >= 5


def test_grpc_refusal_is_resource_exhausted(start_proxy, grpc_modules):  # noqa: F811
    import grpc

    from tests.grpc_support import GRPC_OPTIONS, InferenceServer, grpc_config

    pb2, pb2_grpc = grpc_modules
    server = InferenceServer(pb2, pb2_grpc)
    try:
        proxy = start_proxy(ONE_PROCESS + grpc_config(("g", server.port)) + """
[[ratelimits]]
name = "rps"
requests_per_second = 1
burst_requests = 2
""", 'protocols = ["h2c"]')
        with grpc.insecure_channel(f"127.0.0.1:{proxy.port}", options=GRPC_OPTIONS) as ch:
            stub = pb2_grpc.PredictorStub(ch)
            codes = []
            for _ in range(4):
                try:
                    stub.Predict(pb2.PredictRequest(model="m", prompt="hi"), timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.append(err.code())
    finally:
        server.stop()
    assert codes[:2] == [grpc.StatusCode.OK] * 2
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes[2:]


def test_buckets_survive_a_reload(start_proxy, demo_upstream):
    import signal

    admin = free_port()
    limit = """
[[ratelimits]]
name = "rps"
requests_per_second = 0.01
burst_requests = 2
"""
    proxy = start_proxy(ONE_PROCESS + simple_config(demo_upstream)
                        + f'\n[admin]\naddress = "127.0.0.1:{admin}"\n' + limit)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        assert [c.post(url, json=_chat(2)).status_code for _ in range(3)] == [200, 200, 429]
        text = proxy.config_path.read_text().replace("burst_requests = 2", "burst_requests = 3")
        proxy.config_path.write_text(text)
        proxy.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "aiproxy_config_reloads_total 1.0" not in httpx.get(
                f"http://127.0.0.1:{admin}/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # the bucket kept its level (0 of 2): not refilled to the new burst of 3
        assert c.post(url, json=_chat(2)).status_code == 429


def test_a_huge_max_tokens_is_still_charged_its_usage(start_proxy, demo_upstream):
    """A request reserving far more than the bucket holds (max_tokens = 2**60) is settled
    to its real usage like any other. Reserving 2**60 took the whole level into a float
    where a token is below rounding: settling gave back up to the whole bucket, so the
    usage was never charged (any client could spend its tokens for free that way)."""
    proxy = start_proxy(ONE_PROCESS + simple_config(demo_upstream) + """
[[ratelimits]]
name = "tpm"
tokens_per_minute = 1
burst_tokens = 1000
""")
    url = f"{proxy.url}/v1/chat/completions"
    hi = [{"role": "user", "content": "hi"}]
    with httpx.Client(timeout=10) as c:
        r = c.post(url, json={"model": "m", "max_tokens": 2**60, "messages": hi})
        assert r.status_code == 200
        assert r.json()["usage"]["total_tokens"] == 4  # 996 of 1000 left
        # Reserves 5 (the estimate of "hi") + 992 = 997: more than is left.
        r = c.post(url, json={"model": "m", "max_tokens": 992, "messages": hi})
        assert r.status_code == 429, r.text
        assert r.headers["x-aiproxy-backpressure"] == "tokens"
        r = c.post(url, json={"model": "m", "max_tokens": 991, "messages": hi})
        assert r.status_code == 200


def test_a_queued_request_counts_once_in_every_limiter(start_proxy):
    """A request that waits in the watermark queue for one limiter is admitted by the
    others once: each retry of the queue took another unit from the requests bucket of
    every limiter before the one it waited for, so one request cost several."""
    proc, port = start_demo_upstream("band-2", extra=("--report-load", "60"))
    try:
        proxy = start_proxy(ONE_PROCESS + simple_config(port) + """
[[ratelimits]]
name = "per-client"
requests_per_second = 0.01
burst_requests = 3
watermark = false
[[ratelimits]]
name = "shared"
requests_per_second = 2
burst_requests = 1
max_wait_ms = 5000
""")
        url = f"{proxy.url}/v1/chat/completions"
        with httpx.Client(timeout=30) as c:
            # The first request makes the load (60%) known; "shared" is empty after it,
            # so the second waits for it in the queue (about 0.7 s) and the third too.
            codes = [c.post(url, json=_chat(2)).status_code for _ in range(3)]
            fourth = c.post(url, json=_chat(2))
    finally:
        stop_process(proc)
    assert codes == [200, 200, 200]  # three requests: "per-client"'s three units
    assert fourth.status_code == 429
    assert fourth.headers["x-aiproxy-backpressure"] == "requests"


# RateLimit-Policy / RateLimit (draft-ietf-httpapi-ratelimit-headers-10/11), read with
# http_sf, an RFC 9651 parser: each a List of Items whose value is a String naming the
# policy, one per request bucket.

def _sf_list(value: str | None) -> list[tuple[str, dict]]:
    import http_sf

    assert value is not None
    members = http_sf.parse(value.encode(), tltype="list")
    for name, _ in members:
        assert type(name) is str, name  # a String, not a Token (the draft's MUST)
    return [(name, dict(params)) for name, params in members]


def _limits(headers: httpx.Headers) -> tuple[list, list]:
    return (_sf_list(headers.get("ratelimit-policy")), _sf_list(headers.get("ratelimit")))


def test_a_429_says_the_policy_and_what_is_left(start_proxy, demo_upstream):
    proxy = start_proxy(ONE_PROCESS + simple_config(demo_upstream) + """
[[ratelimits]]
name = "per-tenant"
requests_per_second = 0.01
burst_requests = 2
""")
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        ok = [c.post(url, json=_chat(2)) for _ in range(2)]
        refused = c.post(url, json=_chat(2))
    # Admitted responses say nothing unless response_headers asks for it.
    assert all(r.status_code == 200 and "ratelimit" not in r.headers for r in ok)
    assert refused.status_code == 429
    policy, limit = _limits(refused.headers)
    # burst 2 at 0.01/s: 2 requests per 200 s; nothing left, and the next fits in
    # Retry-After seconds, which the reset does not pass (the draft's section 6).
    assert policy == [("per-tenant", {"q": 2, "w": 200})]
    after = int(refused.headers["retry-after"])
    assert 90 <= after <= 100
    assert limit == [("per-tenant", {"r": 0, "t": after})]


def test_response_headers_count_down_as_requests_are_made(start_proxy, demo_upstream):
    proxy = start_proxy(ONE_PROCESS + simple_config(demo_upstream) + """
[[ratelimits]]
name = "rps"
requests_per_second = 0.01
burst_requests = 5
response_headers = true
""")
    url = f"{proxy.url}/v1/chat/completions"
    remaining, resets = [], []
    with httpx.Client() as c:
        for n in range(5):
            r = c.post(url, json=_chat(2, stream=n % 2 == 1))  # event streams too
            assert r.status_code == 200
            assert n % 2 == 0 or r.text.rstrip().endswith("data: [DONE]")
            policy, limit = _limits(r.headers)
            assert policy == [("rps", {"q": 5, "w": 500})]
            [(name, params)] = limit
            assert name == "rps"
            remaining.append(params["r"])
            resets.append(params["t"])
        last = c.post(url, json=_chat(2))
    assert remaining == [4, 3, 2, 1, 0]  # one unit per request
    # until the bucket is full again: 100 s per unit taken (less what refilled meanwhile)
    assert all(100 * n - 5 <= t <= 100 * n for n, t in enumerate(resets, 1)), resets
    assert last.status_code == 429
    assert _limits(last.headers)[1] == [("rps", {"r": 0, "t": int(last.headers["retry-after"])})]


def _curl_head(*args: str) -> tuple[int, dict[str, list[str]]]:
    import subprocess

    out = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-D", "-", "--max-time", "10",
                          *args], capture_output=True, text=True, timeout=20, check=True)
    lines = out.stdout.splitlines()
    status = int(lines[0].split()[1])
    fields: dict[str, list[str]] = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            fields.setdefault(name.strip().lower(), []).append(value.strip())
    return status, fields


@pytest.mark.parametrize("version", ["--http1.1", "--http2-prior-knowledge"])
def test_curl_sees_one_member_per_limiter(start_proxy, demo_upstream, version):
    """Every limiter with a request bucket reports its own member; a limiter of tokens
    only has none (the draft registers no quota unit for tokens). Over HTTP/1.1 and
    HTTP/2 alike, on admitted responses and on 429s."""
    proxy = start_proxy(ONE_PROCESS + simple_config(demo_upstream) + """
[[ratelimits]]
name = "slow"
requests_per_second = 0.01
burst_requests = 3
response_headers = true
[[ratelimits]]
name = "tpm"
tokens_per_minute = 100000
response_headers = true
[[ratelimits]]
name = "fast"
requests_per_second = 0.5
burst_requests = 10
response_headers = true
""", 'protocols = ["http1", "h2c"]')
    args = [version, "-H", "content-type: application/json",
            "--data-binary", json.dumps(_chat(2)), f"{proxy.url}/v1/chat/completions"]
    seen = []
    for _ in range(4):
        status, fields = _curl_head(*args)
        policy = _sf_list(", ".join(fields["ratelimit-policy"]))
        limit = _sf_list(", ".join(fields["ratelimit"]))
        seen.append((status, policy, limit))
    for status, policy, _ in seen[:3]:
        assert status == 200
        assert policy == [("slow", {"q": 3, "w": 300}), ("fast", {"q": 10, "w": 20})]
    assert [[(n, p["r"]) for n, p in limit] for _, _, limit in seen[:3]] == [
        [("slow", 2), ("fast", 9)], [("slow", 1), ("fast", 8)], [("slow", 0), ("fast", 7)]]
    status, policy, limit = seen[3]
    # "slow" refuses first: "fast" is not asked, so only "slow" is reported
    assert status == 429
    assert policy == [("slow", {"q": 3, "w": 300})]
    assert [(n, p["r"]) for n, p in limit] == [("slow", 0)]


def test_grpc_callers_get_the_fields_as_metadata(start_proxy, grpc_modules):  # noqa: F811
    import grpc

    from tests.grpc_support import GRPC_OPTIONS, InferenceServer, grpc_config

    pb2, pb2_grpc = grpc_modules
    server = InferenceServer(pb2, pb2_grpc)
    try:
        proxy = start_proxy(ONE_PROCESS + grpc_config(("g", server.port)) + """
[[ratelimits]]
name = "rps"
requests_per_second = 0.01
burst_requests = 2
response_headers = true
""", 'protocols = ["h2c"]')
        with grpc.insecure_channel(f"127.0.0.1:{proxy.port}", options=GRPC_OPTIONS) as ch:
            stub = pb2_grpc.PredictorStub(ch)
            admitted = []
            for _ in range(2):
                _, call = stub.Predict.with_call(pb2.PredictRequest(model="m", prompt="hi"),
                                                 timeout=10)
                admitted.append(dict(call.initial_metadata()))
            with pytest.raises(grpc.RpcError) as err:
                stub.Predict(pb2.PredictRequest(model="m", prompt="hi"), timeout=10)
    finally:
        server.stop()
    limits = [_sf_list(md["ratelimit"]) for md in admitted]
    assert [[(n, p["r"]) for n, p in limit] for limit in limits] == [[("rps", 1)], [("rps", 0)]]
    assert limits[0][0][1]["t"] == 100 and 190 <= limits[1][0][1]["t"] <= 200
    assert all(_sf_list(md["ratelimit-policy"]) == [("rps", {"q": 2, "w": 200})]
               for md in admitted)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(err.value.trailing_metadata())
    assert _sf_list(trailers["ratelimit-policy"]) == [("rps", {"q": 2, "w": 200})]
    assert _sf_list(trailers["ratelimit"])[0][1]["r"] == 0


def test_response_headers_option_and_policy_names(tmp_path):
    cfg = load_config_text(BASE + """
[[ratelimits]]
name = "a"
requests_per_second = 1
response_headers = true
""", "rl.toml")
    assert cfg.ratelimits[0].response_headers is True
    text = "\n".join(_problems(BASE + """
[[ratelimits]]
name = "café"
requests_per_second = 1
response_headers = "yes"
"""))
    assert "ratelimits[0].name: must be printable ASCII" in text
    assert "ratelimits[0].response_headers" in text


def _go_seconds(text: str) -> int:
    """A Go duration of whole seconds ("45s", "1m40s", "2h0m0s") in seconds."""
    import re

    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(\d+)s", text)
    assert m, text
    h, mi, s = (int(g or 0) for g in m.groups())
    return h * 3600 + mi * 60 + s


def test_openai_headers_through_the_openai_client(start_proxy, demo_upstream):
    """openai_headers: x-ratelimit-{limit,remaining,reset}-{requests,tokens} as OpenAI's
    API sends them, read by the openai client from admitted responses and from the
    RateLimitError of a 429. Of two limiters the tighter token bucket is reported."""
    import openai

    proxy = start_proxy(ONE_PROCESS + simple_config(demo_upstream) + """
[[ratelimits]]
name = "rpm"
requests_per_second = 0.01
burst_requests = 3
tokens_per_minute = 600000
openai_headers = true

[[ratelimits]]
name = "tpm"
tokens_per_minute = 60
burst_tokens = 1000
openai_headers = true
""")
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0)
    seen = []
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model="demo-model", max_tokens=50,
            messages=[{"role": "user", "content": "lorem ipsum dolor"}])
        assert raw.parse().choices[0].message.content
        h = raw.headers
        seen.append((int(h["x-ratelimit-remaining-requests"]),
                     _go_seconds(h["x-ratelimit-reset-requests"]),
                     int(h["x-ratelimit-remaining-tokens"]),
                     _go_seconds(h["x-ratelimit-reset-tokens"])))
        assert h["x-ratelimit-limit-requests"] == "3"
        assert h["x-ratelimit-limit-tokens"] == "1000"  # the tighter bucket's burst
    assert [s[0] for s in seen] == [2, 1, 0]
    # 100 s a request unit to refill; a token a second, and 50 + the prompt reserved
    assert all(100 * n - 5 <= s[1] <= 100 * n for n, s in enumerate(seen, 1)), seen
    tokens = [s[2] for s in seen]
    assert tokens[0] <= 1000 - 50 and tokens[0] > tokens[1] > tokens[2] > 0, seen
    assert all(1000 - t - 5 <= s[3] <= 1000 - t for t, s in zip(tokens, seen, strict=True)), seen

    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="demo-model", max_tokens=50,
                                       messages=[{"role": "user", "content": "again"}])
    h = err.value.response.headers
    assert h["x-ratelimit-remaining-requests"] == "0"
    after = int(h["retry-after"])
    assert 0 < _go_seconds(h["x-ratelimit-reset-requests"]) <= after


def test_openai_headers_replace_the_upstreams_own(start_proxy):
    """An upstream (an OpenAI key shared by every tenant) that sends its own
    x-ratelimit-*-tokens: the client sees this proxy's token figures instead; fields
    of a kind no limiter here reports (requests) pass through."""
    import http.server
    import threading

    class Upstream(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            body = json.dumps({"id": "x", "object": "chat.completion", "model": "m",
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant",
                                                        "content": "hi"}}],
                               "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                         "total_tokens": 4}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.send_header("X-RateLimit-Remaining-Tokens", "149000")
            self.send_header("x-ratelimit-limit-tokens", "150000")
            self.send_header("x-ratelimit-remaining-requests", "4999")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proxy = start_proxy(ONE_PROCESS + simple_config(server.server_address[1]) + """
[[ratelimits]]
name = "tpm"
tokens_per_minute = 6000
burst_tokens = 500
openai_headers = true
""")
        r = httpx.post(f"{proxy.url}/v1/chat/completions", json=_chat(2, max_tokens=20))
        assert r.status_code == 200, r.text
        assert r.headers.get_list("x-ratelimit-limit-tokens") == ["500"]
        [left] = r.headers.get_list("x-ratelimit-remaining-tokens")
        assert 0 < int(left) <= 480
        assert r.headers.get_list("x-ratelimit-remaining-requests") == ["4999"]
        assert "x-ratelimit-limit-requests" not in r.headers
    finally:
        server.shutdown()
        server.server_close()


def test_redis_password_stays_out_of_the_backend_error_log(start_proxy, demo_upstream):
    # /config redacts a redis_url's password; the line logged when Redis cannot be
    # reached named the URL whole, so anyone who reads the log read the password.
    dead = free_port()
    url = f"redis://:hunter2pw@127.0.0.1:{dead}/0"
    proxy = start_proxy(ONE_PROCESS + simple_config(demo_upstream) + f"""
[cache]
shared = true
backend = "redis"
redis_url = "{url}"
redis_timeout_ms = 200

[[ratelimits]]
name = "shared"
backend = "redis"
redis_url = "{url}"
redis_timeout_ms = 200
requests_per_second = 100
""")
    r = httpx.post(f"{proxy.url}/v1/chat/completions", json=_chat(3), timeout=10)
    assert r.status_code == 200, r.text  # on_backend_error = "open", the cache a miss
    log = proxy.log()
    assert f"backend redis://:<redacted>@127.0.0.1:{dead}/0 failed" in log, log
    assert f"at redis://:<redacted>@127.0.0.1:{dead}/0 failed" in log, log
    assert "hunter2pw" not in log


@pytest.mark.parametrize("version", ["--http1.1", "--http2-prior-knowledge"])
def test_proxy_errors_on_admitted_requests_carry_the_fields(start_proxy, version):
    """An admitted request the proxy itself answers (here a 502: nothing listens on the
    upstream's port) still tells the client what its budget holds, in both field sets."""
    proxy = start_proxy(ONE_PROCESS + simple_config(free_port()) + """
[[ratelimits]]
name = "rps"
requests_per_second = 0.01
burst_requests = 2
response_headers = true
openai_headers = true
""", 'protocols = ["http1", "h2c"]')
    args = [version, "-H", "content-type: application/json",
            "--data-binary", json.dumps(_chat(2)), f"{proxy.url}/v1/chat/completions"]
    seen = [_curl_head(*args) for _ in range(3)]
    for left, (status, fields) in zip((1, 0), seen, strict=False):
        assert status in (502, 503), (status, fields)
        assert _sf_list(", ".join(fields["ratelimit-policy"])) == [("rps", {"q": 2, "w": 200})]
        [(name, params)] = _sf_list(", ".join(fields["ratelimit"]))
        assert (name, params["r"]) == ("rps", left)
        assert fields["x-ratelimit-limit-requests"] == ["2"]
        assert fields["x-ratelimit-remaining-requests"] == [str(left)]
    status, fields = seen[2]
    assert status == 429
    # one of each: the refusal's own fields, not the admitted ones added again
    assert len(fields["ratelimit"]) == 1 and len(fields["x-ratelimit-remaining-requests"]) == 1
