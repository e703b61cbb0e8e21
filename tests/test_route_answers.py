"""Routes the proxy answers itself: `redirect = {...}` (nginx `return 301 ...`, Envoy's
redirect action) and `direct_response = {...}` (nginx `return 403 "..."`, Envoy's
direct_response), over HTTP/1.1, h2c and TLS, with real clients (curl, httpx)."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aiproxy.config.address import split_authority
from aiproxy.config.schema import Redirect
from aiproxy.governance.auth import hash_key
from aiproxy.pipeline.redirect import location
from tests.h2_support import ProxyProc, make_pki, wait_for
from tests.support import aiproxy_cli, free_port, raw_exchange, wait_port

pytestmark = pytest.mark.timeout(60)

CONFIG = """
[[listeners]]
name = "plain"
address = "127.0.0.1:{plain}"
protocols = ["http1", "h2c"]

[[listeners]]
name = "tls"
address = "127.0.0.1:{tls}"
protocols = ["h2", "http1"]
tls = { cert = "%(cert)s", key = "%(key)s" }

[access_log]
path = "%(log)s"
flush_interval_ms = 20

[[clusters]]
name = "demo"
endpoints = ["127.0.0.1:%(demo)d"]

[[routes]]
name = "to-tls"
match = { host = "insecure.test" }
redirect = { scheme = "https" }

[[routes]]
name = "moved"
match = { path_prefix = "/v0/" }
redirect = { prefix_rewrite = "/v1/", status = 308 }

[[routes]]
name = "elsewhere"
match = { path = "/docs" }
redirect = { host = "docs.example.com", path = "/start?from=proxy", status = 302 }

[[routes]]
name = "other-port"
match = { path = "/port" }
redirect = { port = %(tls_port)d, scheme = "https", path = "/echo/landing", strip_query = true }

[[routes]]
name = "deny"
match = { path_prefix = "/admin" }
direct_response = { status = 403, body = "forbidden here\\n" }
response_headers_add = { cache-control = "no-store" }

[[routes]]
name = "health"
match = { path = "/healthz" }
direct_response = { status = 200, body = '{"ok": true}', content_type = "application/json" }

[[routes]]
name = "gone"
match = { path = "/gone" }
direct_response = { status = 204 }

[[routes]]
name = "limited"
match = { path = "/limited" }
direct_response = { status = 200, body = "ok" }

[[ratelimits]]
name = "few"
routes = ["limited"]
key = ["route"]
requests_per_second = 1
burst_requests = 1

[[routes]]
name = "rest"
cluster = "demo"
"""


@pytest.fixture(scope="module")
def env(demo_upstream: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("route-answers")
    pki = make_pki(tmp / "pki")
    log = tmp / "access.log"
    # The TLS listener's port is in the config twice (its listener, a redirect to it).
    tls_port = free_port()
    text = CONFIG.replace("{tls}", str(tls_port)) % {
        "cert": pki.cert, "key": pki.key, "log": log, "demo": demo_upstream,
        "tls_port": tls_port}
    proxy = ProxyProc(tmp, text, ("plain",))
    wait_port("127.0.0.1", tls_port, proc=proxy.proc)
    yield {"proxy": proxy, "plain": f"http://127.0.0.1:{proxy.ports['plain']}",
           "tls": f"https://127.0.0.1:{tls_port}", "tls_port": tls_port, "ca": pki.ca,
           "log": log}
    proxy.stop()


def curl(*args: str) -> subprocess.CompletedProcess:
    """curl's output as str with its CRLFs kept (text mode would make them LF)."""
    r = subprocess.run(["curl", "-sS", "--max-time", "10", *args], capture_output=True,
                       check=False)
    r.stdout, r.stderr = r.stdout.decode("latin-1"), r.stderr.decode("latin-1")
    return r


def head_of(out: str) -> tuple[int, dict[str, str]]:
    lines = out.split("\r\n\r\n")[0].split("\r\n")
    status = int(lines[0].split()[1])
    return status, {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}


def access_lines(log: Path, route: str) -> list[dict]:
    if not log.exists():
        return []
    return [rec for rec in map(json.loads, log.read_text().splitlines())
            if rec["route"] == route]


# -- redirects ----------------------------------------------------------------------------


def test_http_to_https_keeps_host_path_and_query(env: dict) -> None:
    r = curl("-i", "-H", "Host: insecure.test:8080", env["plain"] + "/a/b?x=1&y=%20z")
    status, fields = head_of(r.stdout)
    assert status == 301
    # The request's port was the http side's: the https URL names none.
    assert fields["location"] == "https://insecure.test/a/b?x=1&y=%20z"
    assert fields["content-length"] == "0"
    assert "via" not in fields  # the proxy's own answer, not a forwarded one


