"""gRPC through aiproxy as real grpcio users drive it: keepalive pings, deadlines seen by
the upstream, cancellation of every streaming kind, messages over 4 MiB, hundreds of
streams on one channel, a slow reader, binary and large metadata, status details,
gzip, the gRPC health service, and upstreams that fail in the ways gRPC names
(PROTOCOL-HTTP2.md, http-grpc-status-mapping.md). Clients and servers are grpcio; raw
h2 upstreams (tests/h2_support.py) play the misbehaving ones."""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from tests.grpc_support import GRPC_OPTIONS, Recorder
from tests.h2_support import H2Upstream, Pki, ProxyProc, make_pki
from tests.support import free_port

MiB = 1024 * 1024
pytestmark = pytest.mark.timeout(90)
LAB = "lab.v1.Lab"
HEALTH = "grpc.health.v1.Health"
# grpcio refuses metadata over 8 KiB by default: raised on both ends to see the proxy's limits.
BIG_METADATA = [("grpc.max_metadata_size", 64 * 1024),
                ("grpc.absolute_max_metadata_size", 64 * 1024)]


# -- a raw-bytes grpcio service ----------------------------------------------------------------


class Lab:
    """Handlers on raw bytes (no generated code): each records what it saw."""

    def __init__(self) -> None:
        self.rec = Recorder()
        self.produced: dict[str, int] = {}
        self.deadlines: list[float | None] = []
        self.holds: dict[str, threading.Event] = {}

    def hold(self, tag: str) -> threading.Event:
        """An event that Early calls tagged `tag` with x-hold wait for before their message."""
        return self.holds.setdefault(tag, threading.Event())

    def _md(self, context: grpc.ServicerContext) -> dict[str, Any]:
        return dict(context.invocation_metadata())

    def _watch(self, context: Any, seconds: float) -> bool:
        """Sleep unless the call ends first; True if it ended."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if not context.is_active():
                return True
            time.sleep(0.01)
        return False

    def echo(self, request: bytes, context: Any) -> bytes:
        md = self._md(context)
        self.deadlines.append(context.time_remaining())
        if "x-compress" in md:
            context.set_compression(grpc.Compression.Gzip)
        if "x-meta-bytes" in md:
            n = int(md["x-meta-bytes"])
            context.send_initial_metadata((("x-big", "i" * n), ("x-big-bin", b"\xff" * n)))
            context.set_trailing_metadata((("x-big-trailer", "t" * n),))
        if "x-sleep-ms" in md and self._watch(context, int(md["x-sleep-ms"]) / 1000):
            self.rec.add("cancelled:echo", md.get("x-tag"))
            return b""
        self.rec.add("done:echo", md.get("x-tag"))
        return request

    def details(self, request: bytes, context: Any) -> bytes:
        context.set_trailing_metadata((("grpc-status-details-bin", request),
                                       ("x-why-bin", b"\x00\x80\xff")))
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "with details")

    def count(self, request: bytes, context: Any) -> Iterator[bytes]:
        """Server stream: x-n messages of x-size bytes, as fast as they are taken."""
        md = self._md(context)
        tag = md.get("x-tag", "")
        n, size = int(md.get("x-n", "10")), int(md.get("x-size", "1024"))
        delay = int(md.get("x-delay-ms", "0")) / 1000
        block = b"c" * size
        done = False

        def ended() -> None:
            if not done:
                self.rec.add("cancelled:count", tag)

        # At the call's end, not after the loop: grpcio stops taking messages from this
        # generator once the call is cancelled while a message is still being sent, and
        # the code below the loop never runs (seen on a loaded machine).
        if not context.add_callback(ended):
            ended()
        for i in range(n):
            if delay and self._watch(context, delay):
                return
            if not context.is_active():
                return
            self.produced[tag] = i + 1
            yield block
        if context.is_active():
            done = True
            self.rec.add("done:count", tag)

    def early(self, request: bytes, context: Any) -> Iterator[bytes]:
        """Initial metadata at once, the only message a second later (with x-hold: once
        the test sets hold(tag), or the call ends)."""
        md = self._md(context)
        tag = md.get("x-tag")
        context.send_initial_metadata((("x-early", "yes"),))
        if "x-hold" in md:
            go = self.hold(tag)
            while not go.wait(0.01):
                if not context.is_active():
                    self.rec.add("cancelled:early", tag)
                    return
        elif self._watch(context, 1.0):
            self.rec.add("cancelled:early", tag)
            return
        yield b"late"

    def upload(self, requests: Iterator[bytes], context: Any) -> bytes:
        tag = self._md(context).get("x-tag")
        total = 0
        try:
            for r in requests:
                total += len(r)
                self.rec.add("part:upload", tag)
        except Exception:
            pass
        # grpcio ends the request iterator when the stream's last message is in, and may
        # see a RST_STREAM that came with it only a moment later: a cancelled call shows
        # as inactive within that moment, one the client ended properly stays active.
        if self._watch(context, 1.0):
            self.rec.add("cancelled:upload", tag)
            return b""
        self.rec.add("done:upload", tag)
        return total.to_bytes(8, "big")

    def chat(self, requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        md = self._md(context)
        if "x-compress" in md:
            context.set_compression(grpc.Compression.Gzip)
        yield from requests

    def health_check(self, request: bytes, context: Any) -> bytes:
        return b"\x08\x01"  # HealthCheckResponse{status: SERVING}

    def health_watch(self, request: bytes, context: Any) -> Iterator[bytes]:
        yield b"\x08\x01"
        self._watch(context, 0.3)
        yield b"\x08\x02"  # NOT_SERVING

    def register(self, server: grpc.Server) -> None:
        h = grpc
        server.add_generic_rpc_handlers((
            h.method_handlers_generic_handler(LAB, {
                "Echo": h.unary_unary_rpc_method_handler(self.echo),
                "Details": h.unary_unary_rpc_method_handler(self.details),
                "Count": h.unary_stream_rpc_method_handler(self.count),
                "Early": h.unary_stream_rpc_method_handler(self.early),
                "Upload": h.stream_unary_rpc_method_handler(self.upload),
                "Chat": h.stream_stream_rpc_method_handler(self.chat),
            }),
            h.method_handlers_generic_handler(HEALTH, {
                "Check": h.unary_unary_rpc_method_handler(self.health_check),
                "Watch": h.unary_stream_rpc_method_handler(self.health_watch),
            }),
        ))


# -- misbehaving h2 upstreams --------------------------------------------------------------------


async def bad_handler(proto: Any, sid: int, path: str, head: dict, body: bytes) -> None:
    """/bad.Http/<status>: that status, text/plain, no grpc-status; /bad.Goaway/<code>:
    response headers and one message, then GOAWAY(code) with this stream refused."""
    kind, arg = path.strip("/").split("/")
    conn = proto.conn
    if kind == "bad.Http":
        body_text = b"<html>bad gateway</html>"
        conn.send_headers(sid, [(b":status", arg.encode()), (b"content-type", b"text/html"),
                                (b"content-length", str(len(body_text)).encode())])
        conn.send_data(sid, body_text, end_stream=True)
        proto.flush()
    elif kind == "bad.Goaway":
        conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
        conn.send_data(sid, b"\x00\x00\x00\x00\x02hi")
        proto.flush()
        await asyncio.sleep(0.1)
        conn.close_connection(error_code=int(arg), last_stream_id=0)
        proto.flush()
        await asyncio.sleep(0.1)
        proto.transport.close()


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    lab = Lab()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=400),
                         options=GRPC_OPTIONS + BIG_METADATA)
    lab.register(server)
    lab.port = server.add_insecure_port("127.0.0.1:0")  # type: ignore[attr-defined]
    server.start()
    yield lab
    server.stop(grace=None).wait(5)


@pytest.fixture(scope="module")
def bad() -> Iterator[H2Upstream]:
    up = H2Upstream(bad_handler, "bad")
    yield up
    up.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("grpc-real-pki"))


@pytest.fixture(scope="module")
def proxy(lab: Lab, bad: H2Upstream, pki: Pki,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    config = f"""
[http]
send_timeout_ms = 60000

