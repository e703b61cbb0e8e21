"""[cache]: exact prompt cache (plain and streamed), scoping, no-store, TTL, errors,
and the embedding/semantic caches with the builtin intent model."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai

from aiproxy.cache.key import request_hash
from aiproxy.cache.store import MemoryCache
from tests.conftest import simple_config
from tests.support import free_port

CHAT = {"model": "demo-model", "max_tokens": 8,
        "messages": [{"role": "user", "content": "what is the capital of France"}]}


def test_canonical_form_ignores_key_order_and_user_not_sampling():
    a = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    b = {"temperature": 0, "user": "u1", "messages": [{"content": "x", "role": "user"}],
         "model": "m"}
    assert request_hash("chat", a) == request_hash("chat", b)
    assert request_hash("chat", a) != request_hash("chat", {**a, "temperature": 0.5})
    assert request_hash("chat", a) != request_hash("chat", {**a, "stream": True})
    assert request_hash("chat", a) != request_hash("completions", a)


def test_memory_cache_is_byte_bounded_lru_with_ttl():
    c = MemoryCache(100)
    c.put("a", 1, 40, 10.0)
    c.put("b", 2, 40, 10.0)
    assert c.get("a", 0.0) == 1  # a is now the most recent
    c.put("c", 3, 40, 10.0)  # 120 > 100: b (least recently used) goes
    assert c.get("b", 0.0) is None and c.get("a", 0.0) == 1 and c.get("c", 0.0) == 3
    assert c.size == 80
    assert c.get("a", 10.0) is None  # expired
    c.put("huge", 4, 101, 10.0)
    assert c.get("huge", 0.0) is None


def _cache_proxy(start_proxy, port: int, cache: str = "", admin: int | None = None):
    extra = f'\n[admin]\naddress = "127.0.0.1:{admin}"\n' if admin else ""
    # The memory backend is per worker; one worker so repeated requests meet the same cache.
    return start_proxy("[server]\nworkers = 1\n" + simple_config(port) + extra
                       + "\n[llm]\ntenant_header = \"x-tenant\"\n\n[cache]\n" + cache)


def test_second_identical_request_is_a_hit_with_identical_bytes(start_proxy, demo_upstream):
    admin = free_port()
    proxy = _cache_proxy(start_proxy, demo_upstream, admin=admin)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        first = c.post(url, json=CHAT)
        second = c.post(url, json=CHAT)
        other = c.post(url, json={**CHAT, "temperature": 0.7})
    assert first.headers["x-aiproxy-cache"] == "miss"
    assert second.headers["x-aiproxy-cache"] == "hit"
    assert second.content == first.content  # same completion id: not asked again
    assert int(second.headers["content-length"]) == len(first.content)
    assert "age" in second.headers
    assert other.headers["x-aiproxy-cache"] == "miss"
    assert other.json()["id"] != first.json()["id"]
    metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
    assert 'aiproxy_cache_lookups_total{cache="prompt",result="hit"} 1.0' in metrics
    assert 'aiproxy_cache_lookups_total{cache="prompt",result="miss"} 2.0' in metrics
    assert 'aiproxy_cache_hit_ratio{cache="joint"} 0.333' in metrics
    # Token counters hold what upstreams spent: the hit adds a request, no tokens.
    spent = first.json()["usage"]["prompt_tokens"] + other.json()["usage"]["prompt_tokens"]
    assert f'aiproxy_llm_prompt_tokens_total{{model="demo-model",pattern="bulk",route="all",tenant="127.0.0.1"}} {spent}.0' in metrics, metrics
    assert 'aiproxy_llm_cached_requests_total{model="demo-model",pattern="bulk",route="all",tenant="127.0.0.1"} 1.0' in metrics
    assert 'aiproxy_llm_requests_total{model="demo-model",pattern="bulk",route="all",tenant="127.0.0.1"} 3.0' in metrics


def test_openai_client_gets_the_cached_answer(start_proxy, demo_upstream):
    proxy = _cache_proxy(start_proxy, demo_upstream)
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k")
    a = client.chat.completions.with_raw_response.create(**CHAT)
    b = client.chat.completions.with_raw_response.create(**CHAT)
    assert b.headers["x-aiproxy-cache"] == "hit"
    assert a.parse().id == b.parse().id and b.parse().usage.total_tokens > 0
    stream_a = list(client.chat.completions.create(**CHAT, stream=True))
    stream_b = list(client.chat.completions.create(**CHAT, stream=True))
    assert [c.model_dump() for c in stream_a] == [c.model_dump() for c in stream_b]


def _raw_chunks(port: int, body: dict) -> tuple[dict[str, str], list[bytes]]:
    """POST over a raw socket; the response's HTTP/1.1 chunks as they were framed."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload)
                  + payload)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode()] = v.strip().decode()
    assert headers.get("transfer-encoding") == "chunked", head
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        chunks.append(rest[:size])
        rest = rest[size + 2:]
    return headers, chunks