def test_redirect_over_h2c_and_tls_h2(env: dict) -> None:
    with httpx.Client(http1=False, http2=True) as c:
        r = c.get(env["plain"] + "/v0/models?limit=2")
    assert r.http_version == "HTTP/2" and r.status_code == 308
    assert r.headers["location"] == f"{env['plain']}/v1/models?limit=2"
    with httpx.Client(http2=True, verify=ssl.create_default_context(cafile=str(env["ca"]))) as c:
        r = c.get(env["tls"] + "/v0/x")
    assert r.http_version == "HTTP/2" and r.status_code == 308
    assert r.headers["location"] == f"https://127.0.0.1:{env['tls_port']}/v1/x"


def test_curl_follows_a_redirect_to_another_route(env: dict) -> None:
    # /port sends the client to the TLS listener's /echo/landing, query dropped; from
    # there the catch-all route forwards to the demo upstream.
    r = curl("-L", "-i", "--cacert", str(env["ca"]), env["plain"] + "/port?drop=me")
    assert r.returncode == 0, r.stderr
    first, rest = r.stdout.split("\r\n\r\n", 1)
    status, fields = head_of(first + "\r\n\r\n")
    assert status == 301
    assert fields["location"] == f"https://127.0.0.1:{env['tls_port']}/echo/landing"
    status2, fields2 = head_of(rest)
    assert status2 == 200 and fields2["x-upstream"] == "demo-a"
    body = json.loads(rest.split("\r\n\r\n", 1)[1])
    assert body["path"] == "/echo/landing"


def test_redirect_to_another_host_with_its_own_query(env: dict) -> None:
    r = httpx.get(env["plain"] + "/docs?q=1")
    assert r.status_code == 302
    assert r.headers["location"] == "http://docs.example.com/start?from=proxy"


