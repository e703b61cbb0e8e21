"""[cache] as a shared cache (RFC 9111) in what it stores and for how long: the
response's Cache-Control, Expires and Age, the request's Cache-Control, Authorization,
which fields a hit replays, and streams that end without proof they are whole. The
upstream is scripted: the last user message is a JSON object naming the response
fields to send ("h") and how to frame the body ("frame": length, chunked, close)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from email.utils import formatdate, parsedate_to_datetime
from typing import Any

import httpx
import pytest

from tests.support import (
    StreamServerThread,
    free_port,
    read_request,
    start_redis_server,
    stop_process,
    wait_redis_keys,
)


class Upstream(StreamServerThread):
    """Every answer has a new id (`c<N>`), so a replay is told from a fresh answer."""

    def __init__(self) -> None:
        self.calls = 0
        super().__init__(self.serve)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (req := await read_request(reader)) is not None:
                if not await self.answer(json.loads(req[3]), writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def answer(self, req: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        self.calls += 1
        n = self.calls
        script = json.loads(req["messages"][-1]["content"])
        fields = b"".join(f"{k}: {v}\r\n".encode() for k, v in script.get("h", []))
        frame = script.get("frame", "length")
        if req.get("stream"):
            pieces = [b'data: {"id": "c%d", "n": %d}\n\n' % (n, i) for i in range(3)]
            pieces.append(b"data: [DONE]\n\n")
            ctype = b"text/event-stream"
        else:
            pieces = [json.dumps({"id": f"c{n}", "object": "chat.completion", "choices": [
                {"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "ok"}}]}).encode()]
            ctype = b"application/json"
        if script.get("cut"):
            pieces = pieces[:2]
        head = b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\n" + fields
        if frame == "length":
            head += b"Content-Length: %d\r\n" % sum(map(len, pieces))
        elif frame == "chunked":
            head += b"Transfer-Encoding: chunked\r\n"
        else:
            head += b"Connection: close\r\n"
        writer.write(head + b"\r\n")
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if frame == "chunked" else piece)
            await writer.drain()
        if frame == "chunked" and not script.get("cut"):
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        return frame != "close" and not script.get("cut")


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    yield up
    up.close()


def _proxy(start_proxy, port: int, cache: str = "", admin: int | None = None):
    more = f'[admin]\naddress = "127.0.0.1:{admin}"\n' if admin else ""
    return start_proxy(f"""
[server]
workers = 1

