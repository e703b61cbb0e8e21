"""gRPC through aiproxy: a real grpcio client -> aiproxy (listeners ["h2c"],
["http1", "h2c"] and TLS ["h2"]) -> a real grpcio server (cluster protocol = "h2"), for
all four call kinds, metadata and trailers, 4 MiB
messages, deadlines, cancellation, a dying upstream, the proxy's own errors and routing
by gRPC service/method. Raw HTTP/2 frames (tests/h2_support.py) check the wire form
where grpcio would hide it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from hyperframe.frame import DataFrame, HeadersFrame, RstStreamFrame

from tests.grpc_support import (
    GRPC_OPTIONS,
    SERVICE,
    InferenceServer,
    grpc_modules,  # noqa: F401 - fixture
)
from tests.h2_support import FrameClient, H2Upstream, Pki, ProxyProc, make_pki, wait_for
from tests.support import free_port, raw_exchange, start_process, stop_process, wait_port

MiB = 1024 * 1024
pytestmark = pytest.mark.timeout(60)

LISTENERS = """
[[listeners]]
name = "h2c"
address = "127.0.0.1:{h2c}"
protocols = ["h2c"]

[[listeners]]
name = "mixed"
address = "127.0.0.1:{mixed}"
protocols = ["http1", "h2c"]
"""


def grpc_request(client: FrameClient, sid: int, path: str, body: bytes = b"",
                 extra: list[tuple[str, str]] | None = None) -> list[Any]:
    """Frames for a gRPC call from a raw client: HEADERS, then one length-prefixed message."""
    fields = [("content-type", "application/grpc"), ("te", "trailers"), *(extra or [])]
    head = client.request(sid, path, "POST", fields, end_stream=False)
    data = DataFrame(sid, data=b"\x00" + len(body).to_bytes(4, "big") + body)
    data.flags.add("END_STREAM")
    return [head, data]


# -- fixtures ---------------------------------------------------------------------------------


async def hang_handler(proto: Any, sid: int, path: str, head: dict, body: bytes) -> None:
    """An h2 upstream that ignores grpc-timeout: /test.Hang/Head sends response headers
    and then nothing; /test.Reset/CODE sends them and then RST_STREAM(CODE); anything
    else sends nothing at all (and /test.Stall/... never acknowledges request DATA: see
    H2Upstream)."""
    if path.endswith("/Head") or path.startswith("/test.Reset/"):
        proto.conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
        proto.flush()
    if path.startswith("/test.Reset/"):
        await asyncio.sleep(0.05)
        proto.conn.reset_stream(sid, int(path.rsplit("/", 1)[1]))
        proto.flush()


@pytest.fixture(scope="module")
def servers(grpc_modules: tuple[ModuleType, ModuleType]) -> Iterator[dict[str, Any]]:  # noqa: F811
    pb2, pb2_grpc = grpc_modules
    a = InferenceServer(pb2, pb2_grpc, "grpc-a")
    b = InferenceServer(pb2, pb2_grpc, "grpc-b")
    hang = H2Upstream(hang_handler, "hang")
    yield {"a": a, "b": b, "hang": hang}
    a.stop()
    b.stop()
    hang.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("grpc-pki"))


@pytest.fixture(scope="module")
def proxy(servers: dict[str, Any], pki: Pki,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    down = free_port()
    config = LISTENERS + f"""
[[listeners]]
name = "tls"
address = "127.0.0.1:{{tls}}"
protocols = ["h2"]
tls = {{ cert = "{pki.cert}", key = "{pki.key}" }}
[[clusters]]
name = "a"
endpoints = ["127.0.0.1:{servers["a"].port}"]
protocol = "h2"

[[clusters]]
name = "b"
endpoints = ["127.0.0.1:{servers["b"].port}"]
protocol = "h2"

[[clusters]]
name = "hang"
endpoints = ["127.0.0.1:{servers["hang"].port}"]
protocol = "h2"