def test_redirect_location_is_built_from_the_normalized_path(env: dict) -> None:
    # Dot segments resolved, %2F decoded ([http] escaped_slashes): what the route
    # matched is what the Location names, with what a URI may not hold escaped.
    raw = raw_exchange(int(env["plain"].rsplit(":", 1)[1]),
                       b"GET /v0/a/../b%2Fc?k={x}|y HTTP/1.1\r\nHost: h.test\r\n"
                       b"Connection: close\r\n\r\n")
    head = raw.split(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 308 ")
    loc = [line[10:] for line in head.split(b"\r\n") if line.lower().startswith(b"location:")]
    assert loc == [b"http://h.test/v1/b/c?k=%7Bx%7D%7Cy"]


def test_head_and_post_get_the_redirect(env: dict) -> None:
    r = httpx.head(env["plain"] + "/v0/x")
    assert r.status_code == 308 and r.headers["location"].endswith("/v1/x")
    # A body the client is still sending is not read: the connection closes after the
    # answer instead of reading it as the next request.
    with socket.create_connection(("127.0.0.1", int(env["plain"].rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v0/upload HTTP/1.1\r\nHost: h.test\r\nContent-Length: 100000\r\n"
                  b"\r\n" + b"x" * 1000)
        s.settimeout(10)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 308 ")
    assert b"\r\nConnection: close\r\n" in got.split(b"\r\n\r\n")[0] + b"\r\n"


# -- direct responses ---------------------------------------------------------------------


def test_direct_response_over_every_protocol(env: dict) -> None:
    r = curl("-i", env["plain"] + "/admin/users")
    status, fields = head_of(r.stdout)
    assert status == 403
    assert fields["content-type"] == "text/plain; charset=utf-8"
    assert fields["cache-control"] == "no-store"  # the route's response_headers_add
    assert r.stdout.endswith("\r\n\r\nforbidden here\n")
    r = curl("-i", "--http2-prior-knowledge", env["plain"] + "/admin")
    assert r.stdout.startswith("HTTP/2 403") and r.stdout.endswith("forbidden here\n")
    with httpx.Client(http2=True, verify=ssl.create_default_context(cafile=str(env["ca"]))) as c:
        r = c.get(env["tls"] + "/healthz")
        assert r.http_version == "HTTP/2"
        assert r.status_code == 200 and r.json() == {"ok": True}
        assert r.headers["content-type"] == "application/json"
        r = c.head(env["tls"] + "/healthz")
        assert r.status_code == 200 and r.content == b""
        assert r.headers["content-length"] == str(len('{"ok": true}'))


def test_no_content_keeps_the_connection(env: dict) -> None:
    port = int(env["plain"].rsplit(":", 1)[1])
    raw = raw_exchange(port, b"GET /gone HTTP/1.1\r\nHost: h\r\n\r\n"
                             b"GET /healthz HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    first, _, rest = raw.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 204 ")
    assert b"content-length" not in first.lower()
    assert rest.startswith(b"HTTP/1.1 200 ") and rest.endswith(b'{"ok": true}')


def test_rate_limits_apply_to_a_direct_route(env: dict) -> None:
    with httpx.Client() as c:
        codes = [c.get(env["plain"] + "/limited").status_code for _ in range(3)]
    assert codes[0] == 200 and 429 in codes[1:]


def test_access_log_names_the_route_and_no_cluster(env: dict) -> None:
    httpx.get(env["plain"] + "/admin/x")
    wait_for(lambda: access_lines(env["log"], "deny"), 5)
    rec = access_lines(env["log"], "deny")[-1]
    assert rec["status"] == 403 and rec["cluster"] is None and rec["endpoint"] is None


def test_auth_runs_before_the_route_answers(tmp_path: Path) -> None:
    key = "k-" + "x" * 30
    proxy = ProxyProc(tmp_path, f"""
[[listeners]]
name = "p"
address = "127.0.0.1:{{p}}"

[auth]
api_keys = [{{ id = "k1", subject = "s", hash = "{hash_key(key)}" }}]

[[routes]]
name = "deny"
direct_response = {{ status = 200, body = "secret" }}
""", ("p",))
    try:
        url = f"http://127.0.0.1:{proxy.ports['p']}/x"
        assert httpx.get(url).status_code == 401
        r = httpx.get(url, headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.text == "secret"
    finally:
        proxy.stop()


# -- config and the Location builder ------------------------------------------------------


def test_bad_route_answers_name_file_line_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("""[[listeners]]
name = "p"
address = "127.0.0.1:1"

[[clusters]]
name = "c"
endpoints = ["127.0.0.1:2"]

[[routes]]
name = "a"
cluster = "c"
redirect = { scheme = "https" }

[[routes]]
name = "b"
redirect = { status = 200, scheme = "ftp" }
retries = { attempts = 1 }

[[routes]]
name = "d"
direct_response = { status = 304, body = "x" }
""")
    r = aiproxy_cli("check", "-c", str(path))
    assert r.returncode != 0
    err = r.stderr
    assert f"{path}:12: routes[0].redirect: give one of cluster" in err, err
    assert "routes[1].redirect.status: must be one of 301, 302, 303, 307, 308" in err
    assert "routes[1].redirect.scheme: must be \"http\" or \"https\"" in err
    assert "routes[1].retries: only meaningful for a route to a cluster" in err
    assert "routes[2].direct_response.body: a 304 response has no body" in err


def test_non_ascii_content_type_is_a_config_error_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "ctype.toml"
    path.write_text("""[[listeners]]
name = "p"
address = "127.0.0.1:1"

[[routes]]
name = "r"
direct_response = { status = 200, body = "hi", content_type = "text/plain; charset=\u00e9" }
""", encoding="utf-8")
    r = aiproxy_cli("check", "-c", str(path))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f"{path}:7: routes[0].direct_response.content_type: "
                                "must be a non-empty ASCII field value"), r.stderr


@pytest.mark.parametrize("host, ok", [
    ("docs.example.com", True), ("192.0.2.7", True), ("::1", True),
    ("[::1]", False), ("docs.example.com:8443", False), ("999.1.1.1", False),
    ("bad host", False), ("bücher.example", False),
])
def test_redirect_host_is_a_name_or_address_without_port(tmp_path: Path, host: str,
                                                          ok: bool) -> None:
    path = tmp_path / "redirect.toml"
    path.write_text(f"""[[listeners]]
name = "p"
address = "127.0.0.1:1"

[[routes]]
name = "r"
redirect = {{ host = "{host}" }}
""")
    r = aiproxy_cli("check", "-c", str(path))
    if ok:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode != 0
        assert f"{path}:7: routes[0].redirect.host: invalid host name '{host}'" in r.stderr, \
            r.stderr


@pytest.mark.parametrize("redirect, scheme, authority, path, query, want", [
    (Redirect(scheme=b"https"), b"http", b"a.test:80", b"/p", b"", b"https://a.test/p"),
    (Redirect(), b"https", b"a.test:8443", b"/p", b"q", b"https://a.test:8443/p?q"),
    (Redirect(), b"https", b"a.test:443", b"/p", b"", b"https://a.test/p"),
    (Redirect(port=8080), b"http", b"[::1]:1", b"/", b"", b"http://[::1]:8080/"),
    (Redirect(host=b"b.test"), b"http", b"a.test:9000", b"/p", b"", b"http://b.test/p"),
    (Redirect(path=b"/n"), b"http", None, b"//evil.test/x", b"", b"/n"),
    (Redirect(), b"http", None, b"//evil.test/x", b"", b"/evil.test/x"),
    (Redirect(scheme=b"https"), b"http", None, b"/x", b"", None),
    (Redirect(strip_query=True), b"http", b"a", b"/a b", b"x=1", b"http://a/a%20b"),
])
def test_location(redirect: Redirect, scheme: bytes, authority: bytes | None, path: bytes,
                  query: bytes, want: bytes | None) -> None:
    assert location(redirect, scheme, authority, path, query, None) == want


def test_split_authority() -> None:
    assert split_authority(b"a.test:81") == (b"a.test", b"81")
    assert split_authority(b"a.test") == (b"a.test", None)
    assert split_authority(b"[::1]:9") == (b"[::1]", b"9")
    assert split_authority(b"[::1]") == (b"[::1]", None)
    assert split_authority(b"a.test:") == (b"a.test", None)