[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{port}"]

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"

{more}
[cache]
{cache}
""")


def _body(script: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": json.dumps(script)}],
            **more}


def _twice(c: httpx.Client, url: str, script: dict[str, Any], **headers: str
           ) -> list[httpx.Response]:
    return [c.post(url, json=_body(script), headers=headers) for _ in range(2)]


def _marks(rs: list[httpx.Response]) -> list[str]:
    return [r.headers["x-aiproxy-cache"] for r in rs]


def _id(r: httpx.Response) -> str:
    return r.text.split('"id": "', 1)[1].split('"', 1)[0]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("cc", ["no-cache", "private", 'no-cache="set-cookie"',
                                'private="x-user", max-age=60', "public, no-cache",
                                "no-store"])
def test_a_response_that_forbids_reuse_is_not_stored(start_proxy, upstream, cc, stream):
    """RFC 9111 5.2.2: no-store and no-cache (reuse only after revalidation, which this
    cache does not do) and, in a shared cache, private (the default scope is a tenant,
    not one user) keep a response out of the cache, for event streams too."""
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"
    script = {"h": [["Cache-Control", cc]], "frame": "chunked"}
    with httpx.Client() as c:
        rs = [c.post(url, json=_body(script, stream=stream)) for _ in range(2)]
    assert _marks(rs) == ["miss", "miss"]
    assert _id(rs[0]) != _id(rs[1]) and upstream.calls == 2


def _entries(admin: int) -> float:
    for line in httpx.get(f"http://127.0.0.1:{admin}/metrics").text.splitlines():
        if line.startswith("aiproxy_cache_entries "):
            return float(line.split()[1])
    raise AssertionError("no aiproxy_cache_entries")


def _dated(offset: float, **more: str) -> list[list[str]]:
    """A Date of now and an Expires `offset` seconds from it, with more fields."""
    now = time.time()
    return [["Date", formatdate(now, usegmt=True)],
            ["Expires", formatdate(now + offset, usegmt=True)],
            *([k.replace("_", "-"), v] for k, v in more.items())]


STALE = {  # a lifetime of 0, or an Age already past it: never stored
    "max-age=0": [["Cache-Control", "max-age=0"]],
    "s-maxage=0 first": [["Cache-Control", "s-maxage=0, max-age=60"]],
    "max-age invalid": [["Cache-Control", "max-age=6O"]],
    "Expires past": _dated(-60),
    "Expires = Date": _dated(0),
    "Expires invalid": [["Expires", "0"]],
    "Age past max-age": [["Cache-Control", "max-age=60"], ["Age", "61"]],
    "Age past ttl_ms": [["Age", "301"]],
    "Age past Expires": _dated(60, Age="60"),
}
FRESH = {
    "max-age=60": [["Cache-Control", "max-age=60"]],
    "s-maxage first": [["Cache-Control", "s-maxage=60, max-age=0"]],
    "Expires future": _dated(60),
    "Expires, asctime Date": [["Date", "Sun Nov  6 08:49:37 1994"],
                              ["Expires", "Sunday, 06-Nov-94 08:50:37 GMT"]],
    "max-age over Expires": _dated(-60, Cache_Control="max-age=60"),
}


@pytest.mark.parametrize("fields", [*STALE.values(), *FRESH.values()],
                         ids=[*STALE, *FRESH])
def test_the_response_lifetime_decides_what_is_stored(start_proxy, upstream, fields):
    """RFC 9111 4.2.1: s-maxage, else max-age, else Expires - Date give the lifetime
    (within ttl_ms); invalid is stale; an entry whose Age is past it is not kept."""
    admin = free_port()
    proxy = _proxy(start_proxy, upstream.port, admin=admin)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        rs = _twice(c, url, {"h": fields})
    fresh = fields in FRESH.values()
    assert _marks(rs) == (["miss", "hit"] if fresh else ["miss", "miss"])
    assert _entries(admin) == (1 if fresh else 0)


def test_an_entry_lives_no_longer_than_its_max_age(start_proxy, upstream):
    admin = free_port()
    proxy = _proxy(start_proxy, upstream.port, admin=admin)
    url = f"{proxy.url}/v1/chat/completions"
    script = {"h": [["Cache-Control", "max-age=1"]]}
    with httpx.Client() as c:
        first = c.post(url, json=_body(script))
        assert _entries(admin) == 1
        time.sleep(1.1)
        again = c.post(url, json=_body(script))
    assert _marks([first, again]) == ["miss", "miss"] and _id(first) != _id(again)


def test_a_hit_carries_its_age_and_the_upstream_date(start_proxy, upstream):
    """RFC 9111 5.1 / 4.2.3: a hit's Age counts the Age it arrived with; its Date is the
    upstream's (RFC 9111 3.1: stored fields are kept), or the time it was received. A
    request's max-age is held against that age."""
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"
    date = "Tue, 01 Dec 2026 10:00:00 GMT"
    with httpx.Client() as c:
        aged = {"h": [["Age", "30"], ["Date", date], ["Cache-Control", "max-age=3600"]]}
        miss, hit = _twice(c, url, aged)
        assert _marks([miss, hit]) == ["miss", "hit"] and _id(miss) == _id(hit)
        assert 30 <= int(hit.headers["age"]) < 3600 and hit.headers["date"] == date
        assert hit.headers.get_list("age") == [hit.headers["age"]]
        younger = c.post(url, json=_body(aged), headers={"cache-control": "max-age=29"})
        assert younger.headers["x-aiproxy-cache"] == "miss"
        undated = _twice(c, url, {"frame": "chunked"})
        assert _marks(undated) == ["miss", "hit"]
        assert abs(parsedate_to_datetime(undated[1].headers["date"]).timestamp()
                   - time.time()) < 3600


ONLY = {"cache-control": "only-if-cached"}


def _not_cached(r: httpx.Response, mark: str = "miss") -> bool:
    return (r.status_code == 504 and r.json()["error"]["code"] == "not_cached"
            and r.headers["x-aiproxy-cache"] == mark)


def test_only_if_cached_is_answered_from_the_cache_or_504(start_proxy, upstream):
    """RFC 9111 5.2.1.7: a request with only-if-cached gets a stored response that meets
    its other directives, or 504; it never goes upstream."""
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"
    script = {"h": [["Cache-Control", "max-age=60"]]}
    with httpx.Client() as c:
        assert _not_cached(c.post(url, json=_body(script), headers=ONLY))
        assert upstream.calls == 0
        stored = c.post(url, json=_body(script))
        hit = c.post(url, json=_body(script), headers=ONLY)
        assert hit.status_code == 200 and hit.headers["x-aiproxy-cache"] == "hit"
        assert _id(hit) == _id(stored)
        for cc in ("only-if-cached, no-cache", "only-if-cached, max-age=0"):
            assert _not_cached(c.post(url, json=_body(script), headers={"cache-control": cc}))
        assert _not_cached(c.post(url, json=_body(script),
                                  headers={"cache-control": "no-store, only-if-cached"}),
                           "bypass")
        assert _not_cached(c.post(url, json=_body(script, stream=True), headers=ONLY))
        assert upstream.calls == 1


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")
def test_redis_entries_keep_the_same_lifetime_and_age(start_proxy, upstream, tmp_path):
    import redis

    proc, rport = start_redis_server(tmp_path)
    try:
        db = redis.Redis(port=rport)
        proxy = _proxy(start_proxy, upstream.port,
                       f'backend = "redis"\nredis_url = "redis://127.0.0.1:{rport}/0"')
        url = f"{proxy.url}/v1/chat/completions"

        with httpx.Client() as c:
            assert _not_cached(c.post(url, json=_body({"tag": "redis"}), headers=ONLY))
            assert upstream.calls == 0
            for name, fields in STALE.items():
                assert _marks(_twice(c, url, {"h": fields})) == ["miss", "miss"], name
            for cc in ("no-cache", "private", "no-store"):
                assert _marks(_twice(c, url, {"h": [["Cache-Control", cc]]})) == [
                    "miss", "miss"], cc
            assert _marks([c.post(url, json=_body({"frame": "close", "cut": True},
                                                  stream=True)) for _ in range(2)]) == [
                "miss", "miss"]
            aged = {"h": [["Age", "30"], ["Cache-Control", "max-age=60"]]}
            assert c.post(url, json=_body(aged)).headers["x-aiproxy-cache"] == "miss"
            wait_redis_keys(db, 1)
            (key,) = db.keys()
            assert 0 < db.pttl(key) <= 30_000  # 60 s lifetime, 30 s of it gone
            hit = c.post(url, json=_body(aged))
            assert hit.headers["x-aiproxy-cache"] == "hit" and int(hit.headers["age"]) >= 30
            assert "date" in hit.headers
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        stop_process(proc)


@pytest.mark.parametrize("cc, stored", [
    (None, False), ("max-age=60", False), ("public", True), ("s-maxage=60", True),
    ("must-revalidate", True),
])
def test_shared_entries_answer_an_authorization_only_when_the_upstream_allows(
        start_proxy, upstream, cc, stored):
    """RFC 9111 3.5: with shared = true the key holds no credentials, so a response to a
    request whose Authorization went upstream is reused only if it says public,
    s-maxage or must-revalidate; per-caller entries (the default) hold the credentials."""
    script = {"h": [["Cache-Control", cc]] if cc else [], "tag": "shared"}
    shared = _proxy(start_proxy, upstream.port, "shared = true")
    url = f"{shared.url}/v1/chat/completions"
    with httpx.Client() as c:
        rs = [c.post(url, json=_body(script), headers={"authorization": f"Bearer k{i}"})
              for i in range(2)]
        assert _marks(rs) == (["miss", "hit"] if stored else ["miss", "miss"])
        anonymous = {**script, "tag": "anonymous"}
        assert _marks(_twice(c, url, anonymous)) == ["miss", "hit"]
    scoped = _proxy(start_proxy, upstream.port)
    url = f"{scoped.url}/v1/chat/completions"
    with httpx.Client() as c:
        assert _marks(_twice(c, url, script, authorization="Bearer k")) == ["miss", "hit"]


@pytest.mark.parametrize("field", ["x-api-key", "api-key", "x-goog-api-key", "x-auth-token",
                                   "cookie"])
@pytest.mark.parametrize("cc, stored", [(None, False), ("public", True)])
def test_shared_entries_hold_every_credential_field_to_the_authorization_rule(
        start_proxy, upstream, field, cc, stored):
    """Anthropic's x-api-key, Azure's api-key, Gemini's x-goog-api-key, a session
    cookie: the upstream checks them as it does Authorization, so with shared = true an
    answer to one is not kept for another key, or for a caller with none, unless the
    upstream marks it for others (RFC 9111 3.5). Proxy-Authorization never goes
    upstream (hop-by-hop), so it does not keep an answer out."""
    script = {"h": [["Cache-Control", cc]] if cc else [], "tag": field}
    shared = _proxy(start_proxy, upstream.port, "shared = true")
    url = f"{shared.url}/v1/chat/completions"
    with httpx.Client() as c:
        rs = [c.post(url, json=_body(script), headers={field: f"k{i}"}) for i in range(2)]
        rs.append(c.post(url, json=_body(script)))
        assert _marks(rs) == (["miss", "hit", "hit"] if stored else ["miss"] * 3)
        assert upstream.calls == (1 if stored else 3)
        hop = {"tag": "proxy-authorization"}
        assert _marks([c.post(url, json=_body(hop), headers={"proxy-authorization": f"k{i}"})
                       for i in range(2)]) == ["miss", "hit"]


@pytest.mark.parametrize("field", ["x-goog-api-key", "x-auth-token", "cookie"])
def test_per_caller_entries_are_keyed_by_every_credential_field(start_proxy, upstream, field):
    """Unless shared, entries are per the credentials a caller sends upstream: another
    key (or none) from the same address never reads them."""
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        got = [c.post(url, json=_body({}), headers=h)
               for h in ({field: "k1"}, {field: "k2"}, {}, {field: "k1"})]
    assert _marks(got) == ["miss", "miss", "miss", "hit"]


def test_shared_entries_behind_auth_need_no_permission(start_proxy, upstream):
    """With [auth] the proxy takes the caller's Authorization itself (it never goes
    upstream): sharing among authenticated callers is the operator's choice."""
    from aiproxy.governance.auth import hash_key

    proxy = _proxy(start_proxy, upstream.port, "shared = true\n\n" + f"""
[auth]
[[auth.api_keys]]
id = "ka"
subject = "alice"
hash = "{hash_key("key-a")}"

[[auth.api_keys]]
id = "kb"
subject = "bob"
hash = "{hash_key("key-b")}"
""")
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        rs = [c.post(url, json=_body({}), headers={"authorization": f"Bearer key-{who}"})
              for who in "ab"]
    assert [r.status_code for r in rs] == [200, 200] and _marks(rs) == ["miss", "hit"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_body_that_ends_with_the_connection_is_not_stored(start_proxy, upstream, stream):
    """Without Content-Length or chunked framing an HTTP/1.1 body ends when the upstream
    closes (RFC 9112 6.3), so a stream cut between two events looks whole: nothing shows
    it is, and a hit would replay the cut answer for the entry's whole life."""
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        for script in ({"frame": "close", "cut": True}, {"frame": "close"}):
            rs = [c.post(url, json=_body(script, stream=stream)) for _ in range(2)]
            assert _marks(rs) == ["miss", "miss"], script
        framed = [c.post(url, json=_body({"frame": "chunked"}, stream=stream))
                  for _ in range(2)]
        assert _marks(framed) == ["miss", "hit"]
    assert upstream.calls == 5


def test_a_hit_replays_no_hop_by_hop_field(start_proxy, upstream):
    """RFC 9111 3.1: Connection and the fields it names, and the Proxy-* fields, are not
    stored; other fields are (a hit is the same answer)."""
    proxy = _proxy(start_proxy, upstream.port)
    url = f"{proxy.url}/v1/chat/completions"
    script = {"h": [["Connection", "x-hop"], ["X-Hop", "1"], ["Keep-Alive", "timeout=5"],
                    ["Proxy-Authenticate", "Basic"], ["Proxy-Authentication-Info", "a"],
                    ["X-Kept", "2"]], "frame": "chunked"}
    with httpx.Client() as c:
        miss, hit = _twice(c, url, script)
    assert _marks([miss, hit]) == ["miss", "hit"]
    for name in ("x-hop", "keep-alive", "proxy-authenticate", "proxy-authentication-info"):
        assert name not in hit.headers, name
    assert hit.headers["x-kept"] == "2"


@pytest.mark.parametrize(("fields", "stored"), [
    ([["Cache-Control", "no-cache, must-revalidate"]], True),
    ([["Cache-Control", "private, max-age=0"]], True),
    (_dated(-60), True),
    ([["Cache-Control", "no-store"]], False),
    ([["Cache-Control", "max-age=60"], ["Set-Cookie", "a=1"]], False),
], ids=["no-cache", "private max-age=0", "Expires past", "no-store", "Set-Cookie"])
def test_ignore_upstream_cache_control(start_proxy, upstream, fields, stored):
    """nginx's proxy_ignore_headers Cache-Control Expires: the upstream's lifetime,
    no-cache and private are not read and entries live ttl_ms; no-store and Set-Cookie
    still keep a response out."""
    proxy = _proxy(start_proxy, upstream.port, "ignore_upstream_cache_control = true")
    url = f"{proxy.url}/v1/chat/completions"
    with httpx.Client() as c:
        rs = _twice(c, url, {"h": fields})
    assert _marks(rs) == (["miss", "hit"] if stored else ["miss", "miss"])
    assert (_id(rs[0]) == _id(rs[1])) == stored


@pytest.mark.parametrize(("fields", "want"), [
    # RFC 9111 5.2: a quoted argument's commas do not separate directives, so the
    # field name list of a qualified private cannot smuggle in a `public`.
    (b'Cache-Control: max-age=5, private="set-cookie, public"\r\n',
     {b"max-age": b"5", b"private": b"set-cookie, public"}),
    (b'Cache-Control: no-cache="a\\"b", S-MAXAGE=7\r\nCache-Control: foo, max-age=9\r\n',
     {b"no-cache": b'a"b', b"s-maxage": b"7", b"foo": b"", b"max-age": b"9"}),
    (b"Cache-Control: ,,no-store,\r\n", {b"no-store": b""}),
    (b"Pragma: no-cache\r\n", {b"no-cache": b""}),
])
def test_cache_control_directives_are_read_as_rfc_9111_lists(fields, want):
    from aiproxy._fast.h1 import parse_request

    from aiproxy.cache.prompt import _directives

    head = parse_request(b"GET / HTTP/1.1\r\nHost: a\r\n" + fields + b"\r\n")
    assert _directives(head) == want