def test_cached_stream_replays_with_its_event_boundaries(start_proxy):
    from tests.support import start_demo_upstream, stop_process

    proc, port = start_demo_upstream("paced", token_delay_ms=30)
    try:
        proxy = _cache_proxy(start_proxy, port)
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        h1, live = _raw_chunks(proxy.port, body)
        h2, replay = _raw_chunks(proxy.port, body)
    finally:
        stop_process(proc)
    assert h1["x-aiproxy-cache"] == "miss" and h2["x-aiproxy-cache"] == "hit"
    assert h2["content-type"] == "text/event-stream"
    assert len(live) > 5  # one event per chunk upstream: paced 30 ms apart
    assert replay == live


def test_no_store_errors_and_tenants(start_proxy, demo_upstream):
    proxy = _cache_proxy(start_proxy, demo_upstream)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        ns = [c.post(url, json=CHAT, headers={"cache-control": "no-store"}) for _ in range(2)]
        assert [r.headers["x-aiproxy-cache"] for r in ns] == ["bypass", "bypass"]
        assert ns[0].json()["id"] != ns[1].json()["id"]
        assert c.post(url, json=CHAT).headers["x-aiproxy-cache"] == "miss"  # no-store kept out
        bad = {"model": "m", "messages": []}
        errs = [c.post(url, json=bad) for _ in range(2)]
        assert [r.status_code for r in errs] == [400, 400]
        assert [r.headers["x-aiproxy-cache"] for r in errs] == ["miss", "miss"]
        a = c.post(url, json=CHAT, headers={"x-tenant": "a"})
        a2 = c.post(url, json=CHAT, headers={"x-tenant": "a"})
        b = c.post(url, json=CHAT, headers={"x-tenant": "b"})
        assert (a.headers["x-aiproxy-cache"], a2.headers["x-aiproxy-cache"],
                b.headers["x-aiproxy-cache"]) == ("miss", "hit", "miss")
        fresh = c.post(url, json=CHAT, headers={"x-tenant": "a", "cache-control": "no-cache"})
        assert fresh.headers["x-aiproxy-cache"] == "miss"
        assert fresh.json()["id"] != a.json()["id"]
        assert c.post(url, json=CHAT, headers={"x-tenant": "a"}).content == fresh.content


def test_api_keys_never_share_entries(start_proxy, demo_upstream):
    """Without [auth] the upstream checks the caller's key; a cache hit never reaches it.
    So entries are scoped by the credentials sent upstream too: a second (or invalid)
    key from the same address and tenant never reads what another key was answered."""
    proxy = _cache_proxy(start_proxy, demo_upstream)

    def ask(key: str, org: str | None = None, **headers: str) -> tuple[str, str]:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0,
                               organization=org, default_headers=headers)
        raw = client.chat.completions.with_raw_response.create(**CHAT)
        return raw.headers["x-aiproxy-cache"], raw.parse().id

    alice = ask("sk-alice")
    assert alice[0] == "miss"
    assert ask("sk-alice") == ("hit", alice[1])
    mallory = ask("sk-not-a-key")
    assert mallory[0] == "miss" and mallory[1] != alice[1]
    # Same tenant header, other key: still apart; another organisation of one key too.
    tenant = ask("sk-alice", **{"x-tenant": "t"})
    assert ask("sk-bob", **{"x-tenant": "t"})[0] == "miss"
    assert ask("sk-alice", **{"x-tenant": "t"}) == ("hit", tenant[1])
    assert ask("sk-alice", "org-2", **{"x-tenant": "t"})[0] == "miss"
    with httpx.Client() as c:  # x-api-key style credentials as well
        url = f"{proxy.url}/v1/chat/completions"
        first = c.post(url, json=CHAT, headers={"x-api-key": "a"})
        assert first.headers["x-aiproxy-cache"] == "miss"
        assert c.post(url, json=CHAT, headers={"x-api-key": "a"}).content == first.content
        assert c.post(url, json=CHAT, headers={"x-api-key": "b"}).headers[
            "x-aiproxy-cache"] == "miss"


