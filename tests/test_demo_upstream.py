"""The demo upstream, run as a real process: the backend the proxy tests rely on."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Iterator

import httpx
import pytest

from aiproxy.demo.upstream import pattern
from tests.support import start_demo_upstream, stop_process

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there big world"},
]


@pytest.fixture(scope="module")
def upstream() -> Iterator[int]:
    proc, port = start_demo_upstream(name="demo-t", token_delay_ms=5)
    yield port
    log = stop_process(proc)
    print(f"demo upstream log:\n{log}")


@pytest.fixture
def client(upstream: int) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{upstream}", timeout=10) as c:
        yield c


def sse_data(text: str) -> list[str]:
    """The data fields of an SSE stream, one per event."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e.removeprefix("data: ") for e in events]


def test_chat_completion_usage(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"model": "m1", "messages": MESSAGES})
    assert r.status_code == 200
    assert r.headers["x-upstream"] == "demo-t"
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "m1"
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "You said: hello there big world"}
    assert choice["finish_reason"] == "stop"
    # Words: "be brief" + "hello there big world" in, "You said: hello there big world" out.
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}


def test_chat_completion_max_tokens(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "You said: hello"
    assert body["usage"]["completion_tokens"] == 3


def test_chat_completion_bad_json(client: httpx.Client) -> None:
    r = client.post(
        "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.headers["x-upstream"] == "demo-t"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_chat_completion_stream(client: httpx.Client) -> None:
    request = {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=request) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-upstream"] == "demo-t"
        data = sse_data(r.read().decode())

    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    *words, stop, usage = chunks
    assert len(words) == 6  # one event per word
    assert words[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"]["content"] for c in words)
    assert text == "You said: hello there big world"
    assert stop["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}


def test_chat_completion_stream_without_usage(client: httpx.Client) -> None:
    request = {"messages": MESSAGES, "stream": True, "max_tokens": 2}
    with client.stream("POST", "/v1/chat/completions", json=request) as r:
        data = sse_data(r.read().decode())
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len(chunks) == 3  # two words, then the stop chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)


ANTHROPIC_SYSTEM = [{"type": "text", "text": "you are a careful assistant",
                     "cache_control": {"type": "ephemeral"}}]
ANTHROPIC_MESSAGES = [{"role": "user", "content": "hello there big world"}]


def test_anthropic_messages_with_the_anthropic_client(upstream: int) -> None:
    """The real `anthropic` client parses the demo's Messages API JSON and SSE."""
    import anthropic

    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{upstream}", api_key="k",
                                 max_retries=0)
    msg = client.messages.create(model="claude-demo", max_tokens=100,
                                 system=ANTHROPIC_SYSTEM, messages=ANTHROPIC_MESSAGES)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "claude-demo"
    assert [b.text for b in msg.content] == ["You said: hello there big world"]
    assert msg.stop_reason == "end_turn"
    # The system block carries cache_control: its 5 words are reported as cache reads.
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens,
            msg.usage.cache_creation_input_tokens, msg.usage.output_tokens) == (4, 5, 0, 6)

    with client.messages.stream(model="claude-demo", max_tokens=3, system=ANTHROPIC_SYSTEM,
                                messages=ANTHROPIC_MESSAGES) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert pieces == ["You", " said:", " hello"]
    assert final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens,
            final.usage.output_tokens) == (4, 5, 3)

    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="claude-demo", max_tokens=0, messages=ANTHROPIC_MESSAGES)
    assert bad.value.body["error"]["type"] == "invalid_request_error"