[[listeners]]
name = "h2c"
address = "127.0.0.1:{{h2c}}"
protocols = ["h2c"]

[[listeners]]
name = "tls"
address = "127.0.0.1:{{tls}}"
protocols = ["h2"]
tls = {{ cert = "{pki.cert}", key = "{pki.key}" }}

[[clusters]]
name = "lab"
endpoints = ["127.0.0.1:{lab.port}"]
protocol = "h2"

[[clusters]]
name = "bad"
endpoints = ["127.0.0.1:{bad.port}"]
protocol = "h2"

[[clusters]]
name = "down"
endpoints = ["127.0.0.1:{free_port()}"]
protocol = "h2"

[[routes]]
name = "health"
match = {{ grpc_service = "{HEALTH}" }}
cluster = "lab"

[[routes]]
name = "lab"
match = {{ grpc_service = "{LAB}" }}
cluster = "lab"

[[routes]]
name = "bad-http"
match = {{ grpc_service = "bad.Http" }}
cluster = "bad"

[[routes]]
name = "bad-goaway"
match = {{ grpc_service = "bad.Goaway" }}
cluster = "bad"

[[routes]]
name = "down"
match = {{ grpc_service = "down.Svc" }}
cluster = "down"
"""
    p = ProxyProc(tmp_path_factory.mktemp("grpc-real"), config, ("h2c", "tls"))
    yield p
    p.stop()


def open_channel(proxy: ProxyProc, pki: Pki, kind: str,
                 options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    target = f"127.0.0.1:{proxy.ports[kind]}"
    opts = GRPC_OPTIONS + BIG_METADATA + (options or [])
    if kind == "tls":
        creds = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
        ch = grpc.secure_channel(target, creds, options=opts)
    else:
        ch = grpc.insecure_channel(target, options=opts)
    grpc.channel_ready_future(ch).result(timeout=10)
    return ch


@pytest.fixture(params=["h2c", "tls"])
def channel(request: pytest.FixtureRequest, proxy: ProxyProc, pki: Pki) -> Iterator[grpc.Channel]:
    ch = open_channel(proxy, pki, request.param)
    yield ch
    ch.close()


def uu(ch: grpc.Channel, method: str, service: str = LAB) -> Any:
    return ch.unary_unary(f"/{service}/{method}")


def us(ch: grpc.Channel, method: str, service: str = LAB) -> Any:
    return ch.unary_stream(f"/{service}/{method}")


def su(ch: grpc.Channel, method: str) -> Any:
    return ch.stream_unary(f"/{LAB}/{method}")


def ss(ch: grpc.Channel, method: str) -> Any:
    return ch.stream_stream(f"/{LAB}/{method}")


# -- keepalive ------------------------------------------------------------------------------------


def test_keepalive_pings_do_not_get_goaway(proxy: ProxyProc, pki: Pki, lab: Lab) -> None:
    """A client asking for a keepalive PING every 50 ms (grpcio sends at most one a
    second), with and without calls in flight: within the PING budget, no GOAWAY, every
    call succeeds on one connection."""
    opts = [("grpc.keepalive_time_ms", 50), ("grpc.keepalive_timeout_ms", 1000),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_time_between_pings_ms", 50)]
    ch = open_channel(proxy, pki, "h2c", opts)
    states: list[Any] = []
    ch.subscribe(states.append)
    try:
        end = time.monotonic() + 5
        n = 0
        while time.monotonic() < end:
            assert uu(ch, "Echo")(b"k%d" % n, timeout=5) == b"k%d" % n
            n += 1
            time.sleep(0.5)
        # A long call with pings while it is in flight.
        assert uu(ch, "Echo")(b"long", metadata=[("x-sleep-ms", "1500")], timeout=5) == b"long"
    finally:
        ch.close()
    log = proxy.log()
    assert "floods" not in log, log[-3000:]
    assert grpc.ChannelConnectivity.TRANSIENT_FAILURE not in states, states
    assert states.count(grpc.ChannelConnectivity.CONNECTING) <= 1, states


# -- deadlines and cancellation ------------------------------------------------------------------


def test_deadline_reaches_upstream_and_ends_call(channel: grpc.Channel, lab: Lab,
                                                  request: pytest.FixtureRequest) -> None:
    assert uu(channel, "Echo")(b"d", timeout=7) == b"d"
    remaining = lab.deadlines[-1]
    assert remaining is not None and 5 < remaining < 7.1, remaining  # grpcio rounds up
    tag = request.node.name
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        uu(channel, "Echo")(b"d", metadata=[("x-sleep-ms", "5000"), ("x-tag", tag)],
                            timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 3
    assert lab.rec.when(f"cancelled:echo#{tag}", 3) is not None, lab.rec.names()


def test_cancel_client_stream_reaches_upstream(channel: grpc.Channel, lab: Lab,
                                               request: pytest.FixtureRequest) -> None:
    tag = request.node.name
    parts: queue.Queue = queue.Queue()
    fut = su(channel, "Upload").future(iter(parts.get, None), metadata=[("x-tag", tag)],
                                       timeout=30)
    parts.put(b"p" * 1000)
    assert lab.rec.when(f"part:upload#{tag}", 5) is not None
    fut.cancel()
    assert lab.rec.when(f"cancelled:upload#{tag}", 5) is not None, lab.rec.names()
    assert lab.rec.when(f"done:upload#{tag}", 0) is None
    parts.put(None)


def test_cancel_server_stream_reaches_upstream(channel: grpc.Channel, lab: Lab,
                                               request: pytest.FixtureRequest) -> None:
    tag = request.node.name
    call = us(channel, "Count")(b"", metadata=[("x-n", "1000"), ("x-delay-ms", "50"),
                                                ("x-tag", tag)], timeout=30)
    next(call)
    next(call)
    call.cancel()
    assert lab.rec.when(f"cancelled:count#{tag}", 5) is not None, lab.rec.names()


# -- size and concurrency ------------------------------------------------------------------------


def test_messages_above_4mib(channel: grpc.Channel) -> None:
    big = os.urandom(12 * MiB)
    assert uu(channel, "Echo")(big, timeout=60) == big
    replies = list(ss(channel, "Chat")(iter([big, big[:5 * MiB]]), timeout=60))
    assert replies == [big, big[:5 * MiB]]


def test_hundreds_of_concurrent_streams_on_one_channel(channel: grpc.Channel) -> None:
    """300 calls at once on one channel (the proxy allows 100 streams a connection;
    grpcio queues the rest), each held 300 ms by the upstream."""
    echo = uu(channel, "Echo")
    futs = [echo.future(b"c%d" % i, metadata=[("x-sleep-ms", "300")], timeout=60)
            for i in range(300)]
    assert [f.result() for f in futs] == [b"c%d" % i for i in range(300)]
    streams = [us(channel, "Count")(b"", metadata=[("x-n", "20"), ("x-size", "100")],
                                    timeout=60) for _ in range(150)]
    assert all(len(list(s)) == 20 for s in streams)


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_slow_reader_holds_back_the_upstream(proxy: ProxyProc, pki: Pki, lab: Lab,
                                             request: pytest.FixtureRequest) -> None:
    """A server stream of 2000 x 256 KiB (500 MiB) read one message a second: the
    upstream is held back by flow control (what it produced is bounded by the windows
    on the way, a few MiB) and the proxy's memory does not grow with the stream."""
    tag = request.node.name
    ch = open_channel(proxy, pki, "h2c")
    try:
        before = _rss_kb(proxy.pid)
        call = us(ch, "Count")(b"", metadata=[("x-n", "2000"), ("x-size", str(256 * 1024)),
                                               ("x-tag", tag)], timeout=60)
        for _ in range(3):
            next(call)
            time.sleep(1)
        produced = lab.produced[tag]
        grown = _rss_kb(proxy.pid) - before
        call.cancel()
    finally:
        ch.close()
    # Windows on the way: grpcio's (up to a few MiB with BDP), the proxy's stream
    # window to the upstream (1 MiB), grpcio server's buffers.
    assert produced * 256 * 1024 < 64 * MiB, produced
    assert grown < 64 * 1024, grown


