"""Operations: admin API, Prometheus metrics, access log, reload, sd_notify."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from aiproxy.governance.auth import hash_key
from tests.conftest import simple_config
from tests.support import (
    admin_block,
    free_port,
    raw_exchange,
    scrape,
    start_process,
    stop_process,
    wait_port,
)


@pytest.mark.parametrize("workers", ["1", '"auto"'])
def test_metrics_count_traffic_and_parse(start_proxy, demo_upstream, workers):
    """One process reads its own counters; with workers the supervisor sums theirs: the
    same names, labels and numbers either way."""
    admin = free_port()
    body = (f"[server]\nworkers = {workers}\n" + simple_config(demo_upstream)
            + admin_block(admin)) + """
[[routes]]
name = "never"
match = { path_prefix = "/" }
cluster = "up"
"""
    proxy = start_proxy(body)
    wait_port("127.0.0.1", admin)
    with httpx.Client(base_url=proxy.url) as client:
        for _ in range(5):
            assert client.get("/echo").status_code == 200
        for _ in range(2):
            assert client.get("/status/404").status_code == 404
        assert client.post("/echo", content=b"x" * 1000).status_code == 200
    samples = scrape(admin)
    key = ("aiproxy_requests_total", (("cluster", "up"), ("outcome", "complete"), ("route", "all"),
                                      ("status", "200")))
    assert samples[key] == 6
    key404 = ("aiproxy_requests_total", (("cluster", "up"), ("outcome", "complete"), ("route", "all"),
                                         ("status", "404")))
    assert samples[key404] == 2
    assert samples[("aiproxy_request_bytes_total", ())] == 1000
    assert samples[("aiproxy_stage_total_seconds_count", ())] == 8
    assert samples[("aiproxy_stage_upstream_ttfb_seconds_count", ())] == 8
    opened = samples[("aiproxy_upstream_connections_opened_total",
                      (("cluster", "up"), ("endpoint", f"127.0.0.1:{demo_upstream}")))]
    assert 1 <= opened < 8  # keep-alive reuse
    health = httpx.get(f"http://127.0.0.1:{admin}/healthz")
    assert health.status_code == 200
    ready = httpx.get(f"http://127.0.0.1:{admin}/readyz").json()
    assert ready == {"ready": True}
    clusters = httpx.get(f"http://127.0.0.1:{admin}/clusters").json()
    assert clusters[0]["name"] == "up"
    routes = httpx.get(f"http://127.0.0.1:{admin}/config/routes").json()
    assert [r["name"] for r in routes] == ["all", "never"]


def test_admin_token_and_redacted_config(start_proxy, demo_upstream):
    admin = free_port()
    proxy = start_proxy(simple_config(demo_upstream) + admin_block(admin, "s3cret"))
    wait_port("127.0.0.1", admin)
    base = f"http://127.0.0.1:{admin}"
    denied = httpx.get(base + "/metrics")
    assert denied.status_code == 401
    assert denied.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(base + "/healthz").status_code == 200
    cfg = httpx.get(base + "/config", headers={"Authorization": "Bearer s3cret"}).json()
    assert cfg["admin"]["token"] == "<redacted>"
    assert "s3cret" not in json.dumps(cfg)
    assert cfg["clusters"][0]["name"] == "up"
    assert proxy.proc.poll() is None


def test_admin_token_scheme_name_is_case_insensitive(start_proxy, demo_upstream):
    """RFC 9110 11.1: the auth scheme is a case-insensitive token, so `bearer TOKEN`
    (as some clients and proxies write it) is the token; anything else still is not."""
    admin = free_port()
    start_proxy(simple_config(demo_upstream) + admin_block(admin, "s3cret"))
    wait_port("127.0.0.1", admin)
    base = f"http://127.0.0.1:{admin}"
    for good in ("Bearer s3cret", "bearer s3cret", "BEARER s3cret", "Bearer  s3cret"):
        r = httpx.get(base + "/config", headers={"Authorization": good})
        assert r.status_code == 200, (good, r.text)
    for bad in ("Bearer s3cre", "Basic s3cret", "Bearers3cret", "s3cret", "Bearer",
                "Bearer s3cret x", "Bearer S3CRET"):
        r = httpx.get(base + "/config", headers={"Authorization": bad})
        assert r.status_code == 401, (bad, r.text)


def test_admin_token_that_is_not_utf8_is_refused_not_a_crash(start_proxy, demo_upstream):
    """An Authorization field with bytes that are not UTF-8 is a wrong token: 401,
    every time, with no traceback in the log."""
    admin = free_port()
    proxy = start_proxy(simple_config(demo_upstream) + admin_block(admin, "s3cret"))
    wait_port("127.0.0.1", admin)
    request = (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Authorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n")
    for _ in range(2):
        answer = raw_exchange(admin, request)
        assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert "Traceback" not in proxy.log(), proxy.log()


def test_admin_unknown_path_and_method_answer_json_errors(start_proxy, demo_upstream):
    """404 and 405 come in the admin API's JSON error shape, as its other errors do,
    not aiohttp's plain text; a 405 names the allowed methods in Allow."""
    admin = free_port()
    start_proxy(simple_config(demo_upstream) + admin_block(admin))
    wait_port("127.0.0.1", admin)
    base = f"http://127.0.0.1:{admin}"
    r = httpx.get(f"{base}/nope")
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "not_found"
    r = httpx.post(f"{base}/healthz")
    assert r.status_code == 405
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "method_not_allowed"
    assert set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}
    r = httpx.get(f"{base}/config/reload")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    assert r.json()["error"]["message"] == "GET is not allowed here (allowed: POST)"


