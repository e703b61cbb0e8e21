"""An upstream whose gzip body does not decode (found by fuzzing with a scripted
upstream): the redaction filter cannot read it, which is the upstream's fault, not the
proxy's. The client gets 502 upstream_bad_response while none of the response has gone
out, a cut response after that, and the proxy logs a warning, not a traceback."""

from __future__ import annotations

import asyncio
import gzip
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import simple_config
from tests.support import StreamServerThread, read_request

pytestmark = pytest.mark.timeout(60)

TEXT = b'{"content": "' + b"card 4111 1111 1111 1111 " * 40 + b'"}'
BODIES = {
    "/not-gzip": b"this is not gzip data at all",
    "/cut-gzip": gzip.compress(TEXT)[:-20],  # the first bytes decode, the end is missing
    "/gzip": gzip.compress(TEXT),
}


async def _coded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while (req := await read_request(reader)) is not None:
        body = BODIES[req[1]]
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
    writer.close()


@pytest.fixture(scope="module")
def coded_upstream() -> Iterator[int]:
    upstream = StreamServerThread(_coded)
    yield upstream.port
    upstream.close()


def _raw(port: int, path: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def test_undecodable_gzip_body_is_a_502_and_no_traceback(start_proxy, coded_upstream):
    proxy = start_proxy(simple_config(coded_upstream) + "\n[redact]\n",
                        'protocols = ["http1", "h2c"]')
    with httpx.Client(timeout=10) as c:
        r = c.get(f"{proxy.url}/not-gzip")
        assert r.status_code == 502, r.content
        assert r.json()["error"]["code"] == "upstream_bad_response", r.text
        assert c.get(f"{proxy.url}/not-gzip").status_code == 502
    # HTTP/2 sends the response head at once: the stream is reset; the connection serves on.
    with httpx.Client(timeout=10, http2=True, http1=False) as c:
        with pytest.raises(httpx.RemoteProtocolError, match="StreamReset"):
            c.get(f"{proxy.url}/not-gzip")
        r = c.get(f"{proxy.url}/gzip")
        assert r.status_code == 200 and b"**** **** **** 1111" in r.content, r.content[:200]
    # Decoded text went out before the stream turned out cut: the response is cut too
    # (no last chunk), never ended as if complete.
    got = _raw(proxy.port, "/cut-gzip")
    assert got.startswith(b"HTTP/1.1 200 "), got[:200]
    assert b"4111 1111" not in got and not got.endswith(b"0\r\n\r\n"), got[-200:]
    log = proxy.log()
    assert "gzip" in log and "Traceback" not in log, log[-3000:]
