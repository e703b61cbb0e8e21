"""A TLS client that ends its side with close_notify while the proxy still has response
data for it: uvloop's TLS transport closes at once (is_closing()) but connection_lost()
comes only once what was written before has drained, and every write in between is
dropped with a "SSL connection is closed" warning past the fifth. The proxy must not
write then: under load, clients that leave mid-response filled the log with it."""

from __future__ import annotations

import shutil
import socket
import ssl
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.settings
import pytest

from tests.conftest import simple_config
from tests.h2_support import client_tls, make_pki

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl"),
]


def _leave_with_close_notify(port: int, window: int) -> None:
    """Over h2: a download with a `window`-byte flow-control window that the client does
    not read (the proxy's socket buffer holds what the kernel does not) and an event
    stream beside it; then close_notify, and the socket stays open a while unread."""
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", port))
    s = client_tls().wrap_socket(raw, server_hostname="localhost")
    try:
        c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        c.initiate_connection()
        c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        c.increment_flow_control_window(window)
        for sid, path in ((1, f"/bytes/{window}"), (3, "/sse?n=300&delay_ms=5")):
            c.send_headers(sid, [(":method", "GET"), (":path", path), (":scheme", "https"),
                                 (":authority", "localhost")], end_stream=True)
        s.sendall(c.data_to_send())
        time.sleep(0.3)  # the download fills the socket buffers, the events flow
        s.settimeout(0.2)
        try:
            s.unwrap()  # sends close_notify; the proxy's reply waits behind its data
        except (ssl.SSLError, OSError):
            pass
        time.sleep(1.0)  # events keep coming from the upstream meanwhile
    finally:
        s.close()


def test_no_writes_to_a_tls_transport_the_client_closed(start_proxy, demo_upstream,
                                                        tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    proxy = start_proxy(
        simple_config(demo_upstream),
        listener_extra=f'protocols = ["h2", "http1"]\n'
                       f'tls = {{ cert = "{pki.cert}", key = "{pki.key}" }}\n')
    # How much the kernel takes in before the proxy's own buffer holds the rest varies:
    # several sizes, so that one of them leaves the proxy's writes unpaused.
    for window in (1 << 20, 2 << 20, 3 << 20, 4 << 20, 6 << 20):
        _leave_with_close_notify(proxy.port, window)
    time.sleep(0.5)
    log = proxy.log()
    assert "SSL connection is closed" not in log, log[-3000:]
