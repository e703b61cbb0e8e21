"""LLM accounting: OpenAI-style requests/responses read into ex.llm, metrics, access log.

End to end with the real `openai` client through aiproxy to the demo upstream."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from aiproxy.llm.estimate import tokens_of_text
from aiproxy.llm.facts import LlmFacts
from aiproxy.llm.openai import ApiPaths, SseReader, endpoint_of, read_request
from tests.conftest import simple_config
from tests.support import free_port, start_demo_upstream, stop_process


def test_endpoints_recognised():
    assert endpoint_of(b"/v1/chat/completions") == "chat"
    assert endpoint_of(b"/v1/completions") == "completions"
    assert endpoint_of(b"/v1/embeddings") == "embeddings"
    assert endpoint_of(b"/v1/responses") == "responses"
    assert endpoint_of(b"/v1/models") is None
    assert endpoint_of(b"/echo") is None


def test_request_fields_and_prompt_estimate():
    body = {"model": "m1", "stream": True, "max_completion_tokens": 77,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]}
    info = read_request("chat", json.dumps(body).encode(), True, -1)
    assert (info.model, info.stream, info.max_tokens, info.include_usage) == ("m1", True, 77, True)
    assert info.prompt_tokens == 2 * 4 + tokens_of_text("be brief") + tokens_of_text("hello there")
    assert not info.truncated


def test_truncated_body_is_read_from_its_start_and_estimated():
    body = json.dumps({"model": "big", "stream": True, "max_tokens": 5,
                       "messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
    info = read_request("chat", body[:4096], False, len(body))
    assert info.truncated and info.model == "big" and info.stream and info.max_tokens == 5
    assert info.prompt_tokens == (len(body) + 3) // 4


def test_sse_reader_handles_events_split_anywhere():
    events = [b'data: {"choices":[{"delta":{"content":"hello"}}]}\n\n',
              b'data: {"choices":[{"delta":{"content":" world"}}]}\r\n\r\n',
              b': keep-alive comment\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n',
              b"data: [DONE]\n\n"]
    stream = b"".join(events)
    for cut in range(1, len(stream)):
        r = SseReader()
        n = r.feed(stream[:cut]) + r.feed(stream[cut:])
        assert n == 2 and r.usage == (7, 2) and r.done and r.text_bytes == 11
    r = SseReader()
    assert [r.feed(e) for e in events] == [1, 1, 0, 0, 0]


def test_pattern_from_last_five_gaps():
    f = LlmFacts("chat", "t")
    for i in range(10):
        f.token_events(1, i * 0.020)  # a steady 20 ms: stddev 0
    assert f.classify_pattern() == "bulk"
    g = LlmFacts("chat", "t")
    t = 0.0
    for gap in (0.001, 0.030, 0.002, 0.045, 0.001, 0.050):
        t += gap
        g.token_events(1, t)
    assert g.classify_pattern() == "streaming"
    h = LlmFacts("chat", "t")
    h.token_events(1, 0.0)
    h.token_events(8, 0.5)  # eight events in one read: mostly zero gaps at the end
    assert h.classify_pattern() == "bulk"


@pytest.fixture(scope="module")
def slow_upstream():
    proc, port = start_demo_upstream("llm-slow", token_delay_ms=100)
    yield port
    stop_process(proc)


def _proxy(start_proxy, port: int, log: Path, admin: int, extra: str = ""):
    body = (simple_config(port) + f'\n[admin]\naddress = "127.0.0.1:{admin}"\n'
            f'\n[access_log]\npath = "{log}"\nflush_interval_ms = 20\n'
            '\n[llm]\ntenant_header = "x-tenant"\n' + extra)
    return start_proxy(body)


def _records(log: Path, n: int) -> list[dict]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        if len(lines) >= n:
            return [json.loads(x) for x in lines]
        time.sleep(0.02)
    raise AssertionError(f"expected {n} access log lines")


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "tell me about the weather in Paris today"}]


def test_openai_client_usage_counted_as_reported(start_proxy, demo_upstream, tmp_path):
    log = tmp_path / "access.log"
    admin = free_port()
    proxy = _proxy(start_proxy, demo_upstream, log, admin)
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k",
                           default_headers={"x-tenant": "acme"})
    plain = client.chat.completions.create(model="demo-model", messages=MESSAGES, max_tokens=6)
    chunks = list(client.chat.completions.create(
        model="demo-model", messages=MESSAGES, max_tokens=9, stream=True,
        stream_options={"include_usage": True}))
    streamed_usage = chunks[-1].usage
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == "You said: tell me about the weather in Paris today".split()[:9]
    unlabelled = list(client.chat.completions.create(
        model="demo-model", messages=MESSAGES, max_tokens=4, stream=True))
    assert all(c.usage is None for c in unlabelled)

    recs = [r["llm"] for r in _records(log, 3)]
    assert recs[0]["prompt_tokens"] == plain.usage.prompt_tokens
    assert recs[0]["completion_tokens"] == plain.usage.completion_tokens
    assert recs[0]["estimated"] is False and recs[0]["stream"] is False
    assert recs[0]["tenant"] == "acme" and recs[0]["model"] == "demo-model"
    assert recs[1]["prompt_tokens"] == streamed_usage.prompt_tokens
    assert recs[1]["completion_tokens"] == streamed_usage.completion_tokens == 9
    assert recs[1]["estimated"] is False and recs[1]["stream"] is True
    assert recs[1]["pattern"] in ("bulk", "streaming") and recs[1]["ttft_ms"] > 0
    # No usage in the stream: the estimator's count of "You said: tell me", labelled.
    assert recs[2]["estimated"] is True
    assert recs[2]["completion_tokens"] == tokens_of_text("You said: tell me")

    metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
    want_prompt = plain.usage.prompt_tokens + streamed_usage.prompt_tokens
    assert _metric(metrics, "aiproxy_llm_requests_total", tenant="acme", route="all",
                   model="demo-model") == 3
    got_prompt = _metric(metrics, "aiproxy_llm_prompt_tokens_total", tenant="acme")
    assert got_prompt == want_prompt + recs[2]["prompt_tokens"]
    assert _metric(metrics, "aiproxy_llm_completion_tokens_total", tenant="acme") == 6 + 9 + recs[2]["completion_tokens"]
    assert _metric(metrics, "aiproxy_llm_estimated_requests_total", tenant="acme") == 1
    assert _metric(metrics, "aiproxy_llm_time_to_first_token_seconds_count", route="all") == 3


def test_sse_arrives_event_by_event(start_proxy, slow_upstream, tmp_path):
    proxy = _proxy(start_proxy, slow_upstream, tmp_path / "a.log", free_port())
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k")
    arrivals = []
    for chunk in client.chat.completions.create(
            model="demo-model", messages=MESSAGES, max_tokens=8, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    assert len(arrivals) == 8
    # The upstream waits 100 ms between events (0.7 s from first to last); a proxy that
    # buffered the stream would hand them over together at the end.
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert arrivals[-1] - arrivals[0] > 0.35 and sum(g > 0.04 for g in gaps) >= 4, gaps


def test_tenant_label_cardinality_is_bounded(start_proxy, demo_upstream, tmp_path):
    admin = free_port()
    proxy = _proxy(start_proxy, demo_upstream, tmp_path / "a.log", admin,
                   extra="max_tenants = 3\n")
    with httpx.Client() as c:
        for i in range(8):
            r = c.post(f"{proxy.url}/v1/chat/completions", headers={"x-tenant": f"t{i}"},
                       json={"model": "demo-model", "messages": MESSAGES})
            assert r.status_code == 200
    metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
    tenants = {line.split('tenant="')[1].split('"')[0] for line in metrics.splitlines()
               if line.startswith("aiproxy_llm_requests_total{")}
    assert tenants == {"t0", "t1", "t2", "other"}
    assert _metric(metrics, "aiproxy_llm_requests_total", tenant="other") == 5


def test_odd_usage_objects_are_ignored_not_fatal():
    from aiproxy.llm.openai import usage_of

    assert usage_of({"type": 5, "usage": None}) is None
    assert usage_of({"usage": {"prompt_tokens": True, "completion_tokens": 1}}) is None
    assert usage_of({"usage": {"prompt_tokens": -1, "completion_tokens": 1}}) is None
    assert usage_of({"type": "response.completed",
                     "response": {"usage": {"input_tokens": 3, "output_tokens": 4}}}) == (3, 4)
    r = SseReader()
    r.feed(b'data: {"type": 7, "usage": {"prompt_tokens": "x"}}\n\ndata: [1,2]\n\n')
    assert r.usage is None and r.events == 2


def test_llm_score_tpm_fed_from_accounting(start_proxy, demo_upstream):
    admin = free_port()
    proxy = start_proxy(simple_config(demo_upstream, cluster_extra='balancer = "llm_score"')
                        + f'\n[admin]\naddress = "127.0.0.1:{admin}"\n[llm]\n')
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k")
    total = 0
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(
                model="demo-model", messages=MESSAGES, max_tokens=5, stream=True,
                stream_options={"include_usage": True}))
            total += chunks[-1].usage.total_tokens
        else:
            total += client.chat.completions.create(
                model="demo-model", messages=MESSAGES, max_tokens=5).usage.total_tokens
    clusters = httpx.get(f"http://127.0.0.1:{admin}/clusters").json()
    text = json.dumps(clusters)
    assert f'"tokens_per_minute": {float(total)}' in text, text


def test_no_tokens_counted_or_charged_for_refusals_and_upstream_errors(start_proxy,
                                                                       tmp_path):
    """The token counters and the rate limit's settlement hold what an upstream spent.
    A request the proxy refused (429) never reached an upstream, and an upstream error
    (500, 429) reports no usage and spends none: neither adds tokens to /metrics nor
    keeps its reservation in the tenant's token bucket."""
    from aiohttp import web

    from tests.support import serve_aiohttp

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        status = int(request.headers.get("x-status", "200"))
        if status != 200:
            return web.json_response({"error": {"message": "upstream says no",
                                                "type": "server_error"}}, status=status)
        return web.json_response({
            "id": "c", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    admin = free_port()
    # 60 tokens a minute (1 a second): a ~45-token reservation that was kept would
    # leave too little for the next request for many seconds.
    limit = ('\n[[ratelimits]]\nname = "t"\nkey = ["tenant"]\ntokens_per_minute = 60\n'
             '\n[[ratelimits]]\nname = "r"\nkey = ["tenant"]\nrequests_per_second = 1\n'
             'burst_requests = 3\nroutes = ["all"]\n')
    prompt = [{"role": "user", "content": "x" * 160}]  # 4 + 40 estimated tokens
    with serve_aiohttp(app) as port:
        proxy = _proxy(start_proxy, port, tmp_path / "a.log", admin, extra=limit)
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0,
                               default_headers={"x-tenant": "acme"})
        for status, exc in ((500, openai.InternalServerError),
                            (429, openai.RateLimitError)):
            with pytest.raises(exc, match="upstream says no"):
                client.chat.completions.create(model="m", messages=prompt, max_tokens=1,
                                               extra_headers={"x-status": str(status)})
        # Both errors gave their reservations back: the bucket still admits one.
        ok = client.chat.completions.create(model="m", messages=prompt, max_tokens=1)
        assert ok.usage.total_tokens == 4
        # The requests bucket (3) is empty now: the proxy refuses, no upstream asked.
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="m", messages=prompt, max_tokens=1)
        assert refused.value.code == "rate_limited"
        recs = [r["llm"] for r in _records(tmp_path / "a.log", 4)]
        assert [r["tenant"] for r in recs] == ["acme"] * 4
    metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
    assert _metric(metrics, "aiproxy_llm_requests_total", tenant="acme") == 4
    assert _metric(metrics, "aiproxy_llm_prompt_tokens_total", tenant="acme") == 3
    assert _metric(metrics, "aiproxy_llm_completion_tokens_total", tenant="acme") == 1
    assert _metric(metrics, "aiproxy_llm_estimated_requests_total", tenant="acme") == 0