def test_anthropic_stream_event_sequence(client: httpx.Client) -> None:
    """The events Anthropic documents, in its order, each an `event:` and a `data:` line."""
    request = {"model": "claude-demo", "max_tokens": 2, "stream": True,
               "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    with client.stream("POST", "/v1/messages", json=request) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for raw in filter(None, text.split("\n\n")):
        name, data = raw.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(name == data["type"] for name, data in events)
    assert [name for name, _ in events] == [
        "message_start", "content_block_start", "ping", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 1 and start["usage"]["output_tokens"] == 1
    assert [e[1]["delta"] for e in events[3:5]] == [{"type": "text_delta", "text": "You"},
                                                   {"type": "text_delta", "text": " said:"}]
    assert events[6][1]["delta"]["stop_reason"] == "max_tokens"
    assert events[6][1]["usage"] == {"output_tokens": 2}


def read_chunked_response(port: int, request: bytes) -> tuple[bytes, list[bytes]]:
    """Send a raw request with Connection: close; return the head and the HTTP chunks."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        raw = b""
        while data := sock.recv(65536):
            raw += data
    head, _, rest = raw.partition(b"\r\n\r\n")
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return head, chunks
        chunks.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]


def test_stream_event_per_http_chunk(upstream: int) -> None:
    body = json.dumps({"messages": MESSAGES, "stream": True}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    head, chunks = read_chunked_response(upstream, request)
    assert b"transfer-encoding: chunked" in head.lower()
    assert len(chunks) == 6 + 2  # words, stop chunk, [DONE]
    assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in chunks)
    assert all(c.count(b"\n\n") == 1 for c in chunks)
    assert chunks[-1] == b"data: [DONE]\n\n"


def test_models(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["demo-model"]


def test_echo_large_body_sha256(client: httpx.Client) -> None:
    payload = os.urandom(1024 * 1024)
    r = client.put("/echo/a/b?x=1&y=two", content=payload, headers={"X-Custom": "Yes"})
    assert r.status_code == 200
    body = r.json()
    assert body["method"] == "PUT"
    assert body["path"] == "/echo/a/b"
    assert body["query"] == "x=1&y=two"
    assert body["headers"]["x-custom"] == "Yes"
    assert body["body_bytes"] == len(payload)
    assert body["body_sha256"] == hashlib.sha256(payload).hexdigest()
    assert body["upstream"] == "demo-t"


def test_echo_streamed_request_body(client: httpx.Client) -> None:
    parts = [os.urandom(100_000) for _ in range(5)]
    r = client.post("/echo", content=iter(parts))  # an iterator makes httpx send chunked
    body = r.json()
    assert body["headers"]["transfer-encoding"] == "chunked"
    assert body["body_bytes"] == 500_000
    assert body["body_sha256"] == hashlib.sha256(b"".join(parts)).hexdigest()


@pytest.mark.parametrize("n", [0, 1, 65536, 300_007])
def test_bytes_chunked(client: httpx.Client, n: int) -> None:
    r = client.get(f"/bytes/{n}")
    assert r.status_code == 200
    assert r.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in r.headers
    assert r.content == pattern(n)


def test_bytes_content_length(client: httpx.Client) -> None:
    r = client.get("/bytes/100000?length=1")
    assert r.headers["content-length"] == "100000"
    assert "transfer-encoding" not in r.headers
    assert r.content == pattern(100_000)


def test_sse(client: httpx.Client) -> None:
    r = client.get("/sse", params={"n": 3, "delay_ms": 1})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert sse_data(r.text) == ["event 0", "event 1", "event 2"]


def test_status_204_has_no_body(client: httpx.Client) -> None:
    r = client.get("/status/204")
    assert r.status_code == 204
    assert r.content == b""
    assert "transfer-encoding" not in r.headers
    assert r.headers["x-upstream"] == "demo-t"


def test_status_with_body(client: httpx.Client) -> None:
    r = client.post("/status/503")
    assert r.status_code == 503
    assert r.json() == {"status": 503}


def test_delay_and_healthz(client: httpx.Client) -> None:
    assert client.get("/delay/10").text == "ok"
    assert client.get("/healthz").text == "ok"


def test_websocket_echo(upstream: int) -> None:
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{upstream}/ws") as ws:
        ws.send("hello")
        assert ws.recv() == "hello"
        ws.send(b"\x00\xff")
        assert ws.recv() == b"\x00\xff"
