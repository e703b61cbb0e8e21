"""[cache] correctness against an upstream the test controls: what takes part in the
key (route, query, Accept-Encoding besides the body and the caller), what is stored
(never a cut stream, an error, Set-Cookie, no-store), how a hit is replayed, and
identical misses that arrive together."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support import free_port

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "temperature": 0}


class Upstream:
    """An OpenAI-style chat upstream on a raw asyncio server: every answer carries a new
    id (`c<N>`, N = calls so far) and the Host it was sent to, so a replay is told from a
    fresh answer. The last user message chooses misbehaviour: "cut" ends an event stream
    mid-way, "cookie" adds Set-Cookie, "nostore"/"private" the Cache-Control, "error" is a
    500, "slow" waits 0.5 s before answering. A request that accepts gzip gets gzip."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(
                asyncio.start_server(self.serve, "127.0.0.1", self.port))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(5)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _shutdown(self) -> None:
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = h.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if not await self.answer(method, target, headers, body, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def answer(self, method: str, target: str, headers: dict[str, str], body: bytes,
                     writer: asyncio.StreamWriter) -> bool:
        req = json.loads(body) if body else {}
        self.calls.append({"method": method, "target": target, "headers": headers,
                           "body": req})
        n = len(self.calls)
        text = req.get("messages", [{}])[-1].get("content", "")
        if "slow" in text:
            await asyncio.sleep(0.5)
        status = b"500 Internal Server Error" if "error" in text else b"200 OK"
        extra = b""
        if "cookie" in text:
            extra += b"Set-Cookie: session=secret-%d\r\n" % n
        if "nostore" in text:
            extra += b"Cache-Control: no-store\r\n"
        if "private" in text:
            extra += b"Cache-Control: private\r\n"
        content = f"answer {n} from {headers.get('host')}"
        if req.get("stream"):
            events = [{"id": f"c{n}", "object": "chat.completion.chunk", "created": 1,
                       "model": req.get("model"), "choices": [
                           {"index": 0, "delta": {"content": word + " "},
                            "finish_reason": None}]} for word in content.split()]
            events[-1]["choices"][0]["finish_reason"] = "stop"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/event-stream\r\n"
                         b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n"
                         + extra + b"\r\n")
            for i, event in enumerate(events):
                data = b"data: " + json.dumps(event).encode() + b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
                await asyncio.sleep(0.01)
                if "cut" in text and i == 1:
                    writer.transport.abort()  # no [DONE], no last chunk
                    return False
            data = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
            await writer.drain()
            return True
        out = json.dumps({"id": f"c{n}", "object": "chat.completion", "created": 1,
                          "model": req.get("model"), "choices": [
                              {"index": 0, "finish_reason": "stop", "message": {
                                  "role": "assistant", "content": content}}],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 2,
                                    "total_tokens": 3}}).encode()
        if "gzip" in headers.get("accept-encoding", ""):
            out = gzip.compress(out)
            extra += b"Content-Encoding: gzip\r\nVary: Accept-Encoding\r\n"
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n" % len(out) + extra + b"\r\n" + out)
        await writer.drain()
        return True


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    yield up
    up.close()


def _proxy(start_proxy, port: int, cache: str = "", routes: str = "", more: str = ""):
    routes = routes or """
[[routes]]
name = "all"
match = { path_prefix = "/" }
cluster = "up"
"""
    return start_proxy(f"""
[server]
workers = 1

[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{port}"]
{routes}
{more}
[cache]
{cache}
""")


def _ask(c: httpx.Client, url: str, body: dict | None = None, **headers: str
         ) -> tuple[str | None, str]:
    r = c.post(url, json=body if body is not None else CHAT, headers=headers)
    return r.headers.get("x-aiproxy-cache"), r.text


TWO_ROUTES = """
[[clusters]]
name = "other"
endpoints = ["127.0.0.1:{port}"]

[[routes]]
name = "b"
match = {{ host = "b.test" }}
cluster = "other"
request_headers_add = {{ "x-which" = "b" }}

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
"""