[[clusters]]
name = "down"
endpoints = ["127.0.0.1:{down}"]
protocol = "h2"

[[routes]]
name = "upload-to-b"
match = {{ grpc_service = "{SERVICE}", grpc_method = "Upload" }}
cluster = "b"

[[routes]]
name = "hang"
match = {{ grpc_service = "test.Hang" }}
cluster = "hang"

[[routes]]
name = "stall"
match = {{ grpc_service = "test.Stall" }}
cluster = "hang"

[[routes]]
name = "reset"
match = {{ grpc_service = "test.Reset" }}
cluster = "hang"

[[routes]]
name = "down"
match = {{ grpc_service = "test.Down" }}
cluster = "down"

[[routes]]
name = "predictor"
match = {{ grpc_service = "{SERVICE}" }}
cluster = "a"
"""
    p = ProxyProc(tmp_path_factory.mktemp("grpc-proxy"), config, ("h2c", "mixed", "tls"))
    yield p
    p.stop()


@pytest.fixture(params=["h2c", "mixed", "tls"])
def channel(request: pytest.FixtureRequest, proxy: ProxyProc, pki: Pki) -> Iterator[grpc.Channel]:
    target = f"127.0.0.1:{proxy.ports[request.param]}"
    if request.param == "tls":
        creds = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
        ch = grpc.secure_channel(target, creds, options=GRPC_OPTIONS)
    else:
        ch = grpc.insecure_channel(target, options=GRPC_OPTIONS)
    grpc.channel_ready_future(ch).result(timeout=10)
    yield ch
    ch.close()


@pytest.fixture
def stub(channel: grpc.Channel, grpc_modules: tuple[ModuleType, ModuleType]) -> Any:  # noqa: F811
    return grpc_modules[1].PredictorStub(channel)


@pytest.fixture
def pb(grpc_modules: tuple[ModuleType, ModuleType]) -> ModuleType:  # noqa: F811
    return grpc_modules[0]


def raw_call(channel: grpc.Channel, path: str, timeout: float = 10) -> grpc.RpcError:
    """A unary call to any path with raw bytes; returns the error it must end with."""
    call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as info:
        call(b"\x0a\x01x", timeout=timeout)
    return info.value


@pytest.fixture(scope="module")
def inspecting_proxy(servers: dict[str, Any],
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    """[llm] and [cache] on every route: both wait for a JSON body's first bytes."""
    config = LISTENERS + f"""
[llm]
[cache]

[[clusters]]
name = "a"
endpoints = ["127.0.0.1:{servers["a"].port}"]
protocol = "h2"

[[routes]]
name = "predictor"
match = {{ grpc_service = "{SERVICE}" }}
cluster = "a"
"""
    p = ProxyProc(tmp_path_factory.mktemp("grpc-inspecting"), config, ("h2c", "mixed"))
    yield p
    p.stop()


def test_streaming_calls_are_not_held_for_body_inspection(
        inspecting_proxy: ProxyProc, grpc_modules: tuple[ModuleType, ModuleType]  # noqa: F811
) -> None:
    """A section that inspects request bodies waits for a gRPC call's first message, not
    for 64 KiB or the end of the stream: a client that waits for the answer to each
    message would otherwise wait forever."""
    pb, pb_grpc = grpc_modules
    with grpc.insecure_channel(f"127.0.0.1:{inspecting_proxy.ports['h2c']}",
                               options=GRPC_OPTIONS) as ch:
        stub = pb_grpc.PredictorStub(ch)
        requests: queue.Queue = queue.Queue()
        call = stub.Chat(iter(requests.get, None), timeout=10)
        for i in range(3):
            requests.put(pb.PredictRequest(prompt=f"m{i}"))
            assert next(call).text == f"echo:m{i}"
        requests.put(None)
        assert list(call) == [] and call.code() == grpc.StatusCode.OK


# -- the four call kinds --------------------------------------------------------------------