# -- metadata, status, compression ---------------------------------------------------------------


def test_large_and_binary_metadata_both_ways(channel: grpc.Channel) -> None:
    n = 6000
    reply, call = uu(channel, "Echo").with_call(
        b"m", metadata=[("x-meta-bytes", str(n)), ("x-req-bin", b"\x00\xff" * 1000),
                        ("x-req-big", "r" * 6000)], timeout=10)
    assert reply == b"m"
    initial = dict(call.initial_metadata())
    assert initial["x-big"] == "i" * n and initial["x-big-bin"] == b"\xff" * n
    assert dict(call.trailing_metadata())["x-big-trailer"] == "t" * n


def test_oversized_response_metadata_fails_only_its_call(proxy: ProxyProc, pki: Pki,
                                                        lab: Lab) -> None:
    """Response metadata over max_header_bytes (the proxy's SETTINGS_MAX_HEADER_LIST_SIZE
    to the upstream, 32 KiB by default) fails that call alone, as a malformed response
    (RFC 9113 8.1.1 and 10.5.1: a stream error): another client's call streaming over
    the same upstream connection meanwhile carries on to its end."""
    victim_ch = open_channel(proxy, pki, "h2c")
    big_ch = open_channel(proxy, pki, "h2c")
    try:
        victim = us(victim_ch, "Count")(b"", metadata=[("x-n", "10"), ("x-size", "10"),
                                                       ("x-delay-ms", "100")], timeout=20)
        got = [next(victim)]
        with pytest.raises(grpc.RpcError) as info:
            uu(big_ch, "Echo")(b"m", metadata=[("x-meta-bytes", "20000")], timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert "header" in info.value.details(), info.value.details()
        got += list(victim)
        assert len(got) == 10 and victim.code() == grpc.StatusCode.OK
        assert uu(big_ch, "Echo")(b"again", timeout=10) == b"again"
    finally:
        victim_ch.close()
        big_ch.close()


def test_status_details_pass_through_intact(channel: grpc.Channel) -> None:
    details = b"\x08\x09\x12\x0cwith details\x1a\x03\x00\x01\xff" + bytes(range(256))
    with pytest.raises(grpc.RpcError) as info:
        uu(channel, "Details")(details, timeout=10)
    err = info.value
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == "with details"
    trailers = dict(err.trailing_metadata())
    assert trailers["grpc-status-details-bin"] == details
    assert trailers["x-why-bin"] == b"\x00\x80\xff"


def test_initial_metadata_before_the_first_message(channel: grpc.Channel, lab: Lab,
                                                   request: pytest.FixtureRequest) -> None:
    """The upstream holds its only message until the client has seen the initial
    metadata: a proxy that kept the headers back for the first message would have the
    call end at its deadline without them."""
    tag = request.node.name
    go = lab.hold(tag)
    call = us(channel, "Early")(b"", metadata=[("x-tag", tag), ("x-hold", "1")], timeout=10)
    try:
        metadata = dict(call.initial_metadata())
    finally:
        go.set()
    assert metadata.get("x-early") == "yes", metadata
    assert list(call) == [b"late"]


def test_gzip_both_directions(channel: grpc.Channel) -> None:
    text = b"compress me " * 10000
    reply = uu(channel, "Echo")(text, metadata=[("x-compress", "1")],
                                compression=grpc.Compression.Gzip, timeout=10)
    assert reply == text
    replies = list(ss(channel, "Chat")(iter([text, text[:100]]), metadata=[("x-compress", "1")],
                                       compression=grpc.Compression.Gzip, timeout=10))
    assert replies == [text, text[:100]]


def test_health_service(channel: grpc.Channel) -> None:
    assert uu(channel, "Check", HEALTH)(b"", timeout=5) == b"\x08\x01"
    assert list(us(channel, "Watch", HEALTH)(b"", timeout=5)) == [b"\x08\x01", b"\x08\x02"]


# -- failing upstreams ---------------------------------------------------------------------------


def test_upstream_down_is_unavailable_with_a_message(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary("/down.Svc/M")(b"", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "refused" in info.value.details() or "connect" in info.value.details(), \
        info.value.details()


@pytest.mark.parametrize("status,code", [
    (400, grpc.StatusCode.INTERNAL), (401, grpc.StatusCode.UNAUTHENTICATED),
    (403, grpc.StatusCode.PERMISSION_DENIED), (404, grpc.StatusCode.UNIMPLEMENTED),
    (429, grpc.StatusCode.UNAVAILABLE), (502, grpc.StatusCode.UNAVAILABLE),
    (503, grpc.StatusCode.UNAVAILABLE), (504, grpc.StatusCode.UNAVAILABLE),
    (500, grpc.StatusCode.UNKNOWN)])
def test_upstream_http_status_maps_to_grpc(channel: grpc.Channel, status: int,
                                           code: grpc.StatusCode) -> None:
    """gRPC's http-grpc-status-mapping.md: an upstream that answers an HTTP error
    without grpc-status (a load balancer's error page)."""
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(f"/bad.Http/{status}")(b"", timeout=10)
    assert info.value.code() == code, info.value


@pytest.mark.parametrize("code", [0, 2], ids=["no_error", "internal_error"])
def test_upstream_goaway_mid_stream(channel: grpc.Channel, code: int) -> None:
    """GOAWAY(last stream 0) after the response headers and a message: the stream was
    not processed as far as HTTP/2 is concerned, but the client has a message; the call
    must end with an error status, never hang or read as OK."""
    call = us(channel, str(code), "bad.Goaway")(b"", timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL), \
        info.value


@pytest.fixture(scope="module")
def short_read_proxy(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    config = f"""
[[listeners]]
name = "h2c"
address = "127.0.0.1:{{h2c}}"
protocols = ["h2c"]

[[clusters]]
name = "lab"
endpoints = ["127.0.0.1:{lab.port}"]
protocol = "h2"
read_timeout_ms = 400

[[routes]]
name = "lab"
cluster = "lab"
"""
    p = ProxyProc(tmp_path_factory.mktemp("grpc-short-read"), config, ("h2c",))
    yield p
    p.stop()


def test_upstream_read_timeout_after_headers_is_a_status(short_read_proxy: ProxyProc,
                                                         pki: Pki, lab: Lab,
                                                         request: pytest.FixtureRequest) -> None:
    """The upstream sent its response headers, then nothing for longer than
    read_timeout_ms: the call ends with grpc-status trailers naming the timeout (as a
    deadline does), not an RST_STREAM(INTERNAL_ERROR) a client reads as INTERNAL, and
    the upstream's call is cancelled."""
    tag = request.node.name
    ch = open_channel(short_read_proxy, pki, "h2c")
    try:
        call = us(ch, "Early")(b"", metadata=[("x-tag", tag)], timeout=10)
        assert dict(call.initial_metadata())["x-early"] == "yes"
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    finally:
        ch.close()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
    assert "read_timeout_ms" in info.value.details(), info.value.details()
    assert lab.rec.when(f"cancelled:early#{tag}", 3) is not None, lab.rec.names()