def test_routes_queries_and_codings_never_share_entries(start_proxy, upstream):
    """The body and the caller are not all that decides an answer: a route may go to
    another cluster or change the request, the query may choose an API version, and an
    entry stored gzip-coded must not reach a client that did not accept gzip."""
    proxy = _proxy(start_proxy, upstream.port, routes=TWO_ROUTES.format(port=upstream.port))
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        a = _ask(c, url, **{"accept-encoding": "identity"})
        b = _ask(c, url, host="b.test", **{"accept-encoding": "identity"})
        assert (a[0], b[0]) == ("miss", "miss") and a[1] != b[1]
        assert upstream.calls[-1]["headers"].get("x-which") == "b"
        assert _ask(c, url, host="b.test", **{"accept-encoding": "identity"}) == ("hit", b[1])

        v1 = _ask(c, url + "?api-version=1", **{"accept-encoding": "identity"})
        v2 = _ask(c, url + "?api-version=2", **{"accept-encoding": "identity"})
        assert (v1[0], v2[0]) == ("miss", "miss") and v1[1] != v2[1]
        assert _ask(c, url + "?api-version=2", **{"accept-encoding": "identity"}) == (
            "hit", v2[1])

        body = {**CHAT, "seed": 7}
        zipped = c.post(url, json=body, headers={"accept-encoding": "gzip"})
        assert zipped.headers["content-encoding"] == "gzip"
        plain = c.post(url, json=body, headers={"accept-encoding": "identity"})
        assert plain.headers["x-aiproxy-cache"] == "miss"
        assert "content-encoding" not in plain.headers
        assert json.loads(plain.content)["id"] != zipped.json()["id"]
        again = c.post(url, json=body, headers={"accept-encoding": "gzip"})
        assert again.headers["x-aiproxy-cache"] == "hit"
        assert again.json() == zipped.json()
    assert len(upstream.calls) == 6


def test_every_field_that_changes_the_answer_takes_part(start_proxy, upstream):
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"
    msgs = CHAT["messages"]
    variants = [
        {"model": "m2"},
        {"messages": [{"role": "system", "content": "be brief"}, *msgs]},
        {"messages": [{"role": "user", "content": "hello", "name": "bob"}]},
        {"messages": [*msgs, {"role": "assistant", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "42"}]},
        {"messages": [*msgs, {"role": "assistant", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "43"}]},
        {"temperature": 0.5}, {"top_p": 0.5}, {"seed": 1}, {"max_tokens": 5}, {"n": 2},
        {"stop": ["x"]}, {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"tool_choice": "none"}, {"logit_bias": {"50256": -100}}, {"stream": True},
    ]
    with httpx.Client() as c:
        first = _ask(c, url)
        answers = {first[1]}
        for change in variants:
            got = _ask(c, url, {**CHAT, **change})
            assert got[0] == "miss", change
            answers.add(got[1])
        assert len(answers) == len(variants) + 1
        # Equivalent JSON (key order, white space) and `user` (documented) share.
        raw = b'{ "temperature" : 0,\n"messages":[{"content":"hello","role":"user"}],"model":"m"}'
        r = c.post(url, content=raw, headers={"content-type": "application/json"})
        assert (r.headers["x-aiproxy-cache"], r.text) == ("hit", first[1])
        assert _ask(c, url, {**CHAT, "user": "u2"}) == ("hit", first[1])
    assert len(upstream.calls) == len(variants) + 1


def test_authenticated_tenants_never_share(start_proxy, upstream):
    """With [auth] entries are per subject; a subject named like a client address is not
    the anonymous callers from that address."""
    from aiproxy.governance.auth import hash_key

    auth = ('[auth]\nrequired = false\n\n'
            f'[[auth.api_keys]]\nid = "ka"\nsubject = "alice"\nhash = "{hash_key("key-a")}"\n\n'
            f'[[auth.api_keys]]\nid = "kb"\nsubject = "bob"\nhash = "{hash_key("key-b")}"\n\n'
            f'[[auth.api_keys]]\nid = "kip"\nsubject = "127.0.0.1"\n'
            f'hash = "{hash_key("key-ip")}"\n')
    proxy = _proxy(start_proxy, upstream.port, more=auth)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        alice = _ask(c, url, **{"x-api-key": "key-a"})
        bob = _ask(c, url, **{"x-api-key": "key-b"})
        assert (alice[0], bob[0]) == ("miss", "miss") and alice[1] != bob[1]
        assert _ask(c, url, **{"x-api-key": "key-a"}) == ("hit", alice[1])
        named = _ask(c, url, **{"x-api-key": "key-ip"})
        anonymous = _ask(c, url)
        assert (named[0], anonymous[0]) == ("miss", "miss") and named[1] != anonymous[1]
