"""W3C Trace Context conformance through a running proxy, after the checks of the W3C test
harness (w3c/trace-context test/test.py): real requests (raw HTTP/1.1, h2c, gRPC) go
through aiproxy with [tracing] to an upstream that records the fields it got, in order."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import grpc
import httpx
import pytest
from aiohttp import web

from aiproxy.governance.tracing import parse_tracestate
from tests.conftest import simple_config
from tests.grpc_support import (
    GRPC_OPTIONS,
    InferenceServer,
    grpc_config,
    grpc_modules,  # noqa: F401 - fixture
)
from tests.support import raw_exchange, serve_aiohttp

T = "12345678901234567890123456789012"
P = "1234567890123456"
VALID = f"00-{T}-{P}-00"
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


@pytest.fixture(scope="module")
def recorder() -> Iterator[int]:
    """An upstream answering with the request's fields as it got them: [[name, value]]."""
    async def handle(request: web.Request) -> web.Response:
        return web.json_response([[k.decode("latin-1"), v.decode("latin-1")]
                                  for k, v in request.raw_headers])

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    with serve_aiohttp(app) as port:
        yield port


@pytest.fixture(scope="module")
def proxy_port(recorder: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    from tests.h2_support import ProxyProc

    config = ('[[listeners]]\nname = "t"\naddress = "127.0.0.1:{port}"\n'
              'protocols = ["http1", "h2c"]\n' + simple_config(recorder)
              + 'model = "model-x"\n\n[tracing]\n')
    proxy = ProxyProc(tmp_path_factory.mktemp("trace-context"), config)
    yield proxy.ports["port"]
    proxy.stop()


def upstream_fields(port: int, fields: list[tuple[str, str]]) -> list[list[str]]:
    """Send a GET with `fields` as written (names, casing, OWS) through the proxy."""
    head = "".join(f"{name}:{value}\r\n" if value[:1] in (" ", "\t") else f"{name}: {value}\r\n"
                   for name, value in fields)
    raw = raw_exchange(port, ("GET /t HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                              f"{head}\r\n").encode("latin-1"))
    status, _, body = raw.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200"), raw
    return json.loads(body)


def context(fields: list[list[str]]) -> tuple[str, str, str, list[str]]:
    """(trace id, parent id, flags, [tracestate field values]) the upstream got."""
    parents = [v for k, v in fields if k.lower() == "traceparent"]
    assert len(parents) == 1, fields
    m = TRACEPARENT.match(parents[0])
    assert m, parents
    return m.group(1), m.group(2), m.group(3), [v for k, v in fields if k.lower() == "tracestate"]


# -- tracestate: the list, its grammar and limits ----------------------------------------------

MEMBERS32 = [",".join(f"bar{i:02d}={i:02d}" for i in range(a, b))
             for a, b in ((1, 11), (11, 21), (21, 31), (31, 33))]
KEY = "abcdefghijklmnopqrstuvwxyz0123456789_-*/"
VALUE = "".join(map(chr, [*range(0x20, 0x2C), *range(0x2D, 0x3D), *range(0x3E, 0x7F)]))


@pytest.mark.parametrize("fields, expected", [
    (["foo=1,bar=2"], "foo=1,bar=2"),
    (["foo=1,bar=2", "rojo=1,congo=2", "baz=3"], "foo=1,bar=2,rojo=1,congo=2,baz=3"),
    ([""], None),                                   # empty: accepted, not sent on
    (["foo=1", ""], "foo=1"),
    (["", "foo=1"], "foo=1"),
    ([" ,foo=1 \t , \t bar=2, \t baz=3,"], "foo=1,bar=2,baz=3"),  # OWS, empty members
    (["\t foo=1 \t"], "foo=1"),
    (["foo= leading"], "foo= leading"),            # a value's leading spaces are its own
    ([f"{KEY}={VALUE}"], f"{KEY}={VALUE}"),
    ([f"{KEY}@a-z0-9_-*/={VALUE}"], f"{KEY}@a-z0-9_-*/={VALUE}"),
    (["foo=1", "z" * 256 + "=1"], "foo=1," + "z" * 256 + "=1"),
    (["foo=1", "t" * 241 + "@" + "v" * 14 + "=1"], "foo=1," + "t" * 241 + "@" + "v" * 14 + "=1"),
    (["k=" + "v" * 256], "k=" + "v" * 256),
    (MEMBERS32, ",".join(MEMBERS32)),
    # invalid: the whole list goes
    (["foo=1,foo=1"], None),                        # a key twice
    (["foo=1,foo=2"], None),
    (["foo=1", "foo=2"], None),
    ([*MEMBERS32[:-1], MEMBERS32[-1] + ",bar33=33"], None),  # 33 members
    (["foo =1"], None),
    (["FOO=1"], None),
    (["foo.bar=1"], None),
    (["1foo=1"], None),                            # a simple key starts with a letter
    (["foo@=1,bar=2"], None),
    (["@foo=1,bar=2"], None),
    (["foo@@bar=1,bar=2"], None),
    (["foo@bar@baz=1,bar=2"], None),
    (["foo@1bar=1"], None),                        # a system id starts with a letter
    (["foo=1", "z" * 257 + "=1"], None),
    (["foo=1", "t" * 242 + "@v=1"], None),
    (["foo=1", "t@" + "v" * 15 + "=1"], None),
    (["foo=bar=baz"], None),
    (["foo=,bar=3"], None),
    (["foo"], None),
    (["k=" + "v" * 257], None),
    (["foo=a\tb"], None),
    (["foo=caf\xe9"], None),
])
def test_parse_tracestate(fields: list[str], expected: str | None) -> None:
    got = parse_tracestate([f.encode("latin-1") for f in fields])
    assert got == (None if expected is None else expected.encode("latin-1"))


@pytest.mark.parametrize("fields, expected", [
    (["foo=1,bar=2", "rojo=1,congo=2", "baz=3"], ["foo=1,bar=2,rojo=1,congo=2,baz=3"]),
    (["", "foo=1 \t , \t bar=2"], ["foo=1,bar=2"]),
    ([""], []),
    (MEMBERS32, [",".join(MEMBERS32)]),
    ([*MEMBERS32[:-1], MEMBERS32[-1] + ",bar33=33"], []),
    (["foo=1,foo=1"], []),
    (["foo=1", "foo=2"], []),
    (["foo =1"], []),
    (["FOO=1"], []),
    (["foo@bar@baz=1,bar=2"], []),
    (["foo=1", "z" * 257 + "=1"], []),
    (["foo=bar=baz"], []),
    (["foo=,bar=3"], []),
], ids=lambda x: repr(x)[:40])
def test_tracestate_through_the_proxy(proxy_port: int, fields: list[str],
                                      expected: list[str]) -> None:
    """Valid lists arrive as one field in order without OWS; invalid ones not at all, the
    trace itself continued (a bad tracestate never spoils traceparent)."""
    got = upstream_fields(proxy_port, [("traceparent", VALID), *(("TraceState", f) for f in fields)])
    trace, parent, flags, tracestate = context(got)
    assert (trace, flags) == (T, "00") and parent != P
    assert tracestate == expected
    # lineage: the route's model goes up as x-model-id, never as a tracestate member
    assert ["x-model-id", "model-x"] in got


def test_tracestate_without_a_valid_traceparent_is_dropped(proxy_port: int) -> None:
    for parent in ([], [("traceparent", f"ff-{T}-{P}-01")]):
        trace, _, _, tracestate = context(upstream_fields(proxy_port, [*parent, ("tracestate", "foo=1")]))
        assert trace != T and tracestate == []


# -- trace flags ------------------------------------------------------------------------------


@pytest.mark.parametrize("sent, forwarded", [
    ("00", "00"), ("01", "01"),
    ("02", "02"), ("03", "03"),   # Level 2: the random trace-id flag is kept with the trace id
    ("ff", "03"), ("09", "01"),   # undefined bits are sent as zero
])
def test_flags_undefined_bits_are_zeroed(proxy_port: int, sent: str, forwarded: str) -> None:
    trace, _, flags, _ = context(upstream_fields(proxy_port, [("traceparent", f"00-{T}-{P}-{sent}")]))
    assert (trace, flags) == (T, forwarded)
    # a later version's traceparent is read as 00: the same rule for its flags
    trace, _, flags, _ = context(upstream_fields(
        proxy_port, [("traceparent", f"cc-{T}-{P}-{sent}-what-the-future-will-be-like")]))
    assert (trace, flags) == (T, forwarded)


def test_new_trace_is_sampled_and_random(proxy_port: int) -> None:
    """A started trace's id is 16 bytes of os.urandom: Level 2's random flag says so."""
    for parent in ([], [("traceparent", f"00-{'0' * 32}-{P}-01")]):
        trace, _, flags, _ = context(upstream_fields(proxy_port, parent))
        assert trace not in (T, "0" * 32) and flags == "03"


# -- HTTP/2 and gRPC --------------------------------------------------------------------------


def test_h2c_tracestate_fields_are_combined(proxy_port: int) -> None:
    with httpx.Client(http2=True, http1=False) as client:
        r = client.get(f"http://127.0.0.1:{proxy_port}/t", headers=httpx.Headers([
            ("traceparent", f"00-{T}-{P}-ff"), ("tracestate", "foo=1"),
            ("tracestate", "bar=2,  baz=3")]))
        assert r.http_version == "HTTP/2"
        trace, parent, flags, tracestate = context(r.json())
        assert (trace, flags, tracestate) == (T, "03", ["foo=1,bar=2,baz=3"]) and parent != P
        r = client.get(f"http://127.0.0.1:{proxy_port}/t", headers=httpx.Headers([
            ("traceparent", f"00-{T}-{P}-01"), ("tracestate", "foo=1"), ("tracestate", "foo=2")]))
        assert context(r.json())[3] == []


@pytest.fixture(scope="module")
def grpc_upstream(grpc_modules: tuple[ModuleType, ModuleType]) -> Iterator[InferenceServer]:  # noqa: F811
    server = InferenceServer(*grpc_modules, "grpc-a")
    yield server
    server.stop()


def test_grpc_metadata_carries_the_trace(grpc_upstream: InferenceServer, start_proxy: Any,
                                         grpc_modules: tuple[ModuleType, ModuleType]) -> None:  # noqa: F811
    pb2, pb2_grpc = grpc_modules
    proxy = start_proxy(grpc_config(("a", grpc_upstream.port)) + "\n[tracing]\n",
                        'protocols = ["h2c"]')
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}", options=GRPC_OPTIONS) as channel:
        stub = pb2_grpc.PredictorStub(channel)
        stub.Predict(pb2.PredictRequest(model="m", prompt="hi"), timeout=10, metadata=[
            ("traceparent", f"00-{T}-{P}-05"), ("tracestate", "foo=1"),
            ("tracestate", "bar=2")])
    seen = grpc_upstream.recorder.metadata[-1]
    m = TRACEPARENT.match(seen["traceparent"])
    assert m and (m.group(1), m.group(3)) == (T, "01") and m.group(2) != P
    assert seen["tracestate"] == "foo=1,bar=2"
