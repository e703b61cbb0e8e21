"""Anthropic's Messages API (POST /v1/messages) through the LLM layer: token accounting
(access log, metrics, token rate limits), with the real `anthropic` client through
aiproxy to the demo upstream's /v1/messages."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from aiproxy.llm.estimate import MESSAGE_OVERHEAD, tokens_of_text
from aiproxy.llm.openai import JsonReader, SseReader, endpoint_of, read_request, usage_of
from tests.support import free_port
from tests.test_llm_accounting import _metric, _proxy, _records

SYSTEM = [{"type": "text", "text": "you are a careful assistant",
           "cache_control": {"type": "ephemeral"}}]
MESSAGES = [{"role": "user", "content": "tell me about the weather in Paris today"}]


def _event(obj: dict) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (obj["type"].encode(), json.dumps(obj).encode())


def _stream(words: list[str], final: bool = True) -> list[bytes]:
    """A Messages API event stream as Anthropic documents it: input (and cache) tokens in
    message_start, the cumulative output in message_delta."""
    usage = {"input_tokens": 10, "cache_creation_input_tokens": 2,
             "cache_read_input_tokens": 5, "output_tokens": 1}
    events = [{"type": "message_start", "message": {
                  "id": "msg_1", "type": "message", "role": "assistant", "model": "c",
                  "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}},
              {"type": "content_block_start", "index": 0,
               "content_block": {"type": "text", "text": ""}},
              {"type": "ping"}]
    events += [{"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": (" " if i else "") + w}}
               for i, w in enumerate(words)]
    events.append({"type": "content_block_stop", "index": 0})
    if final:
        events += [{"type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": {"output_tokens": len(words)}},
                   {"type": "message_stop"}]
    return [_event(e) for e in events]


def test_messages_endpoint_recognised():
    assert endpoint_of(b"/v1/messages") == "messages"
    assert endpoint_of(b"/v1/messages/") == "messages"
    # Token counting and batches generate nothing: not accounted.
    assert endpoint_of(b"/v1/messages/count_tokens") is None
    assert endpoint_of(b"/v1/messages/batches") is None


def test_messages_request_fields_and_prompt_estimate():
    """The estimate reads what the model reads: the top-level system (a string or text
    blocks) and each message's content, a string or blocks (text, tool_result whose
    content is a string or blocks)."""
    body = {"model": "claude", "max_tokens": 300, "stream": True, "system": SYSTEM,
            "messages": [
                {"role": "user", "content": "first question"},
                {"role": "assistant", "content": [{"type": "text", "text": "an answer"},
                                                  {"type": "tool_use", "id": "t1",
                                                   "name": "f", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {"type": "tool_result", "tool_use_id": "t2",
                     "content": [{"type": "text", "text": "cloudy later"}]},
                    {"type": "text", "text": "and tomorrow?"}]}]}
    info = read_request("messages", json.dumps(body).encode(), True, -1)
    assert (info.model, info.stream, info.max_tokens) == ("claude", True, 300)
    texts = ["you are a careful assistant", "first question", "an answer", "sunny",
             "cloudy later", "and tomorrow?"]
    assert info.prompt_tokens == 3 * MESSAGE_OVERHEAD + sum(map(tokens_of_text, texts))
    plain = dict(body, system="be brief")
    info = read_request("messages", json.dumps(plain).encode(), True, -1)
    assert info.prompt_tokens == (3 * MESSAGE_OVERHEAD + tokens_of_text("be brief")
                                  + sum(map(tokens_of_text, texts[1:])))


def test_messages_json_usage_counts_cache_reads_and_writes():
    msg = {"id": "msg_1", "type": "message", "role": "assistant", "model": "c",
           "content": [{"type": "text", "text": "hello there"}], "stop_reason": "end_turn",
           "usage": {"input_tokens": 10, "cache_creation_input_tokens": 2,
                     "cache_read_input_tokens": 5, "output_tokens": 3}}
    assert usage_of(msg) == (17, 3)
    # Null cache counts (as Anthropic sends when caching is not in play) are none.
    nulls = dict(msg, usage={"input_tokens": 10, "cache_creation_input_tokens": None,
                             "cache_read_input_tokens": None, "output_tokens": 3})
    assert usage_of(nulls) == (10, 3)
    r = JsonReader()
    r.feed(json.dumps(dict(msg, usage=None)).encode())
    assert r.result() == (None, len("hello there"))  # no usage: the text is estimated
    # A body past the kept limit: the usage fields found in its last bytes.
    big = JsonReader()
    big.feed(b'{"content": [{"type": "text", "text": "' + b"x" * (2 << 20) + b'"}], ')
    big.feed(b'"usage": {"input_tokens": 10, "cache_creation_input_tokens": 2, '
             b'"cache_read_input_tokens": 5, "output_tokens": 3}}')
    assert big.result()[0] == (17, 3)


def test_sse_reader_reads_messages_usage_once_split_anywhere():
    """Input from message_start, output from message_delta (cumulative: it replaces
    message_start's placeholder 1, never adds to it); text from the text_delta events."""
    stream = b"".join(_stream(["hello", "big", "world"]))
    for cut in range(1, len(stream)):
        r = SseReader()
        n = r.feed(stream[:cut]) + r.feed(stream[cut:])
        assert n == 3 and r.usage == (17, 3) and r.text_bytes == len("hello big world")
    r = SseReader()
    assert [r.feed(e) for e in _stream(["a", "b"])] == [0, 0, 0, 1, 1, 0, 0, 0]
    # A message_delta that reports the input too (cumulative, as newer API versions do).
    r.feed(_event({"type": "message_delta", "delta": {},
                   "usage": {"input_tokens": 11, "cache_read_input_tokens": 5,
                             "output_tokens": 4}}))
    assert r.usage == (16, 4)
    # Cut before message_delta: the input is known, the output is not.
    cut = SseReader()
    for e in _stream(["a", "b"], final=False):
        cut.feed(e)
    assert cut.usage is None and cut.prompt == 17


def test_anthropic_client_usage_counted_as_reported(start_proxy, demo_upstream, tmp_path):
    log = tmp_path / "access.log"
    admin = free_port()
    proxy = _proxy(start_proxy, demo_upstream, log, admin)
    client = anthropic.Anthropic(base_url=proxy.url, api_key="k", max_retries=0,
                                 default_headers={"x-tenant": "acme"})
    plain = client.messages.create(model="claude-demo", max_tokens=6, system=SYSTEM,
                                   messages=MESSAGES)
    with client.messages.stream(model="claude-demo", max_tokens=9, system=SYSTEM,
                                messages=MESSAGES) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text.split() == "You said: tell me about the weather in Paris today".split()[:9]

    def prompt(usage) -> int:
        return (usage.input_tokens + (usage.cache_creation_input_tokens or 0)
                + (usage.cache_read_input_tokens or 0))

    assert plain.usage.cache_read_input_tokens == 5  # the system block, cached
    recs = [r["llm"] for r in _records(log, 2)]
    assert recs[0]["endpoint"] == recs[1]["endpoint"] == "messages"
    assert recs[0]["tenant"] == "acme" and recs[0]["model"] == "claude-demo"
    assert recs[0]["prompt_tokens"] == prompt(plain.usage) == 13
    assert recs[0]["completion_tokens"] == plain.usage.output_tokens == 6
    assert recs[0]["estimated"] is False and recs[0]["stream"] is False
    assert recs[1]["prompt_tokens"] == prompt(streamed.usage) == 13
    assert recs[1]["completion_tokens"] == streamed.usage.output_tokens == 9
    assert recs[1]["estimated"] is False and recs[1]["stream"] is True
    assert recs[1]["ttft_ms"] > 0 and recs[1]["pattern"] in ("bulk", "streaming")

    metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
    assert _metric(metrics, "aiproxy_llm_requests_total", tenant="acme", route="all",
                   model="claude-demo") == 2
    assert _metric(metrics, "aiproxy_llm_prompt_tokens_total", tenant="acme") == 13 + 13
    assert _metric(metrics, "aiproxy_llm_completion_tokens_total", tenant="acme") == 6 + 9
    assert _metric(metrics, "aiproxy_llm_estimated_requests_total", tenant="acme") == 0
    assert _metric(metrics, "aiproxy_llm_time_to_first_token_seconds_count",
                   route="all", model="claude-demo") == 2


def test_anthropic_stream_cut_before_message_delta(start_proxy, tmp_path):
    """A Messages stream that ends before message_delta: its input is what message_start
    reported, its output the estimate of the text that came (not message_start's
    placeholder output_tokens)."""
    from aiohttp import web

    from tests.support import serve_aiohttp

    async def messages(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for event in _stream(["alpha"] * 20, final=False):
            await resp.write(event)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    log = tmp_path / "a.log"
    with serve_aiohttp(app) as port:
        proxy = _proxy(start_proxy, port, log, free_port())
        client = anthropic.Anthropic(base_url=proxy.url, api_key="k", max_retries=0)
        with client.messages.stream(model="c", max_tokens=50, messages=MESSAGES) as stream:
            assert "".join(stream.text_stream) == " ".join(["alpha"] * 20)
        rec = _records(log, 1)[0]["llm"]
    assert rec["prompt_tokens"] == 17
    assert rec["completion_tokens"] == tokens_of_text(" ".join(["alpha"] * 20))
    assert rec["estimated"] is True


def test_anthropic_tokens_reserved_and_settled(start_proxy, demo_upstream, tmp_path):
    """A token rate limit holds for /v1/messages as for chat completions: admission
    reserves the prompt estimate plus max_tokens, and the exchange is settled to the
    usage the upstream reported. A bucket of 100 tokens that refills 1 a minute: each
    request reserves 14 + 60 and is settled to its usage (8 + 10), so the second fits in
    what the first left and the third does not."""
    limit = ('\n[[ratelimits]]\nname = "t"\nkey = ["tenant"]\ntokens_per_minute = 1\n'
             'burst_tokens = 100\n')
    proxy = _proxy(start_proxy, demo_upstream, tmp_path / "a.log", free_port(), extra=limit)
    client = anthropic.Anthropic(base_url=proxy.url, api_key="k", max_retries=0,
                                 default_headers={"x-tenant": "acme"})
    reserved = MESSAGE_OVERHEAD + tokens_of_text(MESSAGES[0]["content"]) + 60
    assert reserved == 74
    for _ in range(2):  # 100 - 18 = 82 left after the first: the second fits
        msg = client.messages.create(model="claude-demo", max_tokens=60, messages=MESSAGES)
        assert msg.usage.input_tokens + msg.usage.output_tokens == 18
    with pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.create(model="claude-demo", max_tokens=60, messages=MESSAGES)
    assert refused.value.response.headers["x-aiproxy-backpressure"] == "tokens"


def test_other_messages_paths_are_not_accounted(start_proxy, demo_upstream, tmp_path):
    """count_tokens generates nothing: no llm record, no reservation."""
    log = tmp_path / "a.log"
    proxy = _proxy(start_proxy, demo_upstream, log, free_port())
    r = httpx.post(f"{proxy.url}/v1/messages/count_tokens",
                   json={"model": "c", "messages": MESSAGES})
    assert r.status_code == 404  # the demo does not serve it
    assert "llm" not in _records(log, 1)[0]


def test_anthropic_cache_hit_counts_no_tokens(start_proxy, demo_upstream, tmp_path):
    """A Messages stream answered again from the prompt cache replays the same events
    to the client; its tokens are counted once (the hit spent none upstream). The demo
    marks its streams `Cache-Control: no-cache`: read past, as configured."""
    admin = free_port()
    proxy = _proxy(start_proxy, demo_upstream, tmp_path / "a.log", admin,
                   extra="[cache]\nignore_upstream_cache_control = true\n")
    client = anthropic.Anthropic(base_url=proxy.url, api_key="k", max_retries=0,
                                 default_headers={"x-tenant": "acme"})
    got = []
    for _ in range(2):
        with client.messages.stream(model="claude-demo", max_tokens=5,
                                    messages=MESSAGES) as stream:
            text = "".join(stream.text_stream)
            got.append((text, stream.get_final_message().usage.output_tokens,
                        stream.response.headers["x-aiproxy-cache"]))
    assert got == [("You said: tell me about", 5, "miss"),
                   ("You said: tell me about", 5, "hit")]
    metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
    assert _metric(metrics, "aiproxy_llm_requests_total", tenant="acme") == 2
    assert _metric(metrics, "aiproxy_llm_cached_requests_total", tenant="acme") == 1
    assert _metric(metrics, "aiproxy_llm_prompt_tokens_total", tenant="acme") == 8
    assert _metric(metrics, "aiproxy_llm_completion_tokens_total", tenant="acme") == 5
