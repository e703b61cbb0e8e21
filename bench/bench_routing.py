"""Route matching over 10 / 1,000 / 10,000 routes.

Every route is a path_prefix route `/svc{i}/`; the looked-up path belongs to the route
second from the end, so a first-match-wins table walks (almost) all of them: this shows
what today's linear matching costs as a table grows, and the baseline for a compiled one.
"""

from __future__ import annotations

import pytest
from aiproxy._fast.h1 import parse_request

from aiproxy.config import RouteConfig, RouteMatch
from aiproxy.routing.table import Route, RouteTable


def _table(n: int) -> RouteTable:
    cluster = object()  # Route only keeps a reference; matching never touches it
    return RouteTable(
        Route(RouteConfig(name=f"svc{i}", cluster="svc",
                          match=RouteMatch(path_prefix=b"/svc%d/" % i)), cluster)
        for i in range(n)
    )


@pytest.mark.parametrize("n", [10, 1_000, 10_000])
def test_route_match(benchmark, n: int) -> None:
    benchmark.group = "route match: path_prefix, hit near the end"
    table = _table(n)
    target = b"/svc%d/v1/items?limit=10" % (n - 2)
    head = parse_request(bytearray(b"GET " + target + b" HTTP/1.1\r\nHost: api.example.com\r\n\r\n"))
    path = target.partition(b"?")[0]
    route = table.match(head.method, path, head.host, head)
    assert route is not None and route.name == f"svc{n - 2}"
    benchmark.extra_info["routes"] = n
    benchmark(table.match, head.method, path, head.host, head)