def test_admin_refuses_cross_site_browser_posts(start_proxy, demo_upstream):
    """Without [admin] token, a page the operator visits could make the browser POST to
    the loopback admin port: a "simple" request (text/plain, a form) needs no CORS
    preflight, so it would reload the config (CSRF). A browser says where a request
    comes from (Sec-Fetch-Site, Origin): one from another origin, the proxy's own
    listener included, is refused. curl and other clients, which send neither, are not."""
    admin = free_port()
    proxy = start_proxy(simple_config(demo_upstream) + admin_block(admin))
    wait_port("127.0.0.1", admin)
    url = f"http://127.0.0.1:{admin}/config/reload"
    own = f"http://127.0.0.1:{admin}"
    cross = [
        {"Origin": "https://evil.example", "Content-Type": "text/plain"},
        {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"},
        {"Sec-Fetch-Site": "same-site", "Origin": proxy.url,
         "Content-Type": "application/x-www-form-urlencoded"},
        {"Origin": "null"},  # a sandboxed frame, a redirect across origins
        {"Sec-Fetch-Site": "cross-site", "Origin": own},  # Sec-Fetch-Site decides
    ]
    for headers in cross:
        r = httpx.post(url, headers=headers, content=b"x=1")
        assert r.status_code == 403, (headers, r.status_code, r.text)
        assert r.json()["error"]["code"] == "cross_origin"
    assert scrape(admin).get(("aiproxy_config_reloads_total", ()), 0) == 0
    allowed = [
        {},
        {"Sec-Fetch-Site": "same-origin", "Origin": own},
        {"Sec-Fetch-Site": "none"},
        {"Origin": own},
    ]
    for headers in allowed:
        r = httpx.post(url, headers=headers)
        assert r.status_code == 200, (headers, r.status_code, r.text)
    out = subprocess.run(["curl", "-sS", "-X", "POST", url], capture_output=True, text=True,
                         timeout=30, check=True)
    assert json.loads(out.stdout)["reloaded"] is True
    assert scrape(admin)[("aiproxy_config_reloads_total", ())] == len(allowed) + 1
    # reads are the browser's same-origin policy's to keep; a state change wants POST
    cross_read = httpx.get(f"{own}/metrics", headers={"Sec-Fetch-Site": "cross-site"})
    assert cross_read.status_code == 200
    for method in ("GET", "HEAD"):
        r = httpx.request(method, url)
        assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_admin_on_loopback_answers_loopback_host_names_only(start_proxy, demo_upstream):
    """DNS rebinding: a page on a name its owner points at 127.0.0.1 is same-origin with
    the loopback admin port, so the browser would let it read /config and POST a reload
    (no Origin check helps: it is the same origin). Its requests name it in Host; on
    loopback the admin API answers loopback names only."""
    admin = free_port()
    start_proxy(simple_config(demo_upstream) + admin_block(admin))
    wait_port("127.0.0.1", admin)
    base = f"http://127.0.0.1:{admin}"
    for host in ("rebind.attacker.example", f"rebind.attacker.example:{admin}",
                 "10.1.2.3", f"[2001:db8::1]:{admin}"):
        for method, path in (("GET", "/config"), ("GET", "/metrics"),
                             ("POST", "/config/reload")):
            r = httpx.request(method, base + path, headers={"Host": host})
            assert r.status_code == 403, (host, path, r.status_code)
            assert r.json()["error"]["code"] == "unknown_host"
    for host in (f"127.0.0.1:{admin}", "localhost", f"LOCALHOST:{admin}", "[::1]",
                 "metrics.localhost"):
        assert httpx.get(base + "/metrics", headers={"Host": host}).status_code == 200, host
    out = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}",
                          f"http://localhost:{admin}/config"], capture_output=True,
                         text=True, timeout=30)
    assert out.stdout == "200", out


