"""[cache] correctness against an upstream the test controls: what takes part in the
key (route, query, Accept-Encoding besides the body and the caller), what is stored
(never a cut stream, an error, Set-Cookie, no-store), how a hit is replayed, and
identical misses that arrive together."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import shutil
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support import (
    StreamServerThread,
    free_port,
    read_request,
    start_redis_server,
    stop_process,
    wait_redis_keys,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "temperature": 0}


class Upstream(StreamServerThread):
    """An OpenAI-style chat upstream on a raw asyncio server: every answer carries a new
    id (`c<N>`, N = calls so far) and the Host it was sent to, so a replay is told from a
    fresh answer. The last user message chooses misbehaviour: "cut" ends an event stream
    mid-way (a plain body half-way), "cookie" adds Set-Cookie, "nostore"/"private" the
    Cache-Control, "vary=<fields>" a Vary, "error" is a
    500, "slow" waits 0.5 s before answering. A request that accepts gzip gets gzip."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        super().__init__(self.serve)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (req := await read_request(reader)) is not None:
                if not await self.answer(*req, writer):
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
        if text.startswith("vary="):  # "vary=<field list>": that Vary field
            extra += b"Vary: " + text[5:].encode() + b"\r\n"
        content = f"answer {n} from {headers.get('host')}"
        if req.get("stream"):
            events = [{"id": f"c{n}", "object": "chat.completion.chunk", "created": 1,
                       "model": req.get("model"), "choices": [
                           {"index": 0, "delta": {"content": word + " "},
                            "finish_reason": None}]} for word in content.split()]
            events[-1]["choices"][0]["finish_reason"] = "stop"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n"
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
                     b"Content-Length: %d\r\n" % len(out) + extra + b"\r\n")
        if "cut" in text:  # half the body, then the connection ends
            writer.write(out[:len(out) // 2])
            await writer.drain()
            writer.transport.abort()
            return False
        writer.write(out)
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


def test_paths_of_one_endpoint_never_share_entries(start_proxy, upstream):
    """The key held the endpoint's kind, not the path: /v1/chat/completions/ (which an
    upstream may answer otherwise, with a 404 or a redirect) was answered from the entry
    of /v1/chat/completions. The path the upstream is sent takes part now."""
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        plain = _ask(c, url)
        slash = _ask(c, url + "/")
        assert (plain[0], slash[0]) == ("miss", "miss") and plain[1] != slash[1]
        assert _ask(c, url + "/") == ("hit", slash[1])
        assert _ask(c, url) == ("hit", plain[1])
    assert [call["target"] for call in upstream.calls] == ["/v1/chat/completions",
                                                            "/v1/chat/completions/"]


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


def _said(text: str, **more: Any) -> dict:
    return {**CHAT, "messages": [{"role": "user", "content": text}], **more}


def test_only_whole_clean_answers_are_stored(start_proxy, upstream):
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        for body in (_said("cut", stream=True), _said("cut")):
            for _ in range(2):
                before = len(upstream.calls)
                with pytest.raises(httpx.HTTPError):
                    c.post(url, json=body).read()
                assert len(upstream.calls) == before + 1  # asked again: nothing stored
        cookies = [c.post(url, json=_said("cookie")) for _ in range(2)]
        assert [r.headers["x-aiproxy-cache"] for r in cookies] == ["miss", "miss"]
        assert cookies[0].headers["set-cookie"] != cookies[1].headers["set-cookie"]
        for text in ("nostore", "error"):
            assert [_ask(c, url, _said(text))[0] for _ in range(2)] == ["miss", "miss"]
        # private: never, even per caller (a tenant is not one user; shared below too).
        assert [_ask(c, url, _said("private"))[0] for _ in range(2)] == ["miss", "miss"]
        refused = c.post(url, json=_said("client"), headers={"cache-control": "no-store"})
        assert refused.headers["x-aiproxy-cache"] == "bypass"
        assert _ask(c, url, _said("client"))[0] == "miss"
    shared = _proxy(start_proxy, upstream.port, cache="shared = true")
    with httpx.Client() as c:
        url = f"{shared.url}/v1/chat/completions"
        assert [_ask(c, url, _said("private"))[0] for _ in range(2)] == ["miss", "miss"]


@pytest.mark.parametrize("vary, stored", [
    ("*", False),
    ("X-User-Tier", False),
    ("Accept-Encoding, anthropic-version", True),
    ("accept-encoding,OpenAI-Beta", True),
    ("Authorization", True),  # per caller: the key holds the credentials sent
    ("Accept-Encoding, Cookie", True),  # per caller: Cookie is a credential field
    ("Origin", True),  # a CORS answer: the key holds the Origin
])
def test_a_vary_the_key_does_not_hold_is_not_stored(start_proxy, upstream, vary, stored):
    """RFC 9111 4.1: a stored response answers only requests that match it on the fields
    its Vary names. Those the key does not hold (or `*`) would be guessed: not stored."""
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        got = [_ask(c, url, _said(f"vary={vary}"), authorization="Bearer k1")[0]
               for _ in range(2)]
    assert got == (["miss", "hit"] if stored else ["miss", "miss"])
    if "Cookie" in vary or vary == "Authorization":  # shared: the key holds no credentials
        shared = _proxy(start_proxy, upstream.port, cache="shared = true")
        with httpx.Client() as c:
            url = f"{shared.url}/v1/chat/completions"
            assert [_ask(c, url, _said(f"vary={vary}"), authorization="Bearer k1")[0]
                    for _ in range(2)] == ["miss", "miss"]


def test_api_version_beta_and_origin_fields_take_part(start_proxy, upstream):
    """anthropic-version, anthropic-beta and OpenAI-Beta change what an upstream answers
    (its shape, its tools) for the same body, and a CORS answer names the Origin it
    allows: one entry each."""
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        for name in ("anthropic-version", "anthropic-beta", "openai-beta", "origin"):
            body = _said(f"versions {name}")
            a = _ask(c, url, body, **{name: "v1"})
            b = _ask(c, url, body, **{name: "v2"})
            assert (a[0], b[0]) == ("miss", "miss") and a[1] != b[1]
            assert _ask(c, url, body, **{name: "v1"}) == ("hit", a[1])
            assert _ask(c, url, body)[0] == "miss"


def test_replays(start_proxy, upstream):
    """A stored stream replays as an event stream the openai client reads alike; a stream
    entry never answers a plain request (nor the reverse); plain hits have a length."""
    proxy = _proxy(start_proxy, upstream.port)
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0)

    def streamed() -> tuple[str | None, list[dict]]:
        with client.chat.completions.with_streaming_response.create(
                model="m", messages=CHAT["messages"], temperature=0, stream=True) as r:
            return r.headers.get("x-aiproxy-cache"), [c.model_dump() for c in r.parse()]

    first, again = streamed(), streamed()
    assert (first[0], again[0]) == ("miss", "hit") and first[1] == again[1]
    assert "".join(c["choices"][0]["delta"]["content"] for c in again[1]).startswith("answer 1")
    plain = client.chat.completions.with_raw_response.create(
        model="m", messages=CHAT["messages"], temperature=0)
    assert plain.headers["x-aiproxy-cache"] == "miss"
    assert plain.parse().choices[0].message.content.startswith("answer 2")
    with httpx.Client() as c:
        url = f"{proxy.url}/v1/chat/completions"
        hit = c.post(url, json=CHAT, headers={"authorization": "Bearer k"})
        assert hit.headers["x-aiproxy-cache"] == "hit"
        assert int(hit.headers["content-length"]) == hit.num_bytes_downloaded
        assert "transfer-encoding" not in hit.headers and int(hit.headers["age"]) >= 0
        assert hit.headers["content-type"] == "application/json"
        with c.stream("POST", url, json={**CHAT, "stream": True},
                      headers={"authorization": "Bearer k"}) as s:
            assert s.headers["x-aiproxy-cache"] == "hit"
            assert s.headers["transfer-encoding"] == "chunked"
            assert "content-length" not in s.headers
            assert s.headers["content-type"] == "text/event-stream"
            assert b"".join(s.iter_bytes()).endswith(b"data: [DONE]\n\n")
        # Only POSTs to the OpenAI endpoints are cached.
        assert "x-aiproxy-cache" not in c.head(url).headers
    assert len(upstream.calls) == 3


def test_identical_misses_together_are_each_asked(start_proxy, upstream):
    """No coalescing (documented): N identical misses at once make N upstream calls, each
    answered whole; an entry is only there once a response ended."""
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient() as c:
            return await asyncio.gather(*[c.post(url, json=_said("slow")) for _ in range(8)])

    answers = asyncio.run(burst())
    assert [r.headers["x-aiproxy-cache"] for r in answers] == ["miss"] * 8
    assert len({r.json()["id"] for r in answers}) == 8 and len(upstream.calls) == 8
    with httpx.Client() as c:
        hit = c.post(url, json=_said("slow"))
    assert hit.headers["x-aiproxy-cache"] == "hit"
    assert hit.json()["id"] in {r.json()["id"] for r in answers}


def _cache_bytes(admin: int) -> float:
    for line in httpx.get(f"http://127.0.0.1:{admin}/metrics").text.splitlines():
        if line.startswith("aiproxy_cache_bytes "):
            return float(line.split()[1])
    raise AssertionError("no aiproxy_cache_bytes")


def test_size_bounds(start_proxy, upstream):
    admin = free_port()
    more = f'[admin]\naddress = "127.0.0.1:{admin}"\n'
    small = _proxy(start_proxy, upstream.port, cache="max_entry_bytes = 400", more=more)
    with httpx.Client() as c:
        url = f"{small.url}/v1/chat/completions"
        assert [_ask(c, url)[0] for _ in range(2)] == ["miss", "miss"]  # over 400: not kept
    assert _cache_bytes(admin) == 0
    admin = free_port()
    more = f'[admin]\naddress = "127.0.0.1:{admin}"\n'
    tight = _proxy(start_proxy, upstream.port, cache="max_bytes = 1024", more=more)
    with httpx.Client() as c:
        url = f"{tight.url}/v1/chat/completions"
        assert [_ask(c, url, _said(t))[0] for t in ("a", "a", "b", "a")] == [
            "miss", "hit", "miss", "miss"]  # one ~600-byte entry fits: b pushed a out
    assert 0 < _cache_bytes(admin) <= 1024


def test_reload_applies_new_bounds_to_entries_held(start_proxy, upstream):
    """A reload keeps the entries, but a smaller max_bytes or a shorter ttl_ms holds for
    them at once, and a route that now sends another model starts new entries."""
    admin = free_port()
    more = f'[admin]\naddress = "127.0.0.1:{admin}"\n'
    proxy = _proxy(start_proxy, upstream.port, more=more)
    url = f"{proxy.url}/v1/chat/completions"
    source = proxy.config_path.read_text()

    def reload(text: str) -> None:
        proxy.config_path.write_text(text)
        r = httpx.post(f"http://127.0.0.1:{admin}/config/reload", timeout=10)
        assert r.status_code == 200, r.text

    with httpx.Client() as c:
        for t in ("a", "b", "c", "a"):
            _ask(c, url, _said(t))
        assert _cache_bytes(admin) > 1024
        reload(source.replace("[cache]\n", "[cache]\nmax_bytes = 1024\n"))
        assert 0 < _cache_bytes(admin) <= 1024
        assert _ask(c, url, _said("a"))[0] == "hit"  # the most recent one stayed
        reload(source.replace('cluster = "up"\n', 'cluster = "up"\nmodel = "m9"\n'))
        assert _ask(c, url, _said("a"))[0] == "miss"
        assert upstream.calls[-1]["body"]["model"] == "m9"
        assert _ask(c, url, _said("a"))[0] == "hit"
        reload(source.replace('cluster = "up"\n', 'cluster = "up"\nmodel = "m9"\n')
               .replace("[cache]\n", "[cache]\nttl_ms = 1\n"))
        assert _ask(c, url, _said("a"))[0] == "miss"  # stored under a 300 s ttl


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")
def test_redis_entries_follow_the_same_rules(start_proxy, upstream, tmp_path):
    import redis

    proc, rport = start_redis_server(tmp_path)
    try:
        db = redis.Redis(port=rport)
        cache = f'backend = "redis"\nredis_url = "redis://127.0.0.1:{rport}/0"'
        proxy = _proxy(start_proxy, upstream.port, cache=cache,
                       routes=TWO_ROUTES.format(port=upstream.port))
        url = f"{proxy.url}/v1/chat/completions"

        with httpx.Client() as c:
            asks = [{}, {"host": "b.test"}, {"accept-encoding": "gzip"}]
            for i, headers in enumerate(asks):
                assert _ask(c, url, **headers)[0] == "miss", headers
                wait_redis_keys(db, i + 1)
            assert _ask(c, url + "?api-version=2")[0] == "miss"
            wait_redis_keys(db, 4)
            assert _ask(c, url, host="b.test")[0] == "hit"
            with pytest.raises(httpx.HTTPError):
                c.post(url, json=_said("cut", stream=True)).read()
            assert _ask(c, url, _said("cookie"))[0] == "miss"
            assert _ask(c, url, _said("after"))[0] == "miss"
            wait_redis_keys(db, 5)  # "after" only
            calls = len(upstream.calls)
            with pytest.raises(httpx.HTTPError):
                c.post(url, json=_said("cut", stream=True)).read()
            assert len(upstream.calls) == calls + 1
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        stop_process(proc)
