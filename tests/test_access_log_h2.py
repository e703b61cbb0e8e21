"""Access log lines and request metrics of HTTP/2 and gRPC: the grpc-status of each call
(a real grpcio client and server, and raw frames), one line for each stream however it
ended (a client's reset, a stream the proxy reset for a protocol error), and requests
cut by the drain deadline told apart from clients that left."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from hyperframe.frame import DataFrame, RstStreamFrame

from tests.conftest import simple_config
from tests.grpc_support import (
    GRPC_OPTIONS,
    SERVICE,
    InferenceServer,
    grpc_modules,  # noqa: F401 - fixture
)
from tests.h2_support import FrameClient, H2Upstream
from tests.support import admin_block, free_port, scrape, wait_ready
from tests.test_access_log import _lines

pytestmark = pytest.mark.timeout(60)


async def _reset_handler(proto: Any, sid: int, path: str, head: dict, body: bytes) -> None:
    """/test.Reset/CODE: response headers, then RST_STREAM(CODE); anything else: no
    answer at all."""
    if path.startswith("/test.Reset/"):
        proto.conn.send_headers(sid, [(b":status", b"200"),
                                      (b"content-type", b"application/grpc")])
        proto.flush()
        await asyncio.sleep(0.05)
        proto.conn.reset_stream(sid, int(path.rsplit("/", 1)[1]))
        proto.flush()


@pytest.fixture(scope="module")
def grpc_upstreams(grpc_modules: tuple[ModuleType, ModuleType]  # noqa: F811
                   ) -> Iterator[tuple[InferenceServer, H2Upstream]]:
    server = InferenceServer(*grpc_modules, "grpc-a")
    hang = H2Upstream(_reset_handler, "hang")
    yield server, hang
    server.stop()
    hang.stop()


def _grpc_call(client: FrameClient, sid: int, path: str,
               extra: list[tuple[str, str]] | None = None) -> None:
    fields = [("content-type", "application/grpc"), ("te", "trailers"), *(extra or [])]
    data = DataFrame(sid, data=b"\x00\x00\x00\x00\x00")
    data.flags.add("END_STREAM")
    client.send(client.request(sid, path, "POST", fields, end_stream=False), data)


def test_grpc_lines_and_metrics_carry_the_grpc_status(
        start_proxy, grpc_upstreams: tuple[InferenceServer, H2Upstream],
        grpc_modules: tuple[ModuleType, ModuleType], tmp_path: Path) -> None:  # noqa: F811
    """The HTTP status of nearly every gRPC call is 200: the line has `grpc_status` as
    the client got it, from the upstream's trailers or trailers-only response, or from
    the proxy's own answer (upstream down: 14, grpc-timeout expired: 4, an upstream's
    RST_STREAM(ENHANCE_YOUR_CALM) after the headers: 8); aiproxy_grpc_calls_total
    counts them by it."""
    pb2, pb2_grpc = grpc_modules
    server, hang = grpc_upstreams
    log = tmp_path / "access.log"
    admin = free_port()
    down = free_port()
    proxy = start_proxy(f"""