def test_malformed_admin_requests_get_400_and_one_log_line(start_proxy, demo_upstream):
    """A request aiohttp's parser refuses is the client's error: 400, and one line in
    the log (as the listeners' h2 does), not a traceback per request that anyone able to
    reach the port can fill the log with."""
    admin = free_port()
    proxy = start_proxy(simple_config(demo_upstream) + admin_block(admin))
    wait_port("127.0.0.1", admin)
    bad = [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"GET /\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
        b"POST /config/reload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ]
    for request in bad:
        answer = raw_exchange(admin, request)
        assert answer.startswith(b"HTTP/1.0 400 ") or answer.startswith(b"HTTP/1.1 400 "), (
            request, answer[:100])
    assert httpx.get(f"http://127.0.0.1:{admin}/healthz").status_code == 200
    log = proxy.log()
    assert "Traceback" not in log, log
    lines = [x for x in log.splitlines() if "aiproxy.admin: bad request from 127.0.0.1: 400 " in x]
    assert len(lines) == len(bad), log


def test_config_view_hides_url_passwords():
    """GET /config shows the effective config without secrets: a Redis URL's password
    too, wherever the URL is."""
    from aiproxy.admin.server import effective_config
    from aiproxy.config.loader import load_config_text

    text = '[[listeners]]\nname = "l"\naddress = "127.0.0.1:1"\n' + simple_config(2) + """
[[ratelimits]]
name = "shared"
requests_per_second = 10
backend = "redis"
redis_url = "redis://:hunter2@127.0.0.1:6379/0"

[cache]
backend = "redis"
redis_url = "rediss://cacheuser:pa%40ss@cache.internal:6380/1"
"""
    view = json.dumps(effective_config(load_config_text(text, "t.toml")))
    assert "hunter2" not in view and "pa%40ss" not in view
    assert "redis://:<redacted>@127.0.0.1:6379/0" in view
    assert "rediss://cacheuser:<redacted>@cache.internal:6380/1" in view


def test_config_view_hides_credential_header_values(start_proxy, demo_upstream):
    """An upstream key a route injects (request_headers_add, as gateways to OpenAI,
    Anthropic or Azure do) is a secret like [admin] token: GET /config and
    /config/routes show the field, never its value."""
    admin = free_port()
    proxy = start_proxy(f"""
[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{demo_upstream}"]

[[routes]]
name = "all"
match = {{ path_prefix = "/", headers = {{ "Authorization" = "Bearer MATCH-SECRET" }} }}
cluster = "up"
request_headers_add = {{ Authorization = "Bearer sk-UPSTREAM-SECRET", "x-api-key" = "KEY-SECRET", "x-team" = "blue" }}
response_headers_add = {{ "set-cookie" = "sid=COOKIE-SECRET" }}
request_headers_remove = ["authorization", "cookie"]
""" + admin_block(admin))
    wait_port("127.0.0.1", admin)
    r = httpx.get(proxy.url + "/echo", headers={"Authorization": "Bearer MATCH-SECRET"})
    assert r.json()["headers"]["x-api-key"] == "KEY-SECRET"  # still sent upstream
    for path in ("/config", "/config/routes"):
        view = httpx.get(f"http://127.0.0.1:{admin}{path}").text
        assert "SECRET" not in view, (path, view)
    route = httpx.get(f"http://127.0.0.1:{admin}/config").json()["routes"][0]
    assert route["request_headers_add"] == [["authorization", "<redacted>"],
                                            ["x-api-key", "<redacted>"], ["x-team", "blue"]]
    assert route["request_headers_remove"] == ["authorization", "cookie"]


def test_config_view_hides_whatever_looks_like_a_secret(start_proxy, demo_upstream):
    """GET /config hides the value of any name that looks like a secret (a header or
    query parameter named *token*, *secret*, *password*, *api_key*, *_key, ...), not
    only the known credential fields, and every URL's password (one with an "@" in it
    too); names that merely look alike (tokens_per_minute, hash_key, api_key_header) or
    say where a secret is or how long it lasts (*_file, *_path, *_ttl) keep their values."""
    admin = free_port()
    start_proxy(f"""
[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{demo_upstream}"]
balancer = "ring_hash"
hash_key = "header:x-user"

[[routes]]
name = "all"
match = {{ path_prefix = "/", query = {{ api_key = "Q-SECRET", page = "1" }}, headers = {{ "X-Client-Secret" = "H-SECRET" }} }}
cluster = "up"
request_headers_add = {{ "X-Service-Token" = "T-SECRET", "X-DB-Password" = "P-SECRET", "X-Signing-Key" = "K-SECRET", "X-Team" = "blue", "X-Private-Key" = "PK-SECRET", "X-Token-TTL" = "3600", "X-Private-Key-File" = "/etc/keys/signing.pem", "X-Secret-Path" = "/run/secrets/db" }}

[[ratelimits]]
name = "shared"
tokens_per_minute = 1000
backend = "redis"
redis_url = "redis://u:p@ss-SECRET@127.0.0.1:1/0"
""" + admin_block(admin))
    wait_port("127.0.0.1", admin)
    view = httpx.get(f"http://127.0.0.1:{admin}/config").json()
    assert "SECRET" not in json.dumps(view), view
    route = view["routes"][0]
    # ... but a name that says where a secret is or how long it lasts keeps its value
    assert route["request_headers_add"] == [
        ["x-service-token", "<redacted>"], ["x-db-password", "<redacted>"],
        ["x-signing-key", "<redacted>"], ["x-team", "blue"], ["x-private-key", "<redacted>"],
        ["x-token-ttl", "3600"], ["x-private-key-file", "/etc/keys/signing.pem"],
        ["x-secret-path", "/run/secrets/db"]]
    assert ["page", "1"] in route["match"]["query"]
    assert view["ratelimits"][0]["redis_url"] == "redis://u:<redacted>@127.0.0.1:1/0"
    assert view["ratelimits"][0]["tokens_per_minute"] == 1000
    assert view["clusters"][0]["hash_key"] == "header:x-user"
    assert view["ratelimits"][0]["on_backend_error"] == "open"



def test_config_view_hides_signed_query_and_field_secrets(start_proxy, demo_upstream):
    """The suffixes that mark a config key as about a secret (timeout_s, api_key_header)
    say nothing of a header field or query parameter: X-Api-Key-S and X-Api-Key-Header
    are hidden. So are a signed URL's parameters (X-Amz-Signature, sig, ...) and an API
    key's (Google's ?key=) in a match table or in a path's query (a redirect's, a health
    check's)."""
    admin = free_port()
    start_proxy(f"""
[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{demo_upstream}"]
health_check = {{ path = "/healthz?access_token=HC-SECRET&probe=1&key=HK-SECRET", interval_ms = 60000 }}

[[routes]]
name = "signed"
match = {{ path_prefix = "/s", query = {{ "X-Amz-Signature" = "AS-SECRET", "X-Amz-Credential" = "AC-SECRET", "X-Amz-Security-Token" = "AT-SECRET", sig = "SG-SECRET", signature = "SN-SECRET", token = "TK-SECRET", access_token = "AX-SECRET", key = "KY-SECRET", page = "1" }}, headers = {{ "X-Api-Key-S" = "HS-SECRET" }} }}
redirect = {{ host = "bucket.example", path = "/obj?X-Amz-Date=20260101T000000Z&X-Amz-Signature=RS-SECRET&sig=RG-SECRET" }}

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
request_headers_add = {{ "X-Api-Key-Header" = "KH-SECRET", "X-Token-S" = "TS-SECRET", "X-Token-TTL" = "3600" }}

[auth]
api_key_header = "x-client-key"

[[auth.api_keys]]
id = "k1"
subject = "ci"
hash = "{hash_key("client-key")}"
""" + admin_block(admin))
    wait_port("127.0.0.1", admin)
    for path in ("/config", "/config/routes"):
        view = httpx.get(f"http://127.0.0.1:{admin}{path}").text
        assert "SECRET" not in view, (path, view)
    view = httpx.get(f"http://127.0.0.1:{admin}/config").json()
    signed, rest = view["routes"]
    assert ["page", "1"] in signed["match"]["query"]
    assert signed["match"]["headers"] == [["x-api-key-s", "<redacted>"]]
    assert signed["redirect"]["path"] == \
        "/obj?X-Amz-Date=20260101T000000Z&X-Amz-Signature=<redacted>&sig=<redacted>"
    assert view["clusters"][0]["health_check"]["path"] == \
        "/healthz?access_token=<redacted>&probe=1&key=<redacted>"
    assert rest["request_headers_add"] == [["x-api-key-header", "<redacted>"],
                                           ["x-token-s", "<redacted>"], ["x-token-ttl", "3600"]]
    # The config keys keep their exceptions.
    assert view["auth"]["api_key_header"] == "x-client-key"
    assert view["clusters"][0]["health_check"]["interval_ms"] == 60000

def test_reload_under_load_drops_nothing(start_proxy, demo_upstream):
    admin = free_port()
    base_cfg = simple_config(demo_upstream) + admin_block(admin)
    # Without the extra route /x/echo reaches the demo upstream as is (its 404); with it,
    # rewritten to /echo (200): which config answered shows in the status. It goes before
    # the catch-all: routes are tried in order.
    catch_all = '[[routes]]\nname = "all"\n'
    flip = base_cfg.replace(catch_all, """[[routes]]
name = "extra"
match = { path_prefix = "/x/" }
prefix_rewrite = "/"
cluster = "up"

""" + catch_all, 1)
    assert flip != base_cfg
    proxy = start_proxy(base_cfg)
    wait_port("127.0.0.1", admin)
    original = proxy.config_path.read_text()
    prefix = original[:original.index(base_cfg)]
    results: list[int] = []
    errors: list[str] = []

    async def load(stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
            while not stop.is_set():
                try:
                    r = await client.get("/echo")
                    results.append(r.status_code)
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))

    async def flips() -> None:
        stop = asyncio.Event()
        workers = [asyncio.create_task(load(stop)) for _ in range(8)]
        async with httpx.AsyncClient(timeout=10) as admin_client:
            for i in range(20):
                proxy.config_path.write_text(prefix + (flip if i % 2 == 0 else base_cfg))
                r = await admin_client.post(f"http://127.0.0.1:{admin}/config/reload")
                assert r.status_code == 200, r.text
                # the config just loaded answers right after the reload returns
                async with httpx.AsyncClient(base_url=proxy.url) as c:
                    resp = await c.get("/x/echo")
                assert resp.status_code == (200 if i % 2 == 0 else 404), (i, resp.text)
                await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*workers)

    asyncio.run(flips())
    assert not errors, errors[:3]
    assert results and set(results) == {200}, set(results)
    samples = scrape(admin)
    assert samples[("aiproxy_config_reloads_total", ())] == 20