def test_unary_metadata_and_trailers(stub: Any, pb: ModuleType, servers: dict) -> None:
    reply, call = stub.Predict.with_call(
        pb.PredictRequest(model="m1", prompt="hello", payload=b"\x00\x01abc"),
        metadata=[("x-echo", "echoed"), ("x-custom-bin", b"\x00\xff\x10")], timeout=10)
    assert (reply.model, reply.text, reply.payload, reply.count) == (
        "grpc-a:m1", "hello", b"\x00\x01abc", 5)
    assert ("x-echo", "echoed") in [(m.key, m.value) for m in call.initial_metadata()]
    trailers = {m.key: m.value for m in call.trailing_metadata()}
    assert trailers["x-trailer"] == "done-m1"
    assert trailers["x-trailer-bin"] == b"\x00\x01\xfe\xff"
    assert call.code() == grpc.StatusCode.OK
    seen = servers["a"].recorder.metadata[-1]
    assert seen["@method"] == "Predict"
    assert seen["x-custom-bin"] == b"\x00\xff\x10"


def test_abort_status_message_and_trailers(stub: Any, pb: ModuleType) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(pb.PredictRequest(model="m2", prompt="fail"), timeout=10)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "prompt 'fail' is not allowed: ü"  # percent-encoded on the wire
    trailers = {m.key: m.value for m in err.trailing_metadata()}
    assert trailers["x-trailer"] == "done-m2"
    assert trailers["x-trailer-bin"] == b"\x00\x01\xfe\xff"


def test_server_streaming_arrives_message_by_message(stub: Any, pb: ModuleType) -> None:
    start = time.monotonic()
    call = stub.StreamTokens(pb.PredictRequest(prompt="one two three four five"),
                             metadata=[("x-delay-ms", "300")], timeout=20)
    arrivals = []
    texts = []
    for token in call:
        arrivals.append(time.monotonic() - start)
        texts.append((token.index, token.text))
    assert texts == list(enumerate(["one", "two", "three", "four", "five"]))
    # The server sleeps 300 ms between tokens: each must be seen as it is sent, not
    # when the stream ends.
    assert arrivals[0] < 0.6, arrivals  # the whole stream takes 1.2 s
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert all(gap > 0.2 for gap in gaps), arrivals
    assert {m.key: m.value for m in call.trailing_metadata()}["x-count"] == "5"
    assert call.code() == grpc.StatusCode.OK


def test_client_streaming_routed_by_method(stub: Any, pb: ModuleType, servers: dict) -> None:
    blocks = [os.urandom(64 * 1024) for _ in range(20)]
    digest = hashlib.sha256(b"".join(blocks)).hexdigest()
    before_a = len(servers["a"].recorder.metadata)
    reply = stub.Upload(iter(pb.PredictRequest(payload=b) for b in blocks), timeout=20)
    assert (reply.model, reply.count, reply.text) == ("grpc-b", 20, digest)
    assert int.from_bytes(reply.payload, "big") == 20 * 64 * 1024
    # grpc_method = "Upload" sent it to cluster b; Predict goes to a.
    assert servers["b"].recorder.metadata[-1]["@method"] == "Upload"
    assert len(servers["a"].recorder.metadata) == before_a
    assert stub.Predict(pb.PredictRequest(model="x"), timeout=10).model == "grpc-a:x"
    assert servers["a"].recorder.metadata[-1]["@method"] == "Predict"


def test_bidi_lockstep(stub: Any, pb: ModuleType) -> None:
    """Each message is sent only after the previous echo arrived: any buffering of
    either direction in the proxy would deadlock this."""
    requests: queue.Queue = queue.Queue()

    def gen() -> Iterator[Any]:
        while True:
            item = requests.get()
            if item is None:
                return
            yield item

    call = stub.Chat(gen(), timeout=20)
    for i in range(10):
        requests.put(pb.PredictRequest(prompt=f"m{i}", payload=bytes([i]) * (i * 1000)))
        reply = next(call)
        assert (reply.text, reply.count, reply.payload) == (f"echo:m{i}", i + 1,
                                                            bytes([i]) * (i * 1000))
    requests.put(None)
    assert list(call) == []
    assert call.code() == grpc.StatusCode.OK


