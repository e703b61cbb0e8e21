"""CPU per request of the LLM filters' hooks, each alone (pytest-benchmark).

The hooks run against a minimal stand-in for the Exchange holding the attributes they
read (head, path, loop clock, route, pool), so the figures are the filters' own added
cost; bench/llm_e2e.py measures the whole proxy's CPU per request with each on and off.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from aiproxy._fast.h1 import parse_request

from aiproxy.cache.key import prompt_key, request_hash
from aiproxy.cache.prompt import CacheState
from aiproxy.config.schema import CacheConfig, LlmConfig, RateLimitConfig
from aiproxy.llm.accounting import LlmState
from aiproxy.pipeline.filters import ResponseHead
from aiproxy.ratelimit.limiter import RateLimitFactory, RateLimitState

BODY = json.dumps({"model": "demo-model", "max_tokens": 64, "messages": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Summarise the plot of Hamlet in three sentences please."}]}
).encode()
COMPLETION = json.dumps({"id": "x", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "word " * 60}}],
    "usage": {"prompt_tokens": 30, "completion_tokens": 60, "total_tokens": 90}}).encode()
SSE = [b'data: {"id":"x","choices":[{"index":0,"delta":{"content":" word"}}]}\n\n'] * 60 + [
    b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":30,"completion_tokens":60}}\n\n',
    b"data: [DONE]\n\n"]
JSON_HEAD = ResponseHead(200, [(b"content-type", b"application/json")])
SSE_HEAD = ResponseHead(200, [(b"content-type", b"text/event-stream")])


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def time(self) -> float:
        self.t += 0.001
        return self.t


def exchange() -> SimpleNamespace:
    head = parse_request(b"POST /v1/chat/completions HTTP/1.1\r\nHost: api\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(BODY))
    stats = SimpleNamespace(add_tokens=lambda n, now: None, reported_at=0.0)
    return SimpleNamespace(
        method=b"POST", path=b"/v1/chat/completions", up_target=b"/v1/chat/completions",
        up_headers=None, head=head, identity=None, llm=None,
        down=SimpleNamespace(peer=b"127.0.0.1"), loop=Clock(), req_done=True,
        request_body=lambda: BODY, request_body_whole=lambda body: True,
        route=SimpleNamespace(name="chat", req_remove=()),
        t_start_pc=0.0,
        t_first=0.5, t_sent=0.1, pool=SimpleNamespace(stats=stats), intent_decision=None,
        cluster=SimpleNamespace(name="chat", track_tokens=False, pools=()), intent=None,
        gov={}, resp_version=11)


LLM = LlmState(LlmConfig())


def account(stream: bool) -> None:
    ex = exchange()
    f = LLM.factory.start(ex)
    f.request(ex)
    if stream:
        f.response_head(ex, SSE_HEAD)
        for chunk in SSE:
            f.response_body(ex, chunk)
    else:
        f.response_head(ex, JSON_HEAD)
        f.response_body(ex, COMPLETION)
    f.response_end(ex)
    f.done(ex)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse-60-events"])
def test_accounting(benchmark, stream: bool) -> None:
    benchmark.group = "llm accounting per request"
    benchmark(account, stream)


def test_ratelimit_admit_and_settle(benchmark) -> None:
    benchmark.group = "rate limit per request"
    state = RateLimitState()
    cfg = RateLimitConfig(name="b", requests_per_second=1e9, burst_requests=10**9,
                          tokens_per_minute=10**12)
    state.update(SimpleNamespace(ratelimits=(cfg,), llm=None, cache=None, auth=None))
    factory = RateLimitFactory(tuple(state.limiters.values()), None)
    ex = exchange()
    LLM.factory.start(ex).request(ex)

    def run() -> None:
        f = factory.start(ex)
        assert f.request(ex) is None
        f.response_body(ex, b"")
        f.done(ex)

    benchmark(run)


@pytest.mark.parametrize("hit", [False, True], ids=["miss", "hit"])
def test_cache_lookup(benchmark, hit: bool) -> None:
    benchmark.group = "prompt cache lookup per request"
    state = CacheState(CacheConfig())
    ex = exchange()
    LLM.factory.start(ex).request(ex)
    if hit:
        f = state_filter(state, ex)
        assert f.request(ex) is None
        f.response_head(ex, JSON_HEAD)
        f.response_body(ex, COMPLETION)
        f.response_end(ex)
    else:  # a different prompt is stored: the lookup misses
        state.store.put(prompt_key(request_hash("chat", {"x": 1}), "", None), None, 10, 1e9)

    def run() -> None:
        ex.llm.cached = False
        result = state_filter(state, ex).request(ex)
        assert (result is not None) == hit

    benchmark(run)


def state_filter(state: CacheState, ex: SimpleNamespace):
    from aiproxy.cache.prompt import CacheFactory

    return CacheFactory(state, repr(("chat",))).start(ex)
