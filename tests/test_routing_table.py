"""Route table: every match kind, and the compiled index agrees with a linear scan."""

from __future__ import annotations

import random

import pytest
from aiproxy._fast.h1 import parse_request

from aiproxy.config import load_config_text
from aiproxy.routing.table import LINEAR_PREFIXES, Route, RouteTable

CLUSTER = """
[[listeners]]
name = "l"
address = "127.0.0.1:1"

[[clusters]]
name = "c"
endpoints = ["127.0.0.1:2"]
"""


def table(routes: str, linear_prefixes: int = LINEAR_PREFIXES) -> RouteTable:
    cfg = load_config_text(CLUSTER + routes, "t.toml")
    return RouteTable((Route(r, {"c": object()}, i) for i, r in enumerate(cfg.routes)),
                      linear_prefixes)


def lookup(tbl: RouteTable, target: bytes, host: bytes = b"example.com", method: bytes = b"GET",
           headers: bytes = b"") -> str | None:
    head = parse_request(bytearray(method + b" " + target + b" HTTP/1.1\r\nHost: " + host
                                   + b"\r\n" + headers + b"\r\n"))
    path, _, query = target.partition(b"?")
    route = tbl.match(head.method, path, head.host, head, query)
    linear = next((r for r in tbl.routes if r.matches(head.method, path, head.host, head, query)),
                  None)
    assert route is linear
    return route.name if route is not None else None


def test_host_exact_wildcard_and_any():
    tbl = table("""
[[routes]]
name = "exact"
match = { host = "api.example.com" }
cluster = "c"
[[routes]]
name = "wild"
match = { host = "*.example.com" }
cluster = "c"
[[routes]]
name = "star"
match = { host = "*", path_prefix = "/any" }
cluster = "c"
""")
    assert lookup(tbl, b"/", b"api.example.com:8080") == "exact"
    assert lookup(tbl, b"/", b"API.Example.com") == "exact"
    assert lookup(tbl, b"/", b"x.y.example.com") == "wild"
    assert lookup(tbl, b"/", b"example.com") is None
    assert lookup(tbl, b"/any/thing", b"other.org") == "star"


def test_first_match_in_config_order_across_buckets():
    tbl = table("""
[[routes]]
name = "catch"
match = { path_prefix = "/v1/" }
cluster = "c"
[[routes]]
name = "specific"
match = { host = "api.example.com", path = "/v1/chat" }
cluster = "c"
[[routes]]
name = "deep"
match = { path_prefix = "/v2/chat/" }
cluster = "c"
[[routes]]
name = "shallow"
match = { path_prefix = "/v2/" }
cluster = "c"
""")
    assert lookup(tbl, b"/v1/chat", b"api.example.com") == "catch"
    assert lookup(tbl, b"/v2/chat/x") == "deep"
    assert lookup(tbl, b"/v2/other") == "shallow"


def test_path_regex_methods_headers_query_grpc():
    tbl = table("""
[[routes]]
name = "regex"
match = { path_regex = "/models/[a-z]+/infer", method = ["POST"] }
cluster = "c"
[[routes]]
name = "hdr"
match = { path_prefix = "/h", headers = { x-exact = "1", x-re = { regex = "ab+c" }, x-on = { present = true }, x-off = { present = false } } }
cluster = "c"
[[routes]]
name = "query"
match = { path = "/q", query = { mode = "fast", debug = true } }
cluster = "c"
[[routes]]
name = "grpc"
match = { grpc_service = "pkg.Svc", grpc_method = "Run" }
cluster = "c"
""")
    assert lookup(tbl, b"/models/gpt/infer", method=b"POST") == "regex"
    assert lookup(tbl, b"/models/gpt/infer") is None
    assert lookup(tbl, b"/models/gpt/infer/x", method=b"POST") is None
    good = b"x-exact: 1\r\nx-re: abbbc\r\nx-on: y\r\n"
    assert lookup(tbl, b"/h", headers=good) == "hdr"
    assert lookup(tbl, b"/h", headers=good + b"x-off: 1\r\n") is None
    assert lookup(tbl, b"/h", headers=b"x-exact: 1\r\nx-re: abd\r\nx-on: y\r\n") is None
    assert lookup(tbl, b"/h", headers=b"x-exact: 1\r\nx-re: abc\r\n") is None
    assert lookup(tbl, b"/q?debug&mode=fast") == "query"
    assert lookup(tbl, b"/q?mode=f%61st&debug=1") == "query"
    assert lookup(tbl, b"/q?mode=slow&debug") is None
    assert lookup(tbl, b"/pkg.Svc/Run", method=b"POST") == "grpc"
    assert lookup(tbl, b"/pkg.Svc/Stop", method=b"POST") is None


# Few prefixes are compared one by one, many are looked up by length: both ways, here
# by forcing the table's threshold (0: always by length).
@pytest.mark.parametrize("linear_prefixes", [LINEAR_PREFIXES, 0])
@pytest.mark.parametrize("seed", range(5))
def test_index_agrees_with_linear_scan(seed, linear_prefixes):
    rng = random.Random(seed)
    hosts = ["a.example.com", "*.example.com", "b.test", "*.test", None]
    prefixes = ["/", "/v1", "/v1/", "/v1/chat", "/v2/", "/svc1", "/svc10/"]
    lines = []
    for i in range(60):
        m = []
        host = rng.choice(hosts)
        if host:
            m.append(f'host = "{host}"')
        kind = rng.random()
        if kind < 0.5:
            m.append(f'path_prefix = "{rng.choice(prefixes)}"')
        elif kind < 0.7:
            m.append(f'path = "{rng.choice(prefixes)}"')
        elif kind < 0.8:
            m.append('path_regex = "/v[12]/.*"')
        if rng.random() < 0.3:
            m.append('method = "POST"')
        if rng.random() < 0.2:
            m.append('headers = { x-k = "1" }')
        lines.append(f'[[routes]]\nname = "r{i}"\ncluster = "c"\nmatch = {{ {", ".join(m)} }}\n')
    tbl = table("".join(lines), linear_prefixes)
    mode = "prefix_list" if linear_prefixes else "prefix_groups"
    assert getattr(tbl.any_host, mode)
    for _ in range(400):
        path = rng.choice(prefixes) + rng.choice(["", "x", "/y", "chat/z"])
        host = rng.choice(["a.example.com", "z.a.example.com", "b.test", "c.test", "other"])
        lookup(tbl, path.encode(), host.encode(), rng.choice([b"GET", b"POST"]),
               rng.choice([b"", b"x-k: 1\r\n"]))