def test_claimed_tenant_never_meets_an_authenticated_one(start_proxy, demo_upstream):
    """With [auth], a tenant_header value is only a claim: "alice" in the header is not
    the subject alice, and reads none of her cache entries (nor her budgets, counters)."""
    from aiproxy.governance.auth import hash_key

    auth = (f'\n[auth]\nrequired = false\n\n[[auth.api_keys]]\nid = "ka"\n'
            f'subject = "alice"\nhash = "{hash_key("key-of-alice")}"\n')
    proxy = _cache_proxy(start_proxy, demo_upstream, auth)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        mine = c.post(url, json=CHAT, headers={"x-api-key": "key-of-alice"})
        claim = c.post(url, json=CHAT, headers={"x-tenant": "alice"})
        again = c.post(url, json=CHAT, headers={"x-tenant": "alice"})
    assert [r.headers["x-aiproxy-cache"] for r in (mine, claim, again)] == [
        "miss", "miss", "hit"]
    assert claim.json()["id"] != mine.json()["id"]


def test_cache_control_on_several_field_lines(start_proxy, demo_upstream):
    """RFC 9110 5.3: Cache-Control split over field lines is one list. A response whose
    second line says no-store (or private, with a shared cache) is not stored; a request
    whose second line says no-store bypasses the cache."""
    import itertools

    from aiohttp import hdrs, web
    from multidict import CIMultiDict

    from tests.support import serve_aiohttp

    ids = itertools.count()

    async def chat(request: web.Request) -> web.Response:
        doc = await request.json()
        words = doc["messages"][0]["content"].split()
        headers = CIMultiDict([(hdrs.CONTENT_TYPE, "application/json")])
        for directive in words[1:]:  # one field line per word after the first
            headers.add(hdrs.CACHE_CONTROL, directive)
        return web.Response(headers=headers, text=json.dumps({
            "id": f"c-{next(ids)}", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)

    def ask(c, text, **headers):
        r = c.post(url, json={"model": "m", "messages": [{"role": "user", "content": text}]},
                   headers=headers)
        return r.headers["x-aiproxy-cache"], r.json()["id"]

    with serve_aiohttp(app) as port:
        proxy = _cache_proxy(start_proxy, port, "shared = true\n")
        url = f"{proxy.url}/v1/chat/completions"
        with httpx.Client() as c:
            for text in ("a public no-store", "b public private", "c max-age=60 no-store"):
                first, second = ask(c, text), ask(c, text)
                assert (first[0], second[0]) == ("miss", "miss") and first != second, text
            assert ask(c, "d public")[0] == "miss" and ask(c, "d public")[0] == "hit"
            # What a request accepts: max-age=0 and Pragma: no-cache refresh the entry,
            # max-age=N takes one at most N s old.
            stored = ask(c, "d public")[1]
            refreshed = ask(c, "d public", **{"cache-control": "max-age=0"})
            assert refreshed[0] == "miss" and refreshed[1] != stored
            assert ask(c, "d public", pragma="no-cache")[0] == "miss"
            assert ask(c, "d public", **{"cache-control": "max-age=60"})[0] == "hit"
            time.sleep(1.1)
            assert ask(c, "d public", **{"cache-control": "max-age=1"})[0] == "miss"
            two = httpx.Headers([("cache-control", "max-age=0"), ("cache-control", "no-store")])
            r = c.post(url, json={"model": "m", "messages": [{"role": "user", "content": "d public"}]},
                       headers=two)
            assert r.headers["x-aiproxy-cache"] == "bypass"


def test_shared_entries_and_ttl(start_proxy, demo_upstream):
    proxy = _cache_proxy(start_proxy, demo_upstream, "shared = true\nttl_ms = 400\n")
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        assert c.post(url, json=CHAT, headers={"x-tenant": "a"}).headers[
            "x-aiproxy-cache"] == "miss"
        assert c.post(url, json=CHAT, headers={"x-tenant": "b"}).headers[
            "x-aiproxy-cache"] == "hit"
        time.sleep(0.6)
        assert c.post(url, json=CHAT, headers={"x-tenant": "b"}).headers[
            "x-aiproxy-cache"] == "miss"


def _semantic_proxy(start_proxy, port: int, admin: int, threshold: float):
    return start_proxy(f"""
[semantic]
model = "builtin:clinc150"
inspect_bytes = 4096

[admin]
address = "127.0.0.1:{admin}"

[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{port}"]

[[routes]]
name = "banking"
match = {{ path_prefix = "/v1/", intent_domain = "banking" }}
cluster = "up"

[[routes]]
name = "rest"
match = {{ path_prefix = "/" }}
cluster = "up"

[cache]
semantic_threshold = {threshold}
""")


def _ask(c: httpx.Client, url: str, text: str) -> httpx.Response:
    return c.post(url, json={"model": "demo-model",
                             "messages": [{"role": "user", "content": text}]})


def test_embedding_and_semantic_caches(start_proxy, demo_upstream):
    admin = free_port()
    proxy = _semantic_proxy(start_proxy, demo_upstream, admin, 0.9)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        first = _ask(c, url, "how much money is in my checking account")
        again = _ask(c, url, "how much money is in my checking account")
        near = _ask(c, url, "how much money is in my checking account please")
        far = _ask(c, url, "play some jazz music in the kitchen")
    assert first.headers["x-aiproxy-cache"] == "miss"
    assert again.headers["x-aiproxy-cache"] == "hit"
    assert near.headers["x-aiproxy-cache"] == "hit"  # a semantic hit: another question
    assert near.content == first.content
    assert far.headers["x-aiproxy-cache"] == "miss"
    metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
    assert 'aiproxy_cache_lookups_total{cache="semantic",result="hit"} 1.0' in metrics
    assert 'aiproxy_cache_lookups_total{cache="prompt",result="hit"} 1.0' in metrics
    # the repeat skipped classification: its decision came from ec:<same hash>
    assert 'aiproxy_cache_lookups_total{cache="embedding",result="hit"} 1.0' in metrics


def test_semantic_hit_needs_the_same_context(start_proxy, demo_upstream):
    """A semantic match may differ only in the question: another system prompt, earlier
    turn, tool list or sampling parameter asks something else and is a miss."""
    proxy = _semantic_proxy(start_proxy, demo_upstream, free_port(), 0.9)
    url = f"{proxy.url}/v1/chat/completions"
    question = "how much money is in my checking account"
    base = {"model": "demo-model", "messages": [{"role": "user", "content": question}]}
    variants = {
        "system": {**base, "messages": [{"role": "system", "content": "Answer in French."},
                                        *base["messages"]]},
        "earlier turn": {**base, "messages": [{"role": "user", "content": "hello"},
                                              {"role": "assistant", "content": "hi"},
                                              *base["messages"]]},
        "max_tokens": {**base, "max_tokens": 3},
        "temperature": {**base, "temperature": 1.5},
        "n": {**base, "n": 2},
        "tools": {**base, "tools": [{"type": "function", "function": {"name": "f"}}]},
    }
    with httpx.Client() as c:
        assert c.post(url, json=base).headers["x-aiproxy-cache"] == "miss"
        for name, body in variants.items():
            near = {**body, "messages": [*body["messages"][:-1], {
                "role": "user", "content": question + " please"}]}
            assert c.post(url, json=near).headers["x-aiproxy-cache"] == "miss", name
        paraphrase = {**base, "messages": [{"role": "user", "content": question + " please"}]}
        assert c.post(url, json=paraphrase).headers["x-aiproxy-cache"] == "hit"


def test_semantic_threshold_keeps_dissimilar_prompts_apart(start_proxy, demo_upstream):
    proxy = _semantic_proxy(start_proxy, demo_upstream, free_port(), 0.9999)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        _ask(c, url, "how much money is in my checking account")
        near = _ask(c, url, "what is the balance of my savings account")
    assert near.headers["x-aiproxy-cache"] == "miss"


def test_h2c_accounting_and_cache(start_proxy, demo_upstream, tmp_path):
    log = tmp_path / "access.log"
    proxy = start_proxy(simple_config(demo_upstream)
                        + f'\n[access_log]\npath = "{log}"\nflush_interval_ms = 20\n'
                        + "\n[cache]\n", 'protocols = ["http1", "h2c"]')
    url = f"{proxy.url}/v1/chat/completions"
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(http2=True, http1=False) as c:
        plain = [c.post(url, json=CHAT) for _ in range(2)]
        streamed = [c.post(url, json=body) for _ in range(2)]
    assert plain[0].http_version == "HTTP/2"
    assert [r.headers["x-aiproxy-cache"] for r in plain + streamed] == ["miss", "hit"] * 2
    assert plain[1].content == plain[0].content
    assert streamed[1].content == streamed[0].content
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(log.read_text().splitlines()) < 4:
        time.sleep(0.02)
    recs = [json.loads(x)["llm"] for x in log.read_text().splitlines()]
    usage = plain[0].json()["usage"]
    assert recs[0]["prompt_tokens"] == usage["prompt_tokens"] and not recs[0]["estimated"]
    assert [r["cached"] for r in recs] == [False, True, False, True]
    assert recs[2]["stream"] and not recs[2]["estimated"]


def test_semantic_indexes_are_bounded():
    """One index per request context: clients sending new contexts cannot grow them
    past INDEXED_LIMIT embeddings; the least recently added-to index goes first."""
    import numpy as np

    from aiproxy.cache.prompt import INDEXED_LIMIT, CacheState
    from aiproxy.config.schema import CacheConfig

    state = CacheState(CacheConfig())
    vector = np.ones(8, dtype=np.float32) / np.sqrt(8)
    state.index(("r", None, "kept"), vector, "k-kept")
    for i in range(2 * INDEXED_LIMIT):
        state.index(("r", None, f"ctx{i}"), vector, f"k{i}")
        if i % 1000 == 0:
            state.index(("r", None, "kept"), vector, f"k-kept{i}")  # used: stays
    assert state.indexed == sum(len(x.keys) for x in state.indexes.values()) <= INDEXED_LIMIT
    assert ("r", None, "kept") in state.indexes and ("r", None, "ctx0") not in state.indexes


def test_hit_via_names_the_protocol_the_response_came_with(start_proxy):
    """Via names the protocol of the message received on that hop (RFC 9110 7.6.3): for
    a response, the upstream's. A hit is the response stored from an HTTP/2 upstream,
    so it says `2` as the miss did, whatever protocol the client speaks."""
    from tests.h2_support import H2Upstream

    up = H2Upstream(name="h2-cache")
    try:
        proxy = start_proxy("[server]\nworkers = 1\n"
                            + simple_config(up.port, cluster_extra='protocol = "h2"')
                            + "\n[llm]\n\n[cache]\n")
        url = f"{proxy.url}/v1/chat/completions"
        with httpx.Client() as c:
            first = c.post(url, json=CHAT)
            second = c.post(url, json=CHAT)
        assert first.headers["x-aiproxy-cache"] == "miss"
        assert second.headers["x-aiproxy-cache"] == "hit"
        assert first.headers["via"] == second.headers["via"] == "2 aiproxy"
    finally:
        up.stop()