@pytest.mark.parametrize("workers", ["1", "2"])
def test_reload_says_what_waits_for_a_restart(start_proxy, demo_upstream, workers):
    """A new admin token applies at once; a new listener address only on restart. The
    reload's answer says which is which, and /config shows the address still bound and
    lists the change that waits; a reload back to it clears the list. An [admin] section
    removed leaves the API serving with its token until the restart."""
    admin = free_port()
    proxy = start_proxy(f"[server]\nworkers = {workers}\n" + simple_config(demo_upstream)
                        + admin_block(admin, "old-token"))
    wait_port("127.0.0.1", admin)
    base = f"http://127.0.0.1:{admin}"
    old, new = {"Authorization": "Bearer old-token"}, {"Authorization": "Bearer new-token"}
    first = proxy.config_path.read_text()
    bound = f"127.0.0.1:{proxy.port}"
    moved = f"127.0.0.1:{free_port()}"
    assert bound in first
    proxy.config_path.write_text(first.replace(bound, moved).replace("old-token", "new-token"))
    r = httpx.post(base + "/config/reload", headers=old)
    assert r.status_code == 200, r.text
    message = r.json()["message"]
    assert "listeners.test" in message and moved in message and bound in message, message
    assert "admin" not in message, message  # the token is no restart's business
    assert httpx.get(base + "/config", headers=old).status_code == 401
    view = httpx.get(base + "/config", headers=new).json()
    assert view["listeners"][0]["address"] == bound
    [pending] = view["pending_restart"]
    assert "listeners.test" in pending and moved in pending, pending
    assert httpx.get(proxy.url + "/echo").status_code == 200  # still on the bound port

    # SIGHUP back to the bound address: nothing waits any more
    proxy.config_path.write_text(first.replace("old-token", "new-token"))
    proxy.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while httpx.get(base + "/config", headers=new).json()["pending_restart"]:
        assert time.monotonic() < deadline, proxy.log()
        time.sleep(0.05)

    # no [admin] any more: the API still serves until a restart, and still wants a token
    proxy.config_path.write_text(first.split("[admin]")[0])
    r = httpx.post(base + "/config/reload", headers=new)
    assert r.status_code == 200, r.text
    assert "admin" in r.json()["message"]
    assert httpx.get(base + "/config").status_code == 401
    view = httpx.get(base + "/config", headers=new).json()
    assert view["admin"]["address"] == f"127.0.0.1:{admin}"
    assert view["admin"]["token"] == "<redacted>"
    assert len(view["pending_restart"]) == 1 and "admin" in view["pending_restart"][0]


