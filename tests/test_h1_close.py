"""How an HTTP/1.1 connection ends after a `Connection: close` response: with bytes of
the client's still behind that request (pipelined), a plain close would answer the next
bytes the client sends with RST, and Linux drops received data a RST arrives behind, so
the client could lose the response it was answered (nginx's lingering_close). The proxy
sends FIN, reads and drops what still comes, and closes when the client does."""

from __future__ import annotations

import socket
import time

import h11

from tests.conftest import simple_config


def _peek_until(s: socket.socket, marker: bytes, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while marker not in s.recv(65536, socket.MSG_PEEK):
        assert time.monotonic() < deadline, "no response"
        time.sleep(0.01)


def test_close_with_pipelined_bytes_behind_does_not_reset(start_proxy, demo_upstream):
    proxy = start_proxy(simple_config(demo_upstream))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"GET /echo HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
                  b"GET /echo HTTP/1.1\r\nHost: a\r\n\r\n")
        _peek_until(s, b'"path"')  # the whole response is here, not read yet
        s.sendall(b"GET /more HTTP/1.1\r\nHost: a\r\n\r\n")  # a closed socket would RST this
        time.sleep(0.3)  # for that RST to come back, if it comes
        data = b""
        while chunk := s.recv(65536):  # ConnectionResetError: the response was lost
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 ") and b"connection: close" in data.lower()
    assert data.count(b"HTTP/1.1 ") == 1  # the pipelined request was not answered


def test_big_response_then_close_survives_bytes_the_client_sends_after(start_proxy,
                                                                        demo_upstream):
    """The response is still in the proxy's socket when its handler is done (the client
    has not read it): a close() then orphans the socket, and the bytes the client sends
    next draw a RST that drops what was not sent yet."""
    size = 16 * 1024 * 1024
    proxy = start_proxy(simple_config(demo_upstream))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.sendall(f"GET /bytes/{size} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
                  "GET /echo HTTP/1.1\r\nHost: a\r\n\r\n".encode())
        time.sleep(1.5)  # the proxy takes the whole body from the upstream meanwhile
        s.sendall(b"GET /more HTTP/1.1\r\nHost: a\r\n\r\n")
        time.sleep(0.3)
        data = b""
        while chunk := s.recv(1 << 20):  # ConnectionResetError: the response was cut
            data += chunk
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "a")]))
    conn.receive_data(data)
    conn.receive_data(b"")
    events = []
    while (ev := conn.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
        events.append(ev)
        if isinstance(ev, h11.ConnectionClosed):
            break
    assert events[0].status_code == 200
    assert sum(len(e.data) for e in events if isinstance(e, h11.Data)) == size
    assert any(isinstance(e, h11.EndOfMessage) for e in events)  # not cut short