def test_stream_cut_by_its_upstream_is_logged_as_an_upstream_error(start_proxy, tmp_path):
    """An upstream that dies or stalls mid-stream: the openai client sees the stream
    break (not a clean end), the access log says why next to the 200 that went out
    first, and the tokens streamed until then are counted."""
    import asyncio

    from aiohttp import web

    from tests.support import serve_aiohttp

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for word in ("alpha", " beta"):
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n'
                             % word.encode())
        await asyncio.sleep(0.1)  # both events reach the client before the cut
        if request.headers.get("x-how") == "die":
            request.transport.close()
        else:
            await asyncio.sleep(5)
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    log = tmp_path / "a.log"
    with serve_aiohttp(app) as port:
        proxy = start_proxy(
            "[server]\nworkers = 1\n" + simple_config(port, cluster_extra="read_timeout_ms = 300")
            + f'\n[access_log]\npath = "{log}"\nflush_interval_ms = 20\n[llm]\n',
            listener_extra='protocols = ["http1", "h2c"]')
        for how, http2 in (("die", False), ("die", True), ("stall", False)):
            client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0,
                                   http_client=httpx.Client(http1=not http2, http2=http2))
            got = []
            with pytest.raises(openai.APIConnectionError):
                for chunk in client.chat.completions.create(
                        model="m", messages=MESSAGES, stream=True,
                        extra_headers={"x-how": how}):
                    got.append(chunk.choices[0].delta.content)
            assert got == ["alpha", " beta"]
        recs = _records(log, 3)
    assert [r["protocol"] for r in recs] == ["HTTP/1.1", "HTTP/2", "HTTP/1.1"]
    assert [r["status"] for r in recs] == [200, 200, 200]
    assert "closed" in recs[0]["upstream_error"] and "closed" in recs[1]["upstream_error"]
    assert "read_timeout_ms" in recs[2]["upstream_error"]
    assert all(r["llm"]["completion_tokens"] == tokens_of_text("alpha beta") for r in recs)
    assert all("client_closed" not in r for r in recs)


