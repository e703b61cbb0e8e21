"""Route matching over 10 / 1,000 / 10,000 routes.

Every route is a path_prefix route `/svc{i}/` (plus, in the host case, a host per route);
the looked-up path belongs to the route second from the end, so a first-match-wins table
that walks its routes in order would touch (almost) all of them. The compiled table
(aiproxy.routing.table) probes a dict per distinct prefix length instead, so the time
should stay flat as the table grows. `linear` is the reference scan, for comparison.
"""

from __future__ import annotations

import pytest
from aiproxy._fast.h1 import parse_request

from aiproxy.config import RouteConfig, RouteMatch
from aiproxy.routing.table import Route, RouteTable

SIZES = [10, 1_000, 10_000]


def _table(n: int, hosts: bool = False) -> RouteTable:
    cluster = object()  # Route only keeps a reference; matching never touches it
    return RouteTable(
        Route(RouteConfig(name=f"svc{i}", cluster="svc",
                          match=RouteMatch(path_prefix=b"/svc%d/" % i,
                                           host=b"h%d.example.com" % i if hosts else None)),
              cluster, i)
        for i in range(n)
    )


def _request(n: int, host: bytes = b"api.example.com"):
    target = b"/svc%d/v1/items?limit=10" % (n - 2)
    head = parse_request(bytearray(b"GET " + target + b" HTTP/1.1\r\nHost: " + host
                                   + b"\r\n\r\n"))
    return head, target.partition(b"?")[0]


def _linear(table: RouteTable, method, path, host, head):
    for route in table.routes:
        if route.matches(method, path, host, head):
            return route
    return None


@pytest.mark.parametrize("n", SIZES)
def test_route_match(benchmark, n: int) -> None:
    benchmark.group = "route match: path_prefix, hit near the end"
    table = _table(n)
    head, path = _request(n)
    route = table.match(head.method, path, head.host, head)
    assert route is not None and route.name == f"svc{n - 2}"
    benchmark.extra_info["routes"] = n
    benchmark(table.match, head.method, path, head.host, head)


@pytest.mark.parametrize("n", SIZES)
def test_route_match_host(benchmark, n: int) -> None:
    benchmark.group = "route match: host + path_prefix, hit near the end"
    table = _table(n, hosts=True)
    head, path = _request(n, b"h%d.example.com" % (n - 2))
    route = table.match(head.method, path, head.host, head)
    assert route is not None and route.name == f"svc{n - 2}"
    benchmark.extra_info["routes"] = n
    benchmark(table.match, head.method, path, head.host, head)


@pytest.mark.parametrize("n", SIZES)
def test_route_match_miss(benchmark, n: int) -> None:
    benchmark.group = "route match: no route matches"
    table = _table(n)
    head, _ = _request(n)
    benchmark.extra_info["routes"] = n
    assert table.match(head.method, b"/nothing/here", head.host, head) is None
    benchmark(table.match, head.method, b"/nothing/here", head.host, head)


@pytest.mark.parametrize("n", [10, 1_000])
def test_route_match_linear_reference(benchmark, n: int) -> None:
    benchmark.group = "route match: linear scan (reference)"
    table = _table(n)
    head, path = _request(n)
    benchmark.extra_info["routes"] = n
    benchmark(_linear, table, head.method, path, head.host, head)


def _regex_table() -> RouteTable:
    """A path_regex route and a header-regex route after it (one cluster each)."""
    cluster = object()
    return RouteTable([
        Route(RouteConfig(name="path", cluster="svc",
                          match=RouteMatch(path_regex=rb"/models/[a-z0-9-]+/v[0-9]+/infer")),
              cluster, 0),
        Route(RouteConfig(name="tenant", cluster="svc",
                          match=RouteMatch(path_prefix=b"/",
                                           header_rules=((b"x-tenant", "regex",
                                                          rb"(team|org)-[a-z]+"),))),
              cluster, 1),
    ])


@pytest.mark.parametrize("kind", ["path_regex", "header_regex"])
def test_route_match_regex(benchmark, kind: str) -> None:
    """A request that a regex condition decides (per request: one regex match, or two)."""
    benchmark.group = "route match: regex conditions"
    table = _regex_table()
    target = b"/models/llama-3/v2/infer" if kind == "path_regex" else b"/chat"
    head = parse_request(bytearray(b"GET " + target + b" HTTP/1.1\r\nHost: a\r\n"
                                   b"x-tenant: team-blue\r\n\r\n"))
    route = table.match(head.method, target, head.host, head)
    assert route is not None and route.name == ("path" if kind == "path_regex" else "tenant")
    benchmark(table.match, head.method, target, head.host, head)
