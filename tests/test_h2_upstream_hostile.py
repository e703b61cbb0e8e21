"""An HTTP/2 upstream that breaks RFC 9113 in ways the `h2` library would never send,
played frame by frame by tests/h2_raw_upstream.py, with the proxy in front of it driven
by real clients (httpx, aiohttp)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import aiohttp
import httpx
import pytest
from hyperframe.frame import GoAwayFrame, PingFrame, RstStreamFrame, WindowUpdateFrame

from aiproxy.protocols.h2_budgets import CONTROL_BUDGET, UNSENT_ACKS_LIMIT
from tests.conftest import Proxy
from tests.h2_raw_upstream import RawConn, RawUpstream
from tests.h2_support import wait_for

pytestmark = pytest.mark.timeout(60)

OK = [(b":status", b"200"), (b"content-type", b"text/plain")]


def config(port: int) -> str:
    return f"""
[server]
workers = 1

[[clusters]]
name = "up"
protocol = "h2"
endpoints = ["127.0.0.1:{port}"]

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
"""


# -- RFC 9113 8.1.1: a malformed response is a stream error ------------------------------------

MALFORMED = {
    # a complete response in one HEADERS frame (END_STREAM) with a connection-specific field
    "head_with_end_stream": lambda c, sid: c.send(
        c.headers(sid, OK + [(b"connection", b"close")], end=True)),
    "pseudo_field_in_trailers": lambda c, sid: c.send(
        c.headers(sid, OK), c.data(sid, b"body"), c.headers(sid, [(b":status", b"200")], end=True)),
    "connection_field_in_trailers": lambda c, sid: c.send(
        c.headers(sid, OK), c.data(sid, b"body"), c.headers(sid, [(b"keep-alive", b"1")], end=True)),
    "uppercase_name_in_trailers": lambda c, sid: c.send(
        c.headers(sid, OK), c.data(sid, b"body"), c.headers(sid, [(b"X-Trailer", b"1")], end=True)),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_response_fails_its_own_stream_only(
    start_proxy: Callable[..., Proxy], case: str
) -> None:
    """RFC 9113 8.1.1: a malformed response is a stream error (PROTOCOL_ERROR), as
    nghttp2 (Envoy) treats one: the other clients' requests sharing the upstream
    connection go on. A field block ending the stream (END_STREAM: a whole response in
    one HEADERS frame, or trailers) must not be made a connection error that fails them."""
    first_in, done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def script(c: RawConn) -> None:
        c.handshake()
        other, _, _ = c.request()
        first_in.set()
        bad, _, _ = c.request()
        MALFORMED[case](c, bad)
        c.send(c.headers(other, OK + [(b"content-length", b"5")]), c.data(other, b"other", True))
        sid, _, _ = c.request()  # the connection is still in use
        c.send(c.headers(sid, OK + [(b"content-length", b"5")]), c.data(sid, b"third", True))
        seen["goaway"] = c.until(lambda f: isinstance(f, GoAwayFrame), 0.5)
        done.set()

    up = RawUpstream(script)
    try:
        proxy = start_proxy(config(up.port))
        result: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: result.setdefault(
            "other", httpx.post(proxy.url + "/other", content=b"x", timeout=10)))
        t.start()
        assert first_in.wait(10)
        # POST: not replayed, so the outcome of this very response is what the client sees.
        with httpx.Client(timeout=10) as client:
            try:
                r = client.post(proxy.url + "/bad", content=b"y")
            except (httpx.RemoteProtocolError, httpx.ReadError):
                # The head went out: the body is cut short, never ended cleanly (a
                # close the client reads as EOF mid-body, or as a reset).
                pass
            else:
                assert r.status_code == 502, (r.status_code, r.content)
                assert r.json()["error"]["code"] == "upstream_bad_response", r.text
        t.join(15)
        other = result["other"]
        assert other.status_code == 200 and other.content == b"other", other.content
        third = httpx.get(proxy.url + "/third", timeout=10)
        assert third.status_code == 200 and third.content == b"third"
        assert done.wait(10) and len(up.conns) == 1
        assert seen["goaway"] is None, seen
        assert not up.errors, up.errors
    finally:
        up.stop()


# -- RFC 9113 8.1: a response complete before the request ----------------------------------------


def stream_end(conn: RawConn, sid: int, timeout: float = 5.0) -> str | None:
    """How the proxy ended its side of stream sid: "end" (END_STREAM), "reset" or None
    (neither within timeout). A new stream meanwhile is over the limit of one (RFC 9113
    5.1.2) and refused, as a real server would."""
    def over(f: object) -> bool:
        new = getattr(f, "stream_id", 0)
        if hasattr(f, "decoded") and new != sid:
            conn.send(conn.rst(new, 0x7))  # REFUSED_STREAM
        return new == sid and (
            isinstance(f, RstStreamFrame) or "END_STREAM" in getattr(f, "flags", ()))
    f = conn.until(over, timeout)
    if f is None:
        return None
    return "reset" if isinstance(f, RstStreamFrame) else "end"


def early_responder(ends: list[str | None]) -> Callable[[RawConn], None]:
    """Answers each request whole as soon as its HEADERS arrive (RFC 9113 8.1 allows it)
    and records how the proxy then ends its side of the stream. Its windows are small
    (1000 bytes), so a request body is never all sent when the response ends, and it
    allows one stream at a time (5.1.2: a half-closed stream still counts)."""
    def script(c: RawConn) -> None:
        c.handshake(settings={0x3: 1, 0x4: 1000})
        while True:
            try:
                sid, _, _ = c.request(timeout=15)
            except TimeoutError:
                return
            c.send(c.headers(sid, OK + [(b"content-length", b"5")]), c.data(sid, b"early", True))
            ends.append(stream_end(c, sid))
    return script


def test_request_body_left_unsent_after_a_complete_response_resets_the_stream(
    start_proxy: Callable[..., Proxy]
) -> None:
    """A response complete while the request body is still being sent (a client still
    uploading, or body bytes the proxy holds waiting for the upstream's window): the
    proxy forwards no more of it, so it must end the stream upstream with RST_STREAM.
    Left half-closed, the stream counts against the upstream's
    SETTINGS_MAX_CONCURRENT_STREAMS for as long as the connection lives (RFC 9113
    5.1.2), until the upstream refuses every new one."""
    ends: list[str | None] = []
    up = RawUpstream(early_responder(ends))
    try:
        proxy = start_proxy(config(up.port))

        async def uploads() -> list[tuple[int, bytes]]:
            out = []
            async with aiohttp.ClientSession() as session:
                for _ in range(2):
                    answered = asyncio.Event()

                    async def body(answered: asyncio.Event = answered) -> AsyncIterator[bytes]:
                        yield b"a" * 4000
                        await answered.wait()  # still uploading when the response comes

                    async with session.post(proxy.url + "/up", data=body(),
                                            headers={"content-length": "100000"}) as r:
                        out.append((r.status, await r.read()))
                        answered.set()
            return out

        assert asyncio.run(uploads()) == [(200, b"early")] * 2
        # The whole body read by the proxy (keep-alive), but not all sent upstream.
        with httpx.Client(timeout=10) as client:
            for _ in range(2):
                r = client.post(proxy.url + "/up", content=b"b" * 20000)
                assert (r.status_code, r.content) == (200, b"early")
        # The upstream's thread records each RST_STREAM as it reads it: the last one may
        # still be in flight when the client has its response.
        wait_for(lambda: len(ends) >= 4, 10)
        assert ends == ["reset"] * 4, ends
        assert len(up.conns) == 1 and not up.errors, up.errors
    finally:
        up.stop()


# -- RFC 9113 6.5.3 and CVE-2019-9512/9515: the proxy's own frames an upstream ignores ---------


def test_upstream_that_never_acks_our_settings_gets_goaway(
    start_proxy: Callable[..., Proxy]
) -> None:
    """RFC 9113 6.5.3: an upstream that never acknowledges the proxy's SETTINGS gets
    GOAWAY(SETTINGS_TIMEOUT) within read_timeout_ms (at most 10 s, nghttpx's
    backend settings timeout), and the request on it fails with a 502. It used to be
    kept (and its request held) for as long as it stayed silent."""
    seen: dict[str, object] = {}

    def script(c: RawConn) -> None:
        c.handshake(ack=False)
        c.request()
        seen["goaway"] = c.until(lambda f: isinstance(f, GoAwayFrame), 15)

    up = RawUpstream(script)
    try:
        proxy = start_proxy(config(up.port).replace(
            'protocol = "h2"', 'protocol = "h2"\nread_timeout_ms = 500'))
        r = httpx.get(proxy.url + "/x", timeout=20)
        assert r.status_code == 502, (r.status_code, r.text)
        message = r.json()["error"]["message"]
        assert "SETTINGS" in message and str(up.port) not in message, r.text  # log only
        assert f"127.0.0.1:{up.port} did not acknowledge our SETTINGS" in proxy.log()
        wait_for(lambda: "goaway" in seen, 10)
        goaway = seen["goaway"]
        assert isinstance(goaway, GoAwayFrame) and goaway.error_code == 0x4, goaway
        assert not up.errors, up.errors
    finally:
        up.stop()


def test_ping_acks_an_upstream_does_not_read_are_capped(
    start_proxy: Callable[..., Proxy]
) -> None:
    """CVE-2019-9512 from the upstream side: an upstream that stops reading (here an
    upload it grants a huge window to fills the socket) and sends PINGs below the
    PING/SETTINGS budget's rate could have their ACKs pile up in the proxy's output for
    as long as the connection lived. Past UNSENT_ACKS_LIMIT ACKs waiting there the proxy
    drops the connection (GOAWAY(ENHANCE_YOUR_CALM), which it cannot read either): the
    upstream, reading again, comes to its end. Kept, it would get the rest of the upload
    and then nothing, the connection open."""
    ping = PingFrame(0, opaque_data=b"12345678").serialize()
    seen: dict[str, int | bool] = {}

    def script(c: RawConn) -> None:
        c.handshake(settings={0x4: 2**31 - 1})
        c.send(WindowUpdateFrame(0, window_increment=2**31 - 1 - 65535))
        c.request()
        time.sleep(1.0)  # the upload fills the socket buffers and the proxy's output
        sent, cut = 0, False
        while sent + 16 <= CONTROL_BUDGET - 100 and not cut:
            cut = not c.send(ping * 16)
            sent += 16
            time.sleep(0.05)
        seen.update(sent=sent, cut=cut or _reads_to_eof(c.sock, 10))

    def body() -> Iterator[bytes]:
        chunk = b"u" * (1 << 16)
        for _ in range(2048):  # 128 MiB, far more than the socket buffers hold
            yield chunk

    up = RawUpstream(script)
    try:
        proxy = start_proxy(config(up.port))
        t = threading.Thread(target=lambda: _post_ignoring_errors(proxy.url + "/up", body()),
                             daemon=True)
        t.start()
        assert wait_for(lambda: "cut" in seen, 30), seen
        assert seen["cut"], f"still connected after {seen['sent']} PINGs it did not read the ACKs of"
        assert int(seen["sent"]) > UNSENT_ACKS_LIMIT
        assert "does not read the ACKs" in proxy.log()
        assert not up.errors, up.errors
    finally:
        up.stop()


def _reads_to_eof(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer ends the connection (EOF or reset) within timeout, read raw."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(1 << 20):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


def _post_ignoring_errors(url: str, content: Iterator[bytes]) -> None:
    try:
        httpx.post(url, content=content, timeout=30)
    except httpx.HTTPError:
        pass