def event_stream(events: list[bytes]):  # noqa: ANN201
    """An aiohttp handler that reads the request and answers with these SSE events."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:
            await resp.write(event)
        await resp.write_eof()
        return resp

    return handler


def _responses_stream(words: list[str], completed: bool) -> list[bytes]:
    """A Responses API event stream as OpenAI sends it: the text arrives once in
    output_text.delta events, and again whole in output_text.done, content_part.done and
    output_item.done; usage comes only in response.completed."""
    text = " ".join(words)
    part = {"type": "output_text", "text": text, "annotations": []}
    item = {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
            "content": [part]}
    resp = {"id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress",
            "model": "m", "output": [], "usage": None}
    ids = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    events = [{"type": "response.created", "response": resp},
              {"type": "response.output_item.added", "output_index": 0,
               "item": {**item, "status": "in_progress", "content": []}},
              {"type": "response.content_part.added", **ids, "part": {**part, "text": ""}}]
    events += [{"type": "response.output_text.delta", **ids, "delta": (" " if i else "") + w}
               for i, w in enumerate(words)]
    events += [{"type": "response.output_text.done", **ids, "text": text},
               {"type": "response.content_part.done", **ids, "part": part},
               {"type": "response.output_item.done", "output_index": 0, "item": item}]
    if completed:
        usage = {"input_tokens": 1, "output_tokens": len(words),
                 "total_tokens": 1 + len(words)}
        events.append({"type": "response.completed",
                       "response": {**resp, "status": "completed", "output": [item],
                                    "usage": usage}})
    return [b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode())
            for e in events]


def test_responses_stream_text_is_estimated_once(start_proxy, tmp_path):
    """A Responses API stream that ends before response.completed (no usage) is charged
    the estimate of its text, counted from the deltas once: not again from the
    output_text.done, content_part.done and output_item.done events that repeat it whole
    (that was 4x the text, charged to the tenant's token bucket)."""
    from aiohttp import web

    from tests.support import serve_aiohttp

    words = ["alpha"] * 40

    app = web.Application()
    app.router.add_post("/v1/responses",
                        event_stream(_responses_stream(words, completed=False)))
    log = tmp_path / "a.log"
    # 200 tokens, refilling 1 a minute. The cut stream costs 1 (prompt "hi") + 60 (its
    # 239 bytes of text): 139 stay, enough for a second request reserving 1 + 100.
    limit = '\n[[ratelimits]]\nname = "t"\ntokens_per_minute = 1\nburst_tokens = 200\n'
    with serve_aiohttp(app) as port:
        proxy = _proxy(start_proxy, port, log, free_port(), extra=limit)
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0)
        events = list(client.responses.create(model="m", input="hi", max_output_tokens=1,
                                              stream=True))
        assert events[-1].type == "response.output_item.done"
        assert events[-1].item.content[0].text == " ".join(words)
        again = list(client.responses.create(model="m", input="hi", max_output_tokens=100,
                                             stream=True))
        assert len(again) == len(events)
        recs = [r["llm"] for r in _records(log, 2)]
    assert recs[0]["completion_tokens"] == tokens_of_text(" ".join(words)) == 60
    assert recs[0]["estimated"] is True


