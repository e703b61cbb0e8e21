"""An upstream that stops reading a request body: the 504 "upstream stopped reading the
request body" comes read_timeout_ms after the body stopped moving, not up to one more
timer period later. Real proxy process, a real socket upstream that never reads the body,
a real client socket that keeps sending."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.conftest import simple_config

pytestmark = pytest.mark.timeout(60)

READ_TIMEOUT_MS = 1500


class DeafUpstream:
    """Takes a connection, reads the request head, then reads nothing more (its small
    receive buffer fills at once) and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.head_at: float | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
            self.conns.append(conn)
            head = b""
            while b"\r\n\r\n" not in head:
                data = conn.recv(1024)
                if not data:
                    break
                head += data
            self.head_at = time.monotonic()

    def stop(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def deaf() -> Iterator[DeafUpstream]:
    up = DeafUpstream()
    yield up
    up.stop()


def test_stalled_upload_gets_504_after_read_timeout(start_proxy, deaf):
    # read_timeout_ms is the shortest timeout, so it is also the connection timer's
    # period (Runtime.min_timeout).
    proxy = start_proxy("[server]\nworkers = 1\ndrain_timeout_ms = 1000\n"
                        + simple_config(deaf.port,
                                        cluster_extra=f"read_timeout_ms = {READ_TIMEOUT_MS}"))
    total = 1 << 30
    client = socket.create_connection(("127.0.0.1", proxy.port))
    client.sendall(b"POST /upload HTTP/1.1\r\nHost: test\r\n"
                   b"Content-Type: application/octet-stream\r\n"
                   b"Content-Length: %d\r\n\r\n" % total)
    last_sent = [time.monotonic()]
    stalled_at: list[float] = []  # the last send before the first that could not go
    stop = threading.Event()

    def send() -> None:
        chunk = b"x" * 65536
        client.settimeout(0.05)
        while not stop.is_set():
            try:
                client.send(chunk)
                last_sent[0] = time.monotonic()
            except TimeoutError:  # the proxy stopped reading: the buffers are full
                if not stalled_at:
                    stalled_at.append(last_sent[0])
                continue
            except OSError:
                return

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        got = b""
        deadline = time.monotonic() + 15
        while b"\r\n\r\n" not in got and time.monotonic() < deadline:
            # the sender's timeout applies to this socket too; retry on it
            try:
                data = client.recv(65536)
            except TimeoutError:
                continue
            if not data:
                break
            got += data
        answered = time.monotonic()
    finally:
        stop.set()
        sender.join(5)
        client.close()
    assert got.startswith(b"HTTP/1.1 504 "), got[:300]
    assert b"upstream stopped reading the request body" in got
    # The body stopped moving (the client's last send before it blocked) read_timeout_ms
    # before the 504, give or take scheduling; not a whole timer period (another
    # read_timeout_ms here) later. The slack is for a loaded 2-core CI machine.
    assert stalled_at
    waited = answered - stalled_at[0]
    assert READ_TIMEOUT_MS / 1000 - 0.2 <= waited <= READ_TIMEOUT_MS / 1000 + 0.9, waited