[server]
workers = 1
[access_log]
path = "{log}"
flush_interval_ms = 20
{admin_block(admin)}
[[clusters]]
name = "a"
endpoints = ["127.0.0.1:{server.port}"]
protocol = "h2"
[[clusters]]
name = "hang"
endpoints = ["127.0.0.1:{hang.port}"]
protocol = "h2"
[[clusters]]
name = "down"
endpoints = ["127.0.0.1:{down}"]
protocol = "h2"
[[routes]]
name = "down"
match = {{ grpc_service = "test.Down" }}
cluster = "down"
[[routes]]
name = "hang"
match = {{ path_prefix = "/test." }}
cluster = "hang"
[[routes]]
name = "predictor"
match = {{ grpc_service = "{SERVICE}" }}
cluster = "a"
""", 'protocols = ["h2c"]')
    wait_ready(admin)
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}", options=GRPC_OPTIONS) as channel:
        stub = pb2_grpc.PredictorStub(channel)
        assert stub.Predict(pb2.PredictRequest(prompt="hi")).text == "hi"
        with pytest.raises(grpc.RpcError) as failed:
            stub.Predict(pb2.PredictRequest(prompt="fail"))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        tokens = list(stub.StreamTokens(pb2.PredictRequest(prompt="a b c")))
        assert len(tokens) == 3
        unary = channel.unary_unary("/test.Down/Call", request_serializer=None,
                                    response_deserializer=None)
        with pytest.raises(grpc.RpcError) as unavailable:
            unary(b"")
        assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
    with FrameClient(proxy.port) as client:  # raw: no client deadline racing the proxy's
        client.handshake()
        _grpc_call(client, 1, "/test.Hang/Call", [("grpc-timeout", "200m")])
        assert client.response(1).header(b"grpc-status") == b"4"
        _grpc_call(client, 3, "/test.Reset/11")  # ENHANCE_YOUR_CALM
        assert dict(client.response(3).trailers or [])[b"grpc-status"] == b"8"
    lines = _lines(log, 6)
    got = [(x["path"], x["status"], x.get("grpc_status", "absent")) for x in lines]
    assert got == [
        (f"/{SERVICE}/Predict", 200, 0),
        (f"/{SERVICE}/Predict", 200, 3),
        (f"/{SERVICE}/StreamTokens", 200, 0),
        ("/test.Down/Call", 502, 14),
        ("/test.Hang/Call", 504, 4),
        ("/test.Reset/11", 502, 8),
    ], got
    metrics = scrape(admin)
    calls = {dict(labels)["grpc_status"]: value for (name, labels), value in metrics.items()
             if name == "aiproxy_grpc_calls_total"}
    assert calls == {"0": 2, "3": 1, "4": 1, "8": 1, "14": 1}, calls


def test_grpc_call_the_client_cancels_has_no_grpc_status(
        start_proxy, grpc_upstreams: tuple[InferenceServer, H2Upstream],
        grpc_modules: tuple[ModuleType, ModuleType], tmp_path: Path) -> None:  # noqa: F811
    """A call the client cancels got no grpc-status: null, and it is client_closed."""
    pb2, pb2_grpc = grpc_modules
    server, _ = grpc_upstreams
    log = tmp_path / "access.log"
    proxy = start_proxy(f'[access_log]\npath = "{log}"\nflush_interval_ms = 20\n'
                        + simple_config(server.port, cluster_extra='protocol = "h2"'),
                        'protocols = ["h2c"]')
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}", options=GRPC_OPTIONS) as channel:
        stream = pb2_grpc.PredictorStub(channel).StreamTokens(
            pb2.PredictRequest(prompt="a b c d e f"), metadata=[("x-delay-ms", "300")])
        next(stream)
        stream.cancel()
    [line] = _lines(log, 1)
    assert line["grpc_status"] is None and line["client_closed"] is True, line


def test_h2_streams_that_end_in_an_error_get_one_line_each(start_proxy, demo_upstream,
                                                            tmp_path: Path) -> None:
    """RFC 9113 8.1.1: a malformed request is a stream error. One the proxy resets
    before it was a request (a connection-specific field, a `:path` that is no
    request-target) gets a `rejected` line, as HTTP/1.1's 400s do; one whose body does
    not add up to its content-length (at a DATA frame, or at trailers) a line with
    `stream_error` and 400, not the client_closed/499 of a client's own reset, which
    still gets its line."""
    log = tmp_path / "access.log"
    proxy = start_proxy(f'[access_log]\npath = "{log}"\nflush_interval_ms = 20\n'
                        + simple_config(demo_upstream), 'protocols = ["h2c"]')
    base = [(":method", "GET"), (":scheme", "http"), (":authority", "test")]
    with FrameClient(proxy.port) as client:
        client.handshake()
        client.send(client.headers(1, [*base, (":path", "/a"), ("connection", "close")]))
        assert client.response(1).reset == 1
        client.send(client.headers(3, [*base, (":path", "/b c")]))
        assert client.response(3).reset == 1
        short = DataFrame(5, data=b"abc")
        short.flags.add("END_STREAM")
        client.send(client.request(5, "/echo/short", "POST", [("content-length", "10")],
                                   end_stream=False), short)
        assert client.response(5).reset == 1
        client.send(client.request(7, "/echo/trailers", "POST", [("content-length", "10")],
                                   end_stream=False), DataFrame(7, data=b"abc"),
                    client.headers(7, [("x-trailer", "t")]))
        assert client.response(7).reset == 1
        client.send(client.request(9, "/delay/5000", "POST", end_stream=False))
        time.sleep(0.2)  # let it reach the upstream: a reset mid-request
        client.send(RstStreamFrame(9, error_code=8))
        client.send(client.request(11, "/echo/ok"))
        assert client.response(11).status == 200
    lines = _lines(log, 6)
    assert len(lines) == 6, lines
    rejected = [x for x in lines if "rejected" in x]
    assert [(x["protocol"], x["status"], x["method"]) for x in rejected] == [
        ("HTTP/2", 400, None)] * 2, rejected
    by_path = {x["path"]: x for x in lines if x["path"]}
    for path in ("/echo/short", "/echo/trailers"):
        line = by_path[path]
        assert line["status"] == 400 and "content-length" in line["stream_error"], line
        assert "client_closed" not in line
    assert by_path["/delay/5000"]["status"] == 499
    assert by_path["/delay/5000"]["client_closed"] is True
    assert by_path["/echo/ok"]["status"] == 200
    assert not {"client_closed", "stream_error"} & set(by_path["/echo/ok"])


def test_requests_cut_by_the_drain_deadline_say_so(start_proxy, demo_upstream,
                                                   tmp_path: Path) -> None:
    """SIGTERM with drain_timeout_ms: what is still running at the deadline is cut by
    the proxy, and its line says `drained` (503 when no response head had gone out),
    not client_closed; a TCP tunnel's line says `ended: "drained"`."""
    log = tmp_path / "access.log"
    admin = free_port()
    tcp = free_port()
    proxy = start_proxy(f"""
[server]
workers = 1
drain_timeout_ms = 500
[access_log]
path = "{log}"
flush_interval_ms = 20
{admin_block(admin)}
[[listeners]]
name = "tcp"
address = "127.0.0.1:{tcp}"
protocols = ["tcp"]
cluster = "up"
""" + simple_config(demo_upstream), 'protocols = ["http1", "h2c"]')
    wait_ready(admin)
    with (socket.create_connection(("127.0.0.1", proxy.port)) as h1,
          socket.create_connection(("127.0.0.1", tcp)) as tunnel,
          FrameClient(proxy.port) as client):
        h1.sendall(b"GET /delay/10000 HTTP/1.1\r\nHost: a\r\n\r\n")
        client.handshake()
        client.send(client.request(1, "/delay/10000"))
        tunnel.sendall(b"GET /echo/tunnel HTTP/1.1\r\nHost: a\r\n\r\n")
        assert tunnel.recv(12) == b"HTTP/1.1 200"
        deadline = time.monotonic() + 10
        while scrape(admin).get(("aiproxy_active_connections", ())) != 3:
            assert time.monotonic() < deadline, "the connections never arrived"
            time.sleep(0.05)
        proxy.proc.send_signal(signal.SIGTERM)
        assert proxy.proc.wait(10) == 0
    lines = _lines(log, 3)
    http = sorted((x for x in lines if x.get("protocol") != "tcp"), key=lambda x: x["protocol"])
    assert [(x["protocol"], x["path"], x["status"], x.get("drained")) for x in http] == [
        ("HTTP/1.1", "/delay/10000", 503, True), ("HTTP/2", "/delay/10000", 503, True)]
    assert not any("client_closed" in x for x in http), http
    [tunnel_line] = [x for x in lines if x.get("protocol") == "tcp"]
    assert tunnel_line["ended"] == "drained", tunnel_line