def test_sse_reader_counts_responses_text_from_deltas_only():
    r = SseReader()
    n = sum(r.feed(e) for e in _responses_stream(["one", "two", "three"], completed=True))
    assert n == 3 and r.text_bytes == len("one two three") and r.usage == (1, 3)


def test_sse_reader_skips_an_event_that_never_ends():
    r = SseReader()
    line = b"data: " + b"x" * 1000 + b"\n"
    for _ in range(3000):  # 3 MB of one event's data lines, no blank line
        r.feed(line * 1)
    assert r.data == [] and r.events == 0
    r.feed(b'\ndata: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3}}\n\n')
    assert r.usage == (2, 3) and r.events == 1


def test_event_stream_without_blank_lines_is_not_buffered(start_proxy):
    """An upstream's event stream whose data lines never end an event (no blank line)
    passes through while the accounting holds at most one event's worth of it (the SSE
    reader kept every data line of the unfinished event: the stream's whole size)."""
    from aiohttp import web

    from tests.support import RssMonitor, serve_aiohttp

    chunk = (b"data: " + b"x" * 1000 + b"\n") * 1000  # 1 MB
    tail = b'\ndata: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3}}\n\n'

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(128):
            await resp.write(chunk)
        await resp.write(tail)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    with serve_aiohttp(app) as port:
        proxy = start_proxy("[server]\nworkers = 1\n" + simple_config(port) + "\n[llm]\n")
        body = {"model": "m", "stream": True, "messages": MESSAGES}
        with (RssMonitor(proxy.proc.pid) as rss, httpx.Client(timeout=60) as c,
              c.stream("POST", f"{proxy.url}/v1/chat/completions", json=body) as r):
            got = sum(len(b) for b in r.iter_raw())
    assert got == 128 * len(chunk) + len(tail)
    assert rss.growth < 48 * 2**20, rss.describe()


