"""W3C Trace Context through the proxy: continued, started, and dropped when invalid."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from aiproxy.governance.tracing import parse_traceparent
from tests.conftest import simple_config

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.mark.parametrize("value, expected", [
    (f"00-{TRACE}-{PARENT}-01", (TRACE, PARENT, "01")),
    (f"00-{TRACE}-{PARENT}-00", (TRACE, PARENT, "00")),
    (f"  00-{TRACE}-{PARENT}-01 ", (TRACE, PARENT, "01")),
    (f"01-{TRACE}-{PARENT}-01-future", (TRACE, PARENT, "01")),  # a later version, read as 00
    (f"01-{TRACE}-{PARENT}-01", (TRACE, PARENT, "01")),
    (f"00-{TRACE}-{PARENT}-01-extra", None),   # version 00 is exactly 55 bytes
    (f"01-{TRACE}-{PARENT}-01x", None),        # after 55 bytes a later version needs "-"
    (f"ff-{TRACE}-{PARENT}-01", None),         # version ff is invalid
    (f"00-{TRACE.upper()}-{PARENT}-01", None),  # lower-case hex only
    (f"00-{'0' * 32}-{PARENT}-01", None),      # all-zero trace id
    (f"00-{TRACE}-{'0' * 16}-01", None),       # all-zero parent id
    (f"00-{TRACE[:-1]}-{PARENT}-01", None),
    (f"00_{TRACE}-{PARENT}-01", None),
    (f"0g-{TRACE}-{PARENT}-01", None),
    ("", None),
])
def test_parse_traceparent(value: str, expected):
    got = parse_traceparent(value.encode())
    want = None if expected is None else tuple(x.encode() for x in expected)
    assert got == want


def _config(port: int, log: Path | None = None) -> str:
    extra = "\n[tracing]\n"
    if log is not None:
        extra += f'\n[access_log]\npath = "{log}"\nflush_interval_ms = 20\n'
    return simple_config(port) + extra


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2c"])
def test_valid_traceparent_is_continued_with_a_new_span(start_proxy, demo_upstream, http2):
    listener = 'protocols = ["http1", "h2c"]' if http2 else ""
    proxy = start_proxy(_config(demo_upstream), listener)
    with httpx.Client(http2=http2, http1=not http2) as client:
        r = client.get(f"http://127.0.0.1:{proxy.port}/echo",
                       headers={"traceparent": f"00-{TRACE}-{PARENT}-01",
                                "tracestate": "vendor=abc", "x-trace-id": "spoofed"})
    assert r.status_code == 200, r.text
    seen = r.json()["headers"]
    trace, span, flags = parse_traceparent(seen["traceparent"].encode())
    assert trace.decode() == TRACE and flags == b"01"
    assert span.decode() != PARENT  # this hop is a span of its own
    assert seen["tracestate"] == "vendor=abc"
    assert seen["x-trace-id"] == TRACE


def test_missing_or_invalid_traceparent_starts_a_trace(start_proxy, demo_upstream):
    proxy = start_proxy(_config(demo_upstream))
    url = f"http://127.0.0.1:{proxy.port}/echo"
    traces = set()
    with httpx.Client() as client:
        twice = [("traceparent", f"00-{TRACE}-{PARENT}-01"),
                 ("traceparent", f"00-{TRACE[::-1]}-{PARENT}-01"), ("tracestate", "a=b")]
        for headers in ({}, {"traceparent": f"ff-{TRACE}-{PARENT}-01", "tracestate": "a=b"},
                        {"traceparent": "garbage", "tracestate": "a=b"},
                        httpx.Headers(twice)):  # W3C 3.2: two is none
            seen = client.get(url, headers=headers).json()["headers"]
            parsed = parse_traceparent(seen["traceparent"].encode())
            assert parsed is not None
            trace = parsed[0].decode()
            assert trace != TRACE and seen["x-trace-id"] == trace
            assert parsed[2] == b"03"  # sampled, and a random trace id (Level 2)
            assert "tracestate" not in seen  # never kept without a valid traceparent
            traces.add(trace)
    assert len(traces) == 4


def test_access_log_carries_the_trace_id(start_proxy, demo_upstream, tmp_path: Path):
    log = tmp_path / "access.log"
    proxy = start_proxy(_config(demo_upstream, log))
    with httpx.Client() as client:
        seen = client.get(f"http://127.0.0.1:{proxy.port}/echo").json()["headers"]
        client.get(f"http://127.0.0.1:{proxy.port}/echo",
                   headers={"traceparent": f"00-{TRACE}-{PARENT}-01"})
    deadline = time.monotonic() + 5
    lines: list[dict] = []
    while time.monotonic() < deadline and len(lines) < 2:
        time.sleep(0.05)
        if log.exists():
            lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["trace_id"] for x in lines] == [seen["x-trace-id"], TRACE]


def test_tracing_off_leaves_headers_alone(start_proxy, demo_upstream):
    proxy = start_proxy(simple_config(demo_upstream) + "\n[tracing]\nenabled = false\n")
    with httpx.Client() as client:
        seen = client.get(f"http://127.0.0.1:{proxy.port}/echo",
                          headers={"traceparent": "garbage"}).json()["headers"]
    assert seen["traceparent"] == "garbage" and "x-trace-id" not in seen


def test_tracing_off_logs_only_a_valid_callers_trace_id(start_proxy, demo_upstream,
                                                         tmp_path: Path):
    """Without [tracing] the access log still names the caller's trace, but only from a
    traceparent W3C calls valid: one it says to ignore (version ff, an all-zero or
    upper-case trace id, bad hex, two of them) names no trace."""
    log = tmp_path / "access.log"
    proxy = start_proxy(simple_config(demo_upstream) + "\n[tracing]\nenabled = false\n"
                        + f'\n[access_log]\npath = "{log}"\nflush_interval_ms = 20\n')
    sent = [[f"ff-{TRACE}-{PARENT}-01"], [f"00-{'0' * 32}-{PARENT}-01"],
            [f"00-{TRACE.upper()}-{PARENT}-01"], [f"00-{'z' * 32}-{PARENT}-01"],
            [f"00-{TRACE}-{'0' * 16}-01"],
            [f"00-{TRACE}-{PARENT}-01", f"00-{TRACE[::-1]}-{PARENT}-01"],
            [f"00-{TRACE}-{PARENT}-01"]]
    with httpx.Client() as client:
        for values in sent:
            headers = httpx.Headers([("traceparent", v) for v in values])
            assert client.get(f"{proxy.url}/echo", headers=headers).status_code == 200
    deadline = time.monotonic() + 5
    lines: list[dict] = []
    while time.monotonic() < deadline and len(lines) < len(sent):
        time.sleep(0.05)
        if log.exists():
            lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["trace_id"] for x in lines] == [None] * (len(sent) - 1) + [TRACE]
