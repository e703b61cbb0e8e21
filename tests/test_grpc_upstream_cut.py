"""A gRPC call whose upstream (HTTP/1.1 or HTTP/2) promises a content-length and then
closes the connection mid-body. gRPC's PROTOCOL-HTTP2.md: a call ends with a
grpc-status, and the proxy has no status 0 to give for a response it could not finish:
the client gets UNAVAILABLE (14, what a lost connection maps to) and never a body
shorter than a content-length the proxy passed on (RFC 9113 8.1.1: malformed).
A real grpcio client checks the status; a raw HTTP/2 client checks the wire form."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hyperframe.frame import DataFrame

from tests.h2_support import FrameClient, H2Upstream, ProxyProc
from tests.support import StreamServerThread

pytestmark = pytest.mark.timeout(60)

MSG = b"\x00\x00\x00\x00\x20" + b"m" * 32  # one gRPC message of 32 bytes: 37 on the wire


async def h1_cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """/cut.H1/Late: head, 10 body bytes of 37, close. /cut.H1/Early: head, close.
    /cut.H1/None: close without a response."""
    head = await reader.readuntil(b"\r\n\r\n")
    if b"/None " in head:
        writer.close()
        return
    body = b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ncontent-length: 37\r\n\r\n"
    if b"/Late " in head:
        body += MSG[:10]
    writer.write(body)
    await writer.drain()
    if b"/Late " in head:
        await asyncio.sleep(0.2)  # the head and the first bytes reach the client first
    writer.close()


async def h2_cut(proto: Any, sid: int, path: str, head: dict, body: bytes) -> None:
    """/cut.H2/Late and /cut.H2/Early: the same over HTTP/2, then the connection drops."""
    proto.conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc"),
                                  (b"content-length", b"37")])
    if path.endswith("/Late"):
        proto.conn.send_data(sid, MSG[:10])
        proto.flush()
        await asyncio.sleep(0.2)
    proto.flush()
    proto.transport.close()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProc]:
    h1 = StreamServerThread(h1_cut)
    h2 = H2Upstream(h2_cut, "h2-cut")
    config = f"""
[[listeners]]
name = "h2c"
address = "127.0.0.1:{{h2c}}"
protocols = ["h2c"]

[[listeners]]
name = "mixed"
address = "127.0.0.1:{{mixed}}"
protocols = ["http1", "h2c"]

[[clusters]]
name = "h1"
endpoints = ["127.0.0.1:{h1.port}"]

[[clusters]]
name = "h2"
endpoints = ["127.0.0.1:{h2.port}"]
protocol = "h2"

[[routes]]
name = "h1"
match = {{ grpc_service = "cut.H1" }}
cluster = "h1"

[[routes]]
name = "h2"
match = {{ grpc_service = "cut.H2" }}
cluster = "h2"
"""
    p = ProxyProc(tmp_path_factory.mktemp("grpc-cut"), config, ("h2c", "mixed"))
    yield p
    p.stop()
    h1.close()
    h2.stop()


CASES = ["/cut.H1/None", "/cut.H1/Early", "/cut.H1/Late", "/cut.H2/Early", "/cut.H2/Late"]
# "h2c" serves HTTP/2 only; "mixed" serves HTTP/1.1 and takes HTTP/2 prior knowledge on
# the same port: a gRPC call must end the same way on both.
LISTENERS = ["h2c", "mixed"]


@pytest.mark.parametrize("listener", LISTENERS)
@pytest.mark.parametrize("path", CASES)
def test_grpcio_client_gets_unavailable(proxy: ProxyProc, path: str, listener: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{proxy.ports[listener]}") as ch:
        call = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(b"\x0a\x01x", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value


@pytest.mark.parametrize("listener", LISTENERS)
@pytest.mark.parametrize("path", CASES)
def test_wire_form(proxy: ProxyProc, path: str, listener: str) -> None:
    """No content-length goes on with a gRPC response the proxy may have to end
    itself; the call ends with grpc-status 14 and a grpc-message in trailers once the
    response headers went out (the HEADERS frame cannot be taken back: HPACK state), as
    one trailers-only HEADERS frame when no response came at all."""
    with FrameClient(proxy.ports[listener]) as c:
        c.handshake()
        head = c.request(1, path, "POST", [("content-type", "application/grpc"),
                                            ("te", "trailers")], end_stream=False)
        data = DataFrame(1, data=b"\x00\x00\x00\x00\x03\x0a\x01x")
        data.flags.add("END_STREAM")
        c.send(head, data)
        resp = c.response(1, timeout=10)
    assert resp.reset is None, resp
    fields = dict(resp.headers)
    assert fields[b":status"] == b"200", resp
    assert b"content-length" not in fields, resp
    end = resp.trailers if resp.trailers is not None else resp.headers
    assert (b"grpc-status", b"14") in end, resp
    assert any(name == b"grpc-message" and value for name, value in end), resp
    if path.endswith("/None"):
        assert resp.trailers is None and not resp.body, resp  # trailers-only
    else:
        assert resp.trailers is not None, resp