CR_EVENTS = [b'data: {"choices":[{"index":0,"delta":{"content":"hello"}}]}\r\r',
             b'data: {"choices":[{"index":0,"delta":{"content":" world"}}]}\r\n\r\n',
             b': keep-alive\r\r',
             b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\r\r',
             b"data: [DONE]\r\r"]


def test_sse_reader_takes_a_lone_cr_as_end_of_line():
    """An event stream may end its lines in CR alone (WHATWG HTML, event stream
    end-of-line = CRLF / CR / LF): the reader saw one endless line and counted none
    of it (no usage, no text). A CRLF split across pieces is still one line end."""
    stream = b"".join(CR_EVENTS)
    for cut in range(1, len(stream)):
        r = SseReader()
        n = r.feed(stream[:cut]) + r.feed(stream[cut:])
        assert (n, r.usage, r.done, r.text_bytes, r.events) == (2, (7, 2), True, 11, 4), cut
    r = SseReader()
    assert [r.feed(e) for e in CR_EVENTS] == [1, 1, 0, 0, 0]
    r = SseReader()
    assert sum(r.feed(stream[i:i + 1]) for i in range(len(stream))) == 2
    assert r.usage == (7, 2) and r.events == 4


def test_cr_terminated_stream_is_counted_through_the_proxy(start_proxy, tmp_path):
    """The openai client reads a CR-terminated stream; the proxy's accounting must
    read the usage that stream reported (it logged 0 completion tokens, estimated)."""
    from aiohttp import web

    from tests.support import serve_aiohttp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", event_stream(CR_EVENTS))
    log = tmp_path / "a.log"
    with serve_aiohttp(app) as port:
        proxy = start_proxy(
            "[server]\nworkers = 1\n" + simple_config(port)
            + f'\n[access_log]\npath = "{log}"\nflush_interval_ms = 20\n[llm]\n',
            listener_extra='protocols = ["http1", "h2c"]')
        for http2 in (False, True):
            client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0,
                                   http_client=httpx.Client(http1=not http2, http2=http2))
            chunks = list(client.chat.completions.create(
                model="m", messages=MESSAGES, stream=True,
                stream_options={"include_usage": True}))
            assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == "hello world"
            assert chunks[-1].usage.completion_tokens == 2
        recs = _records(log, 2)
    for rec in recs:
        llm = rec["llm"]
        assert (llm["prompt_tokens"], llm["completion_tokens"], llm["estimated"]) == (7, 2, False)
        assert llm["ttft_ms"] is not None