def test_bad_reload_keeps_running_config(start_proxy, demo_upstream):
    admin = free_port()
    proxy = start_proxy(simple_config(demo_upstream) + admin_block(admin))
    wait_port("127.0.0.1", admin)
    good = proxy.config_path.read_text()
    proxy.config_path.write_text(good + "\n[[routes]]\nname = \"bad\"\ncluster = \"nope\"\n")
    r = httpx.post(f"http://127.0.0.1:{admin}/config/reload")
    assert r.status_code == 400
    assert "unknown cluster 'nope'" in r.json()["error"]["message"]
    assert httpx.get(proxy.url + "/echo").status_code == 200
    proxy.proc.send_signal(signal.SIGHUP)  # same bad file through the signal path
    time.sleep(0.5)
    assert httpx.get(proxy.url + "/echo").status_code == 200
    samples = scrape(admin)
    assert samples[("aiproxy_config_reload_failures_total", ())] == 2
    assert samples[("aiproxy_config_last_reload_success", ())] == 0


def test_access_log_lines_and_reopen(start_proxy, demo_upstream, tmp_path: Path):
    log = tmp_path / "access.log"
    proxy = start_proxy(simple_config(demo_upstream, http="server_timing = true")
                        + f'\n[access_log]\npath = "{log}"\nflush_interval_ms = 20\n')
    r = httpx.get(proxy.url + "/echo?q=1", headers={
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    assert r.status_code == 200
    assert "upstream_ttfb;dur=" in r.headers["server-timing"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (not log.exists() or not log.read_text()):
        time.sleep(0.05)
    record = json.loads(log.read_text().splitlines()[0])
    assert record["method"] == "GET" and record["path"] == "/echo" and record["status"] == 200
    assert record["route"] == "all" and record["cluster"] == "up"
    assert record["endpoint"] == f"127.0.0.1:{demo_upstream}"
    assert record["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert record["bytes_out"] == len(r.content)
    assert "upstream_ttfb" in record["timings_ms"]
    rotated = tmp_path / "access.log.1"
    log.rename(rotated)
    proxy.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not log.exists():  # the reopen creates it
        time.sleep(0.02)
    httpx.get(proxy.url + "/echo")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (not log.exists() or not log.read_text()):
        time.sleep(0.05)
    assert len(log.read_text().splitlines()) == 1
    assert len(rotated.read_text().splitlines()) == 1


def test_sd_notify_sequence(tmp_path: Path, demo_upstream):
    notify_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.settimeout(10)
    port = free_port()
    cfg = tmp_path / "a.toml"
    # one process here; tests/test_workers.py has the supervisor's sequence
    cfg.write_text('[server]\nworkers = 1\n'
                   f'[[listeners]]\nname = "l"\naddress = "127.0.0.1:{port}"\n'
                   + simple_config(demo_upstream))
    proc = start_process([sys.executable, "-m", "aiproxy", "-c", str(cfg)],
                         env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "400000",
                              "WATCHDOG_PID": ""})
    try:
        messages = []

        def expect(prefix: str) -> None:
            while True:
                msg = sock.recv(4096).decode()
                messages.append(msg)
                if msg.startswith(prefix):
                    return

        expect("READY=1")
        wait_port("127.0.0.1", port)  # READY came after the listener was bound
        expect("WATCHDOG=1")
        proc.send_signal(signal.SIGHUP)
        expect("RELOADING=1")
        assert "MONOTONIC_USEC=" in messages[-1]
        expect("READY=1")
        proc.send_signal(signal.SIGTERM)
        expect("STOPPING=1")
        assert proc.wait(10) == 0
        order = [m.split("\n")[0] for m in messages if not m.startswith("WATCHDOG")]
        assert order == ["READY=1", "RELOADING=1", "READY=1", "STOPPING=1"]
    finally:
        stop_process(proc)
        sock.close()
        os.unlink(notify_path)


def test_route_flips_under_load_take_effect_at_once(start_proxy, demo_upstream, demo_upstream_b):
    """20 reloads that move /x between two clusters (and add/remove a split route) while
    8 clients run at full speed: no request fails, and the first request after each
    reload returns already sees the new route (the lag, one request's time, is printed)."""
    admin = free_port()

    def config(i: int) -> str:
        target = "b" if i % 2 == 0 else "a"
        extra = ('\n[[routes]]\nname = "split"\nmatch = { path_prefix = "/echo/s" }\n'
                 'split = [{ cluster = "a", weight = 50 }, { cluster = "b", weight = 50 }]\n'
                 if i % 2 == 0 else "")
        return f"""
[[clusters]]
name = "a"
endpoints = ["127.0.0.1:{demo_upstream}"]
balancer = "{"least_request" if i % 2 else "round_robin"}"

[[clusters]]
name = "b"
endpoints = ["127.0.0.1:{demo_upstream_b}"]

[[routes]]
name = "x"
match = {{ path_prefix = "/echo/x" }}
cluster = "{target}"
{extra}
[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "a"
""" + admin_block(admin)

    proxy = start_proxy(config(1))
    wait_port("127.0.0.1", admin)
    prefix = proxy.config_path.read_text()[: -len(config(1))]
    results: list[int] = []
    errors: list[str] = []
    probes: list[int] = []

    async def load(stop: asyncio.Event, path: str) -> None:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
            while not stop.is_set():
                try:
                    r = await client.get(path)
                    results.append(r.status_code)
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))

    async def flips() -> list[float]:
        stop = asyncio.Event()
        workers = [asyncio.create_task(load(stop, "/echo" if n % 2 else "/echo/x"))
                   for n in range(8)]
        lags = []
        async with httpx.AsyncClient(timeout=10) as admin_client, \
                httpx.AsyncClient(base_url=proxy.url, timeout=10) as probe:
            for i in range(20):
                want = "demo-b" if i % 2 == 0 else "demo-a"
                proxy.config_path.write_text(prefix + config(i))
                r = await admin_client.post(f"http://127.0.0.1:{admin}/config/reload")
                assert r.status_code == 200, r.text
                done = time.monotonic()
                tries = 0
                while True:
                    tries += 1
                    resp = await probe.get("/echo/x")
                    assert resp.status_code == 200
                    if resp.headers["x-upstream"] == want:
                        break
                    assert time.monotonic() - done < 1, "new route never answered"
                lags.append(time.monotonic() - done)
                probes.append(tries)
                s = await probe.get("/echo/s")
                assert s.status_code == 200  # the split route, or "all" when it is gone
                await asyncio.sleep(0.03)
        stop.set()
        await asyncio.gather(*workers)
        return lags

    lags = asyncio.run(flips())
    assert not errors, errors[:3]
    assert results and set(results) == {200}, collections.Counter(results)
    print(f"route flip lag after reload: max {max(lags) * 1000:.1f} ms, probes {probes}")
    assert set(probes) == {1}  # the very first request after the reload saw the new route
    samples = scrape(admin)
    assert samples[("aiproxy_config_reloads_total", ())] == 20


@pytest.mark.parametrize("workers", ["1", "2"])
def test_access_log_path_waits_for_a_restart(start_proxy, demo_upstream, tmp_path, workers):
    """The access log is opened at start: a reload to another path keeps writing the
    first file, and the reload's answer and /config say the new path waits."""
    admin = free_port()
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    proxy = start_proxy(f"[server]\nworkers = {workers}\n" + simple_config(demo_upstream)
                        + admin_block(admin) + f'\n[access_log]\npath = "{first}"\n')
    wait_port("127.0.0.1", admin)
    base = f"http://127.0.0.1:{admin}"
    proxy.config_path.write_text(proxy.config_path.read_text().replace(str(first), str(second)))
    r = httpx.post(base + "/config/reload")
    assert r.status_code == 200, r.text
    assert f"access_log.path: {second} (serving {first})" in r.json()["message"], r.text
    view = httpx.get(base + "/config").json()
    assert view["access_log"]["path"] == str(first)
    assert view["pending_restart"] == [f"access_log.path: {second} (serving {first})"]
    assert httpx.get(proxy.url + "/echo", headers={"x-mark": "after"}).status_code == 200
    deadline = time.monotonic() + 10
    while '"/echo"' not in (first.read_text() if first.exists() else ""):
        assert time.monotonic() < deadline, proxy.log()
        time.sleep(0.05)
    assert not second.exists()