def test_4mib_messages_all_kinds(stub: Any, pb: ModuleType) -> None:
    big = os.urandom(4 * MiB)
    reply = stub.Predict(pb.PredictRequest(model="big", payload=big), timeout=30)
    assert reply.payload == big and reply.count == len(big)

    reply = stub.Upload(iter([pb.PredictRequest(payload=big)] * 3), timeout=30)
    assert reply.count == 3 and int.from_bytes(reply.payload, "big") == 3 * len(big)

    tokens = list(stub.StreamTokens(pb.PredictRequest(prompt="a b"),
                                    metadata=[("x-token-bytes", str(4 * MiB))], timeout=30))
    assert [len(t.text) for t in tokens] == [4 * MiB + 1] * 2

    replies = list(stub.Chat(iter([pb.PredictRequest(prompt="c", payload=big)] * 2), timeout=30))
    assert [r.payload == big for r in replies] == [True, True]


# -- deadlines and cancellation -------------------------------------------------------------------


def test_client_deadline_shorter_than_server_sleep(stub: Any, pb: ModuleType,
                                                   servers: dict) -> None:
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(pb.PredictRequest(prompt="sleep:5000"), timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The upstream's call ends too, long before its 5 s (the proxy resets the stream;
    # the grpc-timeout it forwards would also end it).
    assert servers["a"].recorder.when("cancelled:Predict", 3, since=start) is not None


def test_grpc_timeout_is_the_upstream_deadline(proxy: ProxyProc, servers: dict) -> None:
    """The upstream here ignores grpc-timeout and never answers, and this client does not
    enforce it: only the proxy can end the call. It must answer DEADLINE_EXCEEDED as a
    trailers-only response at about the deadline, and reset the upstream stream."""
    hang: H2Upstream = servers["hang"]
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        start = time.monotonic()
        c.send(*grpc_request(c, 1, "/test.Hang/Silent", b"x", [("grpc-timeout", "700m")]))
        resp = c.response(1, timeout=10)
        elapsed = time.monotonic() - start
    assert elapsed > 0.6, elapsed  # not before the deadline; not never: timeout=10 above
    assert resp.status == 200 and resp.trailers is None and resp.body == b""
    assert resp.header(b"content-type") == b"application/grpc"
    assert resp.header(b"grpc-status") == b"4"  # DEADLINE_EXCEEDED
    assert wait_for(lambda: any(ev[1] == "reset" for ev in hang.events if ev[0] >= start), 3), \
        hang.events


def test_expired_grpc_timeout_then_another_stream(proxy: ProxyProc, servers: dict) -> None:
    """A grpc-timeout already spent on arrival ("0n") has the connection's timer armed for
    now, which uvloop makes a plain Handle (no when()). The next stream on the connection
    compared its own deadline with that timer's and raised: the connection was dropped
    with neither stream answered (found by fuzzing). Both must be answered."""
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(c.request(1, "/test.Hang/Silent", "POST", [
            ("content-type", "application/grpc"), ("te", "trailers"), ("grpc-timeout", "0n")],
            end_stream=False))
        c.send(*grpc_request(c, 3, f"/{SERVICE}/Predict", b"\x12\x02hi",
                             [("grpc-timeout", "5S")]))
        first = c.response(1, timeout=10)
        second = c.response(3, timeout=10)
    assert first.status == 200 and first.header(b"grpc-status") == b"4", first
    assert second.status == 200 and second.trailers is not None, second
    assert (b"grpc-status", b"0") in second.trailers, second
    assert "Traceback" not in proxy.log()


def test_grpc_timeout_over_http1(proxy: ProxyProc, servers: dict) -> None:
    """A gRPC request over HTTP/1.1 (a gRPC-Web or bridge client sends grpc-timeout too)
    to an upstream that never answers: the proxy ends it at about the deadline, not at
    its connection timer's next round (min_timeout, 60 s here), and resets the upstream
    stream."""
    hang: H2Upstream = servers["hang"]
    msg = b"\x00\x00\x00\x00\x01x"
    start = time.monotonic()
    raw = raw_exchange(proxy.ports["mixed"], b"POST /test.Hang/Silent HTTP/1.1\r\n"
                       b"Host: test\r\ncontent-type: application/grpc\r\nte: trailers\r\n"
                       b"grpc-timeout: 700m\r\ncontent-length: %d\r\n\r\n%s" % (len(msg), msg),
                       until=b"deadline_exceeded", timeout=15)
    elapsed = time.monotonic() - start
    assert raw.startswith(b"HTTP/1.1 504 "), raw
    assert b"deadline_exceeded" in raw
    assert elapsed > 0.6, elapsed  # not before the deadline; not never: timeout=15 above
    assert wait_for(lambda: any(ev[1] == "reset" for ev in hang.events if ev[0] >= start), 3), \
        hang.events


@pytest.mark.parametrize("code,status", [(8, b"1"), (11, b"8"), (7, b"14"), (2, b"13")],
                         ids=["cancel", "enhance_your_calm", "refused_stream", "internal_error"])
def test_upstream_reset_after_headers_maps_to_its_status(proxy: ProxyProc, code: int,
                                                         status: bytes) -> None:
    """gRPC's PROTOCOL-HTTP2.md: an RST_STREAM code means a status (CANCEL: CANCELLED,
    ENHANCE_YOUR_CALM: RESOURCE_EXHAUSTED, REFUSED_STREAM: UNAVAILABLE, others:
    INTERNAL). Past the response headers the proxy ends the call with that status in
    trailers, where a reset of its own would read as INTERNAL whatever happened."""
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(*grpc_request(c, 1, f"/test.Reset/{code}", b"x", []))
        resp = c.response(1, timeout=10)
    assert resp.status == 200 and resp.reset is None and resp.trailers is not None, resp
    assert (b"grpc-status", status) in resp.trailers, resp


def test_grpc_timeout_after_response_headers(proxy: ProxyProc, servers: dict) -> None:
    """Same, with the upstream's response headers already forwarded: the call cannot be
    trailers-only any more; it must still end at the deadline, with grpc-status 4
    trailers (a RST_STREAM reads as INTERNAL), and the upstream stream must be reset."""
    hang: H2Upstream = servers["hang"]
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        start = time.monotonic()
        c.send(*grpc_request(c, 1, "/test.Hang/Head", b"x", [("grpc-timeout", "700m")]))
        resp = c.response(1, timeout=10)
        elapsed = time.monotonic() - start
    assert elapsed > 0.6, elapsed  # not before the deadline; not never: timeout=10 above
    assert resp.status == 200
    assert resp.reset is None and resp.trailers is not None, resp
    assert (b"grpc-status", b"4") in resp.trailers, resp
    assert wait_for(lambda: any(ev[1] == "reset" for ev in hang.events if ev[0] >= start), 3), \
        hang.events


# Filters that leave a call's response body alone: [tracing] (on in
# config/aiproxy.toml) and a rate limit, whose filter only reads the body (to charge an
# LLM response's tokens) and holds none of it back.
CALL_FILTERS = {"tracing": "[tracing]\n",
                "ratelimit": '[[ratelimits]]\nname = "calls"\nrequests_per_second = 1000\n'}


@pytest.fixture(scope="module", params=list(CALL_FILTERS))
def filtered_proxy(request: pytest.FixtureRequest, servers: dict[str, Any],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    """Every call has a filter that leaves its response body alone."""
    config = LISTENERS + CALL_FILTERS[request.param] + f"""

[[clusters]]
name = "hang"
endpoints = ["127.0.0.1:{servers["hang"].port}"]
protocol = "h2"

[[routes]]
name = "hang"
match = {{ path_prefix = "/test.Hang/" }}
cluster = "hang"
"""
    p = ProxyProc(tmp_path_factory.mktemp("grpc-filtered"), config, ("h2c", "mixed"))
    yield p
    p.stop()


def test_grpc_timeout_after_response_headers_with_filters(filtered_proxy: ProxyProc,
                                                          servers: dict) -> None:
    """As above with [tracing] or a rate limit on: their filters change nothing of the
    response, so the call still ends with grpc-status 4 trailers, not the
    RST_STREAM(INTERNAL_ERROR) that grpcio callers read as INTERNAL "Received RST_STREAM
    with error code 2"."""
    hang: H2Upstream = servers["hang"]
    with FrameClient(filtered_proxy.ports["h2c"]) as c:
        c.handshake()
        start = time.monotonic()
        c.send(*grpc_request(c, 1, "/test.Hang/Head", b"x", [("grpc-timeout", "700m")]))
        resp = c.response(1, timeout=10)
    assert resp.status == 200
    assert resp.reset is None and resp.trailers is not None, resp
    assert (b"grpc-status", b"4") in resp.trailers, resp
    assert wait_for(lambda: any(ev[1] == "reset" for ev in hang.events if ev[0] >= start), 3), \
        hang.events


def test_cancel_server_stream_reaches_upstream(stub: Any, pb: ModuleType, servers: dict,
                                               request: pytest.FixtureRequest) -> None:
    tag = request.node.name
    call = stub.StreamTokens(pb.PredictRequest(prompt=" ".join(["w"] * 100)),
                             metadata=[("x-delay-ms", "100"), ("x-tag", tag)], timeout=30)
    assert next(call).index == 0
    assert next(call).index == 1
    call.cancel()
    assert call.code() == grpc.StatusCode.CANCELLED
    rec = servers["a"].recorder
    # The upstream's call ends well before its 10 s of tokens are up. "end" (its
    # termination callback) rather than "cancelled": a cancel that lands while grpc is
    # still sending a token stops the handler's generator without resuming it.
    assert rec.when(f"end:StreamTokens#{tag}", 3) is not None, rec.names()
    assert rec.when(f"done:StreamTokens#{tag}", 0) is None


def test_cancel_bidi_reaches_upstream(stub: Any, pb: ModuleType, servers: dict,
                                      request: pytest.FixtureRequest) -> None:
    tag = request.node.name
    requests: queue.Queue = queue.Queue()
    call = stub.Chat(iter(requests.get, None), metadata=[("x-tag", tag)], timeout=30)
    requests.put(pb.PredictRequest(prompt="first"))
    assert next(call).text == "echo:first"
    requests.put(pb.PredictRequest(prompt="sleep:10000"))
    rec = servers["a"].recorder
    time.sleep(0.3)  # the upstream is in its 10 s sleep, watching its context
    call.cancel()
    assert rec.when(f"cancelled:Chat#{tag}", 3) is not None, rec.names()
    assert rec.when(f"end:Chat#{tag}", 3) is not None, rec.names()
    assert rec.when(f"done:Chat#{tag}", 0) is None
    requests.put(None)


def test_stalled_upload_does_not_block_other_calls_on_the_channel(channel: grpc.Channel,
                                                                   stub: Any,
                                                                   pb: ModuleType) -> None:
    """Client-streaming calls to an upstream that stopped reading share the client's one
    HTTP/2 connection with other calls: they may hold back their own streams' windows,
    not the connection's, or every other call on the channel would hang."""
    upload = channel.stream_unary("/test.Stall/Upload", request_serializer=None,
                                  response_deserializer=None)
    block = b"\x0a\x80\x80\x04" + b"s" * 65536  # one 64 KiB message

    stalled = [upload.future(iter([block] * 64), timeout=30) for _ in range(24)]
    try:
        time.sleep(1.5)  # the stalled calls have filled every window they can
        start = time.monotonic()
        reply = stub.Predict(pb.PredictRequest(model="through"), timeout=10)
        assert reply.model == "grpc-a:through"
        assert time.monotonic() - start < 3
    finally:
        for f in stalled:
            f.cancel()


# -- errors -----------------------------------------------------------------------------------


def test_no_route_is_unimplemented(channel: grpc.Channel) -> None:
    err = raw_call(channel, "/no.Such/Method")
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert err.details()


def test_upstream_down_is_unavailable(channel: grpc.Channel) -> None:
    err = raw_call(channel, "/test.Down/Predict")
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_upstream_trailers_only_passes_through(channel: grpc.Channel) -> None:
    """The upstream's own UNIMPLEMENTED (a method it does not have): a trailers-only
    response from the upstream reaches the client as one, also while the client is still
    streaming its request."""
    err = raw_call(channel, f"/{SERVICE}/NoSuchMethod")
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED

    def slow() -> Iterator[bytes]:
        for _ in range(50):
            yield b"\x0a\x01x"
            time.sleep(0.02)

    call = channel.stream_unary(f"/{SERVICE}/NoSuchStream", request_serializer=None,
                                response_deserializer=None)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        call(slow(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("path,status", [("/no.Such/Method", b"12"), ("/test.Down/M", b"14")])
def test_proxy_errors_are_trailers_only(proxy: ProxyProc, path: str, status: bytes) -> None:
    """One HEADERS frame with END_STREAM: :status 200, application/grpc, grpc-status,
    grpc-message (https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md)."""
    with FrameClient(proxy.ports["h2c"]) as c:
        c.handshake()
        c.send(*grpc_request(c, 1, path, b"x"))
        frames = c.frames_until(lambda f: f.stream_id == 1 and "END_STREAM" in f.flags)
    on_stream = [f for f in frames if f.stream_id == 1]
    assert len(on_stream) == 1 and isinstance(on_stream[0], HeadersFrame), on_stream
    fields = dict(on_stream[0].decoded)
    assert fields[b":status"] == b"200"
    assert fields[b"content-type"] == b"application/grpc"
    assert fields[b"grpc-status"] == status
    assert fields[b"grpc-message"]
    assert not any(isinstance(f, RstStreamFrame) for f in frames)


# -- an upstream going away gracefully ------------------------------------------------------------


def test_upload_across_upstream_goaway_loses_nothing(tmp_path: Path,
                                                     grpc_modules: tuple[ModuleType, ModuleType],  # noqa: F811
                                                     ) -> None:
    """The upstream stops gracefully (GOAWAY naming this stream as one it still
    processes, RFC 9113 6.8) while a client-streaming call is sending fast: every message
    the client sent reaches it. h2 empties its send buffer on a GOAWAY, so request DATA
    the proxy had queued but not yet written was dropped: the call ended OK with
    messages missing. Several rounds: the loss needs a GOAWAY read in the same loop turn
    as client DATA."""
    pb2, pb2_grpc = grpc_modules
    port = free_port()
    config = LISTENERS + f"""
[[clusters]]
name = "up"
endpoints = ["127.0.0.1:{port}"]
protocol = "h2"

[[routes]]
name = "all"
cluster = "up"
"""
    proxy = ProxyProc(tmp_path, config, ("h2c", "mixed"))
    n = 400
    try:
        for _ in range(5):
            server = InferenceServer(pb2, pb2_grpc, "up", port)
            ch = grpc.insecure_channel(f"127.0.0.1:{proxy.ports['h2c']}", options=GRPC_OPTIONS)

            def messages(srv: InferenceServer = server) -> Iterator[Any]:
                for i in range(n):
                    if i == n // 2:
                        srv.server.stop(grace=10)  # GOAWAY; calls in flight may finish
                    yield pb2.PredictRequest(payload=b"x" * 4096)

            try:
                reply = grpc_modules[1].PredictorStub(ch).Upload(messages(), timeout=20)
            finally:
                ch.close()
                server.stop()
            assert (reply.count, int.from_bytes(reply.payload, "big")) == (n, n * 4096)
    finally:
        proxy.stop()


# -- a dying upstream ---------------------------------------------------------------------------


@pytest.fixture(params=["h2c", "mixed"])
def killable(request: pytest.FixtureRequest, tmp_path: Path,
             grpc_modules: tuple[ModuleType, ModuleType]) -> Iterator[Any]:  # noqa: F811
    """A grpcio server in its own process, and a proxy in front of it; the client's
    channel goes to the h2c-only listener or to the mixed one (HTTP/1.1 and h2c prior
    knowledge on one port): a call must end the same way on both."""
    port = free_port()
    server = start_process([sys.executable, "-m", "tests.grpc_support", "--gen",
                            str(tmp_path / "gen"), "--port", str(port), "--name", "doomed"])
    proxy = None
    try:
        wait_port("127.0.0.1", port, proc=server, timeout=20)
        config = LISTENERS + f"""
[[clusters]]
name = "doomed"
endpoints = ["127.0.0.1:{port}"]
protocol = "h2"

[[routes]]
name = "all"
cluster = "doomed"
"""
        proxy = ProxyProc(tmp_path, config, ("h2c", "mixed"))
        ch = grpc.insecure_channel(f"127.0.0.1:{proxy.ports[request.param]}",
                                   options=GRPC_OPTIONS)
        yield server, grpc_modules[1].PredictorStub(ch), proxy
        ch.close()
    finally:
        stop_process(server)
        if proxy is not None:
            proxy.stop()


def _kill(proc: Any) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(5)


def test_upstream_killed_mid_stream(killable: Any, pb: ModuleType) -> None:
    server, stub, proxy = killable
    call = stub.StreamTokens(pb.PredictRequest(prompt=" ".join(["w"] * 100)),
                             metadata=[("x-delay-ms", "100")], timeout=30)
    assert next(call).index == 0
    start = time.monotonic()
    _kill(server)
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    assert time.monotonic() - start < 5
    # As with the upstream directly (its socket closed): not the INTERNAL an
    # RST_STREAM(INTERNAL_ERROR) of the proxy's would read as.
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value


def test_upstream_killed_before_unary_reply(killable: Any, pb: ModuleType) -> None:
    server, stub, proxy = killable
    assert stub.Predict(pb.PredictRequest(model="warm"), timeout=10).model == "doomed:warm"
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            stub.Predict(pb.PredictRequest(prompt="sleep:5000"), timeout=20)
        except grpc.RpcError as exc:
            result["error"] = exc

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.5)  # the call is in the upstream's handler
    start = time.monotonic()
    _kill(server)
    t.join(10)
    assert not t.is_alive()
    assert time.monotonic() - start < 5
    assert result["error"].code() == grpc.StatusCode.UNAVAILABLE, result
    # The next call fails fast too: the upstream is gone.
    err = raw_call(grpc.insecure_channel(f"127.0.0.1:{proxy.ports['mixed']}"),
                   f"/{SERVICE}/Predict")
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_upstream_graceful_shutdown_lets_calls_finish(killable: Any, pb: ModuleType) -> None:
    """SIGTERM to the upstream: grpcio sends GOAWAY and finishes the calls in flight.
    The proxy must keep relaying those streams to the end, not fail them."""
    server, stub, proxy = killable
    call = stub.StreamTokens(pb.PredictRequest(prompt=" ".join(f"w{i}" for i in range(10))),
                             metadata=[("x-delay-ms", "150")], timeout=30)
    assert next(call).index == 0
    server.send_signal(signal.SIGTERM)
    rest = [t.index for t in call]
    assert rest == list(range(1, 10))
    assert call.code() == grpc.StatusCode.OK
    assert server.wait(10) == 0
