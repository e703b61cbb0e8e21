"""Model lineage across three hops through aiproxy: model services A -> B -> C call each
other through the proxy passing traceparent on; GET /lineage/<trace> on the admin
listener returns the call graph with the model of every edge."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import aiohttp
import httpx
import pytest
from aiohttp import web

from aiproxy.governance.tracing import LineageStore, parse_traceparent
from tests.support import free_port, serve_aiohttp, wait_port

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def _service(name: str, next_url: str | None) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        seen = {"service": name, "model": request.headers.get("x-model-id"),
                "traceparent": request.headers.get("traceparent")}
        if next_url is not None:
            # Call the next model through the proxy: pass the trace on, say who calls.
            headers = {"traceparent": request.headers["traceparent"], "x-model-id": seen["model"]}
            async with aiohttp.ClientSession() as session:
                async with session.post(next_url, json={"model": "whatever", "q": name},
                                        headers=headers) as resp:
                    seen["next"] = await resp.json()
        return web.json_response(seen)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


@pytest.fixture
def services(start_proxy) -> Iterator[tuple]:
    proxy_port, admin_port = free_port(), free_port()
    with contextlib.ExitStack() as stack:
        ports = {}
        for n, nxt in (("a", "b"), ("b", "c"), ("c", None)):
            url = f"http://127.0.0.1:{proxy_port}/{nxt}/v1/chat" if nxt else None
            ports[n] = stack.enter_context(serve_aiohttp(_service(f"svc-{n}", url)))
        body = f'[admin]\naddress = "127.0.0.1:{admin_port}"\n\n[tracing]\n'
        for n, p in ports.items():
            body += f"""
[[clusters]]
name = "svc-{n}"
endpoints = ["127.0.0.1:{p}"]

