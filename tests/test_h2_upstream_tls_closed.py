"""A TLS HTTP/2 upstream that ends its side with close_notify while the proxy still has
request data for it: uvloop's TLS transport is closing at once (is_closing()) but
connection_lost() comes only once what was written before has drained, and every write
in between is dropped with a "SSL connection is closed" warning past the fifth. The
proxy must not write then (as h2_server does not to its clients)."""

from __future__ import annotations

import shutil
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hyperframe.frame import RstStreamFrame, WindowUpdateFrame

from tests.conftest import Proxy
from tests.h2_raw_upstream import RawConn, RawUpstream
from tests.h2_support import FrameClient, make_pki

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl"),
]

UPLOADS = 4     # HTTP/1.1 clients whose uploads fill the upstream connection's output
STREAMS = 10    # HTTP/2 client streams reset once the upstream sent close_notify


def test_no_writes_to_a_tls_upstream_that_sent_close_notify(
    start_proxy: Callable[..., Proxy], tmp_path: Path
) -> None:
    pki = make_pki(tmp_path / "pki")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki.cert, pki.key)
    ctx.set_alpn_protocols(["h2"])
    all_in, notified = threading.Event(), threading.Event()

    def script(c: RawConn) -> None:
        c.sock = ctx.wrap_socket(c.sock, server_side=True)
        c.handshake(settings={0x4: 2**31 - 1})
        c.send(WindowUpdateFrame(0, window_increment=2**31 - 1 - 65535))
        for _ in range(UPLOADS + STREAMS):
            c.request()
        all_in.set()
        time.sleep(0.5)  # the uploads fill the socket buffers and the proxy's output
        c.sock.settimeout(0.2)
        try:
            c.sock.unwrap()  # close_notify; the proxy's answer waits behind its data
        except (ssl.SSLError, OSError):
            pass
        notified.set()
        time.sleep(3)  # open, unread, while the clients leave

    up = RawUpstream(script)
    try:
        proxy = start_proxy(listener_extra='protocols = ["http1", "h2c"]', body=f"""
[server]
workers = 1

[[clusters]]
name = "up"
protocol = "h2"
endpoints = ["127.0.0.1:{up.port}"]
tls = {{ ca = "{pki.ca}", sni = "localhost" }}

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
cluster = "up"
""")
        h2c = FrameClient(proxy.port)
        h2c.handshake()
        for i in range(STREAMS):
            h2c.send(h2c.request(1 + 2 * i, "/open", "POST", end_stream=False))
        clients = []
        for _ in range(UPLOADS):
            s = socket.create_connection(("127.0.0.1", proxy.port))
            s.sendall(b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            clients.append(s)
        chunk = b"10000\r\n" + b"u" * 0x10000 + b"\r\n"
        deadline = time.monotonic() + 20
        while not notified.is_set() and time.monotonic() < deadline:
            for s in clients:  # uploads that go on until the proxy stops taking them
                s.setblocking(False)
                try:
                    s.send(chunk)
                except OSError:
                    pass
            time.sleep(0.01)
        assert all_in.is_set() and notified.is_set()
        for i in range(STREAMS):  # each reset reaches the upstream's stream as a write
            h2c.send(RstStreamFrame(1 + 2 * i, error_code=0x8))
            time.sleep(0.05)
        time.sleep(1.0)
        h2c.close()
        for s in clients:
            s.close()
        log = proxy.log()
        assert "SSL connection is closed" not in log, log[-3000:]
        assert not up.errors, up.errors
    finally:
        up.stop()