def _miss_then_hit(client: openai.OpenAI, ask: dict, log) -> dict:
    """Ask twice: a cache miss, then a hit with the same answer; the miss's access-log
    `llm` object carries the upstream's usage and the hit's says cached. Returns the
    miss's `llm` object."""
    first = client.chat.completions.with_raw_response.create(**ask)
    again = client.chat.completions.with_raw_response.create(**ask)
    assert first.headers["x-aiproxy-cache"] == "miss"
    assert again.headers["x-aiproxy-cache"] == "hit"
    assert again.parse().id == first.parse().id
    recs = _records(log, 2)
    usage = first.parse().usage
    llm = recs[0]["llm"]
    assert (llm["prompt_tokens"], llm["completion_tokens"]) == (
        usage.prompt_tokens, usage.completion_tokens)
    assert recs[1]["llm"]["cached"] is True
    return llm


def test_a_prefix_rewritten_api_is_accounted_cached_and_limited(start_proxy, demo_upstream,
                                                                tmp_path):
    # A route that serves the upstream's /v1/ under /openai/v1/ (prefix_rewrite): the
    # body is the same OpenAI request, so accounting, the cache and a token budget apply
    # as they do at /v1/ (they used to see no LLM endpoint and let it all pass).
    log = tmp_path / "access.log"
    proxy = start_proxy(f"""
        [server]
        workers = 1

        [access_log]
        path = "{log}"
        flush_interval_ms = 20

        [llm]

        [cache]

        [[ratelimits]]
        name = "tokens"
        tokens_per_minute = 100

        [[clusters]]
        name = "up"
        endpoints = ["127.0.0.1:{demo_upstream}"]

        [[routes]]
        name = "openai"
        match = {{ path_prefix = "/openai/" }}
        prefix_rewrite = "/"
        cluster = "up"
        """)
    client = openai.OpenAI(base_url=f"{proxy.url}/openai/v1", api_key="k", max_retries=0)
    ask = {"model": "demo-model", "max_tokens": 20, "messages": MESSAGES}
    _miss_then_hit(client, ask, log)
    # The token bucket is charged: a request reserving more than 100 tokens is refused.
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(**{**ask, "max_tokens": 100})
    assert refused.value.response.headers["x-aiproxy-backpressure"] == "tokens"


def test_api_paths_lookup_under_each_prefix():
    paths = ApiPaths(("/v1/", "/openai/v1/", "/api/v1/", "/openai/deployments/*/"))
    assert paths.lookup(b"/v1/chat/completions") == ("chat", None)
    assert paths.lookup(b"/openai/v1/chat/completions/") == ("chat", None)
    assert paths.lookup(b"/api/v1/embeddings") == ("embeddings", None)
    assert paths.lookup(b"/openai/deployments/gpt4o/chat/completions") == ("chat", "gpt4o")
    assert paths.lookup(b"/openai/deployments/e3/embeddings") == ("embeddings", "e3")
    # `*` is one whole, non-empty segment; what follows must be an endpoint.
    assert paths.lookup(b"/openai/deployments//chat/completions") is None
    assert paths.lookup(b"/openai/deployments/a/b/chat/completions") is None
    assert paths.lookup(b"/openai/deployments/gpt4o/models") is None
    assert paths.lookup(b"/openai/v1/models") is None
    assert paths.lookup(b"/other/v1/chat/completions") is None
    assert ApiPaths().lookup(b"/openai/v1/chat/completions") is None