[[routes]]
name = "to-{n}"
cluster = "svc-{n}"
match = {{ path_prefix = "/{n}/" }}
model = "model-{n}"
"""
        # start_proxy picks its listener's port itself; the services need the proxy's port
        # before it starts, so the proxy gets a second listener on a port chosen here.
        hop = f'[[listeners]]\nname = "hop"\naddress = "127.0.0.1:{proxy_port}"\n\n'
        start_proxy(hop + body)
        wait_port("127.0.0.1", proxy_port)
        wait_port("127.0.0.1", admin_port)
        yield proxy_port, admin_port


def test_lineage_across_three_hops(services):
    proxy_port, admin_port = services
    r = httpx.post(f"http://127.0.0.1:{proxy_port}/a/v1/chat", json={"model": "x"},
                   headers={"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"}, timeout=20)
    assert r.status_code == 200, r.text
    a = r.json()
    b, c = a["next"], a["next"]["next"]
    assert [a["model"], b["model"], c["model"]] == ["model-a", "model-b", "model-c"]
    hops = [parse_traceparent(x["traceparent"].encode()) for x in (a, b, c)]
    assert all(h[0].decode() == TRACE for h in hops)

    g = httpx.get(f"http://127.0.0.1:{admin_port}/lineage/{TRACE}", timeout=10).json()
    spans = {s["span_id"]: s for s in g["spans"]}
    assert len(spans) == 6
    # The span id each service saw as its parent is the proxy's attempt to call it: a
    # client span, child of that hop's server span.
    attempts = [h[1].decode() for h in hops]
    assert all(spans[a]["kind"] == "client" for a in attempts)
    hop_spans = [spans[a]["parent_id"] for a in attempts]
    assert all(spans[s]["kind"] == "server" for s in hop_spans)
    assert g["roots"] == [hop_spans[0]]
    assert spans[hop_spans[0]]["parent_id"] == CLIENT_SPAN
    edges = {(e["parent"], e["child"], e["model"]) for e in g["edges"]}
    assert edges == {(CLIENT_SPAN, hop_spans[0], "model-a"),
                     (hop_spans[0], attempts[0], "model-a"),
                     (attempts[0], hop_spans[1], "model-b"),
                     (hop_spans[1], attempts[1], "model-b"),
                     (attempts[1], hop_spans[2], "model-c"),
                     (hop_spans[2], attempts[2], "model-c")}
    assert spans[hop_spans[1]]["caller_model_id"] == "model-a"
    assert [spans[s]["route"] for s in hop_spans] == ["to-a", "to-b", "to-c"]
    assert all(spans[s]["status"] == 200 for s in hop_spans)
    # The outer hop lasted at least as long as the ones inside it.
    assert spans[hop_spans[0]]["duration_ms"] >= spans[hop_spans[2]]["duration_ms"]
    missing = httpx.get(f"http://127.0.0.1:{admin_port}/lineage/{'1' * 32}", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_trace"


def test_store_is_bounded():
    store = LineageStore(max_traces=3)
    for i in range(5):
        for j in range(300):
            store.add({"trace_id": f"t{i}", "span_id": f"s{j}", "parent_id": None,
                       "model_id": None, "start": j})
    assert list(store.traces) == ["t2", "t3", "t4"] and store.dropped == 2
    assert len(store.graph("t4")["spans"]) == 256
    assert store.graph("t0") is None


def test_store_is_bounded_in_spans_of_all_traces():
    """Clients choose trace ids: 10,000 traces of 256 spans would be theirs to fill."""
    store = LineageStore(max_traces=100, max_spans=1000)
    for i in range(20):
        for j in range(200):
            store.add({"trace_id": f"t{i}", "span_id": f"s{j}", "parent_id": None,
                       "model_id": None, "start": j})
    assert store.spans == sum(map(len, store.traces.values())) == 1000
    assert list(store.traces) == [f"t{i}" for i in range(15, 20)] and store.dropped == 15
    store.add({"trace_id": "t15", "span_id": "x", "parent_id": None, "model_id": None,
               "start": 0})  # t15 is touched: t16 goes first
    assert list(store.traces)[:2] == ["t17", "t18"] and store.spans == 801


def test_spans_exported_over_otlp_grpc(start_proxy, demo_upstream):
    """A real OTLP/gRPC receiver (opentelemetry-proto's service on a grpcio server)."""
    from opentelemetry.proto.collector.trace.v1 import (
        trace_service_pb2,
        trace_service_pb2_grpc,
    )

    from tests.grpc_support import start_grpc_server

    received = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (the generated name)
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server, port = start_grpc_server(
        lambda s: trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), s),
        max_workers=2)
    try:
        from tests.conftest import simple_config

        proxy = start_proxy(simple_config(demo_upstream) + f"""
[tracing]
otlp_endpoint = "127.0.0.1:{port}"
service_name = "edge-1"
""")
        with httpx.Client(timeout=10) as c:
            for i in range(3):
                r = c.get(f"{proxy.url}/echo/{i}",
                          headers={"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"})
                assert r.status_code == 200
        deadline = time.monotonic() + 10
        while sum(len(ss.spans) for req in received for rs in req.resource_spans
                  for ss in rs.scope_spans) < 6:  # a server and a client span each
            assert time.monotonic() < deadline, "spans never exported"
            time.sleep(0.05)
    finally:
        server.stop(0)
    rs = received[0].resource_spans[0]
    assert rs.resource.attributes[0].key == "service.name"
    assert rs.resource.attributes[0].value.string_value == "edge-1"
    every = [s for req in received for r in req.resource_spans for ss in r.scope_spans
             for s in ss.spans]
    assert {s.trace_id.hex() for s in every} == {TRACE}
    spans = [s for s in every if s.kind == 2]  # SERVER
    assert {s.parent_span_id.hex() for s in spans} == {CLIENT_SPAN}
    assert len({s.span_id for s in spans}) == 3
    attempts = [s for s in every if s.kind == 3]  # CLIENT: one upstream attempt each
    assert sorted(s.parent_span_id for s in attempts) == sorted(s.span_id for s in spans)
    attrs = {kv.key: kv.value for kv in spans[0].attributes}
    assert attrs["http.response.status_code"].int_value == 200
    assert attrs["aiproxy.route"].string_value == "all"
    # OpenTelemetry's HTTP server span: server.* is the proxy as addressed, not upstream
    assert attrs["url.scheme"].string_value == "http"
    assert attrs["network.protocol.version"].string_value == "1.1"
    assert attrs["client.address"].string_value == "127.0.0.1"
    assert attrs["server.address"].string_value == "127.0.0.1"
    assert attrs["server.port"].int_value == proxy.port
    assert attrs["aiproxy.upstream.address"].string_value == f"127.0.0.1:{demo_upstream}"
    assert spans[0].end_time_unix_nano > spans[0].start_time_unix_nano


