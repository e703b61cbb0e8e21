"""Path normalization before routing, and the proxy's own headers not spoofable."""

from __future__ import annotations

import json

import httpx
import pytest

from aiproxy.pipeline.paths import BadPath, normalize_path
from tests.support import raw_exchange, start_demo_upstream, stop_process


@pytest.mark.parametrize("raw, expected", [
    (b"/a/b", b"/a/b"),
    (b"/a/./b", b"/a/b"),
    (b"/a/../b", b"/b"),
    (b"/../../b", b"/b"),               # never above the root
    (b"/a/b/..", b"/a/"),
    (b"/a/b/.", b"/a/b/"),
    (b"/a/.b/..c", b"/a/.b/..c"),       # dots inside names are names
    (b"/%61dmin", b"/admin"),           # unreserved characters decoded
    (b"/%2e%2E/admin", b"/admin"),      # encoded dot segments are dot segments
    (b"/a%2fb", b"/a/b"),               # an encoded slash is decoded (escaped_slashes)
    (b"/x/..%2Fadmin", b"/admin"),      # ... before dot segments are removed
    (b"/%2Fadmin", b"/admin"),          # ... and repeated slashes merged
    (b"/caf%c3%a9", b"/caf%C3%A9"),
    (b"//a//b", b"/a/b"),               # repeated slashes merged (merge_slashes)
    (b"/a/%7euser", b"/a/~user"),
])
def test_normalize_path(raw: bytes, expected: bytes):
    assert normalize_path(raw) == expected


def test_slash_options():
    assert normalize_path(b"//a//b", merge_slashes=False) == b"//a//b"
    assert normalize_path(b"/a%2fb", escaped_slashes="keep") == b"/a%2Fb"
    assert normalize_path(b"/a%5c..%5cb", escaped_slashes="keep") == b"/a%5C..%5Cb"
    for raw, mode in ((b"/a%2fb", "reject"), (b"/a%5cb", "decode"), (b"/a%5cb", "reject"),
                      (b"/a\\b", "keep"), (b"/a\\b", "decode")):
        with pytest.raises(BadPath):
            normalize_path(raw, escaped_slashes=mode)


@pytest.mark.parametrize("raw", [b"/a%", b"/a%4", b"/a%zz", b"/%g0"])
def test_malformed_percent_encoding(raw: bytes):
    with pytest.raises(BadPath):
        normalize_path(raw)


@pytest.fixture(scope="module")
def two_upstreams():
    a, port_a = start_demo_upstream("public")
    b, port_b = start_demo_upstream("private")
    yield port_a, port_b
    stop_process(a)
    stop_process(b)


def _config(port_a: int, port_b: int) -> str:
    return f"""
[[clusters]]
name = "public"
endpoints = ["127.0.0.1:{port_a}"]

[[clusters]]
name = "private"
endpoints = ["127.0.0.1:{port_b}"]

[[routes]]
name = "private"
match = {{ path_prefix = "/echo/private/" }}
cluster = "private"

[[routes]]
name = "private-host"
match = {{ host = "private.example" }}
cluster = "private"

[[routes]]
name = "dotted-host"
match = {{ host = "dotted.example." }}
cluster = "private"

[[routes]]
name = "public"
match = {{ path_prefix = "/" }}
cluster = "public"
"""


def _raw(port: int, target: bytes, headers: bytes = b"") -> bytes:
    return raw_exchange(port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n"
                        b"Connection: close\r\n" + headers + b"\r\n")


def _echoed(port: int, target: bytes) -> dict:
    """What the demo upstream saw of a request sent with this exact target."""
    data = _raw(port, target)
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


@pytest.mark.parametrize("target", [
    b"/echo/public/../private/x",
    b"/echo/./private/x",
    b"/echo/%70rivate/x",
    b"/echo/public/%2e%2e/private/x",
    b"//echo/private/x",                # nginx merges slashes: so does the proxy
    b"/echo//private/x",
    b"/echo/%2Fprivate/x",              # an encoded slash is a slash to most servers
    b"/echo/public/..%2Fprivate/x",
])
def test_what_is_matched_is_what_is_forwarded(start_proxy, two_upstreams, target):
    proxy = start_proxy(_config(*two_upstreams))
    body = _echoed(proxy.port, target)
    assert body["upstream"] == "private"
    assert body["path"] == "/echo/private/x"


def test_backslash_is_400_and_slash_options(start_proxy, two_upstreams):
    proxy = start_proxy(_config(*two_upstreams))
    for target in (b"/echo/\\private/x", b"/echo/%5Cprivate/x"):
        data = _raw(proxy.port, target)
        assert data.startswith(b"HTTP/1.1 400"), data[:200]
    proxy = start_proxy(_config(*two_upstreams)
                        + '[http]\nmerge_slashes = false\nescaped_slashes = "keep"\n')
    body = _echoed(proxy.port, b"/echo/%2fprivate//x")
    assert (body["upstream"], body["path"]) == ("public", "/echo/%2Fprivate//x")


def test_host_with_a_trailing_dot_is_the_same_host(start_proxy, two_upstreams):
    """`private.example.` is the fully qualified `private.example`: the same route."""
    proxy = start_proxy(_config(*two_upstreams))
    data = raw_exchange(proxy.port, b"GET /echo/x HTTP/1.1\r\nHost: private.example.\r\n"
                        b"Connection: close\r\n\r\n")
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["upstream"] == "private"
    for host in (b"dotted.example", b"dotted.example."):  # and a route's dot is the same
        data = raw_exchange(proxy.port, b"GET /echo/x HTTP/1.1\r\nHost: " + host +
                            b"\r\nConnection: close\r\n\r\n")
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["upstream"] == "private", host


def test_query_survives_normalization(start_proxy, two_upstreams):
    proxy = start_proxy(_config(*two_upstreams))
    body = _echoed(proxy.port, b"/echo/a/../b?x=a/../b&y=1")
    assert body["path"] == "/echo/b"
    assert body["query"] == "x=a/../b&y=1"


def test_malformed_percent_encoding_is_400(start_proxy, two_upstreams):
    proxy = start_proxy(_config(*two_upstreams))
    data = _raw(proxy.port, b"/echo/%zz")
    assert data.startswith(b"HTTP/1.1 400")
    assert b"percent-encoding" in data


def test_client_cannot_state_the_semantic_decision(start_proxy, two_upstreams):
    proxy = start_proxy(_config(*two_upstreams))
    r = httpx.get(f"http://127.0.0.1:{proxy.port}/echo/x",
                  headers={"x-aiproxy-intent": "transfer", "x-aiproxy-intent-domain": "banking",
                           "x-aiproxy-intent-confidence": "1"})
    seen = r.json()["headers"]
    assert not any(name.startswith("x-aiproxy-intent") for name in seen)


def test_client_cannot_state_any_proxy_field(start_proxy, two_upstreams):
    """Every x-aiproxy-* field and its CGI spelling, in any case, is the proxy's own."""
    proxy = start_proxy(_config(*two_upstreams))
    data = _raw(proxy.port, b"/echo/x", b"X-AIProxy-Identity: subject=root\r\n"
                b"x_aiproxy_policy: allow\r\nX_AIPROXY_INTENT: transfer\r\n"
                b"x-aiproxy-: bare\r\nx-aiproxyz: kept\r\n")
    seen = json.loads(data.split(b"\r\n\r\n", 1)[1])["headers"]
    assert not any("aiproxy_" in name or "aiproxy-" in name for name in seen), seen
    assert seen["x-aiproxyz"] == "kept"