def _prefix_proxy(start_proxy, demo_upstream: int, log: Path, llm: str) -> object:
    return start_proxy(f"""
        [server]
        workers = 1

        [access_log]
        path = "{log}"
        flush_interval_ms = 20

        [llm]
        {llm}

        [cache]

        [[clusters]]
        name = "up"
        endpoints = ["127.0.0.1:{demo_upstream}"]

        [[routes]]
        name = "openai"
        match = {{ path_prefix = "/openai/" }}
        cluster = "up"
        """)


def test_api_prefixes_account_and_cache_a_groq_style_path(start_proxy, demo_upstream,
                                                           tmp_path):
    # Groq serves the OpenAI API under /openai/v1/ (no rewrite: the upstream's own path).
    log = tmp_path / "access.log"
    proxy = _prefix_proxy(start_proxy, demo_upstream, log,
                          'api_prefixes = ["/v1/", "/openai/v1/"]')
    client = openai.OpenAI(base_url=f"{proxy.url}/openai/v1", api_key="k", max_retries=0)
    ask = {"model": "demo-model", "max_tokens": 20, "messages": MESSAGES}
    llm = _miss_then_hit(client, ask, log)
    assert (llm["model"], llm["estimated"]) == ("demo-model", False)


def test_default_api_prefix_leaves_other_paths_alone(start_proxy, demo_upstream, tmp_path):
    log = tmp_path / "access.log"
    proxy = _prefix_proxy(start_proxy, demo_upstream, log, "")
    client = openai.OpenAI(base_url=f"{proxy.url}/openai/v1", api_key="k", max_retries=0)
    answer = client.chat.completions.with_raw_response.create(
        model="demo-model", max_tokens=20, messages=MESSAGES)
    assert answer.parse().usage.completion_tokens > 0
    assert "x-aiproxy-cache" not in answer.headers
    assert "llm" not in _records(log, 1)[0]


def test_azure_deployment_path_is_accounted_with_the_deployment_as_model(
        start_proxy, demo_upstream, tmp_path):
    log = tmp_path / "access.log"
    proxy = _prefix_proxy(start_proxy, demo_upstream, log,
                          'api_prefixes = ["/openai/deployments/*/"]')
    client = openai.AzureOpenAI(azure_endpoint=proxy.url, api_key="k",
                                api_version="2024-06-01", max_retries=0)
    # The Azure client names the deployment in the path (and sends it as "model" too).
    first = client.chat.completions.with_raw_response.create(
        model="gpt4o-prod", max_tokens=20, messages=MESSAGES)
    assert first.headers["x-aiproxy-cache"] == "miss"
    assert first.parse().model == "gpt4o-prod"
    # A body without "model" (Azure's own REST form): the deployment is the model, and
    # each deployment has its own cache entries.
    body = {"max_tokens": 20, "messages": MESSAGES}
    with httpx.Client(base_url=proxy.url, headers={"api-key": "k"}) as c:
        for deployment, mark in (("mini", "miss"), ("mini", "hit"), ("large", "miss")):
            r = c.post(f"/openai/deployments/{deployment}/chat/completions",
                       params={"api-version": "2024-06-01"}, json=body)
            assert (r.status_code, r.headers["x-aiproxy-cache"]) == (200, mark)
            assert r.json()["model"] == deployment
    recs = _records(log, 4)
    assert [rec["llm"]["model"] for rec in recs] == ["gpt4o-prod", "mini", "mini", "large"]
    usage = first.parse().usage
    assert (recs[0]["llm"]["prompt_tokens"], recs[0]["llm"]["completion_tokens"]) == (
        usage.prompt_tokens, usage.completion_tokens)