def test_reload_does_not_wait_for_a_slow_collector(start_proxy, demo_upstream):
    """A reload that drops or moves otlp_endpoint stops the old exporter without waiting
    for its export in flight: the reload runs on the event loop, and joining the export
    thread there held every request (and the reload) until the collector answered or the
    export timed out."""
    import threading

    from opentelemetry.proto.collector.trace.v1 import (
        trace_service_pb2,
        trace_service_pb2_grpc,
    )

    from tests.conftest import simple_config
    from tests.grpc_support import start_grpc_server
    from tests.support import admin_block

    entered, release = threading.Event(), threading.Event()
    calls = []

    class Stuck(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (the generated name)
            calls.append(context)
            entered.set()
            release.wait(30)
            return trace_service_pb2.ExportTraceServiceResponse()

    server, port = start_grpc_server(
        lambda s: trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Stuck(), s),
        max_workers=2)
    admin = free_port()
    try:
        base = simple_config(demo_upstream) + admin_block(admin) + "\n[tracing]\n"
        proxy = start_proxy(base + f'otlp_endpoint = "127.0.0.1:{port}"\n')
        wait_port("127.0.0.1", admin)
        assert httpx.get(f"{proxy.url}/echo", timeout=10).status_code == 200
        assert entered.wait(10), "the span was never exported"
        text = proxy.config_path.read_text()
        proxy.config_path.write_text(text.replace(f'otlp_endpoint = "127.0.0.1:{port}"', ""))
        r = httpx.post(f"http://127.0.0.1:{admin}/config/reload", timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{proxy.url}/echo", timeout=30).status_code == 200
        # Both answered while the old exporter's call still waits on the collector.
        assert calls[0].is_active()
    finally:
        release.set()
        server.stop(0)


def test_a_span_keeps_the_first_1024_characters_of_a_long_path(start_proxy, demo_upstream):
    from tests.conftest import simple_config

    admin = free_port()
    proxy = start_proxy(simple_config(demo_upstream)
                        + f'[admin]\naddress = "127.0.0.1:{admin}"\n\n[tracing]\n')
    wait_port("127.0.0.1", admin)
    path = "/echo/" + "p" * 6000
    r = httpx.get(f"{proxy.url}{path}?token=secret", timeout=10,
                  headers={"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"})
    assert r.status_code == 200
    spans = httpx.get(f"http://127.0.0.1:{admin}/lineage/{TRACE}").json()["spans"]
    (span,) = [s for s in spans if s["kind"] == "server"]
    assert span["path"] == path[:1024]


def test_a_request_without_host_is_a_span_too(start_proxy, demo_upstream):
    """HTTP/1.0 needs no Host: its span has none (server.address is left out), and the
    request is recorded like any other."""
    import socket

    from tests.conftest import simple_config

    admin = free_port()
    proxy = start_proxy("[server]\nworkers = 1\n" + simple_config(demo_upstream)
                        + f'[admin]\naddress = "127.0.0.1:{admin}"\n\n[tracing]\n')
    wait_port("127.0.0.1", admin)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"GET /echo HTTP/1.0\r\ntraceparent: 00-%s-%s-01\r\n\r\n"
                  % (TRACE.encode(), CLIENT_SPAN.encode()))
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:100]
    spans = httpx.get(f"http://127.0.0.1:{admin}/lineage/{TRACE}").json()["spans"]
    (span,) = [s for s in spans if s["kind"] == "server"]
    assert span["host"] is None and span["protocol"] == "1.0" and span["path"] == "/echo"


@pytest.mark.parametrize(("host", "attrs"), [
    ("api.example.com", [("server.address", "api.example.com")]),
    ("api.example.com:8443", [("server.address", "api.example.com"), ("server.port", 8443)]),
    ("[::1]:8080", [("server.address", "::1"), ("server.port", 8080)]),
    ("[::1]", [("server.address", "::1")]),
    ("example.com:99999", [("server.address", "example.com")]),
    (None, []),
])
def test_host_becomes_server_address_and_port(host, attrs):
    from aiproxy.governance.otlp import host_attributes

    assert host_attributes(host) == attrs


def test_a_collector_that_is_down_is_reported_now_and_then(start_proxy, demo_upstream):
    """Spans go out every 0.2 s; with no collector listening each export fails at once.
    One warning says so (with how many spans were lost since), not one per batch."""
    from tests.conftest import simple_config
    from tests.support import stop_process

    down = free_port()  # nothing listens there
    proxy = start_proxy("[server]\nworkers = 1\n" + simple_config(demo_upstream)
                        + f'\n[tracing]\notlp_endpoint = "127.0.0.1:{down}"\n')
    with httpx.Client(timeout=10) as c:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:  # a flush or more every 0.2 s, each a failure
            assert c.get(f"{proxy.url}/echo").status_code == 200
            time.sleep(0.02)
    log = stop_process(proxy.proc)
    lines = [line for line in log.splitlines() if "OTLP export" in line]
    assert len(lines) == 1, lines
    assert f"127.0.0.1:{down}" in lines[0]
